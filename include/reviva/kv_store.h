// KVStore: the K/V cache of a decoder, layer by layer, split between device memory and pinned
// host memory, for inference that streams the layers that do not fit.
//
// A layer's K/V is one token-major buffer of up to `capacity_tokens` rows of `token_bytes` (a
// row holds a token's K and V of every head: an append is one contiguous copy): an append block
// of the store's OffloadManager (Note [Append blocks] in append_blocks.cpp), whose device
// memory comes from the DeviceArena through an ArenaDeviceAllocator. A layer is either resident
// (a kept block: its memory grows with its tokens and never leaves) or streamed: its contents
// live in its write-through pinned host copy, and it is brought to the device for each use.
// Appended tokens are copied to the host copy alone, never the whole layer; a fetch copies only
// the valid prefix.
//
// The manager's budget is the one bound on the store's device memory: a layer's bytes for each
// resident layer and for each "slot" (room for one streamed layer at a time), so no memory is
// held for max_new_tokens up front and a promotion maps memory instead of asking an allocator
// for a buffer. When the arena cannot give memory, the store degrades rather than fails: a
// promotion leaves the layer streamed, a prefetch that finds no memory is skipped (the fetch
// happens at the acquire), and both are counted; only a layer that cannot be held at all is an
// OutOfMemory.
//
// Layers are used in a cycle (0, 1, ..., L-1, 0, ...: one decode step after another), declared to
// the store's PrefetchScheduler as its order: at each acquire it starts bringing in the next
// `prefetch_layers` streamed layers of the cycle (resident layers take no place in the window)
// and at each release it lets go of (frees: the host copy is already whole) a streamed layer
// needed later than the window, so that the copies run while compute works on the layers before
// them. The store shares the TransferEngine, the pinned pool and the arena; the lifetime
// protocol is the manager's (Note [Lifetime protocol] in offload_manager_impl.h). Single-threaded.
//
// Paged layers (options.page_tokens > 0; Note [Paged layers] in kv_store_pages.cpp): a layer that
// is not resident from the start keeps its K/V in pages of page_tokens tokens, each an append block
// of its own, so that decode brings a streamed layer in page by page (the staging room is a few
// pages, not whole layers) and a promotion keeps its pages on the device. Such a layer is used
// through the *_page calls; the whole-layer calls refuse it.
//
// Spilled layers (Note [Spilled layers] in kv_store_disk.cpp): a streamed whole layer whose K/V
// lives on disk (options.disk) between its uses, when pinned host memory cannot hold every
// streamed layer: only a few such layers hold a pinned host copy at a time, read back from disk
// ahead of their turn in the cycle and written back (the rows they gained) after it.
#pragma once

#include <reviva/arena_device_allocator.h>
#include <reviva/device_arena.h>
#include <reviva/disk_store.h>
#include <reviva/export.h>
#include <reviva/offload_manager.h>
#include <reviva/pinned_host_pool.h>
#include <reviva/prefetch_scheduler.h>
#include <reviva/stream.h>
#include <reviva/transfer_engine.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace reviva {

struct KVStoreOptions {
  int num_layers = 0;
  std::size_t token_bytes = 0;        // bytes of one token of one layer (its K and V)
  std::size_t capacity_tokens = 0;    // tokens a layer may hold (prompt + new tokens)
  int prefetch_layers = 2;            // streamed layers kept in flight ahead of compute
  std::size_t timeline_capacity = 0;  // copy and stall events kept for timeline() (0: none)
  std::size_t page_tokens = 0;        // > 0: layers not resident from the start are paged
  // Tokens each layer may hold, when they differ (Note [Layers of their own size] in
  // kv_store.cpp): num_layers entries, each in [1, capacity_tokens]; empty: capacity_tokens each.
  // A sliding-window layer kept as a ring of its window holds fewer. Not with page_tokens.
  std::vector<std::size_t> layer_capacity_tokens;
  // Where spilled layers keep their K/V (spill_to_disk); null: no layer may spill.
  std::shared_ptr<DiskStore> disk;
  // Spilled layers that may hold a pinned host copy at once (the one just used, the one in use,
  // the window's, and those being read ahead); 0: prefetch_layers + 3. At least 2.
  int disk_staged_layers = 0;
};

