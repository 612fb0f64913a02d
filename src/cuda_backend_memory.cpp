// CudaBackend's memory (see cuda_backend_impl.h): pinned host memory (Note [Pinning by
// registration]), stream-ordered device memory (cudaMallocAsync / cudaFreeAsync), and the driver's
// virtual memory management calls that the device arena maps its memory with.
#include "cuda_backend_impl.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>

#include <sys/mman.h>

namespace reviva::detail {

// Note [Pinning by registration]
// Pinned memory is anonymous memory, asked for in huge pages and touched by a few threads, then
// registered (cudaHostRegister), not cudaHostAlloc'ed: measured on the H200 host
// (benchmarks/bench_pinning.py, pinning-2026-12-01-1de38c6.json) cudaHostAlloc pins 0.40 ms per
// MB and holds the driver while it does, so that a thread launching kernels meanwhile waits
// as long; populating took 0.028 ms per MB with no CUDA call and registering 0.027. Both
// CUDA calls wait for the device's queued work, so pinning belongs before a call's compute.
// Where the device cannot use a registered host pointer as its own, cudaHostAlloc it is.
void* CudaBackend::allocate_pinned_host(std::size_t bytes) {
  REVIVA_CHECK_ARG(bytes > 0, "allocate_pinned_host: bytes must be > 0");
  DeviceGuard guard(device_);
  if (!register_host_) return host_alloc(bytes);
  const std::size_t size = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  // Over-map by a huge page, then trim, so that the range starts on a huge-page boundary.
  void* raw = mmap(nullptr, size + kHugePage, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED)
    throw OutOfMemory(detail::concat("mmap of ", size, " bytes of host memory failed"));
  const auto base = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t start = (base + kHugePage - 1) / kHugePage * kHugePage;
  if (start > base) munmap(raw, start - base);
  if (const std::uintptr_t end = start + size; base + size + kHugePage > end)
    munmap(reinterpret_cast<void*>(end), base + size + kHugePage - end);
  char* p = reinterpret_cast<char*>(start);
  madvise(p, size, MADV_HUGEPAGE);  // a hint: 4 KiB pages work too, only slower to pin
  populate(p, size);
  const cudaError_t status =
      cudaHostRegister(p, size, cudaHostRegisterPortable | cudaHostRegisterMapped);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    munmap(p, size);
    if (status == cudaErrorMemoryAllocation || status == cudaErrorHostMemoryAlreadyRegistered)
      throw OutOfMemory(
          detail::concat("cudaHostRegister of ", size,
                         " bytes of host memory failed: ", cudaGetErrorString(status)));
    REVIVA_CUDA_CHECK(status);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  registered_[p] = size;
  return p;
}

void CudaBackend::free_pinned_host(void* ptr) noexcept {
  if (!ptr) return;
  std::size_t size = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = registered_.find(ptr);
    if (it != registered_.end()) {
      size = it->second;
      registered_.erase(it);
    }
  }
  if (size == 0) {
    REVIVA_CUDA_WARN(cudaFreeHost(ptr));
    return;
  }
  REVIVA_CUDA_WARN(cudaHostUnregister(ptr));
  munmap(ptr, size);
}

void* CudaBackend::allocate_device(std::size_t bytes, StreamHandle stream) {
  REVIVA_CHECK_ARG(bytes > 0, "allocate_device: bytes must be > 0");
  DeviceGuard guard(device_);
  void* p = nullptr;
  const cudaError_t status = cudaMallocAsync(&p, bytes, as_stream(stream));
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    std::size_t free_bytes = 0, total_bytes = 0;
    (void)cudaMemGetInfo(&free_bytes, &total_bytes);
    throw OutOfMemory(detail::concat("cudaMallocAsync of ", bytes, " bytes on ", name(),
                                     " failed: ", free_bytes, " of ", total_bytes, " bytes free"));
  }
  REVIVA_CUDA_CHECK(status);
  return p;
}

void CudaBackend::free_device(void* ptr, StreamHandle stream) noexcept {
  if (!ptr) return;
  try {
    DeviceGuard guard(device_);
    REVIVA_CUDA_WARN(cudaFreeAsync(ptr, as_stream(stream)));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "reviva: warning: free_device: %s\n", e.what());
  }
}

DeviceMemoryInfo CudaBackend::device_memory_info() {
  DeviceGuard guard(device_);
  DeviceMemoryInfo info;
  REVIVA_CUDA_CHECK(cudaMemGetInfo(&info.free_bytes, &info.total_bytes));
  return info;
}

MemoryKind CudaBackend::memory_kind(const void* ptr) {
  cudaPointerAttributes attributes{};
  REVIVA_CUDA_CHECK(cudaPointerGetAttributes(&attributes, ptr));
  switch (attributes.type) {
    case cudaMemoryTypeUnregistered: return MemoryKind::Pageable;
    case cudaMemoryTypeHost: return MemoryKind::PinnedHost;
    case cudaMemoryTypeDevice: return MemoryKind::Device;
    case cudaMemoryTypeManaged: return MemoryKind::Managed;
  }
  return MemoryKind::Unknown;
}

