// reviva._C.KVStore and reviva._C.DeviceArena: the core KVStore and its arena on torch tensors.
//
// A layer's K/V is one token-major buffer [capacity, 2, batch, kv_heads, head_dim] (a row holds a
// token's K then V): an append block of the store's OffloadManager, in the core's DeviceArena
// outside torch's allocator. view() returns a tensor over the first tokens of an acquired
// layer's buffer; the tensor keeps that memory mapped while it lives (its deleter holds the arena
// buffer), so no view can outlive the memory it reads, and release(layer) revokes it (Note
// [Revoked views] in leases.h): the slot may hold another layer's K/V from then on, in other
// memory while a numpy array or DLPack capsule of the view still holds the old one.
// Compute is torch's current stream on CUDA; on the host runtime acquire() waits for the fill
// before returning, since torch computes on the CPU synchronously.
#include "leases.h"
#include "runtime.h"

#include <reviva/host_attention.h>

#include <atomic>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace py = pybind11;

namespace reviva::python {
namespace {

py::dict arena_stats(DeviceArena& arena) {
  const DeviceArenaStats s = arena.stats();
  py::dict d;
  d["granularity"] = s.granularity;
  d["limit_bytes"] = s.limit_bytes;
  d["mapped_bytes"] = s.mapped_bytes;
  d["retiring_bytes"] = s.retiring_bytes;
  d["peak_bytes"] = s.peak_bytes;
  d["reserved_address_bytes"] = s.reserved_address_bytes;
  d["buffers"] = s.buffers;
  d["maps"] = s.maps;
  d["unmaps"] = s.unmaps;
  d["failed_maps"] = s.failed_maps;
  d["reclaim_calls"] = s.reclaim_calls;
  d["map_s"] = s.map_ms / 1e3;
  d["unmap_s"] = s.unmap_ms / 1e3;
  return d;
}

std::shared_ptr<DeviceArena> make_arena(const std::shared_ptr<Runtime>& rt,
                                        std::size_t limit_bytes) {
  REVIVA_CHECK_ARG(rt != nullptr, "DeviceArena: runtime is None");
  DeviceArenaOptions o;
  o.limit_bytes = limit_bytes;
#if defined(REVIVA_TORCH_CUDA)
  if (rt->is_cuda()) {
    // The device is full: torch may hold cached blocks it does not use (the prefill working
    // set, after prefill); give them back to the device and try the mapping again.
    const c10::DeviceIndex device = rt->device().index();
    o.reclaim = [device] {
      const auto before = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
      const auto reserved = before.reserved_bytes[0].current;
      const auto allocated = before.allocated_bytes[0].current;
      if (reserved <= allocated) return false;
      c10::cuda::CUDACachingAllocator::emptyCache();
      return true;
    };
  }
#endif
  return DeviceArena::create(rt->backend(), o);
}

class PyKVStore {
 public:
  PyKVStore(py::object engine, std::shared_ptr<DeviceArena> arena, int num_layers, int64_t batch,
            int64_t kv_heads, int64_t head_dim, py::object dtype, int64_t capacity_tokens,
            int prefetch_layers, std::size_t timeline_capacity, int64_t page_tokens,
            const std::vector<int64_t>& layer_capacity_tokens,
            const std::optional<std::string>& disk_path, int disk_staged_layers)
      : rt_(runtime_of(engine)) {
    REVIVA_CHECK_ARG(arena != nullptr, "KVStore: arena is None");
    REVIVA_CHECK_ARG(batch > 0 && kv_heads > 0 && head_dim > 0,
                     "KVStore: batch, kv_heads and head_dim must be > 0, got ", batch, ", ",
                     kv_heads, ", ", head_dim);
    REVIVA_CHECK_ARG(capacity_tokens > 0, "KVStore: capacity_tokens must be > 0, got ",
                     capacity_tokens);
    REVIVA_CHECK_ARG(page_tokens >= 0, "KVStore: page_tokens must be >= 0, got ", page_tokens);
    REVIVA_CHECK_ARG(arena->backend().kind() == rt_->backend()->kind(),
                     "KVStore: the arena belongs to another kind of device than the engine");
    dtype_ = torch::python::detail::py_object_to_dtype(dtype);
    row_ = {2, batch, kv_heads, head_dim};
    std::size_t token_bytes = c10::elementSize(dtype_);
    for (int64_t d : row_) {
      REVIVA_CHECK_ARG(
          !__builtin_mul_overflow(token_bytes, static_cast<std::size_t>(d), &token_bytes),
          "KVStore: a token of batch ", batch, ", ", kv_heads, " heads of ", head_dim,
          " overflows");
    }
    KVStoreOptions o;
    o.num_layers = num_layers;
    o.token_bytes = token_bytes;
    o.capacity_tokens = static_cast<std::size_t>(capacity_tokens);
    o.prefetch_layers = prefetch_layers;
    o.timeline_capacity = timeline_capacity;
    o.page_tokens = static_cast<std::size_t>(page_tokens);
    for (int64_t c : layer_capacity_tokens) {
      REVIVA_CHECK_ARG(c > 0, "KVStore: layer_capacity_tokens must be > 0, got ", c);
      o.layer_capacity_tokens.push_back(static_cast<std::size_t>(c));
    }
    // Note [Spilled layers] (src/kv_store_disk.cpp): a disk for layers that spill ("" a new
    // folder under $TMPDIR)
    REVIVA_CHECK_ARG(disk_staged_layers >= 0, "KVStore: disk_staged_layers must be >= 0, got ",
                     disk_staged_layers);
    if (disk_path) {
      DiskStoreOptions d;
      d.directory = *disk_path;
      o.disk = std::make_shared<DiskStore>(d);
    }
    o.disk_staged_layers = disk_staged_layers;
    store_ = std::make_shared<KVStore>(engine_of(engine), std::move(arena), o);
  }

