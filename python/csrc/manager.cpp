// reviva._C: the OffloadManager and PrefetchScheduler on torch tensors.
//
// A managed block is a tensor's bytes plus its shape and dtype; acquire() returns a tensor viewing
// the block's current device memory, valid until release(). Compute is torch's current stream on
// CUDA; on the host runtime acquire() waits for the data before returning, since torch computes
// on the CPU synchronously. On CUDA the blocks' device memory comes from PyTorch's caching
// allocator (TorchDeviceAllocator), so Reviva and PyTorch share one pool.
#include "runtime.h"

#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace reviva::python {
namespace {

#if defined(REVIVA_TORCH_CUDA)
// Device memory from PyTorch's caching allocator. Stream-ordered as DeviceAllocator requires:
// a block is allocated for `stream` and, when freed, torch's record_stream on the freeing stream
// keeps it from reuse until that stream's work so far has completed.
class TorchDeviceAllocator final : public DeviceAllocator {
 public:
  explicit TorchDeviceAllocator(c10::DeviceIndex device) : device_(device) {}

  void* allocate(std::size_t bytes, StreamHandle stream) override {
    c10::DataPtr data;
    {
      c10::cuda::CUDAStreamGuard guard(
          c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), device_));
      try {
        data = c10::cuda::CUDACachingAllocator::get()->allocate(bytes);
      } catch (const c10::OutOfMemoryError& e) {
        throw OutOfMemory(std::string("torch's CUDA allocator: ") + e.what_without_backtrace());
      }
    }
    void* ptr = data.get();
    std::lock_guard<std::mutex> lock(mutex_);
    live_.emplace(ptr, std::move(data));
    return ptr;
  }

  void deallocate(void* ptr, std::size_t, StreamHandle stream) noexcept override {
    c10::DataPtr data;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = live_.find(ptr);
      if (it == live_.end()) return;
      data = std::move(it->second);
      live_.erase(it);
    }
    try {
      c10::cuda::CUDACachingAllocator::recordStream(
          data, c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), device_));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "reviva: warning: recordStream failed (%s); synchronizing\n", e.what());
      cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
    }
  }  // `data` frees here

  std::string name() const override { return "torch CUDA caching allocator"; }

 private:
  c10::DeviceIndex device_;
  std::mutex mutex_;
  std::unordered_map<void*, c10::DataPtr> live_;  // guarded by mutex_
};
#endif

Access parse_access(const std::string& access) {
  if (access == "readwrite" || access == "rw") return Access::ReadWrite;
  if (access == "read" || access == "readonly" || access == "r") return Access::ReadOnly;
  if (access == "write" || access == "writeonly" || access == "w") return Access::WriteOnly;
  throw InvalidArgument("unknown access '" + access + "': use 'readwrite', 'read' or 'write'");
}

struct TensorMeta {
  std::vector<int64_t> shape;
  torch::ScalarType dtype;
};

class PyOffloadManager {
 public:
  PyOffloadManager(py::object py_engine, std::size_t budget_bytes, double budget_fraction,
                   const std::string& policy, const std::string& allocator,
                   std::size_t timeline_capacity)
      : rt_(runtime_of(py_engine)), py_engine_(std::move(py_engine)) {
    OffloadManagerOptions o;
    o.budget_bytes = budget_bytes;
    o.budget_fraction = budget_fraction;
    o.policy = parse_policy(policy);
    o.timeline_capacity = timeline_capacity;
    std::shared_ptr<DeviceAllocator> device_allocator;
    if (allocator == "torch" && rt_->is_cuda()) {
#if defined(REVIVA_TORCH_CUDA)
      device_allocator = std::make_shared<TorchDeviceAllocator>(rt_->device().index());
#endif
    } else if (allocator == "backend" || allocator == "torch") {
      device_allocator = make_backend_device_allocator(rt_->backend());  // host runtime: torch
                                                                         // CPU memory is plain
    } else {
      throw InvalidArgument("unknown allocator '" + allocator + "': use 'torch' or 'backend'");
    }
    allocator_name_ = device_allocator->name();
    manager_ = std::make_unique<OffloadManager>(engine_of(py_engine_), device_allocator, o);
  }

