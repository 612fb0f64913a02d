// The io_uring engine of the disk tier, on the raw system calls (no liburing: it is not on every
// machine Reviva builds on). One ring of `depth` entries: submit() queues an op and fills free
// submission slots; one reaper thread waits for completions, resubmits short writes and what
// EAGAIN/EINTR sent back, and fills the slots freed from the queue.
//
// Note [Ring memory order]: the kernel reads the submission tail and writes the completion tail;
// we publish a submission entry with a release store of the tail and read completion entries
// after an acquire load of theirs, as liburing does.
#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "disk_io.h"

namespace reviva::detail {
namespace {

int sys_setup(unsigned entries, io_uring_params* p) {
  return static_cast<int>(::syscall(__NR_io_uring_setup, entries, p));
}
int sys_enter(int fd, unsigned submit, unsigned min_complete, unsigned flags) {
  return static_cast<int>(
      ::syscall(__NR_io_uring_enter, fd, submit, min_complete, flags, nullptr, 0));
}

// An op in flight: what is left of it and how much moved already (a short write goes on).
struct Flight {
  DiskOp op;
  std::size_t moved = 0;
};

constexpr std::uint64_t kStop = 0;  // user_data of the NOP that stops the reaper

class UringEngine final : public DiskIoEngine {
 public:
  UringEngine() = default;
  ~UringEngine() override {
    if (reaper_.joinable()) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        idle_.wait(lock, [&] { return in_flight_ == 0 && queue_.empty(); });
        push_locked(kStop, IORING_OP_NOP, -1, nullptr, 0, 0);
      }
      reaper_.join();  // (it returns at the NOP's completion)
    }
    unmap();
  }

