// WeightStore (see weight_store.h): weights streamed from pinned host memory, on an
// OffloadManager of host-backed blocks and its PrefetchScheduler. Which layers are resident, and
// their fills (Note [Resident fills as compute nears]): weight_store_residency.cpp.
//
// Note [Streamed weights]
// A layer's weights never change during inference, so their pinned host copy is their home and
// the device holds copies: every acquire is Access::ReadOnly, which keeps the host copy valid, so
// a streamed layer leaves the device without a D2H (its memory is reused once the streams that
// read it pass: lifetime rule 2, the arena allocator's stream-ordered reuse) and comes back with
// one H2D of its bytes, which compute waits for at acquire (rule 3). The host copy is read by
// every fetch and released only when the store closes, after its copies (rule 4). Resident layers
// are acquired once by the store itself, through the copy stream, and stay pinned in the manager,
// so no eviction can take them; compute waits for a resident layer's fill only at its own acquire
// (held through compute, every fill delayed the call's first work). A new resident layer's fill is
// issued as compute comes near it (Note [Resident fills as compute nears]); they take no place in
// the prefetch window, whose cycle lists the
// streamed layers alone (a decode step needs each once, in order; so does a prefill, where each
// layer's compute over a long prompt hides its copy). The budget is each resident layer's bytes
// plus `slots` times the largest streamed layer (or the caller's slot_bytes): the one compute
// holds and those in flight.
// The window may be as wide as the slots: the arena's allocator reuses freed memory in stream
// order (Note [Stream-ordered frees] in offload_manager_impl.h), so a prefetch that found no room
// at an acquire is retried when the layer is released, into the memory just freed, its copy
// ordered on the device after compute's use. With one slot and a window of one, the next
// layer's copy is queued as soon as the host releases a layer and starts the moment compute is
// done with it, also across the end of a decode step, where the host waits for the token.
//
// Note [Blocks within a block]
// A mixture-of-experts layer's experts are one block of the layer (all experts' gate_up
// projections, then all their down projections: the parameters HF's experts forward reads as
// [experts, ...] tensors), which a prefill acquires whole, but a decode step runs only the
// experts its router chose (2 of Mixtral's 8, 8 of Qwen3-MoE's 128): Note [Routed experts] in
// python/reviva/weights/routed_experts.py. Each expert's projection is also a view of the store, a
// block whose host copy is its range of the layer's host copy (PinnedBlock::share: Note [Shared
// blocks] in pinned_host_pool.cpp; no second host copy, and every view is exactly its bytes of the
// layer). A decode step leaves the experts' whole block out of the cycle (set_on_demand) and
// acquires the chosen experts' views one at a time: each is fetched at its acquire (the host knows
// the router's choice only once the router ran, so no prefetch can know it earlier) and leaves at
// its release (clean: its memory is reused in stream order). Views and layers on demand take no
// part in the cycle, so the prefetch window keeps bringing the next layers' attention blocks.
//
// Note [Declared orders]
// A decode step (or a prefill) uses every layer once, in index order, and that cycle is the
// store's default. A training step uses each layer twice: its forward in index order, then its
// backward in reverse, where the layer's recompute and its gradient read its weights once more
// (python/reviva/train/finetune.py). set_order declares such a step as the sequence of its uses;
// the scheduler's order is that sequence's streamed layers, a layer listed as often as the step
// uses it, so that what is prefetched after a layer's forward is the next layer's forward, after
// the last layer's forward its backward needs nothing (the same layer, still on the device: its
// next use is within the window, so its release does not send it away), and after layer 0's
// backward the next step's forward begins again with layer 0. A use out of that order (an
// evaluation's forward alone) still reads the right weights: the scheduler counts it off
// schedule and the layer is fetched when acquired.
#include <reviva/error.h>
#include <reviva/weight_store.h>

#include <algorithm>
#include <cstdio>
#include <string>