  ~PyKVStore() {
    py::gil_scoped_release release;
    // waits for copies touching the buffers before they go back (or, while host_kv's views
    // live, when the last of them goes: they hold the store)
    store_.reset();
  }

  // clear() and close() give the host copies back: not while host_kv's views of them live.
  void check_no_host_views(const char* what) const {
    const int views = host_views_->load();
    REVIVA_CHECK_ARG(views == 0, "KVStore::", what, ": ", views,
                     " result(s) of host_kv() still view the host copies; drop them first");
  }

  void acquire(int layer) {
    auto compute = rt_->compute_stream();
    store_->acquire(layer, *compute);
    if (!rt_->is_cuda()) {
      py::gil_scoped_release release;
      compute->synchronize();  // the fill has landed before torch reads on the CPU
    }
  }

  // [tokens, 2, batch, kv_heads, head_dim] over the acquired layer's first `tokens` tokens, until
  // release(layer).
  torch::Tensor view(int layer, int64_t tokens) {
    torch::Tensor t = rows(layer, tokens);
    leases_.grant(layer, t);
    return t;
  }

  void acquire_page(int layer, std::size_t page) {
    auto compute = rt_->compute_stream();
    store_->acquire_page(layer, page, *compute);
    if (!rt_->is_cuda()) {
      py::gil_scoped_release release;
      compute->synchronize();  // the fill has landed before torch reads on the CPU
    }
  }

  // view() for this object's own use (not revoked: dropped before it returns).
  torch::Tensor rows(int layer, int64_t tokens) {
    REVIVA_CHECK_ARG(tokens >= 0, "KVStore::view: tokens must be >= 0, got ", tokens);
    const std::size_t mapped = store_->reserved_tokens(layer);
    REVIVA_CHECK_ARG(static_cast<std::size_t>(tokens) <= mapped, "KVStore::view: ", tokens,
                     " tokens of layer ", layer, " asked, ", mapped,
                     " reserved (call reserve first)");
    std::shared_ptr<ArenaBuffer> buffer = store_->buffer(layer);
    std::vector<int64_t> shape{tokens};
    shape.insert(shape.end(), row_.begin(), row_.end());
    return torch::from_blob(
        buffer->data(), shape, [buffer](void*) mutable { buffer.reset(); },
        torch::TensorOptions().dtype(dtype_).device(rt_->device()));
  }

  // page_view() for this object's own use (not revoked: dropped before it returns).
  torch::Tensor page_rows(int layer, std::size_t page, int64_t tokens) {
    REVIVA_CHECK_ARG(tokens >= 0, "KVStore::page_view: tokens must be >= 0, got ", tokens);
    const std::size_t mapped = store_->reserved_page_tokens(layer, page);
    REVIVA_CHECK_ARG(static_cast<std::size_t>(tokens) <= mapped, "KVStore::page_view: ", tokens,
                     " tokens of page ", page, " of layer ", layer, " asked, ", mapped,
                     " reserved");
    std::shared_ptr<ArenaBuffer> buffer = store_->page_buffer(layer, page);
    std::vector<int64_t> shape{tokens};
    shape.insert(shape.end(), row_.begin(), row_.end());
    return torch::from_blob(
        buffer->data(), shape, [buffer](void*) mutable { buffer.reset(); },
        torch::TensorOptions().dtype(dtype_).device(rt_->device()));
  }

  // [tokens, 2, batch, kv_heads, head_dim] over the first `tokens` tokens of an acquired page,
  // until release_page(layer, page).
  torch::Tensor page_view(int layer, std::size_t page, int64_t tokens) {
    torch::Tensor t = page_rows(layer, page, tokens);
    page_leases_.grant(page_key(layer, page), t);
    return t;
  }

  void release_page(int layer, std::size_t page) {
    store_->release_page(layer, page, *rt_->compute_stream());
    page_leases_.revoke(
        page_key(layer, page),
        revoked("page_view(" + std::to_string(layer) + ", " + std::to_string(page) + ", ...)",
                "release_page(" + std::to_string(layer) + ", " + std::to_string(page) + ")"));
  }

  std::pair<torch::Tensor, torch::Tensor> page_kv(int layer, std::size_t page, int64_t tokens) {
    torch::Tensor rows = page_view(layer, page, tokens);
    return {rows.select(1, 0).permute({1, 2, 0, 3}), rows.select(1, 1).permute({1, 2, 0, 3})};
  }