void* CudaBackend::reserve_address(std::size_t bytes) {
  check_vmm(bytes, "reserve_address");
  CUdeviceptr p = 0;
  driver_check(driver_.address_reserve(&p, bytes, granularity_, 0, 0), "cuMemAddressReserve",
               bytes);
  return reinterpret_cast<void*>(p);
}

void CudaBackend::release_address(void* ptr, std::size_t bytes) noexcept {
  if (!ptr) return;
  const CUresult r = driver_.address_free(reinterpret_cast<CUdeviceptr>(ptr), bytes);
  if (r != CUDA_SUCCESS)
    std::fprintf(stderr, "reviva: warning: cuMemAddressFree of %zu bytes failed: %s\n", bytes,
                 driver_.describe(r).c_str());
}

// New physical memory, mapped and made accessible; the handle is released at once (the memory
// lives until the range is unmapped), so unmap_memory needs nothing but the range.
void CudaBackend::map_memory(void* ptr, std::size_t bytes) {
  check_vmm(bytes, "map_memory");
  DeviceGuard guard(device_);
  CUmemGenericAllocationHandle handle{};
  const CUresult created = driver_.create(&handle, bytes, &prop_, 0);
  if (created == CUDA_ERROR_OUT_OF_MEMORY) {
    std::size_t free_bytes = 0, total_bytes = 0;
    (void)cudaMemGetInfo(&free_bytes, &total_bytes);
    throw OutOfMemory(detail::concat("cuMemCreate of ", bytes, " bytes on ", name(),
                                     " failed: ", free_bytes, " of ", total_bytes, " bytes free"));
  }
  driver_check(created, "cuMemCreate", bytes);
  const auto p = reinterpret_cast<CUdeviceptr>(ptr);
  CUresult r = driver_.map(p, bytes, 0, handle, 0);
  if (r == CUDA_SUCCESS) {
    CUmemAccessDesc access{};
    access.location = prop_.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = driver_.set_access(p, bytes, &access, 1);
    if (r != CUDA_SUCCESS) (void)driver_.unmap(p, bytes);
  }
  (void)driver_.release(handle);  // freed with the mapping from now on (or now, on failure)
  driver_check(r, "cuMemMap/cuMemSetAccess", bytes);
}

void CudaBackend::unmap_memory(void* ptr, std::size_t bytes) noexcept {
  if (!ptr) return;
  const CUresult r = driver_.unmap(reinterpret_cast<CUdeviceptr>(ptr), bytes);
  if (r != CUDA_SUCCESS)
    std::fprintf(stderr, "reviva: warning: cuMemUnmap of %zu bytes failed: %s\n", bytes,
                 driver_.describe(r).c_str());
}

void* CudaBackend::host_alloc(std::size_t bytes) {
  void* p = nullptr;
  const cudaError_t status = cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped);
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    throw OutOfMemory(detail::concat("cudaHostAlloc of ", bytes,
                                     " bytes of pinned host memory failed (out of memory)"));
  }
  REVIVA_CUDA_CHECK(status);
  return p;
}

// Touches every page (the kernel backs it now, in huge pages where it can), on a few threads
// for large ranges: page faults and zeroing are the cost, and they parallelize.
void CudaBackend::populate(char* p, std::size_t size) {
  constexpr std::size_t kPage = 4096;
  const std::size_t per_thread = std::size_t{64} << 20;
  const std::size_t hw = std::max(1u, std::thread::hardware_concurrency());
  const std::size_t n = std::clamp<std::size_t>(size / per_thread, 1, std::min<std::size_t>(hw, 8));
  const std::size_t chunk = (size / n + kPage - 1) / kPage * kPage;
  auto touch = [p, size](std::size_t from, std::size_t to) {
    for (std::size_t off = from; off < std::min(to, size); off += kPage)
      static_cast<volatile char*>(p)[off] = 0;
  };
  std::vector<std::thread> threads;
  for (std::size_t i = 1; i < n; ++i) threads.emplace_back(touch, i * chunk, (i + 1) * chunk);
  touch(0, chunk);
  for (auto& t : threads) t.join();
}

void CudaBackend::check_vmm(std::size_t bytes, const char* what) const {
  if (granularity_ == 0)
    throw BackendError(detail::concat(what, ": ", name(),
                                      " has no virtual memory management (or the driver lacks "
                                      "it): the device arena is unavailable"));
  REVIVA_CHECK_ARG(bytes > 0 && bytes % granularity_ == 0, what, ": ", bytes,
                   " bytes is not a positive multiple of the ", granularity_, "-byte granularity");
}

void CudaBackend::driver_check(CUresult r, const char* call, std::size_t bytes) const {
  if (r != CUDA_SUCCESS)
    throw BackendError(detail::concat(call, " of ", bytes, " bytes on ", name(),
                                      " failed: ", driver_.describe(r)));
}

}  // namespace reviva::detail
