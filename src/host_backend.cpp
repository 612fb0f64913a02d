// The host backend: CUDA's stream/event semantics on the CPU, for machines without a GPU and
// for tests. Each stream is a worker thread draining a FIFO of tasks; an event carries a
// generation counter (bumped by each record, reached when the recording stream runs the record
// task); a stream waiting on an event runs a task that blocks until the generation captured at
// submission is reached. "Device" memory is ordinary host memory, counted against a simulated
// total so that budget logic can be exercised at any size.
#include <reviva/backend.h>
#include <reviva/error.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <new>
#include <thread>

#include <sys/mman.h>
#include <unistd.h>

namespace reviva {
namespace {

using Clock = std::chrono::steady_clock;

struct HostEvent {
  std::mutex mutex;
  std::condition_variable reached_cv;
  std::uint64_t recorded = 0;    // guarded by mutex: generation of the latest record
  std::uint64_t completed = 0;   // guarded by mutex: latest generation reached
  Clock::time_point reached_at;  // guarded by mutex
  bool timing = false;
};

// An event handle owns a reference; tasks that reference the event hold their own, so
// destroying a handle with records still queued is safe (as with cudaEventDestroy).
struct EventRef {
  std::shared_ptr<HostEvent> event;
};

class HostStream {
 public:
  HostStream() : worker_([this] { run(); }) {}

  ~HostStream() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    work_cv_.notify_one();
    worker_.join();  // drains the queue first: submitted work always completes
  }

  void submit(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(task));
      ++submitted_;
    }
    work_cv_.notify_one();
  }

  void synchronize() {
    std::unique_lock<std::mutex> lock(mutex_);
    const std::uint64_t target = submitted_;
    idle_cv_.wait(lock, [&] { return completed_ >= target; });
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping and drained
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ++completed_;
      }
      idle_cv_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable idle_cv_;
  std::deque<std::function<void()>> queue_;  // guarded by mutex_
  std::uint64_t submitted_ = 0;              // guarded by mutex_
  std::uint64_t completed_ = 0;              // guarded by mutex_
  bool stopping_ = false;                    // guarded by mutex_
  std::thread worker_;                       // last: starts after the fields above exist
};

HostStream* as_stream(StreamHandle handle) {
  REVIVA_CHECK_ARG(handle != nullptr, "host backend: null stream handle");
  return static_cast<HostStream*>(handle);
}

std::shared_ptr<HostEvent> as_event(EventHandle handle) {
  REVIVA_CHECK_ARG(handle != nullptr, "host backend: null event handle");
  return static_cast<EventRef*>(handle)->event;
}

constexpr std::size_t kDeviceAlignment = 256;
constexpr std::size_t kPinnedAlignment = 4096;

std::size_t round_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }

class HostBackend final : public Backend {
 public:
  explicit HostBackend(HostBackendOptions options) : options_(options) {}

  ~HostBackend() override {
    for (auto& [ptr, bytes] : device_allocations_) std::free(const_cast<char*>(ptr));
  }

  BackendKind kind() const noexcept override { return BackendKind::Host; }
  std::string name() const override { return "host"; }
  int device_index() const noexcept override { return -1; }

  StreamHandle create_stream(StreamPriority) override { return new HostStream(); }
  void destroy_stream(StreamHandle stream) noexcept override {
    delete static_cast<HostStream*>(stream);
  }
  void synchronize_stream(StreamHandle stream) override { as_stream(stream)->synchronize(); }

  void stream_wait_event(StreamHandle stream, EventHandle event) override {
    auto ev = as_event(event);
    std::uint64_t target;
    {
      std::lock_guard<std::mutex> lock(ev->mutex);
      target = ev->recorded;
    }
    if (target == 0) return;  // never recorded: nothing to wait for
    as_stream(stream)->submit([ev, target] {
      std::unique_lock<std::mutex> lock(ev->mutex);
      ev->reached_cv.wait(lock, [&] { return ev->completed >= target; });
    });
  }

