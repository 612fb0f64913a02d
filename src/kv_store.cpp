// KVStore (see kv_store.h). How the lifetime protocol (Note [Lifetime protocol] in
// offload_manager.cpp) applies to the store:
//   rule 1: an append's D2H starts after an event recorded on compute when wrote() is called;
//   rule 2: a slot is refilled only after the compute event recorded at its release and after
//           the last D2H that read it (the H2D stream waits on both);
//   rule 3: compute waits on a slot's fill at acquire;
//   rule 4: host copies record every copy stream that used them; a fill of a layer waits for the
//           last append to its host copy, so it never reads bytes still being written;
//   rule 5: the store takes no lock (single-threaded).
#include <reviva/error.h>
#include <reviva/kv_store.h>

#include <algorithm>
#include <cstdio>
#include <string>

namespace reviva {

namespace {
// A stall shorter than this is timer noise, not compute waiting for a copy (as in the manager).
constexpr double kStallThresholdMs = 0.01;
}  // namespace

struct KVStore::Slot {
  std::vector<void*> buffers;
  int layer = -1;  // the layer whose prefix it holds (or is being filled with)
  bool acquired = false;
  Transfer fill;           // last H2D into the slot
  Transfer previous_fill;  // a fill of an earlier layer that may still be landing
  Transfer last_read;      // last D2H that read the slot
  // On compute, where its last user released it. Re-recorded at each release: a wait captures
  // the record current when the wait is enqueued (CUDA's semantics, and the host backend's).
  std::unique_ptr<Event> released;
};

struct KVStore::Layer {
  bool resident = false;
  bool acquired = false;
  std::vector<void*> buffers;     // resident layers
  std::vector<PinnedBlock> host;  // streamed layers: the host copies, one per tensor
  Transfer arrival;               // promoted layers: the H2D that brought their prefix in
  std::size_t length = 0;
  int slot = -1;         // streamed layers: the slot holding it, if any
  Transfer last_append;  // last D2H into its host copy
};

struct KVStore::Stall {
  std::shared_ptr<Event> before;
  std::shared_ptr<Event> after;
};

KVStore::KVStore(std::shared_ptr<TransferEngine> engine, KVStoreOptions options)
    : engine_(std::move(engine)), options_(options) {
  REVIVA_CHECK_ARG(engine_ != nullptr, "KVStore: engine is null");
  backend_ = engine_->stream(Direction::HostToDevice).backend_ptr();
  append_producer_ = std::make_unique<Event>(backend_);
  REVIVA_CHECK_ARG(options_.num_layers > 0, "KVStore: num_layers must be > 0, got ",
                   options_.num_layers);
  REVIVA_CHECK_ARG(options_.tensors_per_layer > 0, "KVStore: tensors_per_layer must be > 0, got ",
                   options_.tensors_per_layer);
  REVIVA_CHECK_ARG(options_.token_bytes > 0, "KVStore: token_bytes must be > 0");
  REVIVA_CHECK_ARG(options_.capacity_tokens > 0, "KVStore: capacity_tokens must be > 0");
  REVIVA_CHECK_ARG(options_.prefetch_layers >= 0, "KVStore: prefetch_layers must be >= 0, got ",
                   options_.prefetch_layers);
  layers_.resize(static_cast<std::size_t>(options_.num_layers));
  for (int i = 0; i < options_.num_layers; ++i) streamed_.push_back(i);
  stats_.streamed_layers = options_.num_layers;
}

KVStore::~KVStore() {
  try {
    // Copies in flight read or write memory the caller frees after this.
    engine_->synchronize();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "reviva: KVStore destroyed with copies failing: %s\n", e.what());
  }
}

std::size_t KVStore::buffer_bytes() const noexcept {
  return options_.token_bytes * options_.capacity_tokens;
}

KVStore::Layer& KVStore::layer_at(int layer, const char* what) {
  REVIVA_CHECK_ARG(layer >= 0 && layer < options_.num_layers, "KVStore::", what, ": layer ", layer,
                   " out of range [0, ", options_.num_layers, ")");
  return layers_[static_cast<std::size_t>(layer)];
}
const KVStore::Layer& KVStore::layer_at(int layer, const char* what) const {
  return const_cast<KVStore*>(this)->layer_at(layer, what);
}

