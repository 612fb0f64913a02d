// OffloadManager: block residency under a device budget (see offload_manager.h).
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
//      defers their reuse (Note [Deferred free] in pinned_host_pool.cpp); a block's own host copy
//      is rewritten only by a D2H that is ordered after compute's use of the data an earlier H2D
//      brought in.
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
// Note [Append blocks]
// A K/V layer grows by a token per decode step and is read whole at each step; moving it as a
// fixed block would re-send it whole whenever it changed (what makes HF's offloaded cache slow).
// An append block (register_append_block) is sized by its contents instead:
//   - `bytes` is its device allocation (what grow() asked for; the capacity with an allocator
//     that cannot grow in place), `valid` the prefix that holds contents, `capacity` the most;
//   - its host copy, once it exists (the first write), is always valid: wrote() sends each
//     written range there (a D2H ordered after compute's write, rule 1), so an eviction is
//     always clean (the memory is freed on the D2H stream after that copy: rule 2) and a fetch
//     copies `valid` bytes, after the last write-through has landed in the host copy (rule 4);
//   - a kept block (keep_resident: a layer the plan holds on the device) is never a victim and
//     has no host copy: its writes stay on the device.
// The scheduler drives append blocks like any other: a streamed layer is prefetched ahead of
// its turn in the decode cycle and offloaded (cleanly: freed) once its next use is beyond the
// window, so the budget's room beside the kept layers is the staging room.
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

const char* to_string(BlockState state) noexcept {
  switch (state) {
    case BlockState::Empty: return "Empty";
    case BlockState::Device: return "Device";
    case BlockState::ToHost: return "ToHost";
    case BlockState::Host: return "Host";
    case BlockState::ToDevice: return "ToDevice";
  }
  return "?";
}

const char* to_string(TimelineKind kind) noexcept {
  switch (kind) {
    case TimelineKind::CopyToHost: return "copy_to_host";
    case TimelineKind::CopyToDevice: return "copy_to_device";
    case TimelineKind::ComputeStall: return "compute_stall";
    case TimelineKind::HostWait: return "host_wait";
  }
  return "?";
}

