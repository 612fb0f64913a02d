// reviva._C: thin glue between torch tensors and the core. It validates inputs (device, dtype,
// contiguity, sizes), converts tensors to pointers and streams, and keeps the lifetime protocol
// (DESIGN.md) at the torch boundary: producer events on torch's current stream, record_stream
// for memory a copy stream still uses, and the current stream waiting on restores.
#include "runtime.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace py = pybind11;

namespace reviva::python {

void bind_manager(py::module_& m);                                          // manager.cpp
void bind_kv_store(py::module_& m);                                         // kv_store.cpp
void bind_weight_store(py::module_& m);                                     // weight_store.cpp
void bind_row_ops(py::class_<Runtime, std::shared_ptr<Runtime>>& runtime);  // row_ops.cpp
void bind_disk(py::module_& m);                                             // disk.cpp

namespace {

// --- OffloadedTensor: a tensor's bytes in a pinned block, and how to rebuild it ------------

// Note [Offload reads its source later]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// offload() returns before its copy has read the tensor (that is the point: compute goes on),
// so a write to the tensor before the copy completes (x.fill_() right after offload, on any
// stream or on the CPU) may land in part of the copy: restore() then gave back a mixture of the
// old and new values, silently. Snapshotting the source first would double the copy on the hot
// path, and making torch's stream wait for the copy would undo the overlap. Instead the source's
// version counter (the one autograd uses: every in-place op on it or on any view of it bumps
// it, on the host, when the op is issued) is read at offload and again when the copy is first
// seen complete (ready(), wait(), host_tensor(), or a restore, which all observe the copy): a
// change in between is a write the copy may have raced, and host_tensor() and restore() refuse
// the offload by name. A write after the copy was seen complete is the caller's own business. A
// write that bypasses torch (numpy, DLPack, a kernel of one's own) bumps no version and is not
// seen, nor is one to an inference-mode tensor (torch keeps no version for those).
struct OffloadedTensor {
  PinnedBlock block;
  Transfer d2h;
  std::vector<int64_t> shape;
  torch::ScalarType dtype;
  torch::Device device{torch::kCPU};
  // Host runtime only: the source stays alive until its asynchronous copy has read it.
  torch::Tensor keepalive;
  // The source's version counter until the copy is seen complete (Note [Offload reads its
  // source later]); empty for a source without one.
  std::optional<c10::VariableVersion> source_version;
  uint32_t version_at_offload = 0;
  std::optional<uint32_t> written_at;  // the source's version when seen changed

  // The copy is complete now: a write to the source issued before this may be in it.
  void copy_seen_complete() {
    if (!source_version) return;
    const uint32_t now = source_version->current_version();
    if (now != version_at_offload) written_at = now;
    source_version.reset();  // (later writes are after the copy)
  }

  // Refuses the offload if its source was written before its copy was seen complete.
  void check_not_torn(const char* what) const {
    REVIVA_CHECK_ARG(!written_at, what, ": the offloaded tensor (shape ", c10::IntArrayRef(shape),
                     ", dtype ", c10::toString(dtype),
                     ") was written in place after TransferEngine.offload() and before its copy "
                     "was complete (its version went from ",
                     version_at_offload, " to ", written_at.value_or(0),
                     "): the copy may hold part of the old values and part of the new; wait for "
                     "the offload (wait() or ready()) before writing to the tensor");
  }

  OffloadedTensor() = default;
  OffloadedTensor(const OffloadedTensor&) = delete;
  OffloadedTensor& operator=(const OffloadedTensor&) = delete;
  // Host runtime: the copy thread may still be reading `keepalive`; it must outlive the read.
  // (No GIL is needed: the host backend's copy threads never take it.)
  ~OffloadedTensor() {
    if (keepalive.defined() && d2h.valid()) {
      try {
        d2h.wait();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "reviva: warning: OffloadedTensor: waiting for the offload: %s\n",
                     e.what());
      }
    }
  }

