// Backend-independent helpers, and the CUDA entry points of a build without CUDA.
#include <reviva/backend.h>
#include <reviva/error.h>

#include "half_bits.h"

#include <cstdint>
#include <cstring>

namespace reviva {

Backend::~Backend() = default;

const char* to_string(BackendKind kind) noexcept {
  switch (kind) {
    case BackendKind::Host: return "host";
    case BackendKind::Cuda: return "cuda";
  }
  return "?";
}

const char* to_string(MemoryKind kind) noexcept {
  switch (kind) {
    case MemoryKind::Unknown: return "unknown";
    case MemoryKind::Pageable: return "pageable host";
    case MemoryKind::PinnedHost: return "pinned host";
    case MemoryKind::Device: return "device";
    case MemoryKind::Managed: return "managed";
  }
  return "?";
}

void check_fp8_rows(const Fp8Rows& rows, const void* out) {
  REVIVA_CHECK_ARG(rows.head_dim > 0 && rows.head_dim % 4 == 0,
                   "dequantize_fp8_rows: head_dim must be a positive multiple of 4, got ",
                   rows.head_dim);
  const std::size_t count = rows.count[0] * rows.count[1] * rows.count[2];
  if (count == 0) return;
  REVIVA_CHECK_ARG(rows.base != nullptr && out != nullptr, "dequantize_fp8_rows: null pointer");
  REVIVA_CHECK_ARG(reinterpret_cast<std::uintptr_t>(rows.base) % 4 == 0,
                   "dequantize_fp8_rows: rows at ", rows.base,
                   " are not 4-byte aligned (each row's fp32 scale is read whole)");
  for (int d = 0; d < 3; ++d)
    REVIVA_CHECK_ARG(rows.stride[d] % 4 == 0, "dequantize_fp8_rows: stride ", d, " of ",
                     rows.stride[d], " bytes is not a multiple of 4");
}

using detail::e4m3_to_float;
using detail::to_bf16;
using detail::to_fp16;

void dequantize_fp8_rows(const Fp8Rows& rows, void* out, HalfType type) {
  check_fp8_rows(rows, out);
  auto* o = static_cast<std::uint16_t*>(out);
  const auto* base = static_cast<const std::uint8_t*>(rows.base);
  for (std::size_t i0 = 0; i0 < rows.count[0]; ++i0)
    for (std::size_t i1 = 0; i1 < rows.count[1]; ++i1)
      for (std::size_t i2 = 0; i2 < rows.count[2]; ++i2) {
        const std::uint8_t* row = base + static_cast<std::int64_t>(i0) * rows.stride[0] +
                                  static_cast<std::int64_t>(i1) * rows.stride[1] +
                                  static_cast<std::int64_t>(i2) * rows.stride[2];
        float scale;
        std::memcpy(&scale, row + rows.head_dim, 4);
        for (std::size_t j = 0; j < rows.head_dim; ++j) {
          const float v = e4m3_to_float(row[j]) * scale;
          *o++ = type == HalfType::BFloat16 ? to_bf16(v) : to_fp16(v);
        }
      }
}

void check_row_gather(const RowGather& g) {
  if (g.count == 0) return;
  REVIVA_CHECK_ARG(g.row_bytes > 0, "gather_rows: row_bytes must be > 0");
  REVIVA_CHECK_ARG(g.rows > 0, "gather_rows: the table has no rows (", g.count, " rows asked for)");
  REVIVA_CHECK_ARG(g.table != nullptr && g.ids != nullptr && g.out != nullptr,
                   "gather_rows: null pointer (table ", g.table, ", ids ",
                   static_cast<const void*>(g.ids), ", out ", g.out, ")");
}

void gather_rows(const RowGather& g) {
  check_row_gather(g);
  const auto* table = static_cast<const std::uint8_t*>(g.table);
  auto* out = static_cast<std::uint8_t*>(g.out);
  for (std::size_t i = 0; i < g.count; ++i, out += g.row_bytes) {
    const std::int64_t id = g.ids[i];
    if (id < 0 || static_cast<std::uint64_t>(id) >= g.rows)
      std::memset(out, 0, g.row_bytes);
    else
      std::memcpy(out, table + static_cast<std::size_t>(id) * g.row_bytes, g.row_bytes);
  }
}

std::shared_ptr<Backend> make_default_backend() {
  if (cuda_available()) return make_cuda_backend(0);
  return make_host_backend();
}

#if !defined(REVIVA_WITH_CUDA)
bool cuda_available() noexcept { return false; }
int cuda_device_count() noexcept { return 0; }
std::shared_ptr<Backend> make_cuda_backend(int device) {
  throw BackendError(detail::concat("cannot create the CUDA backend on device ", device,
                                    ": this build of Reviva has no CUDA (REVIVA_WITH_CUDA=OFF)"));
}
#endif

}  // namespace reviva
