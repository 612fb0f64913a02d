// ArenaDeviceAllocator: a DeviceAllocator on the core's DeviceArena, so that the OffloadManager's
// blocks live in Reviva's own device memory (outside torch's allocator), reused in stream order.
//
// A freed buffer stays mapped in a cache. A later allocation that it fits (its mapped size at
// least the request, and at most twice the request rounded to the arena's granularity) takes
// it: the allocating stream first waits on the event recorded where it was freed, on the device,
// with no host wait (DeviceAllocator's stream-ordered contract). Without a fitting buffer a new
// one is mapped; when the arena or the device has no memory for it, the cache is given back
// first and the mapping tried once more. trim() gives the whole cache back (each buffer after the
// streams that used it, Note [Lifetime protocol] rule 2). Thread-safe; no backend call is made
// while the mutex is held.
//
// Why a cache over the arena rather than the arena alone: mapping and unmapping physical memory
// are driver calls of tens of microseconds to milliseconds, and unmapping must wait for the
// memory's last use; blocks that come and go every layer (streamed K/V, saved activations) need
// memory that is reused at stream speed.
#pragma once

#include <reviva/device_allocator.h>
#include <reviva/device_arena.h>
#include <reviva/export.h>

#include <cstddef>
#include <memory>
#include <string>

namespace reviva {

struct ArenaAllocatorStats {
  std::size_t live_bytes = 0;    // mapped bytes of buffers handed out
  std::size_t cached_bytes = 0;  // mapped bytes of freed buffers kept for reuse
  std::uint64_t allocations = 0;
  std::uint64_t cache_hits = 0;  // allocations served from the cache
  std::uint64_t trims = 0;       // times the cache was given back (asked, or to make room)
  std::size_t peak_bytes = 0;    // most live + cached bytes at once
};

class REVIVA_API ArenaDeviceAllocator final : public DeviceAllocator {
 public:
  explicit ArenaDeviceAllocator(std::shared_ptr<DeviceArena> arena);
  ~ArenaDeviceAllocator() override;
  ArenaDeviceAllocator(const ArenaDeviceAllocator&) = delete;
  ArenaDeviceAllocator& operator=(const ArenaDeviceAllocator&) = delete;

  void* allocate(std::size_t bytes, StreamHandle stream) override;
  void deallocate(void* ptr, std::size_t bytes, StreamHandle stream) noexcept override;
  std::string name() const override;
  // A cached buffer is taken only after the allocating stream waits for its free (rule 2).
  bool reuses_in_stream_order() const noexcept override { return true; }
  // Growable allocations reserve the capacity's address space and map what is asked; a cached
  // buffer is taken for one when its address space holds the capacity.
  bool grows_in_place() const noexcept override { return true; }
  void* allocate_growable(std::size_t bytes, std::size_t capacity, StreamHandle stream,
                          bool fresh = false) override;
  bool grow(void* ptr, std::size_t bytes) override;
  // The buffer behind a live allocation (null when `ptr` is not one): holding it keeps the memory
  // mapped after deallocate, e.g. while a view of it lives, and keeps it from the next allocation
  // (a buffer freed while held is never cached: Note [Memory held by views] in the .cpp).
  std::shared_ptr<ArenaBuffer> buffer_of(void* ptr) const;

  // Allocations (not growable ones) of fewer bytes map this many from now on (0: each its own
  // size). Blocks of different sizes used in turn (a decoder layer's attention, then its MLP's
  // projections) then leave buffers of one size in the cache, each of which serves the next
  // allocation: a smaller buffer cached could not serve a larger request, and a new one would be
  // mapped beside it. A buffer freed later whose address space is smaller than the minimum
  // (allocated before it was raised) goes back to the arena at its free instead of the cache:
  // no allocation could take it again.
  void set_min_bytes(std::size_t bytes);
  std::size_t min_bytes() const;
  // Gives every cached buffer back to the arena (unmapped once its streams pass).
  void trim();
  ArenaAllocatorStats stats() const;
  DeviceArena& arena() const noexcept { return *arena_; }

 private:
  struct Impl;
  void* take(std::size_t bytes, std::size_t capacity, StreamHandle stream, bool fresh);
  std::shared_ptr<DeviceArena> arena_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace reviva
