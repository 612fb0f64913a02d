// KVStore (see kv_store.h): the K/V view over an OffloadManager of append blocks and its
// PrefetchScheduler. The lifetime protocol (Note [Lifetime protocol] in offload_manager.cpp) is
// the manager's: an append's D2H waits for compute's write (rule 1), memory is freed and reused
// after the streams that used it (rule 2, the arena allocator's stream-ordered reuse), compute
// waits for a fetch at acquire (rule 3), a fetch waits for the layer's last append to its host
// copy (rule 4). Here: the residency decisions (which layers are kept, the budget's room for
// streamed ones), the cycle declared to the scheduler, and the store's own checks and counts.
#include <reviva/error.h>
#include <reviva/kv_store.h>

#include <cstdio>
#include <string>

namespace reviva {

KVStore::KVStore(std::shared_ptr<TransferEngine> engine, std::shared_ptr<DeviceArena> arena,
                 KVStoreOptions options)
    : engine_(std::move(engine)), arena_(std::move(arena)), options_(options) {
  REVIVA_CHECK_ARG(engine_ != nullptr, "KVStore: engine is null");
  REVIVA_CHECK_ARG(arena_ != nullptr, "KVStore: arena is null");
  REVIVA_CHECK_ARG(options_.num_layers > 0, "KVStore: num_layers must be > 0, got ",
                   options_.num_layers);
  REVIVA_CHECK_ARG(options_.token_bytes > 0, "KVStore: token_bytes must be > 0");
  REVIVA_CHECK_ARG(options_.capacity_tokens > 0, "KVStore: capacity_tokens must be > 0");
  REVIVA_CHECK_ARG(options_.capacity_tokens <= (std::size_t{1} << 40) / options_.token_bytes,
                   "KVStore: ", options_.capacity_tokens, " tokens of ", options_.token_bytes,
                   " bytes exceed what a layer may hold (1 TiB)");
  REVIVA_CHECK_ARG(options_.prefetch_layers >= 0, "KVStore: prefetch_layers must be >= 0, got ",
                   options_.prefetch_layers);
  allocator_ = std::make_shared<ArenaDeviceAllocator>(arena_);
  OffloadManagerOptions mo;
  mo.budget_bytes = 1;  // set_budget(): a layer's bytes per resident layer and per slot
  mo.timeline_capacity = options_.timeline_capacity;
  manager_ = std::make_unique<OffloadManager>(engine_, allocator_, mo);
  for (int i = 0; i < options_.num_layers; ++i)
    blocks_.push_back(
        manager_->register_append_block(layer_bytes(), "K/V of layer " + std::to_string(i)));
  resident_.assign(blocks_.size(), false);
  acquired_.assign(blocks_.size(), nullptr);
  counts_.streamed_layers = options_.num_layers;
  PrefetchSchedulerOptions so;
  so.prefetch_groups = options_.prefetch_layers;
  so.eager_offload = true;  // a released streamed layer needed after the window goes at once
  scheduler_ = std::make_unique<PrefetchScheduler>(*manager_, so);
  declare_cycle();
}

KVStore::~KVStore() {
  try {
    close();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "reviva: KVStore destroyed with copies failing: %s\n", e.what());
  }
}

void KVStore::close() {
  if (closed_) return;
  closed_ = true;
  scheduler_.reset();
  manager_.reset();  // waits for its copies; every block's memory and host copy go back
  allocator_->trim();
}

void KVStore::check_open(const char* what) const {
  REVIVA_CHECK_ARG(!closed_, "KVStore::", what,
                   ": the store is closed (its memory was given back)");
}

std::size_t KVStore::layer_bytes() const noexcept {
  return options_.token_bytes * options_.capacity_tokens;
}

BlockId KVStore::block_at(int layer, const char* what) const {
  check_open(what);
  REVIVA_CHECK_ARG(layer >= 0 && layer < options_.num_layers, "KVStore::", what, ": layer ", layer,
                   " out of range [0, ", options_.num_layers, ")");
  return blocks_[static_cast<std::size_t>(layer)];
}

void KVStore::check_acquired(int layer, const char* what) const {
  block_at(layer, what);
  REVIVA_CHECK_ARG(acquired_[static_cast<std::size_t>(layer)] != nullptr, "KVStore::", what,
                   ": layer ", layer, " is not acquired");
}

// The budget: a layer's bytes for each resident layer (its most) and for each slot.
void KVStore::set_budget() {
  const std::size_t units = static_cast<std::size_t>(counts_.resident_layers + slots_);
  manager_->set_budget_bytes(std::max<std::size_t>(units * layer_bytes(), 1));
}