void KVStore::check_buffers(const std::vector<void*>& buffers, const char* what) const {
  REVIVA_CHECK_ARG(buffers.size() == static_cast<std::size_t>(options_.tensors_per_layer),
                   "KVStore::", what, ": ", buffers.size(), " buffers given, expected ",
                   options_.tensors_per_layer);
  for (void* b : buffers) REVIVA_CHECK_ARG(b != nullptr, "KVStore::", what, ": null buffer");
}

void KVStore::make_resident(int layer, std::vector<void*> buffers) {
  Layer& l = layer_at(layer, "make_resident");
  check_buffers(buffers, "make_resident");
  REVIVA_CHECK_ARG(!l.resident, "KVStore::make_resident: layer ", layer, " is already resident");
  REVIVA_CHECK_ARG(!host_ready_, "KVStore::make_resident: layer ", layer,
                   ": residency is fixed once a layer was acquired");
  become_resident(layer, std::move(buffers));
}

void KVStore::become_resident(int layer, std::vector<void*> buffers) {
  Layer& l = layers_[static_cast<std::size_t>(layer)];
  l.resident = true;
  l.buffers = std::move(buffers);
  streamed_.erase(std::remove(streamed_.begin(), streamed_.end(), layer), streamed_.end());
  ++stats_.resident_layers;
  --stats_.streamed_layers;
}

// Removes slot `s` from the free list if it is parked there (released, still holding a layer).
void KVStore::unpark(int s) {
  auto parked = std::find(free_slots_.begin(), free_slots_.end(), s);
  if (parked != free_slots_.end()) free_slots_.erase(parked);
}

// H2D of `l`'s valid prefix from its host copies into `dst`, after the last append to them
// (rule 4: the host copy is whole). Invalid when the layer holds no tokens.
Transfer KVStore::copy_prefix_in(Layer& l, const std::vector<void*>& dst) {
  if (l.length == 0) return {};
  if (l.last_append.valid()) l.last_append.enqueue_wait(engine_->stream(Direction::HostToDevice));
  std::vector<CopyRequest> requests;
  const std::size_t bytes = l.length * options_.token_bytes;
  for (std::size_t t = 0; t < dst.size(); ++t) {
    requests.push_back({dst[t], l.host[t].data(), bytes});
    l.host[t].record_use(engine_->stream_ptr(Direction::HostToDevice));
  }
  stats_.bytes_to_device += bytes * dst.size();
  return engine_->copy_batch(Direction::HostToDevice, requests);
}

void KVStore::promote(int layer, std::vector<void*> buffers) {
  Layer& l = layer_at(layer, "promote");
  check_buffers(buffers, "promote");
  REVIVA_CHECK_ARG(!l.resident, "KVStore::promote: layer ", layer, " is already resident");
  REVIVA_CHECK_ARG(!l.acquired, "KVStore::promote: layer ", layer, " is acquired");
  if (l.slot >= 0) {  // it leaves its slot, which becomes free (if it was reserved, too)
    const int s = l.slot;
    slots_[static_cast<std::size_t>(s)].layer = -1;
    l.slot = -1;
    unpark(s);
    free_slots_.push_back(s);
  }
  l.arrival = copy_prefix_in(l, buffers);
  // Rule 4: the pool reuses the host copies only after the copies that used them complete.
  stats_.host_bytes -= l.host.size() * buffer_bytes();
  l.host.clear();
  l.last_append = Transfer{};
  become_resident(layer, std::move(buffers));
  ++stats_.promotions;
}

void KVStore::add_slot(std::vector<void*> buffers) {
  check_buffers(buffers, "add_slot");
  Slot s;
  s.buffers = std::move(buffers);
  s.released = std::make_unique<Event>(backend_);
  slots_.push_back(std::move(s));
  free_slots_.push_back(static_cast<int>(slots_.size()) - 1);
  ++stats_.slots;
}

