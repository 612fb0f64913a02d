// OffloadManager::Impl: the state behind an OffloadManager and the steps its calls are made of,
// shared by the files that implement it: offload_manager.cpp (a block's lifetime: register,
// acquire, release, offload, prefetch, discard), offload_manager_room.cpp (eviction, making room
// under the budget, waiting for memory, folding completed copies into state), append_blocks.cpp
// (Note [Append blocks], [Fetch tails], [Host-side appends]) and offload_manager_metrics.cpp
// (metrics, timeline, invariants). Private to the library (not installed).
//
// Note [Lifetime protocol]
// DESIGN.md's five rules, and where each is kept here:
//   1. A D2H starts only after the events recorded where compute last used the block: every
//      eviction first makes the D2H stream wait on the block's last-use events (evict()).
//   2. Device memory of an offloaded block is released only after its D2H: the memory is freed
//      stream-ordered on the D2H stream after the copy, and its bytes stay counted against the
//      budget until the copy's completion event is seen (poll()). A clean eviction (the host copy
//      is still valid) frees on the D2H stream after the same waits, guarded by an event.
//   3. A block is handed to compute only after the compute stream waits on its H2D event
//      (acquire() -> wait_for_copy()).
//   4. Host memory of a block is reused only after every copy that read it: host blocks come
//      from the PinnedHostPool, and the engine records each copy's stream on them, so the pool
//      defers their reuse (Note [Deferred free] in pinned_host_pool_frees.cpp); a block's own host
//      copy is rewritten only by a D2H that is ordered after compute's use of the data an earlier
//      H2D brought in.
//   5. No backend call while holding `mutex`: each operation decides under the mutex (marking the
//      block `busy` while it is in transition), makes its backend calls unlocked, and records the
//      outcome under the mutex again. Objects whose destructors call the backend (events,
//      transfers, pinned blocks) are moved into a Graveyard that dies after the lock is released.
//
// Note [Stream-ordered frees]
// Rule 2 keeps a freed block's bytes counted against the budget until the host sees the free
// complete (`freeing`), so a block that needs room waits on the host for the device to pass the
// free. When the allocator reuses freed memory only after the allocating stream waits for the
// free on the device (DeviceAllocator::reuses_in_stream_order: the arena's allocator), that
// wait is already on the device: the bytes of memory the allocator owns count as free at once,
// and the next copy into them is ordered after the free by the allocator. This is what keeps a
// copy stream fed when the host runs ahead of the device (a training backward): the host makes
// room as it frees and the copies wait on the device, instead of the host waiting for each
// free. Memory adopted from the caller is given back through its release function and stays
// counted until the free is seen.
//
#pragma once

#include <reviva/error.h>
#include <reviva/offload_manager.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

namespace reviva {

using Clock = std::chrono::steady_clock;

// A stall shorter than this is timer noise, not compute waiting for a copy.
constexpr double kStallThresholdMs = 0.01;

// A point after which one stream no longer uses a block's device memory.
struct UseGuard {
  std::shared_ptr<Event> event;  // either an event recorded on `stream` ...
  Transfer transfer;             // ... or the completion of a copy (on a copy stream)
  StreamHandle stream = nullptr;
  const Event& point() const { return event ? *event : transfer.completion_event(); }
};

// Backend-calling objects released under the mutex die here, after it is unlocked. Declare it
// before the lock so that it is destroyed after the lock (reverse order of declaration).
struct Graveyard {
  std::vector<Transfer> transfers;
  std::vector<PinnedBlock> blocks;
  std::vector<UseGuard> guards;
  std::vector<std::shared_ptr<Event>> events;
};

struct OffloadManager::Impl {
  struct Block {
    BlockId id = kInvalidBlock;
    std::size_t bytes = 0;
    std::string name;
    BlockState state = BlockState::Empty;
    void* device = nullptr;
    std::function<void(StreamHandle)> release_adopted;  // set while the memory is the caller's
    PinnedBlock host;
    bool host_valid = false;
    int pins = 0;
    bool busy = false;        // a thread is moving it (decided under the mutex, acting unlocked)
    bool prefetched = false;  // arrived by prefetch(), not yet acquired
    bool drop_on_landing = false;    // discarded while its D2H ran: Empty once the copy lands
    std::vector<UseGuard> last_use;  // latest use per stream since it became resident
    Transfer transfer;               // D2H while ToHost; H2D while ToDevice or until folded
    // Append blocks (Note [Append blocks]); `bytes` is then the device allocation.
    bool append = false;
    bool keep = false;            // kept resident: never evicted, no host copy
    std::size_t capacity = 0;     // an append block's most bytes; a fixed block's `bytes`
    std::size_t valid = 0;        // an append block's bytes of contents
    Transfer last_write;          // its last write-through D2H (a fetch waits for it: rule 4)
    std::size_t fetch_tail = 0;   // Note [Fetch tails]: fetches copy the last bytes alone (0: all)
    std::size_t device_from = 0;  // the device copy's first fetched byte (before it: stale)
  };
  struct Freeing {  // device memory freed stream-ordered, counted until `guard` completes
    std::uint64_t id;
    std::size_t bytes;
    std::shared_ptr<Event> guard;
  };
  struct Stall {
    BlockId block;
    std::shared_ptr<Event> before, after;
    bool prefetched;
  };

