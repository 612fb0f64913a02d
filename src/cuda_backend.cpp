// The CUDA backend: the Backend interface on one CUDA device. Streams are non-blocking (never
// synchronised with the legacy default stream), events are created without timing unless asked,
// device memory is stream-ordered (cudaMallocAsync / cudaFreeAsync), and pinned host memory is
// portable and mapped so that the segment-copy kernel can read and write it directly.
// Every call runs with this backend's device current and restores the caller's afterwards.
//
// The class is cuda_backend_impl.h's; its memory (pinned host, device, virtual) is
// cuda_backend_memory.cpp's, its copies and kernels cuda_backend_kernels.cpp's.
#include "cuda_backend_impl.h"
#include "launchers.h"

#include <cstdio>
#include <memory>
#include <string>

namespace reviva {
namespace detail {
namespace {

void host_func_trampoline(void* user_data) {
  std::unique_ptr<std::function<void()>> fn(static_cast<std::function<void()>*>(user_data));
  (*fn)();
}

}  // namespace

CudaBackend::CudaBackend(int device) : device_(device) {
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
  REVIVA_CUDA_CHECK(
      cudaDeviceGetAttribute(&host_pointer, cudaDevAttrCanUseHostPointerForRegisteredMem, device_));
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

std::string CudaBackend::name() const {
  return "cuda:" + std::to_string(device_) + " (" + device_name_ + ")";
}

StreamHandle CudaBackend::create_stream(StreamPriority priority) {
  DeviceGuard guard(device_);
  cudaStream_t s = nullptr;
  const int p = priority == StreamPriority::High ? highest_priority_ : lowest_priority_;
  REVIVA_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, p));
  return s;
}

void CudaBackend::destroy_stream(StreamHandle stream) noexcept {
  try {
    DeviceGuard guard(device_);
    REVIVA_CUDA_WARN(cudaStreamDestroy(as_stream(stream)));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "reviva: warning: destroy_stream: %s\n", e.what());
  }
}

void CudaBackend::synchronize_stream(StreamHandle stream) {
  REVIVA_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
}

void CudaBackend::stream_wait_event(StreamHandle stream, EventHandle event) {
  REVIVA_CUDA_CHECK(cudaStreamWaitEvent(as_stream(stream), as_event(event), 0));
}

void CudaBackend::launch_host_func(StreamHandle stream, std::function<void()> fn) {
  REVIVA_CHECK_ARG(fn != nullptr, "launch_host_func: empty function");
  auto holder = std::make_unique<std::function<void()>>(std::move(fn));
  REVIVA_CUDA_CHECK(cudaLaunchHostFunc(as_stream(stream), host_func_trampoline, holder.get()));
  holder.release();  // the trampoline owns it now
}

EventHandle CudaBackend::create_event(bool enable_timing) {
  DeviceGuard guard(device_);
  cudaEvent_t e = nullptr;
  REVIVA_CUDA_CHECK(
      cudaEventCreateWithFlags(&e, enable_timing ? cudaEventDefault : cudaEventDisableTiming));
  return e;
}

void CudaBackend::destroy_event(EventHandle event) noexcept {
  try {
    DeviceGuard guard(device_);
    REVIVA_CUDA_WARN(cudaEventDestroy(as_event(event)));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "reviva: warning: destroy_event: %s\n", e.what());
  }
}

void CudaBackend::record_event(EventHandle event, StreamHandle stream) {
  REVIVA_CUDA_CHECK(cudaEventRecord(as_event(event), as_stream(stream)));
}

bool CudaBackend::query_event(EventHandle event) {
  const cudaError_t status = cudaEventQuery(as_event(event));
  if (status == cudaSuccess) return true;
  if (status == cudaErrorNotReady) {
    (void)cudaGetLastError();  // not an error: clear it so later checks don't see it
    return false;
  }
  detail::throw_cuda_error(status, "cudaEventQuery", __FILE__, __LINE__);
}

void CudaBackend::synchronize_event(EventHandle event) {
  REVIVA_CUDA_CHECK(cudaEventSynchronize(as_event(event)));
}

float CudaBackend::elapsed_ms(EventHandle start, EventHandle end) {
  float ms = 0.0f;
  REVIVA_CUDA_CHECK(cudaEventElapsedTime(&ms, as_event(start), as_event(end)));
  return ms;
}

}  // namespace detail

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
  return std::make_shared<detail::CudaBackend>(device);
}

}  // namespace reviva
