// OffloadManager's append blocks: a K/V layer's buffer sized by its contents (register, grow,
// write-through, keep resident, truncate, fetch tails, host-side appends).
//
// Note [Append blocks]
// A K/V layer grows by a token per decode step and is read whole at each step; moving it as a
// fixed block would re-send it whole whenever it changed (what makes HF's offloaded cache slow).
// An append block (register_append_block) is sized by its contents instead:
//   - `bytes` is its device allocation (what grow() asked for; the capacity with an allocator
//     that cannot grow in place), `valid` the prefix that holds contents, `capacity` the most;
//   - its host copy, once it exists (the first write), is always valid: wrote() sends each
//     written range there (a D2H ordered after compute's write, rule 1), so an eviction is
//     always clean (the memory is freed on the D2H stream after that copy: rule 2) and a fetch
//     copies `valid` bytes, after the last write-through has landed in the host copy (rule 4);
//   - a kept block (keep_resident: a layer the plan holds on the device) is never a victim and
//     has no host copy: its writes stay on the device.
// The scheduler drives append blocks like any other: a streamed layer is prefetched ahead of
// its turn in the decode cycle and offloaded (cleanly: freed) once its next use is beyond the
// window, so the budget's room beside the kept layers is the staging room.
#include "offload_manager_impl.h"

