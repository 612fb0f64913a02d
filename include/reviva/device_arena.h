// DeviceArena: Reviva's own device memory, outside any framework's caching allocator.
//
// Memory comes as ArenaBuffers. A buffer reserves a contiguous range of device address space for
// its capacity when it is made, and is backed by physical memory from its start, mapped in
// granules (2 MiB on current GPUs) as it grows: a layer's K/V grows with its tokens in place (no
// memory for tokens not yet written, no copy when it grows), and memory given back returns to
// the device, where torch's allocator (or anyone) can have it. No cache of freed blocks, so no
// fragmentation decides whether a plan fits: a plan fits when the bytes are there.
//
// Stream order (Note [Lifetime protocol], rule 2): a buffer's memory is unmapped only after every
// stream that used it (record_use) has passed that use. Giving memory back never blocks: the bytes
// are "retiring" until their streams pass, and later calls unmap what has become free; reclaim()
// waits for them when asked (at the end of a generate call, or when a mapping needs the room).
//
// The arena never maps more than its limit (mapped + retiring). When the device itself has no
// memory for a mapping, the arena first waits for its own retiring memory, then calls the
// `reclaim` hook (the binding empties torch's cache of unused blocks there) and tries once more;
// then it throws OutOfMemory naming the numbers, leaving the buffer as it was.
//
// The arena is thread-safe and makes no backend call while holding its mutex (rule 5). A buffer
// is used by one thread at a time; it keeps its arena alive.
#pragma once

#include <reviva/backend.h>
#include <reviva/export.h>
#include <reviva/stream.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace reviva {

struct DeviceArenaOptions {
  // Most bytes mapped at once, retiring ones included. 0: as much as the device gives.
  std::size_t limit_bytes = 0;
  // Called when the device has no memory left for a mapping; frees memory held elsewhere in the
  // process and returns whether it freed any (the mapping is then tried once more). Called
  // without the arena's mutex; it may not call the arena.
  std::function<bool()> reclaim;
};

struct DeviceArenaStats {
  std::size_t granularity = 0;
  std::size_t limit_bytes = 0;     // 0: none
  std::size_t mapped_bytes = 0;    // backing live buffers
  std::size_t retiring_bytes = 0;  // given back, waiting for their streams
  std::size_t peak_bytes = 0;      // most mapped + retiring at once (since reset_peak)
  std::size_t reserved_address_bytes = 0;
  std::size_t buffers = 0;  // live buffers
  std::uint64_t maps = 0;
  std::uint64_t unmaps = 0;
  std::uint64_t failed_maps = 0;  // mappings refused: over the limit, or the device had none
  std::uint64_t reclaim_calls = 0;
  double map_ms = 0.0;    // host time in the backend's map calls (all, since the arena was made)
  double unmap_ms = 0.0;  // the same for unmapping
};

class DeviceArena;

class REVIVA_API ArenaBuffer {
 public:
  ~ArenaBuffer();  // gives its memory and address range back, stream-ordered; never blocks
  ArenaBuffer(const ArenaBuffer&) = delete;
  ArenaBuffer& operator=(const ArenaBuffer&) = delete;

  void* data() const noexcept { return base_; }
  std::size_t capacity() const noexcept { return capacity_; }  // address space reserved
  std::size_t mapped_bytes() const noexcept { return mapped_; }
  const std::string& name() const noexcept { return name_; }

  // Backs at least the first `bytes` with memory (rounded up to the granularity). Throws
  // OutOfMemory naming the numbers when the arena's limit or the device cannot give it (the
  // buffer is then unchanged), InvalidArgument beyond the capacity.
  void grow_to(std::size_t bytes);
  // As grow_to, but returns false instead of throwing OutOfMemory.
  bool try_grow_to(std::size_t bytes);
  // The work queued on `stream` so far may use this buffer: its memory goes back only after it.
  void record_use(const Stream& stream);
  // Gives all its memory back (stream-ordered), keeping the address range for a later grow_to.
  void release_memory();

 private:
  friend class DeviceArena;
  ArenaBuffer(std::shared_ptr<DeviceArena> arena, void* base, std::size_t capacity,
              std::string name);

  std::shared_ptr<DeviceArena> arena_;
  char* base_;
  std::size_t capacity_;
  std::size_t mapped_ = 0;
  std::string name_;
  std::vector<std::pair<void*, std::size_t>> mappings_;  // in order, each one map_memory call
  std::vector<std::pair<StreamHandle, std::unique_ptr<Event>>> uses_;  // latest use per stream
};

class REVIVA_API DeviceArena : public std::enable_shared_from_this<DeviceArena> {
 public:
  // Throws BackendError naming why when the backend has no virtual memory management.
  static std::shared_ptr<DeviceArena> create(std::shared_ptr<Backend> backend,
                                             DeviceArenaOptions options = {});
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  // A buffer with `capacity` bytes of address space (rounded up to the granularity) and no
  // memory yet. `name` appears in messages.
  std::shared_ptr<ArenaBuffer> allocate(std::size_t capacity, std::string name = {});

  std::size_t granularity() const noexcept { return granularity_; }
  std::size_t round_up(std::size_t bytes) const noexcept;
  std::size_t limit_bytes() const;
  // A new limit; it may be below what is mapped now (later mappings then fail until memory
  // goes back).
  void set_limit_bytes(std::size_t bytes);
  void set_reclaim(std::function<bool()> reclaim);

  // Unmaps retiring memory whose streams have passed its last use; with `wait`, waits for all.
  void reclaim(bool wait);
  DeviceArenaStats stats();
  void reset_peak();
  Backend& backend() const noexcept { return *backend_; }
  const std::shared_ptr<Backend>& backend_ptr() const noexcept { return backend_; }

 private:
  friend class ArenaBuffer;
  struct Impl;
  DeviceArena(std::shared_ptr<Backend> backend, DeviceArenaOptions options);
  void map(ArenaBuffer& buffer, std::size_t bytes);  // grows `buffer` by `bytes` (granules)
  // Takes over memory (and, with `address`, the address range) that `uses` may still touch.
  void retire(std::vector<std::pair<void*, std::size_t>> mappings, void* address,
              std::size_t address_bytes,
              std::vector<std::pair<StreamHandle, std::unique_ptr<Event>>> uses) noexcept;

  std::shared_ptr<Backend> backend_;
  std::size_t granularity_ = 0;
  std::unique_ptr<Impl> impl_;
};

}  // namespace reviva
