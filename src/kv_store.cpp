// KVStore (see kv_store.h): the K/V view over an OffloadManager of append blocks and its
// PrefetchScheduler. The lifetime protocol (Note [Lifetime protocol] in offload_manager_impl.h) is
// the manager's: an append's D2H waits for compute's write (rule 1), memory is freed and reused
// after the streams that used it (rule 2, the arena allocator's stream-ordered reuse), compute
// waits for a fetch at acquire (rule 3), a fetch waits for the layer's last append to its host
// copy (rule 4). Here: the residency decisions (which layers are kept, the budget's room for
// streamed ones), the cycle declared to the scheduler, and the store's own checks and counts. A
// paged layer's calls (Note [Paged layers], [Paged prefill order]) are kv_store_pages.cpp's,
// a host-attended layer's kv_store_host.cpp's, a spilled layer's (Note [Spilled layers])
// kv_store_disk.cpp's.
//
// Note [Layers of their own size]
// A sliding-window layer reads only its last W tokens, so the K/V cache keeps it as a ring of a
// few more than W (reviva/cache/window_rings.py, Note [Window rings]): its block holds that many
// tokens however long the call, where a global layer's holds every token. So each layer has its own
// capacity (options.layer_capacity_tokens): its append block, its pinned host copy and its
// resident bytes are its own size. The budget counts each whole resident layer by its own bytes
// and each slot by the largest layer that may stream (not resident, not read on the host): a
// slot holds any streamed layer. Pages keep one capacity (a ring is whole).
#include <reviva/error.h>
#include <reviva/kv_store.h>

#include <algorithm>
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
  const auto& caps = options_.layer_capacity_tokens;
  REVIVA_CHECK_ARG(caps.empty() || caps.size() == static_cast<std::size_t>(options_.num_layers),
                   "KVStore: layer_capacity_tokens has ", caps.size(), " entries for ",
                   options_.num_layers, " layers (empty: capacity_tokens each)");
  for (std::size_t i = 0; i < caps.size(); ++i)
    REVIVA_CHECK_ARG(caps[i] > 0 && caps[i] <= options_.capacity_tokens,
                     "KVStore: layer_capacity_tokens[", i, "] = ", caps[i], " must be in [1, ",
                     options_.capacity_tokens, "] (capacity_tokens)");
  REVIVA_CHECK_ARG(caps.empty() || options_.page_tokens == 0,
                   "KVStore: layers of their own capacity (layer_capacity_tokens) cannot be paged "
                   "(page_tokens ",
                   options_.page_tokens, ")");
  REVIVA_CHECK_ARG(options_.disk_staged_layers == 0 || options_.disk_staged_layers >= 2,
                   "KVStore: disk_staged_layers must be 0 (prefetch_layers + 3) or >= 2, got ",
                   options_.disk_staged_layers);
  allocator_ = std::make_shared<ArenaDeviceAllocator>(arena_);
  OffloadManagerOptions mo;
  mo.budget_bytes = 1;  // set_budget(): a layer's bytes per resident layer and per slot
  mo.timeline_capacity = options_.timeline_capacity;
  manager_ = std::make_unique<OffloadManager>(engine_, allocator_, mo);
  const std::size_t page = options_.page_tokens;
  const std::size_t per_layer = page > 0 ? (options_.capacity_tokens + page - 1) / page : 0;
  for (int i = 0; i < options_.num_layers; ++i) {
    blocks_.push_back(
        manager_->register_append_block(layer_bytes(i), "K/V of layer " + std::to_string(i)));
    std::vector<BlockId> pages;
    for (std::size_t j = 0; j < per_layer; ++j)
      pages.push_back(manager_->register_append_block(
          page_bytes(j), "K/V of layer " + std::to_string(i) + " page " + std::to_string(j)));
    pages_.push_back(std::move(pages));
    page_acquired_.emplace_back(per_layer, nullptr);
  }
  cycle_write_page_.assign(blocks_.size(), 1);
  spills_.resize(blocks_.size());
  resident_.assign(blocks_.size(), false);
  host_attended_.assign(blocks_.size(), false);
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
  forget_spills();  // (its reads and write-backs are waited for)
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

std::size_t KVStore::capacity(int layer) const {
  REVIVA_CHECK_ARG(layer >= 0 && layer < options_.num_layers, "KVStore::capacity: layer ", layer,
                   " out of range [0, ", options_.num_layers, ")");
  const auto& caps = options_.layer_capacity_tokens;
  return caps.empty() ? options_.capacity_tokens : caps[static_cast<std::size_t>(layer)];
}

std::size_t KVStore::layer_bytes(int layer) const { return options_.token_bytes * capacity(layer); }