namespace reviva {

BlockId OffloadManager::register_append_block(std::size_t capacity, std::string name) {
  const BlockId id = register_block(capacity, std::move(name));
  std::lock_guard<std::mutex> lock(impl_->mutex);
  Impl::Block& b = impl_->find(id);
  b.append = true;
  b.bytes = 0;  // no device allocation yet
  return id;
}

void OffloadManager::grow(BlockId id, std::size_t bytes) {
  Impl& m = *impl_;
  void* ptr;
  std::size_t before;
  {
    std::unique_lock<std::mutex> lock(m.mutex);
    Impl::Block& b = m.wait_idle(lock, id);
    REVIVA_CHECK_ARG(b.append, "grow: block ", id, " (", b.name, ") is not an append block");
    REVIVA_CHECK_ARG(b.pins > 0, "grow: block ", id, " (", b.name, ") is not acquired");
    REVIVA_CHECK_ARG(bytes <= b.capacity, "grow: ", bytes, " bytes exceed block ", id, " (", b.name,
                     ")'s capacity of ", b.capacity);
    if (bytes <= b.bytes) return;
    REVIVA_ASSERT(m.allocator->grows_in_place(), "an append block below its capacity");
    b.busy = true;
    ptr = b.device;
    before = b.bytes;
  }
  bool reserved = false;
  try {
    m.reserve(bytes - before, /*may_wait=*/true, id);
    reserved = true;
    if (!m.allocator->grow(ptr, bytes)) {
      std::lock_guard<std::mutex> lock(m.mutex);
      throw OutOfMemory(detail::concat("block ", id, " (", m.find(id).name, ") cannot grow from ",
                                       before, " to ", bytes, " bytes: ", m.allocator->name(),
                                       " has no memory for it (", m.numbers(), ")"));
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(m.mutex);
    if (reserved) m.held -= bytes - before;
    m.find(id).busy = false;
    m.changed.notify_all();
    throw;
  }
  std::lock_guard<std::mutex> lock(m.mutex);
  Impl::Block& b = m.find(id);
  b.bytes = bytes;
  b.busy = false;
  m.changed.notify_all();
}

std::size_t OffloadManager::wrote(BlockId id, std::size_t offset, std::size_t bytes,
                                  const Stream& compute) {
  REVIVA_CHECK_ARG(&compute.backend() == &backend(),
                   "wrote: the stream belongs to another backend");
  Impl& m = *impl_;
  void* device;
  bool need_host;
  bool whole;
  std::size_t capacity;
  {
    std::unique_lock<std::mutex> lock(m.mutex);
    Impl::Block& b = m.wait_idle(lock, id);
    REVIVA_CHECK_ARG(b.append, "wrote: block ", id, " (", b.name, ") is not an append block");
    REVIVA_CHECK_ARG(b.pins > 0, "wrote: block ", id, " (", b.name, ") is not acquired");
    REVIVA_CHECK_ARG(offset <= b.valid, "wrote: bytes from ", offset, " would leave a gap after ",
                     "block ", id, " (", b.name, ")'s ", b.valid, " valid bytes");
    REVIVA_CHECK_ARG(bytes <= b.bytes && offset <= b.bytes - bytes, "wrote: bytes [", offset, ", ",
                     offset + bytes, ") of block ", id, " (", b.name, ") are not backed (", b.bytes,
                     " are): grow() it before compute writes them");
    b.valid = std::max(b.valid, offset + bytes);
    if (bytes == 0 || (b.keep && !b.host)) return 0;  // kept: the writes stay on the device
    b.busy = true;
    device = b.device;
    need_host = !b.host;
    whole = need_host || !b.host_valid;  // a new or stale host copy gets the whole prefix
    capacity = b.capacity;
  }
  std::size_t sent = 0;
  try {
    PinnedBlock fresh;
    if (need_host) {  // the first write: the host copy (the whole valid prefix goes, below)
      const double t0 = m.host_now_ms();
      fresh = m.engine->pool().allocate(capacity);
      std::lock_guard<std::mutex> lock(m.mutex);
      m.metrics.host_copy_alloc_ms += m.host_now_ms() - t0;
    }
    PinnedBlock* host;
    std::size_t first;
    {
      std::lock_guard<std::mutex> lock(m.mutex);
      Impl::Block& b = m.find(id);
      if (need_host) b.host = std::move(fresh);
      host = &b.host;  // stable while busy
      first = whole ? 0 : offset;
      sent = offset + bytes - first;
    }
    Event producer(m.backend);  // rule 1: after compute's write
    producer.record(compute);
    host->record_use(m.engine->stream_ptr(Direction::DeviceToHost));
    Transfer t = m.engine->copy(Direction::DeviceToHost, static_cast<char*>(host->data()) + first,
                                static_cast<const char*>(device) + first, sent, &producer);
    Graveyard trash;
    std::lock_guard<std::mutex> lock(m.mutex);
    Impl::Block& b = m.find(id);
    trash.transfers.push_back(std::move(b.last_write));
    b.last_write = t;
    b.host_valid = true;
    // The D2H reads the device memory: frees after it (rule 2) go on the D2H stream, and an
    // eviction's waits order it; its metrics are folded when it lands.
    m.orphans.emplace_back(id, std::move(t));
    m.metrics.bytes_written_through += sent;
    b.busy = false;
    m.changed.notify_all();
  } catch (...) {
    // The host copy lacks the range now: it is stale (an eviction then copies the valid prefix
    // whole), or, taken for this write, it goes.
    Graveyard trash;
    std::lock_guard<std::mutex> lock(m.mutex);
    Impl::Block& b = m.find(id);
    if (need_host) {
      trash.blocks.push_back(std::move(b.host));
      b.host = PinnedBlock();
    }
    b.host_valid = false;
    b.busy = false;
    m.changed.notify_all();
    throw;
  }
  return sent;
}

bool OffloadManager::keep_resident(BlockId id) {
  Impl& m = *impl_;
  for (;;) {
    Transfer landing;
    bool partial = false;  // on the device from a fetch with a tail: Note [Fetch tails]
    {
      Graveyard trash;
      std::unique_lock<std::mutex> lock(m.mutex);
      Impl::Block& b = m.wait_idle(lock, id);
      REVIVA_CHECK_ARG(b.append, "keep_resident: block ", id, " (", b.name,
                       ") is not an append block");
      if (b.keep) return true;
      REVIVA_CHECK_ARG(b.state != BlockState::Disk, "keep_resident: block ", id, " (", b.name,
                       ") is on disk (its host copy was detached): attach_host first");
      if (b.state == BlockState::ToHost) {
        landing = b.transfer;
      } else if ((b.state == BlockState::Device || b.state == BlockState::ToDevice) &&
                 b.device_from > 0) {
        REVIVA_CHECK_ARG(b.pins == 0, "keep_resident: block ", id, " (", b.name, ") is acquired");
        partial = true;  // it leaves first (its host copy is whole) and comes back whole
      } else if (b.state == BlockState::Device || b.state == BlockState::ToDevice ||
                 b.state == BlockState::Empty) {
        // On the device (or nothing yet): the host copy goes once no copy reads or writes it
        // (the pool defers its reuse: rule 4).
        b.keep = true;
        trash.blocks.push_back(std::move(b.host));
        b.host = PinnedBlock();
        b.host_valid = false;
        return true;
      } else {  // Host: fetched below
        b.busy = true;
      }
    }
    if (landing.valid()) {
      landing.wait();
      m.poll(/*wait_for_turn=*/true);
      continue;
    }
    if (partial) {
      engine().synchronize();  // (a fetch in flight lands first)
      m.poll(/*wait_for_turn=*/true);
      offload(id);
      continue;
    }
    std::size_t bytes;
    {
      std::lock_guard<std::mutex> lock(m.mutex);
      bytes = m.fetch_bytes(m.find(id));
    }
    void* ptr = nullptr;
    Transfer copy;
    bool reserved = false;
    try {
      m.reserve(bytes, /*may_wait=*/true, id);
      reserved = true;
      // (not the memory of blocks that move; the whole prefix: it stays, Note [Fetch tails])
      copy = m.fetch(id, bytes, &ptr, /*fresh=*/true, /*whole=*/true);
    } catch (const OutOfMemory&) {
      m.abandon(id, ptr, bytes, reserved, m.h2d().handle());
      return false;
    } catch (...) {
      m.abandon(id, ptr, bytes, reserved, m.h2d().handle());
      throw;
    }
    Graveyard trash;
    std::lock_guard<std::mutex> lock(m.mutex);
    Impl::Block& b = m.find(id);
    b.state = BlockState::ToDevice;
    b.device = ptr;
    b.bytes = bytes;
    b.transfer = copy;
    b.last_use.push_back(UseGuard{nullptr, copy, m.h2d().handle()});
    b.keep = true;
    trash.blocks.push_back(std::move(b.host));  // reused after the H2D that reads it (rule 4)
    b.host = PinnedBlock();
    b.host_valid = false;
    b.busy = false;
    m.changed.notify_all();
    return true;
  }
}

bool OffloadManager::kept(BlockId id) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->find(id).keep;
}

void OffloadManager::truncate(BlockId id, std::size_t bytes) {
  Impl& m = *impl_;
  std::unique_lock<std::mutex> lock(m.mutex);
  Impl::Block& b = m.wait_idle(lock, id);
  REVIVA_CHECK_ARG(b.append, "truncate: block ", id, " (", b.name, ") is not an append block");
  REVIVA_CHECK_ARG(b.pins == 0, "truncate: block ", id, " (", b.name, ") is acquired");
  REVIVA_CHECK_ARG(bytes <= b.valid, "truncate: ", bytes, " bytes exceed block ", id, " (", b.name,
                   ")'s ", b.valid, " valid bytes");
  // A fetch in flight copies the old prefix, of which the kept one is a part; a write-through in
  // flight lands before any later fetch reads its range (rule 4: fetches wait for last_write).
  b.valid = bytes;
}

// Note [Fetch tails]
// A sliding-window layer's query at token p reads the keys of tokens (p - W, p] alone, so a
// streamed such layer needs only the last W tokens of its K/V on the device, not its whole valid
// prefix: with a tail of W tokens' bytes its fetches copy those alone (the bytes a step moves for
// it stop growing with the context), into the same offsets of its device memory (the memory
// before them is backed but holds stale bytes, which the caller promises not to read). The host
// copy stays whole (write-through), so lifting the tail brings everything back at the next fetch;
// a device copy fetched with a tail that no longer covers what is asked leaves the device then.
void OffloadManager::set_fetch_tail(BlockId id, std::size_t bytes) {
  Impl& m = *impl_;
  bool drop = false;
  for (int attempt = 0; attempt < 2; ++attempt) {
    m.poll(/*wait_for_turn=*/false);  // a fetch that has landed is folded first
    std::unique_lock<std::mutex> lock(m.mutex);
    Impl::Block& b = m.wait_idle(lock, id);
    REVIVA_CHECK_ARG(b.append, "set_fetch_tail: block ", id, " (", b.name,
                     ") is not an append block");
    REVIVA_CHECK_ARG(b.pins == 0, "set_fetch_tail: block ", id, " (", b.name, ") is acquired");
    const bool narrower = b.device_from > 0 && (bytes == 0 || bytes > b.fetch_tail);
    if (narrower && b.state == BlockState::ToDevice && attempt == 0) {
      lock.unlock();
      engine().synchronize();  // (rare: the fetch in flight lands, then it can leave)
      continue;
    }
    b.fetch_tail = bytes;
    drop = narrower && b.state == BlockState::Device && !b.keep;
    break;
  }
  if (drop) offload(id);  // (clean: its host copy is whole)
}

std::size_t OffloadManager::valid_bytes(BlockId id) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  const Impl::Block& b = impl_->find(id);
  return b.append ? b.valid : b.bytes;
}

