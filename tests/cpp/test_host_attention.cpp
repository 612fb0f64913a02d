// host_decode_attention (Note [Attention on the host]): one query per sequence and head over
// token-major K/V rows, against a double-precision softmax, for fp32 and bf16 rows, grouped
// heads (groups of 4, fewer, more), a batch, a key range starting past 0 (a window), ranges
// shorter than a block and one thread per key, any number of threads, a head_dim not a multiple
// of the vector width, rows long enough to shorten the blocks; fp8 (e4m3) rows with their
// per-row scales, e4m3's subnormals, zeros, 448 and NaN; calls from several threads at once
// (Note [Attention's thread pool]); misuse is refused naming the values.
#include "test_util.h"

#include <reviva/host_attention.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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

// --- fp8 (e4m3) rows: [2][batch][kv_heads] of head_dim e4m3 bytes and an fp32 scale ---

// An e4m3 byte's value (CUDA's __NV_E4M3), in double: subnormals m x 2^-9, normals
// (1 + m/8) x 2^(e - 7), S.1111.111 NaN.
double e4m3(std::uint8_t b) {
  static const std::array<double, 256> table = [] {
    std::array<double, 256> v{};
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      v[b] = e == 15 && m == 7 ? std::numeric_limits<double>::quiet_NaN()
             : e == 0          ? std::ldexp(m, -9)
                               : std::ldexp(1.0 + m / 8.0, e - 7);
      if (b & 0x80) v[b] = -v[b];
    }
    return v;
  }();
  return table[b];
}

// The byte nearest x, saturated at +-448.
std::uint8_t nearest_e4m3(double x) {
  const double a = std::min(std::fabs(x), 448.0);
  int b;
  if (a < 0x1p-6) {
    b = static_cast<int>(std::nearbyint(a * 512.0));  // (subnormals; 8 is 0x08, 2^-6)
  } else {
    int e;
    const double f = std::frexp(a, &e);  // a = 2f x 2^(e - 1), exponent field e - 1 + 7
    b = ((e + 6) << 3) + static_cast<int>(std::nearbyint((2.0 * f - 1.0) * 8.0));  // (8 carries)
  }
  return static_cast<std::uint8_t>(b | (x < 0 ? 0x80 : 0));
}

struct Fp8Rows {
  HostAttentionShape shape;
  std::size_t tokens;
  std::vector<std::uint8_t> bytes;  // tokens x 2 x batch x kv_heads x (head_dim + 4)

  std::size_t head_row() const { return shape.head_dim + 4; }
  std::size_t token_row() const { return 2 * shape.batch * shape.kv_heads * head_row(); }
  // The row of token t's key (kv 0) or value (kv 1) of sequence b, kv head g.
  std::uint8_t* row(std::size_t t, std::size_t kv, std::size_t b, std::size_t g) {
    return bytes.data() + t * token_row() +
           ((kv * shape.batch + b) * shape.kv_heads + g) * head_row();
  }
  float scale(std::size_t t, std::size_t kv, std::size_t b, std::size_t g) {
    float s;
    std::memcpy(&s, row(t, kv, b, g) + shape.head_dim, sizeof s);
    return s;
  }
};

// Rows of two kinds, half each: quantized as the store does (scale amax / 448: bytes over
// e4m3's whole range, 448 included), and with a scale drawn from [1e-6, 1e3] (log-uniform) and
// the bytes nearest the same kind of vector divided by it (saturated at 448 for small scales,
// all zeros and subnormals for large ones). Either way the elements are ~N(0, 2): the scores
// stay in a range where fp32 rounding leaves the softmax to ~1e-6.
Fp8Rows make_fp8_rows(const HostAttentionShape& s, std::size_t tokens, unsigned seed) {
  Fp8Rows r{s, tokens,
            std::vector<std::uint8_t>(tokens * 2 * s.batch * s.kv_heads * (s.head_dim + 4))};
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_real_distribution<double> log_scale(-6.0, 3.0);
  std::vector<float> x(s.head_dim);
  for (std::size_t t = 0; t < tokens; ++t)
    for (std::size_t kv = 0; kv < 2; ++kv)
      for (std::size_t b = 0; b < s.batch; ++b)
        for (std::size_t g = 0; g < s.kv_heads; ++g) {
          float amax = 0;
          for (float& v : x) amax = std::max(amax, std::fabs(v = normal(gen)));
          const float scale = gen() % 2 ? amax * (1.0f / 448.0f)
                                        : static_cast<float>(std::pow(10.0, log_scale(gen)));
          std::uint8_t* row = r.row(t, kv, b, g);
          for (std::size_t d = 0; d < s.head_dim; ++d) row[d] = nearest_e4m3(double(x[d]) / scale);
          std::memcpy(row + s.head_dim, &scale, sizeof scale);
        }
  return r;
}