struct KVStoreStats {
  int resident_layers = 0;
  int streamed_layers = 0;
  int slots = 0;
  int paged_layers = 0;  // layers kept in pages (options.page_tokens > 0), promoted ones included
  int page_slots = 0;
  std::uint64_t fills = 0;             // fetches (H2D of a layer's valid prefix)
  std::uint64_t prefetched_fills = 0;  // of those, started ahead of use
  std::uint64_t slot_hits = 0;         // acquires of streamed layers that found them on the device
  std::uint64_t promotions = 0;        // streamed layers made resident
  std::uint64_t promotion_failures = 0;         // promotions refused: the arena had no memory
  std::uint64_t prefetches_without_memory = 0;  // prefetches skipped: the arena had no memory
  // prefetches that found every slot's room in use; retried at the next release (with as many
  // slots as the window, the last layer of the window waits for a release each time)
  std::uint64_t prefetches_deferred = 0;
  std::uint64_t bytes_to_device = 0;        // H2D bytes landed
  std::uint64_t bytes_to_host = 0;          // D2H bytes submitted (appends to host copies)
  int host_attended_layers = 0;             // streamed layers read on the host (attend_on_host)
  std::uint64_t bytes_written_on_host = 0;  // rows the host wrote into them (host_wrote)
  double compute_stall_ms = 0.0;            // compute's waits for fetches (the manager's meter)
  double copy_to_device_ms = 0.0;           // H2D copy-stream time of the landed fetches
  double overlap_ratio = 1.0;         // Note [Overlap ratio], over the store's copies and stalls
  std::size_t host_bytes = 0;         // pinned bytes of the host copies
  double host_copy_wait_ms = 0.0;     // host time taking host copies from the pool (pinning)
  std::size_t device_bytes = 0;       // arena bytes mapped for the store now (held and cached)
  std::size_t peak_device_bytes = 0;  // the most at once
  // Note [Spilled layers]
  int spilled_layers = 0;          // layers whose K/V lives on disk between uses
  int staged_layers = 0;           // of those, holding a pinned host copy now
  int peak_staged_layers = 0;      // the most at once
  std::uint64_t disk_reads = 0;    // spilled layers read back from disk
  std::uint64_t staging_hits = 0;  // stagings that found the host copy still pinned (no read)
  std::uint64_t bytes_from_disk = 0;
  std::uint64_t bytes_to_disk = 0;
  double disk_wait_ms = 0.0;   // the calling thread's waits for disk reads and write-backs
  std::size_t disk_bytes = 0;  // disk space the spilled layers hold now
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
  // Room for one more streamed layer on the device at a time (the budget grows by a layer).
  void add_slot();
  // Paged layers: room for `pages` streamed pages on the device at a time (beside the slots).
  // False, changing nothing, when the pages acquired need more room.
  bool set_page_slots(int pages);
  int page_slots() const noexcept { return page_slots_; }
  // Gives up a slot's room (the budget shrinks by a layer; streamed layers not acquired leave
  // the device as needed, their memory going back once the streams that used it pass). False,
  // changing nothing, when the layers acquired need that room, or only one slot is left while
  // layers stream.
  bool drop_slot();

  // Compute is about to use `layer`: returns its device buffer, holding its first length(layer)
  // tokens for work submitted to `compute` from now on (compute waits for their fetch), until
  // release(). Starts bringing in the next streamed layers of the cycle. Throws OutOfMemory
  // when a streamed layer needs memory that the budget or the arena cannot give.
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
  // The arena buffer behind the acquired layer (to keep its memory mapped while views exist).
  std::shared_ptr<ArenaBuffer> buffer(int layer) const;