std::size_t OffloadManager::capacity(BlockId id) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->find(id).capacity;
}

std::size_t OffloadManager::host_bytes(BlockId id) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  const Impl::Block& b = impl_->find(id);
  return b.host ? b.host.size() : 0;
}

// Note [Host-side appends]
// A streamed K/V layer whose decode attention runs on the host's cores (Note [Attention on the
// host] in host_attention.cpp) is never fetched again: its readers and its writer are the host.
// Its host copy is then the only copy, read in place (host_rows) once the write-throughs queued
// before have landed (rule 4's wait, by the host thread instead of a fetch), and a decode step's
// new rows go straight into it (host_wrote), which is a memcpy, not a copy on a stream. A block
// with a device copy refuses both writes (the device copy would go stale and a later fetch would
// not know); the caller offloads it first (clean: its host copy is whole).
namespace {
// Waits for the block's last write-through D2H outside the lock.
void wait_transfer(const Transfer& t) {
  if (t.valid()) t.wait();
}
}  // namespace

const void* OffloadManager::host_rows(BlockId id) {
  Impl& m = *impl_;
  Transfer last;
  const void* data;
  {
    std::unique_lock<std::mutex> lock(m.mutex);
    Impl::Block& b = m.wait_idle(lock, id);
    REVIVA_CHECK_ARG(b.append, "host_rows: block ", id, " (", b.name, ") is not an append block");
    REVIVA_CHECK_ARG(b.host && b.host_valid, "host_rows: block ", id, " (", b.name,
                     ") has no valid host copy (kept on the device, or never written)");
    last = b.last_write;
    data = b.host.data();
  }
  wait_transfer(last);
  return data;
}

