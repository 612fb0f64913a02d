// Shared by the binding's files: the Runtime (a backend bound to one torch device, and the
// torch-side halves of the lifetime protocol) and the input checks on tensors.
#pragma once

#include <reviva/reviva.h>

#include <torch/extension.h>

#if defined(REVIVA_TORCH_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace reviva::python {

// --- Runtime: a backend bound to one torch device -----------------------------------------------

class Runtime {
 public:
  explicit Runtime(const std::optional<std::string>& device) {
    std::string d = device.value_or(cuda_available() ? "cuda" : "cpu");
    torch::Device td(d);
    if (td.is_cuda()) {
#if defined(REVIVA_TORCH_CUDA)
      const int index = td.has_index() ? td.index() : 0;
      backend_ = make_cuda_backend(index);
      device_ = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
#else
      throw InvalidArgument("Runtime: device '" + d +
                            "' needs a CUDA build of both torch and Reviva; this build has none");
#endif
    } else if (td.is_cpu()) {
      // Small mapping granules: the tiny models of the CPU tests keep their real proportions
      // of K/V to working set (2 MiB granules would dwarf a layer's K/V there).
      HostBackendOptions options;
      options.vmm_granularity = std::size_t{64} << 10;
      backend_ = make_host_backend(options);
      device_ = torch::Device(torch::kCPU);
      host_compute_ = std::make_shared<const Stream>(backend_);
    } else {
      throw InvalidArgument("Runtime: unsupported device '" + d + "' (use 'cuda[:N]' or 'cpu')");
    }
  }

  const std::shared_ptr<Backend>& backend() const { return backend_; }
  const torch::Device& device() const { return device_; }
  bool is_cuda() const { return device_.is_cuda(); }

  // The stream torch computes on now, as a (non-owning) Reviva stream; nullptr on the host
  // runtime, where torch computes synchronously.
  std::shared_ptr<const Stream> current_stream() const {
#if defined(REVIVA_TORCH_CUDA)
    if (is_cuda()) {
      cudaStream_t s = c10::cuda::getCurrentCUDAStream(device_.index()).stream();
      return std::make_shared<const Stream>(Stream::wrap(backend_, s));
    }
#endif
    return nullptr;
  }

  // An event on torch's current stream: the point after which a copy may read (or overwrite)
  // memory torch computed with (lifetime rule 1). nullopt on the host runtime.
  std::optional<Event> producer_event() const {
    auto stream = current_stream();
    if (!stream) return std::nullopt;
    Event e(backend_);
    e.record(*stream);
    return e;
  }

  // Lifetime rule 2 at the torch boundary: torch's allocator will not reuse `t`'s memory until
  // `stream` has finished the work queued on it so far.
  void record_stream(const torch::Tensor& t, const Stream& stream) const {
#if defined(REVIVA_TORCH_CUDA)
    if (is_cuda()) {
      c10::cuda::CUDACachingAllocator::recordStream(
          t.storage().data_ptr(), c10::cuda::getStreamFromExternal(
                                      static_cast<cudaStream_t>(stream.handle()), device_.index()));
    }
#else
    (void)t;
    (void)stream;
#endif
  }

  // Copy streams for an engine: on CUDA, streams of torch's pool, which live as long as the
  // process. torch's allocator records events on the streams named in record_stream when it frees
  // such memory, possibly after the engine is gone, so the engine must not own (destroy) them.
  void choose_copy_streams(TransferEngineOptions& options) const {
#if defined(REVIVA_TORCH_CUDA)
    if (is_cuda()) {
      options.d2h_stream =
          c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_.index()).stream();
      options.h2d_stream =
          c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device_.index()).stream();
    }
#else
    (void)options;
#endif
  }

  // The stream compute runs on, for the manager: torch's current stream on CUDA; on the host
  // runtime a stream of the runtime's own, which callers synchronize after each acquire (torch
  // computes on the CPU synchronously).
  std::shared_ptr<const Stream> compute_stream() const {
    if (auto s = current_stream()) return s;
    return host_compute_;
  }

  std::string repr() const {
    return "Runtime(device='" + device_.str() + "', backend='" + backend_->name() + "')";
  }

 private:
  std::shared_ptr<Backend> backend_;
  torch::Device device_{torch::kCPU};
  std::shared_ptr<const Stream> host_compute_;  // host runtime only
};

// --- input checks ----------------------------------------------------------------------------

inline std::string describe(const torch::Tensor& t) {
  std::ostringstream s;
  s << "tensor of shape " << t.sizes() << ", dtype " << t.dtype() << ", device " << t.device();
  return s.str();
}

inline void check_on_runtime_device(const Runtime& rt, const torch::Tensor& t, const char* what) {
  REVIVA_CHECK_ARG(t.defined(), what, ": tensor is undefined (None)");
  REVIVA_CHECK_ARG(t.device() == rt.device(), what, ": expected a tensor on ", rt.device().str(),
                   " (the runtime's device), got a ", describe(t));
  REVIVA_CHECK_ARG(t.is_contiguous(), what, ": the tensor must be contiguous, got strides ",
                   t.strides(), " for a ", describe(t), " (call .contiguous() first)");
  REVIVA_CHECK_ARG(t.nbytes() > 0, what, ": the tensor is empty (", describe(t), ")");
}

// A manager's timeline as a list of dicts (kind, block, start_s, end_s, bytes: seconds from the
// timeline's origin).
inline pybind11::list timeline_list(const std::vector<TimelineEvent>& events) {
  pybind11::list out;
  for (const TimelineEvent& e : events) {
    pybind11::dict d;
    d["kind"] = to_string(e.kind);
    d["block"] = e.block;
    d["start_s"] = e.start_ms / 1e3;
    d["end_s"] = e.end_ms / 1e3;
    d["bytes"] = e.bytes;
    out.append(d);
  }
  return out;
}

// The core engine behind a Python TransferEngine object, and its runtime (binding.cpp).
std::shared_ptr<TransferEngine> engine_of(pybind11::handle py_engine);
std::shared_ptr<Runtime> runtime_of(pybind11::handle py_engine);

}  // namespace reviva::python
