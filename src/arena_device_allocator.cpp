// ArenaDeviceAllocator (see arena_device_allocator.h). The lifetime protocol here:
//   rule 2: a freed buffer is reused only by a stream that first waits on the event recorded
//           where it was freed, and goes back to the arena only after every stream that used
//           it (ArenaBuffer::record_use at each free);
//   rule 5: the cache and the live map change under `mutex`; events, waits and arena calls are
//           made without it (buffers taken out of the maps first).
//
// Note [Memory held by views]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// buffer_of() lets a caller hold a live allocation's buffer past its free: the binding's tensors
// over a block (WeightStore.acquire, KVStore.view) hold it in their storage's deleter, and a
// numpy array, a DLPack capsule or a storage taken from such a tensor holds that storage, with
// the raw address, for as long as Python keeps it. Such a buffer, freed, must go to no other
// allocation while it is held: the next block's bytes would appear under the old view, and its
// writes would land in them; nor back to the arena, which would unmap memory a view still points
// at. So a cached buffer is taken only when the cache's reference is its last one (use_count() ==
// 1; the count only falls once a buffer is freed, since buffer_of() finds live allocations alone):
// one still held stays cached, and once trimmed it goes back to the arena when its last holder
// drops it (ArenaBuffer's destructor, stream-ordered after the uses recorded at its free). Until
// then it stays mapped and counts against the arena's limit like any mapping, and a later
// allocation that cannot be mapped beside it throws OutOfMemory saying how many bytes such views
// hold. Deciding at the take, not at the free, costs the hot path nothing: a view that dies
// between a block's release and the next allocation (a local of the function that released it)
// leaves its buffer to be reused as before.
#include <reviva/arena_device_allocator.h>
#include <reviva/error.h>
#include <reviva/stream.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace reviva {

struct ArenaDeviceAllocator::Impl {
  struct Cached {
    std::shared_ptr<ArenaBuffer> buffer;
    std::unique_ptr<Event> freed;  // where its last user freed it
  };
  mutable std::mutex mutex;
  std::multimap<std::size_t, Cached> cache;                      // by mapped bytes; mutex
  std::unordered_map<void*, std::shared_ptr<ArenaBuffer>> live;  // guarded by mutex
  ArenaAllocatorStats stats;                                     // guarded by mutex
  std::size_t min_bytes = 0;                                     // guarded by mutex
  // Buffers freed, out of the cache and still held by views (Note [Memory held by views]),
  // for the message of an OutOfMemory; guarded by mutex.
  std::vector<std::weak_ptr<ArenaBuffer>> held;

  // Whether a cached buffer is held by a view besides the cache. Caller holds mutex.
  static bool viewed(const Cached& c) { return c.buffer.use_count() > 1; }

  // Keeps track of `buffer` leaving the allocator if a view still holds it. Caller holds mutex.
  void note_held(const std::shared_ptr<ArenaBuffer>& buffer) {
    if (buffer.use_count() <= 1) return;
    std::erase_if(held, [](const std::weak_ptr<ArenaBuffer>& w) { return w.expired(); });
    held.push_back(buffer);
  }

  // The mapped bytes and number of freed buffers (cached or not) that views still hold. Caller
  // holds mutex.
  std::pair<std::size_t, std::size_t> held_by_views() {
    std::erase_if(held, [](const std::weak_ptr<ArenaBuffer>& w) { return w.expired(); });
    std::size_t bytes = 0, buffers = 0;
    for (const auto& w : held)
      if (auto b = w.lock()) bytes += b->mapped_bytes(), ++buffers;
    for (const auto& [mapped, c] : cache)
      if (viewed(c)) bytes += mapped, ++buffers;
    return {bytes, buffers};
  }
};

ArenaDeviceAllocator::ArenaDeviceAllocator(std::shared_ptr<DeviceArena> arena)
    : arena_(std::move(arena)), impl_(std::make_unique<Impl>()) {
  REVIVA_CHECK_ARG(arena_ != nullptr, "ArenaDeviceAllocator: arena is null");
}

ArenaDeviceAllocator::~ArenaDeviceAllocator() {
  trim();
  // Buffers still handed out go back with their last recorded uses (the manager frees every
  // block before it is destroyed; this is the path of a caller that did not).
  std::unordered_map<void*, std::shared_ptr<ArenaBuffer>> live;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    live.swap(impl_->live);
  }
}

