// OffloadManager: block residency under a device budget (see offload_manager.h): a block's
// lifetime (register, adopt, acquire, release, offload, prefetch, discard, unregister). The
// protocol the calls keep is Note [Lifetime protocol] in offload_manager_impl.h; append blocks are
// in append_blocks.cpp, making room in offload_manager_room.cpp, metrics in
// offload_manager_metrics.cpp.
#include "offload_manager_impl.h"

namespace reviva {

const char* to_string(BlockState state) noexcept {
  switch (state) {
    case BlockState::Empty: return "Empty";
    case BlockState::Device: return "Device";
    case BlockState::ToHost: return "ToHost";
    case BlockState::Host: return "Host";
    case BlockState::ToDevice: return "ToDevice";
    case BlockState::Disk: return "Disk";
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
        case BlockState::Disk:
          throw InvalidArgument(
              detail::concat("acquire: block ", id, " (", b.name,
                             ") is on disk (its host copy was detached): ", "attach_host first"));
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
      } else {  // Host, Disk or Empty: only the host copy (if any) to drop
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

}  // namespace reviva
