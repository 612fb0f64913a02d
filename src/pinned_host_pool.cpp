// PinnedHostPool: slabs of pinned memory carved into blocks, best fit with splitting and
// coalescing; the deferred reuse of blocks that copies touched (Note [Deferred free]) is
// pinned_host_pool_frees.cpp's, the state both share pinned_host_pool_impl.h's.
//
// Note [Slabs landing]
// reserve() may pin slabs on one thread while another allocates (a generate call pins its host
// copies ahead on a helper thread while prefill runs). An allocation that finds no free block
// but sees a slab that would fit being pinned waits for it instead of pinning one more, so that
// the two together pin what was asked once, not twice.
//
// Note [No backend call under the mutex]
// Recording and querying events, and reserving or returning slabs, are backend calls (CUDA calls
// on a GPU) and may take long or block; they are made with the pool's mutex released (rule 5).
// A slab being reserved is counted in bytes_reserved before the call, so that two threads cannot
// together overshoot the capacity cap.
#include "pinned_host_pool_impl.h"

#include <reviva/error.h>
#include <reviva/pinned_host_pool.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <mutex>
#include <utility>
#include <vector>

namespace reviva {

namespace {

// The host's physical memory in bytes (0 where the system does not say).
std::size_t host_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page)
                               : 0;
}

constexpr std::size_t kSlabGranularity = std::size_t{2} << 20;

std::size_t round_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }

}  // namespace

// --- PinnedBlock -----------------------------------------------------------------------------

PinnedBlock::PinnedBlock(std::shared_ptr<PinnedHostPool> pool, PoolBlock* block, void* data,
                         std::size_t size) noexcept
    : pool_(std::move(pool)), block_(block), data_(data), size_(size) {}

PinnedBlock::~PinnedBlock() { reset(); }

