// fp8 K/V rows to 16-bit values (Backend::dequantize_fp8_rows_async; Note [fp8 K/V rows] in
// python/reviva/cache/fp8.py): known values, every e4m3 byte, strided views, both output types,
// the same bits on both backends as the host reference, and bad arguments named.
#include "test_util.h"

#include <cmath>
#include <cstring>
#include <vector>

namespace reviva::test {
namespace {

using Fp8Dequantize = BackendTest;

constexpr std::size_t kHeadDim = 128;
constexpr std::size_t kRow = kHeadDim + 4;

float bf16_value(std::uint16_t bits) {
  const std::uint32_t wide = static_cast<std::uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, 4);
  return f;
}

// Rows [tokens][2][heads] of kRow bytes (the store's token-major K and V); K's view selected.
struct Layout {
  std::size_t tokens = 37, heads = 3;
  std::size_t bytes() const { return tokens * 2 * heads * kRow; }
  Fp8Rows keys(const void* base) const {
    Fp8Rows r;
    r.base = base;
    r.count[0] = tokens;
    r.count[1] = 1;
    r.count[2] = heads;
    r.stride[0] = static_cast<std::int64_t>(2 * heads * kRow);
    r.stride[1] = 0;
    r.stride[2] = static_cast<std::int64_t>(kRow);
    r.head_dim = kHeadDim;
    return r;
  }
};

// Every e4m3 byte but the two NaNs, and a scale per row (fp32, some negative powers of two).
std::vector<std::uint8_t> make_rows(const Layout& l, std::uint64_t seed) {
  std::vector<std::uint8_t> rows = random_bytes(l.bytes(), seed);
  for (std::size_t r = 0; r < l.bytes() / kRow; ++r) {
    std::uint8_t* row = rows.data() + r * kRow;
    for (std::size_t j = 0; j < kHeadDim; ++j) {
      if ((row[j] & 0x7F) == 0x7F) row[j] &= 0xFE;  // no NaN
    }
    const float scale =
        std::ldexp(1.0f + static_cast<float>(r % 7) / 7.0f, static_cast<int>(r % 11) - 8);
    std::memcpy(row + kHeadDim, &scale, 4);
  }
  return rows;
}

// Runs the backend's dequantization of `l`'s keys (the rows copied to device memory) and
// returns its output.
std::vector<std::uint16_t> run(const std::shared_ptr<Backend>& backend, const Layout& l,
                               const std::vector<std::uint8_t>& rows, HalfType type) {
  Stream s(backend);
  const std::size_t out_bytes = l.tokens * l.heads * kHeadDim * 2;
  void* host_in = backend->allocate_pinned_host(rows.size());
  void* host_out = backend->allocate_pinned_host(out_bytes);
  void* dev_in = backend->allocate_device(rows.size(), s.handle());
  void* dev_out = backend->allocate_device(out_bytes, s.handle());
  std::memcpy(host_in, rows.data(), rows.size());
  backend->copy_async(dev_in, host_in, rows.size(), s.handle());
  backend->dequantize_fp8_rows_async(l.keys(dev_in), dev_out, type, s.handle());
  backend->copy_async(host_out, dev_out, out_bytes, s.handle());
  s.synchronize();
  std::vector<std::uint16_t> out(out_bytes / 2);
  std::memcpy(out.data(), host_out, out_bytes);
  backend->free_device(dev_in, s.handle());
  backend->free_device(dev_out, s.handle());
  s.synchronize();
  backend->free_pinned_host(host_in);
  backend->free_pinned_host(host_out);
  return out;
}

TEST(Fp8Reference, KnownValues) {
  // 1.0 (0x38), 448 (0x7E), -1.0 (0xB8), the smallest subnormal 2^-9 (0x01), zero, then 1.5.
  std::uint8_t row[kRow] = {0x38, 0x7E, 0xB8, 0x01, 0x00, 0x3C};
  const float scale = 2.0f;
  std::memcpy(row + kHeadDim, &scale, 4);
  Fp8Rows r;
  r.base = row;
  r.count[0] = r.count[1] = r.count[2] = 1;
  r.head_dim = kHeadDim;
  alignas(4) std::uint16_t out[kHeadDim];
  dequantize_fp8_rows(r, out, HalfType::BFloat16);
  const float want[] = {2.0f, 896.0f, -2.0f, std::ldexp(1.0f, -8), 0.0f, 3.0f};
  for (int j = 0; j < 6; ++j) EXPECT_EQ(bf16_value(out[j]), want[j]) << j;
  dequantize_fp8_rows(r, out, HalfType::Float16);
  EXPECT_EQ(out[0], 0x4000);  // 2.0 in fp16
  EXPECT_EQ(out[1], 0x6300);  // 896.0 in fp16
  EXPECT_EQ(out[2], 0xC000);  // -2.0
}

TEST(Fp8Reference, EveryByteAgreesWithTheFormula) {
  // value = (-1)^s * 2^(e-7) * (1 + m/8), subnormals m * 2^-9; scale 1, bf16 holds them exactly.
  alignas(4) std::uint8_t row[256 + 4];
  for (int b = 0; b < 256; ++b) row[b] = static_cast<std::uint8_t>(b);
  const float one = 1.0f;
  std::memcpy(row + 256, &one, 4);
  Fp8Rows r;
  r.base = row;
  r.count[0] = r.count[1] = r.count[2] = 1;
  r.head_dim = 256;
  std::uint16_t out[256];
  dequantize_fp8_rows(r, out, HalfType::BFloat16);
  for (int b = 0; b < 256; ++b) {
    const int e = (b >> 3) & 15, m = b & 7;
    if (e == 15 && m == 7) {
      EXPECT_TRUE(std::isnan(bf16_value(out[b]))) << b;
      continue;
    }
    float v = e == 0 ? std::ldexp(static_cast<float>(m), -9)
                     : std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
    if (b & 0x80) v = -v;
    EXPECT_EQ(bf16_value(out[b]), v) << b;
  }
}

TEST_P(Fp8Dequantize, StridedKeysGiveTheReferenceBits) {
  const Layout l;
  const std::vector<std::uint8_t> rows = make_rows(l, 91);
  for (HalfType type : {HalfType::BFloat16, HalfType::Float16}) {
    std::vector<std::uint16_t> want(l.tokens * l.heads * kHeadDim);
    dequantize_fp8_rows(l.keys(rows.data()), want.data(), type);
    const std::vector<std::uint16_t> got = run(backend_, l, rows, type);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * 2), 0);
    // and the values: K rows only (V rows, interleaved, are not read)
    const std::uint8_t* k = rows.data() + (l.heads - 1) * kRow;  // token 0, last head
    alignas(4) std::uint8_t one_row[kRow];
    std::memcpy(one_row, k, kRow);
    Fp8Rows single;
    single.base = one_row;
    single.count[0] = single.count[1] = single.count[2] = 1;
    single.head_dim = kHeadDim;
    std::vector<std::uint16_t> alone(kHeadDim);
    dequantize_fp8_rows(single, alone.data(), type);
    EXPECT_EQ(std::memcmp(alone.data(), want.data() + (l.heads - 1) * kHeadDim, kHeadDim * 2), 0);
  }
}

