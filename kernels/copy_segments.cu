// Coalesced copy of many small segments in one kernel launch (see launchers.h).
#include "launchers.h"

#include <algorithm>

namespace reviva::kernels {
namespace {

constexpr int kThreads = 256;
// Segments handled by one block; a block walks its segments one after another, so that a batch
// of thousands of tiny segments needs few blocks.
constexpr int kMaxBlocks = 4096;

__device__ inline bool aligned16(const void* p) {
  return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0;
}

__global__ void copy_segments_kernel(const CopySegment* __restrict__ segments, std::size_t count) {
  for (std::size_t s = blockIdx.x; s < count; s += gridDim.x) {
    const CopySegment seg = segments[s];
    const char* src = static_cast<const char*>(seg.src);
    char* dst = static_cast<char*>(seg.dst);
    std::size_t done = 0;
    if (aligned16(src) && aligned16(dst)) {
      // 16-byte accesses for the aligned body: 4x fewer transactions over PCIe.
      const std::size_t vecs = seg.bytes / 16;
      const uint4* s4 = reinterpret_cast<const uint4*>(src);
      uint4* d4 = reinterpret_cast<uint4*>(dst);
      for (std::size_t i = threadIdx.x; i < vecs; i += blockDim.x) d4[i] = s4[i];
      done = vecs * 16;
    }
    for (std::size_t i = done + threadIdx.x; i < seg.bytes; i += blockDim.x) dst[i] = src[i];
  }
}

}  // namespace

cudaError_t launch_copy_segments(const CopySegment* segments, std::size_t count,
                                 cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const int blocks = static_cast<int>(std::min<std::size_t>(count, kMaxBlocks));
  copy_segments_kernel<<<blocks, kThreads, 0, stream>>>(segments, count);
  return cudaGetLastError();
}

cudaError_t preload_copy_segments() {
  cudaFuncAttributes attributes{};
  return cudaFuncGetAttributes(&attributes, copy_segments_kernel);  // forces the module load
}

}  // namespace reviva::kernels
