// KVStore's spilled layers (see kv_store.h): K/V on disk between uses.
//
// Note [Spilled layers]
// A streamed layer's K/V lives in its pinned host copy (write-through: Note [Append blocks]), so
// pinned host memory bounds the context: a 24 GB card with 64 GB of RAM stops near 400k tokens of
// an 8B model in bf16. A spilled layer (spill_to_disk) keeps its K/V in an extent of the store's
// DiskStore instead, and holds a pinned host copy only around its turn in the cycle:
//   - staging: its valid prefix is read from disk into a host copy from the pinned pool (whole
//     disk blocks, each checked against its checksum), which the manager then takes
//     (attach_host: Disk -> Host); from there it is fetched, used and written through like any
//     streamed layer;
//   - unstaging: once it is on the host again (offloaded: clean), the manager hands the host
//     copy back (detach_host: Host -> Disk, after its last write-through has landed), the rows
//     it gained since it was staged (from the disk block holding the first of them) are written
//     back, and the host copy returns to the pool once that write is done. A layer staged again
//     before then takes the same host copy back without a read (a staging hit).
// At most options.disk_staged_layers spilled layers hold host copies (the budget of pinned
// memory the spill needs): at each acquire, the `staged_limit()` spilled layers of the cycle
// starting at the one before the acquired layer are wanted; the others are unstaged and the
// wanted ones not staged start their reads, in cycle order. The layer before is wanted so that
// unstaging never waits for the compute that the GPU may still be running on the layer just
// released; the window's layers are wanted so that the scheduler can prefetch them once their
// reads land; the rest read ahead, keeping the disk busy while compute works. A read that has
// landed is handed to the manager at the next acquire or release (finish_ready_spills); an
// acquire of a layer whose read is still in flight waits for it (disk_wait_ms).
// A disk failure (EIO, a short read, a bad checksum) raises DiskError naming the file, block and
// offset from the call that waits for the request: never wrong rows. A failed read loses the
// layer's rows (its host copy was never filled): the store refuses it from then on, by name,
// until clear(). A failed write-back loses nothing: the host copy, still whole, goes back to the
// manager, and the next write-back starts again from the failed one's first block.
#include <reviva/error.h>
#include <reviva/kv_store.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