namespace reviva {

WeightStore::WeightStore(std::shared_ptr<TransferEngine> engine, std::shared_ptr<DeviceArena> arena,
                         WeightStoreOptions options)
    : engine_(std::move(engine)), arena_(std::move(arena)), options_(std::move(options)) {
  REVIVA_CHECK_ARG(engine_ != nullptr, "WeightStore: engine is null");
  REVIVA_CHECK_ARG(arena_ != nullptr, "WeightStore: arena is null");
  REVIVA_CHECK_ARG(!options_.layer_bytes.empty(), "WeightStore: no layers");
  for (std::size_t i = 0; i < options_.layer_bytes.size(); ++i)
    REVIVA_CHECK_ARG(options_.layer_bytes[i] > 0, "WeightStore: layer ", i, " has 0 bytes");
  largest_ = *std::max_element(options_.layer_bytes.begin(), options_.layer_bytes.end());
  REVIVA_CHECK_ARG(options_.slot_bytes == 0 || options_.slot_bytes >= largest_,
                   "WeightStore: slot_bytes ", options_.slot_bytes,
                   " cannot hold the largest layer (", largest_, " bytes)");
  first_view_ = static_cast<int>(options_.layer_bytes.size());
  for (std::size_t j = 0; j < options_.views.size(); ++j) {
    const WeightView& v = options_.views[j];
    REVIVA_CHECK_ARG(v.of >= 0 && v.of < first_view_, "WeightStore: view ", j, " is of layer ",
                     v.of, ", out of range [0, ", first_view_, ")");
    const std::size_t of = options_.layer_bytes[static_cast<std::size_t>(v.of)];
    REVIVA_CHECK_ARG(v.bytes > 0 && v.offset <= of && v.bytes <= of - v.offset,
                     "WeightStore: view ", j, " (", v.bytes, " bytes from offset ", v.offset,
                     ") is not inside layer ", v.of, "'s ", of, " bytes");
  }
  allocator_ = std::make_shared<ArenaDeviceAllocator>(arena_);
  OffloadManagerOptions mo;
  mo.budget_bytes = 1;  // set_residency() sets it
  mo.timeline_capacity = options_.timeline_capacity;
  manager_ = std::make_unique<OffloadManager>(engine_, allocator_, mo);
  std::vector<PinnedBlock> hosts;
  for (std::size_t size : options_.layer_bytes) hosts.push_back(engine_->pool().allocate(size));
  std::vector<PinnedBlock> shares;  // Note [Blocks within a block]
  for (const WeightView& v : options_.views)
    shares.push_back(hosts[static_cast<std::size_t>(v.of)].share(v.offset, v.bytes));
  for (std::size_t i = 0; i < hosts.size(); ++i) {
    host_.push_back(hosts[i].data());
    blocks_.push_back(manager_->register_host_block(std::move(hosts[i]),
                                                    "weights of layer " + std::to_string(i)));
  }
  for (std::size_t j = 0; j < shares.size(); ++j) {
    host_.push_back(shares[j].data());
    blocks_.push_back(manager_->register_host_block(
        std::move(shares[j]), "view " + std::to_string(j) + " of layer " +
                                  std::to_string(options_.views[j].of) + "'s weights"));
  }
  resident_.assign(blocks_.size(), false);
  on_demand_.assign(blocks_.size(), false);
  for (std::size_t i = static_cast<std::size_t>(first_view_); i < blocks_.size(); ++i)
    on_demand_[i] = true;
  acquired_.assign(blocks_.size(), nullptr);
  resident_at_.assign(blocks_.size(), nullptr);
  declare_cycle();
}

WeightStore::~WeightStore() {
  try {
    close();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "reviva: WeightStore destroyed with copies failing: %s\n", e.what());
  }
}

void WeightStore::close() {
  if (closed_) return;
  closed_ = true;
  scheduler_.reset();
  // The resident layers' holds end; their memory goes back after every use recorded by the
  // releases of compute's acquires (the manager keeps each stream's last use).
  const Stream& h2d = engine_->stream(Direction::HostToDevice);
  for (std::size_t i = 0; i < blocks_.size(); ++i) {
    if (acquired_[i] != nullptr) manager_->release(blocks_[i], h2d);
    if (resident_at_[i] != nullptr) manager_->release(blocks_[i], h2d);
  }
  manager_.reset();  // waits for its copies; every block's memory and host copy go back
  allocator_->trim();
}

void WeightStore::check_open(const char* what) const {
  REVIVA_CHECK_ARG(!closed_, "WeightStore::", what,
                   ": the store is closed (its memory was given back)");
}

BlockId WeightStore::block_at(int layer, const char* what) const {
  check_open(what);
  REVIVA_CHECK_ARG(layer >= 0 && layer < num_layers(), "WeightStore::", what, ": layer ", layer,
                   " out of range [0, ", num_layers(), ")");
  return blocks_[static_cast<std::size_t>(layer)];
}

void* WeightStore::host_data(int layer) const {
  block_at(layer, "host_data");
  return host_[static_cast<std::size_t>(layer)];
}