  // Writes `key` and `value` ([batch, kv_heads, n, head_dim], any strides) as tokens
  // [first, first + n) of the acquired layer: maps them, copies them in on torch's stream and
  // sends them on to the layer's host copy. One call for what compute writes per layer. A paged
  // layer (Note [Paged layers] in kv_store.cpp) is written page by page, each page acquired,
  // written through and released here.
  void write(int layer, int64_t first, const torch::Tensor& key, const torch::Tensor& value) {
    REVIVA_CHECK_ARG(key.dim() == 4 && key.sizes() == value.sizes(),
                     "KVStore::write: key and value must be [batch, kv_heads, tokens, head_dim] "
                     "of one shape, got ",
                     describe(key), " and ", describe(value));
    REVIVA_CHECK_ARG(key.size(0) == row_[1] && key.size(1) == row_[2] && key.size(3) == row_[3],
                     "KVStore::write: expected [", row_[1], ", ", row_[2], ", tokens, ", row_[3],
                     "], got ", describe(key));
    REVIVA_CHECK_ARG(key.scalar_type() == dtype_ && value.scalar_type() == dtype_,
                     "KVStore::write: expected dtype ", c10::toString(dtype_), ", got ",
                     describe(key), " and ", describe(value));
    REVIVA_CHECK_ARG(key.device() == rt_->device() && value.device() == rt_->device(),
                     "KVStore::write: expected tensors on ", rt_->device().str(), ", got ",
                     describe(key), " and ", describe(value));
    const int64_t n = key.size(2);
    const auto capacity = static_cast<int64_t>(store_->capacity(layer));
    REVIVA_CHECK_ARG(first >= 0 && n <= capacity && first <= capacity - n,
                     "KVStore::write: ", first + n, " tokens exceed layer ", layer,
                     "'s capacity of ", capacity,
                     " tokens (prompt + max_new_tokens) planned for this generate call");
    if (store_->paged(layer)) {
      write_pages(layer, first, key, value);
      return;
    }
    {
      py::gil_scoped_release release;
      store_->reserve(layer, static_cast<std::size_t>(first + n));
    }
    torch::Tensor rows = this->rows(layer, first + n).narrow(0, first, n);
    rows.select(1, 0).copy_(key.permute({2, 0, 1, 3}));
    rows.select(1, 1).copy_(value.permute({2, 0, 1, 3}));
    store_->wrote(layer, static_cast<std::size_t>(first), static_cast<std::size_t>(n),
                  *rt_->compute_stream());
  }

  void write_pages(int layer, int64_t first, const torch::Tensor& key, const torch::Tensor& value) {
    const auto page = static_cast<int64_t>(store_->page_tokens());
    const int64_t n = key.size(2);
    const auto length = static_cast<int64_t>(store_->length(layer));
    REVIVA_CHECK_ARG(first == length, "KVStore::write: a paged layer is written at its end (",
                     length, " tokens), got tokens from ", first);
    auto compute = rt_->compute_stream();
    for (int64_t done = 0; done < n;) {
      const int64_t at = (first + done) % page;
      const auto j = static_cast<std::size_t>((first + done) / page);
      const int64_t count = std::min(n - done, page - at);
      acquire_page(layer, j);  // (on the host runtime: after its fill has landed)
      try {
        {
          py::gil_scoped_release release;
          store_->reserve_page(layer, j, static_cast<std::size_t>(at + count));
        }
        torch::Tensor rows = page_rows(layer, j, at + count).narrow(0, at, count);
        rows.select(1, 0).copy_(key.narrow(2, done, count).permute({2, 0, 1, 3}));
        rows.select(1, 1).copy_(value.narrow(2, done, count).permute({2, 0, 1, 3}));
        store_->wrote_page(layer, j, static_cast<std::size_t>(at), static_cast<std::size_t>(count),
                           *compute);
      } catch (...) {
        store_->release_page(layer, j, *compute);
        throw;
      }
      store_->release_page(layer, j, *compute);
      done += count;
    }
  }

  // The acquired layer's first `tokens` tokens as K and V, [batch, kv_heads, tokens, head_dim]
  // views of its token-major buffer.
  std::pair<torch::Tensor, torch::Tensor> kv(int layer, int64_t tokens) {
    torch::Tensor rows = view(layer, tokens);
    return {rows.select(1, 0).permute({1, 2, 0, 3}), rows.select(1, 1).permute({1, 2, 0, 3})};
  }