  // Paged layers (see above). `page` counts from 0; token indices within a page. Compute uses a
  // page between acquire_page and release_page as it uses a layer between acquire and release
  // (a page that compute writes is written through to its host copy by wrote_page).
  bool paged(int layer) const;
  std::size_t page_tokens() const noexcept { return options_.page_tokens; }
  std::size_t pages(int layer) const;  // pages holding the layer's tokens: ceil(length / page)
  void* acquire_page(int layer, std::size_t page, const Stream& compute);
  void reserve_page(int layer, std::size_t page, std::size_t tokens);
  std::size_t reserved_page_tokens(int layer, std::size_t page) const;
  void wrote_page(int layer, std::size_t page, std::size_t first, std::size_t count,
                  const Stream& compute);
  void release_page(int layer, std::size_t page, const Stream& compute);
  std::shared_ptr<ArenaBuffer> page_buffer(int layer, std::size_t page) const;
  // A paged layer's prefill by chunks of `chunk` tokens over tokens [first, end): declares the
  // order of its page accesses (per chunk: the pages before the chunk, which its attention
  // reads, then the pages it writes), so that the scheduler brings the next chunk's pages in
  // while compute works on the current ones, instead of fetching each when it is reached. Until
  // end_prefill_order(), which declares the decode cycle again.
  void declare_prefill_order(int layer, std::size_t first, std::size_t end, std::size_t chunk);
  void end_prefill_order();

  // Keeps the layer's first `tokens` tokens (<= length()) and forgets the rest: later writes
  // continue from there (assisted decoding's rejected tokens). Not while the layer (or one of
  // its pages) is acquired.
  void truncate(int layer, std::size_t tokens);
  // A streamed layer whose reads need only its last `tokens` tokens (a sliding window; 0: all):
  // its fetches copy those alone (OffloadManager::set_fetch_tail, Note [Fetch tails] in
  // append_blocks.cpp); the tokens before them are stale on the device and must not be read.
  // Not for paged layers; not while the layer is acquired.
  void set_fetch_window(int layer, std::size_t tokens);
  std::size_t length(int layer) const;
  bool resident(int layer) const;

  // Note [Host-side appends] (append_blocks.cpp): a streamed whole layer whose reads and writes
  // happen on the host from now on (decode attention on the host's cores, Note [Attention on the
  // host] in host_attention.cpp): it leaves the device (clean: its host copy is whole), the cycle
  // no longer brings it in, and acquire refuses it. Not while acquired; not for a resident or a
  // paged layer. Until clear() (or the store's end).
  // Note [Spilled layers]: a streamed whole layer whose K/V lives on disk between its uses.
  // Only before the first acquire; not for a resident or paged layer; options.disk must be set.
  void spill_to_disk(int layer);
  bool spilled(int layer) const;

  void attend_on_host(int layer);
  bool host_attended(int layer) const;
  // A host-attended layer's rows (token-major, token_bytes each, its first length() tokens
  // valid), once every write-through to them has landed. Valid until clear() or close().
  const void* host_rows(int layer);
  // The host wrote tokens [first, first + count) of a host-attended layer: `rows` (count *
  // token_bytes bytes) go into its host copy; first <= length() (no gap), within the capacity.
  void host_wrote(int layer, std::size_t first, std::size_t count, const void* rows);
  std::size_t layer_bytes() const noexcept;  // capacity_tokens * token_bytes (the largest layer)
  std::size_t layer_bytes(int layer) const;  // the layer's capacity * token_bytes
  std::size_t capacity(int layer) const;     // tokens the layer may hold
  const KVStoreOptions& options() const noexcept { return options_; }
  // Waits for every copy in flight. (How long compute waited for fills is the engine's stall
  // meter: TransferEngine::stats().)
  void synchronize();
  KVStoreStats stats();
  // The manager's timeline of the store's copies and compute's waits for them (ms since the
  // store was built), up to options().timeline_capacity events; empty once closed.
  std::vector<TimelineEvent> timeline();
  // Forgets all contents (lengths 0) after its copies land; the memory goes back to the pool and
  // the allocator's cache, from where the next contents take it.
  void clear();
  // Waits for its copies, then gives every buffer back to the arena (stream-ordered after the
  // last use) and every host copy to the pool. The store is unusable afterwards. Idempotent.
  void close();
  bool closed() const noexcept { return closed_; }

