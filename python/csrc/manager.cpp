// reviva._C: the OffloadManager and PrefetchScheduler on torch tensors.
//
// A managed block is a tensor's bytes plus its shape and dtype; acquire() returns a tensor viewing
// the block's device memory, which stays there while the tensor lives (Note [Leases]). Compute is
// torch's current stream on CUDA; on the host runtime acquire() waits for the data before
// returning, since torch computes on the CPU synchronously. On CUDA the blocks' device memory
// comes from PyTorch's caching allocator (TorchDeviceAllocator), so Reviva and PyTorch share one
// pool.
#include "runtime.h"

#include <cstdint>
#include <cstdio>
#include <exception>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace py = pybind11;

namespace reviva::python {
namespace {

#if defined(REVIVA_TORCH_CUDA)
// `bytes` from PyTorch's caching allocator, for torch's current stream; its out-of-memory error
// becomes Reviva's (the manager degrades on OutOfMemory).
c10::DataPtr torch_allocate(std::size_t bytes) {
  try {
    return c10::cuda::CUDACachingAllocator::get()->allocate(bytes);
  } catch (const c10::OutOfMemoryError& e) {
    throw OutOfMemory(std::string("torch's CUDA allocator: ") + e.what_without_backtrace());
  }
}

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
      data = torch_allocate(bytes);
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

// Note [Compute-ordered torch memory]
// TorchDeviceAllocator hands each block memory of the pool of the stream it names (the H2D
// stream for a fetch) and frees it with record_stream: torch reuses such memory only once the
// host sees the event, and a pool per copy stream keeps memory that compute's allocations cannot
// use (a training backward on the H200 reserved 9.0 GB where save_on_cpu reserved 6.9). This one
// allocates on torch's current (compute) stream, as torch's own ops do, so that Reviva's blocks
// and torch's tensors share one pool in one order:
//   - the stream that writes the memory first (the H2D copy) waits, on the device, for compute's
//     work queued at allocation: the memory's earlier users are done before it is overwritten;
//   - at the free, compute waits, on the device, for the work queued on the freeing stream (which
//     the manager ordered after every use of the block), and the memory goes back to torch with
//     no event: the next compute-stream allocation reuses it in compute's order, and a copy into
//     it waits for compute again (the first rule).
// So freed memory is reused only in stream order (reuses_in_stream_order(): the manager counts
// it free at once, Note [Stream-ordered frees] in src/offload_manager_impl.h) and the host never
// waits to see a free.
class TorchComputeOrderedAllocator final : public DeviceAllocator {
 public:
  explicit TorchComputeOrderedAllocator(std::shared_ptr<Runtime> rt) : rt_(std::move(rt)) {}

  void* allocate(std::size_t bytes, StreamHandle stream) override {
    auto compute = rt_->current_stream();
    c10::DataPtr data = torch_allocate(bytes);
    if (stream != compute->handle()) {
      Event ready(rt_->backend());
      ready.record(*compute);
      rt_->backend()->stream_wait_event(stream, ready.handle());
    }
    void* ptr = data.get();
    std::lock_guard<std::mutex> lock(mutex_);
    live_.emplace(ptr, Live{std::move(data), compute->handle()});
    return ptr;
  }

  void deallocate(void* ptr, std::size_t, StreamHandle stream) noexcept override {
    Live block;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = live_.find(ptr);
      if (it == live_.end()) return;
      block = std::move(it->second);
      live_.erase(it);
    }
    if (stream != block.compute) {
      try {
        Event freed(rt_->backend());
        freed.record(stream);
        rt_->backend()->stream_wait_event(block.compute, freed.handle());
      } catch (const std::exception& e) {
        std::fprintf(stderr, "reviva: warning: ordering a free failed (%s); synchronizing\n",
                     e.what());
        cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
      }
    }
  }  // `block.data` goes back to torch here, reusable in the compute stream's order

  bool reuses_in_stream_order() const noexcept override { return true; }
  std::string name() const override {
    return "torch CUDA caching allocator, ordered on the compute stream";
  }