namespace {

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

}  // namespace

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
  void evict(BlockId id) {
    std::vector<UseGuard> uses;
    void* ptr;
    std::size_t bytes;
    bool clean;
    bool need_host;
    bool empty = false;          // an append block with no contents: nothing to keep
    std::size_t copy_bytes = 0;  // the contents (an append block's valid prefix)
    std::size_t host_size = 0;   // a new host copy's size (an append block's capacity)
    std::function<void(StreamHandle)> release;
    {
      std::lock_guard<std::mutex> lock(mutex);
      Block& b = find(id);
      REVIVA_ASSERT(b.busy && b.state == BlockState::Device && b.pins == 0 && !b.keep);
      uses = b.last_use;
      ptr = b.device;
      bytes = b.bytes;
      clean = b.host_valid;
      need_host = !b.host;
      copy_bytes = b.append ? b.valid : b.bytes;
      host_size = b.append ? b.capacity : b.bytes;
      if (!clean && copy_bytes == 0) {
        clean = true;
        empty = true;
      }
      release = std::move(b.release_adopted);
      b.release_adopted = nullptr;
    }
    const bool free_at_once = frees_at_once(release);
    std::shared_ptr<Event> guard;
    Transfer transfer;
    try {
      PinnedBlock* host_slot = nullptr;  // stable while the block is busy: only we touch it
      if (!clean) {
        PinnedBlock fresh;
        if (need_host) fresh = engine->pool().allocate(host_size);
        std::lock_guard<std::mutex> lock(mutex);
        Block& b = find(id);
        if (need_host) b.host = std::move(fresh);
        host_slot = &b.host;
      }
      // Rule 1: the D2H stream is ordered after every use of the block.
      for (const UseGuard& u : uses) d2h().wait(u.point());
      if (!clean) transfer = engine->offload(ptr, *host_slot, copy_bytes);
      // Rule 2: the memory is freed on the D2H stream after the copy (or after the waits).
      free_device(ptr, bytes, std::move(release), d2h().handle());
      release = nullptr;
      if (clean && !free_at_once) {
        guard = std::make_shared<Event>(backend);
        guard->record(d2h());
      }
    } catch (...) {
      Graveyard trash;
      std::lock_guard<std::mutex> lock(mutex);
      Block& b = find(id);
      if (!b.release_adopted) b.release_adopted = std::move(release);
      b.busy = false;
      changed.notify_all();
      throw;
    }
    Graveyard trash;
    std::lock_guard<std::mutex> lock(mutex);
    Block& b = find(id);
    left_device(b, trash);
    ++metrics.evictions;
    if (clean) {
      ++metrics.clean_evictions;
      b.state = empty ? BlockState::Empty : BlockState::Host;
      count_free(bytes, std::move(guard));
    } else {
      b.state = BlockState::ToHost;
      b.transfer = std::move(transfer);  // its bytes are freed when this D2H lands
    }
    policy->on_evict(id);
  }

  // Evicts and waits until `bytes` more fit under the limit: the budget, or `lower_budget` while
  // the budget is being lowered. Then, under the same lock, counts the bytes against the budget
  // (or makes `lower_budget` the budget), so that `held <= budget` always holds. Block `self` is
  // never evicted. Without `may_wait`, returns false instead of waiting. Unlocked.
  bool make_room(std::size_t bytes, std::optional<std::size_t> lower_budget, bool may_wait,
                 BlockId self) {
    for (;;) {
      BlockId victim = kInvalidBlock;
      {
        std::lock_guard<std::mutex> lock(mutex);
        const std::size_t limit = lower_budget.value_or(budget);
        if (bytes > limit)
          throw OutOfMemory(detail::concat("block ", self, " of ", bytes,
                                           " bytes cannot fit the device budget: ", numbers()));
        if (held + bytes <= limit) {
          if (lower_budget) {
            budget = limit;
            metrics.budget_bytes = limit;
          } else {
            held += bytes;
            note_held();
          }
          return true;
        }
        if (held - freeing_bytes + bytes > limit) {
          std::vector<BlockId> candidates;
          for (const auto& [id, b] : blocks)
            if (id != self && b->state == BlockState::Device && b->pins == 0 && !b->busy &&
                !b->keep)
              candidates.push_back(id);
          if (!candidates.empty()) {
            victim = policy->choose_victim(candidates);
            Block& v = find(victim);
            REVIVA_ASSERT(v.state == BlockState::Device && v.pins == 0 && !v.busy,
                          "the policy chose block ", victim, " that cannot be evicted");
            v.busy = true;
          }
        }
        if (victim == kInvalidBlock) {
          bool in_flight = freeing_bytes > 0;
          for (const auto& [id, b] : blocks)
            if (id != self && (b->busy || b->transfer.valid())) in_flight = true;
          if (!in_flight)
            throw OutOfMemory(detail::concat("cannot make room for ", bytes, " bytes (block ", self,
                                             ") within a device budget of ", limit, ": ", numbers(),
                                             "; the rest is in use by compute"));
          if (!may_wait) return false;
        }
      }
      if (victim != kInvalidBlock)
        evict(victim);
      else
        wait_for_memory();
    }
  }

  bool reserve(std::size_t bytes, bool may_wait, BlockId self) {
    return make_room(bytes, std::nullopt, may_wait, self);
  }

  // Blocks until some device memory in flight is freed (or a copy lands). Unlocked.
  void wait_for_memory() {
    std::shared_ptr<Event> guard;
    Transfer transfer;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (!freeing.empty()) guard = freeing.front().guard;
      if (!guard) {  // a D2H landing frees memory; an H2D landing makes a block evictable
        // The oldest D2H (copies run in order on the one D2H stream): waiting for a later one
        // would hold the caller until more memory is free than it needs (a training forward
        // adopting activations behind the copies waited for the newest).
        BlockId oldest = kInvalidBlock;
        for (const auto& [id, b] : blocks)
          if (!b->busy && b->state == BlockState::ToHost && (!transfer.valid() || id < oldest)) {
            transfer = b->transfer;
            oldest = id;
          }
        for (const auto& [id, b] : blocks)
          if (!transfer.valid() && !b->busy && b->transfer.valid()) transfer = b->transfer;
      }
    }
    const double t0 = host_now_ms();
    if (guard) {
      guard->synchronize();
    } else if (transfer.valid()) {
      transfer.wait();
    } else {
      // Another thread is mid-transition: let it finish.
      std::unique_lock<std::mutex> lock(mutex);
      changed.wait_for(lock, std::chrono::milliseconds(1));
    }
    const double t1 = host_now_ms();
    {
      std::lock_guard<std::mutex> lock(mutex);
      metrics.host_wait_ms += t1 - t0;
      add_timeline(TimelineKind::HostWait, kInvalidBlock, t0, t1, 0);
    }
    poll(/*wait_for_turn=*/true);
  }

  // ---------------------------------------------------------------------------------------------
  // Folding completions into state and metrics (Note at the top: queries run unlocked).
  void poll(bool wait_for_turn) {
    while (polling.exchange(true, std::memory_order_acquire)) {
      if (!wait_for_turn) return;
      std::this_thread::yield();
    }
    struct Probe {
      BlockId id;
      Transfer transfer;
      bool done = false;
      double start = 0, end = 0;
    };
    struct FreeProbe {
      std::uint64_t id;
      std::shared_ptr<Event> guard;
      bool done = false;
    };
    struct StallProbe {
      Stall stall;
      bool done = false;
      double ms = 0, start = 0;
    };
    std::vector<Probe> probes;
    std::vector<FreeProbe> frees;
    std::vector<StallProbe> stall_probes;
    Graveyard trash;
    try {
      {
        std::lock_guard<std::mutex> lock(mutex);
        for (const auto& [id, b] : blocks)
          if (!b->busy && b->transfer.valid()) probes.push_back({id, b->transfer});
        for (const auto& [id, t] : orphans) probes.push_back({id, t, false, 0, 0});
        for (const Freeing& f : freeing) frees.push_back({f.id, f.guard});
        for (const Stall& s : stalls) stall_probes.push_back({s});
      }
      for (Probe& p : probes) {
        p.done = p.transfer.ready();
        if (p.done) {
          p.start = since_origin_ms(p.transfer.start_event());
          p.end = since_origin_ms(p.transfer.completion_event());
        }
      }
      for (FreeProbe& f : frees) f.done = f.guard->query();
      for (StallProbe& s : stall_probes) {
        s.done = s.stall.after->query();
        if (s.done) {
          s.ms = Event::elapsed_ms(*s.stall.before, *s.stall.after);
          s.start = since_origin_ms(*s.stall.before);
        }
      }
      std::lock_guard<std::mutex> lock(mutex);
      for (Probe& p : probes) {
        if (!p.done) continue;
        auto orphan = std::find_if(orphans.begin(), orphans.end(),
                                   [&](const auto& o) { return o.second.id() == p.transfer.id(); });
        if (orphan != orphans.end()) {  // only metrics to fold: the block has moved on (or a
                                        // write-through D2H)
          if (p.transfer.direction() == Direction::DeviceToHost) {
            metrics.bytes_to_host += p.transfer.bytes();
            metrics.to_host_busy_ms += p.end - p.start;
            add_timeline(TimelineKind::CopyToHost, p.id, p.start, p.end, p.transfer.bytes());
          } else {
            metrics.bytes_to_device += p.transfer.bytes();
            metrics.to_device_busy_ms += p.end - p.start;
            add_timeline(TimelineKind::CopyToDevice, p.id, p.start, p.end, p.transfer.bytes());
          }
          trash.transfers.push_back(std::move(orphan->second));
          orphans.erase(orphan);
          continue;
        }
        auto it = blocks.find(p.id);
        if (it == blocks.end()) continue;
        Block& b = *it->second;
        if (b.busy || !b.transfer.valid() || b.transfer.id() != p.transfer.id()) continue;
        const bool to_host = p.transfer.direction() == Direction::DeviceToHost;
        if (to_host) {
          REVIVA_ASSERT(b.state == BlockState::ToHost);
          b.state = BlockState::Host;
          b.host_valid = true;
          if (b.drop_on_landing) {  // discarded meanwhile: nothing to keep
            b.drop_on_landing = false;
            b.state = BlockState::Empty;
            b.host_valid = false;
            b.valid = 0;
            trash.blocks.push_back(std::move(b.host));
            b.host = PinnedBlock();
          }
          held -= b.bytes;
          freeing_bytes -= b.bytes;
          metrics.bytes_to_host += p.transfer.bytes();
          metrics.to_host_busy_ms += p.end - p.start;
        } else {
          if (b.state == BlockState::ToDevice) b.state = BlockState::Device;
          metrics.bytes_to_device += p.transfer.bytes();
          metrics.to_device_busy_ms += p.end - p.start;
        }
        add_timeline(to_host ? TimelineKind::CopyToHost : TimelineKind::CopyToDevice, p.id, p.start,
                     p.end, p.transfer.bytes());
        trash.transfers.push_back(std::move(b.transfer));
        b.transfer = Transfer();
      }
      for (FreeProbe& f : frees) {
        if (!f.done) continue;
        auto it = std::find_if(freeing.begin(), freeing.end(),
                               [&](const Freeing& x) { return x.id == f.id; });
        if (it == freeing.end()) continue;
        held -= it->bytes;
        freeing_bytes -= it->bytes;
        trash.events.push_back(std::move(it->guard));
        freeing.erase(it);
      }
      for (StallProbe& s : stall_probes) {
        if (!s.done) continue;
        auto it = std::find_if(stalls.begin(), stalls.end(),
                               [&](const Stall& x) { return x.after == s.stall.after; });
        if (it == stalls.end()) continue;
        metrics.compute_stall_ms += s.ms;
        if (s.stall.prefetched) {
          if (s.ms > kStallThresholdMs)
            ++metrics.prefetch_late;
          else
            ++metrics.prefetch_hits;
        }
        if (s.ms > kStallThresholdMs)
          add_timeline(TimelineKind::ComputeStall, s.stall.block, s.start, s.start + s.ms, 0);
        trash.events.push_back(std::move(it->before));
        trash.events.push_back(std::move(it->after));
        stalls.erase(it);
      }
      changed.notify_all();
    } catch (...) {
      polling.store(false, std::memory_order_release);
      throw;
    }
    polling.store(false, std::memory_order_release);
  }

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