  BlockId register_tensor(const std::vector<int64_t>& shape, py::object dtype) {
    const torch::ScalarType st = torch::python::detail::py_object_to_dtype(dtype);
    int64_t numel = 1;
    for (int64_t d : shape) {
      REVIVA_CHECK_ARG(d >= 0, "register: negative dimension ", d, " in shape ",
                       c10::IntArrayRef(shape));
      numel *= d;
    }
    const std::size_t bytes = static_cast<std::size_t>(numel) * c10::elementSize(st);
    REVIVA_CHECK_ARG(bytes > 0, "register: the shape ", c10::IntArrayRef(shape), " holds no bytes");
    const BlockId id = manager_->register_block(bytes);
    meta_[id] = TensorMeta{shape, st};
    return id;
  }

  BlockId adopt(const torch::Tensor& t) {
    check_on_runtime_device(*rt_, t, "adopt");
    auto stream = rt_->compute_stream();
    // The block owns a reference to the tensor's storage until it leaves the device; then
    // torch frees it, after the freeing stream's work (record_stream).
    auto holder = std::make_shared<torch::Tensor>(t);
    std::shared_ptr<Runtime> rt = rt_;
    auto release = [holder, rt](StreamHandle s) {
      const Stream stream = Stream::wrap(rt->backend(), s);
      // CUDA: torch frees the memory once `s` has done its work so far (record_stream). CPU
      // tensors have no such hook: wait for the stream (a copy may still read the tensor).
      if (!rt->is_cuda()) stream.synchronize();
      py::gil_scoped_acquire gil;  // dropping the tensor may touch its Python object
      rt->record_stream(*holder, stream);
      *holder = torch::Tensor();
    };
    const BlockId id = manager_->adopt(t.data_ptr(), t.nbytes(), release, *stream);
    meta_[id] = TensorMeta{t.sizes().vec(), t.scalar_type()};
    return id;
  }

  torch::Tensor acquire(BlockId id, const std::string& access) {
    const TensorMeta& meta = lookup(id);
    auto stream = rt_->compute_stream();
    void* ptr;
    {
      py::gil_scoped_release nogil;
      ptr = manager_->acquire(id, *stream, parse_access(access));
      if (!rt_->is_cuda()) stream->synchronize();  // CPU compute starts right away
    }
    return torch::from_blob(
        ptr, meta.shape, [](void*) {},
        torch::TensorOptions().dtype(meta.dtype).device(rt_->device()));
  }

  void release(BlockId id) {
    lookup(id);
    auto stream = rt_->compute_stream();
    manager_->release(id, *stream);
  }

  void unregister(BlockId id) {
    lookup(id);
    {
      py::gil_scoped_release nogil;
      manager_->unregister(id);
    }
    meta_.erase(id);
  }

  const TensorMeta& lookup(BlockId id) const {
    auto it = meta_.find(id);
    REVIVA_CHECK_ARG(it != meta_.end(), "unknown block id ", id);
    return it->second;
  }

  py::dict metrics() {
    ManagerMetrics r;
    {
      py::gil_scoped_release nogil;
      r = manager_->metrics();
    }
    py::dict d;
    d["bytes_to_host"] = r.bytes_to_host;
    d["bytes_to_device"] = r.bytes_to_device;
    d["to_host_busy_ms"] = r.to_host_busy_ms;
    d["to_device_busy_ms"] = r.to_device_busy_ms;
    d["compute_stall_ms"] = r.compute_stall_ms;
    d["host_wait_ms"] = r.host_wait_ms;
    d["overlap_ratio"] = r.overlap_ratio;
    d["budget_bytes"] = r.budget_bytes;
    d["device_bytes"] = r.device_bytes;
    d["peak_device_bytes"] = r.peak_device_bytes;
    d["registered_bytes"] = r.registered_bytes;
    d["peak_registered_bytes"] = r.peak_registered_bytes;
    d["device_bytes_saved"] = r.device_bytes_saved;
    d["evictions"] = r.evictions;
    d["clean_evictions"] = r.clean_evictions;
    d["prefetches"] = r.prefetches;
    d["prefetch_hits"] = r.prefetch_hits;
    d["prefetch_late"] = r.prefetch_late;
    d["prefetch_misses"] = r.prefetch_misses;
    d["timeline_dropped"] = r.timeline_dropped;
    d["policy"] = manager_->policy_name();
    d["allocator"] = allocator_name_;
    return d;
  }

