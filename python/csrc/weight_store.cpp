// reviva._C.WeightStore: the core WeightStore on torch tensors (include/reviva/weight_store.h).
//
// host(layer) is a uint8 CPU tensor over the layer's pinned host copy, and acquire(layer) a uint8
// device tensor over its device copy; the caller lays its parameters out in them. Each tensor
// keeps what it reads alive: a host tensor holds the store (its pinned copies go back only when
// the store and every such tensor are gone), a device tensor holds the arena buffer (its memory
// stays mapped while the tensor lives) and is revoked (Note [Revoked views] in leases.h) at
// release(layer), or for a resident_view when set_residency drops the layer: a streamed slot holds
// the next layer from then on, in memory of its own while a numpy array or DLPack capsule of the
// old tensor still holds the old memory (Note [Memory held by views]). Compute is torch's current
// stream on CUDA; on the host runtime acquire() waits for the fill before returning, since torch
// computes on the CPU synchronously.
//
// The core's WeightStore is single-threaded, and the binding lets the GIL go inside its longer
// calls: every call into the store takes the object's turn (turn(): the GIL let go first, then a
// mutex), so calls from several Python threads run one at a time instead of racing in the core.
// What one thread's calls leave (a layer acquired, a residency) the others see: a call against
// it is refused by name ("is already acquired", "not while a layer is acquired").
#include "leases.h"
#include "runtime.h"

#include <algorithm>
#include <mutex>
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

  // f(store) with the store to this thread alone (the GIL let go, then the store's mutex: a
  // thread waiting for the turn holds neither, so no order of the two can deadlock).
  template <typename F>
  auto turn(F&& f) {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(turn_);
    return f(*store_);
  }

  torch::Tensor host(int layer) {
    const auto [data, bytes] = turn(
        [&](WeightStore& s) { return std::make_pair(s.host_data(layer), s.layer_bytes(layer)); });
    const auto n = static_cast<int64_t>(bytes);
    std::shared_ptr<WeightStore> keep = store_;
    return torch::from_blob(
        data, {n}, [keep](void*) mutable { keep.reset(); },
        torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCPU).pinned_memory(true));
  }

  torch::Tensor acquire(int layer) {
    auto compute = rt_->compute_stream();
    const Held held = turn([&](WeightStore& s) {
      void* data = s.acquire(layer, *compute);
      if (!rt_->is_cuda()) compute->synchronize();  // the fill landed before torch reads
      return Held{data, s.buffer(layer), s.layer_bytes(layer)};
    });
    torch::Tensor t = device_tensor(held);
    acquired_.grant(layer, t);
    return t;
  }

  // A resident layer's device copy, its fill perhaps in flight on CUDA: for laying views out,
  // not for reading before acquire(layer) (which orders torch's stream after the fill).
  torch::Tensor resident_view(int layer) {
    const Held held = turn([&](WeightStore& s) {
      void* data = s.resident_data(layer);
      // (torch on the CPU reads without stream order: the fills land first)
      if (!rt_->is_cuda()) s.synchronize();
      return Held{data, s.buffer(layer), s.layer_bytes(layer)};
    });
    torch::Tensor t = device_tensor(held);
    resident_.grant(layer, t);
    return t;
  }

  void release(int layer) {
    auto compute = rt_->compute_stream();
    turn([&](WeightStore& s) { s.release(layer, *compute); });
    const std::string l = std::to_string(layer);
    acquired_.revoke(layer, "a tensor from WeightStore.acquire(" + l +
                                ") used after WeightStore.release(" + l +
                                "): that memory may hold another layer's weights now");
  }

  void set_residency(const std::vector<int>& resident, int slots, int prefetch_layers) {
    auto compute = rt_->compute_stream();
    turn([&](WeightStore& s) { s.set_residency(resident, slots, prefetch_layers, *compute); });
    for (const long layer : resident_.keys()) {
      if (std::find(resident.begin(), resident.end(), layer) != resident.end()) continue;
      const std::string l = std::to_string(layer);
      resident_.revoke(layer, "a tensor from WeightStore.resident_view(" + l +
                                  ") used after set_residency left layer " + l +
                                  " out: that memory may hold another layer's weights now");
    }
  }

  py::dict stats() {
    const WeightStoreStats st = turn([](WeightStore& s) { return s.stats(); });
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

  py::list timeline(bool take) {
    const std::vector<TimelineEvent> events =
        turn([&](WeightStore& s) { return take ? s.take_timeline() : s.timeline(); });
    return timeline_list(events);
  }

 private:
  struct Held {  // a layer's device copy, read in the store's turn
    void* data;
    std::shared_ptr<ArenaBuffer> buffer;
    std::size_t bytes;
  };

  // A uint8 tensor over a layer's device copy, holding its arena buffer mapped.
  torch::Tensor device_tensor(const Held& held) {
    std::shared_ptr<ArenaBuffer> buffer = held.buffer;
    return torch::from_blob(
        held.data, {static_cast<int64_t>(held.bytes)}, [buffer](void*) mutable { buffer.reset(); },
        torch::TensorOptions().dtype(torch::kUInt8).device(rt_->device()));
  }

  std::shared_ptr<Runtime> rt_;
  std::shared_ptr<WeightStore> store_;
  std::mutex turn_;  // turn(): one thread at a time in the store
  Leases acquired_;  // acquire() by layer, until release
  Leases resident_;  // resident_view() by layer, until set_residency leaves it out
};

}  // namespace

