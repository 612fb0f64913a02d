// KVStore (see kv_store.h). How the lifetime protocol (Note [Lifetime protocol] in
// offload_manager.cpp) applies to the store:
//   rule 1: an append's D2H starts after an event recorded on compute when wrote() is called;
//   rule 2: a slot is refilled only after the compute event recorded at its release and after
//           the last D2H that read it (the H2D stream waits on both); a buffer's memory goes
//           back to the arena only after every stream that used it (ArenaBuffer::record_use);
//   rule 3: compute waits on a slot's fill at acquire;
//   rule 4: host copies record every copy stream that used them; a fill of a layer waits for the
//           last append to its host copy, so it never reads bytes still being written;
//   rule 5: the store takes no lock (single-threaded).
#include <reviva/error.h>
#include <reviva/kv_store.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

namespace reviva {

struct KVStore::Slot {
  std::shared_ptr<ArenaBuffer> buffer;
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
  std::shared_ptr<ArenaBuffer> buffer;  // resident layers
  PinnedBlock host;                     // streamed layers: the host copy, once it has tokens
  Transfer arrival;                     // promoted layers: the H2D that brought their prefix in
  std::size_t length = 0;
  int slot = -1;         // streamed layers: the slot holding it, if any
  Transfer last_append;  // last D2H into its host copy
};

KVStore::KVStore(std::shared_ptr<TransferEngine> engine, std::shared_ptr<DeviceArena> arena,
                 KVStoreOptions options)
    : engine_(std::move(engine)), arena_(std::move(arena)), options_(options) {
  REVIVA_CHECK_ARG(engine_ != nullptr, "KVStore: engine is null");
  REVIVA_CHECK_ARG(arena_ != nullptr, "KVStore: arena is null");
  backend_ = engine_->stream(Direction::HostToDevice).backend_ptr();
  append_producer_ = std::make_unique<Event>(backend_);
  REVIVA_CHECK_ARG(options_.num_layers > 0, "KVStore: num_layers must be > 0, got ",
                   options_.num_layers);
  REVIVA_CHECK_ARG(options_.token_bytes > 0, "KVStore: token_bytes must be > 0");
  REVIVA_CHECK_ARG(options_.capacity_tokens > 0, "KVStore: capacity_tokens must be > 0");
  REVIVA_CHECK_ARG(options_.capacity_tokens <= (std::size_t{1} << 40) / options_.token_bytes,
                   "KVStore: ", options_.capacity_tokens, " tokens of ", options_.token_bytes,
                   " bytes exceed what a layer may hold (1 TiB)");
  REVIVA_CHECK_ARG(options_.prefetch_layers >= 0, "KVStore: prefetch_layers must be >= 0, got ",
                   options_.prefetch_layers);
  layers_.resize(static_cast<std::size_t>(options_.num_layers));
  for (int i = 0; i < options_.num_layers; ++i) streamed_.push_back(i);
  stats_.streamed_layers = options_.num_layers;
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
  // Copies in flight read or write the buffers and host copies given back below.
  engine_->synchronize();
  for (Slot& s : slots_) s.buffer.reset();  // retired after their recorded uses
  for (Layer& l : layers_) {
    l.buffer.reset();
    l.host.reset();  // to the pool, reused after the copy streams that used it
  }
  note_device_bytes();
}

void KVStore::check_open(const char* what) const {
  REVIVA_CHECK_ARG(!closed_, "KVStore::", what,
                   ": the store is closed (its memory was given back)");
}

std::size_t KVStore::layer_bytes() const noexcept {
  return options_.token_bytes * options_.capacity_tokens;
}

KVStore::Layer& KVStore::layer_at(int layer, const char* what) {
  check_open(what);
  REVIVA_CHECK_ARG(layer >= 0 && layer < options_.num_layers, "KVStore::", what, ": layer ", layer,
                   " out of range [0, ", options_.num_layers, ")");
  return layers_[static_cast<std::size_t>(layer)];
}
const KVStore::Layer& KVStore::layer_at(int layer, const char* what) const {
  return const_cast<KVStore*>(this)->layer_at(layer, what);
}

ArenaBuffer& KVStore::acquired_buffer(int layer, const char* what) const {
  const Layer& l = layer_at(layer, what);
  REVIVA_CHECK_ARG(l.acquired, "KVStore::", what, ": layer ", layer, " is not acquired");
  return l.resident ? *l.buffer : *slots_[static_cast<std::size_t>(l.slot)].buffer;
}

void KVStore::note_device_bytes() {
  std::size_t bytes = 0;
  for (const Slot& s : slots_)
    if (s.buffer) bytes += s.buffer->mapped_bytes();
  for (const Layer& l : layers_)
    if (l.buffer) bytes += l.buffer->mapped_bytes();
  stats_.device_bytes = bytes;
  stats_.peak_device_bytes = std::max(stats_.peak_device_bytes, bytes);
}

void KVStore::make_resident(int layer) {
  Layer& l = layer_at(layer, "make_resident");
  REVIVA_CHECK_ARG(!l.resident, "KVStore::make_resident: layer ", layer, " is already resident");
  REVIVA_CHECK_ARG(!started_, "KVStore::make_resident: layer ", layer,
                   ": residency is fixed once a layer was acquired (use promote)");
  become_resident(layer, arena_->allocate(layer_bytes(), "K/V of layer " + std::to_string(layer)));
}

void KVStore::become_resident(int layer, std::shared_ptr<ArenaBuffer> buffer) {
  Layer& l = layers_[static_cast<std::size_t>(layer)];
  l.resident = true;
  l.buffer = std::move(buffer);
  streamed_.erase(std::remove(streamed_.begin(), streamed_.end(), layer), streamed_.end());
  ++stats_.resident_layers;
  --stats_.streamed_layers;
}

// Removes slot `s` from the free list if it is parked there (released, still holding a layer).
void KVStore::unpark(int s) {
  auto parked = std::find(free_slots_.begin(), free_slots_.end(), s);
  if (parked != free_slots_.end()) free_slots_.erase(parked);
}

// H2D of `l`'s valid prefix from its host copy into `dst` (mapped for it), after the last
// append to it (rule 4: the host copy is whole). Invalid when the layer holds no tokens.
Transfer KVStore::copy_prefix_in(Layer& l, ArenaBuffer& dst) {
  if (l.length == 0) return {};
  const Stream& h2d = engine_->stream(Direction::HostToDevice);
  if (l.last_append.valid()) l.last_append.enqueue_wait(h2d);
  const std::size_t bytes = l.length * options_.token_bytes;
  l.host.record_use(engine_->stream_ptr(Direction::HostToDevice));
  stats_.bytes_to_device += bytes;
  CopyRequest request{dst.data(), l.host.data(), bytes};
  Transfer t = engine_->copy_batch(Direction::HostToDevice, {&request, 1});
  dst.record_use(h2d);
  return t;
}

bool KVStore::promote(int layer) {
  Layer& l = layer_at(layer, "promote");
  REVIVA_CHECK_ARG(!l.resident, "KVStore::promote: layer ", layer, " is already resident");
  REVIVA_CHECK_ARG(!l.acquired, "KVStore::promote: layer ", layer, " is acquired");
  auto buffer = arena_->allocate(layer_bytes(), "K/V of layer " + std::to_string(layer));
  if (!buffer->try_grow_to(l.length * options_.token_bytes)) {
    ++stats_.promotion_failures;
    return false;
  }
  if (l.slot >= 0) {  // it leaves its slot, which becomes free (if it was reserved, too)
    const int s = l.slot;
    slots_[static_cast<std::size_t>(s)].layer = -1;
    l.slot = -1;
    unpark(s);
    free_slots_.push_back(s);
  }
  l.arrival = copy_prefix_in(l, *buffer);
  // Rule 4: the pool reuses the host copy only after the copies that used it complete.
  if (l.host) stats_.host_bytes -= l.host.size();
  l.host.reset();
  l.last_append = Transfer{};
  become_resident(layer, std::move(buffer));
  ++stats_.promotions;
  note_device_bytes();
  return true;
}

void KVStore::add_slot() {
  check_open("add_slot");
  Slot s;
  s.buffer = arena_->allocate(layer_bytes(), "K/V staging slot " + std::to_string(slots_.size()));
  s.released = std::make_unique<Event>(backend_);
  slots_.push_back(std::move(s));
  free_slots_.push_back(static_cast<int>(slots_.size()) - 1);
  ++stats_.slots;
}

// Takes a free slot for a layer whose prefix needs `need` bytes: the least recently released
// one whose memory already holds that much, else the least recently released one (which must
// map more). -1 when none is free.
bool KVStore::drop_slot() {
  check_open("drop_slot");
  if (stats_.slots <= 1 && !streamed_.empty()) return false;
  int s = -1;
  if (!free_slots_.empty()) {
    s = take_free_slot(0);
  } else {  // a slot a prefetch filled for a layer not acquired yet: that layer is filled again
    s = take_prefetched_slot();
    if (s < 0) return false;
  }
  Slot& slot = slots_[static_cast<std::size_t>(s)];
  // Whatever still reads or writes it (a fill, an append) is ordered before the memory goes:
  // the buffer's recorded uses (rule 2), and the transfers the slot remembers are waited for
  // by the arena through those same streams.
  slot.buffer.reset();
  slot.fill = slot.previous_fill = slot.last_read = Transfer{};
  --stats_.slots;
  note_device_bytes();
  return true;
}

// A slot holding a layer a prefetch filled and compute has not acquired yet (not on the free
// list); its layer loses it. -1 when every slot is acquired.
int KVStore::take_prefetched_slot() {
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    Slot& slot = slots_[i];
    if (!slot.buffer || slot.acquired) continue;
    if (slot.layer >= 0) layers_[static_cast<std::size_t>(slot.layer)].slot = -1;
    slot.layer = -1;
    return static_cast<int>(i);
  }
  return -1;
}

