// WeightStore's residency (see weight_store.h): which layers stay on the device (set_residency),
// the budget and slots around them, and the fills of the resident layers, issued as compute comes
// near them (Note [Resident fills as compute nears]). The store itself (its blocks, the cycle,
// acquire and release: Note [Streamed weights]) is weight_store.cpp.
#include <reviva/error.h>
#include <reviva/weight_store.h>

#include <algorithm>
#include <utility>
#include <vector>

// Note [Resident fills as compute nears]
// set_residency used to fill every new resident layer at once: ~15.6 GB for the 32B shape on a
// 24 GB card, ~0.28 s on the copy stream. The first call of a process loads each kernel at its
// first launch (CUDA's lazy module loading), and a load waits for the work in flight on the
// device: the H200 at 60c6625 (torch.profiler of call 1) shows HF's first kernel of the call
// (generate's isin) launched at 107 ms and returning at 366 ms, the moment the copy stream drained,
// for ~0.26 s of call 1's 0.6 s before its first layer (a resident run's is ~0.23 s). So a new
// resident layer's fill is issued when compute acquires a layer within kFillAheadLayers whole
// layers' bytes before it (or at its own acquire), in layer order: what is in flight when a kernel
// loads is the prefetch window and those few fills, and the fill still lands long before compute
// reaches the layer. Its device address is known from its fill on (resident_data).
constexpr std::size_t kFillAheadLayers = 2;

namespace reviva {

void WeightStore::set_residency(const std::vector<int>& resident, int slots, int prefetch_layers,
                                const Stream& compute) {
  check_open("set_residency");
  for (std::size_t i = 0; i < acquired_.size(); ++i)
    REVIVA_CHECK_ARG(acquired_[i] == nullptr, "WeightStore::set_residency: layer ", i,
                     " is acquired");
  std::vector<bool> wanted(blocks_.size(), false);
  for (int layer : resident) {
    block_at(layer, "set_residency");
    REVIVA_CHECK_ARG(layer < first_view_, "WeightStore::set_residency: layer ", layer,
                     " is a view (of layer ",
                     options_.views[static_cast<std::size_t>(std::max(layer - first_view_, 0))].of,
                     "): views are fetched on demand, never resident");
    REVIVA_CHECK_ARG(!wanted[static_cast<std::size_t>(layer)], "WeightStore::set_residency: layer ",
                     layer, " is listed twice");
    wanted[static_cast<std::size_t>(layer)] = true;
  }
  // (views never are resident, and stream only where their layer does)
  const auto layers = static_cast<std::size_t>(first_view_);
  const bool streams = resident.size() < layers;
  REVIVA_CHECK_ARG(slots >= 0, "WeightStore::set_residency: slots must be >= 0, got ", slots);
  REVIVA_CHECK_ARG(!streams || slots >= 1, "WeightStore::set_residency: ", layers - resident.size(),
                   " layers stream, which needs a slot, got 0");
  REVIVA_CHECK_ARG(prefetch_layers >= 0 && prefetch_layers <= (streams ? slots : 0),
                   "WeightStore::set_residency: prefetch_layers must be in [0, slots] = [0, ",
                   streams ? slots : 0, "], got ", prefetch_layers);
  // Layers no longer resident leave after compute's work so far (clean: no copy), and so do
  // streamed layers on the device (prefetched at the end of the last call): the new cycle starts
  // from its first streamed layer.
  scheduler_.reset();  // (a new cycle below)
  for (std::size_t i = 0; i < blocks_.size(); ++i) {
    if (wanted[i]) continue;
    if (resident_at_[i] != nullptr) {  // the store's hold ends
      manager_->release(blocks_[i], compute);
      resident_at_[i] = nullptr;
    }
    resident_[i] = false;
    manager_->offload(blocks_[i]);
  }
  resident_ = wanted;  // the budget holds the resident layers and the slots
  unfilled_ = 0;
  for (std::size_t i = 0; i < blocks_.size(); ++i)
    if (resident_[i] && resident_at_[i] == nullptr) ++unfilled_;
  slots_ = streams ? slots : 0;
  prefetch_layers_ = streams ? prefetch_layers : 0;
  manager_->set_budget_bytes(budget_for(slots_));
  // The cycle's first streamed layers are copied first, as much as the slots hold, then the
  // resident layers among the first (Note [Resident fills as compute nears]): the copy stream is
  // FIFO, and a first streamed layer queued behind resident fills would hold the call's first
  // layer up for them (Note [Streamed weights]).
  const Stream& h2d = engine_->stream(Direction::HostToDevice);
  allocator_->trim();  // the memory of layers that left goes back to the arena
  try {
    reserve_unfilled(h2d);
    prefetch_cycle_start();
    fill_resident_near(0);
  } catch (...) {
    // Every layer streamed, no slots: the caller plans again with less.
    for (std::size_t i = 0; i < blocks_.size(); ++i) {
      if (resident_at_[i] != nullptr) manager_->release(blocks_[i], h2d);
      resident_at_[i] = nullptr;
      manager_->offload(blocks_[i]);
    }
    resident_.assign(blocks_.size(), false);
    unfilled_ = 0;
    slots_ = 0;
    prefetch_layers_ = 0;
    manager_->set_budget_bytes(1);
    declare_cycle();
    allocator_->trim();
    throw;
  }
  declare_cycle();
}

// Note [Resident fills as compute nears]: the memory of the resident layers whose fills are to
// come is mapped now, so that an arena too small for them is found here (OutOfMemory, before the
// call's compute), not at an acquire in the middle of a call: each buffer is allocated and freed
// at once, and stays mapped in the allocator's cache, from which the fills take it.
void WeightStore::reserve_unfilled(const Stream& stream) {
  std::vector<std::pair<void*, std::size_t>> held;
  try {
    for (std::size_t i = 0; i < blocks_.size(); ++i) {
      if (!resident_[i] || resident_at_[i] != nullptr) continue;
      const std::size_t n = bytes_of(i);
      held.emplace_back(allocator_->allocate(n, stream.handle()), n);
    }
  } catch (...) {
    for (const auto& [ptr, n] : held) allocator_->deallocate(ptr, n, stream.handle());
    throw;
  }
  for (const auto& [ptr, n] : held) allocator_->deallocate(ptr, n, stream.handle());
}

// Note [Resident fills as compute nears]: the fills of the resident layers from `layer` on whose
// start lies within kFillAheadLayers whole layers' bytes of it, in order. The store holds them
// through the copy stream, not compute: compute is ordered after a resident layer's fill only
// when it acquires that layer (held through compute, the call's first synchronization waited for
// every fill: the H200, 32B shape at 10ddabe, 0.27 s of call 1 before its first layer). A fill
// the arena cannot give memory for throws OutOfMemory; the layer stays resident and unfilled.
void WeightStore::fill_resident_near(int layer) {
  if (unfilled_ == 0) return;  // (every acquire asks: after a call's first pass, none is left)
  const std::size_t reach = kFillAheadLayers * std::max(options_.slot_bytes, largest_);
  const Stream& h2d = engine_->stream(Direction::HostToDevice);
  std::size_t ahead = 0;
  const auto layers = static_cast<std::size_t>(first_view_);  // (views are never resident)
  for (auto i = static_cast<std::size_t>(layer); i < layers && ahead <= reach; ++i) {
    if (resident_[i] && resident_at_[i] == nullptr) {
      resident_at_[i] = manager_->acquire(blocks_[i], h2d, Access::ReadOnly);
      --unfilled_;
    }
    ahead += options_.layer_bytes[i];
  }
}

}  // namespace reviva