  // Note [Host-side appends] (append_blocks.cpp), Note [Attention on the host]: decode
  // attention of a host-attended layer on the host's cores. `key`, `value`: the n new tokens'
  // [batch, kv_heads, n, row] on the CPU in the store's dtype, written at the layer's end into
  // its host copy (row: head_dim elements, or for fp8 rows (uint8) head_dim + 4 bytes as
  // kv_fp8.quantize makes them); `q`: their queries, [batch, heads, n, head_dim] on the CPU (any
  // float dtype). Query j attends keys [0, length + j + 1) (causal within the new tokens; within
  // the last `window` of them for a sliding layer, 0: no window). Returns
  // [batch, heads, n, head_dim] fp32. Without the GIL; bf16, fp32 or fp8 K/V.
  torch::Tensor host_attend(int layer, const torch::Tensor& q, const torch::Tensor& key,
                            const torch::Tensor& value, double scale, int threads, int64_t window) {
    const bool bf16 = dtype_ == torch::kBFloat16, fp8 = dtype_ == torch::kUInt8;
    REVIVA_CHECK_ARG(bf16 || fp8 || dtype_ == torch::kFloat32,
                     "KVStore::host_attend: K/V of dtype ", c10::toString(dtype_),
                     " (attention on the host reads bf16, fp32 or fp8 rows)");
    const int64_t head_dim = fp8 ? row_[3] - 4 : row_[3];
    REVIVA_CHECK_ARG(key.dim() == 4 && key.sizes() == value.sizes() && key.size(0) == row_[1] &&
                         key.size(1) == row_[2] && key.size(3) == row_[3],
                     "KVStore::host_attend: key and value must be [", row_[1], ", ", row_[2],
                     ", tokens, ", row_[3], "], got ", describe(key), " and ", describe(value));
    REVIVA_CHECK_ARG(key.scalar_type() == dtype_ && value.scalar_type() == dtype_ &&
                         key.device().is_cpu() && value.device().is_cpu(),
                     "KVStore::host_attend: key and value must be ", c10::toString(dtype_),
                     " on the CPU, got ", describe(key), " and ", describe(value));
    const int64_t n = key.size(2);
    REVIVA_CHECK_ARG(q.dim() == 4 && q.size(0) == row_[1] && q.size(2) == n &&
                         q.size(3) == head_dim && q.size(1) % row_[2] == 0 && q.device().is_cpu(),
                     "KVStore::host_attend: q must be [", row_[1], ", heads (a multiple of ",
                     row_[2], "), ", n, ", ", head_dim, "] on the CPU, got ", describe(q));
    REVIVA_CHECK_ARG(threads >= 1, "KVStore::host_attend: threads must be >= 1, got ", threads);
    REVIVA_CHECK_ARG(window >= 0, "KVStore::host_attend: window must be >= 0 (0: none), got ",
                     window);
    const int64_t heads = q.size(1);
    // token-major rows of the new tokens: [n, 2, batch, kv_heads, head_dim]
    torch::Tensor rows =
        torch::stack({key.permute({2, 0, 1, 3}), value.permute({2, 0, 1, 3})}, 1).contiguous();
    // [n, batch, heads, head_dim] fp32: one query per sequence and head at a time
    torch::Tensor queries = q.permute({2, 0, 1, 3}).to(torch::kFloat32).contiguous();
    torch::Tensor out = torch::empty({n, row_[1], heads, head_dim}, queries.options());
    HostAttentionShape shape;
    shape.batch = static_cast<std::size_t>(row_[1]);
    shape.kv_heads = static_cast<std::size_t>(row_[2]);
    shape.heads = static_cast<std::size_t>(heads);
    shape.head_dim = static_cast<std::size_t>(head_dim);
    const RowType type = fp8 ? RowType::Fp8E4M3 : bf16 ? RowType::BFloat16 : RowType::Float32;
    {
      py::gil_scoped_release release;
      // (calls from several threads on one store take turns: each appends at the layer's end,
      // which another's append would move under it)
      std::lock_guard<std::mutex> turn(host_attend_mutex_);
      const std::size_t first = store_->length(layer);
      const auto* new_rows = static_cast<const char*>(rows.data_ptr());
      const std::size_t row_bytes = store_->options().token_bytes;
      for (int64_t j = 0; j < n; ++j) {
        const std::size_t at = first + static_cast<std::size_t>(j);
        store_->host_wrote(layer, at, 1, new_rows + static_cast<std::size_t>(j) * row_bytes);
        // (a sliding layer's query at `at` reads keys (at - window, at]: Note [Sliding windows])
        const auto w = static_cast<std::size_t>(window);
        const std::size_t from = w > 0 && at + 1 > w ? at + 1 - w : 0;
        host_decode_attention(store_->host_rows(layer), type, shape, from, at + 1,
                              queries[j].data_ptr<float>(), static_cast<float>(scale),
                              out[j].data_ptr<float>(), threads);
      }
    }
    return out.permute({1, 2, 0, 3});
  }

  // A host-attended layer's first `tokens` tokens as K and V, [batch, kv_heads, tokens,
  // head_dim] CPU views of its host copy: valid until the store is cleared or closed (read them
  // at once: a returned cache's parking copies them).
  std::pair<torch::Tensor, torch::Tensor> host_kv(int layer, int64_t tokens) {
    REVIVA_CHECK_ARG(tokens >= 0 && static_cast<std::size_t>(tokens) <= store_->length(layer),
                     "KVStore::host_kv: ", tokens, " tokens of layer ", layer, " asked, ",
                     store_->length(layer), " held");
    const void* data;
    {
      py::gil_scoped_release release;
      data = store_->host_rows(layer);
    }
    std::vector<int64_t> shape{tokens};
    shape.insert(shape.end(), row_.begin(), row_.end());
    // (the views own a reference to the store and count themselves: clear() and close() refuse
    // while they live, and the store's memory outlives the Python object if they do)
    host_views_->fetch_add(1);
    torch::Tensor rows = torch::from_blob(
        const_cast<void*>(data), shape,
        [views = host_views_, keep = store_](void*) mutable {
          views->fetch_sub(1);
          keep.reset();
        },
        torch::TensorOptions().dtype(dtype_));
    return {rows.select(1, 0).permute({1, 2, 0, 3}), rows.select(1, 1).permute({1, 2, 0, 3})};
  }

  // Note [fp8 decode attention] (src/fp8_attention.cpp): a decode step of an fp8 layer in one
  // call. `key`, `value`: the new token's [batch, kv_heads, 1, head_dim] (16-bit), quantized into
  // row `first` of the acquired layer (its rows then hold first + 1 tokens, sent on to its host
  // copy as write() does); `q`: its queries, [batch, heads, 1, head_dim] of the same dtype,
  // attending keys [first_key, first + 1). Writes `out` ([batch, heads, 1, head_dim], any
  // strides with a dense last dimension: the decode graphs' static buffer) and returns it. The
  // rows are read in place; nothing of the layer's size is allocated.
  torch::Tensor attend_fp8_decode(int layer, int64_t first, const torch::Tensor& q,
                                  const torch::Tensor& key, const torch::Tensor& value,
                                  double scale, int64_t first_key, torch::Tensor out) {
    Fp8DecodeAttention a = fp8_decode_args(layer, q, key, value, scale, out);
    const auto capacity = static_cast<int64_t>(store_->capacity(layer));
    REVIVA_CHECK_ARG(first >= 0 && first < capacity, "KVStore::attend_fp8_decode: ", first + 1,
                     " tokens exceed layer ", layer, "'s capacity of ", capacity,
                     " tokens (prompt + max_new_tokens) planned for this generate call");
    REVIVA_CHECK_ARG(first_key >= 0 && first_key <= first, "KVStore::attend_fp8_decode: first_key ",
                     first_key, " outside [0, ", first, "]");
    {
      py::gil_scoped_release release;
      store_->reserve(layer, static_cast<std::size_t>(first + 1));
    }
    torch::Tensor rows = this->rows(layer, first + 1);  // [tokens, 2, batch, kv_heads, dim + 4]
    a.k_rows = rows.select(1, 0).data_ptr();
    a.v_rows = rows.select(1, 1).data_ptr();
    a.first_key = static_cast<std::size_t>(first_key);
    a.length = static_cast<std::size_t>(first + 1);
    launch_fp8_decode(a);
    store_->wrote(layer, static_cast<std::size_t>(first), 1, *rt_->compute_stream());
    return out;
  }