// The softmax in double over the rows' exact values (each byte's value x its row's scale):
// out[b][h][d]. `flush`: e4m3's subnormals read as 0; `unscaled`: the scales read as 1 (what
// the test must tell apart from the kernel's result).
std::vector<double> reference_fp8(Fp8Rows& r, std::size_t first, std::size_t last,
                                  const std::vector<float>& q, float scale, bool flush = false,
                                  bool unscaled = false) {
  const auto& s = r.shape;
  const std::size_t D = s.head_dim, per_group = s.heads / s.kv_heads, keys = last - first;
  // values[((t - first) * 2 + kv) * B * G + b * G + g][d]
  std::vector<double> values(keys * 2 * s.batch * s.kv_heads * D);
  double* x = values.data();
  for (std::size_t t = first; t < last; ++t)
    for (std::size_t kv = 0; kv < 2; ++kv)
      for (std::size_t b = 0; b < s.batch; ++b)
        for (std::size_t g = 0; g < s.kv_heads; ++g) {
          const std::uint8_t* row = r.row(t, kv, b, g);
          const double row_scale = unscaled ? 1.0 : r.scale(t, kv, b, g);
          for (std::size_t d = 0; d < D; ++d)
            *x++ = flush && (row[d] & 0x78) == 0 ? 0.0 : e4m3(row[d]) * row_scale;
        }
  auto at = [&](std::size_t t, std::size_t kv, std::size_t b, std::size_t g) {
    return values.data() + (((t - first) * 2 + kv) * s.batch * s.kv_heads + b * s.kv_heads + g) * D;
  };
  std::vector<double> out(s.batch * s.heads * D, 0.0);
  for (std::size_t b = 0; b < s.batch; ++b) {
    for (std::size_t h = 0; h < s.heads; ++h) {
      const std::size_t g = h / per_group;
      const float* qh = q.data() + (b * s.heads + h) * D;
      std::vector<double> score;
      double top = -std::numeric_limits<double>::infinity();
      for (std::size_t t = first; t < last; ++t) {
        const double* k = at(t, 0, b, g);
        double dot = 0;
        for (std::size_t d = 0; d < D; ++d) dot += double(qh[d]) * k[d];
        score.push_back(dot * scale);
        top = std::max(top, score.back());
      }
      double sum = 0;
      for (double& e : score) sum += (e = std::exp(e - top));
      double* o = out.data() + (b * s.heads + h) * D;
      for (std::size_t t = first; t < last; ++t) {
        const double* v = at(t, 1, b, g);
        for (std::size_t d = 0; d < D; ++d) o[d] += score[t - first] / sum * v[d];
      }
    }
  }
  return out;
}

// sqrt(sum (a - b)^2 / sum b^2) over [i0, i1).
template <typename A>
double relative_error(const A& a, const std::vector<double>& b, std::size_t i0, std::size_t i1) {
  double err = 0, norm = 0;
  for (std::size_t i = i0; i < i1; ++i) {
    err += (a[i] - b[i]) * (a[i] - b[i]);
    norm += b[i] * b[i];
  }
  return std::sqrt(err / norm);
}