  std::size_t nbytes() const { return block.size(); }
  void wait() {
    {
      py::gil_scoped_release release;
      d2h.wait();
    }
    copy_seen_complete();
    keepalive =
        torch::Tensor();  // with the GIL held: dropping a tensor may touch its Python object
  }
  bool ready() {
    const bool r = d2h.ready();
    if (r) {
      copy_seen_complete();
      keepalive = torch::Tensor();
    }
    return r;
  }
};
using OffloadedPtr = std::shared_ptr<OffloadedTensor>;

// A CPU tensor viewing the pinned block (zero copy); keeps the block alive.
torch::Tensor host_view(const OffloadedPtr& h) {
  h->wait();
  h->check_not_torn("OffloadedTensor.host_tensor");
  OffloadedPtr keep = h;
  return torch::from_blob(
      h->block.data(), h->shape, [keep](void*) {},
      torch::TensorOptions().dtype(h->dtype).device(torch::kCPU));
}

// A CPU tensor over a block of the pool (uninitialized, zero copy): pinned host memory of the
// process's one pool for a buffer that Python fills and reads (the prefill's residual stream on
// the host, Note [Residual stream on the host] in python/reviva/generate/llama_layer.py). The block
// goes back to the pool with the tensor's last reference; the copies that use it must have finished
// by then (the caller waits for its streams before dropping it).
torch::Tensor pinned_tensor(const std::shared_ptr<PinnedHostPool>& pool, std::vector<int64_t> shape,
                            const py::object& dtype) {
  const torch::ScalarType st = torch::python::detail::py_object_to_dtype(dtype);
  std::size_t numel = 1;
  for (const int64_t d : shape) {
    REVIVA_CHECK_ARG(d >= 0, "PinnedHostPool.tensor: negative size in shape");
    REVIVA_CHECK_ARG(
        d == 0 || numel <= std::numeric_limits<std::size_t>::max() / static_cast<std::size_t>(d),
        "PinnedHostPool.tensor: the shape's element count overflows");
    numel *= static_cast<std::size_t>(d);
  }
  const std::size_t item = c10::elementSize(st);
  REVIVA_CHECK_ARG(numel <= std::numeric_limits<std::size_t>::max() / item,
                   "PinnedHostPool.tensor: the shape's byte count overflows");
  const std::size_t bytes = std::max<std::size_t>(numel * item, 1);
  auto block = std::make_shared<PinnedBlock>(pool->allocate(bytes));
  void* data = block->data();
  return torch::from_blob(
      data, shape, [block](void*) mutable { block.reset(); },
      torch::TensorOptions().dtype(st).device(torch::kCPU));
}

// --- TransferEngine binding --------------------------------------------------------------------

class PyTransferEngine {
 public:
  PyTransferEngine(std::shared_ptr<Runtime> rt, std::shared_ptr<PinnedHostPool> pool,
                   TransferEngineOptions options)
      : rt_(std::move(rt)), engine_(std::make_shared<TransferEngine>(std::move(pool), options)) {
    REVIVA_CHECK_ARG(&engine_->backend() == rt_->backend().get(),
                     "TransferEngine: the pool belongs to another runtime");
  }

  OffloadedPtr offload(const torch::Tensor& t, bool record_stream) {
    return offload_batch({t}, record_stream).front();
  }