  // Note [fp8 attention in the decode graphs] (python/reviva/generate/decode_graphs.py): the same
  // step as attend_fp8_decode, to be captured in a CUDA graph and replayed at every step: the
  // step's length (tokens after it) is read from `length` (int64 [1] on the device) and the rows'
  // addresses from `rows` (int64 [2] on the device: rows_address()) when the kernels run.
  // Launches the kernels alone: the caller reserves the row (reserve) before each replay and
  // reports it written (wrote) after. Keys from length - window on (0: every key).
  torch::Tensor attend_fp8_decode_graphed(int layer, const torch::Tensor& q,
                                          const torch::Tensor& key, const torch::Tensor& value,
                                          double scale, int64_t window, const torch::Tensor& length,
                                          const torch::Tensor& rows, torch::Tensor out) {
    Fp8DecodeAttention a = fp8_decode_args(layer, q, key, value, scale, out);
    REVIVA_CHECK_ARG(window >= 0,
                     "KVStore::attend_fp8_decode_graphed: window must be >= 0 (0: "
                     "none), got ",
                     window);
    REVIVA_CHECK_ARG(length.defined() && length.device() == rt_->device() &&
                         length.scalar_type() == torch::kInt64 && length.numel() == 1,
                     "KVStore::attend_fp8_decode_graphed: length must be one int64 on ",
                     rt_->device().str(), ", got a ", describe(length));
    REVIVA_CHECK_ARG(rows.defined() && rows.device() == rt_->device() &&
                         rows.scalar_type() == torch::kInt64 && rows.numel() == 2 &&
                         rows.is_contiguous(),
                     "KVStore::attend_fp8_decode_graphed: rows must be two contiguous int64 on ",
                     rt_->device().str(), ", got a ", describe(rows));
    a.device_length = length.data_ptr<int64_t>();
    a.device_rows = reinterpret_cast<const std::uint64_t*>(rows.data_ptr<int64_t>());
    a.window = static_cast<std::size_t>(window);
    a.length = store_->capacity(layer);  // (the most a step's length can be: sets the splits)
    launch_fp8_decode(a);
    return out;
  }

  // The acquired layer's K and V rows' addresses (for attend_fp8_decode_graphed's `rows`).
  std::pair<std::uint64_t, std::uint64_t> rows_address(int layer) {
    REVIVA_CHECK_ARG(dtype_ == torch::kUInt8, "KVStore::rows_address: the store holds ",
                     c10::toString(dtype_), " rows, not fp8 rows");
    REVIVA_CHECK_ARG(!store_->paged(layer), "KVStore::rows_address: layer ", layer,
                     " is paged (read page by page)");
    std::shared_ptr<ArenaBuffer> buffer = store_->buffer(layer);
    const auto k = reinterpret_cast<std::uint64_t>(buffer->data());
    const auto v_offset = static_cast<std::uint64_t>(row_[1] * row_[2] * row_[3]);
    return {k, k + v_offset};
  }

  void wrote(int layer, std::size_t first, std::size_t count) {
    store_->wrote(layer, first, count, *rt_->compute_stream());
  }

  void release(int layer) {
    store_->release(layer, *rt_->compute_stream());
    const std::string l = std::to_string(layer);
    leases_.revoke(layer,
                   revoked("view(" + l + ", ...) or kv(" + l + ", ...)", "release(" + l + ")"));
  }

  // clear() and close(): every view and page view still alive is revoked.
  void revoke_all(const char* what) {
    leases_.revoke_all(revoked("view() or kv()", what));
    page_leases_.revoke_all(revoked("page_view() or page_kv()", what));
  }