 private:
  struct Live {
    c10::DataPtr data;
    StreamHandle compute = nullptr;
  };
  std::shared_ptr<Runtime> rt_;
  std::mutex mutex_;
  std::unordered_map<void*, Live> live_;  // guarded by mutex_
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

// Note [Leases]
// acquire() and acquire_group() return tensors viewing a block's device memory. Python keeps
// tensors past release() (a loop variable, a view saved for later), and the manager moves or frees
// the memory of a released block; a tensor that outlived its block read garbage, and writing to
// one after unregister() corrupted the heap. So each acquire of a block opens a lease, which holds
// the core pin (the block stays resident at the same address) until both
//   - the caller has called release() for it, and
//   - the tensor it returned is gone: its storage's deleter ran (views share that storage).
// Whichever comes second releases the pin, on the compute stream captured at acquire time: the
// stream's work queued by then covers every use of the tensor on it. While a block has a lease,
// offload, discard and unregister refuse it, saying what holds it.
// A deleter runs on whatever thread drops the last reference, possibly without the GIL and after
// the Python manager is gone. So it needs neither: it holds the LeaseTable, which holds the core
// manager (and through it the engine and backend), and the lease holds its stream. It never
// throws; a failure to release is reported on stderr.
class LeaseTable : public std::enable_shared_from_this<LeaseTable> {
 public:
  explicit LeaseTable(std::shared_ptr<OffloadManager> manager) : manager_(std::move(manager)) {}
  LeaseTable(const LeaseTable&) = delete;
  LeaseTable& operator=(const LeaseTable&) = delete;

  OffloadManager& manager() const { return *manager_; }

  // Tensors viewing `ptrs[i]`, the address the caller's acquire of `blocks[i]` on `compute`
  // returned: each takes over that acquire's pin as a lease. On failure no lease and no pin is
  // left (pins not yet leased are released).
  std::vector<torch::Tensor> open(std::span<const BlockId> blocks, std::span<void* const> ptrs,
                                  std::span<const TensorMeta* const> metas,
                                  const torch::Device& device,
                                  const std::shared_ptr<const Stream>& compute) {
    std::vector<torch::Tensor> tensors;
    std::vector<LeaseId> ids;
    try {
      tensors.reserve(blocks.size());
      ids.reserve(blocks.size());
      for (std::size_t i = 0; i < blocks.size(); ++i) {
        const std::size_t bytes = manager_->bytes(blocks[i]);
        {
          std::lock_guard<std::mutex> lock(mutex_);
          const LeaseId id = next_id_++;
          leases_.emplace(
              id, Lease{blocks[i], compute, reinterpret_cast<std::uintptr_t>(ptrs[i]), bytes});
          ids.push_back(id);
        }
        tensors.push_back(tensor_of(ids.back(), ptrs[i], *metas[i], device));
      }
    } catch (...) {
      // The caller gets no tensor: its part of each lease ends now, the tensors' part as
      // `tensors` unwinds.
      for (LeaseId id : ids) release_quietly(id);
      for (std::size_t i = ids.size(); i < blocks.size(); ++i) {
        try {
          manager_->release(blocks[i], *compute);
        } catch (const std::exception& e) {
          warn("releasing block", blocks[i], e);
        }
      }
      throw;
    }
    return tensors;
  }

  // The caller's release() of `block`: ends its part of one lease, preferably one whose tensor is
  // gone already (that pin ends now, not later).
  void release(BlockId block) {
    release_group(std::span<const BlockId>(&block, 1), false, "release");
  }