std::size_t WeightStore::layer_bytes(int layer) const {
  block_at(layer, "layer_bytes");
  return bytes_of(static_cast<std::size_t>(layer));
}

std::size_t WeightStore::bytes_of(std::size_t i) const {
  const auto layers = static_cast<std::size_t>(first_view_);
  return i < layers ? options_.layer_bytes[i] : options_.views[i - layers].bytes;
}

bool WeightStore::view(int layer) const {
  block_at(layer, "view");
  return layer >= first_view_;
}

bool WeightStore::on_demand(int layer) const {
  block_at(layer, "on_demand");
  return on_demand_[static_cast<std::size_t>(layer)];
}

bool WeightStore::resident(int layer) const {
  block_at(layer, "resident");
  return resident_[static_cast<std::size_t>(layer)];
}

void* WeightStore::resident_data(int layer) const {
  block_at(layer, "resident_data");
  void* ptr = resident_at_[static_cast<std::size_t>(layer)];
  REVIVA_CHECK_ARG(resident_[static_cast<std::size_t>(layer)], "WeightStore::resident_data: layer ",
                   layer, " is not resident");
  REVIVA_CHECK_ARG(ptr != nullptr, "WeightStore::resident_data: layer ", layer,
                   " is resident but its fill has not been issued yet (Note [Resident fills as "
                   "compute nears]: it is issued as compute comes near it, at the latest at its "
                   "acquire)");
  return ptr;
}

bool WeightStore::acquired(int layer) const {
  block_at(layer, "acquired");
  return acquired_[static_cast<std::size_t>(layer)] != nullptr;
}

// Note [Streamed weights]: the resident layers' bytes and `slots` of the largest streamed layer
// of the cycle (slot_bytes 0), or of the largest streamed layer where every one is on demand (a
// slot of the empty cycle's 0 bytes would let none of them in).
std::size_t WeightStore::budget_for(int slots) const {
  std::size_t held = 0, streamed = 0;
  for (std::size_t i = 0; i < blocks_.size(); ++i) {
    if (resident_[i])
      held += bytes_of(i);
    else
      streamed = std::max(streamed, bytes_of(i));
  }
  std::size_t slot = options_.slot_bytes;
  if (slot == 0) slot = largest_cycled();
  if (slot == 0) slot = streamed;
  return std::max<std::size_t>(held + static_cast<std::size_t>(slots) * slot, 1);
}

// The largest streamed layer of the cycle (neither resident nor on demand).
std::size_t WeightStore::largest_cycled() const {
  std::size_t largest = 0;
  for (std::size_t i = 0; i < blocks_.size(); ++i)
    if (!resident_[i] && !on_demand_[i]) largest = std::max(largest, bytes_of(i));
  return largest;
}

// The layers of one step in use order (Note [Declared orders]): set_order's, or each once.
std::vector<std::size_t> WeightStore::step_uses() const {
  std::vector<std::size_t> uses;
  if (order_.empty()) {
    for (std::size_t i = 0; i < blocks_.size(); ++i) uses.push_back(i);
  } else {
    for (int layer : order_) uses.push_back(static_cast<std::size_t>(layer));
  }
  return uses;
}

void WeightStore::declare_cycle() {
  PrefetchSchedulerOptions so;
  so.prefetch_groups = prefetch_layers_;
  so.eager_offload = true;  // a released streamed layer needed after the window goes at once
  scheduler_ = std::make_unique<PrefetchScheduler>(*manager_, so);
  std::vector<std::vector<BlockId>> order;
  for (std::size_t i : step_uses())
    if (!resident_[i] && !on_demand_[i]) order.push_back({blocks_[i]});
  if (!order.empty()) scheduler_->declare_order(std::move(order));
}

// The cycle's first streamed layers, as many as the slots hold (each taking its device buffer's
// bytes: ArenaDeviceAllocator::set_min_bytes).
void WeightStore::prefetch_cycle_start() {
  if (slots_ == 0) return;
  const std::size_t room = budget_for(slots_) - budget_for(0);  // the slots' bytes
  const std::size_t least = allocator_->min_bytes();
  std::size_t queued = 0;
  std::vector<bool> seen(blocks_.size(), false);
  for (std::size_t i : step_uses()) {
    if (resident_[i] || on_demand_[i] || seen[i]) continue;
    seen[i] = true;
    queued += std::max(options_.layer_bytes[i], least);
    if (queued > room || !manager_->prefetch(blocks_[i])) break;
  }
}

