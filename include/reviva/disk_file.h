// DiskFile: a file of checksummed blocks, read and written asynchronously; the disk tier's
// mechanism. DiskStore keeps its extents in a temporary one; a saved prompt cache is a named one.
//
// Blocks are `block_bytes` long from offset 0; each request starts on a block and covers whole
// blocks but for its last. Each block's CRC-32C is taken over its bytes before its write is
// submitted and handed to the caller, who keeps it; a read is given the sums to check and fails
// on a mismatch (Note [Checksums] in disk_file.cpp), so damaged bytes never pass for data.
// Several blocks are in flight at once through io_uring where the kernel allows it, else through
// a pool of threads doing pread/pwrite, with O_DIRECT where the file system takes it.
//
// A failed request (EIO, a short read, no space, a wrong checksum) raises DiskError naming the
// file, the block and its offset when it is waited for: never wrong data, never a hang, and the
// file keeps serving other requests.
//
// Buffers: a request reads into or writes from the caller's memory straight when it is aligned
// to kDiskAlignment and its blocks are whole 4 KiB pages (pinned blocks of a PinnedHostPool
// with that alignment are), else through the file's own aligned staging buffers (at most
// `queue_depth` of `block_bytes` each). Thread-safe.
#pragma once

#include <reviva/error.h>
#include <reviva/export.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace reviva {

// The alignment of O_DIRECT buffers, offsets and lengths.
inline constexpr std::size_t kDiskAlignment = 4096;

// A disk request that failed: the message names the file, the block, its offset in the file and
// the cause (the errno's name, or the checksums that differ).
class REVIVA_API DiskError : public Error {
 public:
  using Error::Error;
  ~DiskError() override;
};

enum class DiskEngine {
  Auto,     // io_uring where the kernel allows it, else threads (the file says which)
  IoUring,  // io_uring or refuse (DiskError naming why it is not there)
  Threads,  // pread/pwrite on `queue_depth` threads
};

enum class DirectIo {
  Auto,  // O_DIRECT where the file system takes it, else the page cache (the file says which)
  On,    // O_DIRECT or refuse
  Off,   // the page cache
};

// One block request as the engine completed it, for fault injection in tests (inject below).
struct DiskCompletion {
  bool write = false;
  std::uint64_t block = 0;        // block index in the file
  std::uint64_t file_offset = 0;  // bytes
  void* buffer = nullptr;         // what was read into or written from
  std::size_t bytes = 0;          // asked of the engine
};

struct DiskFileOptions {
  // The unit of checksums and of requests to the engine: a multiple of kDiskAlignment.
  std::size_t block_bytes = std::size_t{1} << 20;
  unsigned queue_depth = 8;  // block requests in flight (io_uring's queue, or threads)
  DiskEngine engine = DiskEngine::Auto;
  DirectIo direct = DirectIo::Auto;
  // Tests only: called with each completed block request and the engine's result (bytes moved,
  // or -errno); returns the result to use. It may change a read's buffer (a flipped byte).
  std::function<long(const DiskCompletion&, long)> inject;
};

enum class DiskFileMode {
  Temporary,  // a new file in the folder `path` ("": $TMPDIR, else /tmp), unlinked once open
  Create,     // a new file at `path`, 0600; an existing one is refused by name
  Read,       // an existing file, read only
};

struct DiskFileCounters {
  std::uint64_t blocks_written = 0;
  std::uint64_t blocks_read = 0;
  std::uint64_t bytes_written = 0;  // asked for by callers, of blocks that succeeded
  std::uint64_t bytes_read = 0;
  std::uint64_t failed_blocks = 0;  // block requests that raised DiskError
  std::uint64_t checksum_failures = 0;
  std::uint64_t staged_blocks = 0;  // blocks that went through the staging buffers
};

namespace detail {
struct DiskRequestState;
}

// An asynchronous read or write. Movable, not copyable. wait() returns once every block is done
// and raises DiskError if any failed; the destructor waits too (the caller's buffer is in use
// until then), and prints a failure nobody waited for instead of raising it.
class REVIVA_API DiskRequest {
 public:
  DiskRequest() noexcept;
  explicit DiskRequest(std::shared_ptr<detail::DiskRequestState> state) noexcept;
  ~DiskRequest();
  DiskRequest(DiskRequest&&) noexcept;
  DiskRequest& operator=(DiskRequest&&) noexcept;
  DiskRequest(const DiskRequest&) = delete;
  DiskRequest& operator=(const DiskRequest&) = delete;

  void wait();
  bool ready() const;  // every block done (wait() would not block)
  explicit operator bool() const noexcept { return state_ != nullptr; }

 private:
  std::shared_ptr<detail::DiskRequestState> state_;
};

class REVIVA_API DiskFile {
 public:
  DiskFile(const std::string& path, DiskFileMode mode, DiskFileOptions options = {});
  ~DiskFile();  // waits for requests in flight, closes the file, removes a folder it made
  DiskFile(const DiskFile&) = delete;
  DiskFile& operator=(const DiskFile&) = delete;

  // Called once per block of a request, on an engine thread, when it completed: its index in
  // the request, its checksum (a write's, taken before; a read's, checked) and whether it
  // succeeded. It must not make requests.
  using BlockDone = std::function<void(std::size_t index, std::uint32_t checksum, bool ok)>;

  // Writes `bytes` from `src` at `file_offset` (a multiple of block_bytes). `checksums`, when not
  // null, receives each block's sum (ceil(bytes / block_bytes) entries, valid once the request
  // succeeded). The buffer stays valid and unchanged until the request is done. The file grows
  // as needed (reserve() first to learn of a full disk before writing).
  DiskRequest write(std::uint64_t file_offset, const void* src, std::size_t bytes,
                    std::uint32_t* checksums = nullptr, BlockDone done = nullptr);
  // Reads `bytes` at `file_offset` (a multiple of block_bytes) into `dst`, each block checked
  // against `checksums` (ceil(bytes / block_bytes) entries, read when the request is made).
  DiskRequest read(std::uint64_t file_offset, void* dst, std::size_t bytes,
                   const std::uint32_t* checksums, BlockDone done = nullptr);

  // Space for the file's first `bytes` bytes, taken now (fallocate, or the size alone where the
  // file system cannot): DiskError naming the bytes and the errno when there is none.
  void reserve(std::uint64_t bytes);
  std::uint64_t size() const;  // the file's size now
  void sync();                 // what was written is on the disk (fdatasync)

  const std::string& path() const noexcept;
  bool direct_io() const noexcept;
  bool io_uring() const noexcept;
  const std::string& why_not_io_uring() const noexcept;  // where the engine is threads
  const DiskFileOptions& options() const noexcept;
  DiskFileCounters counters() const;
  int fd() const noexcept;  // (tests reach the file through it)

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace reviva