  // The caller's part of one lease per entry of `group`. Checks everything first, so that a
  // refused call changes nothing; with `discard`, refuses unless every block is then free.
  void release_group(std::span<const BlockId> group, bool discard, const char* what) {
    std::vector<Lease> ended;
    std::vector<BlockId> drop;  // blocks to discard once their pins are given back
    {
      std::lock_guard<std::mutex> lock(mutex_);
      std::map<BlockId, std::size_t> count;
      for (BlockId id : group) ++count[id];
      for (const auto& [block, n] : count) {
        const Use use = use_of(block);
        REVIVA_CHECK_ARG(use.unreleased >= n, what, ": block ", block, " (", manager_->name(block),
                         ") is not acquired", n > 1 ? " that many times" : "",
                         use.tensors_alive > 0 ? " (every acquire of it was released already; its "
                                                 "tensors from acquire() keep it resident until "
                                                 "they are gone)"
                                               : "");
        // Free afterwards only if no other lease holds it and no tensor of these leases lives.
        const bool free_after = use.leases == n && use.tensors_alive == 0;
        REVIVA_CHECK_ARG(!discard || free_after, what, "(discard=True): block ", block, " (",
                         manager_->name(block), ") is still in use: ", describe(use, n),
                         "; del those tensors before discarding it");
      }
      for (BlockId id : group) {
        auto it = choose_unreleased(id);
        it->second.released = true;
        if (!it->second.tensor_alive) {
          ended.push_back(std::move(it->second));
          leases_.erase(it);
        }
      }
      for (const Lease& lease : ended)
        if (take_discard(lease.block)) drop.push_back(lease.block);
    }
    // Every ended lease gives back its pin, even if one release fails; the first error is raised.
    std::exception_ptr error;
    for (const Lease& lease : ended) {
      try {
        manager_->release(lease.block, *lease.compute);
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
    for (BlockId block : drop) discard_quietly(block);
    if (error) std::rethrow_exception(error);
  }

  // Refuses an operation that would move or drop `block`'s memory while a lease holds it.
  void check_unleased(BlockId block, const char* what) const {
    std::lock_guard<std::mutex> lock(mutex_);
    const Use use = use_of(block);
    REVIVA_CHECK_ARG(use.leases == 0, what, ": block ", block, " (", manager_->name(block),
                     ") is acquired: ", describe(use, 0), "; ",
                     use.unreleased > 0 ? "release() it" : "",
                     use.unreleased > 0 && use.tensors_alive > 0 ? " and " : "",
                     use.tensors_alive > 0 ? "del those tensors" : "", " first");
  }

  // Refuses memory of a lease: a block adopting it would hold it after its lease ended.
  void check_not_leased(const void* ptr, std::size_t bytes, const char* what) const {
    const auto begin = reinterpret_cast<std::uintptr_t>(ptr);
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [id, lease] : leases_) {
      REVIVA_CHECK_ARG(begin + bytes <= lease.begin || lease.begin + lease.bytes <= begin, what,
                       ": the tensor views block ", lease.block,
                       " of this manager (a tensor from acquire()); adopt a clone of it");
    }
  }

  // Drops `block`'s contents (OffloadManager::discard) when its last lease ends, in whichever
  // thread ends it: memory a dead block's views still hold goes back as soon as the last view
  // goes, not at the caller's next chance. False, arranging nothing, when no lease holds it now.
  bool discard_when_free(BlockId block) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (use_of(block).leases == 0) return false;
    discard_when_free_.insert(block);
    return true;
  }