  void launch_host_func(StreamHandle stream, std::function<void()> fn) override {
    REVIVA_CHECK_ARG(fn != nullptr, "launch_host_func: empty function");
    as_stream(stream)->submit(std::move(fn));
  }

  EventHandle create_event(bool enable_timing) override {
    auto ev = std::make_shared<HostEvent>();
    ev->timing = enable_timing;
    return new EventRef{std::move(ev)};
  }
  void destroy_event(EventHandle event) noexcept override { delete static_cast<EventRef*>(event); }

  void record_event(EventHandle event, StreamHandle stream) override {
    auto ev = as_event(event);
    HostStream* s = as_stream(stream);
    std::uint64_t generation;
    {
      std::lock_guard<std::mutex> lock(ev->mutex);
      generation = ++ev->recorded;
    }
    s->submit([ev, generation] {
      {
        std::lock_guard<std::mutex> lock(ev->mutex);
        ev->completed = std::max(ev->completed, generation);
        ev->reached_at = Clock::now();
      }
      ev->reached_cv.notify_all();
    });
  }

  bool query_event(EventHandle event) override {
    auto ev = as_event(event);
    std::lock_guard<std::mutex> lock(ev->mutex);
    return ev->completed >= ev->recorded;
  }

  void synchronize_event(EventHandle event) override {
    auto ev = as_event(event);
    std::unique_lock<std::mutex> lock(ev->mutex);
    const std::uint64_t target = ev->recorded;
    ev->reached_cv.wait(lock, [&] { return ev->completed >= target; });
  }

  float elapsed_ms(EventHandle start, EventHandle end) override {
    auto a = as_event(start);
    auto b = as_event(end);
    Clock::time_point ta, tb;
    {
      std::lock_guard<std::mutex> lock(a->mutex);
      if (!a->timing) throw InvalidArgument("elapsed_ms: start event has timing disabled");
      if (a->recorded == 0 || a->completed < a->recorded)
        throw BackendError("elapsed_ms: start event has not completed");
      ta = a->reached_at;
    }
    {
      std::lock_guard<std::mutex> lock(b->mutex);
      if (!b->timing) throw InvalidArgument("elapsed_ms: end event has timing disabled");
      if (b->recorded == 0 || b->completed < b->recorded)
        throw BackendError("elapsed_ms: end event has not completed");
      tb = b->reached_at;
    }
    return std::chrono::duration<float, std::milli>(tb - ta).count();
  }

  void* allocate_pinned_host(std::size_t bytes) override {
    REVIVA_CHECK_ARG(bytes > 0, "allocate_pinned_host: bytes must be > 0");
    void* p = std::aligned_alloc(kPinnedAlignment, round_up(bytes, kPinnedAlignment));
    if (!p)
      throw OutOfMemory(detail::concat("host backend: cannot allocate ", bytes,
                                       " bytes of (simulated pinned) host memory"));
    std::lock_guard<std::mutex> lock(mutex_);
    pinned_allocations_[static_cast<const char*>(p)] = bytes;
    return p;
  }