std::string ArenaDeviceAllocator::name() const {
  return "Reviva device arena (" + arena_->backend().name() + ")";
}

void* ArenaDeviceAllocator::allocate(std::size_t bytes, StreamHandle stream) {
  REVIVA_CHECK_ARG(bytes > 0, "ArenaDeviceAllocator::allocate: bytes must be > 0");
  return take(std::max(bytes, min_bytes()), 0, stream, /*fresh=*/false);
}

void ArenaDeviceAllocator::set_min_bytes(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->min_bytes = bytes;
}

std::size_t ArenaDeviceAllocator::min_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->min_bytes;
}

void* ArenaDeviceAllocator::allocate_growable(std::size_t bytes, std::size_t capacity,
                                              StreamHandle stream, bool fresh) {
  REVIVA_CHECK_ARG(bytes > 0 && bytes <= capacity,
                   "ArenaDeviceAllocator::allocate_growable: ", bytes, " bytes of a capacity of ",
                   capacity);
  return take(bytes, capacity, stream, fresh);
}

// A buffer backing `bytes`, whose address space holds `capacity` (0: only `bytes`); `fresh`: a
// new one, never a cached one.
void* ArenaDeviceAllocator::take(std::size_t bytes, std::size_t capacity, StreamHandle stream,
                                 bool fresh) {
  const std::size_t rounded = arena_->round_up(bytes);
  const std::size_t address = std::max(rounded, arena_->round_up(capacity));
  Impl::Cached taken;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    ++impl_->stats.allocations;
    auto chosen = impl_->cache.end();
    // (a buffer a view still holds is the view's: Note [Memory held by views])
    if (capacity == 0) {
      // The smallest cached buffer that holds the request, if not more than twice its size.
      for (auto it = impl_->cache.lower_bound(bytes);
           it != impl_->cache.end() && it->first <= 2 * rounded; ++it) {
        if (!Impl::viewed(it->second)) {
          chosen = it;
          break;
        }
      }
    } else if (!fresh) {
      // A growable request (a K/V layer, which grows into what it was given) takes any cached
      // buffer whose address space holds its capacity: the smallest that holds it, else the
      // largest below it, grown in place below. Mapping a new one instead would leave the
      // cached ones mapped beside it (a prefill that starts each layer small and grows it
      // would map a layer per layer).
      for (auto it = impl_->cache.lower_bound(bytes); it != impl_->cache.end(); ++it) {
        if (it->second.buffer->capacity() >= address && !Impl::viewed(it->second)) {
          chosen = it;
          break;
        }
      }
      for (auto it = impl_->cache.lower_bound(bytes);
           chosen == impl_->cache.end() && it != impl_->cache.begin();) {
        --it;
        if (it->second.buffer->capacity() >= address && !Impl::viewed(it->second)) chosen = it;
      }
    }
    if (chosen != impl_->cache.end()) {
      taken = std::move(chosen->second);
      impl_->cache.erase(chosen);
      impl_->stats.cached_bytes -= taken.buffer->mapped_bytes();
      ++impl_->stats.cache_hits;
    }
  }
  // Backs `taken` (a cached buffer, or a new one when it has none) with `bytes`.
  auto map_taken = [&] {
    if (taken.buffer) {
      // Rule 2: this stream's work after the call comes after the work that freed it.
      arena_->backend().stream_wait_event(stream, taken.freed->handle());
      if (!taken.buffer->try_grow_to(bytes)) {
        trim();
        try {
          taken.buffer->grow_to(bytes);
        } catch (...) {  // back to the cache, unchanged
          std::lock_guard<std::mutex> lock(impl_->mutex);
          impl_->stats.cached_bytes += taken.buffer->mapped_bytes();
          impl_->cache.emplace(taken.buffer->mapped_bytes(), std::move(taken));
          throw;
        }
      }
    } else {
      taken.buffer = arena_->allocate(address, "ArenaDeviceAllocator block");
      if (!taken.buffer->try_grow_to(bytes)) {
        if (!fresh) trim();  // cached memory of other sizes makes room (not for a fresh one)
        taken.buffer->grow_to(bytes);
      }
    }
  };
  try {
    map_taken();
  } catch (const OutOfMemory& e) {
    std::size_t held_bytes = 0, held_buffers = 0;
    {
      std::lock_guard<std::mutex> lock(impl_->mutex);
      std::tie(held_bytes, held_buffers) = impl_->held_by_views();
    }
    if (held_bytes == 0) throw;
    throw OutOfMemory(detail::concat(
        e.what(), "; ", held_bytes, " bytes of that are ", held_buffers,
        " freed block(s) still held by views over them (tensors, numpy arrays, DLPack capsules or "
        "storages taken from a block and kept past its release): drop those views to give the "
        "memory back"));
  }
  void* ptr = taken.buffer->data();
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->stats.live_bytes += taken.buffer->mapped_bytes();
  impl_->stats.peak_bytes =
      std::max(impl_->stats.peak_bytes, impl_->stats.live_bytes + impl_->stats.cached_bytes);
  impl_->live.emplace(ptr, std::move(taken.buffer));
  return ptr;
}