// host_decode_attention over fp8 rows with 1 and 4 threads, each against the softmax in double
// (every sequence and head to 1e-5 relative; ~1.2e-6 seen), and the two against each other.
// Where the keys are a few hundred, the test is checked to be able to fail: the softmax of the
// rows with their subnormals flushed (0.11 relative or more seen), or with their scales left out
// (270 or more), is far from the right one.
void check_fp8(const HostAttentionShape& s, std::size_t tokens, std::size_t first,
               std::size_t last) {
  const std::string what = "batch " + std::to_string(s.batch) + ", kv_heads " +
                           std::to_string(s.kv_heads) + ", heads " + std::to_string(s.heads) +
                           ", head_dim " + std::to_string(s.head_dim) + ", keys [" +
                           std::to_string(first) + ", " + std::to_string(last) + ")";
  SCOPED_TRACE(what);
  Fp8Rows rows = make_fp8_rows(
      s, tokens, static_cast<unsigned>(tokens * 31 + s.head_dim * 7 + s.heads * 3 + s.batch));
  std::mt19937 gen(static_cast<unsigned>(tokens + s.heads));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::size_t D = s.head_dim, BH = s.batch * s.heads;
  std::vector<float> q(BH * D);
  for (float& x : q) x = normal(gen);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const std::vector<double> want = reference_fp8(rows, first, last, q, scale);
  std::vector<std::vector<float>> outs;
  for (int threads : {1, 4}) {
    std::vector<float> out(q.size(), -1.0f);
    host_decode_attention(rows.bytes.data(), RowType::Fp8E4M3, s, first, last, q.data(), scale,
                          out.data(), threads);
    for (std::size_t i = 0; i < BH; ++i)
      EXPECT_LT(relative_error(out, want, i * D, (i + 1) * D), 1e-5)
          << threads << " threads, sequence " << i / s.heads << " head " << i % s.heads;
    outs.push_back(std::move(out));
  }
  const std::vector<double> one(outs[0].begin(), outs[0].end());
  EXPECT_LT(relative_error(outs[1], one, 0, one.size()), 5e-6)
      << "1 and 4 threads";  // (~7e-7 seen)
  if (last - first >= 100 && last - first <= 1000) {
    EXPECT_GT(
        relative_error(reference_fp8(rows, first, last, q, scale, true), want, 0, want.size()),
        1e-2)
        << "flushing the subnormals would go unnoticed";
    EXPECT_GT(relative_error(reference_fp8(rows, first, last, q, scale, false, true), want, 0,
                             want.size()),
              1.0)
        << "leaving the scales out would go unnoticed";
  }
}

TEST(HostAttention, Fp8MatchesTheSoftmaxInDoubleOverTheRowsExactValues) {
  for (std::size_t head_dim : {64, 128, 100}) {  // (100 = 6 x 16 + 4: a scalar tail)
    for (std::size_t group : {1, 4, 7}) {        // (7: a group of 4 and one of 3)
      for (std::size_t batch : {1, 3}) {
        const HostAttentionShape s{batch, 2, 2 * group, head_dim};
        check_fp8(s, 5, 2, 3);        // one key
        check_fp8(s, 300, 0, 300);    // a few blocks
        check_fp8(s, 4100, 3, 4100);  // thousands, from past 0
      }
    }
  }
}

// Rows drawn as the test above draws them hold what it is meant to cover: e4m3's subnormals, zeros
// of both signs, negative values, 448 and -448, and scales from 1e-6 to 1e3.
TEST(HostAttention, Fp8TestRowsCoverSubnormalsZerosAnd448) {
  Fp8Rows r = make_fp8_rows({3, 2, 8, 100}, 300, 1);
  std::array<std::size_t, 256> count{};
  float smallest = 1e30f, largest = 0;
  for (std::size_t t = 0; t < r.tokens; ++t)
    for (std::size_t kv = 0; kv < 2; ++kv)
      for (std::size_t b = 0; b < 3; ++b)
        for (std::size_t g = 0; g < 2; ++g) {
          for (std::size_t d = 0; d < 100; ++d) ++count[r.row(t, kv, b, g)[d]];
          smallest = std::min(smallest, r.scale(t, kv, b, g));
          largest = std::max(largest, r.scale(t, kv, b, g));
        }
  for (int b : {0x00, 0x80, 0x7E, 0xFE}) EXPECT_GT(count[b], 0u) << "byte " << b;
  for (int m = 1; m < 8; ++m) {  // (subnormals: exponent 0)
    EXPECT_GT(count[m], 0u) << "byte " << m;
    EXPECT_GT(count[0x80 | m], 0u) << "byte " << (0x80 | m);
  }
  EXPECT_EQ(count[0x7F] + count[0xFF], 0u);  // (no NaN)
  EXPECT_LT(smallest, 1e-5f);
  EXPECT_GT(largest, 1e2f);
}

