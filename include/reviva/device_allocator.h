// DeviceAllocator: how the core obtains device memory for the blocks it manages.
//
// Allocation is stream-ordered: memory returned by allocate(bytes, s) may be used by work
// submitted to `s` after the call (other streams must be ordered after `s` by events), and
// deallocate(p, bytes, s) makes it reusable only once the work submitted to `s` before the call
// has completed. The default implementation is cudaMallocAsync / cudaFreeAsync on the backend;
// the Python binding supplies one on PyTorch's caching allocator, so that Reviva and PyTorch
// share one pool and one budget.
#pragma once

#include <reviva/backend.h>
#include <reviva/export.h>

#include <cstddef>
#include <memory>
#include <string>

namespace reviva {

class REVIVA_API DeviceAllocator {
 public:
  virtual ~DeviceAllocator();
  // Throws OutOfMemory naming the numbers when the memory cannot be had.
  virtual void* allocate(std::size_t bytes, StreamHandle stream) = 0;
  virtual void deallocate(void* ptr, std::size_t bytes, StreamHandle stream) noexcept = 0;
  virtual std::string name() const = 0;
  // Whether memory freed on one stream is given to a later allocation on another stream only
  // after that stream waits, on the device, for the free (never while the free is pending): the
  // OffloadManager then counts a freed block's bytes as free at once instead of holding them
  // against its budget until the host sees the free complete (Note [Stream-ordered frees] in
  // offload_manager_impl.h). False unless the allocator guarantees it.
  virtual bool reuses_in_stream_order() const noexcept { return false; }

  // Growable allocations (the OffloadManager's append blocks: a K/V layer growing a token at a
  // time). allocate_growable backs `bytes` of an allocation that may later grow in place up to
  // `capacity`; grow() backs its first `bytes`, false when no memory can be had (the allocation
  // is then unchanged). An allocator that cannot grow in place (grows_in_place() false) allocates
  // `capacity` at once, and the manager counts all of it. deallocate takes the bytes backed.
  // `fresh`: memory the allocator does not keep for reuse (a block that stays for good must not
  // take what blocks that come and go reuse).
  virtual bool grows_in_place() const noexcept { return false; }
  virtual void* allocate_growable(std::size_t bytes, std::size_t capacity, StreamHandle stream,
                                  bool fresh = false) {
    (void)bytes;
    (void)fresh;
    return allocate(capacity, stream);
  }
  virtual bool grow(void* ptr, std::size_t bytes) {
    (void)ptr;
    (void)bytes;
    return false;
  }
};

// The backend's own stream-ordered allocator (cudaMallocAsync on CUDA).
REVIVA_API std::shared_ptr<DeviceAllocator> make_backend_device_allocator(
    std::shared_ptr<Backend> backend);

}  // namespace reviva