void OffloadManager::host_wrote(BlockId id, std::size_t offset, const void* src,
                                std::size_t bytes) {
  Impl& m = *impl_;
  m.poll(/*wait_for_turn=*/false);  // (an eviction that has landed leaves the block Host)
  Transfer last;
  char* dst;
  {
    std::unique_lock<std::mutex> lock(m.mutex);
    Impl::Block& b = m.wait_idle(lock, id);
    REVIVA_CHECK_ARG(b.append, "host_wrote: block ", id, " (", b.name, ") is not an append block");
    REVIVA_CHECK_ARG(b.pins == 0 && !b.keep, "host_wrote: block ", id, " (", b.name,
                     ") is acquired or kept on the device");
    REVIVA_CHECK_ARG(b.state == BlockState::Host, "host_wrote: block ", id, " (", b.name, ") is ",
                     to_string(b.state),
                     ", not Host: its device copy would go stale (offload it first)");
    REVIVA_CHECK_ARG(b.host && b.host_valid, "host_wrote: block ", id, " (", b.name,
                     ") has no valid host copy");
    REVIVA_CHECK_ARG(src != nullptr || bytes == 0, "host_wrote: src is null");
    REVIVA_CHECK_ARG(offset <= b.valid, "host_wrote: bytes from ", offset,
                     " would leave a gap after block ", id, " (", b.name, ")'s ", b.valid,
                     " valid bytes");
    REVIVA_CHECK_ARG(bytes <= b.capacity && offset <= b.capacity - bytes, "host_wrote: bytes [",
                     offset, ", ", offset + bytes, ") exceed block ", id, " (", b.name,
                     ")'s capacity of ", b.capacity);
    last = b.last_write;
    dst = static_cast<char*>(b.host.data());
    b.busy = true;  // (no copy may start on it while the host writes)
  }
  try {
    wait_transfer(last);  // a write-through still landing in the same bytes lands first
    if (bytes > 0) std::memcpy(dst + offset, src, bytes);
  } catch (...) {
    std::lock_guard<std::mutex> lock(m.mutex);
    m.find(id).busy = false;
    m.changed.notify_all();
    throw;
  }
  std::lock_guard<std::mutex> lock(m.mutex);
  Impl::Block& b = m.find(id);
  b.valid = std::max(b.valid, offset + bytes);
  b.busy = false;
  m.changed.notify_all();
}