  // The Python manager is gone, so no release() can come any more: the caller's part of every
  // lease ends, with a warning as the core manager gives for a block still acquired.
  void abandon() noexcept {
    std::vector<Lease> ended;
    std::map<BlockId, int> unreleased;  // acquires per block
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto it = leases_.begin(); it != leases_.end();) {
        if (!it->second.released) ++unreleased[it->second.block];
        it->second.released = true;
        if (it->second.tensor_alive) {
          ++it;
        } else {
          ended.push_back(std::move(it->second));
          it = leases_.erase(it);
        }
      }
    }
    for (const auto& [block, n] : unreleased)
      std::fprintf(stderr,
                   "reviva: warning: OffloadManager deleted while block %llu is still acquired "
                   "(%d time(s)); releasing it\n",
                   static_cast<unsigned long long>(block), n);
    for (const Lease& lease : ended) end_quietly(lease);
    std::vector<BlockId> drop;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const Lease& lease : ended)
        if (take_discard(lease.block)) drop.push_back(lease.block);
    }
    for (BlockId block : drop) discard_quietly(block);
  }

 private:
  using LeaseId = std::uint64_t;
  struct Lease {
    BlockId block = kInvalidBlock;
    std::shared_ptr<const Stream> compute;  // captured at acquire: the pin is released on it
    std::uintptr_t begin = 0;               // the block's device memory, for adopt's check
    std::size_t bytes = 0;
    bool released = false;     // the caller called release() for it
    bool tensor_alive = true;  // its tensor's storage exists
  };
  struct Use {  // the leases of one block
    std::size_t leases = 0, unreleased = 0, tensors_alive = 0;
  };
  // Owned (through the deleter) by a tensor's storage: its destruction is the tensor's end.
  struct TensorRef {
    std::shared_ptr<LeaseTable> table;
    LeaseId id;
    TensorRef(std::shared_ptr<LeaseTable> t, LeaseId i) noexcept : table(std::move(t)), id(i) {}
    ~TensorRef() { table->tensor_gone(id); }
    TensorRef(const TensorRef&) = delete;
    TensorRef& operator=(const TensorRef&) = delete;
  };

  // The tensor part of lease `id` ends when the last copy of the deleter (holding `ref`) goes:
  // with the tensor's storage, or at once if the tensor cannot be made.
  torch::Tensor tensor_of(LeaseId id, void* ptr, const TensorMeta& meta,
                          const torch::Device& device) {
    std::shared_ptr<TensorRef> ref;
    try {
      ref = std::make_shared<TensorRef>(shared_from_this(), id);
    } catch (...) {
      tensor_gone(id);
      throw;
    }
    return torch::from_blob(
        ptr, meta.shape, [ref](void*) {}, torch::TensorOptions().dtype(meta.dtype).device(device));
  }

  // The deleter's half (any thread, no GIL).
  void tensor_gone(LeaseId id) noexcept {
    Lease ended;
    bool drop;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = leases_.find(id);
      REVIVA_ASSERT(it != leases_.end(), "lease ", id, " ended twice");
      it->second.tensor_alive = false;
      if (!it->second.released) return;
      ended = std::move(it->second);
      leases_.erase(it);
      drop = take_discard(ended.block);
    }
    end_quietly(ended);
    if (drop) discard_quietly(ended.block);
  }

  // Ends the caller's part of lease `id` on a failure path.
  void release_quietly(LeaseId id) noexcept {
    Lease ended;
    bool drop;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = leases_.find(id);
      REVIVA_ASSERT(it != leases_.end() && !it->second.released, "lease ", id, " released twice");
      it->second.released = true;
      if (it->second.tensor_alive) return;
      ended = std::move(it->second);
      leases_.erase(it);
      drop = take_discard(ended.block);
    }
    end_quietly(ended);
    if (drop) discard_quietly(ended.block);
  }

  // Whether `block` waits to be discarded and no lease holds it any more (then it leaves the
  // set). Requires mutex_.
  bool take_discard(BlockId block) {
    auto it = discard_when_free_.find(block);
    if (it == discard_when_free_.end() || use_of(block).leases > 0) return false;
    discard_when_free_.erase(it);
    return true;
  }

  void discard_quietly(BlockId block) noexcept {
    try {
      manager_->discard(block);
    } catch (const std::exception& e) {
      warn("discarding block", block, e);
    }
  }

  void end_quietly(const Lease& lease) noexcept {
    try {
      manager_->release(lease.block, *lease.compute);
    } catch (const std::exception& e) {
      warn("releasing block", lease.block, e);
    }
  }

  static void warn(const char* doing, BlockId block, const std::exception& e) noexcept {
    std::fprintf(stderr, "reviva: warning: %s %llu at the end of its lease: %s\n", doing,
                 static_cast<unsigned long long>(block), e.what());
  }

  Use use_of(BlockId block) const {  // requires mutex_
    Use use;
    for (const auto& [id, lease] : leases_) {
      if (lease.block != block) continue;
      ++use.leases;
      if (!lease.released) ++use.unreleased;
      if (lease.tensor_alive) ++use.tensors_alive;
    }
    return use;
  }

  // What holds a block, leaving out `releasing` acquires that this very call releases.
  static std::string describe(const Use& use, std::size_t releasing) {
    std::string out;
    if (use.unreleased > releasing)
      out = std::to_string(use.unreleased - releasing) + " acquire(s) not yet released";
    if (use.tensors_alive > 0) {
      if (!out.empty()) out += ", ";
      out += "tensors from acquire() still alive (from " + std::to_string(use.tensors_alive) +
             " acquire(s))";
    }
    return out;
  }

  // An unreleased lease of `block` (one exists: checked by the caller), whose tensor is gone if
  // there is one, else the oldest. Requires mutex_.
  std::map<LeaseId, Lease>::iterator choose_unreleased(BlockId block) {
    auto chosen = leases_.end();
    for (auto it = leases_.begin(); it != leases_.end(); ++it) {
      if (it->second.block != block || it->second.released) continue;
      if (!it->second.tensor_alive) return it;
      if (chosen == leases_.end()) chosen = it;
    }
    REVIVA_ASSERT(chosen != leases_.end(), "block ", block, " has no lease to release");
    return chosen;
  }

  std::shared_ptr<OffloadManager> manager_;
  // Lock order: mutex_ before the core manager's (messages name blocks under mutex_). Neither
  // is held while the other side waits for the GIL.
  mutable std::mutex mutex_;
  std::map<LeaseId, Lease> leases_;                // guarded by mutex_; oldest first
  LeaseId next_id_ = 1;                            // guarded by mutex_
  std::unordered_set<BlockId> discard_when_free_;  // guarded by mutex_
};

