// The thread pool of decode attention on the host (Note [Attention's thread pool] in
// host_attention_pool.h): its workers' loop, their growth, and the pool's end at exit.
#include "host_attention_pool.h"

#include <system_error>

namespace reviva::detail {

Pool::~Pool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void Pool::grow(std::size_t count) {
  while (workers_.size() < count) {
    const std::size_t index = workers_.size() + 1;
    std::uint64_t seen;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      seen = generation_;  // (a new worker waits for the next call, not the last one)
    }
    try {
      workers_.emplace_back([this, index, seen] { serve(index, seen); });
    } catch (const std::system_error&) {
      return;  // (the caller runs the parts left over)
    }
  }
}

void Pool::serve(std::size_t index, std::uint64_t seen) {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stopping_ || generation_ != seen; });
    if (stopping_) return;
    seen = generation_;
    if (index >= parts_) continue;
    void (*job)(void*, std::size_t) = job_;
    void* arg = job_arg_;
    lock.unlock();
    job(arg, index);
    lock.lock();
    if (--pending_ == 0) done_cv_.notify_one();
  }
}

Pool& pool() {
  static struct Holder {
    Pool* pool = new Pool;
    ~Holder() {
      if (!pool->forked()) delete pool;
    }
  } holder;
  return *holder.pool;
}

}  // namespace reviva::detail