bool ArenaDeviceAllocator::grow(void* ptr, std::size_t bytes) {
  std::shared_ptr<ArenaBuffer> buffer = buffer_of(ptr);
  REVIVA_CHECK_ARG(buffer != nullptr, "ArenaDeviceAllocator::grow: ", ptr,
                   " is not a live allocation of this allocator");
  REVIVA_CHECK_ARG(bytes <= buffer->capacity(), "ArenaDeviceAllocator::grow: ", bytes,
                   " bytes exceed the allocation's capacity of ", buffer->capacity());
  const std::size_t before = buffer->mapped_bytes();
  if (bytes <= before) return true;
  if (!buffer->try_grow_to(bytes)) {
    trim();  // cached memory makes room
    if (!buffer->try_grow_to(bytes)) return false;
  }
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->stats.live_bytes += buffer->mapped_bytes() - before;
  impl_->stats.peak_bytes =
      std::max(impl_->stats.peak_bytes, impl_->stats.live_bytes + impl_->stats.cached_bytes);
  return true;
}

std::shared_ptr<ArenaBuffer> ArenaDeviceAllocator::buffer_of(void* ptr) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  auto it = impl_->live.find(ptr);
  return it == impl_->live.end() ? nullptr : it->second;
}

void ArenaDeviceAllocator::deallocate(void* ptr, std::size_t, StreamHandle stream) noexcept {
  if (!ptr) return;
  try {
    std::shared_ptr<ArenaBuffer> buffer;
    {
      std::lock_guard<std::mutex> lock(impl_->mutex);
      auto it = impl_->live.find(ptr);
      if (it == impl_->live.end()) {
        std::fprintf(stderr, "reviva: warning: ArenaDeviceAllocator: %p was not allocated here\n",
                     ptr);
        return;
      }
      buffer = std::move(it->second);
      impl_->live.erase(it);
      impl_->stats.live_bytes -= buffer->mapped_bytes();
    }
    const Stream on = Stream::wrap(arena_->backend_ptr(), stream);
    buffer->record_use(on);
    if (buffer->capacity() < min_bytes()) {
      // Smaller than any allocation now: no request could take it from the cache, where it
      // would stay mapped beside the buffers that serve them. Back to the arena (unmapped once
      // `stream` passes its last use). (A WeightStore whose slot is lowered offloads its
      // streamed blocks and trims; a block whose free came after the trim stayed cached: a
      // 1-granule buffer beside two of 2, seen in 12 of 120 runs of a core test on a loaded
      // host.)
      std::lock_guard<std::mutex> lock(impl_->mutex);
      impl_->note_held(buffer);
      return;
    }
    auto freed = std::make_unique<Event>(arena_->backend_ptr());
    freed->record(on);
    const std::size_t mapped = buffer->mapped_bytes();
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->stats.cached_bytes += mapped;
    impl_->cache.emplace(mapped, Impl::Cached{std::move(buffer), std::move(freed)});
  } catch (const std::exception& e) {
    // Out of memory for an event: the buffer was dropped above with the uses recorded so far.
    std::fprintf(stderr, "reviva: warning: ArenaDeviceAllocator::deallocate: %s\n", e.what());
  }
}

void ArenaDeviceAllocator::trim() {
  std::multimap<std::size_t, Impl::Cached> cache;  // destroyed after the lock: arena calls
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    if (impl_->cache.empty()) return;
    for (const auto& [mapped, c] : impl_->cache) impl_->note_held(c.buffer);
    cache.swap(impl_->cache);
    impl_->stats.cached_bytes = 0;
    ++impl_->stats.trims;
  }
}

ArenaAllocatorStats ArenaDeviceAllocator::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->stats;
}

}  // namespace reviva