// The decode cycle, one group per layer; resident layers take no place in the window.
void KVStore::declare_cycle() {
  std::vector<std::vector<BlockId>> order;
  for (BlockId id : blocks_) order.push_back({id});
  scheduler_->declare_order(std::move(order));
}

void KVStore::make_resident(int layer) {
  const BlockId id = block_at(layer, "make_resident");
  const auto i = static_cast<std::size_t>(layer);
  REVIVA_CHECK_ARG(!resident_[i], "KVStore::make_resident: layer ", layer, " is already resident");
  REVIVA_CHECK_ARG(!started_, "KVStore::make_resident: layer ", layer,
                   ": residency is fixed once a layer was acquired (use promote)");
  manager_->keep_resident(id);  // Empty: nothing to fetch, always kept
  resident_[i] = true;
  ++counts_.resident_layers;
  --counts_.streamed_layers;
  set_budget();
  declare_cycle();
}

bool KVStore::promote(int layer) {
  const BlockId id = block_at(layer, "promote");
  const auto i = static_cast<std::size_t>(layer);
  REVIVA_CHECK_ARG(!resident_[i], "KVStore::promote: layer ", layer, " is already resident");
  REVIVA_CHECK_ARG(acquired_[i] == nullptr, "KVStore::promote: layer ", layer, " is acquired");
  ++counts_.resident_layers;
  set_budget();  // room for it beside the slots
  // Into memory of its own: a layer on the device (prefetched) leaves its memory to the
  // streamed layers (it is clean: nothing is copied), so that a promotion never takes the
  // memory streaming needs. Its valid prefix comes in from the host copy now (compute waits for
  // it at the next acquire), and the host copy goes back to the pool once that copy read it.
  manager_->settle(id);  // its prefetch in flight lands first (the other copies go on)
  manager_->offload(id);
  if (!manager_->keep_resident(id)) {
    --counts_.resident_layers;
    set_budget();
    ++counts_.promotion_failures;
    return false;
  }
  resident_[i] = true;
  --counts_.streamed_layers;
  ++counts_.promotions;
  declare_cycle();
  return true;
}

void KVStore::add_slot() {
  check_open("add_slot");
  ++slots_;
  set_budget();
}

bool KVStore::drop_slot() {
  check_open("drop_slot");
  if (slots_ <= 1 && counts_.streamed_layers > 0) return false;
  if (slots_ == 0) return false;
  --slots_;
  try {
    set_budget();  // streamed layers not acquired leave (cleanly) until the rest fits
  } catch (const OutOfMemory&) {
    ++slots_;  // the layers acquired need that room
    set_budget();
    return false;
  }
  // The room's memory goes back: the streamed layers on the device beyond the slots left now
  // leave, and the allocator's cache is given back to the arena.
  int room = slots_;
  for (std::size_t j = 0; j < blocks_.size(); ++j) room -= !resident_[j] && acquired_[j];
  for (std::size_t j = 0; j < blocks_.size(); ++j) {
    if (resident_[j] || acquired_[j]) continue;
    if (manager_->state(blocks_[j]) != BlockState::Device) continue;
    if (room > 0)
      --room;
    else
      manager_->offload(blocks_[j]);
  }
  allocator_->trim();
  return true;
}

void* KVStore::acquire(int layer, const Stream& compute) {
  const BlockId id = block_at(layer, "acquire");
  const auto i = static_cast<std::size_t>(layer);
  REVIVA_CHECK_ARG(acquired_[i] == nullptr, "KVStore::acquire: layer ", layer,
                   " is already acquired");
  started_ = true;
  if (!resident_[i]) {
    const BlockState state = manager_->state(id);
    if (state == BlockState::Device || state == BlockState::ToDevice) {
      ++counts_.slot_hits;
    } else {
      int held = 0;  // streamed layers compute holds: each fills a slot's room
      for (std::size_t j = 0; j < acquired_.size(); ++j) held += acquired_[j] && !resident_[j];
      REVIVA_CHECK_ARG(held < slots_, "KVStore::acquire: layer ", layer, " needs a slot, but all ",
                       slots_, " slots are acquired (release layers, or add slots)");
    }
  }
  // The manager makes compute wait for a fetch still landing (rule 3), and the scheduler starts
  // the next streamed layers of the cycle.
  const std::vector<void*> ptrs = scheduler_->acquire_group({&id, 1}, compute, Access::ReadWrite);
  acquired_[i] = ptrs.front();
  return ptrs.front();
}