// --- OffloadManager ------------------------------------------------------------------------------

OffloadManager::OffloadManager(std::shared_ptr<TransferEngine> engine,
                               std::shared_ptr<DeviceAllocator> allocator,
                               OffloadManagerOptions options,
                               std::unique_ptr<EvictionPolicy> policy)
    : engine_(std::move(engine)) {
  REVIVA_CHECK_ARG(engine_ != nullptr, "OffloadManager: engine is null");
  REVIVA_CHECK_ARG(allocator != nullptr, "OffloadManager: allocator is null");
  REVIVA_CHECK_ARG(
      options.budget_bytes > 0 || (options.budget_fraction > 0.0 && options.budget_fraction <= 1.0),
      "OffloadManager: budget_fraction must be in (0, 1] when budget_bytes is 0, got ",
      options.budget_fraction);
  if (!policy) policy = make_policy(options.policy);
  impl_ = std::make_unique<Impl>(engine_, std::move(allocator), options, std::move(policy));
  Impl& m = *impl_;
  if (options.budget_bytes > 0) {
    m.budget = options.budget_bytes;
  } else {
    const DeviceMemoryInfo info = m.backend->device_memory_info();
    m.budget =
        static_cast<std::size_t>(static_cast<double>(info.total_bytes) * options.budget_fraction);
  }
  m.metrics.budget_bytes = m.budget;
  m.origin.record(m.d2h());
  m.origin.synchronize();
  m.origin_host = Clock::now();
}

OffloadManager::~OffloadManager() {
  try {
    synchronize();
    std::vector<BlockId> ids = blocks();
    for (BlockId id : ids) {
      Impl& m = *impl_;
      {
        std::lock_guard<std::mutex> lock(m.mutex);
        Impl::Block& b = m.find(id);
        if (b.pins > 0) {
          std::fprintf(stderr,
                       "reviva: warning: ~OffloadManager: block %llu (%s) is still acquired\n",
                       static_cast<unsigned long long>(id), b.name.c_str());
          b.pins = 0;
        }
      }
      unregister(id);
    }
    engine_->synchronize();
    synchronize();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "reviva: warning: ~OffloadManager: %s\n", e.what());
  }
}

BlockId OffloadManager::register_block(std::size_t bytes, std::string name) {
  REVIVA_CHECK_ARG(bytes > 0, "register_block: bytes must be > 0");
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mutex);
  const BlockId id = m.next_id++;
  auto b = std::make_unique<Impl::Block>();
  b->id = id;
  b->bytes = bytes;
  b->capacity = bytes;
  b->name = name.empty() ? "block" + std::to_string(id) : std::move(name);
  m.blocks.emplace(id, std::move(b));
  m.registered += bytes;
  m.metrics.peak_registered_bytes = std::max(m.metrics.peak_registered_bytes, m.registered);
  m.policy->on_register(id, bytes);
  return id;
}

BlockId OffloadManager::adopt(void* device_ptr, std::size_t bytes,
                              std::function<void(StreamHandle)> release, const Stream& producer,
                              std::string name) {
  REVIVA_CHECK_ARG(device_ptr != nullptr, "adopt: device pointer is null");
  REVIVA_CHECK_ARG(release != nullptr, "adopt: a release function is required");
  Impl& m = *impl_;
  const BlockId id = register_block(bytes, std::move(name));
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    m.find(id).busy = true;
  }
  try {
    m.reserve(bytes, /*may_wait=*/true, id);
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(m.mutex);
      m.find(id).busy = false;
    }
    unregister(id);
    throw;
  }
  auto event = std::make_shared<Event>(m.backend);
  event->record(producer);
  std::lock_guard<std::mutex> lock(m.mutex);
  Impl::Block& b = m.find(id);
  b.state = BlockState::Device;
  b.device = device_ptr;
  b.release_adopted = std::move(release);
  b.last_use.push_back(UseGuard{std::move(event), Transfer(), producer.handle()});
  b.busy = false;
  m.changed.notify_all();
  return id;
}

BlockId OffloadManager::register_host_block(PinnedBlock host, std::string name) {
  REVIVA_CHECK_ARG(static_cast<bool>(host), "register_host_block: the host block is empty");
  const BlockId id = register_block(host.size(), std::move(name));
  std::lock_guard<std::mutex> lock(impl_->mutex);
  Impl::Block& b = impl_->find(id);
  b.host = std::move(host);
  b.host_valid = true;
  b.state = BlockState::Host;
  return id;
}

BlockId OffloadManager::register_append_block(std::size_t capacity, std::string name) {
  const BlockId id = register_block(capacity, std::move(name));
  std::lock_guard<std::mutex> lock(impl_->mutex);
  Impl::Block& b = impl_->find(id);
  b.append = true;
  b.bytes = 0;  // no device allocation yet
  return id;
}

