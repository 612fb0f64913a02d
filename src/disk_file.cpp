// DiskFile (include/reviva/disk_file.h): opening the file (O_DIRECT where taken), the checksums,
// the staging buffers for callers' memory that O_DIRECT cannot take, and the requests; the
// engines (disk_io.h) move the bytes.
//
// Note [Checksums]: a block's CRC-32C is taken over its bytes (a request's last block may be
// partial; with O_DIRECT the rest of its last 4 KiB page is written as zeros and not summed)
// before its write is submitted. A read is checked against the caller's sum before the request
// reports success; a mismatch fails the request (DiskError names the block, both sums and the
// file), so damaged bytes never pass for data. Through a staging buffer they never reach the
// caller's memory; read straight into it, the caller's bytes are undefined after a failed
// request, as after any failed read.
#include <reviva/checksum.h>
#include <reviva/disk_file.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "disk_io.h"

namespace reviva {

DiskError::~DiskError() = default;

namespace detail {

struct DiskRequestState {
  std::mutex mutex;
  std::condition_variable finished;
  std::size_t remaining = 0;    // guarded by mutex: blocks not completed
  std::string error;            // guarded by mutex: the failure of the lowest block
  std::size_t error_block = 0;  // guarded by mutex
  std::size_t failures = 0;     // guarded by mutex
  bool observed = false;        // guarded by mutex: wait() saw the outcome

  void block_done(std::size_t block, const std::string& failure) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (!failure.empty() && (failures++ == 0 || block < error_block)) {
        error = failure;
        error_block = block;
      }
      --remaining;
    }
    finished.notify_all();
  }
  void wait_all() {
    std::unique_lock<std::mutex> lock(mutex);
    finished.wait(lock, [&] { return remaining == 0; });
  }
};

}  // namespace detail

// ---- DiskRequest

DiskRequest::DiskRequest() noexcept = default;
DiskRequest::DiskRequest(std::shared_ptr<detail::DiskRequestState> state) noexcept
    : state_(std::move(state)) {}
DiskRequest::DiskRequest(DiskRequest&&) noexcept = default;
DiskRequest& DiskRequest::operator=(DiskRequest&& other) noexcept {
  if (this != &other) {
    DiskRequest old(std::move(*this));  // (waits for what this one held)
    state_ = std::move(other.state_);
  }
  return *this;
}
DiskRequest::~DiskRequest() {
  if (!state_) return;
  state_->wait_all();
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (state_->failures > 0 && !state_->observed)
    std::fprintf(stderr, "reviva: a failed disk request was never waited for: %s\n",
                 state_->error.c_str());
}

void DiskRequest::wait() {
  if (!state_) return;
  state_->wait_all();
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->observed = true;
  if (state_->failures == 0) return;
  std::string message = state_->error;
  if (state_->failures > 1)
    message += detail::concat(" (and ", state_->failures - 1, " more blocks of this request)");
  throw DiskError(message);
}

bool DiskRequest::ready() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->remaining == 0;
}

// ---- DiskFile

namespace {
std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }
bool aligned(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % kDiskAlignment == 0; }
}  // namespace

struct DiskFile::Impl {
  DiskFileOptions options;
  DiskFileMode mode = DiskFileMode::Temporary;
  std::string folder;  // a Temporary file's folder
  bool made_folder = false;
  std::string path;
  std::string shown;  // the path as messages name it
  int fd = -1;
  bool direct = false;
  std::string why_not_io_uring;
  std::unique_ptr<detail::DiskIoEngine> engine;

  mutable std::mutex mutex;
  DiskFileCounters counters;  // guarded by mutex

  std::mutex staging_mutex;
  std::condition_variable staging_returned;
  std::vector<void*> staging_free;  // guarded by staging_mutex
  std::size_t staging_made = 0;     // guarded by staging_mutex

