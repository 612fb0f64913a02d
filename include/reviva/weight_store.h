// WeightStore: a decoder's weights, layer by layer, kept in pinned host memory and brought to the
// device for the layers that do not fit it, for inference with models larger than the card.
//
// A layer's weights are one packed block (its parameters side by side, as the caller lays them
// out): a block of the store's OffloadManager whose contents are its pinned host copy (Note
// [Streamed weights] in weight_store.cpp). The host copy is the weights' one home: it is filled
// once, by the caller, before the layer is first used, and never written again, so a layer
// leaves the device without a copy and comes back with one H2D of its bytes. Device memory comes
// from the DeviceArena through an ArenaDeviceAllocator, under the manager's budget: each resident
// layer's bytes, and room for `slots` streamed layers at a time (the one in use and those being
// brought in).
//
// Resident layers are held on the device from set_residency() on (one H2D each, then no copies).
// The streamed ones are used in a cycle (a decode step's layers, then the next step's), declared
// to the store's PrefetchScheduler as its order: at each acquire it starts bringing in the next
// `prefetch_layers` streamed layers, and a released streamed layer needed later than the window
// leaves at once (its memory is reused for the next). A prefill uses the layers in the same
// order, once each, with more compute per layer: the same cycle serves it. Between calls,
// trim() gives the streamed layers' memory back and keeps the resident ones. Single-threaded.
#pragma once

#include <reviva/arena_device_allocator.h>
#include <reviva/device_arena.h>
#include <reviva/export.h>
#include <reviva/offload_manager.h>
#include <reviva/prefetch_scheduler.h>
#include <reviva/stream.h>
#include <reviva/transfer_engine.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace reviva {

// A block whose host copy is part of a layer's (Note [Blocks within a block] in
// weight_store.cpp): bytes [offset, offset + bytes) of layer `of`'s host copy.
struct WeightView {
  int of = 0;
  std::size_t offset = 0;
  std::size_t bytes = 0;
};

struct WeightStoreOptions {
  std::vector<std::size_t> layer_bytes;  // each layer's packed weights (> 0 each)
  // Views: view j is the store's layer layer_bytes.size() + j, fetched on demand (set_on_demand),
  // never resident, with no host copy of its own (e.g. one expert of a layer's experts, which
  // a decode step fetches alone where its router chose it).
  std::vector<WeightView> views;
  std::size_t timeline_capacity = 0;  // copy and stall events kept for timeline() (0: none)
  // The room of one slot. 0: the largest streamed layer. A caller that splits each of its layers
  // into consecutive blocks used one after the other (a decoder layer's attention, then its MLP:
  // Note [Layers in parts] in python/reviva/weights/packing.py) gives the largest whole layer here,
  // so that one slot holds a layer and the next block's copy goes into the memory its predecessor
  // just freed. At least the largest layer (block) of the store.
  std::size_t slot_bytes = 0;
};

struct WeightStoreStats {
  int resident_layers = 0;
  int streamed_layers = 0;
  int slots = 0;
  int prefetch_layers = 0;
  std::uint64_t fills = 0;             // H2D copies of a layer's weights
  std::uint64_t prefetched_fills = 0;  // of those, started ahead of use
  std::uint64_t slot_hits = 0;         // acquires of streamed layers that found them on the device
  std::uint64_t bytes_to_device = 0;   // H2D bytes landed
  std::uint64_t bytes_to_host = 0;     // D2H bytes (none: a layer leaves without a copy)
  double compute_stall_ms = 0.0;       // compute's waits for fills (the manager's meter)
  double copy_to_device_ms = 0.0;      // H2D copy-stream time of the landed fills
  double overlap_ratio = 1.0;          // Note [Overlap ratio], over the store's copies and stalls
  std::size_t host_bytes = 0;          // pinned bytes of the host copies (every layer)
  std::size_t resident_bytes = 0;      // bytes of the resident layers
  std::size_t device_bytes = 0;        // arena bytes mapped for the store now (held and cached)
  std::size_t peak_device_bytes = 0;   // the most at once
};

class REVIVA_API WeightStore {
 public:
  // Takes every layer's host copy from the engine's pinned pool now (throws OutOfMemory naming
  // the numbers when the pool cannot give it). Every layer starts streamed, with no slots.
  WeightStore(std::shared_ptr<TransferEngine> engine, std::shared_ptr<DeviceArena> arena,
              WeightStoreOptions options);
  ~WeightStore();  // close()
  WeightStore(const WeightStore&) = delete;
  WeightStore& operator=(const WeightStore&) = delete;

  // The layer's pinned host copy (layer_bytes(layer) bytes), for the caller to fill before the
  // layer's first use. Valid until close().
  void* host_data(int layer) const;
  std::size_t layer_bytes(int layer) const;
  int num_layers() const noexcept { return static_cast<int>(blocks_.size()); }  // views included
  bool view(int layer) const;  // whether `layer` is a view (WeightStoreOptions::views)