void OffloadManager::grow(BlockId id, std::size_t bytes) {
  Impl& m = *impl_;
  void* ptr;
  std::size_t before;
  {
    std::unique_lock<std::mutex> lock(m.mutex);
    Impl::Block& b = m.wait_idle(lock, id);
    REVIVA_CHECK_ARG(b.append, "grow: block ", id, " (", b.name, ") is not an append block");
    REVIVA_CHECK_ARG(b.pins > 0, "grow: block ", id, " (", b.name, ") is not acquired");
    REVIVA_CHECK_ARG(bytes <= b.capacity, "grow: ", bytes, " bytes exceed block ", id, " (", b.name,
                     ")'s capacity of ", b.capacity);
    if (bytes <= b.bytes) return;
    REVIVA_ASSERT(m.allocator->grows_in_place(), "an append block below its capacity");
    b.busy = true;
    ptr = b.device;
    before = b.bytes;
  }
  bool reserved = false;
  try {
    m.reserve(bytes - before, /*may_wait=*/true, id);
    reserved = true;
    if (!m.allocator->grow(ptr, bytes)) {
      std::lock_guard<std::mutex> lock(m.mutex);
      throw OutOfMemory(detail::concat("block ", id, " (", m.find(id).name, ") cannot grow from ",
                                       before, " to ", bytes, " bytes: ", m.allocator->name(),
                                       " has no memory for it (", m.numbers(), ")"));
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(m.mutex);
    if (reserved) m.held -= bytes - before;
    m.find(id).busy = false;
    m.changed.notify_all();
    throw;
  }
  std::lock_guard<std::mutex> lock(m.mutex);
  Impl::Block& b = m.find(id);
  b.bytes = bytes;
  b.busy = false;
  m.changed.notify_all();
}

std::size_t OffloadManager::wrote(BlockId id, std::size_t offset, std::size_t bytes,
                                  const Stream& compute) {
  REVIVA_CHECK_ARG(&compute.backend() == &backend(),
                   "wrote: the stream belongs to another backend");
  Impl& m = *impl_;
  void* device;
  bool need_host;
  bool whole;
  std::size_t capacity;
  {
    std::unique_lock<std::mutex> lock(m.mutex);
    Impl::Block& b = m.wait_idle(lock, id);
    REVIVA_CHECK_ARG(b.append, "wrote: block ", id, " (", b.name, ") is not an append block");
    REVIVA_CHECK_ARG(b.pins > 0, "wrote: block ", id, " (", b.name, ") is not acquired");
    REVIVA_CHECK_ARG(offset <= b.valid, "wrote: bytes from ", offset, " would leave a gap after ",
                     "block ", id, " (", b.name, ")'s ", b.valid, " valid bytes");
    REVIVA_CHECK_ARG(bytes <= b.bytes && offset <= b.bytes - bytes, "wrote: bytes [", offset, ", ",
                     offset + bytes, ") of block ", id, " (", b.name, ") are not backed (", b.bytes,
                     " are): grow() it before compute writes them");
    b.valid = std::max(b.valid, offset + bytes);
    if (bytes == 0 || (b.keep && !b.host)) return 0;  // kept: the writes stay on the device
    b.busy = true;
    device = b.device;
    need_host = !b.host;
    whole = need_host || !b.host_valid;  // a new or stale host copy gets the whole prefix
    capacity = b.capacity;
  }
  std::size_t sent = 0;
  try {
    PinnedBlock fresh;
    if (need_host) {  // the first write: the host copy (the whole valid prefix goes, below)
      const double t0 = m.host_now_ms();
      fresh = m.engine->pool().allocate(capacity);
      std::lock_guard<std::mutex> lock(m.mutex);
      m.metrics.host_copy_alloc_ms += m.host_now_ms() - t0;
    }
    PinnedBlock* host;
    std::size_t first;
    {
      std::lock_guard<std::mutex> lock(m.mutex);
      Impl::Block& b = m.find(id);
      if (need_host) b.host = std::move(fresh);
      host = &b.host;  // stable while busy
      first = whole ? 0 : offset;
      sent = offset + bytes - first;
    }
    Event producer(m.backend);  // rule 1: after compute's write
    producer.record(compute);
    host->record_use(m.engine->stream_ptr(Direction::DeviceToHost));
    Transfer t = m.engine->copy(Direction::DeviceToHost, static_cast<char*>(host->data()) + first,
                                static_cast<const char*>(device) + first, sent, &producer);
    Graveyard trash;
    std::lock_guard<std::mutex> lock(m.mutex);
    Impl::Block& b = m.find(id);
    trash.transfers.push_back(std::move(b.last_write));
    b.last_write = t;
    b.host_valid = true;
    // The D2H reads the device memory: frees after it (rule 2) go on the D2H stream, and an
    // eviction's waits order it; its metrics are folded when it lands.
    m.orphans.emplace_back(id, std::move(t));
    m.metrics.bytes_written_through += sent;
    b.busy = false;
    m.changed.notify_all();
  } catch (...) {
    // The host copy lacks the range now: it is stale (an eviction then copies the valid prefix
    // whole), or, taken for this write, it goes.
    Graveyard trash;
    std::lock_guard<std::mutex> lock(m.mutex);
    Impl::Block& b = m.find(id);
    if (need_host) {
      trash.blocks.push_back(std::move(b.host));
      b.host = PinnedBlock();
    }
    b.host_valid = false;
    b.busy = false;
    m.changed.notify_all();
    throw;
  }
  return sent;
}

bool OffloadManager::keep_resident(BlockId id) {
  Impl& m = *impl_;
  for (;;) {
    Transfer landing;
    bool partial = false;  // on the device from a fetch with a tail: Note [Fetch tails]
    {
      Graveyard trash;
      std::unique_lock<std::mutex> lock(m.mutex);
      Impl::Block& b = m.wait_idle(lock, id);
      REVIVA_CHECK_ARG(b.append, "keep_resident: block ", id, " (", b.name,
                       ") is not an append block");
      if (b.keep) return true;
      if (b.state == BlockState::ToHost) {
        landing = b.transfer;
      } else if ((b.state == BlockState::Device || b.state == BlockState::ToDevice) &&
                 b.device_from > 0) {
        REVIVA_CHECK_ARG(b.pins == 0, "keep_resident: block ", id, " (", b.name, ") is acquired");
        partial = true;  // it leaves first (its host copy is whole) and comes back whole
      } else if (b.state == BlockState::Device || b.state == BlockState::ToDevice ||
                 b.state == BlockState::Empty) {
        // On the device (or nothing yet): the host copy goes once no copy reads or writes it
        // (the pool defers its reuse: rule 4).
        b.keep = true;
        trash.blocks.push_back(std::move(b.host));
        b.host = PinnedBlock();
        b.host_valid = false;
        return true;
      } else {  // Host: fetched below
        b.busy = true;
      }
    }
    if (landing.valid()) {
      landing.wait();
      m.poll(/*wait_for_turn=*/true);
      continue;
    }
    if (partial) {
      engine().synchronize();  // (a fetch in flight lands first)
      m.poll(/*wait_for_turn=*/true);
      offload(id);
      continue;
    }
    std::size_t bytes;
    {
      std::lock_guard<std::mutex> lock(m.mutex);
      bytes = m.fetch_bytes(m.find(id));
    }
    void* ptr = nullptr;
    Transfer copy;
    bool reserved = false;
    try {
      m.reserve(bytes, /*may_wait=*/true, id);
      reserved = true;
      // (not the memory of blocks that move; the whole prefix: it stays, Note [Fetch tails])
      copy = m.fetch(id, bytes, &ptr, /*fresh=*/true, /*whole=*/true);
    } catch (const OutOfMemory&) {
      m.abandon(id, ptr, bytes, reserved, m.h2d().handle());
      return false;
    } catch (...) {
      m.abandon(id, ptr, bytes, reserved, m.h2d().handle());
      throw;
    }
    Graveyard trash;
    std::lock_guard<std::mutex> lock(m.mutex);
    Impl::Block& b = m.find(id);
    b.state = BlockState::ToDevice;
    b.device = ptr;
    b.bytes = bytes;
    b.transfer = copy;
    b.last_use.push_back(UseGuard{nullptr, copy, m.h2d().handle()});
    b.keep = true;
    trash.blocks.push_back(std::move(b.host));  // reused after the H2D that reads it (rule 4)
    b.host = PinnedBlock();
    b.host_valid = false;
    b.busy = false;
    m.changed.notify_all();
    return true;
  }
}

bool OffloadManager::kept(BlockId id) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->find(id).keep;
}