PinnedBlock::PinnedBlock(PinnedBlock&& other) noexcept
    : pool_(std::move(other.pool_)),
      block_(std::exchange(other.block_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

PinnedBlock& PinnedBlock::operator=(PinnedBlock&& other) noexcept {
  if (this != &other) {
    reset();
    pool_ = std::move(other.pool_);
    block_ = std::exchange(other.block_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

std::size_t PinnedBlock::capacity() const noexcept {
  return block_ ? pool_->block_capacity(block_) : 0;
}

void PinnedBlock::record_use(std::shared_ptr<const Stream> stream) const {
  REVIVA_CHECK_ARG(block_ != nullptr, "PinnedBlock::record_use on an empty block");
  REVIVA_CHECK_ARG(stream != nullptr, "PinnedBlock::record_use: stream is null");
  REVIVA_CHECK_ARG(&stream->backend() == &pool_->backend(),
                   "PinnedBlock::record_use: the stream belongs to another backend");
  pool_->record_use(block_, std::move(stream));
}

// Note [Shared blocks]
// A share is a PinnedBlock over part of another's memory (a streamed layer's experts, each a
// range of the layer's block: Note [Blocks within a block] in weight_store.cpp). Each PinnedBlock
// over a pool block counts as one of its holders; release() returns the memory only when the last
// holder goes, and the streams that any of them recorded (record_use goes to the pool block)
// are waited for as for one block (Note [Deferred free]).
PinnedBlock PinnedBlock::share(std::size_t offset, std::size_t bytes) const {
  REVIVA_CHECK_ARG(block_ != nullptr, "PinnedBlock::share on an empty block");
  REVIVA_CHECK_ARG(bytes > 0 && offset <= size_ && bytes <= size_ - offset,
                   "PinnedBlock::share: ", bytes, " bytes from offset ", offset,
                   " are not inside the block's ", size_, " bytes");
  pool_->add_share(block_);
  return PinnedBlock(pool_, block_, static_cast<char*>(data_) + offset, bytes);
}

void PinnedBlock::reset() noexcept {
  if (block_) pool_->release(block_);
  block_ = nullptr;
  data_ = nullptr;
  size_ = 0;
  pool_.reset();
}

// --- PinnedHostPool --------------------------------------------------------------------------

std::shared_ptr<PinnedHostPool> PinnedHostPool::create(std::shared_ptr<Backend> backend,
                                                       PinnedHostPoolOptions options) {
  REVIVA_CHECK_ARG(backend != nullptr, "PinnedHostPool: backend is null");
  REVIVA_CHECK_ARG(options.alignment >= 64 && (options.alignment & (options.alignment - 1)) == 0,
                   "PinnedHostPoolOptions.alignment must be a power of two >= 64, got ",
                   options.alignment);
  REVIVA_CHECK_ARG(options.slab_bytes > 0, "PinnedHostPoolOptions.slab_bytes must be > 0");
  options.slab_bytes = round_up(options.slab_bytes, options.alignment);
  return std::shared_ptr<PinnedHostPool>(new PinnedHostPool(std::move(backend), options));
}

PinnedHostPool::PinnedHostPool(std::shared_ptr<Backend> backend, PinnedHostPoolOptions options)
    : backend_(std::move(backend)), options_(options), impl_(std::make_unique<Impl>()) {}

PinnedHostPool::~PinnedHostPool() {
  // Blocks hold the pool alive, so none is live here; pending ones wait for their copies.
  try {
    synchronize_pending();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "reviva: warning: PinnedHostPool: waiting for pending frees: %s\n",
                 e.what());
  }
  std::vector<char*> bases;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    for (auto& [base, slab] : impl_->slabs) {
      for (PoolBlock* b = slab->first; b;) {
        PoolBlock* next = b->next;
        delete b;
        b = next;
      }
      bases.push_back(slab->base);
    }
    impl_->slabs.clear();
    impl_->free_blocks.clear();
    impl_->idle_events.clear();
  }
  for (char* base : bases) backend_->free_pinned_host(base);
}

std::size_t PinnedHostPool::block_capacity(const PoolBlock* block) const noexcept {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return block->size;
}

// Pins a slab whose bytes the caller counted in bytes_reserved and `landing`; on failure uncounts
// them. Either way the slab leaves `landing`: add_slab() (under the mutex) or here.
char* PinnedHostPool::pin_slab(std::size_t slab_bytes) {
  try {
    return static_cast<char*>(backend_->allocate_pinned_host(slab_bytes));
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(impl_->mutex);
      impl_->stats.bytes_reserved -= slab_bytes;
      impl_->landing.erase(impl_->landing.find(slab_bytes));
    }
    impl_->landed.notify_all();
    throw;
  }
}

// A pinned slab joins the pool as one free block. Requires mutex.
void PinnedHostPool::add_slab(char* base, std::size_t slab_bytes) {
  auto slab = std::make_unique<PoolSlab>();
  slab->base = base;
  slab->size = slab_bytes;
  auto* whole = new PoolBlock;
  whole->slab = slab.get();
  whole->size = slab_bytes;
  whole->free = false;
  slab->first = whole;
  impl_->slabs.emplace(base, std::move(slab));
  ++impl_->stats.slabs_allocated;
  impl_->insert_free(whole);
  impl_->landing.erase(impl_->landing.find(slab_bytes));
  impl_->landed.notify_all();
}

void PinnedHostPool::reserve(std::size_t count, std::size_t block_bytes) {
  REVIVA_CHECK_ARG(block_bytes > 0, "PinnedHostPool::reserve: block_bytes must be > 0");
  REVIVA_CHECK_ARG(block_bytes <= std::numeric_limits<std::size_t>::max() / 2,
                   "PinnedHostPool::reserve: ", block_bytes, " bytes is not a plausible size");
  const std::size_t size = round_up(block_bytes, options_.alignment);
  // (checked before anything is pinned: pinned memory cannot be paged out, so a request beyond
  // the host's memory would pin slab after slab until the machine swapped or killed us)
  const std::size_t host = host_memory_bytes();
  REVIVA_CHECK_ARG(count <= std::numeric_limits<std::size_t>::max() / size &&
                       (host == 0 || count * size <= host),
                   "PinnedHostPool::reserve: ", count, " blocks of ", block_bytes,
                   " bytes exceed the host's ", host, " bytes of memory");
  const std::size_t slab_bytes = std::max(options_.slab_bytes, round_up(size, kSlabGranularity));
  process_pending();
  // Blocks of `size` the free list can give, slabs other threads are pinning, and allocations
  // served since this call began (by other threads, from these slabs or their own): what is
  // still missing.
  auto missing = [&, start = stats().allocations]() {  // requires mutex
    std::size_t have = impl_->stats.allocations - start;
    for (const PoolBlock* b : impl_->free_blocks) have += b->size / size;
    for (std::size_t landing : impl_->landing) have += landing / size;
    return count > have ? count - have : 0;
  };
  // Each slab is free for allocations (Note [Slabs landing]) as soon as it is pinned.
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(impl_->mutex);
      const std::size_t left = missing();
      if (left == 0) return;
      auto& st = impl_->stats;
      if (options_.capacity_bytes != 0 && st.bytes_reserved + slab_bytes > options_.capacity_bytes)
        throw OutOfMemory(detail::concat(
            "pinned host pool: cannot reserve ", left, " more blocks of ", block_bytes,
            " bytes: capacity ", options_.capacity_bytes, " bytes, reserved ", st.bytes_reserved));
      st.bytes_reserved += slab_bytes;
      st.peak_bytes_reserved = std::max(st.peak_bytes_reserved, st.bytes_reserved);
      impl_->landing.insert(slab_bytes);
    }
    char* base = pin_slab(slab_bytes);
    std::lock_guard<std::mutex> lock(impl_->mutex);
    add_slab(base, slab_bytes);
  }
}