int KVStore::take_free_slot() {
  if (free_slots_.empty()) return -1;
  const int s = free_slots_.front();
  free_slots_.pop_front();
  Slot& slot = slots_[static_cast<std::size_t>(s)];
  if (slot.layer >= 0) layers_[static_cast<std::size_t>(slot.layer)].slot = -1;
  slot.layer = -1;
  return s;
}

// Puts `layer`'s valid prefix into a free slot. False when no slot is free.
bool KVStore::fill(int layer, bool prefetch) {
  const int s = take_free_slot();
  if (s < 0) return false;
  Slot& slot = slots_[static_cast<std::size_t>(s)];
  Layer& l = layers_[static_cast<std::size_t>(layer)];
  slot.layer = layer;
  l.slot = s;
  if (l.length == 0) {
    // Nothing to copy: the slot is reserved, and compute, which will write into it, waits for
    // the appends of its previous layer still reading it (rule 2) and for a fill of a previous
    // layer still writing it (a prefetch whose layer was promoted).
    slot.previous_fill = slot.fill;
    slot.fill = slot.last_read;
    return true;
  }
  slot.previous_fill = Transfer{};
  const Stream& h2d = engine_->stream(Direction::HostToDevice);
  h2d.wait(*slot.released);  // rule 2: compute is done with it (no-op if never released)
  if (slot.last_read.valid()) slot.last_read.enqueue_wait(h2d);  // rule 2: appends read it
  slot.fill = copy_prefix_in(l, slot.buffers);
  ++stats_.fills;
  if (prefetch) ++stats_.prefetched_fills;
  return true;
}

// Fills the next `prefetch_layers` streamed layers of the cycle after `layer`, while slots last;
// a layer still parked in a released slot is kept there (taken off the free list).
void KVStore::prefetch_after(int layer) {
  if (streamed_.empty() || options_.prefetch_layers == 0) return;
  auto it = std::upper_bound(streamed_.begin(), streamed_.end(), layer);
  std::size_t pos = static_cast<std::size_t>(it - streamed_.begin());
  for (int k = 0; k < options_.prefetch_layers; ++k, ++pos) {
    const int next = streamed_[pos % streamed_.size()];
    if (next == layer) return;  // went round the whole cycle
    Layer& l = layers_[static_cast<std::size_t>(next)];
    if (l.slot >= 0) {
      unpark(l.slot);
      continue;
    }
    if (!fill(next, /*prefetch=*/true)) return;
  }
}

// The host copies of every streamed layer, at the first acquire (the residency is fixed from
// then on): pinned allocations can synchronize the device, so none is made once compute runs.
void KVStore::allocate_host_copies() {
  PinnedHostPool& pool = engine_->pool();
  for (int layer : streamed_) {
    Layer& l = layers_[static_cast<std::size_t>(layer)];
    while (l.host.size() < static_cast<std::size_t>(options_.tensors_per_layer)) {
      l.host.push_back(pool.allocate(buffer_bytes()));
      stats_.host_bytes += buffer_bytes();
    }
  }
  host_ready_ = true;
}

std::vector<void*> KVStore::acquire(int layer, const Stream& compute) {
  Layer& l = layer_at(layer, "acquire");
  if (!host_ready_) allocate_host_copies();
  REVIVA_CHECK_ARG(!l.acquired, "KVStore::acquire: layer ", layer, " is already acquired");
  if (l.resident) {
    if (l.arrival.valid()) {  // a promoted layer's prefix: rule 3, once
      l.arrival.enqueue_wait(compute);
      l.arrival = Transfer{};
    }
    l.acquired = true;
    prefetch_after(layer);
    return l.buffers;
  }
  if (l.slot >= 0) {
    ++stats_.slot_hits;
    unpark(l.slot);
  } else if (!fill(layer, /*prefetch=*/false)) {
    REVIVA_CHECK_ARG(false, "KVStore::acquire: layer ", layer, " needs a slot, but all ",
                     slots_.size(), " slots are acquired (release layers, or add slots)");
  }
  Slot& slot = slots_[static_cast<std::size_t>(l.slot)];
  if (slot.previous_fill.valid()) {
    slot.previous_fill.enqueue_wait(compute);
    slot.previous_fill = Transfer{};
  }
  if (slot.fill.valid()) {  // rule 3, with timing events around the wait
    Stall stall{std::make_shared<Event>(backend_, true), std::make_shared<Event>(backend_, true)};
    stall.before->record(compute);
    slot.fill.enqueue_wait(compute);
    stall.after->record(compute);
    stalls_.push_back(std::move(stall));
    if (stalls_.size() > 256) fold_stalls(/*wait=*/false);
  }
  slot.acquired = true;
  l.acquired = true;
  prefetch_after(layer);
  return slot.buffers;
}

