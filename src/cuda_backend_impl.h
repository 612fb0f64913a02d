// CudaBackend: the Backend interface on one CUDA device (cuda_backend.cpp says how), the class
// shared by the files that implement it: cuda_backend.cpp (the device, its streams and events,
// making the backend), cuda_backend_memory.cpp (pinned host memory: Note [Pinning by
// registration]; device memory; the virtual memory management calls of the device arena) and
// cuda_backend_kernels.cpp (copies and the library's kernels queued on a stream). Private to the
// library (not installed).
#pragma once

#include "cuda_check.h"

#include <reviva/backend.h>
#include <reviva/error.h>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <functional>
#include <map>
#include <mutex>
#include <string>

namespace reviva::detail {

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

inline cudaStream_t as_stream(StreamHandle h) { return static_cast<cudaStream_t>(h); }
inline cudaEvent_t as_event(EventHandle h) { return static_cast<cudaEvent_t>(h); }

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

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device);

  BackendKind kind() const noexcept override { return BackendKind::Cuda; }
  std::string name() const override;
  int device_index() const noexcept override { return device_; }

  // Streams and events (cuda_backend.cpp).
  StreamHandle create_stream(StreamPriority priority) override;
  void destroy_stream(StreamHandle stream) noexcept override;
  void synchronize_stream(StreamHandle stream) override;
  void stream_wait_event(StreamHandle stream, EventHandle event) override;
  void launch_host_func(StreamHandle stream, std::function<void()> fn) override;
  EventHandle create_event(bool enable_timing) override;
  void destroy_event(EventHandle event) noexcept override;
  void record_event(EventHandle event, StreamHandle stream) override;
  bool query_event(EventHandle event) override;
  void synchronize_event(EventHandle event) override;
  float elapsed_ms(EventHandle start, EventHandle end) override;

  // Pinned host memory, device memory and virtual memory management (cuda_backend_memory.cpp).
  void* allocate_pinned_host(std::size_t bytes) override;
  void free_pinned_host(void* ptr) noexcept override;
  void* allocate_device(std::size_t bytes, StreamHandle stream) override;
  void free_device(void* ptr, StreamHandle stream) noexcept override;
  DeviceMemoryInfo device_memory_info() override;
  MemoryKind memory_kind(const void* ptr) override;
  std::size_t vmm_granularity() override { return granularity_; }
  void* reserve_address(std::size_t bytes) override;
  void release_address(void* ptr, std::size_t bytes) noexcept override;
  void map_memory(void* ptr, std::size_t bytes) override;
  void unmap_memory(void* ptr, std::size_t bytes) noexcept override;

  // Copies and kernels queued on a stream (cuda_backend_kernels.cpp).
  void copy_async(void* dst, const void* src, std::size_t bytes, StreamHandle stream) override;
  void copy_segments_async(const CopySegment* segments, std::size_t count,
                           StreamHandle stream) override;
  void dequantize_fp8_rows_async(const Fp8Rows& rows, void* out, HalfType type,
                                 StreamHandle stream) override;
  void attend_fp8_decode_async(const Fp8DecodeAttention& attention, StreamHandle stream) override;
  std::size_t fp8_decode_workspace_bytes(const Fp8DecodeAttention& attention) const override;
  void gather_rows_async(const RowGather& gather, StreamHandle stream) override;
  void rms_norm_async(const RmsNorm& n, StreamHandle stream) override;
  void rotary_async(const Rotary& r, StreamHandle stream) override;
  void silu_mul_async(const SiluMul& op, StreamHandle stream) override;
  void memset_async(void* dst, int value, std::size_t bytes, StreamHandle stream) override;

 private:
  static constexpr std::size_t kHugePage = std::size_t{2} << 20;

  void* host_alloc(std::size_t bytes);
  static void populate(char* p, std::size_t size);
  void check_vmm(std::size_t bytes, const char* what) const;
  void driver_check(CUresult r, const char* call, std::size_t bytes) const;

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

}  // namespace reviva::detail
