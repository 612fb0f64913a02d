// host_decode_attention (Note [Attention on the host]): one query per sequence and head over
// token-major K/V rows, against a double-precision softmax, for fp32 and bf16 rows, grouped
// heads (groups of 4, fewer, more), a batch, a key range starting past 0 (a window), ranges
// shorter than a block and one thread per key, any number of threads, a head_dim not a multiple
// of the vector width, rows long enough to shorten the blocks; calls from several threads at
// once (Note [Attention's thread pool]); misuse is refused naming the values.
#include "test_util.h"

#include <reviva/host_attention.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace reviva::test {
namespace {

std::uint16_t to_bf16(float f) {  // (round to nearest even)
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<std::uint16_t>(bits >> 16);
}

float from_bf16(std::uint16_t v) {
  const std::uint32_t bits = static_cast<std::uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

struct Case {
  HostAttentionShape shape;
  std::size_t tokens, first, last;
  int threads;
  bool bf16;
};

// The rows (as floats, already rounded to bf16 where the case stores bf16) and their softmax in
// double: out[b][h][d].
std::vector<double> reference(const Case& c, const std::vector<float>& rows,
                              const std::vector<float>& q, float scale) {
  const auto& s = c.shape;
  const std::size_t row = 2 * s.batch * s.kv_heads * s.head_dim;
  std::vector<double> out(s.batch * s.heads * s.head_dim, 0.0);
  for (std::size_t b = 0; b < s.batch; ++b) {
    for (std::size_t h = 0; h < s.heads; ++h) {
      const std::size_t g = h / (s.heads / s.kv_heads);
      std::vector<double> score;
      double top = -1e300;
      for (std::size_t t = c.first; t < c.last; ++t) {
        const float* k = rows.data() + t * row + (b * s.kv_heads + g) * s.head_dim;
        double dot = 0;
        for (std::size_t d = 0; d < s.head_dim; ++d)
          dot += double(q[(b * s.heads + h) * s.head_dim + d]) * k[d];
        score.push_back(dot * scale);
        top = std::max(top, score.back());
      }
      double sum = 0;
      for (double& x : score) sum += (x = std::exp(x - top));
      for (std::size_t t = c.first; t < c.last; ++t) {
        const float* v = rows.data() + t * row + s.batch * s.kv_heads * s.head_dim +
                         (b * s.kv_heads + g) * s.head_dim;
        for (std::size_t d = 0; d < s.head_dim; ++d)
          out[(b * s.heads + h) * s.head_dim + d] += score[t - c.first] / sum * v[d];
      }
    }
  }
  return out;
}

void check(const Case& c) {
  const auto& s = c.shape;
  std::mt19937 gen(static_cast<unsigned>(c.tokens * 7 + c.first + c.shape.head_dim));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::size_t n = c.tokens * 2 * s.batch * s.kv_heads * s.head_dim;
  std::vector<float> rows(n);
  std::vector<std::uint16_t> rows_bf16(n);
  for (std::size_t i = 0; i < n; ++i) {
    rows[i] = 2.0f * normal(gen);  // (peaked enough that the softmax is not uniform)
    rows_bf16[i] = to_bf16(rows[i]);
    if (c.bf16) rows[i] = from_bf16(rows_bf16[i]);
  }
  std::vector<float> q(s.batch * s.heads * s.head_dim);
  for (float& x : q) x = normal(gen);
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  std::vector<float> out(q.size(), -1.0f);
  host_decode_attention(c.bf16 ? static_cast<const void*>(rows_bf16.data()) : rows.data(),
                        c.bf16 ? RowType::BFloat16 : RowType::Float32, s, c.first, c.last, q.data(),
                        scale, out.data(), c.threads);
  const std::vector<double> want = reference(c, rows, q, scale);
  double err = 0, norm = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    err += (out[i] - want[i]) * (out[i] - want[i]);
    norm += want[i] * want[i];
  }
  EXPECT_LT(std::sqrt(err / norm), 1e-5)
      << "tokens " << c.tokens << " [" << c.first << ", " << c.last << ") threads " << c.threads
      << (c.bf16 ? " bf16" : " fp32");
}

TEST(HostAttention, MatchesTheSoftmaxInDoubleForEveryLayoutAndThreadCount) {
  const HostAttentionShape gqa{2, 2, 6, 64};    // batch 2, 2 kv heads of 3 queries each
  const HostAttentionShape one{1, 8, 32, 128};  // the 8B shape's heads
  for (bool bf16 : {false, true}) {
    for (int threads : {1, 3, 8}) {
      check({gqa, 1000, 0, 1000, threads, bf16});
      check({gqa, 1000, 300, 1000, threads, bf16});  // a window: keys from 300 on
      check({gqa, 1000, 990, 995, threads, bf16});   // shorter than a block
      check({one, 777, 0, 777, threads, bf16});
    }
    check({gqa, 40, 0, 40, 64, bf16});  // more threads than blocks
  }
}

TEST(HostAttention, MatchesTheSoftmaxInDoubleForOtherShapes) {
  const HostAttentionShape eight{1, 1, 8, 40};    // two groups of 4 queries; 40 = 2 x 16 + 8
  const HostAttentionShape mha{2, 3, 3, 48};      // one query per K/V head
  const HostAttentionShape batch{8, 8, 32, 128};  // 8 sequences: rows of 32-64 KiB
  const HostAttentionShape five{1, 2, 10, 17};    // a group of 4 and 1; 17 = 16 + 1
  for (bool bf16 : {false, true}) {
    for (int threads : {1, 2}) {
      check({eight, 300, 0, 300, threads, bf16});
      check({mha, 300, 7, 300, threads, bf16});
      check({batch, 100, 0, 100, threads, bf16});
      check({five, 130, 1, 130, threads, bf16});
    }
  }
}

// Calls from several threads at once, with different thread counts (the pool grows while other
// calls wait), give what the same call gives alone: the same split, the same sums.
TEST(HostAttention, CallsFromSeveralThreadsAtOnce) {
  const HostAttentionShape s{1, 8, 32, 128};
  const std::size_t tokens = 600;
  std::mt19937 gen(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> rows(tokens * 2 * s.batch * s.kv_heads * s.head_dim);
  for (float& x : rows) x = normal(gen);
  std::vector<float> q(s.batch * s.heads * s.head_dim);
  for (float& x : q) x = normal(gen);
  const int counts[] = {1, 2, 3, 5};
  std::vector<std::vector<float>> alone(4, std::vector<float>(q.size()));
  for (int c = 0; c < 4; ++c)
    host_decode_attention(rows.data(), RowType::Float32, s, 0, tokens, q.data(), 0.1f,
                          alone[c].data(), counts[c]);
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&, c] {
      std::vector<float> out(q.size());
      for (int r = 0; r < 20; ++r) {
        host_decode_attention(rows.data(), RowType::Float32, s, 0, tokens, q.data(), 0.1f,
                              out.data(), counts[c]);
        if (out != alone[c]) ++mismatches[c];
      }
    });
  }
  for (std::thread& t : callers) t.join();
  for (int c = 0; c < 4; ++c) EXPECT_EQ(mismatches[c], 0) << counts[c] << " threads";
}

TEST(HostAttention, MisuseIsRefusedNamingTheValues) {
  std::vector<float> rows(2 * 4 * 8, 0.0f), q(4, 0.0f), out(4);
  const HostAttentionShape s{1, 1, 1, 4};
  auto message = [&](HostAttentionShape shape, std::size_t first, std::size_t last, int threads) {
    try {
      host_decode_attention(rows.data(), RowType::Float32, shape, first, last, q.data(), 1.0f,
                            out.data(), threads);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message(s, 3, 3, 1).find("keys [3, 3) are empty"), std::string::npos);
  EXPECT_NE(
      message({1, 2, 3, 4}, 0, 2, 1).find("heads 3 must be a positive multiple of kv_heads 2"),
      std::string::npos);
  EXPECT_NE(message(s, 0, 2, 0).find("threads must be >= 1, got 0"), std::string::npos);
  EXPECT_NE(message({0, 1, 1, 4}, 0, 2, 1).find("batch 0"), std::string::npos);
  EXPECT_THROW(
      host_decode_attention(nullptr, RowType::Float32, s, 0, 2, q.data(), 1.0f, out.data(), 1),
      InvalidArgument);
}

}  // namespace
}  // namespace reviva::test
