// The CUDA backend: the Backend interface on one CUDA device. Streams are non-blocking (never
// synchronised with the legacy default stream), events are created without timing unless asked,
// device memory is stream-ordered (cudaMallocAsync / cudaFreeAsync), and pinned host memory is
// portable and mapped so that the segment-copy kernel can read and write it directly.
// Every call runs with this backend's device current and restores the caller's afterwards.
#include "cuda_check.h"
#include "launchers.h"

#include <reviva/backend.h>
#include <reviva/error.h>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <sys/mman.h>

namespace reviva {
namespace {

static_assert(sizeof(CopySegment) == sizeof(kernels::CopySegment) &&
                  offsetof(CopySegment, src) == offsetof(kernels::CopySegment, src) &&
                  offsetof(CopySegment, dst) == offsetof(kernels::CopySegment, dst) &&
                  offsetof(CopySegment, bytes) == offsetof(kernels::CopySegment, bytes),
              "reviva::CopySegment and kernels::CopySegment must share one layout");

// Makes `device` current for the guard's lifetime.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    REVIVA_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device_) REVIVA_CUDA_CHECK(cudaSetDevice(device_));
  }
  ~DeviceGuard() {
    if (previous_ != device_) REVIVA_CUDA_WARN(cudaSetDevice(previous_));
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int previous_ = 0;
};

cudaStream_t as_stream(StreamHandle h) { return static_cast<cudaStream_t>(h); }
cudaEvent_t as_event(EventHandle h) { return static_cast<cudaEvent_t>(h); }

void host_func_trampoline(void* user_data) {
  std::unique_ptr<std::function<void()>> fn(static_cast<std::function<void()>*>(user_data));
  (*fn)();
}

// The driver's virtual memory management calls, looked up through the runtime at run time:
// linking libcuda would make the library fail to load on machines without a driver (CI), where
// the host backend must still work.
struct VmmDriver {
  PFN_cuMemAddressReserve_v10020 address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 address_free = nullptr;
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 granularity = nullptr;
  PFN_cuGetErrorName_v6000 error_name = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetAttribute_v2000 device_attribute = nullptr;

  // False when any call is missing (an old driver): the arena is then unavailable.
  bool load() {
    return get("cuMemAddressReserve", address_reserve) && get("cuMemAddressFree", address_free) &&
           get("cuMemCreate", create) && get("cuMemRelease", release) && get("cuMemMap", map) &&
           get("cuMemUnmap", unmap) && get("cuMemSetAccess", set_access) &&
           get("cuMemGetAllocationGranularity", granularity) && get("cuGetErrorName", error_name) &&
           get("cuDeviceGet", device_get) && get("cuDeviceGetAttribute", device_attribute);
  }

  // Whether `ordinal` supports cuMemCreate/cuMemMap (after load()).
  bool supported(int ordinal) const {
    CUdevice dev{};
    int vmm = 0;
    return device_get(&dev, ordinal) == CUDA_SUCCESS &&
           device_attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev) ==
               CUDA_SUCCESS &&
           vmm != 0;
  }

  std::string describe(CUresult r) const {
    const char* name = nullptr;
    if (error_name) error_name(r, &name);
    return name ? name : detail::concat("CUresult ", static_cast<int>(r));
  }

 private:
  template <typename Fn>
  static bool get(const char* symbol, Fn& fn) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t status =
        cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &found);
    if (status != cudaSuccess || found != cudaDriverEntryPointSuccess || p == nullptr) {
      (void)cudaGetLastError();
      return false;
    }
    fn = reinterpret_cast<Fn>(p);
    return true;
  }
};

