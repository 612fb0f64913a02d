// A decode step's row operations (Backend::rms_norm_async, rotary_async, silu_mul_async; Note
// [Decode row ops] in src/row_ops.cpp): the host references against independent computations in
// double precision rounded where HF's modules round, each backend against the references (Rotary
// to the bit, SiluMul and RmsNorm within one unit in the last place), in place and strided, and
// bad arguments named.
#include "test_util.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace reviva::test {
namespace {

using RowOps = BackendTest;
using Half = std::uint16_t;

float value(Half bits, HalfType type) { return half_value(bits, type); }

// (doubles here hold floats' products exactly)
Half bits_of(double x, HalfType type) { return half_bits(static_cast<float>(x), type); }

double rounded(double x, HalfType type) { return value(bits_of(x, type), type); }

std::vector<Half> random_halves(std::size_t n, float spread, HalfType type, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, spread);
  std::vector<Half> v(n);
  for (auto& x : v) x = bits_of(normal(rng), type);
  return v;
}

// RMSNorm weights of +-0.5, 1, 2: the weight's product is exact, so a normalized value one unit
// off (the sum of squares in another order) stays one unit off after it.
std::vector<Half> power_of_two_weights(std::size_t n, HalfType type, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const float choices[] = {0.5f, 1.0f, 2.0f, -1.0f, -0.5f};
  std::vector<Half> v(n);
  for (auto& x : v) x = bits_of(choices[rng() % 5], type);
  return v;
}

// Units in the last place of `type` between two values of it (0 when equal).
int ulps(Half a, Half b, HalfType type) {
  if (a == b) return 0;
  const float fa = value(a, type), fb = value(b, type);
  if (std::isnan(fa) || std::isnan(fb)) return 1 << 20;
  const int ia = static_cast<std::int16_t>(a), ib = static_cast<std::int16_t>(b);
  const int oa = ia < 0 ? -(ia & 0x7FFF) : ia, ob = ib < 0 ? -(ib & 0x7FFF) : ib;
  return std::abs(oa - ob);
}

int worst_ulps(const std::vector<Half>& a, const std::vector<Half>& b, HalfType type) {
  EXPECT_EQ(a.size(), b.size());
  int worst = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i)
    worst = std::max(worst, ulps(a[i], b[i], type));
  return worst;
}

const char* type_name(HalfType t) { return t == HalfType::BFloat16 ? "bf16" : "fp16"; }

// Device copies of host vectors, read back after the stream's work (through pinned staging).
class Device {
 public:
  Device(std::shared_ptr<Backend> backend, const Stream& stream)
      : backend_(std::move(backend)), stream_(stream) {}
  ~Device() {
    for (void* p : buffers_) backend_->free_device(p, stream_.handle());
    stream_.synchronize();
  }
  void* put(const std::vector<Half>& v) {
    const std::size_t bytes = std::max<std::size_t>(1, v.size()) * 2;
    void* d = backend_->allocate_device(bytes, stream_.handle());
    buffers_.push_back(d);
    void* staging = backend_->allocate_pinned_host(bytes);
    std::memcpy(staging, v.data(), v.size() * 2);
    backend_->copy_async(d, staging, v.size() * 2, stream_.handle());
    stream_.synchronize();
    backend_->free_pinned_host(staging);
    return d;
  }
  std::vector<Half> get(const void* d, std::size_t n) {
    void* staging = backend_->allocate_pinned_host(std::max<std::size_t>(1, n) * 2);
    backend_->copy_async(staging, d, n * 2, stream_.handle());
    stream_.synchronize();
    std::vector<Half> v(n);
    std::memcpy(v.data(), staging, n * 2);
    backend_->free_pinned_host(staging);
    return v;
  }

 private:
  std::shared_ptr<Backend> backend_;
  const Stream& stream_;
  std::vector<void*> buffers_;
};

// --- the references against double precision -------------------------------------------------

