// A decode step's attention over fp8 K/V rows (Backend::attend_fp8_decode_async; Note [fp8
// decode attention] in src/fp8_attention.cpp): the host reference against an independent
// double-precision computation, each backend against the reference (the new token's row to the
// bit, the output within fp32 and 16-bit rounding) over shapes that take every kernel variant
// (heads per block 1 to 8, two head groups, head_dim 64 to 256, one split and many, a window),
// and bad arguments named.
#include "test_util.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

namespace reviva::test {
namespace {

using Fp8Attention = BackendTest;

double e4m3_value(std::uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const double v = e == 0 ? std::ldexp(m, -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return (b & 0x80) ? -v : v;
}

struct Shape {
  std::size_t batch, heads, kv_heads, head_dim, length, first_key;
  HalfType type;
};

// One step's inputs in host memory: the store's token-major rows [length][2][batch][kv_heads]
// (K then V), the queries [batch][heads][head_dim], the new token [batch][kv_heads][head_dim].
struct Problem {
  Shape s;
  std::size_t row = 0;
  std::vector<std::uint8_t> rows;
  std::vector<std::uint16_t> q, k_new, v_new;

  explicit Problem(const Shape& shape, std::uint64_t seed) : s(shape), row(shape.head_dim + 4) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    rows = random_bytes(s.length * 2 * s.batch * s.kv_heads * row, seed);
    for (std::size_t r = 0; r < rows.size() / row; ++r) {
      std::uint8_t* p = rows.data() + r * row;
      for (std::size_t j = 0; j < s.head_dim; ++j)
        if ((p[j] & 0x7F) >= 0x60) p[j] &= 0xDF;  // no NaN, no magnitude above 2^5: real scores
      // (scales 2^-4 to 2^-12: the tensor-core kernel weighs values relative to the largest)
      const float scale =
          std::ldexp(1.0f + static_cast<float>(r % 5) / 5.0f, -4 - 4 * static_cast<int>(r % 3));
      std::memcpy(p + s.head_dim, &scale, 4);
    }
    const auto fill = [&](std::vector<std::uint16_t>& v, std::size_t n, float spread) {
      v.resize(n);
      for (auto& x : v) x = half_bits(spread * normal(rng), s.type);
    };
    fill(q, s.batch * s.heads * s.head_dim, 1.0f);
    fill(k_new, s.batch * s.kv_heads * s.head_dim, 3.0f);
    fill(v_new, s.batch * s.kv_heads * s.head_dim, 2.0f);
  }

  Fp8DecodeAttention args(void* rows_at, const void* q_at, const void* k_at, const void* v_at,
                          void* out_at) const {
    Fp8DecodeAttention a;
    a.type = s.type;
    a.batch = s.batch;
    a.heads = s.heads;
    a.kv_heads = s.kv_heads;
    a.head_dim = s.head_dim;
    a.q = q_at;
    a.q_stride[0] = static_cast<std::int64_t>(s.heads * s.head_dim);
    a.q_stride[1] = static_cast<std::int64_t>(s.head_dim);
    a.k_new = k_at;
    a.v_new = v_at;
    a.k_new_stride[0] = a.v_new_stride[0] = static_cast<std::int64_t>(s.kv_heads * s.head_dim);
    a.k_new_stride[1] = a.v_new_stride[1] = static_cast<std::int64_t>(s.head_dim);
    a.k_rows = rows_at;
    a.v_rows = static_cast<std::uint8_t*>(rows_at) + s.batch * s.kv_heads * row;
    a.row_stride[0] = static_cast<std::int64_t>(s.kv_heads * row);
    a.row_stride[1] = static_cast<std::int64_t>(row);
    a.row_stride[2] = static_cast<std::int64_t>(2 * s.batch * s.kv_heads * row);
    a.first_key = s.first_key;
    a.length = s.length;
    a.scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
    a.out = out_at;
    a.out_stride[0] = a.q_stride[0];
    a.out_stride[1] = a.q_stride[1];
    return a;
  }
};

struct Result {
  std::vector<std::uint8_t> rows;  // after the step
  std::vector<std::uint16_t> out;
};

// The host reference, in place on host copies.
Result reference(const Problem& p) {
  Result r{p.rows, std::vector<std::uint16_t>(p.q.size())};
  attend_fp8_decode(
      p.args(r.rows.data(), p.q.data(), p.k_new.data(), p.v_new.data(), r.out.data()));
  return r;
}

// The backend's, through its device memory. `graphed`: as captured in a CUDA graph (Note [fp8
// attention in the decode graphs]): the length and the rows' addresses in device memory, read
// when the kernels run, the first key from a window, the capacity `extra` tokens beyond.
Result run(const std::shared_ptr<Backend>& backend, const Problem& p, bool graphed = false,
           std::size_t extra = 0, std::int64_t step_length = -1) {
  Stream st(backend);
  const std::size_t rows_bytes = p.rows.size(), q_bytes = p.q.size() * 2;
  const std::size_t kv_bytes = p.k_new.size() * 2;
  const std::size_t out_at = rows_bytes + q_bytes + 2 * kv_bytes;
  const std::size_t step_at = out_at + q_bytes;  // the length, then the rows' two addresses
  const std::size_t total = step_at + 24;
  auto* host = static_cast<std::uint8_t*>(backend->allocate_pinned_host(total));
  auto* dev = static_cast<std::uint8_t*>(backend->allocate_device(total, st.handle()));
  std::memcpy(host, p.rows.data(), rows_bytes);
  std::memcpy(host + rows_bytes, p.q.data(), q_bytes);
  std::memcpy(host + rows_bytes + q_bytes, p.k_new.data(), kv_bytes);
  std::memcpy(host + rows_bytes + q_bytes + kv_bytes, p.v_new.data(), kv_bytes);
  Fp8DecodeAttention a = p.args(dev, dev + rows_bytes, dev + rows_bytes + q_bytes,
                                dev + rows_bytes + q_bytes + kv_bytes, dev + out_at);
  if (graphed) {
    const auto length = step_length >= 0 ? step_length : static_cast<std::int64_t>(p.s.length);
    const std::uint64_t rows[2] = {reinterpret_cast<std::uint64_t>(a.k_rows),
                                   reinterpret_cast<std::uint64_t>(a.v_rows)};
    std::memcpy(host + step_at, &length, 8);
    std::memcpy(host + step_at + 8, rows, 16);
    a.device_length = reinterpret_cast<const std::int64_t*>(dev + step_at);
    a.device_rows = reinterpret_cast<const std::uint64_t*>(dev + step_at + 8);
    a.k_rows = a.v_rows = nullptr;  // (not read)
    a.window = p.s.first_key > 0 ? p.s.length - p.s.first_key : 0;
    a.first_key = 12345;  // (not read)
    a.length = p.s.length + extra;
  }
  backend->copy_async(dev, host, total, st.handle());
  const std::size_t ws = backend->fp8_decode_workspace_bytes(a);
  void* workspace = ws > 0 ? backend->allocate_device(ws, st.handle()) : nullptr;
  a.workspace = workspace;
  a.workspace_bytes = ws;
  backend->attend_fp8_decode_async(a, st.handle());
  backend->copy_async(host, dev, total, st.handle());
  st.synchronize();
  Result r{std::vector<std::uint8_t>(host, host + rows_bytes),
           std::vector<std::uint16_t>(p.q.size())};
  std::memcpy(r.out.data(), host + out_at, q_bytes);
  if (workspace != nullptr) backend->free_device(workspace, st.handle());
  backend->free_device(dev, st.handle());
  st.synchronize();
  backend->free_pinned_host(host);
  return r;
}

// run(graphed) with `length` written to the device in place of the problem's (whose length is
// the capacity).
Result run_with_length(const std::shared_ptr<Backend>& backend, const Problem& p,
                       std::int64_t length) {
  return run(backend, p, /*graphed=*/true, 0, length);
}

// Independent of the reference: the rows `after` (the new token included) dequantized in
// double, softmax in double; [batch][heads][head_dim].
std::vector<double> exact(const Problem& p, const std::vector<std::uint8_t>& after) {
  const Shape& s = p.s;
  const std::size_t group = s.heads / s.kv_heads;
  const auto value = [&](std::size_t kv, std::size_t b, std::size_t h, std::size_t t,
                         std::size_t j) {
    const std::uint8_t* r =
        after.data() + ((t * 2 + kv) * s.batch * s.kv_heads + b * s.kv_heads + h) * p.row;
    float scale;
    std::memcpy(&scale, r + s.head_dim, 4);
    return e4m3_value(r[j]) * scale;
  };
  std::vector<double> out(s.batch * s.heads * s.head_dim);
  const double sm = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  for (std::size_t b = 0; b < s.batch; ++b)
    for (std::size_t h = 0; h < s.heads; ++h) {
      std::vector<double> score;
      for (std::size_t t = s.first_key; t < s.length; ++t) {
        double d = 0;
        for (std::size_t j = 0; j < s.head_dim; ++j)
          d += half_value(p.q[(b * s.heads + h) * s.head_dim + j], s.type) *
               value(0, b, h / group, t, j);
        score.push_back(d * sm);
      }
      const double top = *std::max_element(score.begin(), score.end());
      double total = 0;
      for (double& x : score) total += (x = std::exp(x - top));
      for (std::size_t j = 0; j < s.head_dim; ++j) {
        double o = 0;
        for (std::size_t t = s.first_key; t < s.length; ++t)
          o += score[t - s.first_key] * value(1, b, h / group, t, j);
        out[(b * s.heads + h) * s.head_dim + j] = o / total;
      }
    }
  return out;
}

// |got - want| within `units` of the 16-bit output's rounding (half a unit in the last place)
// plus fp32's sums (a thousandth of the largest output).
void expect_close(const std::vector<std::uint16_t>& got, const std::vector<double>& want,
                  HalfType type, const char* what, double units = 1) {
  double top = 0;
  for (double w : want) top = std::max(top, std::fabs(w));
  const double eps = units * (type == HalfType::BFloat16 ? 1.0 / 256 : 1.0 / 2048);
  std::size_t bad = 0;
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double d = std::fabs(half_value(got[i], type) - want[i]);
    worst = std::max(worst, d);
    bad += d > eps * std::fabs(want[i]) + 1e-3 * top;
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " values off, worst by "
                     << worst << " (largest " << top << ")";
}

std::vector<double> as_double(const std::vector<std::uint16_t>& v, HalfType type) {
  std::vector<double> out;
  for (auto x : v) out.push_back(half_value(x, type));
  return out;
}

TEST(Fp8AttentionReference, NewTokenIsQuantizedAsKvFp8Does) {
  // amax 448 * 2: scale 2; values that e4m3 holds exactly keep their bytes; 1.4 (bf16
  // 1.3984375) / 2 rounds to nearest (mantissa 3.19 -> 3: 0x33); 2^-8 / 2 is the smallest
  // subnormal (0x01).
  const Shape s{1, 1, 1, 8, 1, 0, HalfType::BFloat16};
  Problem p(s, 1);
  const float values[8] = {896.0f, 2.0f, -2.0f, 0.0f, 3.0f, -896.0f, 1.4f, 1.0f / 256};
  for (int j = 0; j < 8; ++j) p.k_new[j] = p.v_new[j] = half_bits(values[j], s.type);
  const Result r = reference(p);
  const std::uint8_t want[8] = {0x7E, 0x38, 0xB8, 0x00, 0x3C, 0xFE, 0x33, 0x01};
  for (int j = 0; j < 8; ++j) EXPECT_EQ(r.rows[j], want[j]) << j;
  float scale;
  std::memcpy(&scale, r.rows.data() + 8, 4);
  EXPECT_EQ(scale, 2.0f);
  EXPECT_EQ(std::memcmp(r.rows.data(), r.rows.data() + p.row, p.row), 0) << "V as K";
  // one key: the output is its value, dequantized
  for (int j = 0; j < 8; ++j)
    EXPECT_FLOAT_EQ(half_value(r.out[j], s.type), static_cast<float>(e4m3_value(want[j]) * 2)) << j;
}

TEST(Fp8AttentionReference, AgreesWithDoublePrecision) {
  for (const Shape& s : {Shape{2, 6, 2, 64, 300, 0, HalfType::BFloat16},
                         Shape{1, 4, 4, 32, 100, 37, HalfType::Float16}}) {
    const Problem p(s, 7);
    const Result r = reference(p);
    expect_close(r.out, exact(p, r.rows), s.type, "reference");
  }
}

TEST_P(Fp8Attention, EveryVariantAgreesWithTheReference) {
  const Shape shapes[] = {
      {1, 32, 8, 128, 5000, 0, HalfType::BFloat16},  // Llama-3-8B's heads: 4 per block, splits
      {2, 9, 3, 64, 700, 0, HalfType::Float16},      // 3 per kv head: blocks of 2, two groups
      {1, 28, 4, 128, 4097, 0, HalfType::BFloat16},  // 7 per kv head (Qwen2-7B)
      {1, 16, 1, 256, 2000, 0, HalfType::BFloat16},  // 16 per kv head: 8 per block; head_dim 256
      {3, 4, 4, 128, 777, 500, HalfType::BFloat16},  // 1 per kv head; a sliding window
      {1, 8, 2, 96, 1, 0, HalfType::Float16},        // the new token alone
      {1, 16, 2, 192, 3000, 0, HalfType::Float16},   // head_dim between 128 and 256
      {1, 64, 8, 128, 3000, 0, HalfType::Float16},   // 8 per kv head: a tensor-core tile's 8
      {2, 8, 8, 64, 300, 0, HalfType::BFloat16},     // 1 per kv head, head_dim 64, a batch
  };
  std::uint64_t seed = 11;
  for (const Shape& s : shapes) {
    SCOPED_TRACE(::testing::Message() << "batch " << s.batch << ", heads " << s.heads << "/"
                                      << s.kv_heads << ", head_dim " << s.head_dim << ", keys ["
                                      << s.first_key << ", " << s.length << ")");
    const Problem p(s, ++seed);
    const Result want = reference(p);
    const Result got = run(backend_, p);
    // the new token's rows, to the bit; every other row untouched
    ASSERT_EQ(got.rows.size(), want.rows.size());
    std::size_t differ = 0;
    for (std::size_t i = 0; i < got.rows.size(); ++i) differ += got.rows[i] != want.rows[i];
    EXPECT_EQ(differ, 0u) << "bytes of the rows differ from the reference's";
    // (both rounded to 16 bits: a value near a rounding boundary may differ by one unit)
    expect_close(got.out, as_double(want.out, s.type), s.type, "against the reference", 2);
    expect_close(got.out, exact(p, got.rows), s.type, "against double precision");
    // the same call again gives the same bits (no state carried between calls)
    const Result again = run(backend_, p);
    EXPECT_EQ(again.out, got.out);
  }
}

TEST_P(Fp8Attention, AsCapturedInAGraphItReadsTheStepFromDeviceMemory) {
  // The same results with the step's length, first key and rows read when the kernels run,
  // under capacities from the step's own length to far beyond it (other splits on CUDA).
  const Shape shapes[] = {
      {1, 32, 8, 128, 5000, 0, HalfType::BFloat16},
      {3, 4, 4, 128, 777, 500, HalfType::BFloat16},  // a window: keys from 500 on
      {2, 9, 3, 64, 1, 0, HalfType::Float16},
  };
  std::uint64_t seed = 40;
  for (const Shape& s : shapes) {
    for (std::size_t extra : {std::size_t{0}, std::size_t{3}, std::size_t{60000}}) {
      SCOPED_TRACE(::testing::Message()
                   << "heads " << s.heads << "/" << s.kv_heads << ", keys [" << s.first_key << ", "
                   << s.length << "), capacity +" << extra);
      const Problem p(s, ++seed);
      const Result want = reference(p);
      const Result got = run(backend_, p, /*graphed=*/true, extra);
      ASSERT_EQ(got.rows.size(), want.rows.size());
      std::size_t differ = 0;
      for (std::size_t i = 0; i < got.rows.size(); ++i) differ += got.rows[i] != want.rows[i];
      EXPECT_EQ(differ, 0u) << "bytes of the rows differ from the reference's";
      expect_close(got.out, as_double(want.out, s.type), s.type, "against the reference", 2);
      expect_close(got.out, exact(p, got.rows), s.type, "against double precision");
    }
  }
}

TEST_P(Fp8Attention, AnImpossibleLengthReadAtRunTimeGivesNaNAndLeavesTheRows) {
  // (read on the stream the step runs on: it cannot throw there; 0 or beyond the capacity)
  const Shape s{1, 32, 8, 128, 3000, 0, HalfType::BFloat16};
  for (std::int64_t length : {std::int64_t{0}, std::int64_t{3001}}) {
    const Problem p(s, 77);
    const Result got = run_with_length(backend_, p, length);
    EXPECT_TRUE(got.rows == p.rows) << "length " << length << ": the rows were written";
    std::size_t nan = 0;
    for (std::uint16_t x : got.out) nan += std::isnan(half_value(x, s.type));
    EXPECT_EQ(nan, got.out.size()) << "length " << length;
  }
}

TEST_P(Fp8Attention, BadArgumentsAreNamed) {
  Stream st(backend_);
  const Shape s{1, 8, 2, 64, 10, 0, HalfType::BFloat16};
  Problem p(s, 3);
  std::vector<std::uint16_t> out(p.q.size());
  const auto expect_named = [&](Fp8DecodeAttention a, const std::string& needle) {
    try {
      backend_->attend_fp8_decode_async(a, st.handle());
      ADD_FAILURE() << "taken: " << needle;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const Fp8DecodeAttention good =
      p.args(p.rows.data(), p.q.data(), p.k_new.data(), p.v_new.data(), out.data());
  Fp8DecodeAttention a = good;
  a.heads = 7;
  expect_named(a, "7 heads are not a multiple of 2");
  a = good;
  a.head_dim = 260;
  expect_named(a, "260");
  a = good;
  a.first_key = 10;
  expect_named(a, "first_key 10, length 10");
  a = good;
  a.row_stride[2] = 130;
  expect_named(a, "130");
  a = good;
  a.v_new = nullptr;
  expect_named(a, "together");
  a = good;
  a.scale = std::nanf("");
  expect_named(a, "not finite");
  st.synchronize();
}

TEST_P(Fp8Attention, ManyKeysNeedAWorkspaceOnTheDevice) {
  const Shape s{1, 32, 8, 128, 65536, 0, HalfType::BFloat16};
  Problem p(s, 5);
  std::vector<std::uint16_t> out(p.q.size());
  Fp8DecodeAttention a =
      p.args(p.rows.data(), p.q.data(), p.k_new.data(), p.v_new.data(), out.data());
  const std::size_t ws = backend_->fp8_decode_workspace_bytes(a);
  if (GetParam() == BackendKind::Host) {
    EXPECT_EQ(ws, 0u);
    return;
  }
  ASSERT_GT(ws, 0u) << "64k keys on 8 kv heads are cut into splits";
  Stream st(backend_);
  try {
    backend_->attend_fp8_decode_async(a, st.handle());
    ADD_FAILURE() << "no workspace was taken";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(ws)), std::string::npos) << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, Fp8Attention,
                         ::testing::Values(BackendKind::Host, BackendKind::Cuda),
                         backend_param_name);

}  // namespace
}  // namespace reviva::test