  // record_stream: torch's allocator may reuse a source's memory only after the D2H stream has
  // passed this point (events recorded when the tensor is freed). Without it the caller keeps
  // each source alive until its offload is ready(); freeing it then needs no event.
  std::vector<OffloadedPtr> offload_batch(const std::vector<torch::Tensor>& tensors,
                                          bool record_stream) {
    REVIVA_CHECK_ARG(!tensors.empty(), "offload_batch: no tensors given");
    std::vector<OffloadedPtr> out;
    std::vector<CopyRequest> requests;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const torch::Tensor& t = tensors[i];
      check_on_runtime_device(*rt_, t, ("offload: tensor " + std::to_string(i)).c_str());
      auto h = std::make_shared<OffloadedTensor>();
      h->block = engine_->pool().allocate(t.nbytes());
      h->block.record_use(engine_->stream_ptr(Direction::DeviceToHost));
      h->shape = t.sizes().vec();
      h->dtype = t.scalar_type();
      h->device = t.device();
      if (!rt_->is_cuda()) h->keepalive = t;
      // (Note [Offload reads its source later])
      const c10::VariableVersion& version = t.unsafeGetTensorImpl()->version_counter();
      if (version.enabled()) {
        h->source_version = version;
        h->version_at_offload = version.current_version();
      }
      requests.push_back({h->block.data(), t.data_ptr(), t.nbytes()});
      out.push_back(std::move(h));
    }
    std::optional<Event> producer = rt_->producer_event();
    Transfer transfer =
        engine_->copy_batch(Direction::DeviceToHost, requests, producer ? &*producer : nullptr);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      out[i]->d2h = transfer;
      if (record_stream) rt_->record_stream(tensors[i], engine_->stream(Direction::DeviceToHost));
    }
    return out;
  }

  torch::Tensor restore(const OffloadedPtr& h, std::optional<torch::Tensor> out, bool wait) {
    std::vector<std::optional<torch::Tensor>> outs{std::move(out)};
    return restore_batch({h}, outs, wait).front();
  }

  std::vector<torch::Tensor> restore_batch(const std::vector<OffloadedPtr>& handles,
                                           std::vector<std::optional<torch::Tensor>> outs,
                                           bool wait) {
    auto [results, transfer] = submit_restore(handles, std::move(outs), true);
    // Rule 3. The host runtime always waits: torch computes on the CPU synchronously.
    if (wait || !rt_->current_stream()) {
      wait_for(transfer);
      for (const OffloadedPtr& h : handles) h->copy_seen_complete();  // (the H2D came after it)
    }
    return results;
  }

  // Starts bringing `h` back into a new device tensor; the caller orders its use with
  // wait_for(transfer) (a prefetch: compute goes on meanwhile). The tensor is allocated on the
  // current stream. record_stream=false: the caller promises that the current stream waits
  // for the transfer (wait_for) before the tensor is freed, so its memory returns to torch's
  // allocator in stream order, without an event that holds it until the H2D stream passes.
  std::pair<torch::Tensor, Transfer> restore_async(const OffloadedPtr& h, bool record_stream) {
    auto [results, transfer] = submit_restore({h}, {}, record_stream);
    return {results.front(), transfer};
  }

  // Later work on torch's current stream waits for `transfer` (rule 3); on the host runtime the
  // calling thread waits, since torch computes on the CPU synchronously.
  // The engine measures the wait (its stall meter: stats()["compute_stall_s"]).
  void wait_for(const Transfer& transfer) {
    auto compute = rt_->compute_stream();
    engine_->wait_on(transfer, *compute);
    if (!rt_->is_cuda()) {
      py::gil_scoped_release release;
      compute->synchronize();
    }
  }

 private:
  std::pair<std::vector<torch::Tensor>, Transfer> submit_restore(
      const std::vector<OffloadedPtr>& handles, std::vector<std::optional<torch::Tensor>> outs,
      bool record_stream) {
    REVIVA_CHECK_ARG(!handles.empty(), "restore_batch: no tensors given");
    REVIVA_CHECK_ARG(outs.empty() || outs.size() == handles.size(),
                     "restore_batch: ", handles.size(), " tensors but ", outs.size(), " outputs");
    // Every source written since its offload refuses the call before anything is queued (a
    // write issued by now may be in a copy that completes later: Note [Offload reads its source
    // later]).
    for (std::size_t i = 0; i < handles.size(); ++i) {
      const OffloadedPtr& h = handles[i];
      if (!h) continue;  // (refused below)
      if (h->d2h.valid() && h->d2h.ready()) h->copy_seen_complete();
      if (h->source_version && h->source_version->current_version() != h->version_at_offload)
        h->written_at = h->source_version->current_version();
      h->check_not_torn(("restore: tensor " + std::to_string(i)).c_str());
    }
    const Stream& h2d = engine_->stream(Direction::HostToDevice);
    std::vector<torch::Tensor> results;
    std::vector<CopyRequest> requests;
    for (std::size_t i = 0; i < handles.size(); ++i) {
      const OffloadedPtr& h = handles[i];
      REVIVA_CHECK_ARG(h && h->block, "restore: tensor ", i, " holds no data");
      REVIVA_CHECK_ARG(h->device == rt_->device(), "restore: tensor ", i, " was offloaded from ",
                       h->device.str(), ", this engine restores to ", rt_->device().str());

      torch::Tensor dst;
      if (!outs.empty() && outs[i].has_value()) {
        dst = *outs[i];
        const std::string what = "restore: out " + std::to_string(i);
        check_on_runtime_device(*rt_, dst, what.c_str());
        REVIVA_CHECK_ARG(dst.scalar_type() == h->dtype, what, ": dtype ", dst.dtype(),
                         " differs from the offloaded ", c10::toString(h->dtype));
        REVIVA_CHECK_ARG(dst.nbytes() == h->nbytes(), what, ": ", dst.nbytes(),
                         " bytes differ from the offloaded ", h->nbytes(), " bytes");
      } else {
        dst = torch::empty(h->shape, torch::TensorOptions().dtype(h->dtype).device(rt_->device()));
      }
      h->d2h.enqueue_wait(h2d);  // the block is read only after its offload has written it
      h->block.record_use(engine_->stream_ptr(Direction::HostToDevice));
      requests.push_back({dst.data_ptr(), h->block.data(), h->nbytes()});
      results.push_back(dst);
    }
    // `dst` memory may have been in use by earlier torch work on the current stream.
    std::optional<Event> producer = rt_->producer_event();
    Transfer transfer =
        engine_->copy_batch(Direction::HostToDevice, requests, producer ? &*producer : nullptr);
    if (record_stream) {
      for (const torch::Tensor& dst : results) rt_->record_stream(dst, h2d);
    }
    return {results, transfer};
  }

 public:
  // Copies between a device tensor and a pinned CPU tensor of the same size (direction from
  // the devices). Returns the completion handle; the caller orders its own use of the result.
  Transfer copy_(const torch::Tensor& dst, const torch::Tensor& src) {
    REVIVA_CHECK_ARG(dst.defined() && src.defined(), "copy_: undefined tensor");
    REVIVA_CHECK_ARG(dst.nbytes() == src.nbytes(), "copy_: dst has ", dst.nbytes(),
                     " bytes, src has ", src.nbytes());
    const bool d2h = dst.device().is_cpu() && src.device() == rt_->device();
    const bool h2d = src.device().is_cpu() && dst.device() == rt_->device();
    REVIVA_CHECK_ARG(rt_->is_cuda() && (d2h || h2d), "copy_: needs one tensor on ",
                     rt_->device().str(), " and one pinned CPU tensor; got dst ", describe(dst),
                     " and src ", describe(src));
    const torch::Tensor& host = d2h ? dst : src;
    const torch::Tensor& device = d2h ? src : dst;
    check_on_runtime_device(*rt_, device, "copy_");
    REVIVA_CHECK_ARG(host.is_contiguous() && host.is_pinned(),
                     "copy_: the CPU tensor must be contiguous and pinned (pin_memory()), got ",
                     describe(host));
    const Direction dir = d2h ? Direction::DeviceToHost : Direction::HostToDevice;
    std::optional<Event> producer = rt_->producer_event();
    Transfer t = engine_->copy(dir, dst.data_ptr(), src.data_ptr(), dst.nbytes(),
                               producer ? &*producer : nullptr);
    rt_->record_stream(device, engine_->stream(dir));
    return t;
  }

  void synchronize() {
    py::gil_scoped_release release;
    engine_->synchronize();
  }

  py::dict stats() {
    const TransferStats st = engine_->stats();
    auto dir = [](const DirectionStats& d) {
      py::dict r;
      r["transfers_submitted"] = d.transfers_submitted;
      r["transfers_completed"] = d.transfers_completed;
      r["bytes_submitted"] = d.bytes_submitted;
      r["bytes_completed"] = d.bytes_completed;
      r["chunks"] = d.chunks;
      r["coalesced_requests"] = d.coalesced_requests;
      r["segment_launches"] = d.segment_launches;
      r["busy_s"] = d.busy_ms / 1e3;
      r["bandwidth_gbps"] = d.bandwidth_gbps();
      return r;
    };
    py::dict r;
    r["to_host"] = dir(st.d2h);
    r["to_device"] = dir(st.h2d);
    r["compute_stall_s"] = st.compute_stall_ms / 1e3;
    r["stalls"] = st.stalls;
    r["overlap_ratio"] = st.overlap_ratio();
    return r;
  }

  void reset_stats() { engine_->reset_stats(); }
  TransferEngine& engine() { return *engine_; }
  const std::shared_ptr<TransferEngine>& engine_ptr() const { return engine_; }
  const std::shared_ptr<Runtime>& runtime() const { return rt_; }

 private:
  std::shared_ptr<Runtime> rt_;
  std::shared_ptr<TransferEngine> engine_;
};