  py::dict stats() {
    const KVStoreStats st = store_->stats();
    py::dict r;
    r["resident_layers"] = st.resident_layers;
    r["streamed_layers"] = st.streamed_layers;
    r["slots"] = st.slots;
    r["paged_layers"] = st.paged_layers;
    r["page_slots"] = st.page_slots;
    r["fills"] = st.fills;
    r["prefetched_fills"] = st.prefetched_fills;
    r["slot_hits"] = st.slot_hits;
    r["promotions"] = st.promotions;
    r["promotion_failures"] = st.promotion_failures;
    r["prefetches_without_memory"] = st.prefetches_without_memory;
    r["prefetches_deferred"] = st.prefetches_deferred;
    r["bytes_to_device"] = st.bytes_to_device;
    r["bytes_to_host"] = st.bytes_to_host;
    r["compute_stall_s"] = st.compute_stall_ms / 1e3;
    r["copy_to_device_s"] = st.copy_to_device_ms / 1e3;
    r["overlap_ratio"] = st.overlap_ratio;
    r["host_bytes"] = st.host_bytes;
    r["host_copy_wait_s"] = st.host_copy_wait_ms / 1e3;
    r["device_bytes"] = st.device_bytes;
    r["peak_device_bytes"] = st.peak_device_bytes;
    r["host_attended_layers"] = st.host_attended_layers;
    r["bytes_written_on_host"] = st.bytes_written_on_host;
    r["spilled_layers"] = st.spilled_layers;
    r["staged_layers"] = st.staged_layers;
    r["peak_staged_layers"] = st.peak_staged_layers;
    r["disk_reads"] = st.disk_reads;
    r["staging_hits"] = st.staging_hits;
    r["bytes_from_disk"] = st.bytes_from_disk;
    r["bytes_to_disk"] = st.bytes_to_disk;
    r["disk_wait_s"] = st.disk_wait_ms / 1e3;
    r["disk_bytes"] = st.disk_bytes;
    const auto& disk = store_->options().disk;
    if (disk) {
      const DiskStoreStats ds = disk->stats();
      r["disk_file"] = ds.file;
      r["disk_io_uring"] = ds.io_uring;
      r["disk_direct_io"] = ds.direct_io;
      r["disk_staged_blocks"] = ds.io.staged_blocks;
      r["disk_peak_bytes"] = ds.peak_bytes_in_use;
    }
    return r;
  }

  KVStore& store() { return *store_; }
  std::shared_ptr<const Stream> compute() { return rt_->compute_stream(); }

  // The checks and fields attend_fp8_decode and attend_fp8_decode_graphed share: the store's
  // fp8 rows, q [batch, heads, 1, D], key and value [batch, kv_heads, 1, D] of q's 16-bit dtype,
  // out like q; every tensor on the runtime's device with a dense last dimension.
  Fp8DecodeAttention fp8_decode_args(int layer, const torch::Tensor& q, const torch::Tensor& key,
                                     const torch::Tensor& value, double scale,
                                     const torch::Tensor& out) {
    REVIVA_CHECK_ARG(dtype_ == torch::kUInt8 && row_[3] > 4,
                     "KVStore::attend_fp8_decode: the store holds ", c10::toString(dtype_),
                     " rows of ", row_[3], ", not fp8 rows (uint8, head_dim + 4 bytes)");
    REVIVA_CHECK_ARG(!store_->paged(layer), "KVStore::attend_fp8_decode: layer ", layer,
                     " is paged (read page by page)");
    const int64_t batch = row_[1], kv_heads = row_[2], dim = row_[3] - 4;
    for (const torch::Tensor* t :
         std::initializer_list<const torch::Tensor*>{&q, &key, &value, &out}) {
      REVIVA_CHECK_ARG(t->defined() && t->device() == rt_->device(),
                       "KVStore::attend_fp8_decode: expected tensors on ", rt_->device().str());
    }
    const auto type = q.scalar_type();
    REVIVA_CHECK_ARG(type == torch::kBFloat16 || type == torch::kHalf,
                     "KVStore::attend_fp8_decode: q must be bfloat16 or float16, got a ",
                     describe(q));
    REVIVA_CHECK_ARG(q.dim() == 4 && q.size(0) == batch && q.size(2) == 1 && q.size(3) == dim &&
                         q.size(1) % kv_heads == 0 && q.stride(3) == 1,
                     "KVStore::attend_fp8_decode: q must be [", batch, ", heads (a multiple of ",
                     kv_heads, "), 1, ", dim, "] with a dense last dimension, got a ", describe(q));
    const int64_t heads = q.size(1);
    for (const torch::Tensor* t : {&key, &value}) {
      REVIVA_CHECK_ARG(
          t->dim() == 4 && t->size(0) == batch && t->size(1) == kv_heads && t->size(2) == 1 &&
              t->size(3) == dim && t->stride(3) == 1 && t->scalar_type() == type,
          "KVStore::attend_fp8_decode: key and value must be [", batch, ", ", kv_heads, ", 1, ",
          dim, "] of q's dtype with a dense last dimension, got a ", describe(*t));
    }
    REVIVA_CHECK_ARG(out.dim() == 4 && out.size(0) == batch && out.size(1) == heads &&
                         out.size(2) == 1 && out.size(3) == dim && out.stride(3) == 1 &&
                         out.scalar_type() == type,
                     "KVStore::attend_fp8_decode: out must be [", batch, ", ", heads, ", 1, ", dim,
                     "] of q's dtype with a dense last dimension, got a ", describe(out));
    Fp8DecodeAttention a;
    a.type = type == torch::kBFloat16 ? HalfType::BFloat16 : HalfType::Float16;
    a.batch = static_cast<std::size_t>(batch);
    a.heads = static_cast<std::size_t>(heads);
    a.kv_heads = static_cast<std::size_t>(kv_heads);
    a.head_dim = static_cast<std::size_t>(dim);
    a.q = q.data_ptr();
    a.q_stride[0] = q.stride(0);
    a.q_stride[1] = q.stride(1);
    a.k_new = key.data_ptr();
    a.v_new = value.data_ptr();
    a.k_new_stride[0] = key.stride(0);
    a.k_new_stride[1] = key.stride(1);
    a.v_new_stride[0] = value.stride(0);
    a.v_new_stride[1] = value.stride(1);
    // token-major rows [tokens][2][batch][kv_heads][dim + 4]
    const int64_t row_bytes = row_[3];
    a.row_stride[0] = kv_heads * row_bytes;
    a.row_stride[1] = row_bytes;
    a.row_stride[2] = 2 * batch * kv_heads * row_bytes;
    a.scale = static_cast<float>(scale);
    a.out = out.data_ptr();
    a.out_stride[0] = out.stride(0);
    a.out_stride[1] = out.stride(1);
    return a;
  }