  std::shared_ptr<TransferEngine> engine;
  std::shared_ptr<Backend> backend;
  std::shared_ptr<DeviceAllocator> allocator;
  OffloadManagerOptions options;
  std::unique_ptr<EvictionPolicy> policy;  // guarded by mutex
  Event origin;
  Clock::time_point origin_host;

  mutable std::mutex mutex;
  std::condition_variable changed;  // a block stopped being busy, or memory was freed
  std::unordered_map<BlockId, std::unique_ptr<Block>> blocks;  // guarded by mutex
  BlockId next_id = 1;                                         // guarded by mutex
  std::size_t budget = 0;                                      // guarded by mutex
  std::size_t held = 0;           // guarded by mutex: bytes counted against the budget
  std::size_t freeing_bytes = 0;  // guarded by mutex: of `held`, already on their way out
  std::size_t registered = 0;     // guarded by mutex
  std::vector<Freeing> freeing;   // guarded by mutex
  std::uint64_t next_freeing_id = 1;
  std::vector<Stall> stalls;  // guarded by mutex
  // H2D copies of blocks that left the device before the copy was folded: still to be counted.
  std::vector<std::pair<BlockId, Transfer>> orphans;  // guarded by mutex
  ManagerMetrics metrics;  // guarded by mutex (counters; derived fields filled on read)
  std::vector<TimelineEvent> timeline;  // guarded by mutex
  std::atomic<bool> polling{false};

  Impl(std::shared_ptr<TransferEngine> e, std::shared_ptr<DeviceAllocator> a,
       OffloadManagerOptions o, std::unique_ptr<EvictionPolicy> p)
      : engine(std::move(e)),
        backend(engine->pool().backend_ptr()),
        allocator(std::move(a)),
        options(o),
        policy(std::move(p)),
        origin(backend, /*enable_timing=*/true) {}

  const Stream& d2h() const { return engine->stream(Direction::DeviceToHost); }
  const Stream& h2d() const { return engine->stream(Direction::HostToDevice); }

  Block& find(BlockId id) {  // requires mutex
    auto it = blocks.find(id);
    REVIVA_CHECK_ARG(it != blocks.end(), "unknown block id ", id);
    return *it->second;
  }

  // Waits (releasing the mutex) until no thread is moving the block; returns it.
  Block& wait_idle(std::unique_lock<std::mutex>& lock, BlockId id) {
    for (;;) {
      Block& b = find(id);
      if (!b.busy) return b;
      changed.wait(lock);
    }
  }

  double since_origin_ms(const Event& e) const { return Event::elapsed_ms(origin, e); }
  double host_now_ms() const {
    return std::chrono::duration<double, std::milli>(Clock::now() - origin_host).count();
  }

  void add_timeline(TimelineKind kind, BlockId block, double start, double end,
                    std::size_t bytes) {  // requires mutex
    if (timeline.size() < options.timeline_capacity)
      timeline.push_back({kind, block, start, end, bytes});
    else
      ++metrics.timeline_dropped;
  }

  void note_held() {  // requires mutex
    metrics.peak_device_bytes = std::max(metrics.peak_device_bytes, held);
    REVIVA_ASSERT(held <= budget, "held ", held, " bytes over the budget of ", budget);
  }

  std::string numbers() const {  // requires mutex
    std::size_t pinned = 0;
    for (const auto& [id, b] : blocks)
      if (b->pins > 0) pinned += b->bytes;
    return detail::concat("budget ", budget, " bytes, held ", held, " (", freeing_bytes,
                          " being freed, ", pinned, " in use by compute)");
  }

  // Bookkeeping of a block whose device memory was just freed (eviction or discard): its uses
  // and an unfolded H2D go (the copy still to be counted), and the bytes are on their way out.
  // Requires mutex.
  void left_device(Block& b, Graveyard& trash) {
    for (UseGuard& u : b.last_use) trash.guards.push_back(std::move(u));
    b.last_use.clear();
    if (b.transfer.valid()) orphans.emplace_back(b.id, std::move(b.transfer));  // its H2D
    b.transfer = Transfer();
    b.device = nullptr;
    b.busy = false;
    freeing_bytes += b.bytes;
    changed.notify_all();
  }

  // Whether memory freed now counts as free at once (Note [Stream-ordered frees]): memory the
  // allocator owns (no caller's `release`), from an allocator that reuses it in stream order.
  bool frees_at_once(const std::function<void(StreamHandle)>& release) const {
    return !release && allocator->reuses_in_stream_order();
  }

  // An append block's device allocation when it is brought to the device: its contents (at
  // least one byte), or its capacity when the allocator cannot grow in place.
  std::size_t fetch_bytes(const Block& b) const {
    if (!b.append) return b.bytes;
    return allocator->grows_in_place() ? std::max<std::size_t>(b.valid, 1) : b.capacity;
  }