  py::list timeline() {
    std::vector<TimelineEvent> events;
    {
      py::gil_scoped_release nogil;
      events = manager_->timeline();
    }
    py::list out;
    for (const TimelineEvent& e : events) {
      py::dict d;
      d["kind"] = to_string(e.kind);
      d["block"] = e.block;
      d["start_ms"] = e.start_ms;
      d["end_ms"] = e.end_ms;
      d["bytes"] = e.bytes;
      out.append(d);
    }
    return out;
  }

  OffloadManager& manager() { return *manager_; }
  const std::shared_ptr<Runtime>& runtime() const { return rt_; }

 private:
  std::shared_ptr<Runtime> rt_;
  py::object py_engine_;  // keeps the engine (and its streams) alive as long as the manager
  std::string allocator_name_;
  std::unique_ptr<OffloadManager> manager_;
  std::unordered_map<BlockId, TensorMeta> meta_;
};

class PyPrefetchScheduler {
 public:
  PyPrefetchScheduler(py::object py_manager, int prefetch_groups, bool adaptive, int min_window,
                      int max_window, bool eager_offload)
      : py_manager_(std::move(py_manager)), manager_(&py_manager_.cast<PyOffloadManager&>()) {
    PrefetchSchedulerOptions o;
    o.prefetch_groups = prefetch_groups;
    o.adaptive = adaptive;
    o.min_window = min_window;
    o.max_window = max_window;
    o.eager_offload = eager_offload;
    scheduler_ = std::make_unique<PrefetchScheduler>(manager_->manager(), o);
  }

  void declare_order(const std::vector<std::vector<BlockId>>& order) {
    for (const auto& g : order)
      for (BlockId id : g) manager_->lookup(id);
    scheduler_->declare_order(order);
  }

  std::vector<torch::Tensor> acquire_group(const std::vector<BlockId>& group,
                                           const std::string& access) {
    for (BlockId id : group) manager_->lookup(id);
    const auto& rt = manager_->runtime();
    auto stream = rt->compute_stream();
    std::vector<void*> ptrs;
    {
      py::gil_scoped_release nogil;
      ptrs = scheduler_->acquire_group(group, *stream, parse_access(access));
      if (!rt->is_cuda()) stream->synchronize();
    }
    std::vector<torch::Tensor> out;
    for (std::size_t i = 0; i < group.size(); ++i) {
      const TensorMeta& meta = manager_->lookup(group[i]);
      out.push_back(torch::from_blob(
          ptrs[i], meta.shape, [](void*) {},
          torch::TensorOptions().dtype(meta.dtype).device(rt->device())));
    }
    return out;
  }

  void release_group(const std::vector<BlockId>& group, bool discard) {
    for (BlockId id : group) manager_->lookup(id);
    auto stream = manager_->runtime()->compute_stream();
    py::gil_scoped_release nogil;
    scheduler_->release_group(group, *stream, discard);
  }

  py::dict stats() const {
    const PrefetchSchedulerStats s = scheduler_->stats();
    py::dict d;
    d["window"] = s.window;
    d["steps"] = s.steps;
    d["groups_in_order"] = s.groups_in_order;
    d["off_schedule_accesses"] = s.off_schedule_accesses;
    d["prefetches_issued"] = s.prefetches_issued;
    d["prefetches_without_room"] = s.prefetches_without_room;
    d["eager_offloads"] = s.eager_offloads;
    d["measured_compute_ms_per_group"] = s.measured_compute_ms_per_group;
    d["measured_copy_ms_per_group"] = s.measured_copy_ms_per_group;
    return d;
  }

  PrefetchScheduler& scheduler() { return *scheduler_; }

 private:
  py::object py_manager_;  // keeps the manager alive
  PyOffloadManager* manager_;
  std::unique_ptr<PrefetchScheduler> scheduler_;
};

}  // namespace