PinnedBlock OffloadManager::detach_host(BlockId id) {
  Impl& m = *impl_;
  m.poll(/*wait_for_turn=*/false);  // (an eviction that has landed leaves the block Host)
  Transfer last;
  {
    std::unique_lock<std::mutex> lock(m.mutex);
    Impl::Block& b = m.wait_idle(lock, id);
    REVIVA_CHECK_ARG(b.append, "detach_host: block ", id, " (", b.name, ") is not an append block");
    REVIVA_CHECK_ARG(b.state == BlockState::Host && b.pins == 0 && !b.keep, "detach_host: block ",
                     id, " (", b.name, ") is ", to_string(b.state), b.keep ? " and kept" : "",
                     ", not Host (offload it first)");
    last = b.last_write;
    b.busy = true;  // (no copy may start on it while its last write lands)
  }
  try {
    wait_transfer(last);
  } catch (...) {
    std::lock_guard<std::mutex> lock(m.mutex);
    m.find(id).busy = false;
    m.changed.notify_all();
    throw;
  }
  Graveyard trash;
  std::lock_guard<std::mutex> lock(m.mutex);
  Impl::Block& b = m.find(id);
  PinnedBlock host = std::move(b.host);
  b.host = PinnedBlock();
  b.host_valid = false;
  trash.transfers.push_back(std::move(b.last_write));
  b.last_write = Transfer();
  b.state = BlockState::Disk;
  b.busy = false;
  m.changed.notify_all();
  return host;
}

void OffloadManager::attach_host(BlockId id, PinnedBlock host) {
  Impl& m = *impl_;
  std::unique_lock<std::mutex> lock(m.mutex);
  Impl::Block& b = m.wait_idle(lock, id);
  REVIVA_CHECK_ARG(b.state == BlockState::Disk, "attach_host: block ", id, " (", b.name, ") is ",
                   to_string(b.state), ", not Disk");
  REVIVA_CHECK_ARG(host && host.size() >= b.capacity, "attach_host: a host copy of ",
                   host ? host.size() : 0, " bytes for block ", id, " (", b.name, ") of capacity ",
                   b.capacity);
  b.host = std::move(host);
  b.host_valid = true;
  b.state = BlockState::Host;
  m.changed.notify_all();
}

}  // namespace reviva
