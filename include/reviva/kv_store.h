// KVStore: the K/V cache of a decoder, layer by layer, split between device memory and pinned
// host memory, for inference that streams the layers that do not fit.
//
// A layer's K/V is one token-major buffer of up to `capacity_tokens` rows of `token_bytes` (a
// row holds a token's K and V of every head: an append is one contiguous copy). A layer is
// either resident (a DeviceArena buffer of its own that grows with its tokens) or streamed: its
// contents live in an append-only pinned host copy, and it is brought into one of a few staging
// slots (arena buffers too) for each use. Appended tokens are copied to the host copy alone,
// never the whole layer; a fill copies only the valid prefix.
//
// All device memory comes from the arena and goes back to it at close() (or destruction):
// mapped as tokens arrive (reserve()), never for tokens not yet written, so no memory is held
// for max_new_tokens up front and a promotion maps memory instead of asking an allocator for a
// buffer. When the arena cannot give memory, the store degrades rather than fails: a promotion
// leaves the layer streamed, a prefetch that finds no memory is skipped (the fill happens at the
// acquire), and both are counted; only a layer that cannot be held at all is an OutOfMemory.
//
// Layers are used in a cycle (0, 1, ..., L-1, 0, ...: one decode step after another); at each
// acquire the store starts filling the next `prefetch_layers` streamed layers of the cycle into
// free slots, so that their copies run while compute works on the layers before them.
//
// Why not the OffloadManager's blocks: a block is moved whole, and a dirty block is re-sent whole;
// the K/V cache grows by a token per step, and re-sending a layer per token is what makes HF's
// offloaded cache slow. The store shares the TransferEngine, the pinned pool and the arena.
// The lifetime protocol is the manager's (Note [Lifetime protocol] in offload_manager.cpp),
// applied in kv_store.cpp. Single-threaded.
#pragma once

#include <reviva/device_arena.h>
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
  std::size_t token_bytes = 0;      // bytes of one token of one layer (its K and V)
  std::size_t capacity_tokens = 0;  // tokens a layer may hold (prompt + new tokens)
  int prefetch_layers = 2;          // streamed layers kept in flight ahead of compute
};

struct KVStoreStats {
  int resident_layers = 0;
  int streamed_layers = 0;
  int slots = 0;
  std::uint64_t fills = 0;                      // slot fills (H2D of a layer's valid prefix)
  std::uint64_t prefetched_fills = 0;           // of those, started ahead of use
  std::uint64_t slot_hits = 0;                  // acquires that found the layer still in its slot
  std::uint64_t promotions = 0;                 // streamed layers made resident
  std::uint64_t promotion_failures = 0;         // promotions refused: the arena had no memory
  std::uint64_t prefetches_without_memory = 0;  // prefetches skipped: no memory for the slot
  std::uint64_t bytes_to_device = 0;            // H2D bytes submitted
  std::uint64_t bytes_to_host = 0;              // D2H bytes submitted (appends to host copies)
  std::size_t host_bytes = 0;                   // pinned bytes of the host copies
  double host_copy_wait_ms = 0.0;     // host time taking host copies from the pool (pinning)
  std::size_t device_bytes = 0;       // arena bytes mapped for this store now
  std::size_t peak_device_bytes = 0;  // the most at once
};

class REVIVA_API KVStore {
 public:
  KVStore(std::shared_ptr<TransferEngine> engine, std::shared_ptr<DeviceArena> arena,
          KVStoreOptions options);
  ~KVStore();  // close()
  KVStore(const KVStore&) = delete;
  KVStore& operator=(const KVStore&) = delete;