namespace reviva {

namespace {

double now_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::size_t round_up(std::size_t bytes, std::size_t unit) {
  return (bytes + unit - 1) / unit * unit;
}

}  // namespace

void KVStore::spill_to_disk(int layer) {
  const BlockId id = block_at(layer, "spill_to_disk");
  const auto i = static_cast<std::size_t>(layer);
  REVIVA_CHECK_ARG(options_.disk != nullptr, "KVStore::spill_to_disk: layer ", layer,
                   ": the store has no disk (KVStoreOptions::disk)");
  REVIVA_CHECK_ARG(!started_, "KVStore::spill_to_disk: layer ", layer,
                   ": residency is fixed once a layer was acquired");
  REVIVA_CHECK_ARG(!resident_[i], "KVStore::spill_to_disk: layer ", layer, " is resident");
  REVIVA_CHECK_ARG(pages_[i].empty(), "KVStore::spill_to_disk: layer ", layer,
                   " is paged (page_tokens ", options_.page_tokens, "): only whole layers spill");
  REVIVA_CHECK_ARG(manager_->valid_bytes(id) == 0, "KVStore::spill_to_disk: layer ", layer,
                   " already holds tokens");
  if (spills_[i].on) return;
  spills_[i].on = true;
  ++spilled_count_;
}

bool KVStore::spilled(int layer) const {
  block_at(layer, "spilled");
  return spills_[static_cast<std::size_t>(layer)].on;
}

int KVStore::staged_limit() const {
  return options_.disk_staged_layers > 0 ? options_.disk_staged_layers
                                         : options_.prefetch_layers + 3;
}

// Holds a pinned host copy: the manager's, or one a read fills or a write-back empties.
bool KVStore::staged(int layer) const {
  const auto i = static_cast<std::size_t>(layer);
  return static_cast<bool>(spills_[i].block) || manager_->host_bytes(blocks_[i]) > 0;
}

// The read or write-back of `layer` is done (waits for it): a read's host copy goes to the
// manager; a write-back's goes back to the pool, or, with `take_back`, to the manager again (a
// staging hit: it still holds the layer's rows).
void KVStore::finish_spill(int layer, bool take_back) {
  const auto i = static_cast<std::size_t>(layer);
  Spill& s = spills_[i];
  if (!s.request) return;
  const double t0 = now_ms();
  try {
    s.request.wait();
  } catch (...) {
    counts_.disk_wait_ms += now_ms() - t0;
    s.request = DiskRequest();
    if (s.reading) {  // the rows are gone: the layer is refused by name until clear()
      s.block = PinnedBlock();
      s.reading = false;
      s.lost = true;
    } else {  // a write-back: the host copy still holds every row; it is written again later
      s.on_disk = s.written_from;
      manager_->attach_host(blocks_[i], std::move(s.block));
    }
    throw;
  }
  counts_.disk_wait_ms += now_ms() - t0;
  s.request = DiskRequest();
  if (s.reading || take_back) {
    if (!s.reading) ++counts_.staging_hits;
    s.reading = false;
    manager_->attach_host(blocks_[i], std::move(s.block));
    note_staged();
  }
  s.block = PinnedBlock();
}

void KVStore::finish_ready_spills() {
  if (spilled_count_ == 0) return;
  for (int i = 0; i < options_.num_layers; ++i) {
    const Spill& s = spills_[static_cast<std::size_t>(i)];
    if (s.request && s.request.ready()) finish_spill(i, /*take_back=*/false);
  }
}

// Spilled layers holding a pinned host copy now.
int KVStore::staged_spills() const {
  int n = 0;
  for (int i = 0; i < options_.num_layers; ++i)
    n += spills_[static_cast<std::size_t>(i)].on && staged(i);
  return n;
}

void KVStore::note_staged() {
  counts_.peak_staged_layers = std::max(counts_.peak_staged_layers, staged_spills());
}

void KVStore::check_not_lost(int layer, const char* what) const {
  REVIVA_CHECK_ARG(!spills_[static_cast<std::size_t>(layer)].lost, "KVStore::", what, ": layer ",
                   layer, "'s K/V was lost to a disk error (raised then); clear() the store");
}

// Room for one more pinned host copy within staged_limit(): write-backs still holding theirs
// finish first.
void KVStore::make_staging_room() {
  int holding = staged_spills();
  for (int j = 0; j < options_.num_layers && holding >= staged_limit(); ++j) {
    const Spill& w = spills_[static_cast<std::size_t>(j)];
    if (w.request && !w.reading) {
      finish_spill(j, /*take_back=*/false);
      --holding;
    }
  }
}

// Starts bringing a spilled layer's host copy back: the host copy of a write-back still pinned
// (once that write is done), or a read of its valid prefix from disk.
void KVStore::stage(int layer) {
  const auto i = static_cast<std::size_t>(layer);
  Spill& s = spills_[i];
  const BlockId id = blocks_[i];
  if (s.lost) return;
  if (s.request && !s.reading) {  // a write-back: its host copy is still whole
    finish_spill(layer, /*take_back=*/true);
    return;
  }
  if (s.request || manager_->state(id) != BlockState::Disk) return;  // reading, or staged
  make_staging_room();
  const std::size_t valid = manager_->valid_bytes(id);
  const std::size_t bytes =
      std::min(round_up(valid, options_.disk->options().file.block_bytes), layer_bytes(layer));
  const double t0 = now_ms();
  s.block = engine_->pool().allocate(layer_bytes(layer));
  counts_.host_copy_wait_ms += now_ms() - t0;
  s.reading = true;
  try {
    s.request = options_.disk->read(s.extent, 0, s.block.data(), bytes);
  } catch (...) {
    s.block = PinnedBlock();
    s.reading = false;
    throw;
  }
  ++counts_.disk_reads;
  counts_.bytes_from_disk += bytes;
  note_staged();
}

// Hands a spilled layer's host copy back from the manager and writes the rows it gained since
// it was staged (from the disk block holding the first of them) to disk; the host copy stays
// pinned until that write is done.
void KVStore::unstage(int layer) {
  const auto i = static_cast<std::size_t>(layer);
  Spill& s = spills_[i];
  const BlockId id = blocks_[i];
  if (s.request || acquired_[i] != nullptr) return;
  if (manager_->state(id) == BlockState::Disk || manager_->host_bytes(id) == 0) return;
  manager_->settle(id);   // (a prefetch in flight lands first)
  manager_->offload(id);  // clean: the host copy is whole
  manager_->settle(id);
  if (manager_->state(id) != BlockState::Host) return;  // (no rows yet)
  const double t0 = now_ms();
  PinnedBlock host = manager_->detach_host(id);  // after its last write-through lands
  counts_.disk_wait_ms += now_ms() - t0;
  const std::size_t valid = manager_->valid_bytes(id);
  const std::size_t block = options_.disk->options().file.block_bytes;
  const std::size_t first = std::min(s.on_disk, valid) / block * block;
  const std::size_t end = std::min(round_up(valid, block), layer_bytes(layer));
  try {
    if (s.extent == 0) s.extent = options_.disk->allocate(layer_bytes(layer));
    if (end > first)
      s.request = options_.disk->write(s.extent, first,
                                       static_cast<const char*>(host.data()) + first, end - first);
  } catch (...) {
    // (nothing was written: the rows are still whole in the host copy, which the manager takes
    // back; the layer stays staged)
    manager_->attach_host(id, std::move(host));
    throw;
  }
  counts_.bytes_to_disk += end > first ? end - first : 0;
  s.written_from = first;
  s.on_disk = valid;
  s.block = std::move(host);
  s.reading = false;
  if (!s.request) s.block = PinnedBlock();  // (nothing to write: the disk was whole)
}

// At each acquire of `current`: the spilled layers wanted staged (Note [Spilled layers]) are
// the staged_limit() of the cycle from the one before `current`; the others leave, and the
// wanted ones not staged start coming back, in cycle order.
void KVStore::advance_spill(int current) {
  if (spilled_count_ == 0) return;
  finish_ready_spills();
  const int n = options_.num_layers;
  std::vector<bool> wanted(static_cast<std::size_t>(n), false);
  std::vector<int> order;
  for (int k = 0; k < n && static_cast<int>(order.size()) < staged_limit(); ++k) {
    const int j = (current - 1 + k + n) % n;
    const auto ju = static_cast<std::size_t>(j);
    if (!spills_[ju].on || resident_[ju] || host_attended_[ju]) continue;
    wanted[ju] = true;
    order.push_back(j);
  }
  for (int j = 0; j < n; ++j)
    if (spills_[static_cast<std::size_t>(j)].on && !wanted[static_cast<std::size_t>(j)] &&
        !resident_[static_cast<std::size_t>(j)])
      unstage(j);
  for (int j : order) stage(j);
}

// A spilled layer compute is about to use: its host copy is the manager's once this returns.
void KVStore::bring_back(int layer) {
  const auto i = static_cast<std::size_t>(layer);
  Spill& s = spills_[i];
  check_not_lost(layer, "acquire");
  const BlockState state = manager_->state(blocks_[i]);
  if (!s.request && state == BlockState::Disk) stage(layer);
  // (a layer with no rows yet takes its host copy at its first write)
  if (state == BlockState::Empty) make_staging_room();
  if (s.request) finish_spill(layer, /*take_back=*/true);
}

// Waits for every read and write-back, gives the host copies and the disk's room back, and
// forgets what the disk held (the layers' contents are discarded by the caller).
void KVStore::forget_spills() {
  for (int i = 0; i < options_.num_layers; ++i) {
    Spill& s = spills_[static_cast<std::size_t>(i)];
    if (s.request) {
      try {
        s.request.wait();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "reviva: KVStore: a disk request of layer %d failed: %s\n", i,
                     e.what());
      }
    }
    s.request = DiskRequest();
    s.block = PinnedBlock();
    s.reading = false;
    s.lost = false;
    s.on_disk = 0;
    if (s.extent != 0) options_.disk->release(s.extent);
    s.extent = 0;
  }
}

}  // namespace reviva