  // Which layers stay on the device (`resident`: distinct indices), the room for streamed layers
  // (`slots`: at least 1 while a layer streams) and how many streamed layers are brought in
  // ahead of use (`prefetch_layers` <= slots: with as many as the slots, the last of the window
  // comes in when a layer is released, into its memory: Note [Streamed weights]). Layers made
  // resident are fetched as compute comes near them (Note [Resident fills as compute nears] in
  // weight_store_residency.cpp: the first ones now, each at the latest at its acquire; compute
  // waits for a layer's fill only when it acquires it), layers no longer resident leave after the
  // work queued on `compute` so far. Not while a layer is acquired. Throws OutOfMemory naming the
  // numbers when the arena cannot give a resident layer's memory, here or at an acquire (the
  // store is then left with every layer streamed and no slots: call again with less).
  void set_residency(const std::vector<int>& resident, int slots, int prefetch_layers,
                     const Stream& compute);
  // The room of one slot from now on (WeightStoreOptions::slot_bytes; 0: the largest streamed
  // layer), e.g. a caller whose layers are split into blocks used one after the other needs a whole
  // layer's room where it acquires all of a layer's blocks at once (a prefill) and only the
  // largest two consecutive blocks' where it takes them one at a time (a decode step: Note
  // [Layers in parts] in python/reviva/weights/packing.py). Lowered, the streamed layers held
  // beyond the new budget leave (clean: no copy; one in flight is waited for), the cycle starts
  // again from its first streamed layer and the memory freed goes back to the arena. Not while a
  // layer is acquired. `block_bytes` (> 0): every streamed layer's device buffer takes that many
  // bytes (at least the largest streamed layer; ArenaDeviceAllocator::set_min_bytes), so that a
  // slot of two such buffers holds any two consecutive layers and the store maps no more than its
  // slots.
  void set_slot_bytes(std::size_t bytes, std::size_t block_bytes = 0);
  std::size_t slot_bytes() const noexcept { return options_.slot_bytes; }
  bool resident(int layer) const;
  // Streamed layers left out of the prefetch cycle from now on (Note [Blocks within a block]),
  // as views always are: such a layer is fetched when acquired (compute waits for its copy) and
  // leaves when released; one larger than a slot needs room the budget may lack (OutOfMemory at
  // its acquire). E.g. a decode step's experts, taken one by one through their views, leave
  // their layer's whole block out. The cycle starts again from its first streamed layer; with
  // slot_bytes 0 the slots' room follows the cycle's largest layer (a slot_bytes given stays: a
  // layer taken back into the cycle larger than it needs set_slot_bytes). Not while a layer is
  // acquired.
  void set_on_demand(const std::vector<int>& layers);
  bool on_demand(int layer) const;
  // The order in which one step uses the layers (Note [Declared orders] in weight_store.cpp):
  // each layer (views excepted) at least once, as often as the step uses it, e.g. a training
  // step's forward 0..n-1 then its backward n-1..0. Empty: every layer once, in index order (a
  // decode step's cycle, the default). The streamed layers of it, on demand ones left out, are
  // the prefetch cycle, which starts again from its first one. Not while a layer is acquired.
  void set_order(const std::vector<int>& order);
  const std::vector<int>& order() const noexcept { return order_; }
  // A resident layer's device address, valid while it stays resident (to lay views out over it),
  // from its fill's issue on (throws before). Its fill may still be in flight: compute reads it
  // only after acquire(), which orders compute after the fill.
  void* resident_data(int layer) const;

  // Compute is about to use `layer`: returns its device address, holding its weights for work
  // submitted to `compute` from now on (compute waits for their fill), until release(). Starts
  // bringing in the next streamed layers of the cycle.
  void* acquire(int layer, const Stream& compute);
  // Compute's use of the acquired layer ends with the work queued on `compute` so far.
  void release(int layer, const Stream& compute);
  bool acquired(int layer) const;
  // The arena buffer behind an acquired or resident layer (to keep its memory mapped while views
  // exist).
  std::shared_ptr<ArenaBuffer> buffer(int layer) const;

  // Between calls: streamed layers leave the device and the slots' memory goes back to the arena
  // (resident layers stay). Not while a layer is acquired.
  void trim();
  // Waits for every copy in flight.
  void synchronize();
  WeightStoreStats stats();
  std::vector<TimelineEvent> timeline();
  // The events so far, leaving none (OffloadManager::take_timeline).
  std::vector<TimelineEvent> take_timeline();
  // Waits for its copies, then gives every buffer back to the arena (stream-ordered after the
  // last use) and every host copy to the pool. The store is unusable afterwards. Idempotent.
  void close();
  bool closed() const noexcept { return closed_; }

 private:
  BlockId block_at(int layer, const char* what) const;
  void check_open(const char* what) const;
  std::vector<std::size_t> step_uses() const;
  void declare_cycle();
  void prefetch_cycle_start();
  void fill_resident_near(int layer);
  void reserve_unfilled(const Stream& stream);
  std::size_t budget_for(int slots) const;
  std::size_t largest_cycled() const;
  std::size_t bytes_of(std::size_t i) const;

  std::shared_ptr<TransferEngine> engine_;
  std::shared_ptr<DeviceArena> arena_;
  std::shared_ptr<ArenaDeviceAllocator> allocator_;
  WeightStoreOptions options_;
  std::unique_ptr<OffloadManager> manager_;
  std::unique_ptr<PrefetchScheduler> scheduler_;
  std::vector<BlockId> blocks_;     // one block per layer
  std::vector<void*> host_;         // each layer's host copy
  std::vector<bool> resident_;      // held on the device by the store (pinned in the manager)
  std::vector<bool> on_demand_;     // outside the cycle: fetched at acquire (views always)
  std::vector<int> order_;          // set_order's (empty: every layer once, in index order)
  int first_view_ = 0;              // the first view's index (after the layers)
  std::vector<void*> acquired_;     // the address of an acquired layer, null otherwise
  std::vector<void*> resident_at_;  // a resident layer's address once its fill is issued, or null
  std::size_t unfilled_ = 0;        // resident layers whose fill is not issued yet
  std::size_t largest_ = 0;         // the largest layer's bytes
  int slots_ = 0;
  int prefetch_layers_ = 0;
  std::uint64_t slot_hits_ = 0;
  bool closed_ = false;
};

}  // namespace reviva