  // Runs `a` on compute's stream (torch's current one on CUDA, with a workspace from torch's
  // allocator: a graph's own pool while capturing); on the host runtime, waited for.
  void launch_fp8_decode(Fp8DecodeAttention& a) {
    const auto& backend = rt_->backend();
    torch::Tensor workspace;
    if (const std::size_t bytes = backend->fp8_decode_workspace_bytes(a); bytes > 0) {
      workspace = torch::empty({static_cast<int64_t>(bytes)},
                               torch::TensorOptions().dtype(torch::kUInt8).device(rt_->device()));
      a.workspace = workspace.data_ptr();
      a.workspace_bytes = bytes;
    }
    auto compute = rt_->compute_stream();
    if (rt_->is_cuda()) {
      backend->attend_fp8_decode_async(a, compute->handle());
      return;
    }
    py::gil_scoped_release release;
    backend->attend_fp8_decode_async(a, compute->handle());
    compute->synchronize();  // (torch on the CPU reads out at once)
  }

 private:
  static long page_key(int layer, std::size_t page) {
    return (static_cast<long>(layer) << 32) | static_cast<long>(page);
  }

  // What a revoked tensor raises (Note [Revoked views] in leases.h).
  static std::string revoked(const std::string& from, const std::string& call) {
    return "a tensor from KVStore." + from + " used after KVStore." + call +
           ": that memory may hold other K/V now (clone() what is to be kept before)";
  }