  ~Impl();
  void open(const std::string& where);
  void* take_staging();
  void give_staging(void* buffer);
  std::string where(bool write, std::uint64_t block, std::size_t bytes) const {
    return detail::concat("disk ", write ? "write" : "read", " of block ", block, " (file offset ",
                          block * options.block_bytes, ", ", bytes, " bytes) in ", shown);
  }
  DiskRequest submit(bool write, std::uint64_t offset, char* user, std::size_t bytes,
                     std::uint32_t* sums_out, const std::uint32_t* sums_in, BlockDone done);
};

DiskFile::Impl::~Impl() {
  engine.reset();  // (completes every block in flight)
  if (fd >= 0) ::close(fd);
  for (void* b : staging_free) std::free(b);
  if (made_folder) ::rmdir(folder.c_str());
}

void DiskFile::Impl::open(const std::string& where) {
  int flags = O_CLOEXEC | (mode == DiskFileMode::Read ? O_RDONLY : O_RDWR);
  if (mode == DiskFileMode::Temporary) {
    folder = where;
    if (folder.empty()) {
      const char* tmp = std::getenv("TMPDIR");
      std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/reviva-disk-XXXXXX";
      if (!::mkdtemp(pattern.data()))
        throw DiskError(detail::concat("DiskFile: cannot make a folder ", pattern, ": ",
                                       detail::errno_text(errno)));
      folder = pattern;
      made_folder = true;
    } else {
      struct stat st {};
      REVIVA_CHECK_ARG(::stat(folder.c_str(), &st) == 0 && S_ISDIR(st.st_mode),
                       "DiskFile: ", folder, " is not a folder");
    }
    path = folder + "/reviva-store-XXXXXX";
    const int made = ::mkstemp(path.data());  // (0600; opened again with the flags wanted)
    if (made < 0)
      throw DiskError(detail::concat("DiskFile: cannot create a file in ", folder, ": ",
                                     detail::errno_text(errno)));
    ::close(made);
    shown = path + " (unlinked)";
  } else {
    path = shown = where;
    if (mode == DiskFileMode::Create) {
      const int made = ::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
      if (made < 0)
        throw DiskError(
            detail::concat("DiskFile: cannot create ", path, ": ", detail::errno_text(errno)));
      ::close(made);
    }
  }
  if (options.direct != DirectIo::Off) {
    fd = ::open(path.c_str(), flags | O_DIRECT);
    // (some file systems open with O_DIRECT and refuse its I/O: one page read says)
    alignas(kDiskAlignment) static thread_local char page[kDiskAlignment];
    if (fd >= 0 && ::pread(fd, page, sizeof page, 0) < 0) {
      ::close(fd);
      fd = -1;
    }
    direct = fd >= 0;
    if (!direct && options.direct == DirectIo::On) {
      const int error = errno;
      if (mode != DiskFileMode::Read) ::unlink(path.c_str());
      throw DiskError(detail::concat("DiskFile: the file system of ", path,
                                     " refuses O_DIRECT (direct=On): ", detail::errno_text(error)));
    }
  }
  if (fd < 0) fd = ::open(path.c_str(), flags);
  const int error = errno;
  if (mode == DiskFileMode::Temporary)
    ::unlink(path.c_str());  // (nothing left behind however the process ends)
  if (fd < 0)
    throw DiskError(
        detail::concat("DiskFile: cannot open ", path, ": ", detail::errno_text(error)));
}

void* DiskFile::Impl::take_staging() {
  std::unique_lock<std::mutex> lock(staging_mutex);
  staging_returned.wait(
      lock, [&] { return !staging_free.empty() || staging_made < options.queue_depth; });
  if (!staging_free.empty()) {
    void* b = staging_free.back();
    staging_free.pop_back();
    return b;
  }
  void* b = std::aligned_alloc(kDiskAlignment, options.block_bytes);
  if (!b)
    throw OutOfMemory(detail::concat("DiskFile: no host memory for a staging buffer of ",
                                     options.block_bytes, " bytes"));
  ++staging_made;
  return b;
}

void DiskFile::Impl::give_staging(void* buffer) {
  {
    std::lock_guard<std::mutex> lock(staging_mutex);
    staging_free.push_back(buffer);
  }
  staging_returned.notify_one();
}

