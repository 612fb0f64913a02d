// reviva._C.WeightStore: the core WeightStore on torch tensors (include/reviva/weight_store.h).
//
// host(layer) is a uint8 CPU tensor over the layer's pinned host copy, and acquire(layer) a uint8
// device tensor over its device copy; the caller lays its parameters out in them. Each tensor
// keeps what it reads alive: a host tensor holds the store (its pinned copies go back only when
// the store and every such tensor are gone), a device tensor holds the arena buffer (its memory
// stays mapped while the tensor lives) and is revoked (Note [Revoked views] in leases.h) at
// release(layer), or for a resident_view when set_residency drops the layer: a streamed slot holds
// the next layer from then on. Compute is torch's current stream on CUDA; on the host
// runtime acquire() waits for the fill before returning, since torch computes on the CPU
// synchronously.
#include "leases.h"
#include "runtime.h"

#include <algorithm>
#include <tuple>
#include <vector>

namespace py = pybind11;

namespace reviva::python {
namespace {

class PyWeightStore {
 public:
  PyWeightStore(py::object engine, std::shared_ptr<DeviceArena> arena,
                std::vector<std::size_t> layer_bytes, std::size_t timeline_capacity,
                std::size_t slot_bytes,
                const std::vector<std::tuple<int, std::size_t, std::size_t>>& views)
      : rt_(runtime_of(engine)) {
    REVIVA_CHECK_ARG(arena != nullptr, "WeightStore: arena is None");
    REVIVA_CHECK_ARG(arena->backend().kind() == rt_->backend()->kind(),
                     "WeightStore: the arena belongs to another kind of device than the engine");
    WeightStoreOptions o;
    o.layer_bytes = std::move(layer_bytes);
    o.timeline_capacity = timeline_capacity;
    o.slot_bytes = slot_bytes;
    for (const auto& [of, offset, bytes] : views) o.views.push_back({of, offset, bytes});
    auto e = engine_of(engine);
    py::gil_scoped_release release;  // (pins every layer's host copy)
    store_ = std::make_shared<WeightStore>(std::move(e), std::move(arena), std::move(o));
  }

  ~PyWeightStore() {
    py::gil_scoped_release release;
    store_.reset();  // the last host tensor, if any outlives this object, closes the store
  }

  torch::Tensor host(int layer) {
    void* data = store_->host_data(layer);
    const auto n = static_cast<int64_t>(store_->layer_bytes(layer));
    std::shared_ptr<WeightStore> keep = store_;
    return torch::from_blob(
        data, {n}, [keep](void*) mutable { keep.reset(); },
        torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCPU).pinned_memory(true));
  }

  torch::Tensor acquire(int layer) {
    auto compute = rt_->compute_stream();
    void* data;
    {
      py::gil_scoped_release release;
      data = store_->acquire(layer, *compute);
      if (!rt_->is_cuda()) compute->synchronize();  // the fill landed before torch reads
    }
    torch::Tensor t = device_tensor(layer, data);
    acquired_.grant(layer, t);
    return t;
  }

  // A resident layer's device copy, its fill perhaps in flight on CUDA: for laying views out,
  // not for reading before acquire(layer) (which orders torch's stream after the fill).
  torch::Tensor resident_view(int layer) {
    void* data = store_->resident_data(layer);
    if (!rt_->is_cuda()) {  // (torch on the CPU reads without stream order: the fills land first)
      py::gil_scoped_release release;
      store_->synchronize();
    }
    torch::Tensor t = device_tensor(layer, data);
    resident_.grant(layer, t);
    return t;
  }

  void release(int layer) {
    store_->release(layer, *rt_->compute_stream());
    const std::string l = std::to_string(layer);
    acquired_.revoke(layer, "a tensor from WeightStore.acquire(" + l +
                                ") used after WeightStore.release(" + l +
                                "): that memory may hold another layer's weights now");
  }

  void set_residency(const std::vector<int>& resident, int slots, int prefetch_layers) {
    auto compute = rt_->compute_stream();
    {
      py::gil_scoped_release release;
      store_->set_residency(resident, slots, prefetch_layers, *compute);
    }
    for (const long layer : resident_.keys()) {
      if (std::find(resident.begin(), resident.end(), layer) != resident.end()) continue;
      const std::string l = std::to_string(layer);
      resident_.revoke(layer, "a tensor from WeightStore.resident_view(" + l +
                                  ") used after set_residency left layer " + l +
                                  " out: that memory may hold another layer's weights now");
    }
  }

  py::dict stats() {
    const WeightStoreStats st = store_->stats();
    py::dict r;
    r["resident_layers"] = st.resident_layers;
    r["streamed_layers"] = st.streamed_layers;
    r["slots"] = st.slots;
    r["prefetch_layers"] = st.prefetch_layers;
    r["fills"] = st.fills;
    r["prefetched_fills"] = st.prefetched_fills;
    r["slot_hits"] = st.slot_hits;
    r["bytes_to_device"] = st.bytes_to_device;
    r["bytes_to_host"] = st.bytes_to_host;
    r["compute_stall_s"] = st.compute_stall_ms / 1e3;
    r["copy_to_device_s"] = st.copy_to_device_ms / 1e3;
    r["overlap_ratio"] = st.overlap_ratio;
    r["host_bytes"] = st.host_bytes;
    r["resident_bytes"] = st.resident_bytes;
    r["device_bytes"] = st.device_bytes;
    r["peak_device_bytes"] = st.peak_device_bytes;
    return r;
  }

  WeightStore& store() { return *store_; }