kernels::Fp8DecodeArgs fp8_decode_args(const Fp8DecodeAttention& a, int sm_count) {
  kernels::Fp8DecodeArgs k{};
  k.bfloat16 = a.type == HalfType::BFloat16;
  k.batch = a.batch;
  k.heads = a.heads;
  k.kv_heads = a.kv_heads;
  k.head_dim = a.head_dim;
  k.q = a.q;
  k.k_new = a.k_new;
  k.v_new = a.v_new;
  k.k_rows = a.k_rows;
  k.v_rows = a.v_rows;
  for (int d = 0; d < 2; ++d) {
    k.q_stride[d] = a.q_stride[d];
    k.k_new_stride[d] = a.k_new_stride[d];
    k.v_new_stride[d] = a.v_new_stride[d];
    k.out_stride[d] = a.out_stride[d];
  }
  for (int d = 0; d < 3; ++d) k.row_stride[d] = a.row_stride[d];
  k.first_key = a.first_key;
  k.length = a.length;
  k.device_length = a.device_length;
  k.device_rows = a.device_rows;
  k.window = a.window;
  k.scale = a.scale;
  k.out = a.out;
  k.workspace = a.workspace;
  k.workspace_bytes = a.workspace_bytes;
  k.sm_count = sm_count;
  return k;
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    cudaDeviceProp prop{};
    REVIVA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
    device_name_ = prop.name;
    REVIVA_CHECK_ARG(prop.unifiedAddressing, "CUDA device ", device_, " (", device_name_,
                     ") lacks unified addressing, which Reviva needs");
    DeviceGuard guard(device_);
    REVIVA_CUDA_CHECK(cudaFree(nullptr));  // create the primary context now, not mid-copy
    // And load the segment-copy kernel now: its lazy load at a first launch can wait for the
    // device. The KVStore CUDA tests hung at their first append (issued while a host function
    // holds the compute stream) and pass on the H200 with this preload; not rerun without it.
    REVIVA_CUDA_CHECK(kernels::preload_copy_segments());
    REVIVA_CUDA_CHECK(kernels::preload_attend_fp8());
    REVIVA_CUDA_CHECK(kernels::preload_row_ops());
    REVIVA_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lowest_priority_, &highest_priority_));
    sm_count_ = prop.multiProcessorCount;
    int host_pointer = 0;
    REVIVA_CUDA_CHECK(cudaDeviceGetAttribute(
        &host_pointer, cudaDevAttrCanUseHostPointerForRegisteredMem, device_));
    register_host_ = host_pointer != 0;
    if (driver_.load() && driver_.supported(device_)) {
      prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      prop_.location.id = device_;
      std::size_t g = 0;
      if (driver_.granularity(&g, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM) == CUDA_SUCCESS)
        granularity_ = g;
    }
  }

  BackendKind kind() const noexcept override { return BackendKind::Cuda; }
  std::string name() const override {
    return "cuda:" + std::to_string(device_) + " (" + device_name_ + ")";
  }
  int device_index() const noexcept override { return device_; }

  StreamHandle create_stream(StreamPriority priority) override {
    DeviceGuard guard(device_);
    cudaStream_t s = nullptr;
    const int p = priority == StreamPriority::High ? highest_priority_ : lowest_priority_;
    REVIVA_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, p));
    return s;
  }

  void destroy_stream(StreamHandle stream) noexcept override {
    try {
      DeviceGuard guard(device_);
      REVIVA_CUDA_WARN(cudaStreamDestroy(as_stream(stream)));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "reviva: warning: destroy_stream: %s\n", e.what());
    }
  }

  void synchronize_stream(StreamHandle stream) override {
    REVIVA_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
  }

  void stream_wait_event(StreamHandle stream, EventHandle event) override {
    REVIVA_CUDA_CHECK(cudaStreamWaitEvent(as_stream(stream), as_event(event), 0));
  }

  void launch_host_func(StreamHandle stream, std::function<void()> fn) override {
    REVIVA_CHECK_ARG(fn != nullptr, "launch_host_func: empty function");
    auto holder = std::make_unique<std::function<void()>>(std::move(fn));
    REVIVA_CUDA_CHECK(cudaLaunchHostFunc(as_stream(stream), host_func_trampoline, holder.get()));
    holder.release();  // the trampoline owns it now
  }

  EventHandle create_event(bool enable_timing) override {
    DeviceGuard guard(device_);
    cudaEvent_t e = nullptr;
    REVIVA_CUDA_CHECK(
        cudaEventCreateWithFlags(&e, enable_timing ? cudaEventDefault : cudaEventDisableTiming));
    return e;
  }

  void destroy_event(EventHandle event) noexcept override {
    try {
      DeviceGuard guard(device_);
      REVIVA_CUDA_WARN(cudaEventDestroy(as_event(event)));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "reviva: warning: destroy_event: %s\n", e.what());
    }
  }

  void record_event(EventHandle event, StreamHandle stream) override {
    REVIVA_CUDA_CHECK(cudaEventRecord(as_event(event), as_stream(stream)));
  }

  bool query_event(EventHandle event) override {
    const cudaError_t status = cudaEventQuery(as_event(event));
    if (status == cudaSuccess) return true;
    if (status == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error: clear it so later checks don't see it
      return false;
    }
    detail::throw_cuda_error(status, "cudaEventQuery", __FILE__, __LINE__);
  }

  void synchronize_event(EventHandle event) override {
    REVIVA_CUDA_CHECK(cudaEventSynchronize(as_event(event)));
  }

  float elapsed_ms(EventHandle start, EventHandle end) override {
    float ms = 0.0f;
    REVIVA_CUDA_CHECK(cudaEventElapsedTime(&ms, as_event(start), as_event(end)));
    return ms;
  }

  // Note [Pinning by registration]
  // Pinned memory is anonymous memory, asked for in huge pages and touched by a few threads, then
  // registered (cudaHostRegister), not cudaHostAlloc'ed: measured on the H200 host
  // (benchmarks/bench_pinning.py, pinning-2026-12-01-1de38c6.json) cudaHostAlloc pins 0.40 ms per
  // MB and holds the driver while it does, so that a thread launching kernels meanwhile waits
  // as long; populating took 0.028 ms per MB with no CUDA call and registering 0.027. Both
  // CUDA calls wait for the device's queued work, so pinning belongs before a call's compute.
  // Where the device cannot use a registered host pointer as its own, cudaHostAlloc it is.
  void* allocate_pinned_host(std::size_t bytes) override {
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

  void free_pinned_host(void* ptr) noexcept override {
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

  void* allocate_device(std::size_t bytes, StreamHandle stream) override {
    REVIVA_CHECK_ARG(bytes > 0, "allocate_device: bytes must be > 0");
    DeviceGuard guard(device_);
    void* p = nullptr;
    const cudaError_t status = cudaMallocAsync(&p, bytes, as_stream(stream));
    if (status == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      std::size_t free_bytes = 0, total_bytes = 0;
      (void)cudaMemGetInfo(&free_bytes, &total_bytes);
      throw OutOfMemory(detail::concat("cudaMallocAsync of ", bytes, " bytes on ", name(),
                                       " failed: ", free_bytes, " of ", total_bytes,
                                       " bytes free"));
    }
    REVIVA_CUDA_CHECK(status);
    return p;
  }

  void free_device(void* ptr, StreamHandle stream) noexcept override {
    if (!ptr) return;
    try {
      DeviceGuard guard(device_);
      REVIVA_CUDA_WARN(cudaFreeAsync(ptr, as_stream(stream)));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "reviva: warning: free_device: %s\n", e.what());
    }
  }

  DeviceMemoryInfo device_memory_info() override {
    DeviceGuard guard(device_);
    DeviceMemoryInfo info;
    REVIVA_CUDA_CHECK(cudaMemGetInfo(&info.free_bytes, &info.total_bytes));
    return info;
  }

  MemoryKind memory_kind(const void* ptr) override {
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

  std::size_t vmm_granularity() override { return granularity_; }

  void* reserve_address(std::size_t bytes) override {
    check_vmm(bytes, "reserve_address");
    CUdeviceptr p = 0;
    driver_check(driver_.address_reserve(&p, bytes, granularity_, 0, 0), "cuMemAddressReserve",
                 bytes);
    return reinterpret_cast<void*>(p);
  }

  void release_address(void* ptr, std::size_t bytes) noexcept override {
    if (!ptr) return;
    const CUresult r = driver_.address_free(reinterpret_cast<CUdeviceptr>(ptr), bytes);
    if (r != CUDA_SUCCESS)
      std::fprintf(stderr, "reviva: warning: cuMemAddressFree of %zu bytes failed: %s\n", bytes,
                   driver_.describe(r).c_str());
  }

  // New physical memory, mapped and made accessible; the handle is released at once (the memory
  // lives until the range is unmapped), so unmap_memory needs nothing but the range.
  void map_memory(void* ptr, std::size_t bytes) override {
    check_vmm(bytes, "map_memory");
    DeviceGuard guard(device_);
    CUmemGenericAllocationHandle handle{};
    const CUresult created = driver_.create(&handle, bytes, &prop_, 0);
    if (created == CUDA_ERROR_OUT_OF_MEMORY) {
      std::size_t free_bytes = 0, total_bytes = 0;
      (void)cudaMemGetInfo(&free_bytes, &total_bytes);
      throw OutOfMemory(detail::concat("cuMemCreate of ", bytes, " bytes on ", name(), " failed: ",
                                       free_bytes, " of ", total_bytes, " bytes free"));
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

  void unmap_memory(void* ptr, std::size_t bytes) noexcept override {
    if (!ptr) return;
    const CUresult r = driver_.unmap(reinterpret_cast<CUdeviceptr>(ptr), bytes);
    if (r != CUDA_SUCCESS)
      std::fprintf(stderr, "reviva: warning: cuMemUnmap of %zu bytes failed: %s\n", bytes,
                   driver_.describe(r).c_str());
  }

  void copy_async(void* dst, const void* src, std::size_t bytes, StreamHandle stream) override {
    REVIVA_CHECK_ARG(dst != nullptr && src != nullptr, "copy_async: null pointer");
    REVIVA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, as_stream(stream)));
  }

  void copy_segments_async(const CopySegment* segments, std::size_t count,
                           StreamHandle stream) override {
    REVIVA_CHECK_ARG(segments != nullptr || count == 0, "copy_segments_async: null segments");
    DeviceGuard guard(device_);
    REVIVA_CUDA_CHECK(kernels::launch_copy_segments(
        reinterpret_cast<const kernels::CopySegment*>(segments), count, as_stream(stream)));
  }

  void dequantize_fp8_rows_async(const Fp8Rows& rows, void* out, HalfType type,
                                 StreamHandle stream) override {
    check_fp8_rows(rows, out);
    DeviceGuard guard(device_);
    kernels::Fp8RowsArgs args{rows.base,
                              {rows.count[0], rows.count[1], rows.count[2]},
                              {rows.stride[0], rows.stride[1], rows.stride[2]},
                              rows.head_dim};
    REVIVA_CUDA_CHECK(kernels::launch_dequantize_fp8_rows(args, out, type == HalfType::BFloat16,
                                                          as_stream(stream)));
  }

  void attend_fp8_decode_async(const Fp8DecodeAttention& attention, StreamHandle stream) override {
    check_fp8_decode_attention(attention);
    const kernels::Fp8DecodeArgs args = fp8_decode_args(attention, sm_count_);
    const std::size_t need = kernels::fp8_decode_workspace_bytes(args);
    REVIVA_CHECK_ARG(
        need == 0 || (attention.workspace != nullptr && attention.workspace_bytes >= need),
        "attend_fp8_decode: a workspace of ", need, " bytes is needed, got ",
        attention.workspace_bytes, " at ", attention.workspace);
    DeviceGuard guard(device_);
    REVIVA_CUDA_CHECK(kernels::launch_attend_fp8_decode(args, as_stream(stream)));
  }

  std::size_t fp8_decode_workspace_bytes(const Fp8DecodeAttention& attention) const override {
    DeviceGuard guard(device_);  // (the splits follow the kernel's occupancy on this device)
    return kernels::fp8_decode_workspace_bytes(fp8_decode_args(attention, sm_count_));
  }

  // The table may be pinned host memory: with unified addressing its host pointer is the
  // device's (Note [Pinning by registration]: registered only where the device can use it so).
  void gather_rows_async(const RowGather& gather, StreamHandle stream) override {
    check_row_gather(gather);
    DeviceGuard guard(device_);
    const kernels::RowGatherArgs args{gather.table, gather.rows,  gather.row_bytes,
                                      gather.ids,   gather.count, gather.out};
    REVIVA_CUDA_CHECK(kernels::launch_gather_rows(args, as_stream(stream)));
  }

  void rms_norm_async(const RmsNorm& n, StreamHandle stream) override {
    check_rms_norm(n);
    DeviceGuard guard(device_);
    const kernels::RmsNormArgs args{n.type == HalfType::BFloat16,
                                    n.rows,
                                    n.width,
                                    n.x,
                                    n.x_stride,
                                    n.residual,
                                    n.residual_stride,
                                    n.weight,
                                    n.eps,
                                    n.out,
                                    n.out_stride};
    REVIVA_CUDA_CHECK(kernels::launch_rms_norm(args, as_stream(stream)));
  }

  void rotary_async(const Rotary& r, StreamHandle stream) override {
    check_rotary(r);
    DeviceGuard guard(device_);
    const kernels::RotaryArgs args{r.type == HalfType::BFloat16,
                                   r.batch,
                                   r.q_heads,
                                   r.k_heads,
                                   r.head_dim,
                                   r.q,
                                   {r.q_stride[0], r.q_stride[1]},
                                   r.k,
                                   {r.k_stride[0], r.k_stride[1]},
                                   r.cos,
                                   r.sin,
                                   r.cos_stride,
                                   r.sin_stride};
    REVIVA_CUDA_CHECK(kernels::launch_rotary(args, as_stream(stream)));
  }

  void silu_mul_async(const SiluMul& op, StreamHandle stream) override {
    check_silu_mul(op);
    DeviceGuard guard(device_);
    const kernels::SiluMulArgs args{op.type == HalfType::BFloat16,
                                    op.rows,
                                    op.width,
                                    op.gate,
                                    op.gate_stride,
                                    op.up,
                                    op.up_stride,
                                    op.out,
                                    op.out_stride};
    REVIVA_CUDA_CHECK(kernels::launch_silu_mul(args, as_stream(stream)));
  }

  void memset_async(void* dst, int value, std::size_t bytes, StreamHandle stream) override {
    REVIVA_CHECK_ARG(dst != nullptr, "memset_async: null pointer");
    REVIVA_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, as_stream(stream)));
  }

 private:
  static constexpr std::size_t kHugePage = std::size_t{2} << 20;

  void* host_alloc(std::size_t bytes) {
    void* p = nullptr;
    const cudaError_t status =
        cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped);
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
  static void populate(char* p, std::size_t size) {
    constexpr std::size_t kPage = 4096;
    const std::size_t per_thread = std::size_t{64} << 20;
    const std::size_t hw = std::max(1u, std::thread::hardware_concurrency());
    const std::size_t n =
        std::clamp<std::size_t>(size / per_thread, 1, std::min<std::size_t>(hw, 8));
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

  void check_vmm(std::size_t bytes, const char* what) const {
    if (granularity_ == 0)
      throw BackendError(detail::concat(what, ": ", name(),
                                        " has no virtual memory management (or the driver lacks "
                                        "it): the device arena is unavailable"));
    REVIVA_CHECK_ARG(bytes > 0 && bytes % granularity_ == 0, what, ": ", bytes,
                     " bytes is not a positive multiple of the ", granularity_,
                     "-byte granularity");
  }

  void driver_check(CUresult r, const char* call, std::size_t bytes) const {
    if (r != CUDA_SUCCESS)
      throw BackendError(detail::concat(call, " of ", bytes, " bytes on ", name(),
                                        " failed: ", driver_.describe(r)));
  }

  int device_;
  std::string device_name_;
  int lowest_priority_ = 0;
  int highest_priority_ = 0;
  int sm_count_ = 1;  // multiprocessors: how many splits fill the device (attend_fp8_decode)
  VmmDriver driver_;
  CUmemAllocationProp prop_{};
  std::size_t granularity_ = 0;  // 0: no virtual memory management
  // Note [Pinning by registration]: whether the device uses a registered host pointer as is.
  bool register_host_ = false;
  std::mutex mutex_;
  std::map<void*, std::size_t> registered_;  // guarded by mutex_: registered ranges and sizes
};

}  // namespace

int cuda_device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver / no device: not an error for the caller
    return 0;
  }
  return count;
}

bool cuda_available() noexcept { return cuda_device_count() > 0; }

std::shared_ptr<Backend> make_cuda_backend(int device) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    throw BackendError(detail::concat("cannot create the CUDA backend on device ", device, ": ",
                                      cudaGetErrorName(status), " (", cudaGetErrorString(status),
                                      ")"));
  }
  REVIVA_CHECK_ARG(device >= 0 && device < count, "CUDA device ", device,
                   " does not exist: this machine has ", count, " CUDA device(s)");
  return std::make_shared<CudaBackend>(device);
}

}  // namespace reviva
