// DiskStore (include/reviva/disk_store.h): extents of one temporary DiskFile and each block's
// checksum and state; the file does the I/O (disk_file.cpp).
//
// Note [Block states]: a block is written (its checksum, from its write, valid), being written,
// or being read by some requests. A read of a block never written or being written, and a write
// of a block being read or written, are refused by name: the caller orders them by waiting. A
// block whose write failed is not written (its old bytes are gone), until a write succeeds.
#include <reviva/disk_store.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace reviva {
namespace {

struct Extent {
  std::uint64_t first_block = 0;
  std::uint64_t blocks = 0;
  std::size_t bytes = 0;
  std::vector<std::uint32_t> crc;     // Note [Checksums] in disk_file.cpp
  std::vector<std::uint8_t> written;  // Note [Block states]
  std::vector<std::uint8_t> writing;
  std::vector<std::uint32_t> readers;
};

}  // namespace

struct DiskStore::Impl {
  DiskStoreOptions options;
  std::unique_ptr<DiskFile> file;

  mutable std::mutex mutex;
  std::unordered_map<DiskExtent, Extent> extents;  // guarded by mutex
  std::map<std::uint64_t, std::uint64_t> free;     // guarded by mutex: first block -> count
  std::uint64_t file_blocks = 0;                   // guarded by mutex
  DiskExtent next_id = 1;                          // guarded by mutex
  std::size_t bytes_in_use = 0;                    // guarded by mutex
  std::size_t peak_bytes_in_use = 0;               // guarded by mutex

  // (the file first: its blocks in flight complete into the extents)
  ~Impl() { file.reset(); }
  std::uint64_t grow(std::uint64_t blocks, std::size_t bytes);
  DiskRequest submit(bool write, DiskExtent id, std::size_t offset, char* user, std::size_t bytes);
};

DiskStore::DiskStore(DiskStoreOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  impl_->file = std::make_unique<DiskFile>(impl_->options.directory, DiskFileMode::Temporary,
                                           impl_->options.file);
}

DiskStore::~DiskStore() = default;

const DiskStoreOptions& DiskStore::options() const noexcept { return impl_->options; }
int DiskStore::fd() const noexcept { return impl_->file->fd(); }

// Adds `blocks` at the file's end (mutex held); returns the first. The space is taken now, so
// that a full disk says so here, by name, not halfway through a write.
std::uint64_t DiskStore::Impl::grow(std::uint64_t blocks, std::size_t bytes) {
  const std::size_t bb = options.file.block_bytes;
  const std::uint64_t first = file_blocks;
  const std::size_t new_size = (first + blocks) * bb;
  if (options.capacity_bytes && new_size > options.capacity_bytes)
    throw OutOfMemory(detail::concat("DiskStore: no room for ", bytes, " bytes in ", file->path(),
                                     " (unlinked): the file would hold ", new_size,
                                     " bytes, capacity ", options.capacity_bytes, " (",
                                     bytes_in_use, " in use)"));
  file->reserve(new_size);
  file_blocks = first + blocks;
  return first;
}

DiskExtent DiskStore::allocate(std::size_t bytes) {
  REVIVA_CHECK_ARG(bytes > 0, "DiskStore::allocate: 0 bytes");
  Impl& s = *impl_;
  const std::size_t bb = s.options.file.block_bytes;
  const std::uint64_t blocks = (bytes + bb - 1) / bb;
  std::lock_guard<std::mutex> lock(s.mutex);
  std::uint64_t first = 0;
  auto fit = s.free.begin();
  while (fit != s.free.end() && fit->second < blocks) ++fit;
  auto tail = s.free.empty() ? s.free.end() : std::prev(s.free.end());
  if (fit != s.free.end()) {
    first = fit->first;
    if (fit->second > blocks) s.free.emplace(first + blocks, fit->second - blocks);
    s.free.erase(fit);
  } else if (tail != s.free.end() && tail->first + tail->second == s.file_blocks) {
    // (the free blocks at the file's end, and as many more as are missing)
    first = tail->first;
    s.grow(blocks - tail->second, bytes);
    s.free.erase(tail);
  } else {
    first = s.grow(blocks, bytes);
  }
  const DiskExtent id = s.next_id++;
  Extent& e = s.extents[id];
  e.first_block = first;
  e.blocks = blocks;
  e.bytes = bytes;
  e.crc.assign(blocks, 0);
  e.written.assign(blocks, 0);
  e.writing.assign(blocks, 0);
  e.readers.assign(blocks, 0);
  s.bytes_in_use += blocks * bb;
  s.peak_bytes_in_use = std::max(s.peak_bytes_in_use, s.bytes_in_use);
  return id;
}

