// PinnedHostPool::Impl: the pool's state (its slabs, the free list, the pending frees) and the
// steps on it that need the mutex, shared by the files that implement the pool:
// pinned_host_pool.cpp (PinnedBlock; slabs, allocation, statistics and invariants: Notes [Slabs
// landing], [No backend call under the mutex], [Shared blocks]) and pinned_host_pool_frees.cpp
// (a block's uses and its release, deferred until its copies are done: Note [Deferred free]).
// Private to the library (not installed).
#pragma once

#include <reviva/pinned_host_pool.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <vector>

namespace reviva {

namespace detail {

struct PoolSlab;

struct PoolBlock {
  PoolSlab* slab = nullptr;
  std::size_t offset = 0;     // from the slab's base
  std::size_t size = 0;       // rounded, a multiple of the pool's alignment
  std::size_t requested = 0;  // bytes asked for (live blocks)
  bool free = true;           // in the free list (false: live or pending)
  int holders = 0;            // live PinnedBlocks over it: the block and its shares
  PoolBlock* prev = nullptr;  // address-order neighbours inside the slab
  PoolBlock* next = nullptr;
  std::vector<std::shared_ptr<const Stream>> uses;  // streams that used it since allocation
};

struct PoolSlab {
  char* base = nullptr;
  std::size_t size = 0;
  PoolBlock* first = nullptr;
};

inline char* block_data(const PoolBlock* b) { return b->slab->base + b->offset; }

struct BySizeThenAddress {
  bool operator()(const PoolBlock* a, const PoolBlock* b) const {
    if (a->size != b->size) return a->size < b->size;
    return block_data(a) < block_data(b);
  }
};

struct PendingFree {
  PoolBlock* block;
  std::vector<Event> events;  // one per stream that used the block
};

}  // namespace detail

using detail::block_data;
using detail::BySizeThenAddress;
using detail::PendingFree;
using detail::PoolBlock;
using detail::PoolSlab;

struct PinnedHostPool::Impl {
  mutable std::mutex mutex;
  std::set<PoolBlock*, BySizeThenAddress> free_blocks;     // guarded by mutex
  std::map<const char*, std::unique_ptr<PoolSlab>> slabs;  // guarded by mutex; by base address
  std::vector<PendingFree> pending;                        // guarded by mutex
  std::vector<Event> idle_events;                          // guarded by mutex
  std::atomic<std::size_t> pending_count{0};               // mirrors pending.size() + in-check
  PinnedHostPoolStats stats;                               // guarded by mutex (counters)
  // Sizes of slabs being pinned now (Note [Slabs landing]).
  std::multiset<std::size_t> landing;  // guarded by mutex
  std::condition_variable landed;      // a slab of `landing` arrived (or failed)

  // Best fit: the smallest free block of at least `size`, split if larger. nullptr if none.
  // Requires mutex.
  PoolBlock* take_best_fit(std::size_t size) {
    PoolSlab probe_slab;
    PoolBlock probe;
    probe.slab = &probe_slab;
    probe.size = size;
    auto it = free_blocks.lower_bound(&probe);
    if (it == free_blocks.end()) return nullptr;
    PoolBlock* b = *it;
    free_blocks.erase(it);
    b->free = false;
    if (b->size > size) {
      auto* rest = new PoolBlock;
      rest->slab = b->slab;
      rest->offset = b->offset + size;
      rest->size = b->size - size;
      rest->prev = b;
      rest->next = b->next;
      if (b->next) b->next->prev = rest;
      b->next = rest;
      b->size = size;
      free_blocks.insert(rest);
    }
    return b;
  }

  // Returns `b` to the free list, merging it with free neighbours. Requires mutex.
  void insert_free(PoolBlock* b) {
    b->free = true;
    b->requested = 0;
    if (PoolBlock* p = b->prev; p && p->free) {
      free_blocks.erase(p);
      p->size += b->size;
      p->next = b->next;
      if (b->next) b->next->prev = p;
      delete b;
      b = p;
    }
    if (PoolBlock* n = b->next; n && n->free) {
      free_blocks.erase(n);
      b->size += n->size;
      b->next = n->next;
      if (n->next) n->next->prev = b;
      delete n;
    }
    free_blocks.insert(b);
  }

  // A pending block whose streams are done: back to the free list, its events kept for reuse.
  // Requires mutex.
  void finish_pending(PendingFree& p) {
    stats.bytes_pending -= p.block->size;
    pending_count.fetch_sub(1);
    insert_free(p.block);
    for (Event& e : p.events) idle_events.push_back(std::move(e));
  }

  void note_allocated(PoolBlock* b, std::size_t requested, bool hit) {
    b->requested = requested;
    b->holders = 1;
    stats.bytes_in_use += b->size;
    stats.bytes_requested += requested;
    stats.peak_bytes_in_use = std::max(stats.peak_bytes_in_use, stats.bytes_in_use);
    ++stats.allocations;
    if (hit) ++stats.cache_hits;
  }
};

}  // namespace reviva