void bind_weight_store(py::module_& m) {
  py::class_<PyWeightStore>(m, "WeightStore",
                            "A decoder's weights in pinned host memory, layer by layer: resident "
                            "layers held on the device, the others streamed ahead of use by a "
                            "PrefetchScheduler (see include/reviva/weight_store.h). Calls from "
                            "several threads take turns, one at a time in the store")
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
           "until release(layer): used after it, the tensor and its views raise; a numpy array or "
           "DLPack capsule taken from it before keeps the bytes it was lent (their memory kept "
           "from reuse, counted in the arena) until it is dropped")
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
            s.turn([&](WeightStore& w) { w.set_slot_bytes(bytes, block_bytes); });
          },
          py::arg("slot_bytes"), py::arg("block_bytes") = 0,
          "The room of one slot from now on (0: the largest streamed layer), and the bytes every "
          "streamed layer's device buffer takes (0: its own); lowered, streamed layers on the "
          "device leave and the cycle starts again. Not while a layer is acquired")
      .def_property_readonly(
          "slot_bytes",
          [](PyWeightStore& s) { return s.turn([](WeightStore& w) { return w.slot_bytes(); }); })
      .def(
          "set_on_demand",
          [](PyWeightStore& s, const std::vector<int>& layers) {
            s.turn([&](WeightStore& w) { w.set_on_demand(layers); });
          },
          py::arg("layers"),
          "Streamed layers left out of the prefetch cycle from now on, as views always are: "
          "fetched when acquired, gone when released. Not while a layer is acquired")
      .def("on_demand",
           [](PyWeightStore& s, int layer) {
             return s.turn([&](WeightStore& w) { return w.on_demand(layer); });
           })
      .def(
          "set_order",
          [](PyWeightStore& s, const std::vector<int>& order) {
            s.turn([&](WeightStore& w) { w.set_order(order); });
          },
          py::arg("order"),
          "The layers one step uses, in use order, each as often as used (a training step: "
          "0..n-1 then n-1..0); [] for every layer once in index order. Not while a layer is "
          "acquired")
      .def_property_readonly(
          "order",
          [](PyWeightStore& s) { return s.turn([](WeightStore& w) { return w.order(); }); })
      .def("view", [](PyWeightStore& s,
                      int layer) { return s.turn([&](WeightStore& w) { return w.view(layer); }); })
      .def("resident",
           [](PyWeightStore& s, int layer) {
             return s.turn([&](WeightStore& w) { return w.resident(layer); });
           })
      .def("acquired",
           [](PyWeightStore& s, int layer) {
             return s.turn([&](WeightStore& w) { return w.acquired(layer); });
           })
      .def("layer_bytes",
           [](PyWeightStore& s, int layer) {
             return s.turn([&](WeightStore& w) { return w.layer_bytes(layer); });
           })
      .def_property_readonly(
          "num_layers",
          [](PyWeightStore& s) { return s.turn([](WeightStore& w) { return w.num_layers(); }); })
      .def("trim", [](PyWeightStore& s) { s.turn([](WeightStore& w) { w.trim(); }); })
      .def("synchronize", [](PyWeightStore& s) { s.turn([](WeightStore& w) { w.synchronize(); }); })
      .def("stats", &PyWeightStore::stats)
      .def("timeline", [](PyWeightStore& s) { return s.timeline(false); })
      .def(
          "take_timeline", [](PyWeightStore& s) { return s.timeline(true); },
          "The events so far (as timeline()), leaving none: each call's own");
}

}  // namespace reviva::python