  void free_pinned_host(void* ptr) noexcept override {
    if (!ptr) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      pinned_allocations_.erase(static_cast<const char*>(ptr));
    }
    std::free(ptr);
  }

  void* allocate_device(std::size_t bytes, StreamHandle) override {
    REVIVA_CHECK_ARG(bytes > 0, "allocate_device: bytes must be > 0");
    const std::size_t rounded = round_up(bytes, kDeviceAlignment);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (device_bytes_ + rounded > options_.simulated_device_bytes)
        throw OutOfMemory(detail::concat("host backend: cannot allocate ", bytes,
                                         " bytes of device memory: ", device_bytes_, " of ",
                                         options_.simulated_device_bytes, " bytes in use"));
      device_bytes_ += rounded;
    }
    void* p = std::aligned_alloc(kDeviceAlignment, rounded);
    std::lock_guard<std::mutex> lock(mutex_);
    if (!p) {
      device_bytes_ -= rounded;
      throw OutOfMemory(detail::concat("host backend: malloc of ", rounded, " bytes failed"));
    }
    device_allocations_[static_cast<const char*>(p)] = rounded;
    return p;
  }

  void free_device(void* ptr, StreamHandle stream) noexcept override {
    if (!ptr) return;
    // Stream-ordered, as cudaFreeAsync: released once the stream's earlier work is done.
    auto release = [this, ptr] {
      std::size_t bytes = 0;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = device_allocations_.find(static_cast<const char*>(ptr));
        if (it == device_allocations_.end()) return;
        bytes = it->second;
        device_allocations_.erase(it);
        device_bytes_ -= bytes;
      }
      std::free(ptr);
    };
    if (stream) {
      try {
        static_cast<HostStream*>(stream)->submit(release);
        return;
      } catch (...) {
        // Could not queue (out of memory): free now, after draining the stream.
        static_cast<HostStream*>(stream)->synchronize();
      }
    }
    release();
  }

  DeviceMemoryInfo device_memory_info() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return {options_.simulated_device_bytes - device_bytes_, options_.simulated_device_bytes};
  }

  // Virtual memory as the OS gives it: an address range reserved with no access, pages made
  // readable and writable when "mapped" and dropped (madvise) when unmapped, so that a use of
  // unmapped arena memory faults here as it would on the GPU. Mapped bytes count against the
  // simulated device total like allocate_device's.
  std::size_t vmm_granularity() override { return options_.vmm_granularity; }

  void* reserve_address(std::size_t bytes) override {
    REVIVA_CHECK_ARG(bytes > 0 && bytes % options_.vmm_granularity == 0, "reserve_address: ", bytes,
                     " bytes is not a positive multiple of the ", options_.vmm_granularity,
                     "-byte granularity");
    void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      throw OutOfMemory(
          detail::concat("host backend: cannot reserve ", bytes, " bytes of address space"));
    std::lock_guard<std::mutex> lock(mutex_);
    reservations_[static_cast<const char*>(p)] = bytes;
    return p;
  }

  void release_address(void* ptr, std::size_t bytes) noexcept override {
    if (!ptr) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      reservations_.erase(static_cast<const char*>(ptr));
    }
    munmap(ptr, bytes);
  }

  void map_memory(void* ptr, std::size_t bytes) override {
    REVIVA_CHECK_ARG(ptr != nullptr && bytes > 0 && bytes % options_.vmm_granularity == 0,
                     "map_memory: ", bytes, " bytes at ", ptr, " is not a positive multiple of ",
                     "the ", options_.vmm_granularity, "-byte granularity");
    {
      std::lock_guard<std::mutex> lock(mutex_);
      REVIVA_CHECK_ARG(holds(reservations_, ptr, bytes), "map_memory: [", ptr, ", +", bytes,
                       ") is not inside one reservation");
      if (device_bytes_ + bytes > options_.simulated_device_bytes)
        throw OutOfMemory(detail::concat("host backend: cannot map ", bytes,
                                         " bytes of device memory: ", device_bytes_, " of ",
                                         options_.simulated_device_bytes, " bytes in use"));
      device_bytes_ += bytes;
    }
    if (mprotect(ptr, bytes, PROT_READ | PROT_WRITE) != 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      device_bytes_ -= bytes;
      throw OutOfMemory(detail::concat("host backend: mprotect of ", bytes, " bytes failed"));
    }
  }

  void unmap_memory(void* ptr, std::size_t bytes) noexcept override {
    if (!ptr) return;
    madvise(ptr, bytes, MADV_DONTNEED);  // the pages' contents are gone, as on the device
    mprotect(ptr, bytes, PROT_NONE);
    std::lock_guard<std::mutex> lock(mutex_);
    device_bytes_ -= bytes;
  }

  MemoryKind memory_kind(const void* ptr) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (contains(device_allocations_, ptr)) return MemoryKind::Device;
    if (contains(reservations_, ptr)) return MemoryKind::Device;
    if (contains(pinned_allocations_, ptr)) return MemoryKind::PinnedHost;
    return MemoryKind::Unknown;  // memory of others (e.g. torch CPU tensors): can't tell
  }

  void copy_async(void* dst, const void* src, std::size_t bytes, StreamHandle stream) override {
    REVIVA_CHECK_ARG(dst != nullptr && src != nullptr, "copy_async: null pointer");
    as_stream(stream)->submit([dst, src, bytes] { std::memcpy(dst, src, bytes); });
  }

  void copy_segments_async(const CopySegment* segments, std::size_t count,
                           StreamHandle stream) override {
    REVIVA_CHECK_ARG(segments != nullptr || count == 0, "copy_segments_async: null segments");
    as_stream(stream)->submit([segments, count] {
      for (std::size_t i = 0; i < count; ++i)
        std::memcpy(segments[i].dst, segments[i].src, segments[i].bytes);
    });
  }

  void memset_async(void* dst, int value, std::size_t bytes, StreamHandle stream) override {
    REVIVA_CHECK_ARG(dst != nullptr, "memset_async: null pointer");
    as_stream(stream)->submit([dst, value, bytes] { std::memset(dst, value, bytes); });
  }

  void dequantize_fp8_rows_async(const Fp8Rows& rows, void* out, HalfType type,
                                 StreamHandle stream) override {
    check_fp8_rows(rows, out);
    as_stream(stream)->submit([rows, out, type] { dequantize_fp8_rows(rows, out, type); });
  }

  void gather_rows_async(const RowGather& gather, StreamHandle stream) override {
    check_row_gather(gather);
    as_stream(stream)->submit([gather] { gather_rows(gather); });
  }

  void attend_fp8_decode_async(const Fp8DecodeAttention& attention, StreamHandle stream) override {
    check_fp8_decode_attention(attention);
    as_stream(stream)->submit([attention] { attend_fp8_decode(attention); });
  }

  std::size_t fp8_decode_workspace_bytes(const Fp8DecodeAttention&) const override { return 0; }

  void rms_norm_async(const RmsNorm& norm, StreamHandle stream) override {
    check_rms_norm(norm);
    as_stream(stream)->submit([norm] { rms_norm(norm); });
  }

  void rotary_async(const Rotary& r, StreamHandle stream) override {
    check_rotary(r);
    as_stream(stream)->submit([r] { rotary(r); });
  }

  void silu_mul_async(const SiluMul& op, StreamHandle stream) override {
    check_silu_mul(op);
    as_stream(stream)->submit([op] { silu_mul(op); });
  }

 private:
  HostBackendOptions options_;
  std::mutex mutex_;
  // Ordered by address, so that memory_kind() finds the allocation holding any interior pointer.
  using Allocations = std::map<const char*, std::size_t>;
  static bool contains(const Allocations& allocations, const void* ptr) {
    return holds(allocations, ptr, 1);
  }
  // Whether one allocation holds all of [ptr, ptr + bytes).
  static bool holds(const Allocations& allocations, const void* ptr, std::size_t bytes) {
    const char* p = static_cast<const char*>(ptr);
    auto it = allocations.upper_bound(p);
    if (it == allocations.begin()) return false;
    --it;
    return p + bytes <= it->first + it->second;
  }

  Allocations device_allocations_;  // guarded by mutex_
  Allocations pinned_allocations_;  // guarded by mutex_
  Allocations reservations_;        // guarded by mutex_: reserved address ranges (arena)
  std::size_t device_bytes_ = 0;    // guarded by mutex_
};

}  // namespace

std::shared_ptr<Backend> make_host_backend(HostBackendOptions options) {
  REVIVA_CHECK_ARG(options.simulated_device_bytes > 0,
                   "HostBackendOptions.simulated_device_bytes must be > 0");
  const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  REVIVA_CHECK_ARG(options.vmm_granularity > 0 && options.vmm_granularity % page == 0,
                   "HostBackendOptions.vmm_granularity must be a positive multiple of the ", page,
                   "-byte page, got ", options.vmm_granularity);
  return std::make_shared<HostBackend>(options);
}

}  // namespace reviva