void OffloadManager::truncate(BlockId id, std::size_t bytes) {
  Impl& m = *impl_;
  std::unique_lock<std::mutex> lock(m.mutex);
  Impl::Block& b = m.wait_idle(lock, id);
  REVIVA_CHECK_ARG(b.append, "truncate: block ", id, " (", b.name, ") is not an append block");
  REVIVA_CHECK_ARG(b.pins == 0, "truncate: block ", id, " (", b.name, ") is acquired");
  REVIVA_CHECK_ARG(bytes <= b.valid, "truncate: ", bytes, " bytes exceed block ", id, " (", b.name,
                   ")'s ", b.valid, " valid bytes");
  // A fetch in flight copies the old prefix, of which the kept one is a part; a write-through in
  // flight lands before any later fetch reads its range (rule 4: fetches wait for last_write).
  b.valid = bytes;
}

// Note [Fetch tails]
// A sliding-window layer's query at token p reads the keys of tokens (p - W, p] alone, so a
// streamed such layer needs only the last W tokens of its K/V on the device, not its whole valid
// prefix: with a tail of W tokens' bytes its fetches copy those alone (the bytes a step moves for
// it stop growing with the context), into the same offsets of its device memory (the memory
// before them is backed but holds stale bytes, which the caller promises not to read). The host
// copy stays whole (write-through), so lifting the tail brings everything back at the next fetch;
// a device copy fetched with a tail that no longer covers what is asked leaves the device then.
void OffloadManager::set_fetch_tail(BlockId id, std::size_t bytes) {
  Impl& m = *impl_;
  bool drop = false;
  for (int attempt = 0; attempt < 2; ++attempt) {
    m.poll(/*wait_for_turn=*/false);  // a fetch that has landed is folded first
    std::unique_lock<std::mutex> lock(m.mutex);
    Impl::Block& b = m.wait_idle(lock, id);
    REVIVA_CHECK_ARG(b.append, "set_fetch_tail: block ", id, " (", b.name,
                     ") is not an append block");
    REVIVA_CHECK_ARG(b.pins == 0, "set_fetch_tail: block ", id, " (", b.name, ") is acquired");
    const bool narrower = b.device_from > 0 && (bytes == 0 || bytes > b.fetch_tail);
    if (narrower && b.state == BlockState::ToDevice && attempt == 0) {
      lock.unlock();
      engine().synchronize();  // (rare: the fetch in flight lands, then it can leave)
      continue;
    }
    b.fetch_tail = bytes;
    drop = narrower && b.state == BlockState::Device && !b.keep;
    break;
  }
  if (drop) offload(id);  // (clean: its host copy is whole)
}

std::size_t OffloadManager::valid_bytes(BlockId id) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  const Impl::Block& b = impl_->find(id);
  return b.append ? b.valid : b.bytes;
}

std::size_t OffloadManager::capacity(BlockId id) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->find(id).capacity;
}

std::size_t OffloadManager::host_bytes(BlockId id) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  const Impl::Block& b = impl_->find(id);
  return b.host ? b.host.size() : 0;
}

// Note [Host-side appends]
// A streamed K/V layer whose decode attention runs on the host's cores (Note [Attention on the
// host] in host_attention.cpp) is never fetched again: its readers and its writer are the host.
// Its host copy is then the only copy, read in place (host_rows) once the write-throughs queued
// before have landed (rule 4's wait, by the host thread instead of a fetch), and a decode step's
// new rows go straight into it (host_wrote), which is a memcpy, not a copy on a stream. A block
// with a device copy refuses both writes (the device copy would go stale and a later fetch would
// not know); the caller offloads it first (clean: its host copy is whole).
namespace {
// Waits for the block's last write-through D2H outside the lock.
void wait_transfer(const Transfer& t) {
  if (t.valid()) t.wait();
}
}  // namespace

const void* OffloadManager::host_rows(BlockId id) {
  Impl& m = *impl_;
  Transfer last;
  const void* data;
  {
    std::unique_lock<std::mutex> lock(m.mutex);
    Impl::Block& b = m.wait_idle(lock, id);
    REVIVA_CHECK_ARG(b.append, "host_rows: block ", id, " (", b.name, ") is not an append block");
    REVIVA_CHECK_ARG(b.host && b.host_valid, "host_rows: block ", id, " (", b.name,
                     ") has no valid host copy (kept on the device, or never written)");
    last = b.last_write;
    data = b.host.data();
  }
  wait_transfer(last);
  return data;
}