PinnedBlock PinnedHostPool::allocate(std::size_t bytes) {
  REVIVA_CHECK_ARG(bytes > 0, "PinnedHostPool::allocate: bytes must be > 0");
  REVIVA_CHECK_ARG(bytes <= std::numeric_limits<std::size_t>::max() / 2,
                   "PinnedHostPool::allocate: ", bytes, " bytes is not a plausible size");
  const std::size_t size = round_up(bytes, options_.alignment);
  process_pending();

  // Recovery steps when the capacity cap blocks a new slab: wait for pending frees, then give
  // back wholly free slabs (a new, larger slab may fit once they are gone), then give up.
  for (int attempt = 0;; ++attempt) {
    std::size_t slab_bytes = 0;
    {
      std::unique_lock<std::mutex> lock(impl_->mutex);
      for (;;) {
        if (PoolBlock* b = impl_->take_best_fit(size)) {
          impl_->note_allocated(b, bytes, /*hit=*/true);
          return PinnedBlock(shared_from_this(), b, block_data(b), bytes);
        }
        if (impl_->landing.lower_bound(size) == impl_->landing.end()) break;
        impl_->landed.wait(lock);  // Note [Slabs landing]
      }
      auto& st = impl_->stats;
      slab_bytes = std::max(options_.slab_bytes, round_up(size, kSlabGranularity));
      if (options_.capacity_bytes != 0 && st.bytes_reserved + slab_bytes > options_.capacity_bytes)
        slab_bytes = size;  // a slab just big enough may still fit under the cap
      if (options_.capacity_bytes == 0 ||
          st.bytes_reserved + slab_bytes <= options_.capacity_bytes) {
        st.bytes_reserved += slab_bytes;  // reserve before the backend call (Note above)
        st.peak_bytes_reserved = std::max(st.peak_bytes_reserved, st.bytes_reserved);
        impl_->landing.insert(slab_bytes);
      } else {
        slab_bytes = 0;
      }
    }

    if (slab_bytes == 0) {
      if (attempt == 0 && impl_->pending_count.load() > 0) {
        synchronize_pending();
        continue;
      }
      if (attempt <= 1 && release_cached() > 0) continue;
      const PinnedHostPoolStats st = stats();
      throw OutOfMemory(detail::concat("pinned host pool: cannot allocate ", bytes, " bytes (",
                                       size, " rounded): capacity ", options_.capacity_bytes,
                                       " bytes, reserved ", st.bytes_reserved, ", in use ",
                                       st.bytes_in_use, ", pending ", st.bytes_pending,
                                       ", largest free block ", st.largest_free_block));
    }

    char* base = pin_slab(slab_bytes);
    std::lock_guard<std::mutex> lock(impl_->mutex);
    add_slab(base, slab_bytes);
    PoolBlock* b = impl_->take_best_fit(size);
    REVIVA_ASSERT(b != nullptr, "a fresh slab of ", slab_bytes, " bytes must fit ", size);
    impl_->note_allocated(b, bytes, /*hit=*/false);
    return PinnedBlock(shared_from_this(), b, block_data(b), bytes);
  }
}