  // Bytes that left_device() marked as on their way out: free once `guard` completes (poll()),
  // or at once without a guard (Note [Stream-ordered frees]). Requires mutex.
  void count_free(std::size_t bytes, std::shared_ptr<Event> guard) {
    if (guard) {
      freeing.push_back({next_freeing_id++, bytes, std::move(guard)});
      return;
    }
    freeing_bytes -= bytes;
    held -= bytes;
    changed.notify_all();
  }

  // Frees a block's device memory stream-ordered on `stream` (the caller's, or the allocator).
  void free_device(void* ptr, std::size_t bytes, std::function<void(StreamHandle)> release,
                   StreamHandle stream) {
    if (release)
      release(stream);
    else
      allocator->deallocate(ptr, bytes, stream);
  }

  // ---------------------------------------------------------------------------------------------
  // Eviction. `b` was marked busy in state Device with no pins by the caller. Unlocked.
  void evict(BlockId id);  // (offload_manager_room.cpp)

  // Evicts and waits until `bytes` more fit under the limit: the budget, or `lower_budget` while
  // the budget is being lowered. Then, under the same lock, counts the bytes against the budget
  // (or makes `lower_budget` the budget), so that `held <= budget` always holds. Block `self` is
  // never evicted. Without `may_wait`, returns false instead of waiting. Unlocked.
  bool make_room(std::size_t bytes, std::optional<std::size_t> lower_budget, bool may_wait,
                 BlockId self);  // (offload_manager_room.cpp)

  bool reserve(std::size_t bytes, bool may_wait, BlockId self) {
    return make_room(bytes, std::nullopt, may_wait, self);
  }

  // Blocks until some device memory in flight is freed (or a copy lands). Unlocked.
  void wait_for_memory();  // (offload_manager_room.cpp)

  // ---------------------------------------------------------------------------------------------
  // Folding completions into state and metrics (Note at the top: queries run unlocked).
  void poll(bool wait_for_turn);  // (offload_manager_room.cpp)

  // Fresh device memory for busy block `id` (*ptr, set before the copy can fail), and the H2D
  // of its host copy into it. Unlocked.
  // An append block copies its valid prefix (its last fetch_tail bytes, unless `whole`: Note
  // [Fetch tails]), after its last write-through (rule 4).
  Transfer fetch(BlockId id, std::size_t bytes, void** ptr, bool fresh = false,
                 bool whole = false) {
    *ptr = allocate_for(id, bytes, h2d().handle(), fresh);
    const PinnedBlock* host;
    std::size_t copy_bytes;
    std::size_t offset = 0;
    Transfer last_write;
    {
      std::lock_guard<std::mutex> lock(mutex);
      Block& b = find(id);  // stable: the block is busy, only this thread touches it
      host = &b.host;
      copy_bytes = b.append ? b.valid : bytes;
      if (b.append && !whole && b.fetch_tail > 0 && b.valid > b.fetch_tail)
        offset = b.valid - b.fetch_tail;
      copy_bytes -= offset;
      b.device_from = offset;
      last_write = b.last_write;
    }
    const Event* after = last_write.valid() ? &last_write.completion_event() : nullptr;
    return engine->restore(*host, *ptr, copy_bytes, after, offset);
  }

  // `bytes` of device memory for busy block `id` on `stream`: growable up to its capacity for
  // an append block (`fresh`: not memory the allocator keeps for reuse). Unlocked.
  void* allocate_for(BlockId id, std::size_t bytes, StreamHandle stream, bool fresh = false) {
    bool append;
    std::size_t capacity;
    {
      std::lock_guard<std::mutex> lock(mutex);
      const Block& b = find(id);
      append = b.append;
      capacity = b.capacity;
    }
    return append ? allocator->allocate_growable(bytes, capacity, stream, fresh)
                  : allocator->allocate(bytes, stream);
  }

  // Undoes a fetch or allocation that failed part way: gives back the device memory (if any was
  // allocated, stream-ordered on `stream`), the reservation against the budget (if made), and
  // the block's busy mark. Takes the mutex.
  void abandon(BlockId id, void* ptr, std::size_t bytes, bool reserved, StreamHandle stream) {
    if (ptr) allocator->deallocate(ptr, bytes, stream);
    std::lock_guard<std::mutex> lock(mutex);
    if (reserved) held -= bytes;
    find(id).busy = false;
    changed.notify_all();
  }

  // Rule 3: `compute` waits for `copy`, with two timing events around the wait measuring how
  // long it actually stalled. Unlocked.
  void wait_for_copy(BlockId id, const Transfer& copy, const Stream& compute, bool prefetched) {
    auto before = std::make_shared<Event>(backend, true);
    auto after = std::make_shared<Event>(backend, true);
    before->record(compute);
    copy.enqueue_wait(compute);
    after->record(compute);
    std::lock_guard<std::mutex> lock(mutex);
    stalls.push_back({id, std::move(before), std::move(after), prefetched});
  }
};

}  // namespace reviva