int KVStore::take_free_slot(std::size_t need) {
  if (free_slots_.empty()) return -1;
  auto chosen = std::find_if(free_slots_.begin(), free_slots_.end(), [&](int s) {
    return slots_[static_cast<std::size_t>(s)].buffer->mapped_bytes() >= need;
  });
  if (chosen == free_slots_.end()) chosen = free_slots_.begin();
  const int s = *chosen;
  free_slots_.erase(chosen);
  Slot& slot = slots_[static_cast<std::size_t>(s)];
  if (slot.layer >= 0) layers_[static_cast<std::size_t>(slot.layer)].slot = -1;
  slot.layer = -1;
  return s;
}

// Puts `layer`'s valid prefix into a free slot, mapping the slot's memory for it if needed.
int KVStore::fill(int layer, bool prefetch) {
  Layer& l = layers_[static_cast<std::size_t>(layer)];
  const std::size_t need = l.length * options_.token_bytes;
  // A layer compute needs now may take a slot a prefetch filled for a later one (out of the
  // cycle's order, or after a slot was dropped); a prefetch never does.
  const int s = !free_slots_.empty() ? take_free_slot(need)
                : prefetch           ? -1
                                     : take_prefetched_slot();
  if (s < 0) return 0;
  Slot& slot = slots_[static_cast<std::size_t>(s)];
  // Memory before anything else changes: a slot that cannot be had narrows the window.
  bool mapped = true;
  if (prefetch) {
    mapped = slot.buffer->try_grow_to(need);
  } else {
    try {
      slot.buffer->grow_to(need);
    } catch (...) {
      free_slots_.push_front(s);
      throw;
    }
  }
  if (!mapped) {
    free_slots_.push_front(s);
    ++stats_.prefetches_without_memory;
    return -1;
  }
  slot.layer = layer;
  l.slot = s;
  note_device_bytes();
  if (l.length == 0) {
    // Nothing to copy: the slot is reserved, and compute, which will write into it, waits for
    // the appends of its previous layer still reading it (rule 2) and for a fill of a previous
    // layer still writing it (a prefetch whose layer was promoted).
    slot.previous_fill = slot.fill;
    slot.fill = slot.last_read;
    return 1;
  }
  slot.previous_fill = Transfer{};
  const Stream& h2d = engine_->stream(Direction::HostToDevice);
  h2d.wait(*slot.released);  // rule 2: compute is done with it (no-op if never released)
  if (slot.last_read.valid()) slot.last_read.enqueue_wait(h2d);  // rule 2: appends read it
  slot.fill = copy_prefix_in(l, *slot.buffer);
  ++stats_.fills;
  if (prefetch) ++stats_.prefetched_fills;
  return 1;
}