TEST_P(Fp8Dequantize, BadArgumentsAreNamed) {
  Stream s(backend_);
  alignas(4) std::uint8_t row[kRow] = {};
  std::uint16_t out[kHeadDim];
  Fp8Rows r;
  r.base = row;
  r.count[0] = r.count[1] = r.count[2] = 1;
  r.head_dim = 6;
  EXPECT_THROW(backend_->dequantize_fp8_rows_async(r, out, HalfType::BFloat16, s.handle()),
               InvalidArgument);
  r.head_dim = kHeadDim;
  r.stride[0] = 130;
  try {
    backend_->dequantize_fp8_rows_async(r, out, HalfType::BFloat16, s.handle());
    ADD_FAILURE() << "a stride of 130 bytes was taken";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("130"), std::string::npos) << e.what();
  }
  r.base = row + 2;
  r.count[0] = 1;
  r.stride[0] = 0;
  EXPECT_THROW(backend_->dequantize_fp8_rows_async(r, out, HalfType::BFloat16, s.handle()),
               InvalidArgument);
  s.synchronize();
}

INSTANTIATE_TEST_SUITE_P(Backends, Fp8Dequantize,
                         ::testing::Values(BackendKind::Host, BackendKind::Cuda),
                         backend_param_name);

}  // namespace
}  // namespace reviva::test
