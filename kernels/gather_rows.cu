// Table rows by index in one kernel (see launchers.h; Note [Embedding on the host] in
// python/reviva/weights/host_embedding.py): an embedding's lookup whose table may stay in pinned
// host memory.
#include <algorithm>
#include <cstdint>

#include "launchers.h"

namespace reviva::kernels {
namespace {

constexpr int kThreads = 256;
constexpr std::size_t kMaxBlocks = 8192;

// Each block copies whole rows, `Word` bytes per access (16, 4 or 1, as the addresses allow);
// reads of a host table are then full-width requests over the bus, many in flight at once.
template <typename Word>
__global__ void gather_rows_kernel(RowGatherArgs a) {
  const std::size_t words = a.row_bytes / sizeof(Word);
  for (std::size_t r = blockIdx.x; r < a.count; r += gridDim.x) {
    const std::int64_t id = a.ids[r];
    Word* out = reinterpret_cast<Word*>(static_cast<unsigned char*>(a.out) + r * a.row_bytes);
    if (id < 0 || static_cast<std::uint64_t>(id) >= a.rows) {
      for (std::size_t j = threadIdx.x; j < words; j += blockDim.x) out[j] = Word{};
      continue;
    }
    const Word* row = reinterpret_cast<const Word*>(static_cast<const unsigned char*>(a.table) +
                                                    static_cast<std::size_t>(id) * a.row_bytes);
    for (std::size_t j = threadIdx.x; j < words; j += blockDim.x) out[j] = row[j];
  }
}

bool aligned(std::uintptr_t x, std::uintptr_t unit) { return x % unit == 0; }

}  // namespace

cudaError_t launch_gather_rows(const RowGatherArgs& a, cudaStream_t stream) {
  if (a.count == 0) return cudaSuccess;
  if (a.table == nullptr || a.ids == nullptr || a.out == nullptr || a.row_bytes == 0)
    return cudaErrorInvalidValue;
  const int blocks = static_cast<int>(std::min(a.count, kMaxBlocks));
  const auto table = reinterpret_cast<std::uintptr_t>(a.table);
  const auto out = reinterpret_cast<std::uintptr_t>(a.out);
  if (aligned(table, 16) && aligned(out, 16) && aligned(a.row_bytes, 16))
    gather_rows_kernel<uint4><<<blocks, kThreads, 0, stream>>>(a);
  else if (aligned(table, 4) && aligned(out, 4) && aligned(a.row_bytes, 4))
    gather_rows_kernel<std::uint32_t><<<blocks, kThreads, 0, stream>>>(a);
  else
    gather_rows_kernel<unsigned char><<<blocks, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace reviva::kernels