// Every byte is read as its value times its row's scale, exactly, in a row's vectors and in its
// tail: one key per call, whose output is its value (a weight of exactly 1), each of the 256
// bytes at each element, with scales 1, 1e-6, 1e3 and 0.375 (NaN bytes NaN).
TEST(HostAttention, Fp8EveryByteIsReadAsItsValue) {
  const HostAttentionShape s{1, 1, 1, 20};  // (20 = 16 + 4: bytes 0-15 vectors, 16-19 a tail)
  const std::size_t tokens = 256;
  std::vector<std::uint8_t> rows(tokens * 2 * 24);
  const float scales[] = {1.0f, 1e-6f, 1e3f, 0.375f};
  for (std::size_t t = 0; t < tokens; ++t) {
    std::uint8_t* v = rows.data() + t * 48 + 24;
    for (std::size_t d = 0; d < 20; ++d) v[d] = static_cast<std::uint8_t>((t + 13 * d) % 256);
    std::memcpy(v + 20, &scales[t % 4], 4);
    std::memcpy(rows.data() + t * 48 + 20, &scales[0], 4);  // (keys: 0 bytes, scale 1)
  }
  std::vector<float> q(20, 0.0f), out(20);
  for (std::size_t t = 0; t < tokens; ++t) {
    host_decode_attention(rows.data(), RowType::Fp8E4M3, s, t, t + 1, q.data(), 1.0f, out.data(),
                          1);
    for (std::size_t d = 0; d < 20; ++d) {
      const std::uint8_t byte = static_cast<std::uint8_t>((t + 13 * d) % 256);
      const double want = e4m3(byte) * scales[t % 4];
      if (std::isnan(want))
        EXPECT_TRUE(std::isnan(out[d])) << "byte " << int(byte) << " element " << d;
      else
        EXPECT_EQ(out[d], static_cast<float>(want)) << "byte " << int(byte) << " element " << d;
    }
  }
}

// A NaN byte (0x7F, 0xFF) is NaN, as the device's conversion makes it: in a key it makes its
// heads' outputs NaN; in a value, that element of its heads' outputs.
TEST(HostAttention, Fp8NaNBytesAreNaN) {
  const HostAttentionShape s{1, 2, 2, 36};  // (36 = 2 x 16 + 4)
  Fp8Rows r = make_fp8_rows(s, 200, 9);
  std::vector<float> q(2 * 36, 0.5f), out(q.size());
  r.row(150, 1, 0, 0)[5] = 0x7F;   // value, kv head 0, element 5 (a vector's)
  r.row(170, 1, 0, 0)[34] = 0xFF;  // element 34 (the tail's)
  r.row(60, 0, 0, 1)[20] = 0xFF;   // key, kv head 1
  host_decode_attention(r.bytes.data(), RowType::Fp8E4M3, s, 0, 200, q.data(), 0.1f, out.data(), 2);
  for (std::size_t d = 0; d < 36; ++d) {
    EXPECT_EQ(std::isnan(out[d]), d == 5 || d == 34) << "head 0 element " << d;
    EXPECT_TRUE(std::isnan(out[36 + d])) << "head 1 element " << d;
  }
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
  // fp8: each row's scale after head_dim bytes, 4-byte aligned
  std::vector<float> q6(6, 0.0f), out6(6);
  try {
    host_decode_attention(rows.data(), RowType::Fp8E4M3, {1, 1, 1, 6}, 0, 2, q6.data(), 1.0f,
                          out6.data(), 1);
    ADD_FAILURE() << "an fp8 head_dim of 6 was taken";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim 6 of fp8 rows must be a multiple of 4"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace reviva::test