class PyOffloadManager {
 public:
  PyOffloadManager(py::object py_engine, std::size_t budget_bytes, double budget_fraction,
                   const std::string& policy, const std::string& allocator,
                   std::size_t timeline_capacity, std::shared_ptr<DeviceArena> arena)
      : rt_(runtime_of(py_engine)), py_engine_(std::move(py_engine)) {
    OffloadManagerOptions o;
    o.budget_bytes = budget_bytes;
    o.budget_fraction = budget_fraction;
    o.policy = parse_policy(policy);
    o.timeline_capacity = timeline_capacity;
    std::shared_ptr<DeviceAllocator> device_allocator;
    REVIVA_CHECK_ARG((allocator == "arena") == (arena != nullptr),
                     "OffloadManager: allocator='arena' takes the arena (arena=...), and only it "
                     "does; got allocator='",
                     allocator, "' with", arena ? "" : "out", " an arena");
    if (allocator == "arena") {
      REVIVA_CHECK_ARG(arena->backend().kind() == rt_->backend()->kind(),
                       "OffloadManager: the arena belongs to another kind of device");
      device_allocator = std::make_shared<ArenaDeviceAllocator>(std::move(arena));
    } else if (allocator == "torch" && rt_->is_cuda()) {
#if defined(REVIVA_TORCH_CUDA)
      device_allocator = std::make_shared<TorchDeviceAllocator>(rt_->device().index());
#endif
    } else if (allocator == "torch_compute" && rt_->is_cuda()) {
#if defined(REVIVA_TORCH_CUDA)
      device_allocator = std::make_shared<TorchComputeOrderedAllocator>(rt_);
#endif
    } else if (allocator == "backend" || allocator == "torch" || allocator == "torch_compute") {
      device_allocator = make_backend_device_allocator(rt_->backend());  // host runtime: torch
                                                                         // CPU memory is plain
    } else {
      throw InvalidArgument("unknown allocator '" + allocator +
                            "': use 'torch', 'torch_compute', 'backend' or 'arena'");
    }
    allocator_name_ = device_allocator->name();
    manager_ = std::make_shared<OffloadManager>(engine_of(py_engine_), device_allocator, o);
    leases_ = std::make_shared<LeaseTable>(manager_);
  }

  // Tensors of this manager's blocks may outlive it (Note [Leases]): they keep the core manager.
  ~PyOffloadManager() { leases_->abandon(); }
  PyOffloadManager(const PyOffloadManager&) = delete;
  PyOffloadManager& operator=(const PyOffloadManager&) = delete;

  BlockId register_tensor(const std::vector<int64_t>& shape, py::object dtype) {
    const torch::ScalarType st = torch::python::detail::py_object_to_dtype(dtype);
    // Element count and byte count are checked for overflow: a product that wrapped registered
    // a block of a few bytes behind a tensor of billions of elements.
    int64_t numel = 1;
    std::size_t bytes = c10::elementSize(st);
    for (int64_t d : shape) {
      REVIVA_CHECK_ARG(d >= 0, "register: negative dimension ", d, " in shape ",
                       c10::IntArrayRef(shape));
      REVIVA_CHECK_ARG(!__builtin_mul_overflow(numel, d, &numel) &&
                           !__builtin_mul_overflow(bytes, static_cast<std::size_t>(d), &bytes),
                       "register: a tensor of shape ", c10::IntArrayRef(shape), " and dtype ",
                       py::str(dtype).cast<std::string>(),
                       " has more elements or bytes than 64 bits can count");
    }
    REVIVA_CHECK_ARG(bytes > 0, "register: the shape ", c10::IntArrayRef(shape), " holds no bytes");
    const BlockId id = manager_->register_block(bytes);
    meta_[id] = TensorMeta{shape, st};
    return id;
  }

