// KVStore: the K/V cache of a decoder, layer by layer, split between device memory and pinned
// host memory, for inference that streams the layers that do not fit.
//
// Every layer holds `tensors_per_layer` tensors (K and V) of up to `capacity_tokens` tokens of
// `token_bytes` each, token-major (a token's bytes are contiguous, so an append is one copy).
// A layer is either resident (its device buffers, given by the caller, hold it for good) or
// streamed: its contents live in an append-only pinned host copy, and it is brought into one of
// a few staging slots (device buffers given by the caller) for each use. Appended tokens are
// copied to the host copy alone, never the whole layer; a fill copies only the valid prefix.
//
// Layers are used in a cycle (0, 1, ..., L-1, 0, ...: one decode step after another); at each
// acquire the store starts filling the next `prefetch_layers` streamed layers of the cycle into
// free slots, so that their copies run while compute works on the layers before them.
//
// Why not the OffloadManager's blocks: a block is moved whole, and a dirty block is re-sent whole;
// the K/V cache grows by a token per step, and re-sending a layer per token is what makes HF's
// offloaded cache slow. The store shares the TransferEngine and the pinned pool with the manager.
// The lifetime protocol is the manager's (Note [Lifetime protocol] in offload_manager.cpp),
// applied in kv_store.cpp. Device memory belongs to the caller, so it counts against the
// caller's allocator (PyTorch's, in the binding) and its budget. Single-threaded.
#pragma once

#include <reviva/export.h>
#include <reviva/stream.h>
#include <reviva/transfer_engine.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

namespace reviva {

struct KVStoreOptions {
  int num_layers = 0;
  int tensors_per_layer = 2;        // K and V
  std::size_t token_bytes = 0;      // bytes of one token of one tensor of one layer
  std::size_t capacity_tokens = 0;  // tokens each buffer and host copy holds
  int prefetch_layers = 2;          // streamed layers kept in flight ahead of compute
};

struct KVStoreStats {
  int resident_layers = 0;
  int streamed_layers = 0;
  int slots = 0;
  std::uint64_t fills = 0;             // slot fills (H2D of a layer's valid prefix)
  std::uint64_t prefetched_fills = 0;  // of those, started ahead of use
  std::uint64_t slot_hits = 0;         // acquires that found the layer still in its slot
  std::uint64_t promotions = 0;        // streamed layers made resident
  std::uint64_t bytes_to_device = 0;   // H2D bytes submitted
  std::uint64_t bytes_to_host = 0;     // D2H bytes submitted (appends to host copies)
  double compute_stall_ms = 0.0;       // compute waiting at acquire for a fill (measured)
  std::uint64_t stalls = 0;            // acquires that waited longer than timer noise
  std::size_t host_bytes = 0;          // pinned bytes of the host copies
};

class REVIVA_API KVStore {
 public:
  KVStore(std::shared_ptr<TransferEngine> engine, KVStoreOptions options);
  ~KVStore();
  KVStore(const KVStore&) = delete;
  KVStore& operator=(const KVStore&) = delete;

  // Layer `layer` lives in `buffers` (tensors_per_layer device pointers of buffer_bytes() each)
  // for good. Only before the first acquire (which allocates the streamed layers' host copies).
  void make_resident(int layer, std::vector<void*> buffers);
  // Makes a streamed layer resident from now on, in `buffers` (as for make_resident): its valid
  // prefix is copied in from the host copy (compute waits for it at the next acquire), and the
  // host copy is given back. For memory that frees up after prefill. Not while acquired.
  void promote(int layer, std::vector<void*> buffers);
  // A staging slot for streamed layers (tensors_per_layer device pointers of buffer_bytes()).
  void add_slot(std::vector<void*> buffers);

  // Compute is about to use `layer`: returns its device buffers, holding its first length(layer)
  // tokens for work submitted to `compute` from now on (compute waits for their fill), until
  // release(). Starts filling the next streamed layers of the cycle.
  std::vector<void*> acquire(int layer, const Stream& compute);
  // Compute wrote tokens [first, first + count) of `layer` into the acquired buffers, with the
  // work queued on `compute` so far. A streamed layer copies them to its host copy from there.
  void wrote(int layer, std::size_t first, std::size_t count, const Stream& compute);
  // Compute's use of the acquired buffers ends with the work queued on `compute` so far.
  void release(int layer, const Stream& compute);

  std::size_t length(int layer) const;
  bool resident(int layer) const;
  std::size_t buffer_bytes() const noexcept;
  const KVStoreOptions& options() const noexcept { return options_; }
  // Waits for every copy in flight and folds stall measurements into stats().
  void synchronize();
  KVStoreStats stats();
  // Forgets all contents (lengths 0), keeping buffers and host copies, after its copies land.
  void clear();

 private:
  struct Slot;
  struct Layer;
  struct Stall;
  Layer& layer_at(int layer, const char* what);
  const Layer& layer_at(int layer, const char* what) const;
  void prefetch_after(int layer);
  bool fill(int layer, bool prefetch);
  int take_free_slot();
  void fold_stalls(bool wait);
  void allocate_host_copies();
  void become_resident(int layer, std::vector<void*> buffers);
  void unpark(int slot);
  Transfer copy_prefix_in(Layer& layer, const std::vector<void*>& dst);
  void check_buffers(const std::vector<void*>& buffers, const char* what) const;

  std::shared_ptr<TransferEngine> engine_;
  std::shared_ptr<Backend> backend_;
  std::unique_ptr<Event> append_producer_;  // re-recorded on compute at each append
  KVStoreOptions options_;
  std::vector<Layer> layers_;
  std::vector<Slot> slots_;
  std::deque<int> free_slots_;  // slots not acquired, least recently released first
  std::vector<int> streamed_;   // streamed layers in cycle order
  std::vector<Stall> stalls_;   // waits whose duration is not measured yet
  KVStoreStats stats_;
  bool host_ready_ = false;
};

}  // namespace reviva
