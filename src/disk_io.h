// The disk tier's engines (disk_io_threads.cpp, disk_io_uring.cpp): they move one block request
// at a time between a buffer and a file offset and report the result; what the bytes mean
// (extents, checksums, staging) is DiskStore's (disk_store.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace reviva::detail {

struct DiskOp {
  bool write = false;
  int fd = -1;
  void* buffer = nullptr;
  std::size_t bytes = 0;
  std::uint64_t file_offset = 0;
  // Called once on an engine thread with the bytes moved (a read may come back short) or
  // -errno. A write comes back whole or with an error: an engine resubmits a short one.
  std::function<void(long result)> done;
};

class DiskIoEngine {
 public:
  virtual ~DiskIoEngine() = default;  // completes every op submitted, then stops
  // Queues the op and returns: it never waits for the disk.
  virtual void submit(DiskOp op) = 0;
  virtual bool io_uring() const noexcept = 0;
};

std::unique_ptr<DiskIoEngine> make_thread_engine(unsigned threads);
// nullptr, with the reason in `why_not`, where the kernel refuses io_uring (too old, disabled by
// sysctl, or a sandbox's seccomp filter).
std::unique_ptr<DiskIoEngine> make_uring_engine(unsigned depth, std::string* why_not);

// "EIO (Input/output error)" for 5.
std::string errno_text(int error);

}  // namespace reviva::detail