  BlockId adopt(const torch::Tensor& t) {
    check_on_runtime_device(*rt_, t, "adopt");
    leases_->check_not_leased(t.data_ptr(), t.nbytes(), "adopt");
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
    BlockId id;
    {
      // Making room may wait for copies to land (a training forward adopting behind its D2H
      // copies): without the GIL, and `release` takes it when it runs.
      py::gil_scoped_release nogil;
      id = manager_->adopt(t.data_ptr(), t.nbytes(), release, *stream);
    }
    meta_[id] = TensorMeta{t.sizes().vec(), t.scalar_type()};
    return id;
  }

  torch::Tensor acquire(BlockId id, const std::string& access) {
    const TensorMeta* meta = &lookup(id);
    const Access mode = parse_access(access);
    auto stream = rt_->compute_stream();
    void* ptr;
    {
      py::gil_scoped_release nogil;
      ptr = manager_->acquire(id, *stream, mode);
      wait_on_host({&id, 1}, *stream);
    }
    return leases_->open({&id, 1}, {&ptr, 1}, {&meta, 1}, rt_->device(), stream).front();
  }

  // The host runtime computes on the CPU at once: the data must be there before acquire returns.
  // If waiting fails, the pins just taken are given back.
  void wait_on_host(std::span<const BlockId> acquired, const Stream& stream) {
    if (rt_->is_cuda()) return;
    try {
      stream.synchronize();
    } catch (...) {
      for (BlockId id : acquired) manager_->release(id, stream);
      throw;
    }
  }

  void release(BlockId id) {
    lookup(id);
    leases_->release(id);
  }

  void release_group(std::span<const BlockId> group, bool discard) {
    for (BlockId id : group) lookup(id);
    leases_->release_group(group, discard, "release_group");
  }

  // offload, discard and unregister move or drop the block's memory (Note [Leases]).
  void offload(BlockId id) {
    lookup(id);
    leases_->check_unleased(id, "offload");
    py::gil_scoped_release nogil;
    manager_->offload(id);
  }

  void discard(BlockId id) {
    lookup(id);
    leases_->check_unleased(id, "discard");
    py::gil_scoped_release nogil;
    manager_->discard(id);
  }

  bool discard_when_free(BlockId id) {
    lookup(id);
    return leases_->discard_when_free(id);
  }

  void unregister(BlockId id) {
    lookup(id);
    leases_->check_unleased(id, "unregister");
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
    d["to_host_busy_s"] = r.to_host_busy_ms / 1e3;
    d["to_device_busy_s"] = r.to_device_busy_ms / 1e3;
    d["compute_stall_s"] = r.compute_stall_ms / 1e3;
    d["host_wait_s"] = r.host_wait_ms / 1e3;
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
    return timeline_list(events);
  }

  py::list take_timeline() {
    std::vector<TimelineEvent> events;
    {
      py::gil_scoped_release nogil;
      events = manager_->take_timeline();
    }
    return timeline_list(events);
  }

  OffloadManager& manager() { return *manager_; }
  LeaseTable& leases() { return *leases_; }
  const std::shared_ptr<Runtime>& runtime() const { return rt_; }

 private:
  std::shared_ptr<Runtime> rt_;
  py::object py_engine_;  // keeps the engine (and its streams) alive as long as the manager
  std::string allocator_name_;
  // Shared with the leases (Note [Leases]): tensors from acquire() may outlive this object.
  std::shared_ptr<OffloadManager> manager_;
  std::shared_ptr<LeaseTable> leases_;
  std::unordered_map<BlockId, TensorMeta> meta_;
};

class PyPrefetchScheduler {
 public:
  PyPrefetchScheduler(py::object py_manager, int prefetch_groups, bool adaptive, int min_window,
                      int max_window, bool eager_offload, std::size_t max_ahead_bytes)
      : py_manager_(std::move(py_manager)), manager_(&py_manager_.cast<PyOffloadManager&>()) {
    PrefetchSchedulerOptions o;
    o.prefetch_groups = prefetch_groups;
    o.adaptive = adaptive;
    o.min_window = min_window;
    o.max_window = max_window;
    o.eager_offload = eager_offload;
    o.max_ahead_bytes = max_ahead_bytes;
    scheduler_ = std::make_unique<PrefetchScheduler>(manager_->manager(), o);
  }

  void declare_order(const std::vector<std::vector<BlockId>>& order) {
    for (const auto& g : order)
      for (BlockId id : g) manager_->lookup(id);
    scheduler_->declare_order(order);
  }