DiskFile::DiskFile(const std::string& path, DiskFileMode mode, DiskFileOptions options)
    : impl_(std::make_unique<Impl>()) {
  REVIVA_CHECK_ARG(options.block_bytes > 0 && options.block_bytes % kDiskAlignment == 0 &&
                       options.block_bytes <= (std::size_t{1} << 30),
                   "DiskFile: block_bytes ", options.block_bytes,
                   " is not a multiple of 4096 in [4096, 1 GiB]");
  REVIVA_CHECK_ARG(options.queue_depth >= 1 && options.queue_depth <= 4096,
                   "DiskFile: queue_depth ", options.queue_depth, " is not in [1, 4096]");
  Impl& f = *impl_;
  f.options = std::move(options);
  f.mode = mode;
  f.open(path);
  if (f.options.engine != DiskEngine::Threads) {
    f.engine = detail::make_uring_engine(f.options.queue_depth, &f.why_not_io_uring);
    if (!f.engine && f.options.engine == DiskEngine::IoUring)
      throw DiskError("DiskFile: engine=IoUring, but " + f.why_not_io_uring);
  }
  if (!f.engine) f.engine = detail::make_thread_engine(f.options.queue_depth);
}

DiskFile::~DiskFile() = default;

const std::string& DiskFile::path() const noexcept { return impl_->path; }
bool DiskFile::direct_io() const noexcept { return impl_->direct; }
bool DiskFile::io_uring() const noexcept { return impl_->engine->io_uring(); }
const std::string& DiskFile::why_not_io_uring() const noexcept { return impl_->why_not_io_uring; }
const DiskFileOptions& DiskFile::options() const noexcept { return impl_->options; }
int DiskFile::fd() const noexcept { return impl_->fd; }

DiskFileCounters DiskFile::counters() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->counters;
}

std::uint64_t DiskFile::size() const {
  struct stat st {};
  if (::fstat(impl_->fd, &st) != 0)
    throw DiskError(
        detail::concat("DiskFile: fstat of ", impl_->shown, ": ", detail::errno_text(errno)));
  return static_cast<std::uint64_t>(st.st_size);
}

void DiskFile::reserve(std::uint64_t bytes) {
  Impl& f = *impl_;
  REVIVA_CHECK_ARG(f.mode != DiskFileMode::Read, "DiskFile::reserve: ", f.shown,
                   " is open for reading");
  const std::uint64_t have = size();
  if (bytes <= have) return;
  int r = ::fallocate(f.fd, 0, static_cast<off_t>(have), static_cast<off_t>(bytes - have));
  if (r != 0 && errno == EOPNOTSUPP) r = ::ftruncate(f.fd, static_cast<off_t>(bytes));
  if (r != 0)
    throw DiskError(detail::concat("DiskFile: no space for ", bytes - have,
                                   " bytes at file offset ", have, " in ", f.shown, ": ",
                                   detail::errno_text(errno)));
}

void DiskFile::sync() {
  if (::fdatasync(impl_->fd) != 0)
    throw DiskError(
        detail::concat("DiskFile: fdatasync of ", impl_->shown, ": ", detail::errno_text(errno)));
}

DiskRequest DiskFile::write(std::uint64_t file_offset, const void* src, std::size_t bytes,
                            std::uint32_t* checksums, BlockDone done) {
  REVIVA_CHECK_ARG(impl_->mode != DiskFileMode::Read, "DiskFile::write: ", impl_->shown,
                   " is open for reading");
  return impl_->submit(true, file_offset, static_cast<char*>(const_cast<void*>(src)), bytes,
                       checksums, nullptr, std::move(done));
}

DiskRequest DiskFile::read(std::uint64_t file_offset, void* dst, std::size_t bytes,
                           const std::uint32_t* checksums, BlockDone done) {
  REVIVA_CHECK_ARG(checksums != nullptr || bytes == 0, "DiskFile::read: no checksums for ", bytes,
                   " bytes");
  return impl_->submit(false, file_offset, static_cast<char*>(dst), bytes, nullptr, checksums,
                       std::move(done));
}

