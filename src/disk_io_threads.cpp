// The thread engine of the disk tier: `threads` workers each doing one pread/pwrite at a time,
// so that many block requests are in flight where io_uring is not there.
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include <unistd.h>

#include "disk_io.h"

namespace reviva::detail {

std::string errno_text(int error) {
  const char* name = strerrorname_np(error);
  return std::string(name ? name : ("errno " + std::to_string(error)).c_str()) + " (" +
         strerror(error) + ")";
}

namespace {

// The whole op, retrying EINTR and short writes; a read returns what it got (short at the end
// of the file).
long transfer(const DiskOp& op) {
  std::size_t done = 0;
  auto p = static_cast<char*>(op.buffer);
  while (done < op.bytes) {
    const auto offset = static_cast<off_t>(op.file_offset + done);
    const ssize_t n = op.write ? ::pwrite(op.fd, p + done, op.bytes - done, offset)
                               : ::pread(op.fd, p + done, op.bytes - done, offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (n == 0) break;  // (a read at the end of the file; a write of 0 bytes: no space)
    done += static_cast<std::size_t>(n);
  }
  if (op.write && done < op.bytes) return -ENOSPC;
  return static_cast<long>(done);
}

class ThreadEngine final : public DiskIoEngine {
 public:
  explicit ThreadEngine(unsigned threads) {
    for (unsigned i = 0; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }
  ~ThreadEngine() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }
  void submit(DiskOp op) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(op));
    }
    wake_.notify_one();
  }
  bool io_uring() const noexcept override { return false; }

 private:
  void work() {
    for (;;) {
      DiskOp op;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // (stopping, and every op queued has been taken)
        op = std::move(queue_.front());
        queue_.pop_front();
      }
      op.done(transfer(op));
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<DiskOp> queue_;  // guarded by mutex_
  bool stopping_ = false;     // guarded by mutex_
  std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<DiskIoEngine> make_thread_engine(unsigned threads) {
  return std::make_unique<ThreadEngine>(threads);
}

}  // namespace reviva::detail
