// DeviceArena (see device_arena.h). How the lifetime protocol applies (Note [Lifetime protocol]
// in offload_manager_impl.h):
//   rule 2: memory given back is unmapped only once the events recorded by record_use() on
//           every stream that used it have completed; until then it is counted as retiring;
//   rule 5: accounting is decided under `mutex`, backend calls (map, unmap, event queries) are
//           made without it; a mapping's bytes are counted before the call and uncounted if it
//           fails, so concurrent mappings can never overshoot the limit together.
#include <reviva/device_arena.h>
#include <reviva/error.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <list>
#include <mutex>

namespace reviva {

namespace {
std::size_t round_up_to(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

struct DeviceArena::Impl {
  struct Retired {
    std::vector<std::pair<void*, std::size_t>> mappings;
    void* address = nullptr;  // the address range too, when the buffer is gone
    std::size_t address_bytes = 0;
    std::vector<std::unique_ptr<Event>> guards;
    std::size_t bytes = 0;  // mapped bytes
    bool taken = false;     // a reclaim is working on it (unlocked)
  };

  DeviceArenaOptions options;
  mutable std::mutex mutex;
  std::function<bool()> reclaim_hook;  // guarded by mutex (copied out before calling)
  std::size_t limit = 0;               // guarded by mutex
  std::size_t mapped = 0;              // guarded by mutex
  std::size_t retiring = 0;            // guarded by mutex
  std::size_t peak = 0;                // guarded by mutex
  std::size_t reserved_address = 0;    // guarded by mutex
  std::size_t buffers = 0;             // guarded by mutex
  std::uint64_t maps = 0;              // guarded by mutex
  std::uint64_t unmaps = 0;            // guarded by mutex
  std::uint64_t failed_maps = 0;       // guarded by mutex
  std::uint64_t reclaim_calls = 0;     // guarded by mutex
  double map_ms = 0.0;                 // guarded by mutex
  double unmap_ms = 0.0;               // guarded by mutex
  std::list<Retired> retired;          // guarded by mutex

  void note_peak() { peak = std::max(peak, mapped + retiring); }  // requires mutex
  std::string numbers() const {                                   // requires mutex
    return detail::concat(mapped, " bytes mapped, ", retiring, " retiring",
                          limit ? detail::concat(", limit ", limit) : std::string());
  }
};

// --- ArenaBuffer -----------------------------------------------------------------------------

ArenaBuffer::ArenaBuffer(std::shared_ptr<DeviceArena> arena, void* base, std::size_t capacity,
                         std::string name)
    : arena_(std::move(arena)),
      base_(static_cast<char*>(base)),
      capacity_(capacity),
      name_(std::move(name)) {}

ArenaBuffer::~ArenaBuffer() {
  arena_->retire(std::move(mappings_), base_, capacity_, std::move(uses_));
}

void ArenaBuffer::grow_to(std::size_t bytes) {
  REVIVA_CHECK_ARG(bytes <= capacity_, "ArenaBuffer '", name_, "': ", bytes,
                   " bytes exceed its capacity of ", capacity_, " bytes");
  if (bytes <= mapped_) return;
  arena_->map(*this, arena_->round_up(bytes) - mapped_);
}

bool ArenaBuffer::try_grow_to(std::size_t bytes) {
  try {
    grow_to(bytes);
    return true;
  } catch (const OutOfMemory&) {
    return false;
  }
}

void ArenaBuffer::record_use(const Stream& stream) {
  REVIVA_CHECK_ARG(&stream.backend() == &arena_->backend() ||
                       stream.backend().kind() == arena_->backend().kind(),
                   "ArenaBuffer::record_use: the stream belongs to another kind of backend");
  for (auto& [handle, event] : uses_) {
    if (handle == stream.handle()) {
      event->record(stream);
      return;
    }
  }
  auto event = std::make_unique<Event>(arena_->backend_ptr());
  event->record(stream);
  uses_.emplace_back(stream.handle(), std::move(event));
}

void ArenaBuffer::release_memory() {
  if (mappings_.empty()) return;
  // The uses go with the memory; a later grow_to starts with none recorded.
  arena_->retire(std::move(mappings_), nullptr, 0, std::move(uses_));
  mappings_.clear();
  uses_.clear();
  mapped_ = 0;
}

// --- DeviceArena -----------------------------------------------------------------------------

std::shared_ptr<DeviceArena> DeviceArena::create(std::shared_ptr<Backend> backend,
                                                 DeviceArenaOptions options) {
  REVIVA_CHECK_ARG(backend != nullptr, "DeviceArena: backend is null");
  return std::shared_ptr<DeviceArena>(new DeviceArena(std::move(backend), std::move(options)));
}

DeviceArena::DeviceArena(std::shared_ptr<Backend> backend, DeviceArenaOptions options)
    : backend_(std::move(backend)), impl_(std::make_unique<Impl>()) {
  granularity_ = backend_->vmm_granularity();
  if (granularity_ == 0)
    throw BackendError(detail::concat("DeviceArena: ", backend_->name(),
                                      " cannot map memory into reserved address ranges (no "
                                      "virtual memory management)"));
  impl_->limit = options.limit_bytes;
  impl_->reclaim_hook = options.reclaim;
  impl_->options = std::move(options);
}

DeviceArena::~DeviceArena() {
  // Buffers keep the arena alive, so only retired memory is left: wait for its streams.
  try {
    reclaim(/*wait=*/true);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "reviva: warning: DeviceArena destroyed while reclaiming: %s\n", e.what());
  }
}

std::size_t DeviceArena::round_up(std::size_t bytes) const noexcept {
  return round_up_to(bytes, granularity_);
}

std::shared_ptr<ArenaBuffer> DeviceArena::allocate(std::size_t capacity, std::string name) {
  REVIVA_CHECK_ARG(capacity > 0, "DeviceArena::allocate: capacity must be > 0 bytes ('", name,
                   "')");
  REVIVA_CHECK_ARG(capacity <= (std::size_t{1} << 48), "DeviceArena::allocate: capacity of ",
                   capacity, " bytes ('", name, "') exceeds any device's address space");
  const std::size_t bytes = round_up(capacity);
  void* base = backend_->reserve_address(bytes);
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->reserved_address += bytes;
    ++impl_->buffers;
  }
  return std::shared_ptr<ArenaBuffer>(
      new ArenaBuffer(shared_from_this(), base, bytes, std::move(name)));
}

std::size_t DeviceArena::limit_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->limit;
}