void KVStore::reserve(int layer, std::size_t tokens) {
  check_acquired(layer, "reserve");
  REVIVA_CHECK_ARG(tokens <= options_.capacity_tokens, "KVStore::reserve: ", tokens,
                   " tokens exceed the capacity of ", options_.capacity_tokens, " tokens");
  if (tokens == 0) return;
  manager_->grow(blocks_[static_cast<std::size_t>(layer)], tokens * options_.token_bytes);
}

std::size_t KVStore::reserved_tokens(int layer) const {
  check_acquired(layer, "reserved_tokens");
  return manager_->bytes(blocks_[static_cast<std::size_t>(layer)]) / options_.token_bytes;
}

std::shared_ptr<ArenaBuffer> KVStore::buffer(int layer) const {
  check_acquired(layer, "buffer");
  return allocator_->buffer_of(acquired_[static_cast<std::size_t>(layer)]);
}

void KVStore::wrote(int layer, std::size_t first, std::size_t count, const Stream& compute) {
  check_acquired(layer, "wrote");
  const BlockId id = blocks_[static_cast<std::size_t>(layer)];
  const std::size_t length = KVStore::length(layer);
  REVIVA_CHECK_ARG(first <= length, "KVStore::wrote: tokens from ", first, " would leave a gap",
                   " after the layer's ", length, " tokens");
  REVIVA_CHECK_ARG(count <= options_.capacity_tokens && first <= options_.capacity_tokens - count,
                   "KVStore::wrote: tokens [", first, ", ", first + count,
                   ") exceed the capacity of ", options_.capacity_tokens, " tokens");
  const std::size_t reserved = reserved_tokens(layer);
  REVIVA_CHECK_ARG(first + count <= reserved, "KVStore::wrote: tokens [", first, ", ",
                   first + count, ") of layer ", layer, " were not reserved (", reserved,
                   " tokens are): call reserve() before compute writes them");
  counts_.bytes_to_host +=
      manager_->wrote(id, first * options_.token_bytes, count * options_.token_bytes, compute);
}

void KVStore::release(int layer, const Stream& compute) {
  check_acquired(layer, "release");
  const auto i = static_cast<std::size_t>(layer);
  acquired_[i] = nullptr;
  const BlockId id = blocks_[i];
  scheduler_->release_group({&id, 1}, compute);
}

std::size_t KVStore::length(int layer) const {
  return manager_->valid_bytes(block_at(layer, "length")) / options_.token_bytes;
}

bool KVStore::resident(int layer) const {
  block_at(layer, "resident");
  return resident_[static_cast<std::size_t>(layer)];
}

void KVStore::synchronize() {
  if (manager_)
    manager_->synchronize();
  else
    engine_->synchronize();
}

KVStoreStats KVStore::stats() {
  KVStoreStats st = counts_;
  st.slots = slots_;
  if (!manager_) return st;
  const ManagerMetrics mm = manager_->metrics();
  st.fills = mm.prefetches + mm.prefetch_misses;
  st.prefetched_fills = mm.prefetches;
  st.prefetches_without_memory = mm.prefetches_without_memory;
  st.prefetches_deferred = scheduler_->stats().prefetches_without_room;
  st.bytes_to_device = mm.bytes_to_device;
  st.compute_stall_ms = mm.compute_stall_ms;
  st.copy_to_device_ms = mm.to_device_busy_ms;
  st.overlap_ratio = mm.overlap_ratio;
  st.host_copy_wait_ms = mm.host_copy_alloc_ms;
  const ArenaAllocatorStats as = allocator_->stats();  // mapped for the store: held and cached
  st.device_bytes = as.live_bytes + as.cached_bytes;
  st.peak_device_bytes = as.peak_bytes;
  st.host_bytes = 0;
  for (BlockId id : blocks_) st.host_bytes += manager_->host_bytes(id);
  return st;
}

std::vector<TimelineEvent> KVStore::timeline() {
  return manager_ ? manager_->timeline() : std::vector<TimelineEvent>{};
}

void KVStore::clear() {
  check_open("clear");
  for (void* p : acquired_)
    REVIVA_CHECK_ARG(p == nullptr, "KVStore::clear: a layer is still acquired");
  manager_->synchronize();
  for (BlockId id : blocks_) manager_->discard(id);
  declare_cycle();
}

}  // namespace reviva