DiskRequest DiskFile::Impl::submit(bool write, std::uint64_t offset, char* user, std::size_t bytes,
                                   std::uint32_t* sums_out, const std::uint32_t* sums_in,
                                   BlockDone done) {
  const std::size_t bb = options.block_bytes;
  REVIVA_CHECK_ARG(user != nullptr || bytes == 0, "DiskFile: a null buffer for ", bytes, " bytes");
  REVIVA_CHECK_ARG(offset % bb == 0, "DiskFile: file offset ", offset, " is not on a block (", bb,
                   " bytes)");
  const std::size_t blocks = (bytes + bb - 1) / bb;
  auto state = std::make_shared<detail::DiskRequestState>();
  state->remaining = blocks;
  for (std::size_t j = 0; j < blocks; ++j) {
    char* mine = user + j * bb;
    const std::size_t valid = std::min(bb, bytes - j * bb);
    const std::uint64_t block = offset / bb + j;
    // O_DIRECT takes whole aligned pages from aligned memory; anything else is staged
    const std::size_t io_bytes = direct ? round_up(valid, kDiskAlignment) : valid;
    void* staging = nullptr;
    if (direct && (!aligned(mine) || io_bytes != valid)) {
      try {
        staging = take_staging();
      } catch (...) {
        // (the blocks not submitted fail; those in flight still use the caller's buffer, so
        // they are waited for before the error leaves)
        for (std::size_t k = j; k < blocks; ++k) {
          if (done) done(k, 0, false);
          state->block_done(k, "not submitted");
        }
        state->wait_all();
        throw;
      }
    }
    std::uint32_t crc = write ? 0 : sums_in[j];
    if (write) {
      if (staging) {
        std::memcpy(staging, mine, valid);
        std::memset(static_cast<char*>(staging) + valid, 0, io_bytes - valid);
      }
      crc = crc32c(mine, valid);
    }
    detail::DiskOp op;
    op.write = write;
    op.fd = fd;
    op.buffer = staging ? staging : mine;
    op.bytes = io_bytes;
    op.file_offset = block * bb;
    op.done = [this, state, j, block, mine, staging, valid, io_bytes, write, crc, sums_out,
               done](long result) {
      void* buffer = staging ? staging : mine;
      if (options.inject)
        result =
            options.inject({write, block, block * options.block_bytes, buffer, io_bytes}, result);
      std::string failure;
      bool bad_sum = false;
      // (a read of the file's last block may stop at its end: the valid bytes are what count)
      const std::size_t need = write ? io_bytes : valid;
      if (result < 0) {
        failure = where(write, block, valid) + ": " + detail::errno_text(static_cast<int>(-result));
      } else if (static_cast<std::size_t>(result) < need) {
        failure =
            where(write, block, valid) + detail::concat(": short ", write ? "write" : "read", " (",
                                                        result, " of ", need, " bytes)");
      } else if (!write) {
        const std::uint32_t got = crc32c(buffer, valid);
        if (got != crc) {
          bad_sum = true;
          char sums[64];
          std::snprintf(sums, sizeof sums, ": checksum 0x%08x, written 0x%08x", got, crc);
          failure = where(write, block, valid) + sums;
        } else if (staging) {
          std::memcpy(mine, staging, valid);
        }
      }
      if (staging) give_staging(staging);
      if (write && failure.empty() && sums_out) sums_out[j] = crc;
      {
        std::lock_guard<std::mutex> lock(mutex);
        if (write) {
          ++counters.blocks_written;
          if (failure.empty()) counters.bytes_written += valid;
        } else {
          ++counters.blocks_read;
          if (failure.empty()) counters.bytes_read += valid;
        }
        counters.staged_blocks += staging != nullptr;
        counters.failed_blocks += !failure.empty();
        counters.checksum_failures += bad_sum;
      }
      if (done) done(j, crc, failure.empty());
      state->block_done(j, failure);
    };
    engine->submit(std::move(op));
  }
  return DiskRequest(std::move(state));
}

}  // namespace reviva