void DeviceArena::set_limit_bytes(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->limit = bytes;
}

void DeviceArena::set_reclaim(std::function<bool()> reclaim) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->reclaim_hook = std::move(reclaim);
}

void DeviceArena::map(ArenaBuffer& buffer, std::size_t bytes) {
  Impl& m = *impl_;
  // Count the bytes first (under the limit), so that no other mapping can take them meanwhile.
  for (bool waited = false;;) {
    bool fits;
    bool any_retiring;
    {
      std::lock_guard<std::mutex> lock(m.mutex);
      fits = m.limit == 0 || m.mapped + m.retiring + bytes <= m.limit;
      any_retiring = m.retiring > 0;
      if (fits) {
        m.mapped += bytes;
        m.note_peak();
      } else if (!any_retiring || waited) {
        ++m.failed_maps;
        throw OutOfMemory(detail::concat("device arena: cannot map ", bytes, " more bytes for '",
                                         buffer.name(), "' within its limit: ", m.numbers()));
      }
    }
    if (fits) break;
    reclaim(/*wait=*/waited = true);  // retiring memory counts against the limit: wait for it
  }
  char* at = buffer.base_ + buffer.mapped_;
  bool tried_retiring = false, tried_hook = false;
  for (;;) {
    try {
      const auto t0 = std::chrono::steady_clock::now();
      backend_->map_memory(at, bytes);
      const double ms = ms_since(t0);
      std::lock_guard<std::mutex> lock(m.mutex);
      m.map_ms += ms;
      break;
    } catch (const OutOfMemory& e) {
      // The device has no memory: our own retiring memory first, then whatever the hook frees.
      bool retry = false;
      std::function<bool()> hook;
      {
        std::lock_guard<std::mutex> lock(m.mutex);
        if (!tried_retiring && m.retiring > 0) {
          retry = tried_retiring = true;
        } else if (!tried_hook && m.reclaim_hook) {
          hook = m.reclaim_hook;
          tried_hook = true;
          ++m.reclaim_calls;
        }
      }
      if (retry) {
        reclaim(/*wait=*/true);
        continue;
      }
      if (hook) {
        bool freed = false;
        try {
          freed = hook();
        } catch (const std::exception& hook_error) {
          std::fprintf(stderr, "reviva: warning: device arena reclaim hook failed: %s\n",
                       hook_error.what());
        }
        if (freed) continue;
      }
      std::lock_guard<std::mutex> lock(m.mutex);
      m.mapped -= bytes;
      ++m.failed_maps;
      throw OutOfMemory(detail::concat(e.what(), "; device arena: ", bytes, " bytes for '",
                                       buffer.name(), "', ", m.numbers()));
    } catch (...) {
      std::lock_guard<std::mutex> lock(m.mutex);
      m.mapped -= bytes;
      ++m.failed_maps;
      throw;
    }
  }
  buffer.mappings_.emplace_back(at, bytes);
  buffer.mapped_ += bytes;
  std::lock_guard<std::mutex> lock(m.mutex);
  ++m.maps;
}