 private:
  // A uint8 tensor over the layer's device copy at `data`, holding its arena buffer mapped.
  torch::Tensor device_tensor(int layer, void* data) {
    std::shared_ptr<ArenaBuffer> buffer = store_->buffer(layer);
    const auto n = static_cast<int64_t>(store_->layer_bytes(layer));
    return torch::from_blob(
        data, {n}, [buffer](void*) mutable { buffer.reset(); },
        torch::TensorOptions().dtype(torch::kUInt8).device(rt_->device()));
  }

  std::shared_ptr<Runtime> rt_;
  std::shared_ptr<WeightStore> store_;
  Leases acquired_;  // acquire() by layer, until release
  Leases resident_;  // resident_view() by layer, until set_residency leaves it out
};

}  // namespace

void bind_weight_store(py::module_& m) {
  py::class_<PyWeightStore>(m, "WeightStore",
                            "A decoder's weights in pinned host memory, layer by layer: resident "
                            "layers held on the device, the others streamed ahead of use by a "
                            "PrefetchScheduler (see include/reviva/weight_store.h)")
      .def(py::init<py::object, std::shared_ptr<DeviceArena>, std::vector<std::size_t>, std::size_t,
                    std::size_t, const std::vector<std::tuple<int, std::size_t, std::size_t>>&>(),
           py::arg("engine"), py::arg("arena"), py::arg("layer_bytes"),
           py::arg("timeline_capacity") = 0, py::arg("slot_bytes") = 0,
           py::arg("views") = std::vector<std::tuple<int, std::size_t, std::size_t>>{},
           "slot_bytes: the room of one slot (0: the largest streamed layer; a caller whose "
           "layers are split into consecutive blocks gives its largest whole layer). views: "
           "(layer, offset, bytes) each, a layer of the store (numbered after layer_bytes) whose "
           "host copy is that range of the layer's, fetched on demand, never resident (Note "
           "[Blocks within a block] in src/weight_store.cpp)")
      .def("host", &PyWeightStore::host, py::arg("layer"),
           "The layer's pinned host copy as a uint8 tensor, to fill before its first use")
      .def("acquire", &PyWeightStore::acquire, py::arg("layer"),
           "The layer's weights on the device (uint8) for compute on torch's current stream, "
           "until release(layer): used after it, the tensor and its views raise")
      .def("resident_view", &PyWeightStore::resident_view, py::arg("layer"),
           "A resident layer's device copy (uint8), its fill perhaps still in flight: to lay "
           "parameters out over it; compute reads it only after acquire(layer). Used after "
           "set_residency leaves the layer out, it and its views raise")
      .def("release", &PyWeightStore::release, py::arg("layer"))
      .def("set_residency", &PyWeightStore::set_residency, py::arg("resident"), py::arg("slots"),
           py::arg("prefetch_layers"))
      .def(
          "set_slot_bytes",
          [](PyWeightStore& s, std::size_t bytes, std::size_t block_bytes) {
            py::gil_scoped_release release;
            s.store().set_slot_bytes(bytes, block_bytes);
          },
          py::arg("slot_bytes"), py::arg("block_bytes") = 0,
          "The room of one slot from now on (0: the largest streamed layer), and the bytes every "
          "streamed layer's device buffer takes (0: its own); lowered, streamed layers on the "
          "device leave and the cycle starts again. Not while a layer is acquired")
      .def_property_readonly("slot_bytes", [](PyWeightStore& s) { return s.store().slot_bytes(); })
      .def(
          "set_on_demand",
          [](PyWeightStore& s, const std::vector<int>& layers) {
            py::gil_scoped_release release;
            s.store().set_on_demand(layers);
          },
          py::arg("layers"),
          "Streamed layers left out of the prefetch cycle from now on, as views always are: "
          "fetched when acquired, gone when released. Not while a layer is acquired")
      .def("on_demand", [](PyWeightStore& s, int layer) { return s.store().on_demand(layer); })
      .def(
          "set_order",
          [](PyWeightStore& s, const std::vector<int>& order) {
            py::gil_scoped_release release;
            s.store().set_order(order);
          },
          py::arg("order"),
          "The layers one step uses, in use order, each as often as used (a training step: "
          "0..n-1 then n-1..0); [] for every layer once in index order. Not while a layer is "
          "acquired")
      .def_property_readonly("order", [](PyWeightStore& s) { return s.store().order(); })
      .def("view", [](PyWeightStore& s, int layer) { return s.store().view(layer); })
      .def("resident", [](PyWeightStore& s, int layer) { return s.store().resident(layer); })
      .def("acquired", [](PyWeightStore& s, int layer) { return s.store().acquired(layer); })
      .def("layer_bytes", [](PyWeightStore& s, int layer) { return s.store().layer_bytes(layer); })
      .def_property_readonly("num_layers", [](PyWeightStore& s) { return s.store().num_layers(); })
      .def("trim",
           [](PyWeightStore& s) {
             py::gil_scoped_release release;
             s.store().trim();
           })
      .def("synchronize",
           [](PyWeightStore& s) {
             py::gil_scoped_release release;
             s.store().synchronize();
           })
      .def("stats", &PyWeightStore::stats)
      .def("timeline",
           [](PyWeightStore& s) {
             std::vector<TimelineEvent> events;
             {
               py::gil_scoped_release release;
               events = s.store().timeline();
             }
             return timeline_list(events);
           })
      .def(
          "take_timeline",
          [](PyWeightStore& s) {
            std::vector<TimelineEvent> events;
            {
              py::gil_scoped_release release;
              events = s.store().take_timeline();
            }
            return timeline_list(events);
          },
          "The events so far (as timeline()), leaving none: each call's own");
}

}  // namespace reviva::python