BlockId KVStore::block_at(int layer, const char* what) const {
  check_open(what);
  REVIVA_CHECK_ARG(layer >= 0 && layer < options_.num_layers, "KVStore::", what, ": layer ", layer,
                   " out of range [0, ", options_.num_layers, ")");
  return blocks_[static_cast<std::size_t>(layer)];
}

void KVStore::check_acquired(int layer, const char* what) const {
  check_whole(layer, what);
  REVIVA_CHECK_ARG(acquired_[static_cast<std::size_t>(layer)] != nullptr, "KVStore::", what,
                   ": layer ", layer, " is not acquired");
}

void KVStore::check_whole(int layer, const char* what) const {
  block_at(layer, what);
  REVIVA_CHECK_ARG(!paged(layer), "KVStore::", what, ": layer ", layer, " is paged (pages of ",
                   options_.page_tokens, " tokens): use the *_page calls");
}

// The budget: a layer's bytes for each whole resident layer (its most) and for each slot, the
// kept pages' bytes, and a page's bytes for each page slot (Note [Paged layers]).
void KVStore::set_budget() {
  // (a whole layer being promoted counts before it is marked resident: promote() raises the
  // budget first, to make its room)
  const std::size_t page = options_.page_tokens > 0 ? page_bytes(0) : 0;
  const std::size_t bytes = resident_bytes_ + static_cast<std::size_t>(slots_) * slot_bytes() +
                            kept_page_bytes_ + static_cast<std::size_t>(page_slots_) * page;
  manager_->set_budget_bytes(std::max<std::size_t>(bytes, 1));
}

// A slot's room (Note [Layers of their own size]): the largest layer that may stream (one not
// resident and not read on the host), or the largest of all when none is left.
std::size_t KVStore::slot_bytes() const {
  std::size_t most = 0;
  for (std::size_t i = 0; i < blocks_.size(); ++i)
    if (!resident_[i] && !host_attended_[i])
      most = std::max(most, layer_bytes(static_cast<int>(i)));
  return most > 0 ? most : layer_bytes();
}

// The decode cycle: one group per whole layer; for a paged layer, a decode step's accesses in
// order: its pages holding tokens (attention reads them), then the page that takes the step's
// token (the last one again, or a new one when the last is full), so that the last page read
// stays for the write instead of leaving and coming back. Resident layers and kept pages take
// no place in the window.
void KVStore::declare_cycle() {
  std::vector<std::vector<BlockId>> order;
  for (std::size_t i = 0; i < blocks_.size(); ++i) {
    if (host_attended_[i]) continue;  // (never fetched again: Note [Host-side appends])
    if (pages_[i].empty()) {
      order.push_back({blocks_[i]});
      continue;
    }
    const std::size_t write = write_page(static_cast<int>(i));
    cycle_write_page_[i] = write;
    for (std::size_t j = 0; j < pages(static_cast<int>(i)); ++j) order.push_back({pages_[i][j]});
    if (write < pages_[i].size()) order.push_back({pages_[i][write]});
  }
  scheduler_->declare_order(std::move(order));
}

// The page that takes a paged layer's next token.
std::size_t KVStore::write_page(int layer) const { return length(layer) / options_.page_tokens; }