  std::vector<torch::Tensor> acquire_group(const std::vector<BlockId>& group,
                                           const std::string& access) {
    std::vector<const TensorMeta*> metas;
    for (BlockId id : group) metas.push_back(&manager_->lookup(id));
    const Access mode = parse_access(access);
    const auto& rt = manager_->runtime();
    auto stream = rt->compute_stream();
    std::vector<void*> ptrs;
    {
      py::gil_scoped_release nogil;
      ptrs = scheduler_->acquire_group(group, *stream, mode);
      manager_->wait_on_host(group, *stream);
    }
    return manager_->leases().open(group, ptrs, metas, rt->device(), stream);
  }

  // The leases are released here (a block's pin ends only once its tensors are gone too); the
  // scheduler then discards, or moves out what nobody holds any more, and prefetches.
  void release_group(const std::vector<BlockId>& group, bool discard) {
    manager_->release_group(group, discard);
    py::gil_scoped_release nogil;
    scheduler_->after_release(group, discard);
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
    d["stops_at_max_ahead"] = s.stops_at_max_ahead;
    d["eager_offloads"] = s.eager_offloads;
    d["measured_compute_s_per_group"] = s.measured_compute_ms_per_group / 1e3;
    d["measured_copy_s_per_group"] = s.measured_copy_ms_per_group / 1e3;
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
                    std::size_t, std::shared_ptr<DeviceArena>>(),
           py::arg("engine"), py::arg("budget_bytes") = 0, py::arg("budget_fraction") = 0.8,
           py::arg("policy") = "lru", py::arg("allocator") = "torch",
           py::arg("timeline_capacity") = std::size_t{1} << 16, py::arg("arena") = py::none(),
           "allocator: where blocks' device memory comes from: 'torch' (PyTorch's caching "
           "allocator, each block in the pool of the stream that first writes it), "
           "'torch_compute' (PyTorch's caching allocator on the compute stream, reused in its "
           "order: Note [Compute-ordered torch memory]), 'backend' (cudaMallocAsync), or "
           "'arena' (Reviva's DeviceArena, given as arena=..., e.g. "
           "reviva.device_resources(device).arena). On the CPU runtime all but 'arena' are the "
           "backend's.")
      .def("register", &PyOffloadManager::register_tensor, py::arg("shape"), py::arg("dtype"),
           "A block for a tensor of this shape and dtype, with no contents yet (state Empty).")
      .def("adopt", &PyOffloadManager::adopt, py::arg("tensor"),
           "Takes over a device tensor's memory as a block (state Device).")
      .def("acquire", &PyOffloadManager::acquire, py::arg("block"), py::arg("access") = "readwrite",
           "A tensor on the block's device memory for the current stream. The block stays "
           "resident until release() is called for this acquire and the tensor is gone.")
      .def("release", &PyOffloadManager::release, py::arg("block"),
           "Ends one acquire of the block; its tensor keeps the block resident while it lives.")
      .def("offload", &PyOffloadManager::offload, py::arg("block"))
      .def(
          "prefetch",
          [](PyOffloadManager& self, BlockId id) {
            self.lookup(id);
            py::gil_scoped_release nogil;
            return self.manager().prefetch(id);
          },
          py::arg("block"))
      .def("discard", &PyOffloadManager::discard, py::arg("block"))
      .def("discard_when_free", &PyOffloadManager::discard_when_free, py::arg("block"),
           "Discards the block as soon as the last tensor from acquire() viewing it is gone "
           "(and its acquires released), in whichever thread that happens. Returns False, "
           "arranging nothing, when nothing holds it now (discard() it then).")
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
      .def("take_timeline", &PyOffloadManager::take_timeline,
           "The events so far (as timeline()), leaving none: each step's own")
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
      .def(py::init<py::object, int, bool, int, int, bool, std::size_t>(), py::arg("manager"),
           py::arg("prefetch_groups") = 2, py::arg("adaptive") = false, py::arg("min_window") = 1,
           py::arg("max_window") = 16, py::arg("eager_offload") = true,
           py::arg("max_ahead_bytes") = 0,
           "max_ahead_bytes: bytes of the window's blocks that may be resident or on their way "
           "ahead of compute (0: as many as the manager's budget holds).")
      .def_property(
          "max_ahead_bytes",
          [](PyPrefetchScheduler& self) { return self.scheduler().max_ahead_bytes(); },
          [](PyPrefetchScheduler& self, std::size_t bytes) {
            self.scheduler().set_max_ahead_bytes(bytes);
          })
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
