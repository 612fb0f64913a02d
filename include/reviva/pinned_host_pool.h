// PinnedHostPool: a caching allocator of page-locked host memory.
//
// Memory is reserved lazily in slabs (never one huge cudaHostAlloc), up to a capacity cap.
// Requests are served best-fit from free blocks, splitting a larger block and coalescing
// neighbours when blocks are freed. A block that copies used goes back to the free list only
// after the events recorded on every stream that used it have completed
// (see Note [Deferred free] in pinned_host_pool_frees.cpp); until then it is "pending".
//
// Thread-safe. No backend call is made while the pool's mutex is held (DESIGN.md, lifetime
// protocol rule 5).
#pragma once

#include <reviva/backend.h>
#include <reviva/export.h>
#include <reviva/stream.h>

#include <cstddef>
#include <cstdint>
#include <memory>

namespace reviva {

struct PinnedHostPoolOptions {
  // Most bytes of pinned memory the pool may reserve (the `host_memory` limit). 0: no cap.
  std::size_t capacity_bytes = 0;
  // Size of one slab; a request larger than a slab gets a slab of its own (rounded up).
  std::size_t slab_bytes = std::size_t{64} << 20;
  // Every block's size and address are multiples of this (a power of two, >= 64).
  std::size_t alignment = 512;
};

struct PinnedHostPoolStats {
  std::size_t bytes_reserved = 0;   // pinned memory held in slabs
  std::size_t bytes_in_use = 0;     // in live blocks (rounded sizes)
  std::size_t bytes_requested = 0;  // in live blocks, as requested
  std::size_t bytes_pending = 0;    // freed, waiting for their streams' events
  std::size_t peak_bytes_in_use = 0;
  std::size_t peak_bytes_reserved = 0;
  std::size_t largest_free_block = 0;
  std::uint64_t allocations = 0;  // successful allocate() calls
  std::uint64_t cache_hits = 0;   // of those, served without reserving a new slab
  std::uint64_t frees = 0;
  std::uint64_t slabs_allocated = 0;  // backend allocations made (ever)
  std::uint64_t slabs_released = 0;   // backend frees made (ever)
  std::size_t slabs = 0;              // slabs held now
  std::size_t free_blocks = 0;
  std::size_t pending_blocks = 0;
  double hit_rate() const noexcept {
    return allocations ? static_cast<double>(cache_hits) / static_cast<double>(allocations) : 0.0;
  }
};

class PinnedHostPool;
namespace detail {
struct PoolBlock;
}

// A live block of pinned memory. Movable, not copyable; returns itself to its pool when
// destroyed or reset(). The pool outlives its blocks (they hold a reference to it).
class REVIVA_API PinnedBlock {
 public:
  PinnedBlock() noexcept = default;
  ~PinnedBlock();
  PinnedBlock(PinnedBlock&& other) noexcept;
  PinnedBlock& operator=(PinnedBlock&& other) noexcept;
  PinnedBlock(const PinnedBlock&) = delete;
  PinnedBlock& operator=(const PinnedBlock&) = delete;

  void* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }  // the bytes asked for
  std::size_t capacity() const noexcept;  // rounded size held (a share: its pool block's)
  explicit operator bool() const noexcept { return block_ != nullptr; }

  // Declares that work on `stream` reads or writes this block. When the block is released, an
  // event is recorded on each such stream and the memory is reused only once all have completed.
  // The pool keeps `stream` alive until then.
  void record_use(std::shared_ptr<const Stream> stream) const;

  // A block over bytes [offset, offset + bytes) of this one's memory that shares its ownership
  // (Note [Shared blocks] in pinned_host_pool.cpp): the memory goes back to the pool when the
  // last of the block and its shares is reset, after every stream any of them recorded. Throws
  // InvalidArgument naming the numbers when the range is not inside the block (bytes > 0).
  PinnedBlock share(std::size_t offset, std::size_t bytes) const;

  // Returns the block to the pool now (deferred as above if streams used it); with shares
  // alive, only drops this one's hold.
  void reset() noexcept;

 private:
  friend class PinnedHostPool;
  PinnedBlock(std::shared_ptr<PinnedHostPool> pool, detail::PoolBlock* block, void* data,
              std::size_t size) noexcept;

  std::shared_ptr<PinnedHostPool> pool_;
  detail::PoolBlock* block_ = nullptr;
  void* data_ = nullptr;
  std::size_t size_ = 0;
};

class REVIVA_API PinnedHostPool : public std::enable_shared_from_this<PinnedHostPool> {
 public:
  static std::shared_ptr<PinnedHostPool> create(std::shared_ptr<Backend> backend,
                                                PinnedHostPoolOptions options = {});
  ~PinnedHostPool();
  PinnedHostPool(const PinnedHostPool&) = delete;
  PinnedHostPool& operator=(const PinnedHostPool&) = delete;

  // A block of at least `bytes` (> 0). Throws OutOfMemory naming the numbers when the capacity
  // cap (or the system) cannot provide it even after waiting for pending frees and releasing
  // cached slabs.
  PinnedBlock allocate(std::size_t bytes);
  // Pins what the free list lacks for `count` blocks of `block_bytes`, slab by slab, so that
  // later allocations of that size are cache hits. Pinning costs ~0.35 ms per MB (measured on
  // the H200 host), and a pinned allocation can synchronize the device: reserve before compute
  // runs, or on another thread while it runs (an allocation meanwhile waits for a slab being
  // pinned that would fit, rather than pin one more: Note [Slabs landing]).
  void reserve(std::size_t count, std::size_t block_bytes);

  // Moves pending blocks whose events have completed to the free list. Called by allocate();
  // callers may call it to make stats current.
  void process_pending();
  // Waits for all pending blocks' events, then processes them.
  void synchronize_pending();
  // Gives back to the backend every slab that is entirely free. Returns the bytes released.
  std::size_t release_cached();

  PinnedHostPoolStats stats() const;
  const PinnedHostPoolOptions& options() const noexcept { return options_; }
  Backend& backend() const noexcept { return *backend_; }
  const std::shared_ptr<Backend>& backend_ptr() const noexcept { return backend_; }
  // True when `ptr` lies inside a slab of this pool.
  bool owns(const void* ptr) const;

  // For tests: checks every internal invariant (free list vs. blocks, coalescing, counters);
  // aborts with a message on the first violation.
  void check_invariants() const;

 private:
  friend class PinnedBlock;
  struct Impl;
  PinnedHostPool(std::shared_ptr<Backend> backend, PinnedHostPoolOptions options);
  void release(detail::PoolBlock* block) noexcept;
  void add_share(detail::PoolBlock* block) noexcept;
  char* pin_slab(std::size_t slab_bytes);
  void add_slab(char* base, std::size_t slab_bytes);
  void record_use(detail::PoolBlock* block, std::shared_ptr<const Stream> stream);
  std::size_t block_capacity(const detail::PoolBlock* block) const noexcept;

  std::shared_ptr<Backend> backend_;
  PinnedHostPoolOptions options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace reviva
