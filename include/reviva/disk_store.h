// DiskStore: the third tier, bytes on local disk (DESIGN.md, "DiskStore").
//
// The store owns one temporary DiskFile (include/reviva/disk_file.h), created 0600 in
// `directory` and unlinked as soon as it is open, so nothing is left behind however the process
// ends. Space in it is handed out as extents (whole blocks of `block_bytes`); the store keeps
// each block's checksum from its write and has every read checked against it, and refuses by
// name what would read a block not (or not yet) written (Note [Block states] in disk_store.cpp).
// Thread-safe: requests may be made from any thread.
#pragma once

#include <reviva/disk_file.h>
#include <reviva/error.h>
#include <reviva/export.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace reviva {

struct DiskStoreOptions {
  // Where the file goes; empty: a new folder under $TMPDIR (else /tmp), removed at close.
  std::string directory;
  // Most bytes the file may hold; 0: what the file system gives (no space raises DiskError).
  std::size_t capacity_bytes = 0;
  DiskFileOptions file;  // block size, requests in flight, engine, O_DIRECT
};

struct DiskStoreStats {
  std::string file;              // the file's path as created (it is unlinked)
  bool io_uring = false;         // the engine in use
  std::string why_not_io_uring;  // what the kernel said, where the engine is threads
  bool direct_io = false;        // O_DIRECT in use
  std::size_t block_bytes = 0;
  std::size_t bytes_in_use = 0;  // in live extents (whole blocks)
  std::size_t peak_bytes_in_use = 0;
  std::size_t file_bytes = 0;  // the file's size: space taken on the disk
  std::uint64_t extents = 0;   // live
  DiskFileCounters io;         // blocks and bytes moved, failures, checksum failures, staging
};

// A run of whole blocks in the store's file. 0 is never an extent.
using DiskExtent = std::uint64_t;

class REVIVA_API DiskStore {
 public:
  explicit DiskStore(DiskStoreOptions options = {});
  ~DiskStore();  // waits for requests in flight, closes the file, removes a folder it made
  DiskStore(const DiskStore&) = delete;
  DiskStore& operator=(const DiskStore&) = delete;

  // Space for `bytes` (rounded up to blocks). Raises OutOfMemory naming the bytes when the
  // capacity is reached, DiskError when the file system has no space left.
  DiskExtent allocate(std::size_t bytes);
  // Gives the extent's blocks back; its requests must have been waited for.
  void release(DiskExtent extent);
  std::size_t extent_bytes(DiskExtent extent) const;

  // Writes `bytes` from `src` to the extent at `offset`, or reads them into `dst`. `offset` is a
  // multiple of block_bytes and the range ends on a block boundary or at the extent's end. The
  // buffer stays valid (and, for a write, unchanged) until the request is done. A block is read
  // only after its write was waited for.
  DiskRequest write(DiskExtent extent, std::size_t offset, const void* src, std::size_t bytes);
  DiskRequest read(DiskExtent extent, std::size_t offset, void* dst, std::size_t bytes);

  DiskStoreStats stats() const;
  const DiskStoreOptions& options() const noexcept;
  int fd() const noexcept;  // (tests reach the file through it)

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace reviva