// Fills the next `prefetch_layers` streamed layers of the cycle after `layer`, while slots and
// memory last; a layer still parked in a released slot is kept there (taken off the free list).
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
    if (fill(next, /*prefetch=*/true) <= 0) return;
  }
}

// A streamed layer's host copy, when it first gets tokens (so that a layer promoted before then
// never pins any). A new slab may synchronize the device: PinnedHostPool::reserve ahead of the
// call avoids that (the pool then serves this from its cache).
void KVStore::allocate_host_copy(Layer& l) {
  const auto t0 = std::chrono::steady_clock::now();
  l.host = engine_->pool().allocate(layer_bytes());
  stats_.host_copy_wait_ms +=
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  stats_.host_bytes += l.host.size();
}

void* KVStore::acquire(int layer, const Stream& compute) {
  Layer& l = layer_at(layer, "acquire");
  REVIVA_CHECK_ARG(!l.acquired, "KVStore::acquire: layer ", layer, " is already acquired");
  started_ = true;
  if (l.resident) {
    if (l.arrival.valid()) {  // a promoted layer's prefix: rule 3, once
      l.arrival.enqueue_wait(compute);
      l.arrival = Transfer{};
    }
    l.acquired = true;
    prefetch_after(layer);
    return l.buffer->data();
  }
  if (l.slot >= 0) {
    ++stats_.slot_hits;
    unpark(l.slot);
  } else if (fill(layer, /*prefetch=*/false) == 0) {
    REVIVA_CHECK_ARG(false, "KVStore::acquire: layer ", layer, " needs a slot, but all ",
                     slots_.size(), " slots are acquired (release layers, or add slots)");
  }
  Slot& slot = slots_[static_cast<std::size_t>(l.slot)];
  if (slot.previous_fill.valid()) {
    slot.previous_fill.enqueue_wait(compute);
    slot.previous_fill = Transfer{};
  }
  // Rule 3; the engine measures how long compute waits (the one stall meter).
  if (slot.fill.valid()) engine_->wait_on(slot.fill, compute);
  slot.acquired = true;
  l.acquired = true;
  prefetch_after(layer);
  return slot.buffer->data();
}