py::dict pool_stats(const PinnedHostPool& pool) {
  const PinnedHostPoolStats st = pool.stats();
  py::dict r;
  r["bytes_reserved"] = st.bytes_reserved;
  r["bytes_in_use"] = st.bytes_in_use;
  r["bytes_requested"] = st.bytes_requested;
  r["bytes_pending"] = st.bytes_pending;
  r["peak_bytes_in_use"] = st.peak_bytes_in_use;
  r["peak_bytes_reserved"] = st.peak_bytes_reserved;
  r["largest_free_block"] = st.largest_free_block;
  r["allocations"] = st.allocations;
  r["cache_hits"] = st.cache_hits;
  r["hit_rate"] = st.hit_rate();
  r["frees"] = st.frees;
  r["slabs"] = st.slabs;
  r["slabs_allocated"] = st.slabs_allocated;
  r["slabs_released"] = st.slabs_released;
  r["free_blocks"] = st.free_blocks;
  r["pending_blocks"] = st.pending_blocks;
  return r;
}

// Runtime.dequantize_fp8_rows: checks the tensors, then the backend's kernel on torch's current
// stream (CUDA) or the host backend's on the runtime's own stream, waited for (torch on the CPU
// computes synchronously).
void dequantize_fp8_rows_into(const Runtime& rt, const torch::Tensor& rows, torch::Tensor& out) {
  REVIVA_CHECK_ARG(rows.defined() && out.defined(), "dequantize_fp8_rows: a tensor is None");
  REVIVA_CHECK_ARG(rows.device() == rt.device() && out.device() == rt.device(),
                   "dequantize_fp8_rows: expected tensors on ", rt.device().str(), ", got rows ",
                   describe(rows), " and out ", describe(out));
  REVIVA_CHECK_ARG(rows.scalar_type() == torch::kUInt8,
                   "dequantize_fp8_rows: rows must be uint8, got a ", describe(rows));
  const bool bf16 = out.scalar_type() == torch::kBFloat16;
  REVIVA_CHECK_ARG(bf16 || out.scalar_type() == torch::kHalf,
                   "dequantize_fp8_rows: out must be bfloat16 or float16, got a ", describe(out));
  const int64_t dims = rows.dim();
  REVIVA_CHECK_ARG(dims >= 1 && dims <= 4,
                   "dequantize_fp8_rows: rows must have 1 to 4 dimensions (up to 3 of rows, "
                   "then the row's bytes), got a ",
                   describe(rows));
  REVIVA_CHECK_ARG(rows.size(-1) > 4 && rows.stride(-1) == 1,
                   "dequantize_fp8_rows: each row must be dense and longer than its 4-byte "
                   "scale, got a ",
                   describe(rows), " with strides ", rows.strides());
  const auto head_dim = static_cast<std::size_t>(rows.size(-1) - 4);
  std::vector<int64_t> want(rows.sizes().begin(), rows.sizes().end());
  want.back() = static_cast<int64_t>(head_dim);
  REVIVA_CHECK_ARG(out.is_contiguous() && out.sizes().vec() == want,
                   "dequantize_fp8_rows: out must be contiguous of shape ", c10::IntArrayRef(want),
                   ", got a ", describe(out), " with strides ", out.strides());
  Fp8Rows r;
  r.base = rows.data_ptr();
  r.head_dim = head_dim;
  const int64_t lead = dims - 1;
  for (int64_t d = 0; d < 3; ++d) {
    const int64_t k = d - (3 - lead);  // leading dims right-aligned into the 3 of Fp8Rows
    r.count[d] = k >= 0 ? static_cast<std::size_t>(rows.size(k)) : 1;
    r.stride[d] = k >= 0 ? rows.stride(k) : 0;
  }
  if (out.numel() == 0) return;  // (the backend checks the rest, check_fp8_rows)
  const HalfType type = bf16 ? HalfType::BFloat16 : HalfType::Float16;
  if (auto stream = rt.current_stream()) {
    rt.backend()->dequantize_fp8_rows_async(r, out.data_ptr(), type, stream->handle());
    return;
  }
  py::gil_scoped_release release;
  auto stream = rt.compute_stream();
  rt.backend()->dequantize_fp8_rows_async(r, out.data_ptr(), type, stream->handle());
  rt.backend()->synchronize_stream(stream->handle());
}