void DiskStore::release(DiskExtent extent) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.extents.find(extent);
  REVIVA_CHECK_ARG(it != s.extents.end(), "DiskStore::release: no extent ", extent);
  const Extent& e = it->second;
  for (std::uint64_t b = 0; b < e.blocks; ++b)
    REVIVA_CHECK_ARG(!e.writing[b] && e.readers[b] == 0, "DiskStore::release: extent ", extent,
                     " has requests in flight (block ", b, "): wait for them first");
  std::uint64_t first = e.first_block, count = e.blocks;
  s.bytes_in_use -= count * s.options.file.block_bytes;
  s.extents.erase(it);
  // (merged with free neighbours, so a long extent fits again where short ones were)
  auto next = s.free.lower_bound(first);
  if (next != s.free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == first) {
      first = prev->first;
      count += prev->second;
      s.free.erase(prev);
    }
  }
  if (next != s.free.end() && first + count == next->first) {
    count += next->second;
    s.free.erase(next);
  }
  s.free.emplace(first, count);
}

std::size_t DiskStore::extent_bytes(DiskExtent extent) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  auto it = impl_->extents.find(extent);
  REVIVA_CHECK_ARG(it != impl_->extents.end(), "DiskStore: no extent ", extent);
  return it->second.bytes;
}

DiskRequest DiskStore::write(DiskExtent extent, std::size_t offset, const void* src,
                             std::size_t bytes) {
  return impl_->submit(true, extent, offset, static_cast<char*>(const_cast<void*>(src)), bytes);
}

DiskRequest DiskStore::read(DiskExtent extent, std::size_t offset, void* dst, std::size_t bytes) {
  return impl_->submit(false, extent, offset, static_cast<char*>(dst), bytes);
}

DiskRequest DiskStore::Impl::submit(bool write, DiskExtent id, std::size_t offset, char* user,
                                    std::size_t bytes) {
  const std::size_t bb = options.file.block_bytes;
  const char* verb = write ? "DiskStore::write" : "DiskStore::read";
  std::uint64_t first_block = 0, first = 0, last = 0;
  std::vector<std::uint32_t> sums;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = extents.find(id);
    REVIVA_CHECK_ARG(it != extents.end(), verb, ": no extent ", id);
    Extent& e = it->second;
    REVIVA_CHECK_ARG(offset % bb == 0 && offset <= e.bytes && bytes <= e.bytes - offset &&
                         ((offset + bytes) % bb == 0 || offset + bytes == e.bytes),
                     verb, ": bytes [", offset, ", ", offset + bytes, ") of extent ", id, " (",
                     e.bytes, " bytes) do not start on a block (", bb,
                     " bytes) or end on one or at the extent's end");
    first = offset / bb;
    last = (offset + bytes + bb - 1) / bb;
    for (std::uint64_t i = first; i < last; ++i) {
      REVIVA_CHECK_ARG(!e.writing[i], verb, ": block ", i, " of extent ", id,
                       " has a write in flight: wait for it first");
      REVIVA_CHECK_ARG(write || e.written[i], verb, ": block ", i, " of extent ", id,
                       " was never written");
      REVIVA_CHECK_ARG(!write || e.readers[i] == 0, verb, ": block ", i, " of extent ", id,
                       " has reads in flight: wait for them first");
    }
    for (std::uint64_t i = first; i < last; ++i) {
      if (write)
        e.writing[i] = 1;
      else
        ++e.readers[i];
    }
    if (!write) sums.assign(e.crc.begin() + first, e.crc.begin() + last);
    first_block = e.first_block;
  }
  // Each block's state (and a write's checksum) as it completes
  auto done = [this, id, first, write](std::size_t j, std::uint32_t crc, bool ok) {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = extents.find(id);
    REVIVA_ASSERT(it != extents.end(), "an extent released with requests in flight");
    Extent& e = it->second;
    const std::size_t i = first + j;
    if (write) {
      e.writing[i] = 0;
      e.written[i] = ok;
      e.crc[i] = crc;
    } else {
      --e.readers[i];
    }
  };
  const std::uint64_t file_offset = (first_block + first) * bb;
  return write ? file->write(file_offset, user, bytes, nullptr, done)
               : file->read(file_offset, user, bytes, sums.data(), done);
}

DiskStoreStats DiskStore::stats() const {
  const Impl& s = *impl_;
  DiskStoreStats out;
  out.io = s.file->counters();
  std::lock_guard<std::mutex> lock(s.mutex);
  out.file = s.file->path();
  out.io_uring = s.file->io_uring();
  out.why_not_io_uring = s.file->why_not_io_uring();
  out.direct_io = s.file->direct_io();
  out.block_bytes = s.options.file.block_bytes;
  out.bytes_in_use = s.bytes_in_use;
  out.peak_bytes_in_use = s.peak_bytes_in_use;
  out.file_bytes = s.file_blocks * s.options.file.block_bytes;
  out.extents = s.extents.size();
  return out;
}

}  // namespace reviva