void KVStore::wrote(int layer, std::size_t first, std::size_t count, const Stream& compute) {
  Layer& l = layer_at(layer, "wrote");
  REVIVA_CHECK_ARG(l.acquired, "KVStore::wrote: layer ", layer, " is not acquired");
  REVIVA_CHECK_ARG(first <= l.length, "KVStore::wrote: tokens from ", first, " would leave a gap",
                   " after the layer's ", l.length, " tokens");
  REVIVA_CHECK_ARG(count <= options_.capacity_tokens && first <= options_.capacity_tokens - count,
                   "KVStore::wrote: tokens [", first, ", ", first + count,
                   ") exceed the capacity of ", options_.capacity_tokens, " tokens");
  l.length = std::max(l.length, first + count);
  if (l.resident || count == 0) return;
  Slot& slot = slots_[static_cast<std::size_t>(l.slot)];
  append_producer_->record(compute);  // rule 1 (the copy's wait captures this record)
  std::vector<CopyRequest> requests;
  const std::size_t offset = first * options_.token_bytes;
  const std::size_t bytes = count * options_.token_bytes;
  for (std::size_t t = 0; t < slot.buffers.size(); ++t) {
    requests.push_back({static_cast<char*>(l.host[t].data()) + offset,
                        static_cast<const char*>(slot.buffers[t]) + offset, bytes});
    l.host[t].record_use(engine_->stream_ptr(Direction::DeviceToHost));
  }
  Transfer t = engine_->copy_batch(Direction::DeviceToHost, requests, append_producer_.get());
  l.last_append = t;
  slot.last_read = t;
  stats_.bytes_to_host += bytes * slot.buffers.size();
}

void KVStore::release(int layer, const Stream& compute) {
  Layer& l = layer_at(layer, "release");
  REVIVA_CHECK_ARG(l.acquired, "KVStore::release: layer ", layer, " is not acquired");
  l.acquired = false;
  if (l.resident) return;
  Slot& slot = slots_[static_cast<std::size_t>(l.slot)];
  slot.released->record(compute);
  slot.acquired = false;
  free_slots_.push_back(l.slot);
  prefetch_after(layer);
}

std::size_t KVStore::length(int layer) const { return layer_at(layer, "length").length; }
bool KVStore::resident(int layer) const { return layer_at(layer, "resident").resident; }

void KVStore::fold_stalls(bool wait) {
  std::vector<Stall> pending;
  for (Stall& s : stalls_) {
    if (wait) s.after->synchronize();
    if (!s.after->query()) {
      pending.push_back(std::move(s));
      continue;
    }
    const double ms = Event::elapsed_ms(*s.before, *s.after);
    if (ms > kStallThresholdMs) {
      stats_.compute_stall_ms += ms;
      ++stats_.stalls;
    }
  }
  stalls_ = std::move(pending);
}

void KVStore::synchronize() {
  engine_->synchronize();
  fold_stalls(/*wait=*/true);
}

KVStoreStats KVStore::stats() {
  fold_stalls(/*wait=*/false);
  return stats_;
}

void KVStore::clear() {
  for (const Layer& l : layers_) {
    REVIVA_CHECK_ARG(!l.acquired, "KVStore::clear: a layer is still acquired");
  }
  synchronize();
  for (Layer& l : layers_) {
    l.length = 0;
    l.slot = -1;
    l.last_append = Transfer{};
  }
  free_slots_.clear();
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    slots_[s].layer = -1;
    slots_[s].fill = Transfer{};
    slots_[s].last_read = Transfer{};
    free_slots_.push_back(static_cast<int>(s));
  }
}

}  // namespace reviva