  // Maps the rings; false (and why) where the kernel refuses.
  bool open(unsigned depth, std::string* why_not) {
    io_uring_params p{};
    fd_ = sys_setup(depth, &p);
    if (fd_ < 0) {
      *why_not = "io_uring_setup: " + errno_text(errno);
      return false;
    }
    if (!(p.features & IORING_FEAT_SINGLE_MMAP)) {
      *why_not = "io_uring without IORING_FEAT_SINGLE_MMAP (kernel older than 5.4)";
      return false;
    }
    ring_bytes_ = std::max(p.sq_off.array + p.sq_entries * sizeof(unsigned),
                           p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe));
    ring_ = ::mmap(nullptr, ring_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_,
                   IORING_OFF_SQ_RING);
    sqes_bytes_ = p.sq_entries * sizeof(io_uring_sqe);
    sqes_ = static_cast<io_uring_sqe*>(::mmap(nullptr, sqes_bytes_, PROT_READ | PROT_WRITE,
                                              MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_SQES));
    if (ring_ == MAP_FAILED || sqes_ == MAP_FAILED) {
      *why_not = "mmap of the io_uring rings: " + errno_text(errno);
      return false;
    }
    auto at = [&](unsigned off) {
      return reinterpret_cast<unsigned*>(static_cast<char*>(ring_) + off);
    };
    sq_head_ = at(p.sq_off.head);
    sq_tail_ = at(p.sq_off.tail);
    sq_mask_ = *at(p.sq_off.ring_mask);
    sq_array_ = at(p.sq_off.array);
    cq_head_ = at(p.cq_off.head);
    cq_tail_ = at(p.cq_off.tail);
    cq_mask_ = *at(p.cq_off.ring_mask);
    cqes_ = reinterpret_cast<io_uring_cqe*>(static_cast<char*>(ring_) + p.cq_off.cqes);
    // one slot kept for the stopping NOP
    depth_ = p.sq_entries > 1 ? p.sq_entries - 1 : 1;
    reaper_ = std::thread([this] { reap(); });
    return true;
  }

  void submit(DiskOp op) override {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(new Flight{std::move(op)});
    fill_locked();
  }
  bool io_uring() const noexcept override { return true; }

 private:
  // Moves queued ops into free slots (mutex_ held).
  void fill_locked() {
    while (!queue_.empty() && in_flight_ < depth_) {
      Flight* f = queue_.front();
      queue_.pop_front();
      ++in_flight_;
      push_flight_locked(f);
    }
  }
  void push_flight_locked(Flight* f) {
    const DiskOp& op = f->op;
    push_locked(reinterpret_cast<std::uint64_t>(f), op.write ? IORING_OP_WRITE : IORING_OP_READ,
                op.fd, static_cast<char*>(op.buffer) + f->moved,
                static_cast<unsigned>(op.bytes - f->moved), op.file_offset + f->moved);
  }
  // One entry, submitted at once (mutex_ held: the submission ring has one producer at a time).
  void push_locked(std::uint64_t user_data, int opcode, int fd, void* addr, unsigned len,
                   std::uint64_t offset) {
    const unsigned tail = *sq_tail_;
    const unsigned index = tail & sq_mask_;
    io_uring_sqe* sqe = &sqes_[index];
    std::memset(sqe, 0, sizeof(*sqe));
    sqe->opcode = static_cast<__u8>(opcode);
    sqe->fd = fd;
    sqe->addr = reinterpret_cast<std::uint64_t>(addr);
    sqe->len = len;
    sqe->off = offset;
    sqe->user_data = user_data;
    sq_array_[index] = index;
    __atomic_store_n(sq_tail_, tail + 1, __ATOMIC_RELEASE);  // Note [Ring memory order]
    for (;;) {
      const int r = sys_enter(fd_, 1, 0, 0);
      if (r >= 0 || (errno != EINTR && errno != EAGAIN && errno != EBUSY)) break;
    }
  }

  void reap() {
    for (;;) {
      const int r = sys_enter(fd_, 0, 1, IORING_ENTER_GETEVENTS);
      if (r < 0 && errno != EINTR && errno != EAGAIN && errno != EBUSY) {
        // (the ring itself failed: nothing can complete; should not happen)
        std::fprintf(stderr, "reviva: io_uring_enter: %s\n", errno_text(errno).c_str());
      }
      unsigned head = *cq_head_;
      const unsigned tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
      bool stop = false;
      for (; head != tail; ++head) {
        const io_uring_cqe cqe = cqes_[head & cq_mask_];
        __atomic_store_n(cq_head_, head + 1, __ATOMIC_RELEASE);
        if (cqe.user_data == kStop) {
          stop = true;
          continue;
        }
        complete(reinterpret_cast<Flight*>(cqe.user_data), cqe.res);
      }
      if (stop) return;
    }
  }

  void complete(Flight* f, int res) {
    // (the op reached this thread through the kernel's rings; taking the mutex its submitter
    // held orders its fields for the reader, and for ThreadSanitizer, which cannot see the rings)
    { std::lock_guard<std::mutex> lock(mutex_); }
    const bool again = res == -EAGAIN || res == -EINTR;
    const bool short_write = f->op.write && res > 0 && f->moved + res < f->op.bytes;
    if (again || short_write) {
      if (res > 0) f->moved += static_cast<std::size_t>(res);
      std::lock_guard<std::mutex> lock(mutex_);
      push_flight_locked(f);  // (keeps its slot)
      return;
    }
    long result = res < 0 ? res : static_cast<long>(f->moved + static_cast<std::size_t>(res));
    if (f->op.write && res == 0) result = -ENOSPC;  // (a write that moves nothing: no space)
    f->op.done(result);
    delete f;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --in_flight_;
      fill_locked();
    }
    idle_.notify_all();
  }

  void unmap() {
    if (sqes_ && sqes_ != MAP_FAILED) ::munmap(sqes_, sqes_bytes_);
    if (ring_ && ring_ != MAP_FAILED) ::munmap(ring_, ring_bytes_);
    if (fd_ >= 0) ::close(fd_);
  }

  int fd_ = -1;
  void* ring_ = nullptr;
  std::size_t ring_bytes_ = 0;
  io_uring_sqe* sqes_ = nullptr;
  std::size_t sqes_bytes_ = 0;
  unsigned *sq_head_ = nullptr, *sq_tail_ = nullptr, *sq_array_ = nullptr;
  unsigned *cq_head_ = nullptr, *cq_tail_ = nullptr;
  unsigned sq_mask_ = 0, cq_mask_ = 0;
  io_uring_cqe* cqes_ = nullptr;
  unsigned depth_ = 1;

  std::mutex mutex_;
  std::condition_variable idle_;
  std::deque<Flight*> queue_;  // guarded by mutex_: waiting for a slot
  unsigned in_flight_ = 0;     // guarded by mutex_
  std::thread reaper_;
};

}  // namespace

std::unique_ptr<DiskIoEngine> make_uring_engine(unsigned depth, std::string* why_not) {
  auto engine = std::make_unique<UringEngine>();
  if (!engine->open(depth, why_not)) return nullptr;
  return engine;
}

}  // namespace reviva::detail