void KVStore::reserve(int layer, std::size_t tokens) {
  ArenaBuffer& b = acquired_buffer(layer, "reserve");
  REVIVA_CHECK_ARG(tokens <= options_.capacity_tokens, "KVStore::reserve: ", tokens,
                   " tokens exceed the capacity of ", options_.capacity_tokens, " tokens");
  b.grow_to(tokens * options_.token_bytes);
  note_device_bytes();
}

std::size_t KVStore::reserved_tokens(int layer) const {
  return acquired_buffer(layer, "reserved_tokens").mapped_bytes() / options_.token_bytes;
}

std::shared_ptr<ArenaBuffer> KVStore::buffer(int layer) const {
  const Layer& l = layer_at(layer, "buffer");
  REVIVA_CHECK_ARG(l.acquired, "KVStore::buffer: layer ", layer, " is not acquired");
  return l.resident ? l.buffer : slots_[static_cast<std::size_t>(l.slot)].buffer;
}

void KVStore::wrote(int layer, std::size_t first, std::size_t count, const Stream& compute) {
  Layer& l = layer_at(layer, "wrote");
  REVIVA_CHECK_ARG(l.acquired, "KVStore::wrote: layer ", layer, " is not acquired");
  REVIVA_CHECK_ARG(first <= l.length, "KVStore::wrote: tokens from ", first, " would leave a gap",
                   " after the layer's ", l.length, " tokens");
  REVIVA_CHECK_ARG(count <= options_.capacity_tokens && first <= options_.capacity_tokens - count,
                   "KVStore::wrote: tokens [", first, ", ", first + count,
                   ") exceed the capacity of ", options_.capacity_tokens, " tokens");
  ArenaBuffer& buffer = acquired_buffer(layer, "wrote");
  REVIVA_CHECK_ARG((first + count) * options_.token_bytes <= buffer.mapped_bytes(),
                   "KVStore::wrote: tokens [", first, ", ", first + count, ") of layer ", layer,
                   " were not reserved (", buffer.mapped_bytes() / options_.token_bytes,
                   " tokens are): call reserve() before compute writes them");
  l.length = std::max(l.length, first + count);
  if (l.resident || count == 0) return;
  if (!l.host) allocate_host_copy(l);
  Slot& slot = slots_[static_cast<std::size_t>(l.slot)];
  append_producer_->record(compute);  // rule 1 (the copy's wait captures this record)
  const std::size_t offset = first * options_.token_bytes;
  const std::size_t bytes = count * options_.token_bytes;
  CopyRequest request{static_cast<char*>(l.host.data()) + offset,
                      static_cast<const char*>(slot.buffer->data()) + offset, bytes};
  l.host.record_use(engine_->stream_ptr(Direction::DeviceToHost));
  Transfer t = engine_->copy_batch(Direction::DeviceToHost, {&request, 1}, append_producer_.get());
  slot.buffer->record_use(engine_->stream(Direction::DeviceToHost));
  l.last_append = t;
  slot.last_read = t;
  stats_.bytes_to_host += bytes;
}

void KVStore::release(int layer, const Stream& compute) {
  Layer& l = layer_at(layer, "release");
  REVIVA_CHECK_ARG(l.acquired, "KVStore::release: layer ", layer, " is not acquired");
  l.acquired = false;
  if (l.resident) {
    l.buffer->record_use(compute);
    return;
  }
  Slot& slot = slots_[static_cast<std::size_t>(l.slot)];
  slot.buffer->record_use(compute);
  slot.released->record(compute);
  slot.acquired = false;
  free_slots_.push_back(l.slot);
  prefetch_after(layer);
}

std::size_t KVStore::length(int layer) const { return layer_at(layer, "length").length; }
bool KVStore::resident(int layer) const { return layer_at(layer, "resident").resident; }

void KVStore::synchronize() { engine_->synchronize(); }

KVStoreStats KVStore::stats() { return stats_; }

void KVStore::clear() {
  check_open("clear");
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
    if (!slots_[s].buffer) continue;  // dropped
    slots_[s].layer = -1;
    slots_[s].fill = Transfer{};
    slots_[s].last_read = Transfer{};
    free_slots_.push_back(static_cast<int>(s));
  }
}

}  // namespace reviva