void OffloadManager::host_wrote(BlockId id, std::size_t offset, const void* src,
                                std::size_t bytes) {
  Impl& m = *impl_;
  m.poll(/*wait_for_turn=*/false);  // (an eviction that has landed leaves the block Host)
  Transfer last;
  char* dst;
  {
    std::unique_lock<std::mutex> lock(m.mutex);
    Impl::Block& b = m.wait_idle(lock, id);
    REVIVA_CHECK_ARG(b.append, "host_wrote: block ", id, " (", b.name, ") is not an append block");
    REVIVA_CHECK_ARG(b.pins == 0 && !b.keep, "host_wrote: block ", id, " (", b.name,
                     ") is acquired or kept on the device");
    REVIVA_CHECK_ARG(b.state == BlockState::Host, "host_wrote: block ", id, " (", b.name, ") is ",
                     to_string(b.state),
                     ", not Host: its device copy would go stale (offload it first)");
    REVIVA_CHECK_ARG(b.host && b.host_valid, "host_wrote: block ", id, " (", b.name,
                     ") has no valid host copy");
    REVIVA_CHECK_ARG(src != nullptr || bytes == 0, "host_wrote: src is null");
    REVIVA_CHECK_ARG(offset <= b.valid, "host_wrote: bytes from ", offset,
                     " would leave a gap after block ", id, " (", b.name, ")'s ", b.valid,
                     " valid bytes");
    REVIVA_CHECK_ARG(bytes <= b.capacity && offset <= b.capacity - bytes, "host_wrote: bytes [",
                     offset, ", ", offset + bytes, ") exceed block ", id, " (", b.name,
                     ")'s capacity of ", b.capacity);
    last = b.last_write;
    dst = static_cast<char*>(b.host.data());
    b.busy = true;  // (no copy may start on it while the host writes)
  }
  try {
    wait_transfer(last);  // a write-through still landing in the same bytes lands first
    if (bytes > 0) std::memcpy(dst + offset, src, bytes);
  } catch (...) {
    std::lock_guard<std::mutex> lock(m.mutex);
    m.find(id).busy = false;
    m.changed.notify_all();
    throw;
  }
  std::lock_guard<std::mutex> lock(m.mutex);
  Impl::Block& b = m.find(id);
  b.valid = std::max(b.valid, offset + bytes);
  b.busy = false;
  m.changed.notify_all();
}

void OffloadManager::unregister(BlockId id) {
  discard(id);
  Impl& m = *impl_;
  Graveyard trash;
  std::unique_lock<std::mutex> lock(m.mutex);
  Impl::Block& b = m.wait_idle(lock, id);
  REVIVA_CHECK_ARG(b.pins == 0, "unregister: block ", id, " (", b.name, ") is acquired ", b.pins,
                   " time(s); release it first");
  if (b.state != BlockState::Empty) {  // a D2H still landing, or another thread's acquire
    Transfer landing = b.transfer;
    lock.unlock();
    if (landing.valid()) {
      landing.wait();
      m.poll(/*wait_for_turn=*/true);
    }
    unregister(id);
    return;
  }
  trash.blocks.push_back(std::move(b.host));
  for (UseGuard& u : b.last_use) trash.guards.push_back(std::move(u));
  m.registered -= b.capacity;
  trash.transfers.push_back(std::move(b.last_write));
  m.policy->on_unregister(id);
  m.blocks.erase(id);
}

void* OffloadManager::acquire(BlockId id, const Stream& compute, Access access) {
  REVIVA_CHECK_ARG(&compute.backend() == &backend(),
                   "acquire: the stream belongs to another backend");
  Impl& m = *impl_;
  m.poll(/*wait_for_turn=*/false);
  for (;;) {
    Transfer wait_on;
    bool prefetched = false;
    Transfer in_flight_d2h;
    {
      std::unique_lock<std::mutex> lock(m.mutex);
      Impl::Block& b = m.wait_idle(lock, id);
      switch (b.state) {
        case BlockState::Device:
        case BlockState::ToDevice: {
          ++b.pins;
          if (b.state == BlockState::ToDevice || b.transfer.valid()) {
            wait_on = b.transfer;  // its H2D may still run
            prefetched = b.prefetched;
          } else if (b.prefetched) {
            ++m.metrics.prefetch_hits;  // landed before it was needed
          }
          b.state = BlockState::Device;
          b.prefetched = false;
          // An append block's copies change by wrote() alone (Note [Append blocks]).
          if (access != Access::ReadOnly && !b.append) b.host_valid = false;
          m.policy->on_access(id);
          void* ptr = b.device;
          lock.unlock();
          if (wait_on.valid()) m.wait_for_copy(id, wait_on, compute, prefetched);
          return ptr;
        }
        case BlockState::ToHost: in_flight_d2h = b.transfer; break;
        case BlockState::Host:
        case BlockState::Empty: b.busy = true; break;
      }
    }
    if (in_flight_d2h.valid()) {
      // The data is on its way out: let it land, then bring it back (or overwrite it).
      const double t0 = m.host_now_ms();
      in_flight_d2h.wait();
      {
        std::lock_guard<std::mutex> lock(m.mutex);
        m.metrics.host_wait_ms += m.host_now_ms() - t0;
      }
      m.poll(/*wait_for_turn=*/true);
      continue;
    }

    // Host or Empty, marked busy: make room, allocate, fetch if the contents are needed.
    BlockState state;
    std::size_t bytes;
    bool append;
    {
      std::lock_guard<std::mutex> lock(m.mutex);
      Impl::Block& b = m.find(id);
      state = b.state;
      bytes = m.fetch_bytes(b);
      append = b.append;
    }
    // An append block's contents are always needed (its writes are appends).
    const bool fetch = state == BlockState::Host && (access != Access::WriteOnly || append);
    void* ptr = nullptr;
    Transfer copy;
    bool reserved = false;
    try {
      m.reserve(bytes, /*may_wait=*/true, id);
      reserved = true;
      if (fetch) {
        copy = m.fetch(id, bytes, &ptr);
      } else {
        ptr = m.allocate_for(id, bytes, compute.handle());
      }
    } catch (...) {
      m.abandon(id, ptr, bytes, reserved, fetch ? m.h2d().handle() : compute.handle());
      throw;
    }
    {
      std::lock_guard<std::mutex> lock(m.mutex);
      Impl::Block& b = m.find(id);
      b.state = BlockState::Device;
      b.device = ptr;
      b.bytes = bytes;
      b.pins = 1;
      b.busy = false;
      b.prefetched = false;
      if (fetch) {
        b.transfer = copy;
        b.last_use.push_back(UseGuard{nullptr, copy, m.h2d().handle()});
        ++m.metrics.prefetch_misses;
      }
      b.host_valid = b.append ? static_cast<bool>(b.host) : fetch && access == Access::ReadOnly;
      m.policy->on_access(id);
      m.changed.notify_all();
    }
    if (fetch) m.wait_for_copy(id, copy, compute, /*prefetched=*/false);
    return ptr;
  }
}