void bind_manager(py::module_& m) {
  py::class_<PyOffloadManager>(m, "OffloadManager",
                               "Residency of registered tensors under a device memory budget.")
      .def(py::init<py::object, std::size_t, double, const std::string&, const std::string&,
                    std::size_t>(),
           py::arg("engine"), py::arg("budget_bytes") = 0, py::arg("budget_fraction") = 0.8,
           py::arg("policy") = "lru", py::arg("allocator") = "torch",
           py::arg("timeline_capacity") = std::size_t{1} << 16)
      .def("register", &PyOffloadManager::register_tensor, py::arg("shape"), py::arg("dtype"),
           "A block for a tensor of this shape and dtype, with no contents yet (state Empty).")
      .def("adopt", &PyOffloadManager::adopt, py::arg("tensor"),
           "Takes over a device tensor's memory as a block (state Device).")
      .def("acquire", &PyOffloadManager::acquire, py::arg("block"), py::arg("access") = "readwrite",
           "A tensor on the block's device memory for the current stream, valid until release.")
      .def("release", &PyOffloadManager::release, py::arg("block"))
      .def(
          "offload",
          [](PyOffloadManager& self, BlockId id) {
            self.lookup(id);
            py::gil_scoped_release nogil;
            self.manager().offload(id);
          },
          py::arg("block"))
      .def(
          "prefetch",
          [](PyOffloadManager& self, BlockId id) {
            self.lookup(id);
            py::gil_scoped_release nogil;
            return self.manager().prefetch(id);
          },
          py::arg("block"))
      .def(
          "discard",
          [](PyOffloadManager& self, BlockId id) {
            self.lookup(id);
            py::gil_scoped_release nogil;
            self.manager().discard(id);
          },
          py::arg("block"))
      .def("unregister", &PyOffloadManager::unregister, py::arg("block"))
      .def(
          "state",
          [](PyOffloadManager& self, BlockId id) {
            self.lookup(id);
            return std::string(to_string(self.manager().state(id)));
          },
          py::arg("block"))
      .def(
          "nbytes",
          [](PyOffloadManager& self, BlockId id) {
            self.lookup(id);
            return self.manager().bytes(id);
          },
          py::arg("block"))
      .def("end_step", [](PyOffloadManager& self) { self.manager().end_step(); })
      .def("synchronize",
           [](PyOffloadManager& self) {
             py::gil_scoped_release nogil;
             self.manager().synchronize();
           })
      .def("metrics", &PyOffloadManager::metrics)
      .def("timeline", &PyOffloadManager::timeline)
      .def("reset_metrics", [](PyOffloadManager& self) { self.manager().reset_metrics(); })
      .def("check_invariants", [](PyOffloadManager& self) { self.manager().check_invariants(); })
      .def_property(
          "budget_bytes", [](PyOffloadManager& self) { return self.manager().budget_bytes(); },
          [](PyOffloadManager& self, std::size_t bytes) {
            py::gil_scoped_release nogil;
            self.manager().set_budget_bytes(bytes);
          })
      .def_property_readonly("device_bytes",
                             [](PyOffloadManager& self) { return self.manager().device_bytes(); })
      .def_property_readonly("blocks",
                             [](PyOffloadManager& self) { return self.manager().blocks(); });

  py::class_<PyPrefetchScheduler>(m, "PrefetchScheduler",
                                  "Keeps the next groups of blocks in flight ahead of compute.")
      .def(py::init<py::object, int, bool, int, int, bool>(), py::arg("manager"),
           py::arg("prefetch_groups") = 2, py::arg("adaptive") = false, py::arg("min_window") = 1,
           py::arg("max_window") = 16, py::arg("eager_offload") = true)
      .def("declare_order", &PyPrefetchScheduler::declare_order, py::arg("order"))
      .def("acquire_group", &PyPrefetchScheduler::acquire_group, py::arg("group"),
           py::arg("access") = "readwrite")
      .def("release_group", &PyPrefetchScheduler::release_group, py::arg("group"),
           py::arg("discard") = false)
      .def("end_step", [](PyPrefetchScheduler& self) { self.scheduler().end_step(); })
      .def_property_readonly("window",
                             [](PyPrefetchScheduler& self) { return self.scheduler().window(); })
      .def_property_readonly("order",
                             [](PyPrefetchScheduler& self) { return self.scheduler().order(); })
      .def("stats", &PyPrefetchScheduler::stats);
}

}  // namespace reviva::python