void KVStore::make_resident(int layer) {
  const BlockId id = block_at(layer, "make_resident");
  const auto i = static_cast<std::size_t>(layer);
  REVIVA_CHECK_ARG(!resident_[i], "KVStore::make_resident: layer ", layer, " is already resident");
  REVIVA_CHECK_ARG(!started_, "KVStore::make_resident: layer ", layer,
                   ": residency is fixed once a layer was acquired (use promote)");
  REVIVA_CHECK_ARG(!spills_[i].on, "KVStore::make_resident: layer ", layer,
                   " spills to disk (spill_to_disk)");
  manager_->keep_resident(id);  // Empty: nothing to fetch, always kept
  for (BlockId page : pages_[i]) manager_->unregister(page);  // (Empty) the layer stays whole
  pages_[i].clear();
  page_acquired_[i].clear();
  resident_[i] = true;
  resident_bytes_ += layer_bytes(layer);
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
  REVIVA_CHECK_ARG(!host_attended_[i], "KVStore::promote: layer ", layer,
                   " is attended on the host");
  if (paged(layer)) {
    for (void* p : page_acquired_[i])
      REVIVA_CHECK_ARG(p == nullptr, "KVStore::promote: a page of layer ", layer, " is acquired");
    // Room for all its pages first; then each page is kept (a page on the device leaves first,
    // to come back into memory of its own, as a whole layer does below).
    kept_page_bytes_ += layer_bytes();
    set_budget();
    std::size_t newly = 0;  // bytes of pages kept now (pages kept before were counted then)
    bool all = true;
    for (std::size_t j = 0; j < pages_[i].size(); ++j) {
      const BlockId page = pages_[i][j];
      if (manager_->kept(page)) continue;  // (by a promotion that stopped part way)
      manager_->settle(page);
      manager_->offload(page);
      if (!manager_->keep_resident(page)) {
        all = false;
        break;
      }
      newly += page_bytes(j);
    }
    kept_page_bytes_ = kept_page_bytes_ - layer_bytes() + newly;
    set_budget();
    declare_cycle();
    if (!all) {
      ++counts_.promotion_failures;
      return false;
    }
    resident_[i] = true;
    ++counts_.resident_layers;  // (its bytes are the kept pages', not a whole layer's)
    ++promoted_pages_;
    --counts_.streamed_layers;
    ++counts_.promotions;
    return true;
  }
  if (spills_[i].on) {
    finish_ready_spills();
    bring_back(layer);  // its host copy first (Note [Spilled layers])
  }
  ++counts_.resident_layers;
  resident_bytes_ += layer_bytes(layer);
  set_budget();  // room for it beside the slots
  // Into memory of its own: a layer on the device (prefetched) leaves its memory to the
  // streamed layers (it is clean: nothing is copied), so that a promotion never takes the
  // memory streaming needs. Its valid prefix comes in from the host copy now (compute waits for
  // it at the next acquire), and the host copy goes back to the pool once that copy read it.
  manager_->settle(id);  // its prefetch in flight lands first (the other copies go on)
  manager_->offload(id);
  if (!manager_->keep_resident(id)) {
    --counts_.resident_layers;
    resident_bytes_ -= layer_bytes(layer);
    set_budget();
    ++counts_.promotion_failures;
    return false;
  }
  resident_[i] = true;
  --counts_.streamed_layers;
  ++counts_.promotions;
  if (spills_[i].on) {  // on the device for good: the disk's copy goes
    Spill& sp = spills_[i];
    if (sp.extent != 0) options_.disk->release(sp.extent);
    sp = Spill();
    --spilled_count_;
  }
  declare_cycle();
  return true;
}

void KVStore::add_slot() {
  check_open("add_slot");
  ++slots_;
  set_budget();
}

bool KVStore::set_page_slots(int pages) {
  check_open("set_page_slots");
  REVIVA_CHECK_ARG(pages >= 0, "KVStore::set_page_slots: pages must be >= 0, got ", pages);
  REVIVA_CHECK_ARG(options_.page_tokens > 0 || pages == 0,
                   "KVStore::set_page_slots: the store has no pages (page_tokens 0)");
  const int before = page_slots_;
  page_slots_ = pages;
  try {
    set_budget();  // pages not acquired leave (cleanly) until the rest fits
  } catch (const OutOfMemory&) {
    page_slots_ = before;  // the pages acquired need that room
    set_budget();
    return false;
  }
  if (pages < before) allocator_->trim();
  return true;
}

bool KVStore::drop_slot() {
  check_open("drop_slot");
  // (host-attended layers are never fetched: they need no slot)
  if (slots_ <= 1 && counts_.streamed_layers > counts_.host_attended_layers) return false;
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
  check_whole(layer, "acquire");
  const BlockId id = block_at(layer, "acquire");
  const auto i = static_cast<std::size_t>(layer);
  REVIVA_CHECK_ARG(acquired_[i] == nullptr, "KVStore::acquire: layer ", layer,
                   " is already acquired");
  REVIVA_CHECK_ARG(!host_attended_[i], "KVStore::acquire: layer ", layer,
                   " is attended on the host (attend_on_host): read host_rows() instead");
  started_ = true;
  advance_spill(layer);  // Note [Spilled layers]
  if (spills_[i].on) bring_back(layer);
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
  const std::size_t cap = capacity(layer);
  REVIVA_CHECK_ARG(tokens <= cap, "KVStore::reserve: ", tokens, " tokens exceed layer ", layer,
                   "'s capacity of ", cap, " tokens");
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
  const std::size_t cap = capacity(layer);
  REVIVA_CHECK_ARG(count <= cap && first <= cap - count, "KVStore::wrote: tokens [", first, ", ",
                   first + count, ") exceed layer ", layer, "'s capacity of ", cap, " tokens");
  const std::size_t reserved = reserved_tokens(layer);
  REVIVA_CHECK_ARG(first + count <= reserved, "KVStore::wrote: tokens [", first, ", ",
                   first + count, ") of layer ", layer, " were not reserved (", reserved,
                   " tokens are): call reserve() before compute writes them");
  counts_.bytes_to_host +=
      manager_->wrote(id, first * options_.token_bytes, count * options_.token_bytes, compute);
  if (spills_[static_cast<std::size_t>(layer)].on) note_staged();  // (a first write pins one)
}

void KVStore::release(int layer, const Stream& compute) {
  check_acquired(layer, "release");
  const auto i = static_cast<std::size_t>(layer);
  acquired_[i] = nullptr;
  const BlockId id = blocks_[i];
  scheduler_->release_group({&id, 1}, compute);
  finish_ready_spills();  // (reads that landed: the next acquire may prefetch those layers)
}