 private:
  BlockId block_at(int layer, const char* what) const;
  BlockId page_at(int layer, std::size_t page, const char* what) const;
  void check_acquired(int layer, const char* what) const;
  void check_page_acquired(int layer, std::size_t page, const char* what) const;
  void check_whole(int layer, const char* what) const;
  std::size_t page_bytes(std::size_t page) const;
  std::size_t write_page(int layer) const;
  std::size_t slot_bytes() const;
  void set_budget();
  void declare_cycle();
  void check_open(const char* what) const;
  // Note [Spilled layers] (kv_store_disk.cpp)
  int staged_limit() const;
  bool staged(int layer) const;
  int staged_spills() const;
  void advance_spill(int current);
  void finish_ready_spills();
  void finish_spill(int layer, bool take_back);
  void note_staged();
  void make_staging_room();
  void check_not_lost(int layer, const char* what) const;
  void stage(int layer);
  void unstage(int layer);
  void bring_back(int layer);
  void forget_spills();

  std::shared_ptr<TransferEngine> engine_;
  std::shared_ptr<DeviceArena> arena_;
  std::shared_ptr<ArenaDeviceAllocator> allocator_;
  KVStoreOptions options_;
  std::unique_ptr<OffloadManager> manager_;
  std::unique_ptr<PrefetchScheduler> scheduler_;
  std::vector<BlockId> blocks_;  // one append block per layer
  std::vector<bool> resident_;
  std::vector<bool> host_attended_;  // Note [Host-side appends]
  std::vector<void*> acquired_;      // the address of an acquired layer, null otherwise
  int slots_ = 0;
  // Paged layers: each layer's pages (empty for a layer resident from the start), the address of
  // each acquired page, the page taking each layer's next token when the cycle was declared, and
  // the bytes of pages kept on the device (promoted layers).
  std::vector<std::vector<BlockId>> pages_;
  std::vector<std::vector<void*>> page_acquired_;
  std::vector<std::size_t> cycle_write_page_;
  std::size_t kept_page_bytes_ = 0;
  std::size_t resident_bytes_ = 0;      // whole resident layers' bytes (each its own capacity's)
  std::size_t staged_pages_bytes_ = 0;  // bytes of the pages compute holds that are not kept
  int promoted_pages_ = 0;        // paged layers promoted (resident, counted by their kept pages)
  int prefill_order_layer_ = -1;  // the paged layer whose prefill order is declared, or -1
  int page_slots_ = 0;
  // Note [Spilled layers]: each spilled layer's room on disk, the bytes of its valid prefix the
  // disk holds, and, while a read fills it or a write-back empties it, its host copy and that
  // request (the host copy is otherwise the manager's, or nowhere: the block is Disk).
  struct Spill {
    bool on = false;
    DiskExtent extent = 0;
    std::size_t on_disk = 0;
    std::size_t written_from = 0;  // the write-back in flight's first byte
    PinnedBlock block;
    DiskRequest request;
    bool reading = false;
    bool lost = false;  // a read or write-back failed: its rows are gone (until clear())
  };
  std::vector<Spill> spills_;
  int spilled_count_ = 0;
  KVStoreStats counts_;   // what the store counts itself (the rest comes from the manager)
  bool started_ = false;  // a layer was acquired: residency is fixed (promotion aside)
  bool closed_ = false;
};

}  // namespace reviva
