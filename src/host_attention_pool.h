// The thread pool of decode attention on the host (Note [Attention's thread pool]): the workers
// host_decode_attention (host_attention.cpp) runs a call's parts on, made at the first call that
// wants them and kept. Internal to src/: not installed.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace reviva::detail {

// Note [Attention's thread pool]
// Workers made at the first call that wants them and kept, grown to the most threads asked for;
// a call runs part 0 on the calling thread and parts 1..n-1 on workers 1..n-1, which wait on a
// condition variable for the next generation of work. Whole calls are serialized (a mutex):
// callers on several threads are safe, and one call at a time is what a decode step makes.
// At exit a static destructor stops and joins the workers; idle, they wait on the condition
// variable only, so nothing is held that the exit could deadlock on. In a child process after
// fork() the workers do not exist (only the forking thread is copied) while the pool's state
// says they do: there the pool is not used (parts run one after another on the caller), nor
// destroyed at exit (joining the workers, or destroying a condition variable they wait on,
// would wait forever), just left.
class Pool {
 public:
  Pool() : pid_(getpid()) {}

  // (only in the process that made the pool: see forked())
  ~Pool();

  // Whether this is a child process forked since the pool was made.
  bool forked() const { return getpid() != pid_; }

  // work(w) for w in [0, n), on up to n threads. work must not throw.
  template <typename F>
  void run(std::size_t n, F& work) {
    if (n <= 1 || forked()) {
      for (std::size_t w = 0; w < n; ++w) work(w);
      return;
    }
    std::lock_guard<std::mutex> call(call_mutex_);
    grow(n - 1);
    const std::size_t workers = std::min(n - 1, workers_.size());
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = [](void* f, std::size_t w) { (*static_cast<F*>(f))(w); };
      job_arg_ = &work;
      parts_ = workers + 1;
      pending_ = workers;
      ++generation_;
    }
    work_cv_.notify_all();
    work(0);
    // (a part no worker could be made for, if any: on this thread)
    for (std::size_t w = workers + 1; w < n; ++w) work(w);
    std::unique_lock<std::mutex> lock(mutex_);
    done_cv_.wait(lock, [&] { return pending_ == 0; });
  }

 private:
  // At least `count` workers, or as many as the system lets us make.
  void grow(std::size_t count);

  void serve(std::size_t index, std::uint64_t seen);

  const pid_t pid_;
  std::mutex call_mutex_;  // held through a call
  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  void (*job_)(void*, std::size_t) = nullptr;  // guarded by mutex_
  void* job_arg_ = nullptr;                    // guarded by mutex_
  std::size_t parts_ = 0;                      // guarded by mutex_
  std::size_t pending_ = 0;                    // guarded by mutex_: workers not done
  std::uint64_t generation_ = 0;               // guarded by mutex_
  bool stopping_ = false;                      // guarded by mutex_
  std::vector<std::thread> workers_;           // guarded by call_mutex_
};

// The process's pool, made at the first call that asks for it; left, not destroyed, at exit in a
// forked child (Note [Attention's thread pool]).
Pool& pool();

}  // namespace reviva::detail