// Runtime.gather_rows: an embedding's lookup whose table may be pinned host memory, read in
// place by the device (Note [Embedding on the host]); on torch's current stream (CUDA) or the
// host backend's own stream, waited for.
void gather_rows_into(const Runtime& rt, const torch::Tensor& table, const torch::Tensor& ids,
                      torch::Tensor& out) {
  REVIVA_CHECK_ARG(table.defined() && ids.defined() && out.defined(),
                   "gather_rows: a tensor is None");
  const bool table_here = table.device() == rt.device();
  REVIVA_CHECK_ARG(table_here || (table.device().is_cpu() && table.is_pinned()),
                   "gather_rows: the table must be on ", rt.device().str(),
                   " or in pinned host memory, got a ", describe(table),
                   table.device().is_cpu() ? " (pageable)" : "");
  REVIVA_CHECK_ARG(table.dim() == 2 && table.is_contiguous() && table.size(0) > 0,
                   "gather_rows: the table must be a contiguous 2-D tensor with rows, got a ",
                   describe(table));
  REVIVA_CHECK_ARG(ids.device() == rt.device() && ids.scalar_type() == torch::kLong &&
                       ids.dim() == 1 && ids.is_contiguous(),
                   "gather_rows: ids must be a contiguous 1-D int64 tensor on ", rt.device().str(),
                   ", got a ", describe(ids));
  REVIVA_CHECK_ARG(out.device() == rt.device() && out.scalar_type() == table.scalar_type() &&
                       out.is_contiguous() && out.dim() == 2 && out.size(0) == ids.size(0) &&
                       out.size(1) == table.size(1),
                   "gather_rows: out must be a contiguous ", table.dtype(), " tensor of shape [",
                   ids.size(0), ", ", table.size(1), "] on ", rt.device().str(), ", got a ",
                   describe(out));
  RowGather g;
  g.table = table.data_ptr();
  g.rows = static_cast<std::size_t>(table.size(0));
  g.row_bytes = static_cast<std::size_t>(table.size(1)) * table.element_size();
  g.ids = ids.data_ptr<int64_t>();
  g.count = static_cast<std::size_t>(ids.size(0));
  g.out = out.data_ptr();
  if (g.count == 0 || g.row_bytes == 0) return;
  if (auto stream = rt.current_stream()) {
    rt.backend()->gather_rows_async(g, stream->handle());
    return;
  }
  py::gil_scoped_release release;
  auto stream = rt.compute_stream();
  rt.backend()->gather_rows_async(g, stream->handle());
  rt.backend()->synchronize_stream(stream->handle());
}

}  // namespace