TEST(RowOpsReference, RmsNormIsHfsFormulaWithTheResidualAdded) {
  for (const HalfType type : {HalfType::BFloat16, HalfType::Float16}) {
    const std::size_t rows = 3, width = 1000, stride = 1003;
    const auto x = random_halves(rows * stride, 2.0f, type, 1);
    const auto w = power_of_two_weights(width, type, 2);
    for (const bool with_residual : {false, true}) {
      auto residual = random_halves(rows * stride, 3.0f, type, 3);
      const auto residual_before = residual;
      std::vector<Half> out(rows * stride, 0);
      RmsNorm n;
      n.type = type;
      n.rows = rows;
      n.width = width;
      n.x = x.data();
      n.x_stride = stride;
      n.residual = with_residual ? residual.data() : nullptr;
      n.residual_stride = stride;
      n.weight = w.data();
      n.eps = 1e-5f;
      n.out = out.data();
      n.out_stride = stride;
      rms_norm(n);
      int worst = 0;
      for (std::size_t r = 0; r < rows; ++r) {
        std::vector<double> s(width);
        double sum = 0;
        for (std::size_t j = 0; j < width; ++j) {
          double v = value(x[r * stride + j], type);
          if (with_residual) {
            v = rounded(value(residual_before[r * stride + j], type) + v, type);
            EXPECT_EQ(residual[r * stride + j], bits_of(v, type)) << "residual " << r << "," << j;
          }
          s[j] = v;
          sum += v * v;
        }
        const double inv = 1.0 / std::sqrt(sum / width + 1e-5);
        for (std::size_t j = 0; j < width; ++j) {
          const double want = value(w[j], type) * rounded(s[j] * inv, type);
          worst = std::max(worst, ulps(out[r * stride + j], bits_of(want, type), type));
        }
      }
      EXPECT_LE(worst, 1) << type_name(type) << " residual " << with_residual;
      if (!with_residual) {
        EXPECT_EQ(residual, residual_before);
      }
    }
  }
}

TEST(RowOpsReference, RotaryIsXCosPlusRotateHalfXSinRoundedAsHfRounds) {
  for (const HalfType type : {HalfType::BFloat16, HalfType::Float16}) {
    const std::size_t batch = 2, qh = 4, kh = 2, d = 64;
    auto q = random_halves(batch * qh * d, 1.5f, type, 4);
    auto k = random_halves(batch * kh * d, 1.5f, type, 5);
    const auto q0 = q, k0 = k;
    const auto cos = random_halves(batch * d, 0.7f, type, 6);
    const auto sin = random_halves(batch * d, 0.7f, type, 7);
    Rotary r;
    r.type = type;
    r.batch = batch;
    r.q_heads = qh;
    r.k_heads = kh;
    r.head_dim = d;
    r.q = q.data();
    r.q_stride[0] = qh * d;
    r.q_stride[1] = d;
    r.k = k.data();
    r.k_stride[0] = kh * d;
    r.k_stride[1] = d;
    r.cos = cos.data();
    r.sin = sin.data();
    r.cos_stride = r.sin_stride = d;
    rotary(r);
    const auto check = [&](const std::vector<Half>& before, const std::vector<Half>& after,
                           std::size_t heads) {
      for (std::size_t b = 0; b < batch; ++b)
        for (std::size_t h = 0; h < heads; ++h)
          for (std::size_t j = 0; j < d; ++j) {
            const Half* x = before.data() + (b * heads + h) * d;
            const double rot = j < d / 2 ? -static_cast<double>(value(x[j + d / 2], type))
                                         : value(x[j - d / 2], type);
            const double want = rounded(
                rounded(value(x[j], type) * static_cast<double>(value(cos[b * d + j], type)),
                        type) +
                    rounded(rot * value(sin[b * d + j], type), type),
                type);
            ASSERT_EQ(after[(b * heads + h) * d + j], bits_of(want, type))
                << type_name(type) << " b" << b << " h" << h << " j" << j;
          }
    };
    check(q0, q, qh);
    check(k0, k, kh);
  }
}