void WeightStore::set_order(const std::vector<int>& order) {
  check_open("set_order");
  for (std::size_t i = 0; i < acquired_.size(); ++i)
    REVIVA_CHECK_ARG(acquired_[i] == nullptr, "WeightStore::set_order: layer ", i, " is acquired");
  std::vector<int> uses(static_cast<std::size_t>(first_view_), 0);
  for (int layer : order) {
    block_at(layer, "set_order");
    REVIVA_CHECK_ARG(layer < first_view_, "WeightStore::set_order: layer ", layer,
                     " is a view: views are fetched on demand, outside any order");
    ++uses[static_cast<std::size_t>(layer)];
  }
  if (!order.empty()) {
    const auto missing = std::find(uses.begin(), uses.end(), 0);
    REVIVA_CHECK_ARG(missing == uses.end(), "WeightStore::set_order: layer ",
                     missing - uses.begin(), " is not in the order (", order.size(),
                     " uses): every layer is used at least once a step");
  }
  if (order == order_) return;
  order_ = order;
  scheduler_.reset();
  declare_cycle();  // (from its first streamed layer)
}

void WeightStore::set_on_demand(const std::vector<int>& layers) {
  check_open("set_on_demand");
  for (std::size_t i = 0; i < acquired_.size(); ++i)
    REVIVA_CHECK_ARG(acquired_[i] == nullptr, "WeightStore::set_on_demand: layer ", i,
                     " is acquired");
  std::vector<bool> wanted(blocks_.size(), false);
  for (std::size_t i = static_cast<std::size_t>(first_view_); i < blocks_.size(); ++i)
    wanted[i] = true;
  for (int layer : layers) {
    block_at(layer, "set_on_demand");
    wanted[static_cast<std::size_t>(layer)] = true;
  }
  if (wanted == on_demand_) return;
  on_demand_ = std::move(wanted);
  scheduler_.reset();
  // The cycle changes, and with it the slots' room where that is the cycle's largest layer
  // (slot_bytes 0): a layer taken back into the cycle may be larger than any left in it (the room
  // stayed the old cycle's, and that layer's acquire found none). A slot_bytes given stays: a
  // caller who takes a larger layer back sets the room for it (set_slot_bytes).
  if (slots_ > 0 && options_.slot_bytes == 0) manager_->set_budget_bytes(budget_for(slots_));
  declare_cycle();  // (from its first streamed layer)
}

void WeightStore::set_slot_bytes(std::size_t bytes, std::size_t block_bytes) {
  check_open("set_slot_bytes");
  for (std::size_t i = 0; i < acquired_.size(); ++i)
    REVIVA_CHECK_ARG(acquired_[i] == nullptr, "WeightStore::set_slot_bytes: layer ", i,
                     " is acquired");
  // (layers on demand take the room they need at their acquire: Note [Blocks within a block])
  const std::size_t streamed = largest_cycled();
  REVIVA_CHECK_ARG(bytes == 0 || bytes >= streamed, "WeightStore::set_slot_bytes: slot_bytes ",
                   bytes, " cannot hold the largest streamed layer of the cycle (", streamed,
                   " bytes)");
  REVIVA_CHECK_ARG(block_bytes == 0 || block_bytes >= streamed,
                   "WeightStore::set_slot_bytes: block_bytes ", block_bytes,
                   " cannot hold the largest streamed layer (", streamed, " bytes)");
  if (bytes == options_.slot_bytes && block_bytes == allocator_->min_bytes()) return;
  options_.slot_bytes = bytes;
  allocator_->set_min_bytes(block_bytes);
  if (slots_ == 0) return;  // (nothing streams: the budget is the resident layers')
  // The streamed layers on the device leave (none is acquired: their last use was released, and
  // their memory is reused after it, in stream order; prefetched for a use that has not come,
  // they are clean: no copy), and the cycle starts again from its first streamed layer under
  // the new budget.
  scheduler_.reset();
  for (std::size_t i = 0; i < blocks_.size(); ++i)
    if (!resident_[i]) manager_->offload(blocks_[i]);
  manager_->set_budget_bytes(budget_for(slots_));
  declare_cycle();
  allocator_->trim();  // the memory they held goes back to the arena
  prefetch_cycle_start();
}