  // Layer `layer` stays on the device for good, in an arena buffer that grows with its tokens.
  // Only before the first acquire (which fixes which layers need host copies).
  void make_resident(int layer);
  // Makes a streamed layer resident from now on: its valid prefix is copied in from the host
  // copy (compute waits for it at the next acquire), and the host copy is given back. For memory
  // that frees up after prefill. Not while acquired. False, changing nothing but the stats, when
  // the arena cannot map its tokens.
  bool promote(int layer);
  // A staging slot for streamed layers: an arena buffer, mapped as its layers need.
  void add_slot();
  // Gives up a slot no layer is using (the least recently released, else one a prefetch filled;
  // its layer is filled again when next needed): its memory goes back to the arena once the
  // streams that used it pass. False when every slot is acquired, or only one is left while
  // layers stream.
  bool drop_slot();

  // Compute is about to use `layer`: returns its device buffer, holding its first length(layer)
  // tokens for work submitted to `compute` from now on (compute waits for their fill), until
  // release(). Starts filling the next streamed layers of the cycle. Throws OutOfMemory when a
  // streamed layer needs a slot's memory that the arena cannot give.
  void* acquire(int layer, const Stream& compute);
  // Backs the acquired layer's buffer for its first `tokens` tokens, before compute writes them.
  // Throws OutOfMemory naming the numbers when the arena cannot.
  void reserve(int layer, std::size_t tokens);
  // Tokens the acquired layer's buffer can hold now (mapped).
  std::size_t reserved_tokens(int layer) const;
  // Compute wrote tokens [first, first + count) of `layer` into the acquired buffer, with the
  // work queued on `compute` so far. A streamed layer copies them to its host copy from there.
  void wrote(int layer, std::size_t first, std::size_t count, const Stream& compute);
  // Compute's use of the acquired buffer ends with the work queued on `compute` so far.
  void release(int layer, const Stream& compute);
  // The arena buffer behind the acquired layer (to keep its memory alive while views exist).
  std::shared_ptr<ArenaBuffer> buffer(int layer) const;

  std::size_t length(int layer) const;
  bool resident(int layer) const;
  std::size_t layer_bytes() const noexcept;  // capacity_tokens * token_bytes
  const KVStoreOptions& options() const noexcept { return options_; }
  // Waits for every copy in flight. (How long compute waited for fills is the engine's stall
  // meter: TransferEngine::stats().)
  void synchronize();
  KVStoreStats stats();
  // Forgets all contents (lengths 0), keeping buffers and host copies, after its copies land.
  void clear();
  // Waits for its copies, then gives every buffer back to the arena (stream-ordered after the
  // last use) and every host copy to the pool. The store is unusable afterwards. Idempotent.
  void close();
  bool closed() const noexcept { return closed_; }

 private:
  struct Slot;
  struct Layer;
  Layer& layer_at(int layer, const char* what);
  const Layer& layer_at(int layer, const char* what) const;
  ArenaBuffer& acquired_buffer(int layer, const char* what) const;
  void prefetch_after(int layer);
  // 1: filled (or reserved), 0: no free slot, -1: no memory for the slot (prefetch only).
  int fill(int layer, bool prefetch);
  int take_free_slot(std::size_t need);
  int take_prefetched_slot();
  void allocate_host_copy(Layer& l);
  void become_resident(int layer, std::shared_ptr<ArenaBuffer> buffer);
  void unpark(int slot);
  Transfer copy_prefix_in(Layer& layer, ArenaBuffer& dst);
  void note_device_bytes();
  void check_open(const char* what) const;

  std::shared_ptr<TransferEngine> engine_;
  std::shared_ptr<DeviceArena> arena_;
  std::shared_ptr<Backend> backend_;
  std::unique_ptr<Event> append_producer_;  // re-recorded on compute at each append
  KVStoreOptions options_;
  std::vector<Layer> layers_;
  std::vector<Slot> slots_;
  std::deque<int> free_slots_;  // slots not acquired, least recently released first
  std::vector<int> streamed_;   // streamed layers in cycle order
  KVStoreStats stats_;
  bool started_ = false;  // a layer was acquired: residency is fixed (promotion aside)
  bool closed_ = false;
};

}  // namespace reviva