std::shared_ptr<TransferEngine> engine_of(py::handle py_engine) {
  return py_engine.cast<PyTransferEngine&>().engine_ptr();
}
std::shared_ptr<Runtime> runtime_of(py::handle py_engine) {
  return py_engine.cast<PyTransferEngine&>().runtime();
}

}  // namespace reviva::python

PYBIND11_MODULE(_C, m) {
  using namespace reviva;
  using namespace reviva::python;
  m.doc() = "Reviva core bindings (pinned host pool, transfer engine) on torch tensors";

  // The module holds the exception types; the translator keeps borrowed pointers to them (plain
  // pointers, so nothing is destroyed after the interpreter has shut down).
  static PyObject* base_error = py::exception<Error>(m, "RevivaError", PyExc_RuntimeError).ptr();
  static PyObject* oom_error =
      py::exception<OutOfMemory>(m, "RevivaOutOfMemoryError", PyExc_MemoryError).ptr();
  static PyObject* backend_error =
      py::exception<BackendError>(m, "RevivaBackendError", base_error).ptr();
  static PyObject* disk_error = py::exception<DiskError>(m, "RevivaDiskError", base_error).ptr();
  // Local: applies to exceptions from this module only, never to those of torch or others.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const OutOfMemory& e) {
      PyErr_SetString(oom_error, e.what());
    } catch (const BackendError& e) {
      PyErr_SetString(backend_error, e.what());
    } catch (const DiskError& e) {
      PyErr_SetString(disk_error, e.what());
    } catch (const Error& e) {
      PyErr_SetString(base_error, e.what());
    }
  });

  m.def("version", &version_string);
  m.def("overlap_ratio", &overlap_ratio, py::arg("compute_stall"), py::arg("copy_busy"),
        "Note [Overlap ratio] (include/reviva/metrics.h): 1 - stall / copy busy time, in [0, 1].");
  m.def("cuda_available", &cuda_available);
  m.def("cuda_device_count", &cuda_device_count);

  py::class_<Runtime, std::shared_ptr<Runtime>> runtime(m, "Runtime");
  runtime
      .def(py::init([](const std::optional<std::string>& device) {
             auto rt = std::make_shared<Runtime>(device);
             // Torch initializes CUDA (its caching allocator among the rest) lazily, at its first
             // CUDA op; Reviva may allocate through that allocator before any (seen on the H200:
             // "Allocator not initialized for device" in a fresh process).
             if (rt->is_cuda()) py::module_::import("torch.cuda").attr("init")();
             return rt;
           }),
           py::arg("device") = py::none())
      .def_property_readonly("device", [](const Runtime& r) { return r.device().str(); })
      .def_property_readonly("backend", [](const Runtime& r) { return r.backend()->name(); })
      .def_property_readonly("kind",
                             [](const Runtime& r) { return to_string(r.backend()->kind()); })
      .def("device_memory_info",
           [](const Runtime& r) {
             const DeviceMemoryInfo info = r.backend()->device_memory_info();
             return py::make_tuple(info.free_bytes, info.total_bytes);
           })
      .def("dequantize_fp8_rows", &dequantize_fp8_rows_into, py::arg("rows"), py::arg("out"),
           "fp8 K/V rows (uint8 [..., head_dim + 4]: e4m3 values and an fp32 scale, Note [fp8 "
           "K/V rows]) into `out` (contiguous bf16 or fp16 [..., head_dim]) on the runtime's "
           "device, in torch's current stream's order: one kernel on CUDA. Up to 3 leading "
           "dimensions, any strides that are multiples of 4 bytes, the last dimension dense.")
      .def("gather_rows", &gather_rows_into, py::arg("table"), py::arg("ids"), py::arg("out"),
           "Rows of `table` (contiguous [rows, width], on the runtime's device or in pinned "
           "host memory, which the device reads in place) by index: out[i] = table[ids[i]] "
           "(ids int64 [n] and out [n, width] on the runtime's device), zeros for an index "
           "outside the table; in torch's current stream's order: one kernel on CUDA, no "
           "host work and no synchronization.")
      .def("__repr__", &Runtime::repr);
  bind_row_ops(runtime);
  bind_disk(m);

  py::class_<PinnedHostPool, std::shared_ptr<PinnedHostPool>>(m, "PinnedHostPool")
      .def(py::init([](const std::shared_ptr<Runtime>& rt, std::size_t capacity_bytes,
                       std::size_t slab_bytes) {
             REVIVA_CHECK_ARG(rt != nullptr, "PinnedHostPool: runtime is None");
             PinnedHostPoolOptions o;
             o.capacity_bytes = capacity_bytes;
             o.slab_bytes = slab_bytes;
             return PinnedHostPool::create(rt->backend(), o);
           }),
           py::arg("runtime"), py::arg("capacity_bytes") = 0,
           py::arg("slab_bytes") = std::size_t{64} << 20)
      .def("stats", &pool_stats)
      .def("reserve", &PinnedHostPool::reserve, py::arg("count"), py::arg("block_bytes"),
           py::call_guard<py::gil_scoped_release>())
      .def("release_cached", &PinnedHostPool::release_cached,
           py::call_guard<py::gil_scoped_release>())
      .def("synchronize_pending", &PinnedHostPool::synchronize_pending,
           py::call_guard<py::gil_scoped_release>())
      .def("check_invariants", &PinnedHostPool::check_invariants)
      .def("tensor", &pinned_tensor, py::arg("shape"), py::arg("dtype"),
           "An uninitialized CPU tensor over a pinned block of this pool; the block returns to "
           "the pool with the tensor (copies using it must have finished).")
      .def_property_readonly("capacity_bytes",
                             [](const PinnedHostPool& p) { return p.options().capacity_bytes; });

  py::class_<Transfer>(m, "Transfer")
      .def("ready", &Transfer::ready)
      .def("wait", &Transfer::wait, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("nbytes", &Transfer::bytes)
      .def_property_readonly(
          "direction", [](const Transfer& t) { return std::string(to_string(t.direction())); });

  py::class_<OffloadedTensor, OffloadedPtr>(m, "OffloadedTensor")
      .def("ready", &OffloadedTensor::ready)
      .def("wait", &OffloadedTensor::wait)
      .def("host_tensor", &host_view,
           "A CPU tensor viewing the pinned copy (waits for the offload first).")
      .def_property_readonly("nbytes", &OffloadedTensor::nbytes)
      .def_property_readonly("shape", [](const OffloadedTensor& h) { return h.shape; })
      .def_property_readonly("dtype",
                             [](const OffloadedTensor& h) {
                               return py::reinterpret_borrow<py::object>(
                                   reinterpret_cast<PyObject*>(torch::getTHPDtype(h.dtype)));
                             })
      .def_property_readonly("device", [](const OffloadedTensor& h) { return h.device.str(); });

  py::class_<PyTransferEngine>(m, "TransferEngine")
      .def(py::init([](std::shared_ptr<Runtime> rt, std::shared_ptr<PinnedHostPool> pool,
                       std::size_t chunk_bytes, std::size_t coalesce_below) {
             REVIVA_CHECK_ARG(rt != nullptr && pool != nullptr,
                              "TransferEngine: runtime and pool are required");
             TransferEngineOptions o;
             o.chunk_bytes = chunk_bytes;
             o.coalesce_below = coalesce_below;
             rt->choose_copy_streams(o);
             return std::make_unique<PyTransferEngine>(std::move(rt), std::move(pool), o);
           }),
           py::arg("runtime"), py::arg("pool"), py::arg("chunk_bytes") = std::size_t{64} << 20,
           py::arg("coalesce_below") = std::size_t{256} << 10)
      .def_property_readonly(
          "runtime", [](py::object self) { return runtime_of(self); },
          "The runtime (device and backend) whose streams this engine copies on.")
      .def("offload", &PyTransferEngine::offload, py::arg("tensor"), py::kw_only(),
           py::arg("record_stream") = true,
           "Copies a device tensor into a pinned block (D2H stream, after the current stream's "
           "work). The copy is asynchronous: it reads the tensor when the D2H stream gets to "
           "it, so the tensor must not be written (in place, by any stream or the host) until "
           "the result is ready() or wait() returned; a write through torch before that is "
           "seen by the tensor's version counter, and restore() and host_tensor() then raise "
           "ValueError instead of returning a copy that may be torn (a write bypassing torch, "
           "or to an inference-mode tensor, is not seen). record_stream=False: the caller keeps "
           "the tensor alive until the result is ready(); its memory then returns to torch's "
           "allocator without events.")
      .def("offload_batch", &PyTransferEngine::offload_batch, py::arg("tensors"), py::kw_only(),
           py::arg("record_stream") = true)
      .def("restore", &PyTransferEngine::restore, py::arg("offloaded"), py::arg("out") = py::none(),
           py::arg("wait") = true)
      .def("restore_async", &PyTransferEngine::restore_async, py::arg("offloaded"), py::kw_only(),
           py::arg("record_stream") = true,
           "Starts the H2D into a new tensor (allocated on the current stream); returns "
           "(tensor, Transfer). Order its use with wait_for(transfer). record_stream=False: the "
           "current stream waits for the transfer before the tensor is freed (the caller's "
           "promise); its memory is then reused in stream order, with no event.")
      .def("wait_for", &PyTransferEngine::wait_for, py::arg("transfer"),
           "Torch's current stream waits for the transfer (the host runtime: the caller waits).")
      .def("restore_batch", &PyTransferEngine::restore_batch, py::arg("offloaded"),
           py::arg("outs") = std::vector<std::optional<torch::Tensor>>{}, py::arg("wait") = true)
      .def("copy_", &PyTransferEngine::copy_, py::arg("dst"), py::arg("src"))
      .def("synchronize", &PyTransferEngine::synchronize)
      .def("stats", &PyTransferEngine::stats)
      .def("reset_stats", &PyTransferEngine::reset_stats);

  bind_manager(m);
  bind_kv_store(m);
  bind_weight_store(m);
}