void* WeightStore::acquire(int layer, const Stream& compute) {
  const BlockId id = block_at(layer, "acquire");
  const auto i = static_cast<std::size_t>(layer);
  REVIVA_CHECK_ARG(acquired_[i] == nullptr, "WeightStore::acquire: layer ", layer,
                   " is already acquired");
  fill_resident_near(layer);  // (Note [Resident fills as compute nears]; this one's, if resident)
  if (resident_[i]) {
    // (pinned since its fill; acquiring again orders `compute` after that fill)
    acquired_[i] = manager_->acquire(id, compute, Access::ReadOnly);
    return acquired_[i];
  }
  REVIVA_CHECK_ARG(slots_ > 0, "WeightStore::acquire: layer ", layer,
                   " streams and the store has no slots (call set_residency first)");
  const BlockState state = manager_->state(id);
  if (state == BlockState::Device || state == BlockState::ToDevice) ++slot_hits_;
  if (on_demand_[i]) {  // (Note [Blocks within a block]: fetched now, outside the cycle)
    acquired_[i] = manager_->acquire(id, compute, Access::ReadOnly);
    return acquired_[i];
  }
  const std::vector<void*> ptrs = scheduler_->acquire_group({&id, 1}, compute, Access::ReadOnly);
  acquired_[i] = ptrs.front();
  return ptrs.front();
}

void WeightStore::release(int layer, const Stream& compute) {
  const BlockId id = block_at(layer, "release");
  const auto i = static_cast<std::size_t>(layer);
  REVIVA_CHECK_ARG(acquired_[i] != nullptr, "WeightStore::release: layer ", layer,
                   " is not acquired");
  acquired_[i] = nullptr;
  if (resident_[i]) {
    manager_->release(id, compute);
  } else if (on_demand_[i]) {  // leaves at once (clean: its memory is reused after compute's use)
    manager_->release(id, compute);
    manager_->offload(id);
  } else {
    scheduler_->release_group({&id, 1}, compute);
  }
}

std::shared_ptr<ArenaBuffer> WeightStore::buffer(int layer) const {
  block_at(layer, "buffer");
  const auto i = static_cast<std::size_t>(layer);
  void* ptr = acquired_[i] != nullptr ? acquired_[i] : resident_at_[i];
  REVIVA_CHECK_ARG(ptr != nullptr, "WeightStore::buffer: layer ", layer,
                   " is neither acquired nor resident with its fill issued");
  return allocator_->buffer_of(ptr);
}

void WeightStore::trim() {
  check_open("trim");
  for (std::size_t i = 0; i < acquired_.size(); ++i)
    REVIVA_CHECK_ARG(acquired_[i] == nullptr, "WeightStore::trim: layer ", i, " is acquired");
  manager_->synchronize();  // prefetches in flight land first, so that they leave too
  for (std::size_t i = 0; i < blocks_.size(); ++i)
    if (!resident_[i]) manager_->offload(blocks_[i]);
  declare_cycle();  // (the next call's cycle starts from its first streamed layer)
  allocator_->trim();
}

void WeightStore::synchronize() {
  if (manager_)
    manager_->synchronize();
  else
    engine_->synchronize();
}

WeightStoreStats WeightStore::stats() {
  WeightStoreStats st;
  st.slots = slots_;
  st.prefetch_layers = prefetch_layers_;
  st.slot_hits = slot_hits_;
  for (std::size_t i = 0; i < static_cast<std::size_t>(first_view_); ++i) {  // (views: none)
    st.host_bytes += options_.layer_bytes[i];
    if (resident_[i]) {
      ++st.resident_layers;
      st.resident_bytes += options_.layer_bytes[i];
    } else {
      ++st.streamed_layers;
    }
  }
  if (!manager_) return st;
  const ManagerMetrics mm = manager_->metrics();
  st.fills = mm.prefetches + mm.prefetch_misses;
  st.prefetched_fills = mm.prefetches;
  st.bytes_to_device = mm.bytes_to_device;
  st.bytes_to_host = mm.bytes_to_host;
  st.compute_stall_ms = mm.compute_stall_ms;
  st.copy_to_device_ms = mm.to_device_busy_ms;
  st.overlap_ratio = mm.overlap_ratio;
  const ArenaAllocatorStats as = allocator_->stats();
  st.device_bytes = as.live_bytes + as.cached_bytes;
  st.peak_device_bytes = as.peak_bytes;
  return st;
}

std::vector<TimelineEvent> WeightStore::timeline() {
  return manager_ ? manager_->timeline() : std::vector<TimelineEvent>{};
}

std::vector<TimelineEvent> WeightStore::take_timeline() {
  return manager_ ? manager_->take_timeline() : std::vector<TimelineEvent>{};
}

}  // namespace reviva