void DeviceArena::retire(
    std::vector<std::pair<void*, std::size_t>> mappings, void* address, std::size_t address_bytes,
    std::vector<std::pair<StreamHandle, std::unique_ptr<Event>>> uses) noexcept {
  try {
    Impl::Retired r;
    for (const auto& [ptr, bytes] : mappings) r.bytes += bytes;
    r.mappings = std::move(mappings);
    r.address = address;
    r.address_bytes = address_bytes;
    for (auto& [handle, event] : uses) r.guards.push_back(std::move(event));
    {
      std::lock_guard<std::mutex> lock(impl_->mutex);
      impl_->mapped -= r.bytes;
      impl_->retiring += r.bytes;
      if (address) --impl_->buffers;
      impl_->retired.push_back(std::move(r));
    }
    reclaim(/*wait=*/false);
  } catch (const std::exception& e) {
    // Only an allocation can fail here; the memory is then kept (leaked) rather than freed
    // under work that may still use it.
    std::fprintf(stderr, "reviva: warning: device arena could not retire memory: %s\n", e.what());
  }
}

void DeviceArena::reclaim(bool wait) {
  Impl& m = *impl_;
  std::vector<std::list<Impl::Retired>::iterator> work;
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    for (auto it = m.retired.begin(); it != m.retired.end(); ++it)
      if (!it->taken) {
        it->taken = true;
        work.push_back(it);
      }
  }
  for (auto it : work) {
    bool done = true;  // iterators of a std::list stay valid while other entries come and go
    for (const auto& guard : it->guards) {
      if (wait) guard->synchronize();
      if (!guard->query()) {
        done = false;
        break;
      }
    }
    double ms = 0.0;
    if (done) {
      const auto t0 = std::chrono::steady_clock::now();
      for (const auto& [ptr, bytes] : it->mappings) backend_->unmap_memory(ptr, bytes);
      if (it->address) backend_->release_address(it->address, it->address_bytes);
      ms = ms_since(t0);
    }
    std::vector<std::unique_ptr<Event>> dead;  // destroyed without the mutex (backend calls)
    std::lock_guard<std::mutex> lock(m.mutex);
    if (!done) {
      it->taken = false;
      continue;
    }
    m.retiring -= it->bytes;
    m.unmaps += it->mappings.size();
    m.unmap_ms += ms;
    if (it->address) m.reserved_address -= it->address_bytes;
    dead = std::move(it->guards);
    m.retired.erase(it);
  }
}

DeviceArenaStats DeviceArena::stats() {
  reclaim(/*wait=*/false);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  const Impl& m = *impl_;
  DeviceArenaStats s;
  s.granularity = granularity_;
  s.limit_bytes = m.limit;
  s.mapped_bytes = m.mapped;
  s.retiring_bytes = m.retiring;
  s.peak_bytes = m.peak;
  s.reserved_address_bytes = m.reserved_address;
  s.buffers = m.buffers;
  s.maps = m.maps;
  s.unmaps = m.unmaps;
  s.failed_maps = m.failed_maps;
  s.reclaim_calls = m.reclaim_calls;
  s.map_ms = m.map_ms;
  s.unmap_ms = m.unmap_ms;
  return s;
}

void DeviceArena::reset_peak() {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->peak = impl_->mapped + impl_->retiring;
}

}  // namespace reviva