void OffloadManager::release(BlockId id, const Stream& compute) {
  REVIVA_CHECK_ARG(&compute.backend() == &backend(),
                   "release: the stream belongs to another backend");
  Impl& m = *impl_;
  auto event = std::make_shared<Event>(m.backend);
  event->record(compute);
  Graveyard trash;
  std::lock_guard<std::mutex> lock(m.mutex);
  Impl::Block& b = m.find(id);
  REVIVA_CHECK_ARG(b.pins > 0, "release: block ", id, " (", b.name, ") is not acquired");
  // Keep the latest use per stream: an eviction waits for all of them (rule 1).
  auto same = std::find_if(b.last_use.begin(), b.last_use.end(),
                           [&](const UseGuard& u) { return u.stream == compute.handle(); });
  if (same != b.last_use.end()) {
    trash.guards.push_back(std::move(*same));
    *same = UseGuard{std::move(event), Transfer(), compute.handle()};
  } else {
    b.last_use.push_back(UseGuard{std::move(event), Transfer(), compute.handle()});
  }
  --b.pins;
  m.changed.notify_all();
}

void OffloadManager::offload(BlockId id) {
  Impl& m = *impl_;
  m.poll(/*wait_for_turn=*/false);  // an H2D that has landed must be folded before eviction
  {
    std::unique_lock<std::mutex> lock(m.mutex);
    Impl::Block& b = m.wait_idle(lock, id);
    REVIVA_CHECK_ARG(b.pins == 0, "offload: block ", id, " (", b.name, ") is acquired ", b.pins,
                     " time(s); release it first");
    if (b.state != BlockState::Device || b.keep) return;
    b.busy = true;
  }
  m.evict(id);
}

bool OffloadManager::prefetch(BlockId id) {
  Impl& m = *impl_;
  std::size_t bytes;
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    Impl::Block& b = m.find(id);
    if (b.busy) return false;
    if (b.state == BlockState::Device || b.state == BlockState::ToDevice) return true;
    if (b.state != BlockState::Host) return false;
    b.busy = true;
    bytes = m.fetch_bytes(b);
  }
  void* ptr = nullptr;
  Transfer copy;
  bool reserved = false;
  try {
    {
      // Free room only: evicting here could push out a block needed sooner than this one (the
      // scheduler makes room by offloading what is needed late).
      std::lock_guard<std::mutex> lock(m.mutex);
      if (m.held + bytes <= m.budget) {
        m.held += bytes;
        m.note_held();
        reserved = true;
      }
    }
    if (reserved) {
      copy = m.fetch(id, bytes, &ptr);
    }
  } catch (const OutOfMemory&) {
    m.abandon(id, ptr, bytes, reserved, m.h2d().handle());
    std::lock_guard<std::mutex> lock(m.mutex);
    ++m.metrics.prefetches_without_memory;
    return false;  // no memory after all: the access will fetch it on demand
  } catch (...) {
    m.abandon(id, ptr, bytes, reserved, m.h2d().handle());
    throw;
  }
  std::lock_guard<std::mutex> lock(m.mutex);
  Impl::Block& b = m.find(id);
  b.busy = false;
  m.changed.notify_all();
  if (!reserved) return false;
  b.state = BlockState::ToDevice;
  b.device = ptr;
  b.bytes = bytes;
  b.transfer = copy;
  b.prefetched = true;
  b.last_use.push_back(UseGuard{nullptr, copy, m.h2d().handle()});
  ++m.metrics.prefetches;
  return true;
}

void OffloadManager::discard(BlockId id) {
  Impl& m = *impl_;
  for (;;) {
    Transfer in_flight;
    std::vector<UseGuard> uses;
    void* ptr = nullptr;
    std::size_t bytes = 0;
    std::function<void(StreamHandle)> release;
    {
      Graveyard trash;
      std::unique_lock<std::mutex> lock(m.mutex);
      Impl::Block& b = m.wait_idle(lock, id);
      REVIVA_CHECK_ARG(b.pins == 0, "discard: block ", id, " (", b.name, ") is acquired ", b.pins,
                       " time(s); release it first");
      if (b.state == BlockState::ToHost) {
        b.drop_on_landing = true;  // no need to wait: poll() empties it when the copy lands
        return;
      }
      if (b.state == BlockState::ToDevice) {
        in_flight = b.transfer;
      } else if (b.state == BlockState::Device) {
        b.busy = true;
        uses = b.last_use;
        ptr = b.device;
        bytes = b.bytes;
        release = std::move(b.release_adopted);
        b.release_adopted = nullptr;
      } else {  // Host or Empty: only the host copy to drop
        trash.blocks.push_back(std::move(b.host));
        b.host = PinnedBlock();
        b.host_valid = false;
        b.state = BlockState::Empty;
        b.valid = 0;
        trash.transfers.push_back(std::move(b.last_write));
        b.last_write = Transfer();
        return;
      }
    }
    if (in_flight.valid()) {
      in_flight.wait();
      m.poll(/*wait_for_turn=*/true);
      continue;
    }
    // Device: free after every use (rule 2), counted until then (or not: Note [Stream-ordered
    // frees]).
    const bool free_at_once = m.frees_at_once(release);
    std::shared_ptr<Event> guard;
    try {
      for (const UseGuard& u : uses) m.d2h().wait(u.point());
      m.free_device(ptr, bytes, std::move(release), m.d2h().handle());
      if (!free_at_once) {
        guard = std::make_shared<Event>(m.backend);
        guard->record(m.d2h());
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(m.mutex);
      m.find(id).busy = false;
      m.changed.notify_all();
      throw;
    }
    Graveyard trash;
    std::lock_guard<std::mutex> lock(m.mutex);
    Impl::Block& b = m.find(id);
    m.left_device(b, trash);
    trash.blocks.push_back(std::move(b.host));
    b.host = PinnedBlock();
    b.host_valid = false;
    b.state = BlockState::Empty;
    b.valid = 0;
    trash.transfers.push_back(std::move(b.last_write));
    b.last_write = Transfer();
    m.count_free(bytes, std::move(guard));
    return;
  }
}

BlockState OffloadManager::state(BlockId id) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  const Impl::Block& b = impl_->find(id);
  return b.drop_on_landing ? BlockState::Empty : b.state;  // its contents are already gone
}

bool OffloadManager::acquired(BlockId id) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->find(id).pins > 0;
}

std::size_t OffloadManager::bytes(BlockId id) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->find(id).bytes;
}

const std::string& OffloadManager::name(BlockId id) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->find(id).name;
}

std::vector<BlockId> OffloadManager::blocks() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  std::vector<BlockId> ids;
  for (const auto& [id, b] : impl_->blocks) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

std::size_t OffloadManager::budget_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->budget;
}

