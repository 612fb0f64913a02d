// OffloadManager::Impl's making of room: eviction (rules 1 and 2 of Note [Lifetime protocol] in
// offload_manager_impl.h), waiting until bytes fit under the budget, waiting for memory in flight,
// and folding completed copies, frees and stalls into the blocks' state and the metrics.
#include "offload_manager_impl.h"

namespace reviva {

// ---------------------------------------------------------------------------------------------
// Eviction. `b` was marked busy in state Device with no pins by the caller. Unlocked.
void OffloadManager::Impl::evict(BlockId id) {
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
bool OffloadManager::Impl::make_room(std::size_t bytes, std::optional<std::size_t> lower_budget,
                                     bool may_wait, BlockId self) {
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
          if (id != self && b->state == BlockState::Device && b->pins == 0 && !b->busy && !b->keep)
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

// Blocks until some device memory in flight is freed (or a copy lands). Unlocked.
void OffloadManager::Impl::wait_for_memory() {
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
void OffloadManager::Impl::poll(bool wait_for_turn) {
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

}  // namespace reviva