TEST(RowOpsReference, SiluMulIsSiluRoundedTimesUpRounded) {
  for (const HalfType type : {HalfType::BFloat16, HalfType::Float16}) {
    const std::size_t rows = 2, width = 777;
    const auto gate = random_halves(rows * width, 3.0f, type, 8);
    const auto up = random_halves(rows * width, 1.0f, type, 9);
    std::vector<Half> out(rows * width);
    SiluMul op;
    op.type = type;
    op.rows = rows;
    op.width = width;
    op.gate = gate.data();
    op.up = up.data();
    op.out = out.data();
    op.gate_stride = op.up_stride = op.out_stride = static_cast<std::int64_t>(width);
    silu_mul(op);
    int worst = 0;
    for (std::size_t i = 0; i < out.size(); ++i) {
      const double g = value(gate[i], type);
      const double want = rounded(g / (1.0 + std::exp(-g)), type) * value(up[i], type);
      worst = std::max(worst, ulps(out[i], bits_of(want, type), type));
    }
    // (fp32's exp against double's: a value on a rounding boundary may round the other way)
    EXPECT_LE(worst, 1) << type_name(type);
  }
}

// --- each backend against the references ------------------------------------------------------

TEST_P(RowOps, RmsNormMatchesTheReferenceStridedInPlaceAndWithTheResidual) {
  Stream s(backend_);
  for (const HalfType type : {HalfType::BFloat16, HalfType::Float16}) {
    for (const std::size_t width : {4096u, 1000u, 37u, 8192u, 9000u}) {  // (9000: the wide kernel)
      for (const bool with_residual : {false, true}) {
        for (const bool in_place : {false, true}) {
          const std::size_t rows = 3, stride = width + 8;
          const auto x = random_halves(rows * stride, 2.0f, type, width + 10);
          const auto w = power_of_two_weights(width, type, width + 11);
          const auto residual = random_halves(rows * stride, 3.0f, type, width + 12);
          // The reference on host copies.
          auto ref_x = x, ref_res = residual;
          std::vector<Half> ref_out(rows * stride, 0);
          RmsNorm n;
          n.type = type;
          n.rows = rows;
          n.width = width;
          n.x_stride = n.residual_stride = n.out_stride = static_cast<std::int64_t>(stride);
          n.eps = 1e-6f;
          n.x = ref_x.data();
          n.residual = with_residual ? ref_res.data() : nullptr;
          n.weight = w.data();
          n.out = in_place ? ref_x.data() : ref_out.data();
          rms_norm(n);
          Device dev(backend_, s);
          void* dx = dev.put(x);
          void* dres = dev.put(residual);
          void* dout = dev.put(std::vector<Half>(rows * stride, 0));
          n.x = dx;
          n.residual = with_residual ? dres : nullptr;
          n.weight = dev.put(w);
          n.out = in_place ? dx : dout;
          backend_->rms_norm_async(n, s.handle());
          const auto got = dev.get(n.out, rows * stride);
          const auto& want = in_place ? ref_x : ref_out;
          EXPECT_LE(worst_ulps(got, want, type), 1)
              << type_name(type) << " width " << width << " residual " << with_residual
              << " in place " << in_place;
          EXPECT_EQ(dev.get(dres, rows * stride), with_residual ? ref_res : residual);
        }
      }
    }
  }
}

TEST_P(RowOps, RotaryMatchesTheReferenceToTheBitOnStridedHeads) {
  Stream s(backend_);
  for (const HalfType type : {HalfType::BFloat16, HalfType::Float16}) {
    for (const std::size_t d : {64u, 128u, 256u}) {
      // q and k as views of one projection's output: [batch][heads + kv][d], strides > d apart.
      const std::size_t batch = 3, qh = 32, kh = 8, row = (qh + kh) * d + 16;
      const auto qk = random_halves(batch * row, 1.5f, type, d);
      const auto cos = random_halves(batch * d * 2, 0.7f, type, d + 1);
      const auto sin = random_halves(batch * d * 2, 0.7f, type, d + 2);
      auto ref = qk;
      Rotary r;
      r.type = type;
      r.batch = batch;
      r.q_heads = qh;
      r.k_heads = kh;
      r.head_dim = d;
      r.q_stride[0] = r.k_stride[0] = static_cast<std::int64_t>(row);
      r.q_stride[1] = r.k_stride[1] = static_cast<std::int64_t>(d);
      r.cos_stride = r.sin_stride = static_cast<std::int64_t>(2 * d);
      r.q = ref.data();
      r.k = ref.data() + qh * d;
      r.cos = cos.data();
      r.sin = sin.data();
      rotary(r);
      Device dev(backend_, s);
      auto* dqk = static_cast<Half*>(dev.put(qk));
      r.q = dqk;
      r.k = dqk + qh * d;
      r.cos = dev.put(cos);
      r.sin = dev.put(sin);
      backend_->rotary_async(r, s.handle());
      EXPECT_EQ(dev.get(dqk, qk.size()), ref) << type_name(type) << " head_dim " << d;
    }
  }
}