  std::shared_ptr<Runtime> rt_;
  torch::ScalarType dtype_;
  std::vector<int64_t> row_;  // [2, batch, kv_heads, head_dim]
  std::shared_ptr<KVStore> store_;
  std::mutex host_attend_mutex_;  // host_attend's turns (its appends)
  std::shared_ptr<std::atomic<int>> host_views_ = std::make_shared<std::atomic<int>>(0);
  Leases leases_;       // view() and kv() by layer
  Leases page_leases_;  // page_view() and page_kv() by page_key
};

}  // namespace

void bind_kv_store(py::module_& m) {
  py::class_<DeviceArena, std::shared_ptr<DeviceArena>>(
      m, "DeviceArena",
      "Reviva's own device memory: buffers backed by memory mapped in granules as they grow, "
      "given back to the device after their last use (see include/reviva/device_arena.h)")
      .def(py::init(&make_arena), py::arg("runtime"), py::arg("limit_bytes") = 0)
      .def("stats", &arena_stats)
      .def("reclaim", &DeviceArena::reclaim, py::arg("wait") = true,
           py::call_guard<py::gil_scoped_release>())
      .def("reset_peak", &DeviceArena::reset_peak)
      .def_property("limit_bytes", &DeviceArena::limit_bytes, &DeviceArena::set_limit_bytes)
      .def_property_readonly("granularity", &DeviceArena::granularity);

  py::class_<PyKVStore>(m, "KVStore",
                        "A decoder's K/V cache: resident layers and layers streamed from pinned "
                        "host memory, append blocks of an OffloadManager driven by a "
                        "PrefetchScheduler (see include/reviva/kv_store.h)")
      .def(py::init<py::object, std::shared_ptr<DeviceArena>, int, int64_t, int64_t, int64_t,
                    py::object, int64_t, int, std::size_t, int64_t, const std::vector<int64_t>&,
                    const std::optional<std::string>&, int>(),
           py::arg("engine"), py::arg("arena"), py::arg("num_layers"), py::arg("batch"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("dtype"), py::arg("capacity_tokens"),
           py::arg("prefetch_layers") = 2, py::arg("timeline_capacity") = 0,
           py::arg("page_tokens") = 0, py::arg("layer_capacity_tokens") = std::vector<int64_t>{},
           py::arg("disk_path") = std::nullopt, py::arg("disk_staged_layers") = 0)
      .def("make_resident", [](PyKVStore& s, int layer) { s.store().make_resident(layer); })
      .def(
          "spill_to_disk", [](PyKVStore& s, int layer) { s.store().spill_to_disk(layer); },
          py::arg("layer"))
      .def(
          "spilled", [](PyKVStore& s, int layer) { return s.store().spilled(layer); },
          py::arg("layer"))
      .def(
          "promote",
          [](PyKVStore& s, int layer) {
            py::gil_scoped_release release;
            return s.store().promote(layer);
          },
          py::arg("layer"))
      .def("add_slot", [](PyKVStore& s) { s.store().add_slot(); })
      .def("drop_slot", [](PyKVStore& s) { return s.store().drop_slot(); })
      .def("acquire", &PyKVStore::acquire, py::arg("layer"))
      .def(
          "set_page_slots", [](PyKVStore& s, int pages) { return s.store().set_page_slots(pages); },
          py::arg("pages"))
      .def(
          "paged", [](PyKVStore& s, int layer) { return s.store().paged(layer); }, py::arg("layer"))
      .def(
          "pages", [](PyKVStore& s, int layer) { return s.store().pages(layer); }, py::arg("layer"))
      .def_property_readonly("page_tokens", [](PyKVStore& s) { return s.store().page_tokens(); })
      .def("acquire_page", &PyKVStore::acquire_page, py::arg("layer"), py::arg("page"))
      .def(
          "declare_prefill_order",
          [](PyKVStore& s, int layer, std::size_t first, std::size_t end, std::size_t chunk) {
            s.store().declare_prefill_order(layer, first, end, chunk);
          },
          py::arg("layer"), py::arg("first"), py::arg("end"), py::arg("chunk"))
      .def("end_prefill_order", [](PyKVStore& s) { s.store().end_prefill_order(); })
      .def("page_kv", &PyKVStore::page_kv, py::arg("layer"), py::arg("page"), py::arg("tokens"),
           "K and V of an acquired page, until release_page(layer, page): used after it, they "
           "raise; a numpy array or DLPack capsule taken from them before keeps the bytes it "
           "was lent (their memory kept from reuse, counted in the arena) until it is dropped")
      .def(
          "release_page",
          [](PyKVStore& s, int layer, std::size_t page) { s.release_page(layer, page); },
          py::arg("layer"), py::arg("page"))
      .def(
          "reserve",
          [](PyKVStore& s, int layer, std::size_t tokens) {
            py::gil_scoped_release release;
            s.store().reserve(layer, tokens);
          },
          py::arg("layer"), py::arg("tokens"))
      .def(
          "attend_on_host",
          [](PyKVStore& s, int layer) {
            py::gil_scoped_release release;
            s.store().attend_on_host(layer);
          },
          py::arg("layer"))
      .def(
          "host_attended", [](PyKVStore& s, int layer) { return s.store().host_attended(layer); },
          py::arg("layer"))
      .def("host_attend", &PyKVStore::host_attend, py::arg("layer"), py::arg("q"), py::arg("key"),
           py::arg("value"), py::arg("scale"), py::arg("threads"), py::arg("window") = 0)
      .def("host_kv", &PyKVStore::host_kv, py::arg("layer"), py::arg("tokens"))
      .def("view", &PyKVStore::view, py::arg("layer"), py::arg("tokens"),
           "[tokens, 2, batch, kv_heads, head_dim] over the acquired layer's rows, until "
           "release(layer): used after it, the tensor and its views raise (clone() to keep them); "
           "a numpy array or DLPack capsule taken from it before keeps the bytes it was lent "
           "(their memory kept from reuse, counted in the arena) until it is dropped")
      .def("write", &PyKVStore::write, py::arg("layer"), py::arg("first"), py::arg("key"),
           py::arg("value"))
      .def("kv", &PyKVStore::kv, py::arg("layer"), py::arg("tokens"),
           "K and V, [batch, kv_heads, tokens, head_dim] views of the acquired layer's rows, until "
           "release(layer): used after it, they raise (clone() to keep them); a numpy array or "
           "DLPack capsule taken from them before keeps the bytes it was lent (their memory kept "
           "from reuse, counted in the arena) until it is dropped")
      .def("wrote", &PyKVStore::wrote, py::arg("layer"), py::arg("first"), py::arg("count"))
      .def("attend_fp8_decode", &PyKVStore::attend_fp8_decode, py::arg("layer"), py::arg("first"),
           py::arg("q"), py::arg("key"), py::arg("value"), py::arg("scale"), py::arg("first_key"),
           py::arg("out"))
      .def("attend_fp8_decode_graphed", &PyKVStore::attend_fp8_decode_graphed, py::arg("layer"),
           py::arg("q"), py::arg("key"), py::arg("value"), py::arg("scale"), py::arg("window"),
           py::arg("length"), py::arg("rows"), py::arg("out"))
      .def("rows_address", &PyKVStore::rows_address, py::arg("layer"))
      .def("release", &PyKVStore::release, py::arg("layer"))
      .def(
          "truncate",
          [](PyKVStore& s, int layer, std::size_t tokens) { s.store().truncate(layer, tokens); },
          py::arg("layer"), py::arg("tokens"))
      .def(
          "set_fetch_window",
          [](PyKVStore& s, int layer, std::size_t tokens) {
            py::gil_scoped_release release;
            s.store().set_fetch_window(layer, tokens);
          },
          py::arg("layer"), py::arg("tokens"))
      .def("length", [](PyKVStore& s, int layer) { return s.store().length(layer); })
      .def("resident", [](PyKVStore& s, int layer) { return s.store().resident(layer); })
      .def("stats", &PyKVStore::stats)
      .def(
          "timeline",
          [](PyKVStore& s) {
            std::vector<TimelineEvent> events;
            {
              py::gil_scoped_release release;
              events = s.store().timeline();
            }
            return timeline_list(events);
          },
          "Copies and compute's waits for them (ms since the store was built), when built with "
          "timeline_capacity > 0")
      .def("synchronize",
           [](PyKVStore& s) {
             py::gil_scoped_release release;
             s.store().synchronize();
           })
      .def("clear",
           [](PyKVStore& s) {
             s.check_no_host_views("clear");
             s.revoke_all("clear()");
             py::gil_scoped_release release;
             s.store().clear();
           })
      .def("close",
           [](PyKVStore& s) {
             s.check_no_host_views("close");
             s.revoke_all("close()");
             py::gil_scoped_release release;
             s.store().close();
           })
      .def_property_readonly("closed", [](PyKVStore& s) { return s.store().closed(); })
      .def_property_readonly("layer_bytes", [](PyKVStore& s) { return s.store().layer_bytes(); })
      .def(
          "capacity", [](PyKVStore& s, int layer) { return s.store().capacity(layer); },
          py::arg("layer"))
      .def(
          "layer_bytes_of", [](PyKVStore& s, int layer) { return s.store().layer_bytes(layer); },
          py::arg("layer"));
}

}  // namespace reviva::python
