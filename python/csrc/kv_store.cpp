// reviva._C.KVStore: the core KVStore on torch tensors.
//
// Buffers (resident layers and staging slots) are torch tensors of shape
// [capacity, batch, kv_heads, head_dim], token-major, on the runtime's device, allocated by the
// caller so that they count against torch's allocator and its memory budget; the store keeps them
// alive. Compute is torch's current stream on CUDA; on the host runtime acquire() waits for the
// fill before returning, since torch computes on the CPU synchronously.
#include "runtime.h"

#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace reviva::python {
namespace {

class PyKVStore {
 public:
  PyKVStore(py::object engine, int num_layers, int64_t batch, int64_t kv_heads, int64_t head_dim,
            py::object dtype, int64_t capacity_tokens, int prefetch_layers)
      : rt_(runtime_of(engine)) {
    REVIVA_CHECK_ARG(batch > 0 && kv_heads > 0 && head_dim > 0,
                     "KVStore: batch, kv_heads and head_dim must be > 0, got ", batch, ", ",
                     kv_heads, ", ", head_dim);
    REVIVA_CHECK_ARG(capacity_tokens > 0, "KVStore: capacity_tokens must be > 0, got ",
                     capacity_tokens);
    dtype_ = torch::python::detail::py_object_to_dtype(dtype);
    shape_ = {capacity_tokens, batch, kv_heads, head_dim};
    KVStoreOptions o;
    o.num_layers = num_layers;
    o.tensors_per_layer = 2;
    o.token_bytes =
        static_cast<std::size_t>(batch * kv_heads * head_dim) * c10::elementSize(dtype_);
    o.capacity_tokens = static_cast<std::size_t>(capacity_tokens);
    o.prefetch_layers = prefetch_layers;
    store_ = std::make_unique<KVStore>(engine_of(engine), o);
  }

  ~PyKVStore() {
    py::gil_scoped_release release;
    store_.reset();  // waits for copies touching the buffers before they are freed
  }

  void make_resident(int layer, const torch::Tensor& k, const torch::Tensor& v) {
    store_->make_resident(layer, {checked(k, "make_resident: k"), checked(v, "make_resident: v")});
    keep(k, v);
  }

  void promote(int layer, const torch::Tensor& k, const torch::Tensor& v) {
    store_->promote(layer, {checked(k, "promote: k"), checked(v, "promote: v")});
    keep(k, v);
  }

  void add_slot(const torch::Tensor& k, const torch::Tensor& v) {
    store_->add_slot({checked(k, "add_slot: k"), checked(v, "add_slot: v")});
    keep(k, v);
  }

  std::pair<torch::Tensor, torch::Tensor> acquire(int layer) {
    auto compute = rt_->compute_stream();
    std::vector<void*> p = store_->acquire(layer, *compute);
    if (!rt_->is_cuda()) {
      py::gil_scoped_release release;
      compute->synchronize();  // the fill has landed before torch reads on the CPU
    }
    return {tensor_at(p[0]), tensor_at(p[1])};
  }

  void wrote(int layer, std::size_t first, std::size_t count) {
    store_->wrote(layer, first, count, *rt_->compute_stream());
  }

  void release(int layer) { store_->release(layer, *rt_->compute_stream()); }

  py::dict stats() {
    const KVStoreStats st = store_->stats();
    py::dict r;
    r["resident_layers"] = st.resident_layers;
    r["streamed_layers"] = st.streamed_layers;
    r["slots"] = st.slots;
    r["fills"] = st.fills;
    r["prefetched_fills"] = st.prefetched_fills;
    r["slot_hits"] = st.slot_hits;
    r["promotions"] = st.promotions;
    r["bytes_to_device"] = st.bytes_to_device;
    r["bytes_to_host"] = st.bytes_to_host;
    r["compute_stall_ms"] = st.compute_stall_ms;
    r["stalls"] = st.stalls;
    r["host_bytes"] = st.host_bytes;
    return r;
  }

  KVStore& store() { return *store_; }
  std::vector<int64_t> buffer_shape() const { return shape_; }

 private:
  void* checked(const torch::Tensor& t, const char* what) const {
    check_on_runtime_device(*rt_, t, what);
    REVIVA_CHECK_ARG(t.sizes().vec() == shape_, "KVStore::", what, ": expected shape ",
                     c10::IntArrayRef(shape_), ", got a ", describe(t));
    REVIVA_CHECK_ARG(t.scalar_type() == dtype_, "KVStore::", what, ": expected dtype ",
                     c10::toString(dtype_), ", got a ", describe(t));
    return t.data_ptr();
  }

  void keep(const torch::Tensor& k, const torch::Tensor& v) {
    buffers_[k.data_ptr()] = k;
    buffers_[v.data_ptr()] = v;
  }

  // The kept tensor whose memory starts at `p` (every buffer the core returns is one of them).
  torch::Tensor tensor_at(void* p) const {
    auto it = buffers_.find(p);
    REVIVA_ASSERT(it != buffers_.end(), "KVStore returned a buffer the binding does not hold");
    return it->second;
  }

  std::shared_ptr<Runtime> rt_;
  torch::ScalarType dtype_;
  std::vector<int64_t> shape_;
  std::unordered_map<void*, torch::Tensor> buffers_;  // resident layers' and slots' buffers
  std::unique_ptr<KVStore> store_;                    // last: destroyed first, before the buffers
};

}  // namespace

void bind_kv_store(py::module_& m) {
  py::class_<PyKVStore>(m, "KVStore",
                        "A decoder's K/V cache: resident layers and layers streamed from pinned "
                        "host memory through staging slots (see include/reviva/kv_store.h)")
      .def(py::init<py::object, int, int64_t, int64_t, int64_t, py::object, int64_t, int>(),
           py::arg("engine"), py::arg("num_layers"), py::arg("batch"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("dtype"), py::arg("capacity_tokens"),
           py::arg("prefetch_layers") = 2)
      .def("make_resident", &PyKVStore::make_resident, py::arg("layer"), py::arg("k"), py::arg("v"))
      .def("promote", &PyKVStore::promote, py::arg("layer"), py::arg("k"), py::arg("v"))
      .def("add_slot", &PyKVStore::add_slot, py::arg("k"), py::arg("v"))
      .def("acquire", &PyKVStore::acquire, py::arg("layer"))
      .def("wrote", &PyKVStore::wrote, py::arg("layer"), py::arg("first"), py::arg("count"))
      .def("release", &PyKVStore::release, py::arg("layer"))
      .def("length", [](PyKVStore& s, int layer) { return s.store().length(layer); })
      .def("resident", [](PyKVStore& s, int layer) { return s.store().resident(layer); })
      .def("stats", &PyKVStore::stats)
      .def("synchronize",
           [](PyKVStore& s) {
             py::gil_scoped_release release;
             s.store().synchronize();
           })
      .def("clear",
           [](PyKVStore& s) {
             py::gil_scoped_release release;
             s.store().clear();
           })
      .def_property_readonly("buffer_shape", &PyKVStore::buffer_shape)
      .def_property_readonly("buffer_bytes", [](PyKVStore& s) { return s.store().buffer_bytes(); });
}

}  // namespace reviva::python