std::size_t PinnedHostPool::release_cached() {
  std::vector<char*> to_free;
  std::size_t released = 0;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    for (auto it = impl_->slabs.begin(); it != impl_->slabs.end();) {
      PoolSlab* slab = it->second.get();
      PoolBlock* only = slab->first;
      if (only->free && only->next == nullptr) {
        impl_->free_blocks.erase(only);
        delete only;
        released += slab->size;
        impl_->stats.bytes_reserved -= slab->size;
        ++impl_->stats.slabs_released;
        to_free.push_back(slab->base);
        it = impl_->slabs.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (char* base : to_free) backend_->free_pinned_host(base);
  return released;
}

PinnedHostPoolStats PinnedHostPool::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  PinnedHostPoolStats st = impl_->stats;
  st.slabs = impl_->slabs.size();
  st.free_blocks = impl_->free_blocks.size();
  st.pending_blocks = impl_->pending.size();
  st.largest_free_block = impl_->free_blocks.empty() ? 0 : (*impl_->free_blocks.rbegin())->size;
  return st;
}

bool PinnedHostPool::owns(const void* ptr) const {
  const char* p = static_cast<const char*>(ptr);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  auto it = impl_->slabs.upper_bound(p);
  if (it == impl_->slabs.begin()) return false;
  --it;
  return p < it->first + it->second->size;
}

void PinnedHostPool::check_invariants() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  std::size_t reserved = 0, in_use = 0, requested = 0, free_count = 0;
  for (const auto& [base, slab] : impl_->slabs) {
    REVIVA_ASSERT(base == slab->base);
    REVIVA_ASSERT(slab->first != nullptr && slab->first->prev == nullptr);
    REVIVA_ASSERT(slab->first->offset == 0);
    std::size_t offset = 0;
    for (const PoolBlock* b = slab->first; b; b = b->next) {
      REVIVA_ASSERT(b->slab == slab.get());
      REVIVA_ASSERT(b->offset == offset, "block at ", b->offset, " expected at ", offset);
      REVIVA_ASSERT(b->size > 0 && b->size % options_.alignment == 0);
      REVIVA_ASSERT(!b->next || b->next->prev == b);
      REVIVA_ASSERT(!(b->free && b->next && b->next->free), "two adjacent free blocks");
      if (b->free) {
        REVIVA_ASSERT(impl_->free_blocks.count(const_cast<PoolBlock*>(b)) == 1);
        REVIVA_ASSERT(b->uses.empty() && b->requested == 0);
        ++free_count;
      }
      offset += b->size;
    }
    REVIVA_ASSERT(offset == slab->size, "blocks cover ", offset, " of a slab of ", slab->size);
    reserved += slab->size;
  }
  REVIVA_ASSERT(free_count == impl_->free_blocks.size(), free_count, " free blocks in slabs, ",
                impl_->free_blocks.size(), " in the free list");
  std::size_t pending_bytes = 0;
  for (const PendingFree& p : impl_->pending) {
    REVIVA_ASSERT(!p.block->free);
    pending_bytes += p.block->size;
  }
  (void)in_use;
  (void)requested;
  const auto& st = impl_->stats;
  REVIVA_ASSERT(reserved == st.bytes_reserved, "slabs hold ", reserved, " bytes, stats say ",
                st.bytes_reserved);
  REVIVA_ASSERT(pending_bytes <= st.bytes_pending);
  REVIVA_ASSERT(
      st.bytes_in_use + st.bytes_pending +
              [&] {
                std::size_t f = 0;
                for (const PoolBlock* b : impl_->free_blocks) f += b->size;
                return f;
              }() ==
          reserved,
      "in use + pending + free != reserved");
  if (options_.capacity_bytes) REVIVA_ASSERT(st.bytes_reserved <= options_.capacity_bytes);
}

}  // namespace reviva