std::size_t KVStore::length(int layer) const {
  const BlockId id = block_at(layer, "length");
  if (!paged(layer)) return manager_->valid_bytes(id) / options_.token_bytes;
  std::size_t bytes = 0;  // pages fill in order (wrote_page): the full ones, then one more
  const auto& pages = pages_[static_cast<std::size_t>(layer)];
  for (std::size_t j = 0; j < pages.size(); ++j) {
    const std::size_t valid = manager_->valid_bytes(pages[j]);
    bytes += valid;
    if (valid < page_bytes(j)) break;
  }
  return bytes / options_.token_bytes;
}

void KVStore::set_fetch_window(int layer, std::size_t tokens) {
  const BlockId id = block_at(layer, "set_fetch_window");
  REVIVA_CHECK_ARG(!paged(layer), "KVStore::set_fetch_window: layer ", layer,
                   " is paged (its pages are fetched one by one)");
  REVIVA_CHECK_ARG(acquired_[static_cast<std::size_t>(layer)] == nullptr,
                   "KVStore::set_fetch_window: layer ", layer, " is acquired");
  manager_->set_fetch_tail(id, tokens * options_.token_bytes);
}

void KVStore::truncate(int layer, std::size_t tokens) {
  const BlockId id = block_at(layer, "truncate");
  const auto i = static_cast<std::size_t>(layer);
  const std::size_t length = KVStore::length(layer);
  REVIVA_CHECK_ARG(tokens <= length, "KVStore::truncate: ", tokens, " tokens exceed layer ", layer,
                   "'s ", length);
  REVIVA_CHECK_ARG(acquired_[i] == nullptr, "KVStore::truncate: layer ", layer, " is acquired");
  if (!paged(layer)) {
    Spill& sp = spills_[i];
    if (sp.request) finish_spill(layer, /*take_back=*/false);
    manager_->truncate(id, tokens * options_.token_bytes);
    sp.on_disk = std::min(sp.on_disk, tokens * options_.token_bytes);
    return;
  }
  for (void* p : page_acquired_[i])
    REVIVA_CHECK_ARG(p == nullptr, "KVStore::truncate: a page of layer ", layer, " is acquired");
  const std::size_t page = options_.page_tokens;
  for (std::size_t j = 0; j < pages_[i].size(); ++j) {
    const std::size_t first = j * page;
    const std::size_t keep = tokens > first ? std::min(tokens - first, page) : 0;
    if (keep * options_.token_bytes < manager_->valid_bytes(pages_[i][j]))
      manager_->truncate(pages_[i][j], keep * options_.token_bytes);
  }
  declare_cycle();  // (the pages a step reads, and the one it writes, changed)
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
  st.host_copy_wait_ms = mm.host_copy_alloc_ms + counts_.host_copy_wait_ms;
  const ArenaAllocatorStats as = allocator_->stats();  // mapped for the store: held and cached
  st.device_bytes = as.live_bytes + as.cached_bytes;
  st.peak_device_bytes = as.peak_bytes;
  st.host_bytes = 0;
  for (BlockId id : blocks_) st.host_bytes += manager_->host_bytes(id);
  for (const auto& pages : pages_) {
    st.paged_layers += !pages.empty();
    for (BlockId id : pages) st.host_bytes += manager_->host_bytes(id);
  }
  st.page_slots = page_slots_;
  st.spilled_layers = spilled_count_;
  st.staged_layers = staged_spills();
  st.disk_bytes = 0;
  for (int i = 0; i < options_.num_layers; ++i) {
    const Spill& sp = spills_[static_cast<std::size_t>(i)];
    if (!sp.on) continue;
    if (sp.block) st.host_bytes += sp.block.size();
    if (sp.extent != 0) st.disk_bytes += options_.disk->extent_bytes(sp.extent);
  }
  return st;
}

std::vector<TimelineEvent> KVStore::timeline() {
  return manager_ ? manager_->timeline() : std::vector<TimelineEvent>{};
}

void KVStore::clear() {
  check_open("clear");
  for (void* p : acquired_)
    REVIVA_CHECK_ARG(p == nullptr, "KVStore::clear: a layer is still acquired");
  for (const auto& acquired : page_acquired_)
    for (void* p : acquired) REVIVA_CHECK_ARG(p == nullptr, "KVStore::clear: a page is acquired");
  manager_->synchronize();
  forget_spills();
  for (BlockId id : blocks_) manager_->discard(id);
  for (const auto& pages : pages_)
    for (BlockId id : pages) manager_->discard(id);
  host_attended_.assign(blocks_.size(), false);  // (their host copies are gone)
  counts_.host_attended_layers = 0;
  declare_cycle();
}

}  // namespace reviva