void OffloadManager::set_budget_bytes(std::size_t bytes) {
  REVIVA_CHECK_ARG(bytes > 0, "set_budget_bytes: the budget must be > 0");
  // Lowering below what is held evicts down to it first.
  impl_->make_room(0, bytes, /*may_wait=*/true, kInvalidBlock);
}

std::size_t OffloadManager::device_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->held;
}

std::size_t OffloadManager::prefetched_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  std::size_t bytes = 0;
  for (const auto& [id, b] : impl_->blocks)
    if (b->prefetched && (b->state == BlockState::ToDevice || b->state == BlockState::Device))
      bytes += b->bytes;
  return bytes;
}

void OffloadManager::end_step() {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->policy->on_step_end();
}

void OffloadManager::synchronize() {
  Impl& m = *impl_;
  engine_->synchronize();
  std::vector<std::shared_ptr<Event>> waits;
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    for (const auto& f : m.freeing) waits.push_back(f.guard);
    for (const auto& s : m.stalls) waits.push_back(s.after);
  }
  for (const auto& e : waits) e->synchronize();
  m.poll(/*wait_for_turn=*/true);
}

void OffloadManager::settle(BlockId id) {
  Impl& m = *impl_;
  for (;;) {
    Transfer in_flight;
    {
      std::unique_lock<std::mutex> lock(m.mutex);
      Impl::Block& b = m.wait_idle(lock, id);
      if (b.state != BlockState::ToDevice && b.state != BlockState::ToHost) return;
      in_flight = b.transfer;
    }
    in_flight.wait();
    m.poll(/*wait_for_turn=*/true);
  }
}

void OffloadManager::poll() { impl_->poll(/*wait_for_turn=*/false); }

ManagerMetrics OffloadManager::metrics() {
  Impl& m = *impl_;
  m.poll(/*wait_for_turn=*/true);
  std::lock_guard<std::mutex> lock(m.mutex);
  ManagerMetrics r = m.metrics;
  r.budget_bytes = m.budget;
  r.device_bytes = m.held;
  r.registered_bytes = m.registered;
  r.device_bytes_saved = m.registered > m.held ? m.registered - m.held : 0;
  const double copy_ms = r.to_host_busy_ms + r.to_device_busy_ms;
  // Host waits are not counted: the GPU may be busy with queued work while the caller waits.
  // Their cost shows in end-to-end time, and host_wait_ms reports them on their own.
  r.overlap_ratio = overlap_ratio(r.compute_stall_ms, copy_ms);
  return r;
}

std::vector<TimelineEvent> OffloadManager::timeline() {
  impl_->poll(/*wait_for_turn=*/true);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->timeline;
}

std::vector<TimelineEvent> OffloadManager::take_timeline() {
  impl_->poll(/*wait_for_turn=*/true);
  std::vector<TimelineEvent> taken;
  std::lock_guard<std::mutex> lock(impl_->mutex);
  taken.swap(impl_->timeline);
  return taken;
}

void OffloadManager::reset_metrics() {
  Impl& m = *impl_;
  m.poll(/*wait_for_turn=*/true);
  std::lock_guard<std::mutex> lock(m.mutex);
  m.metrics = ManagerMetrics{};
  m.metrics.budget_bytes = m.budget;
  m.metrics.peak_device_bytes = m.held;
  m.metrics.peak_registered_bytes = m.registered;
  m.timeline.clear();
}

std::string OffloadManager::policy_name() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->policy->name();
}

void OffloadManager::check_invariants() const {
  const Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mutex);
  std::size_t held = 0, leaving = 0, registered = 0;
  for (const auto& [id, bp] : m.blocks) {
    const Impl::Block& b = *bp;
    REVIVA_ASSERT(b.id == id);
    registered += b.capacity;
    if (b.append) {
      REVIVA_ASSERT(b.valid <= b.capacity && b.bytes <= b.capacity, "append block ", id,
                    " over its capacity");
      REVIVA_ASSERT(!b.keep || !b.host || b.busy, "kept block ", id, " with a host copy");
      // A host copy is kept whole by the writes (stale only after a write-through that failed,
      // while the block is on the device: its eviction then copies the valid prefix).
      if (!b.busy && b.host && b.state == BlockState::Host)
        REVIVA_ASSERT(b.host_valid, "append block ", id, " on the host with a stale host copy");
      if (!b.busy && (b.state == BlockState::Device || b.state == BlockState::ToDevice))
        REVIVA_ASSERT(b.valid <= b.bytes, "append block ", id, " contents beyond its memory");
      if (b.state == BlockState::Empty && !b.drop_on_landing)
        REVIVA_ASSERT(b.valid == 0, "Empty append block ", id, " with contents");
    }
    REVIVA_ASSERT(b.pins >= 0);
    if (b.busy) continue;  // in transition: checked once it settles
    switch (b.state) {
      case BlockState::Empty:
        REVIVA_ASSERT(b.device == nullptr && !b.host_valid && b.pins == 0 && !b.transfer.valid(),
                      "Empty block ", id, " holds memory or a copy");
        break;
      case BlockState::Device:
        REVIVA_ASSERT(b.device != nullptr, "Device block ", id, " without device memory");
        held += b.bytes;
        break;
      case BlockState::ToDevice:
        REVIVA_ASSERT(b.device != nullptr && b.transfer.valid() && b.pins == 0 &&
                      (b.host_valid || b.keep));
        held += b.bytes;
        break;
      case BlockState::ToHost:
        REVIVA_ASSERT(b.device == nullptr && b.transfer.valid() && b.pins == 0 && b.host);
        held += b.bytes;
        leaving += b.bytes;
        break;
      case BlockState::Host:
        REVIVA_ASSERT(b.device == nullptr && b.host && b.host_valid && b.pins == 0, "Host block ",
                      id, " without a valid host copy");
        break;
    }
    if (b.pins > 0) REVIVA_ASSERT(b.state == BlockState::Device);
  }
  for (const auto& f : m.freeing) {
    held += f.bytes;
    leaving += f.bytes;
  }
  REVIVA_ASSERT(registered == m.registered, "registered ", registered, " != ", m.registered);
  bool any_busy = false;
  for (const auto& [id, b] : m.blocks) any_busy = any_busy || b->busy;
  if (!any_busy) {
    REVIVA_ASSERT(held == m.held, "blocks hold ", held, " bytes, the account says ", m.held);
    REVIVA_ASSERT(leaving == m.freeing_bytes, "leaving ", leaving, " != ", m.freeing_bytes);
  }
  REVIVA_ASSERT(m.held <= m.budget, "held ", m.held, " over the budget ", m.budget);
  REVIVA_ASSERT(m.metrics.peak_device_bytes <= std::max(m.budget, m.metrics.budget_bytes));
}

}  // namespace reviva