TEST_P(RowOps, SiluMulMatchesTheReferenceIntoGateAndApart) {
  Stream s(backend_);
  for (const HalfType type : {HalfType::BFloat16, HalfType::Float16}) {
    for (const bool into_gate : {false, true}) {
      const std::size_t rows = 2, width = 14336;
      const auto gate = random_halves(rows * width, 3.0f, type, 20);
      const auto up = random_halves(rows * width, 1.0f, type, 21);
      std::vector<Half> ref(rows * width);
      SiluMul op;
      op.type = type;
      op.rows = rows;
      op.width = width;
      op.gate_stride = op.up_stride = op.out_stride = static_cast<std::int64_t>(width);
      op.gate = gate.data();
      op.up = up.data();
      op.out = ref.data();
      silu_mul(op);
      Device dev(backend_, s);
      void* dgate = dev.put(gate);
      void* dout = dev.put(std::vector<Half>(rows * width, 0));
      op.gate = dgate;
      op.up = dev.put(up);
      op.out = into_gate ? dgate : dout;
      backend_->silu_mul_async(op, s.handle());
      EXPECT_LE(worst_ulps(dev.get(op.out, rows * width), ref, type), 1)
          << type_name(type) << " into gate " << into_gate;
    }
  }
}

TEST_P(RowOps, BadArgumentsAreNamed) {
  Stream s(backend_);
  Half a[8] = {}, b[8] = {}, c[8] = {};
  const auto named = [](const std::function<void()>& call, const std::string& word) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one naming " << word;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
    }
  };
  RmsNorm n;
  n.rows = 1;
  n.width = 8;
  n.x = a;
  n.weight = b;
  n.out = c;
  n.eps = 1e-6f;
  RmsNorm bad = n;
  bad.width = 0;
  named([&] { backend_->rms_norm_async(bad, s.handle()); }, "width");
  bad = n;
  bad.weight = nullptr;
  named([&] { backend_->rms_norm_async(bad, s.handle()); }, "weight");
  bad = n;
  bad.residual = c;
  named([&] { backend_->rms_norm_async(bad, s.handle()); }, "residual");
  bad = n;
  bad.rows = 2;
  bad.x_stride = 4;
  bad.out_stride = 8;
  named([&] { backend_->rms_norm_async(bad, s.handle()); }, "x 4");
  bad = n;
  bad.eps = -1.0f;
  named([&] { backend_->rms_norm_async(bad, s.handle()); }, "eps");
  Rotary r;
  r.batch = 1;
  r.q_heads = 1;
  r.head_dim = 7;
  r.q = a;
  r.cos = b;
  r.sin = c;
  named([&] { backend_->rotary_async(r, s.handle()); }, "head_dim must be even");
  r.head_dim = 8;
  r.sin = nullptr;
  named([&] { backend_->rotary_async(r, s.handle()); }, "sin");
  SiluMul op;
  op.rows = 1;
  op.width = 8;
  op.gate = a;
  op.out = c;
  named([&] { backend_->silu_mul_async(op, s.handle()); }, "up");
  // Nothing to compute: nothing checked.
  EXPECT_NO_THROW(backend_->rms_norm_async(RmsNorm{}, s.handle()));
  EXPECT_NO_THROW(backend_->rotary_async(Rotary{}, s.handle()));
  EXPECT_NO_THROW(backend_->silu_mul_async(SiluMul{}, s.handle()));
  s.synchronize();
}

INSTANTIATE_TEST_SUITE_P(Backends, RowOps, ::testing::Values(BackendKind::Host, BackendKind::Cuda),
                         backend_param_name);

}  // namespace
}  // namespace reviva::test
