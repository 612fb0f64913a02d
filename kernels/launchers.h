// Launchers of the CUDA kernels the core owns. Each takes raw pointers, sizes and an explicit
// stream, and returns the launch status; none of them uses the default stream or includes torch.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace reviva::kernels {

// One segment of a coalesced copy. Either side may be device memory or mapped pinned host
// memory (with unified addressing, pinned host pointers are valid in kernels).
struct CopySegment {
  const void* src;
  void* dst;
  std::size_t bytes;
};

// Copies `count` independent segments in one launch: the way many small copies become one
// operation instead of `count` DMA submissions, each with its own fixed cost.
// `segments` must be readable by the device (device memory or mapped pinned host memory) and
// stay valid until the launch completes on `stream`.
cudaError_t launch_copy_segments(const CopySegment* segments,  // [count]
                                 std::size_t count, cudaStream_t stream);

// Loads the segment-copy kernel now. Under CUDA's lazy module loading (the default since CUDA
// 12) a kernel's first launch loads its module, which can wait for work in flight on the device;
// called once when a backend is made, so that no copy pays that mid-stream.
cudaError_t preload_copy_segments();

}  // namespace reviva::kernels
