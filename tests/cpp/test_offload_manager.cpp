// OffloadManager: long randomized runs on the host backend that check, after every operation, the
// budget, the state machine's invariants and the contents of every block against a shadow copy
// (for each policy, several seeds and budgets down to one that barely fits the largest block);
// the lifetime protocol with gated streams on both backends; the states and what each transition
// copies; budgets (absolute, fraction, lowered, over-pinned); adoption of caller memory; metrics
// and timeline; misuse; no backend call under the manager's mutex; many threads at once.
//
// Device memory comes from a checking allocator that poisons memory when it is handed out and
// when it is given back, each on the stream it was given, so that work not ordered after an
// allocation, or a free not ordered after the last copy that reads the memory, shows up as wrong
// data rather than passing by luck. On the host backend streams are threads, so a missing wait
// also shows up as wrong data; the copy streams are stalled now and then to make that likely.
#include "test_util.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <future>
#include <map>
#include <set>
#include <sstream>
#include <thread>

namespace reviva::test {
namespace {

constexpr std::size_t kKiB = 1024;
constexpr std::size_t kMiB = 1024 * 1024;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

::testing::AssertionResult same_bytes(const void* got, const std::vector<std::uint8_t>& want) {
  const auto* g = static_cast<const std::uint8_t*>(got);
  if (std::memcmp(g, want.data(), want.size()) == 0) return ::testing::AssertionSuccess();
  std::size_t i = 0;
  while (g[i] == want[i]) ++i;
  std::size_t wrong = 0;
  for (std::size_t j = 0; j < want.size(); ++j) wrong += g[j] != want[j];
  std::ostringstream first;
  first << std::hex << "got 0x" << int{g[i]} << ", want 0x" << int{want[i]};
  return ::testing::AssertionFailure()
         << wrong << " of " << want.size() << " bytes differ, the first at offset " << i << ": "
         << first.str()
         << " (0xa5: memory never written after allocation; 0x5a: memory already freed)";
}

// ThreadSanitizer makes every memory access about ten times slower: under it the randomized runs
// are shortened (every operation still interleaves with the copy threads), so that CI stays fast.
#if defined(__SANITIZE_THREAD__)
constexpr double kSanitizerScale = 0.25;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
constexpr double kSanitizerScale = 0.25;
#else
constexpr double kSanitizerScale = 1.0;
#endif
#else
constexpr double kSanitizerScale = 1.0;
#endif

// Work on `stream` pauses for `us` microseconds: copies queued behind it run late, so that a
// missing wait on them shows up as wrong data.
void stall(const Stream& stream, int us) {
  stream.launch_host_func([us] { std::this_thread::sleep_for(std::chrono::microseconds(us)); });
}

// A StreamGate that opens by itself after a deadline, so that a manager call that wrongly blocks
// on gated work fails the test instead of hanging it (expired() says whether that happened).
class DeadlineGate {
 public:
  explicit DeadlineGate(milliseconds deadline = milliseconds(5000)) {
    watchdog_ = std::thread([state = state_, deadline] {
      std::unique_lock<std::mutex> lock(state->mutex);
      if (!state->cv.wait_for(lock, deadline, [&] { return state->open; })) {
        state->expired = true;
        state->open = true;
        state->cv.notify_all();
      }
    });
  }
  ~DeadlineGate() {
    open();
    watchdog_.join();
  }
  DeadlineGate(const DeadlineGate&) = delete;
  DeadlineGate& operator=(const DeadlineGate&) = delete;

  void block(const Stream& stream) {
    stream.launch_host_func([state = state_] {
      std::unique_lock<std::mutex> lock(state->mutex);
      state->cv.wait(lock, [&] { return state->open; });
    });
  }
  void open() {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->open = true;
    }
    state_->cv.notify_all();
  }
  bool expired() const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->expired;
  }

 private:
  struct State {
    mutable std::mutex mutex;
    std::condition_variable cv;
    bool open = false;
    bool expired = false;
  };
  std::shared_ptr<State> state_ = std::make_shared<State>();
  std::thread watchdog_;
};

// Device memory handed to the manager, as the DeviceAllocator contract counts it: from when it
// is handed out until the work its stream had queued when it was given back has completed.
class MemoryLedger {
 public:
  explicit MemoryLedger(std::shared_ptr<Backend> backend) : backend_(std::move(backend)) {}
  void handed_out(std::size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    live_ += bytes;
  }
  void given_back(std::size_t bytes, StreamHandle stream) {
    auto done = std::make_shared<Event>(backend_);
    if (stream) done->record(stream);
    std::lock_guard<std::mutex> lock(mutex_);
    live_ -= bytes;
    pending_.push_back({std::move(done), bytes});
  }
  // Bytes handed out and not yet reusable.
  std::size_t outstanding() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::size_t pending = 0;
    std::erase_if(pending_, [&](const Pending& p) {
      if (p.done->query()) return true;
      pending += p.bytes;
      return false;
    });
    return live_ + pending;
  }

 private:
  struct Pending {
    std::shared_ptr<Event> done;
    std::size_t bytes;
  };
  std::shared_ptr<Backend> backend_;
  std::mutex mutex_;
  std::size_t live_ = 0;          // guarded by mutex_
  std::vector<Pending> pending_;  // guarded by mutex_
};

// The backend's allocator, checked: every allocation is poisoned with 0xa5 on its stream when
// handed out and with 0x5a on the free's stream when given back (see the file comment); frees
// must match a live allocation and its size; no call may name the null (default) stream; the
// ledger counts what the manager must count against its budget.
class CheckingAllocator final : public DeviceAllocator {
 public:
  explicit CheckingAllocator(std::shared_ptr<Backend> backend)
      : backend_(backend), inner_(make_backend_device_allocator(backend)), ledger_(backend) {}

  void* allocate(std::size_t bytes, StreamHandle stream) override {
    void* p = inner_->allocate(bytes, stream);
    if (stream)
      backend_->memset_async(p, 0xa5, bytes, stream);
    else
      ++null_streams_;
    ledger_.handed_out(bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    live_[p] = bytes;
    ++allocations_;
    return p;
  }
  void deallocate(void* p, std::size_t bytes, StreamHandle stream) noexcept override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = live_.find(p);
      if (it == live_.end()) {
        ++bad_frees_;  // a double free, or memory this allocator never gave: do not pass it on
        return;
      }
      if (it->second != bytes) ++bad_frees_;
      live_.erase(it);
    }
    try {
      ledger_.given_back(bytes, stream);
      if (stream) backend_->memset_async(p, 0x5a, bytes, stream);
    } catch (...) {
    }
    if (!stream) ++null_streams_;
    inner_->deallocate(p, bytes, stream);
  }
  std::string name() const override { return "checking(" + inner_->name() + ")"; }

  std::size_t live() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return live_.size();
  }
  std::uint64_t allocations() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return allocations_;
  }
  std::uint64_t bad_frees() const { return bad_frees_; }
  std::uint64_t null_streams() const { return null_streams_; }
  std::size_t outstanding_bytes() { return ledger_.outstanding(); }

 private:
  std::shared_ptr<Backend> backend_;
  std::shared_ptr<DeviceAllocator> inner_;
  MemoryLedger ledger_;
  mutable std::mutex mutex_;
  std::map<void*, std::size_t> live_;  // guarded by mutex_
  std::uint64_t allocations_ = 0;      // guarded by mutex_
  std::atomic<std::uint64_t> bad_frees_{0};
  std::atomic<std::uint64_t> null_streams_{0};
};

TransferEngineOptions small_chunks() {
  TransferEngineOptions o;
  o.chunk_bytes = 256 * kKiB;  // blocks of a few hundred KiB and up are copied in chunks
  return o;
}

OffloadManagerOptions with_budget(std::size_t bytes, PolicyKind policy = PolicyKind::Lru) {
  OffloadManagerOptions o;
  o.budget_bytes = bytes;
  o.policy = policy;
  return o;
}

// A manager with its engine, pools and checking allocator, a compute stream, and the test's
// shadow copy of every block's contents. Test data is staged through a pool of its own, so that
// the manager's pool can be checked for leaks.
struct Harness {
  Harness(std::shared_ptr<Backend> b, OffloadManagerOptions options,
          std::unique_ptr<EvictionPolicy> policy = nullptr)
      : backend(std::move(b)),
        pool(PinnedHostPool::create(backend, {})),
        staging(PinnedHostPool::create(backend, {})),
        engine(std::make_shared<TransferEngine>(pool, small_chunks())),
        allocator(std::make_shared<CheckingAllocator>(backend)),
        compute(std::make_shared<Stream>(backend)),
        manager(std::make_unique<OffloadManager>(engine, allocator, options, std::move(policy))) {}
  ~Harness() {
    try {
      compute->synchronize();
      manager->synchronize();
    } catch (...) {
    }
    manager.reset();
  }

  OffloadManager& m() { return *manager; }
  const Stream& h2d() const { return engine->stream(Direction::HostToDevice); }
  const Stream& d2h() const { return engine->stream(Direction::DeviceToHost); }

  // Writes fresh random bytes to [offset, offset + len) of the block at `dev` on `stream`, and
  // into its shadow. Asynchronous: the staging block is kept until the stream has copied it.
  void write(BlockId id, void* dev, std::size_t offset, std::size_t len,
             const std::shared_ptr<Stream>& stream) {
    auto& shadow = shadow_of(id);
    PinnedBlock st = staging->allocate(len);
    fill_random(st.data(), len, ++seed);
    std::memcpy(shadow.data() + offset, st.data(), len);
    backend->copy_async(static_cast<char*>(dev) + offset, st.data(), len, stream->handle());
    st.record_use(stream);
  }
  void write(BlockId id, void* dev) { write(id, dev, 0, manager->bytes(id), compute); }

  // Reads the block at `dev` back after the work queued so far on `stream`, against its shadow.
  ::testing::AssertionResult matches(BlockId id, const void* dev, const Stream& stream) {
    const auto& shadow = shadow_of(id);
    PinnedBlock st = staging->allocate(shadow.size());
    backend->copy_async(st.data(), dev, shadow.size(), stream.handle());
    stream.synchronize();
    return same_bytes(st.data(), shadow) << " (block " << id << ")";
  }
  ::testing::AssertionResult matches(BlockId id, const void* dev) {
    return matches(id, dev, *compute);
  }

  // A registered block holding fresh contents, resident and released.
  BlockId put(std::size_t bytes, std::string name = {}) {
    const BlockId id = manager->register_block(bytes, std::move(name));
    void* p = manager->acquire(id, *compute, Access::WriteOnly);
    write(id, p);
    manager->release(id, *compute);
    return id;
  }
  // Acquires the block read-only and compares it with its shadow.
  ::testing::AssertionResult holds(BlockId id) {
    void* p = manager->acquire(id, *compute, Access::ReadOnly);
    auto result = matches(id, p);
    manager->release(id, *compute);
    return result;
  }

  std::vector<std::uint8_t>& shadow_of(BlockId id) {
    std::lock_guard<std::mutex> lock(shadow_mutex);
    auto& s = shadows[id];
    if (s.empty()) s.resize(manager->bytes(id));
    return s;
  }

  std::shared_ptr<Backend> backend;
  std::shared_ptr<PinnedHostPool> pool;
  std::shared_ptr<PinnedHostPool> staging;
  std::shared_ptr<TransferEngine> engine;
  std::shared_ptr<CheckingAllocator> allocator;
  std::shared_ptr<Stream> compute;
  std::unique_ptr<OffloadManager> manager;
  std::mutex shadow_mutex;
  std::map<BlockId, std::vector<std::uint8_t>> shadows;  // guarded by shadow_mutex
  std::atomic<std::uint64_t> seed{1};
};

// After everything is unregistered: nothing held anywhere.
void expect_no_leak(Harness& h) {
  h.compute->synchronize();
  h.manager->synchronize();
  EXPECT_TRUE(h.manager->blocks().empty());
  EXPECT_EQ(h.manager->device_bytes(), 0u);
  h.manager->check_invariants();
  EXPECT_EQ(h.allocator->live(), 0u) << "allocations never given back";
  EXPECT_EQ(h.allocator->bad_frees(), 0u) << "double or mismatched frees";
  EXPECT_EQ(h.allocator->null_streams(), 0u) << "allocator called with the default stream";
  h.pool->synchronize_pending();
  EXPECT_EQ(h.pool->stats().bytes_in_use, 0u) << "host copies never given back";
  h.pool->check_invariants();
  h.staging->synchronize_pending();
  if (h.backend->kind() == BackendKind::Host) {
    const DeviceMemoryInfo info = h.backend->device_memory_info();
    EXPECT_EQ(info.free_bytes, info.total_bytes) << "device memory not freed";
  }
}

// ---------------------------------------------------------------------------------------------
// Randomized property test (host backend).

struct BlockModel {
  BlockId id = kInvalidBlock;
  std::size_t bytes = 0;
  bool has_contents = false;  // false: registered or discarded, no contents required
  void* acquired = nullptr;   // the address while the test holds it
  Access access = Access::ReadWrite;
};

class ManagerPropertyTest : public ::testing::TestWithParam<std::tuple<PolicyKind, int>> {};

std::string property_name(const ::testing::TestParamInfo<std::tuple<PolicyKind, int>>& info) {
  const char* budgets[] = {"BarelyFitsLargest", "LargestPlusPart", "ThreeLargest", "Roomy"};
  std::string policy = to_string(std::get<0>(info.param));
  policy.erase(
      std::remove_if(policy.begin(), policy.end(), [](char c) { return !std::isalnum(c); }),
      policy.end());
  return policy + "_" + budgets[std::get<1>(info.param)];
}

TEST_P(ManagerPropertyTest, RandomOperationsKeepBudgetStatesAndDataIntact) {
  const auto [policy, variant] = GetParam();
  const std::uint64_t seed = 7919 * (static_cast<std::uint64_t>(policy) + 1) + variant;
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto uniform = [&rng](std::size_t lo, std::size_t hi) { return lo + rng() % (hi - lo + 1); };

  const std::size_t largest = uniform(512 * kKiB, 2 * kMiB) | 1;  // odd sizes too
  const std::size_t smallest = 32 * kKiB;
  std::size_t budget = largest;
  if (variant == 1) budget = largest + uniform(1, largest);
  if (variant == 2) budget = 3 * largest;
  if (variant == 3) budget = 8 * largest;
  auto block_size = [&] {  // log-uniform in [smallest, largest]
    const double t = std::uniform_real_distribution<double>(0, 1)(rng);
    return std::min(largest,
                    static_cast<std::size_t>(smallest * std::pow(double(largest) / smallest, t)) +
                        rng() % 4096);
  };

  HostBackendOptions bo;
  bo.simulated_device_bytes = std::size_t{1} << 30;
  Harness h(make_host_backend(bo), with_budget(budget, policy));
  OffloadManager& m = h.m();
  ASSERT_EQ(m.budget_bytes(), budget);

  std::vector<BlockModel> blocks;
  std::size_t pinned = 0;  // bytes of blocks the test holds acquired
  std::vector<std::shared_ptr<std::atomic<int>>> adopted_releases;
  auto adopted_null_streams = std::make_shared<std::atomic<int>>(0);
  auto adopted = std::make_shared<MemoryLedger>(h.backend);  // adopted memory, until given back
  std::uint64_t last_to_host = 0, last_to_device = 0;
  int ooms = 0, acquires = 0, reads = 0;

  auto pick = [&](auto&& want) -> BlockModel* {
    std::vector<BlockModel*> c;
    for (auto& b : blocks)
      if (want(b)) c.push_back(&b);
    return c.empty() ? nullptr : c[rng() % c.size()];
  };
  auto free_block = [](const BlockModel& b) { return b.acquired == nullptr; };
  auto held_block = [](const BlockModel& b) { return b.acquired != nullptr; };
  auto erase = [&](BlockId id) {
    blocks.erase(std::find_if(blocks.begin(), blocks.end(), [&](auto& b) { return b.id == id; }));
  };
  auto resident_or_arriving = [&](BlockId id) {
    const BlockState s = m.state(id);
    return s == BlockState::Device || s == BlockState::ToDevice;
  };
  auto maybe_stall_copies = [&] {
    if (rng() % 24 == 0) stall(h.h2d(), static_cast<int>(uniform(100, 1000)));
    if (rng() % 24 == 0) stall(h.d2h(), static_cast<int>(uniform(100, 1000)));
  };
  auto verify = [&](BlockModel& b) {
    ++reads;
    return h.matches(b.id, b.acquired);
  };

  // Checked after every operation.
  auto check_all = [&](const char* op) {
    SCOPED_TRACE(op);
    const std::size_t held = m.device_bytes();
    ASSERT_LE(held, m.budget_bytes()) << "over budget after " << op;
    m.check_invariants();
    const ManagerMetrics mm = m.metrics();
    ASSERT_LE(mm.peak_device_bytes, budget);
    ASSERT_EQ(mm.budget_bytes, budget);
    std::size_t registered = 0;
    for (auto& b : blocks) registered += b.bytes;
    ASSERT_EQ(mm.registered_bytes, registered);
    ASSERT_GE(mm.peak_registered_bytes, registered);
    ASSERT_GE(mm.bytes_to_host, last_to_host) << "a completed-bytes counter went down";
    ASSERT_GE(mm.bytes_to_device, last_to_device) << "a completed-bytes counter went down";
    last_to_host = mm.bytes_to_host;
    last_to_device = mm.bytes_to_device;
    ASSERT_LE(mm.clean_evictions, mm.evictions);
    ASSERT_GE(mm.overlap_ratio, 0.0);
    ASSERT_LE(mm.overlap_ratio, 1.0);
    // Every byte handed to the manager and not yet reusable is counted (read after `held`: what
    // is outstanding now was outstanding then). The ledger's events are recorded inside
    // deallocate, one task after the point the manager may rightly wait for, so an excess must
    // only vanish soon, not be absent: within milliseconds, allowed 200 ms (10 ms was too
    // short under ASan on a 2-core machine busy with a build: 2q_BarelyFitsLargest, once).
    std::size_t outstanding = h.allocator->outstanding_bytes() + adopted->outstanding();
    for (int retry = 0; retry < 100 && outstanding > held; ++retry) {
      std::this_thread::sleep_for(milliseconds(2));
      outstanding = h.allocator->outstanding_bytes() + adopted->outstanding();
    }
    ASSERT_LE(outstanding, held) << "device memory in use that the manager does not count";
  };

  const int ops = scaled(static_cast<int>(2500 * kSanitizerScale));
  int max_held = 1;
  for (int op = 0; op < ops; ++op) {
    if (op % 200 == 0) max_held = static_cast<int>(uniform(1, 4));
    const int held_count =
        static_cast<int>(std::count_if(blocks.begin(), blocks.end(), held_block));
    const int r = static_cast<int>(rng() % 1000);
    maybe_stall_copies();
    const char* what = "";

    if (blocks.empty() || (r < 60 && blocks.size() < 24)) {
      what = "register";
      BlockModel b;
      b.bytes = op == 0 || rng() % 20 == 0 ? largest : block_size();
      b.id = m.register_block(b.bytes, "block" + std::to_string(op));
      ASSERT_NE(b.id, kInvalidBlock);
      ASSERT_EQ(m.state(b.id), BlockState::Empty);
      ASSERT_EQ(m.bytes(b.id), b.bytes);
      blocks.push_back(b);
    } else if (r < 75 && blocks.size() < 24) {
      what = "adopt";
      const std::size_t bytes = block_size();
      if (pinned + bytes > budget) continue;
      void* dev = h.backend->allocate_device(bytes, h.compute->handle());
      BlockModel b;
      b.bytes = bytes;
      auto released = std::make_shared<std::atomic<int>>(0);
      adopted_releases.push_back(released);
      auto backend = h.backend;
      auto release_fn = [backend, dev, bytes, released, adopted_null_streams,
                         adopted](StreamHandle s) {
        released->fetch_add(1);
        if (!s) adopted_null_streams->fetch_add(1);
        adopted->given_back(bytes, s);
        backend->free_device(dev, s);
      };
      // Its contents are written on the compute stream, late: the manager must order any copy
      // of the block after the producer's work.
      if (rng() % 2) stall(*h.compute, static_cast<int>(uniform(200, 1500)));
      PinnedBlock st = h.staging->allocate(bytes);
      std::vector<std::uint8_t> contents(bytes);
      fill_random(st.data(), bytes, ++h.seed);
      std::memcpy(contents.data(), st.data(), bytes);
      h.backend->copy_async(dev, st.data(), bytes, h.compute->handle());
      st.record_use(h.compute);
      adopted->handed_out(bytes);
      b.id = m.adopt(dev, bytes, release_fn, *h.compute, "adopted" + std::to_string(op));
      b.has_contents = true;
      h.shadow_of(b.id) = std::move(contents);
      ASSERT_EQ(m.state(b.id), BlockState::Device);
      blocks.push_back(b);
    } else if (r < 420 && held_count < max_held) {
      what = "acquire";
      BlockModel* b = pick(free_block);
      if (!b) continue;
      const int a = static_cast<int>(rng() % 100);
      Access access = a < 45 ? Access::ReadWrite : a < 80 ? Access::ReadOnly : Access::WriteOnly;
      if (access == Access::ReadOnly && !b->has_contents) access = Access::ReadWrite;
      const bool fits = pinned + b->bytes <= budget;
      void* p = nullptr;
      try {
        p = m.acquire(b->id, *h.compute, access);
      } catch (const OutOfMemory& e) {
        ASSERT_FALSE(fits) << "acquire of " << b->bytes << " bytes threw with " << pinned
                           << " bytes pinned under a budget of " << budget << ": " << e.what();
        EXPECT_NE(std::string(e.what()).find(std::to_string(budget)), std::string::npos)
            << "the message does not name the budget: " << e.what();
        ++ooms;
        what = "acquire (out of memory)";
      }
      if (p) {
        ASSERT_TRUE(fits) << "acquire of " << b->bytes << " bytes succeeded with " << pinned
                          << " bytes pinned under a budget of " << budget;
        ASSERT_NE(p, nullptr);
        ++acquires;
        b->acquired = p;
        b->access = access;
        pinned += b->bytes;
        ASSERT_TRUE(resident_or_arriving(b->id)) << to_string(m.state(b->id));
        if (access != Access::WriteOnly && b->has_contents) {
          ASSERT_TRUE(verify(*b));
        }
        if (access != Access::ReadOnly) {
          if (rng() % 8 == 0) stall(*h.compute, static_cast<int>(uniform(200, 1500)));
          if (access == Access::ReadWrite && b->has_contents && rng() % 2) {
            const std::size_t off = uniform(0, b->bytes - 1);
            h.write(b->id, p, off, uniform(1, b->bytes - off), h.compute);  // a partial update
          } else {
            h.write(b->id, p, 0, b->bytes, h.compute);
          }
          b->has_contents = true;
        }
      }
    } else if (r < 600) {
      what = "release";
      BlockModel* b = pick(held_block);
      if (!b) continue;
      if (b->has_contents && rng() % 3 == 0) {
        ASSERT_TRUE(verify(*b));  // still there while held
      }
      m.release(b->id, *h.compute);
      ASSERT_TRUE(resident_or_arriving(b->id)) << to_string(m.state(b->id));
      b->acquired = nullptr;
      pinned -= b->bytes;
    } else if (r < 720) {
      what = "offload";
      BlockModel* b = pick([](auto&) { return true; });
      if (b->acquired) {
        EXPECT_THROW(m.offload(b->id), InvalidArgument) << "offload of an acquired block";
        ASSERT_TRUE(resident_or_arriving(b->id));
      } else {
        const BlockState before = m.state(b->id);
        m.offload(b->id);
        const BlockState after = m.state(b->id);
        if (before == BlockState::Device) {
          ASSERT_TRUE(after == BlockState::ToHost || after == BlockState::Host) << to_string(after);
        }
        if (before == BlockState::Host || before == BlockState::Empty) {
          ASSERT_EQ(after, before);
        }
      }
    } else if (r < 820) {
      what = "prefetch";
      BlockModel* b = pick(free_block);
      if (!b) continue;
      const BlockState before = m.state(b->id);
      const std::size_t room = m.budget_bytes() - m.device_bytes();  // only grows meanwhile
      const bool on_its_way = m.prefetch(b->id);
      const BlockState after = m.state(b->id);
      if (before == BlockState::Host && room >= b->bytes) {
        ASSERT_TRUE(on_its_way) << "prefetch refused with " << room << " bytes free for "
                                << b->bytes;
      }
      if (before == BlockState::Empty) {
        ASSERT_FALSE(on_its_way) << "prefetch of a block without contents";
        ASSERT_EQ(after, BlockState::Empty);
      }
      if (before == BlockState::Device) {
        ASSERT_TRUE(on_its_way);
      }
      if (on_its_way) {
        ASSERT_TRUE(after == BlockState::ToDevice || after == BlockState::Device)
            << to_string(after);
      } else {
        ASSERT_TRUE(after == BlockState::Host || after == BlockState::ToHost ||
                    after == BlockState::Empty)
            << to_string(after);
      }
    } else if (r < 860) {
      what = "discard";
      BlockModel* b = pick(free_block);
      if (!b) continue;
      const BlockState before = m.state(b->id);
      m.discard(b->id);
      ASSERT_EQ(m.state(b->id), BlockState::Empty)
          << "discard of block " << b->id << " in state " << to_string(before) << " left it "
          << to_string(m.state(b->id));
      b->has_contents = false;
    } else if (r < 895) {
      what = "unregister";
      BlockModel* b = pick(free_block);
      if (!b) continue;
      const BlockId id = b->id;
      m.unregister(id);
      erase(id);
      EXPECT_THROW(m.state(id), InvalidArgument);
    } else if (r < 915) {
      what = "end_step";
      m.end_step();
    } else if (r < 960) {
      what = "poll";
      m.poll();
    } else if (r < 970) {
      what = "synchronize";
      m.synchronize();
      for (auto& b : blocks) {
        const BlockState s = m.state(b.id);
        ASSERT_TRUE(s != BlockState::ToHost && s != BlockState::ToDevice)
            << "block " << b.id << " still " << to_string(s) << " after synchronize()";
      }
    } else {
      what = "verify a block";
      BlockModel* b = pick([](auto& b) { return b.acquired == nullptr && b.has_contents; });
      if (!b || pinned + b->bytes > budget) continue;
      ASSERT_TRUE(h.holds(b->id));
    }
    ASSERT_NO_FATAL_FAILURE(check_all(what)) << "operation " << op << ": " << what;
    if (HasFailure()) return;
  }

  // Everything the manager knows matches the model, and every block still holds its contents.
  const std::vector<BlockId> listed = m.blocks();
  const std::set<BlockId> known(listed.begin(), listed.end());
  std::set<BlockId> modelled;
  for (auto& b : blocks) modelled.insert(b.id);
  EXPECT_EQ(known, modelled);
  for (auto& b : blocks) {
    if (b.acquired) {
      m.release(b.id, *h.compute);
      b.acquired = nullptr;
    }
  }
  pinned = 0;
  for (auto& b : blocks)
    if (b.has_contents && b.bytes <= budget) {
      EXPECT_TRUE(h.holds(b.id));
    }

  const ManagerMetrics mm = m.metrics();
  RecordProperty("acquires", acquires);
  RecordProperty("out_of_memory", ooms);
  RecordProperty("reads", reads);
  RecordProperty("evictions", static_cast<int>(mm.evictions));
  RecordProperty("clean_evictions", static_cast<int>(mm.clean_evictions));
  RecordProperty("prefetches", static_cast<int>(mm.prefetches));
  RecordProperty("prefetch_misses", static_cast<int>(mm.prefetch_misses));
  RecordProperty("host_wait_ms", std::to_string(mm.host_wait_ms));
  EXPECT_GT(mm.evictions, 0u);
  EXPECT_GT(mm.bytes_to_host, 0u);
  EXPECT_GT(mm.bytes_to_device, 0u);
  for (const TimelineEvent& e : m.timeline()) {
    EXPECT_LE(e.start_ms, e.end_ms);
    if (e.kind == TimelineKind::CopyToHost || e.kind == TimelineKind::CopyToDevice) {
      EXPECT_GT(e.bytes, 0u);
    }
  }
  EXPECT_GT(acquires, ops / 10);
  EXPECT_GT(reads, ops / 20);
  if (variant == 0 && ops >= 1000) {
    EXPECT_GT(ooms, 0) << "the budget never bound the pinned set";
  }

  for (auto& b : blocks) m.unregister(b.id);
  blocks.clear();
  expect_no_leak(h);
  for (auto& r : adopted_releases) {
    EXPECT_EQ(r->load(), 1) << "an adopted block's release";
  }
  EXPECT_EQ(adopted_null_streams->load(), 0);
}

INSTANTIATE_TEST_SUITE_P(Policies, ManagerPropertyTest,
                         ::testing::Combine(::testing::Values(PolicyKind::Lru, PolicyKind::TwoQ,
                                                              PolicyKind::Belady),
                                            ::testing::Values(0, 1, 2, 3)),
                         property_name);

// ---------------------------------------------------------------------------------------------
// Both backends: lifetime protocol, states, misuse, adoption, metrics.

class ManagerTest : public BackendTest {
 protected:
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped()) return;
    h_ = std::make_unique<Harness>(backend_, with_budget(64 * kMiB));
  }
  void TearDown() override { h_.reset(); }
  Harness& h() { return *h_; }
  OffloadManager& m() { return h_->m(); }
  std::unique_ptr<Harness> h_;
};

TEST_P(ManagerTest, ReleasedBlockLeavesOnlyAfterTheComputeWorkBeforeTheRelease) {
  // Lifetime rule 1: the D2H of a released block waits for the compute stream's work up to the
  // release. The compute stream is gated when the last write is queued; what reaches the host
  // must be that write, not the contents before it.
  const std::size_t n = 2 * kMiB + 3;
  const BlockId id = h().put(n, "x");
  void* p = m().acquire(id, *h().compute, Access::ReadWrite);
  DeadlineGate gate;
  gate.block(*h().compute);
  h().write(id, p);
  m().release(id, *h().compute);
  const auto start = Clock::now();
  m().offload(id);
  EXPECT_LT(Clock::now() - start, milliseconds(1000)) << "offload() blocked on compute work";
  std::this_thread::sleep_for(milliseconds(30));
  m().poll();
  EXPECT_EQ(m().state(id), BlockState::ToHost) << "the copy finished before the compute work";
  EXPECT_GE(m().device_bytes(), n) << "memory let go while its copy has not even started";
  gate.open();
  m().synchronize();
  EXPECT_FALSE(gate.expired()) << "the manager waited for the gated compute stream";
  EXPECT_EQ(m().state(id), BlockState::Host);
  EXPECT_EQ(m().device_bytes(), 0u);
  EXPECT_TRUE(h().holds(id));
}

TEST_P(ManagerTest, BlockArrivingWhileItsCopyIsGatedIsUsedOnlyAfterArrival) {
  // Lifetime rule 3, for a prefetched block and for a demand fetch: acquire() returns at once,
  // and the compute stream's later work sees the block's contents, not what was there before.
  const std::size_t n = 3 * kMiB + 1;
  for (bool prefetched : {true, false}) {
    SCOPED_TRACE(prefetched ? "prefetched" : "demand fetch");
    const BlockId id = h().put(n);
    m().offload(id);
    m().synchronize();
    ASSERT_EQ(m().state(id), BlockState::Host);
    DeadlineGate gate;
    gate.block(h().h2d());
    if (prefetched) {
      ASSERT_TRUE(m().prefetch(id));
      EXPECT_EQ(m().state(id), BlockState::ToDevice);
    }
    const auto start = Clock::now();
    void* p = m().acquire(id, *h().compute, Access::ReadOnly);
    EXPECT_LT(Clock::now() - start, milliseconds(1000)) << "acquire() waited for the copy";
    PinnedBlock out = h().staging->allocate(n);
    backend_->copy_async(out.data(), p, n, h().compute->handle());
    Event used(backend_);
    used.record(*h().compute);
    std::this_thread::sleep_for(milliseconds(30));
    EXPECT_FALSE(used.query()) << "compute used the block before its copy arrived";
    gate.open();
    used.synchronize();
    EXPECT_TRUE(same_bytes(out.data(), h().shadow_of(id)));
    m().release(id, *h().compute);
    EXPECT_FALSE(gate.expired());
    m().unregister(id);
  }
  expect_no_leak(h());
}

TEST_P(ManagerTest, AcquireWaitsForEvictionsInFlightInsteadOfExceedingTheBudget) {
  // Lifetime rule 2 and the budget: with room for one block, acquiring a second evicts the first,
  // whose D2H is gated; its memory is not free until the copy completes, so acquire must wait.
  const std::size_t n = kMiB;
  h_ = std::make_unique<Harness>(backend_, with_budget(n + n / 2));
  const BlockId a = h().put(n, "a");
  const BlockId b = m().register_block(n, "b");
  DeadlineGate gate(milliseconds(150));  // opens by itself: acquire is expected to wait for it
  gate.block(h().d2h());
  std::atomic<bool> done{false};
  std::atomic<std::size_t> worst{0};
  std::thread watcher([&] {
    while (!done) {
      std::size_t held = m().device_bytes();
      std::size_t w = worst;
      while (held > w && !worst.compare_exchange_weak(w, held)) {
      }
      std::this_thread::sleep_for(milliseconds(1));
    }
  });
  const auto start = Clock::now();
  void* p = m().acquire(b, *h().compute, Access::WriteOnly);
  const auto waited = Clock::now() - start;
  done = true;
  watcher.join();
  EXPECT_GE(waited, milliseconds(100)) << "acquire did not wait for the eviction's copy";
  EXPECT_TRUE(gate.expired());
  EXPECT_LE(worst.load(), n + n / 2) << "over budget while the eviction was in flight";
  EXPECT_LE(m().device_bytes(), n + n / 2);
  h().write(b, p);
  m().release(b, *h().compute);
  m().synchronize();
  const ManagerMetrics mm = m().metrics();
  EXPECT_GT(mm.host_wait_ms, 0.0);
  EXPECT_LE(mm.peak_device_bytes, n + n / 2);
  bool host_wait_event = false;
  for (const auto& e : m().timeline()) host_wait_event |= e.kind == TimelineKind::HostWait;
  EXPECT_TRUE(host_wait_event);
  EXPECT_TRUE(h().holds(a));
  EXPECT_TRUE(h().holds(b));
}

TEST_P(ManagerTest, StatesAndWhatEachTransitionCopies) {
  const std::size_t n = kMiB + 123;
  const BlockId id = m().register_block(n, "weights.0");
  EXPECT_EQ(m().state(id), BlockState::Empty);
  EXPECT_EQ(m().bytes(id), n);
  EXPECT_EQ(m().name(id), "weights.0");
  EXPECT_EQ(m().blocks(), std::vector<BlockId>{id});
  EXPECT_EQ(m().device_bytes(), 0u) << "memory taken before the first acquire";
  EXPECT_EQ(h().allocator->allocations(), 0u);

  void* p = m().acquire(id, *h().compute, Access::ReadWrite);
  EXPECT_EQ(m().state(id), BlockState::Device);
  EXPECT_EQ(m().device_bytes(), n);
  h().write(id, p);
  m().release(id, *h().compute);
  EXPECT_EQ(m().state(id), BlockState::Device);
  m().synchronize();
  ManagerMetrics m0 = m().metrics();
  EXPECT_EQ(m0.bytes_to_device, 0u) << "an Empty block was fetched";

  {  // Device -> ToHost -> Host
    DeadlineGate gate;
    gate.block(h().d2h());
    m().offload(id);
    EXPECT_EQ(m().state(id), BlockState::ToHost);
    EXPECT_EQ(m().device_bytes(), n);
    gate.open();
    m().synchronize();
    EXPECT_FALSE(gate.expired());
  }
  EXPECT_EQ(m().state(id), BlockState::Host);
  EXPECT_EQ(m().device_bytes(), 0u);
  ManagerMetrics m1 = m().metrics();
  EXPECT_EQ(m1.bytes_to_host, m0.bytes_to_host + n);
  EXPECT_EQ(m1.evictions, m0.evictions + 1);
  EXPECT_EQ(m1.clean_evictions, m0.clean_evictions);

  {  // Host -> ToDevice -> Device
    DeadlineGate gate;
    gate.block(h().h2d());
    EXPECT_TRUE(m().prefetch(id));
    EXPECT_EQ(m().state(id), BlockState::ToDevice);
    EXPECT_EQ(m().device_bytes(), n);
    EXPECT_TRUE(m().prefetch(id)) << "a block on its way is reported on its way";
    gate.open();
    m().synchronize();
    EXPECT_FALSE(gate.expired());
  }
  EXPECT_EQ(m().state(id), BlockState::Device);
  ManagerMetrics m2 = m().metrics();
  EXPECT_EQ(m2.bytes_to_device, m1.bytes_to_device + n);
  EXPECT_EQ(m2.prefetches, m1.prefetches + 1);
  EXPECT_TRUE(h().holds(id));  // ReadOnly: the host copy stays valid
  ManagerMetrics m3 = m().metrics();
  EXPECT_EQ(m3.prefetch_hits, m2.prefetch_hits + 1) << "arrived before the acquire: a hit";
  EXPECT_EQ(m3.prefetch_misses, m2.prefetch_misses);

  // Clean eviction: nothing is copied back.
  m().offload(id);
  m().synchronize();
  EXPECT_EQ(m().state(id), BlockState::Host);
  ManagerMetrics m4 = m().metrics();
  EXPECT_EQ(m4.bytes_to_host, m3.bytes_to_host) << "a clean block was copied again";
  EXPECT_EQ(m4.clean_evictions, m3.clean_evictions + 1);
  EXPECT_EQ(m4.evictions, m3.evictions + 1);

  // Demand fetch: a miss.
  EXPECT_TRUE(h().holds(id));
  m().synchronize();
  ManagerMetrics m5 = m().metrics();
  EXPECT_EQ(m5.bytes_to_device, m4.bytes_to_device + n);
  EXPECT_EQ(m5.prefetch_misses, m4.prefetch_misses + 1);

  // ReadWrite makes the host copy stale: the next eviction copies.
  p = m().acquire(id, *h().compute, Access::ReadWrite);
  h().write(id, p, n / 3, n / 3, h().compute);
  m().release(id, *h().compute);
  m().offload(id);
  m().synchronize();
  ManagerMetrics m6 = m().metrics();
  EXPECT_EQ(m6.bytes_to_host, m5.bytes_to_host + n);
  EXPECT_EQ(m6.clean_evictions, m5.clean_evictions);
  EXPECT_TRUE(h().holds(id));
  m().offload(id);
  m().synchronize();

  // WriteOnly fetches nothing.
  ManagerMetrics m7 = m().metrics();
  p = m().acquire(id, *h().compute, Access::WriteOnly);
  h().write(id, p);
  m().release(id, *h().compute);
  m().synchronize();
  EXPECT_EQ(m().metrics().bytes_to_device, m7.bytes_to_device) << "WriteOnly fetched the block";
  EXPECT_TRUE(h().holds(id));

  // Discard: no contents anywhere, nothing to prefetch, nothing fetched on the next acquire.
  m().discard(id);
  EXPECT_EQ(m().state(id), BlockState::Empty);
  m().synchronize();
  EXPECT_EQ(m().device_bytes(), 0u);
  EXPECT_FALSE(m().prefetch(id));
  EXPECT_EQ(m().state(id), BlockState::Empty);
  ManagerMetrics m8 = m().metrics();
  p = m().acquire(id, *h().compute, Access::ReadWrite);
  EXPECT_EQ(m().state(id), BlockState::Device);
  m().release(id, *h().compute);
  m().synchronize();
  EXPECT_EQ(m().metrics().bytes_to_device, m8.bytes_to_device);

  m().unregister(id);
  EXPECT_TRUE(m().blocks().empty());
  EXPECT_THROW(m().state(id), InvalidArgument);
  expect_no_leak(h());
}

TEST_P(ManagerTest, MemoryStaysCountedUntilComputeIsDoneWithIt) {
  // Memory that leaves the device (dirty or clean eviction, discard, unregister) is freed
  // stream-ordered after compute's last use; until that use has run it still counts against the
  // budget, and its contents are what that use left.
  const std::size_t n = 512 * kKiB + 1;
  for (const char* leave : {"dirty offload", "clean offload", "discard", "unregister"}) {
    SCOPED_TRACE(leave);
    const std::string how = leave;
    const BlockId id = h().put(n);
    if (how == "clean offload") {  // a valid host copy: the eviction needs no D2H
      m().offload(id);
      m().synchronize();
      EXPECT_TRUE(h().holds(id));
    }
    DeadlineGate gate;
    gate.block(*h().compute);
    void* p = m().acquire(id, *h().compute,
                          how == "clean offload" ? Access::ReadOnly : Access::ReadWrite);
    PinnedBlock seen = h().staging->allocate(n);
    backend_->copy_async(seen.data(), p, n, h().compute->handle());  // compute's (gated) use
    if (how == "dirty offload") h().write(id, p);
    m().release(id, *h().compute);
    if (how == "unregister") {
      m().unregister(id);
    } else if (how == "discard") {
      m().discard(id);
    } else {
      m().offload(id);
    }
    std::this_thread::sleep_for(milliseconds(20));
    m().poll();
    EXPECT_GE(m().device_bytes(), n) << "memory compute still uses is no longer counted";
    gate.open();
    m().synchronize();
    EXPECT_FALSE(gate.expired());
    EXPECT_EQ(m().device_bytes(), 0u);
    h().compute->synchronize();
    if (how != "dirty offload") {
      EXPECT_TRUE(same_bytes(seen.data(), h().shadow_of(id))) << "compute's use saw other contents";
    }
    if (how == "dirty offload" || how == "clean offload") {
      EXPECT_TRUE(h().holds(id));
    }
    if (how != "unregister") m().unregister(id);
  }
  expect_no_leak(h());
}

TEST_P(ManagerTest, OffloadRightAfterUseIsNotSkippedWhileTheFetchIsInFlight) {
  // On a GPU the host runs ahead: a block is fetched (or prefetched), used and released, and
  // offloaded before its H2D has even run. If state() reports it Device, offload() must move it
  // out (the D2H ordered after the H2D and the use), not silently do nothing.
  const std::size_t n = kMiB + 17;
  const BlockId id = h().put(n);
  for (bool prefetched : {false, true}) {
    SCOPED_TRACE(prefetched ? "prefetched" : "demand fetch");
    m().offload(id);
    m().synchronize();
    ASSERT_EQ(m().state(id), BlockState::Host);
    {
      DeadlineGate gate;
      gate.block(h().h2d());
      if (prefetched) {
        ASSERT_TRUE(m().prefetch(id));
      }
      void* p = m().acquire(id, *h().compute, Access::ReadWrite);
      h().write(id, p, n / 2, n / 4, h().compute);  // a partial update on top of the fetch
      m().release(id, *h().compute);
      const BlockState before = m().state(id);
      m().offload(id);
      const BlockState after = m().state(id);
      if (before == BlockState::Device) {
        EXPECT_TRUE(after == BlockState::ToHost || after == BlockState::Host)
            << "state() said Device, but offload() left the block " << to_string(after);
      }
      gate.open();
      m().synchronize();
      EXPECT_FALSE(gate.expired());
    }
    EXPECT_TRUE(h().holds(id));
  }
}

TEST_P(ManagerTest, OffloadAndPrefetchOfOtherStatesAreNoOps) {
  const BlockId empty = m().register_block(4096);
  m().offload(empty);
  EXPECT_EQ(m().state(empty), BlockState::Empty);
  EXPECT_FALSE(m().prefetch(empty));
  const BlockId resident = h().put(8192);
  EXPECT_TRUE(m().prefetch(resident));  // already resident
  EXPECT_EQ(m().state(resident), BlockState::Device);
  m().offload(resident);
  m().synchronize();
  m().offload(resident);  // already on the host
  EXPECT_EQ(m().state(resident), BlockState::Host);
  EXPECT_TRUE(h().holds(resident));
  m().check_invariants();
}

TEST_P(ManagerTest, MisuseIsRejectedNamingTheBlock) {
  const BlockId id = h().put(64 * kKiB);
  void* p = m().acquire(id, *h().compute, Access::ReadWrite);
  EXPECT_THROW(m().offload(id), InvalidArgument) << "offload of an acquired block";
  EXPECT_THROW(m().discard(id), InvalidArgument) << "discard of an acquired block";
  EXPECT_THROW(m().unregister(id), InvalidArgument) << "unregister of an acquired block";
  EXPECT_EQ(m().state(id), BlockState::Device);
  EXPECT_TRUE(h().matches(id, p)) << "misuse damaged the block";
  m().release(id, *h().compute);
  EXPECT_THROW(m().release(id, *h().compute), InvalidArgument) << "release of a released block";

  for (BlockId unknown : {BlockId{987654321}, kInvalidBlock}) {
    try {
      m().acquire(unknown, *h().compute);
      ADD_FAILURE() << "acquire of unknown block " << unknown;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(std::to_string(unknown)), std::string::npos) << e.what();
    }
    try {
      m().release(unknown, *h().compute);
      ADD_FAILURE() << "release of unknown block " << unknown;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(std::to_string(unknown)), std::string::npos) << e.what();
    }
    EXPECT_THROW(m().state(unknown), InvalidArgument);
    EXPECT_THROW(m().offload(unknown), InvalidArgument);
    EXPECT_THROW(m().prefetch(unknown), InvalidArgument);
    EXPECT_THROW(m().unregister(unknown), InvalidArgument);
  }
  EXPECT_THROW(m().register_block(0), InvalidArgument);
  m().check_invariants();
  EXPECT_TRUE(h().holds(id));
  m().unregister(id);
  expect_no_leak(h());
}

TEST_P(ManagerTest, AdoptedMemoryIsManagedAndGivenBackOnce) {
  const std::size_t n = kMiB + 5;
  // The producer is a stream of its own, gated while it writes the contents: the block's first
  // D2H must wait for it (rule 1), and the memory must not be given back before that copy.
  auto producer = std::make_shared<Stream>(backend_);
  void* dev = backend_->allocate_device(n, producer->handle());
  struct Released {
    std::atomic<int> calls{0};
    std::atomic<bool> null_stream{false};
  };
  auto released = std::make_shared<Released>();
  auto backend = backend_;
  auto release = [released, backend, dev](StreamHandle s) {
    ++released->calls;
    if (!s) released->null_stream = true;
    backend->free_device(dev, s);
  };
  DeadlineGate gate;
  gate.block(*producer);
  std::vector<std::uint8_t> contents(n);
  PinnedBlock st = h().staging->allocate(n);
  fill_random(st.data(), n, 99);
  std::memcpy(contents.data(), st.data(), n);
  backend_->copy_async(dev, st.data(), n, producer->handle());
  st.record_use(producer);
  st.reset();

  const BlockId id = m().adopt(dev, n, release, *producer, "kv.0");
  h().shadow_of(id) = contents;
  EXPECT_EQ(m().state(id), BlockState::Device);
  EXPECT_EQ(m().bytes(id), n);
  EXPECT_EQ(m().name(id), "kv.0");
  EXPECT_EQ(m().device_bytes(), n);
  const auto start = Clock::now();
  m().offload(id);
  EXPECT_LT(Clock::now() - start, milliseconds(1000)) << "offload() blocked on the producer";
  std::this_thread::sleep_for(milliseconds(30));
  m().poll();
  EXPECT_EQ(m().state(id), BlockState::ToHost);
  EXPECT_GE(m().device_bytes(), n);
  if (backend_->kind() == BackendKind::Host) {
    EXPECT_EQ(backend_->memory_kind(dev), MemoryKind::Device)
        << "adopted memory freed before its copy ran";
  }
  gate.open();
  m().synchronize();
  EXPECT_FALSE(gate.expired());
  EXPECT_EQ(m().state(id), BlockState::Host);
  EXPECT_EQ(released->calls.load(), 1);
  EXPECT_FALSE(released->null_stream.load());
  EXPECT_EQ(m().device_bytes(), 0u);
  EXPECT_TRUE(h().holds(id));  // back through the manager's allocator
  m().unregister(id);
  EXPECT_EQ(released->calls.load(), 1) << "adopted memory given back twice";
  producer->synchronize();
  expect_no_leak(h());
}

TEST_P(ManagerTest, AdoptedBlockUnregisteredWhileResidentIsGivenBack) {
  const std::size_t n = 256 * kKiB;
  void* dev = backend_->allocate_device(n, h().compute->handle());
  backend_->memset_async(dev, 7, n, h().compute->handle());
  auto calls = std::make_shared<std::atomic<int>>(0);
  auto backend = backend_;
  const BlockId id = m().adopt(
      dev, n,
      [calls, backend, dev](StreamHandle s) {
        ++*calls;
        backend->free_device(dev, s);
      },
      *h().compute);
  m().unregister(id);
  m().synchronize();
  EXPECT_EQ(calls->load(), 1);
  expect_no_leak(h());
}

TEST_P(ManagerTest, StallsAndPrefetchOutcomesAreMeasured) {
  const std::size_t n = 2 * kMiB;
  const BlockId id = h().put(n, "late");
  m().offload(id);
  m().synchronize();
  m().reset_metrics();
  EXPECT_EQ(m().metrics().bytes_to_host, 0u);
  {
    DeadlineGate gate;
    gate.block(h().h2d());
    ASSERT_TRUE(m().prefetch(id));
    void* p = m().acquire(id, *h().compute, Access::ReadOnly);
    std::this_thread::sleep_for(milliseconds(40));
    gate.open();
    EXPECT_TRUE(h().matches(id, p));
    m().release(id, *h().compute);
  }
  m().synchronize();
  ManagerMetrics mm = m().metrics();
  EXPECT_EQ(mm.prefetch_late, 1u);
  EXPECT_EQ(mm.prefetch_hits, 0u);
  EXPECT_GE(mm.compute_stall_ms, 10.0) << "compute waited about 40 ms for the copy";
  EXPECT_LT(mm.overlap_ratio, 1.0);
  bool stall_event = false;
  for (const auto& e : m().timeline())
    if (e.kind == TimelineKind::ComputeStall && e.block == id) {
      stall_event = true;
      EXPECT_GE(e.end_ms - e.start_ms, 10.0);
    }
  EXPECT_TRUE(stall_event);
}

TEST_P(ManagerTest, TimelineRecordsEveryCopyUpToItsCapacity) {
  const std::size_t n = 512 * kKiB + 9;
  for (std::size_t capacity : {std::size_t{1} << 16, std::size_t{3}}) {
    SCOPED_TRACE("capacity=" + std::to_string(capacity));
    OffloadManagerOptions o = with_budget(64 * kMiB);
    o.timeline_capacity = capacity;
    h_ = std::make_unique<Harness>(backend_, o);
    const BlockId id = h().put(n, "t");
    const int trips = 4;
    for (int i = 0; i < trips; ++i) {
      m().synchronize();  // the last H2D has landed: the block is Device, so offload copies
      m().offload(id);
      m().synchronize();
      void* p = m().acquire(id, *h().compute, Access::ReadWrite);
      h().write(id, p);
      m().release(id, *h().compute);
    }
    m().synchronize();
    const ManagerMetrics mm = m().metrics();
    EXPECT_EQ(mm.bytes_to_host, trips * n);
    EXPECT_EQ(mm.bytes_to_device, trips * n);
    EXPECT_GT(mm.to_host_busy_ms, 0.0);
    EXPECT_GT(mm.to_device_busy_ms, 0.0);
    const auto events = m().timeline();
    std::size_t to_host = 0, to_device = 0;
    for (const auto& e : events) {
      EXPECT_LE(e.start_ms, e.end_ms);
      if (e.kind == TimelineKind::CopyToHost || e.kind == TimelineKind::CopyToDevice) {
        EXPECT_GE(e.start_ms, 0.0);
        EXPECT_EQ(e.block, id);
        EXPECT_EQ(e.bytes, n);
      }
      to_host += e.kind == TimelineKind::CopyToHost;
      to_device += e.kind == TimelineKind::CopyToDevice;
    }
    if (capacity > 100) {
      EXPECT_EQ(to_host, std::size_t{trips});
      EXPECT_EQ(to_device, std::size_t{trips});
      EXPECT_EQ(mm.timeline_dropped, 0u);
    } else {
      EXPECT_LE(events.size(), capacity);
      EXPECT_GE(mm.timeline_dropped + events.size(), std::size_t{2 * trips});
      EXPECT_GT(mm.timeline_dropped, 0u);
    }
    // take_timeline: the same events, then none until the next copy; the metrics stay
    EXPECT_EQ(m().take_timeline().size(), events.size());
    EXPECT_TRUE(m().timeline().empty());
    EXPECT_TRUE(m().take_timeline().empty());
    EXPECT_EQ(m().metrics().bytes_to_host, trips * n);
    EXPECT_TRUE(h().holds(id));
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, ManagerTest,
                         ::testing::Values(BackendKind::Host, BackendKind::Cuda),
                         backend_param_name);

// ---------------------------------------------------------------------------------------------
// Budgets (host backend: its simulated device size makes budget fractions exact).

std::shared_ptr<Backend> host_of(std::size_t simulated) {
  HostBackendOptions o;
  o.simulated_device_bytes = simulated;
  return make_host_backend(o);
}

TEST(ManagerBudget, FractionIsOfTheBackendsTotal) {
  auto backend = host_of(std::size_t{1} << 30);
  // Memory held by others: the fraction is of the total, not of what is free.
  Stream s(backend);
  DeviceBuffer other(*backend, s, 100 * kMiB);
  const std::size_t total = backend->device_memory_info().total_bytes;
  OffloadManagerOptions o;
  o.budget_fraction = 0.25;
  Harness h(backend, o);
  EXPECT_EQ(h.m().budget_bytes(), static_cast<std::size_t>(static_cast<double>(total) * 0.25));
  EXPECT_EQ(h.m().metrics().budget_bytes, h.m().budget_bytes());

  Harness d(host_of(10 * kMiB), OffloadManagerOptions{});  // the default fraction, 0.8
  const double expected = 0.8 * 10 * kMiB;
  EXPECT_NEAR(static_cast<double>(d.m().budget_bytes()), expected, 1.0);

  Harness absolute(backend, with_budget(12345678));
  EXPECT_EQ(absolute.m().budget_bytes(), 12345678u);
}

TEST(ManagerBudget, PinningMoreThanTheBudgetThrowsNamingIt) {
  const std::size_t budget = kMiB;
  Harness h(host_of(std::size_t{1} << 30), with_budget(budget));
  OffloadManager& m = h.m();
  const BlockId a = h.put(600 * kKiB, "a");
  const BlockId b = h.put(300 * kKiB, "b");
  const BlockId c = m.register_block(600 * kKiB, "c");
  void* pa = m.acquire(a, *h.compute, Access::ReadOnly);
  try {
    m.acquire(c, *h.compute, Access::WriteOnly);
    FAIL() << "1200 KiB pinned under a budget of 1 MiB";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(budget)), std::string::npos) << e.what();
  }
  EXPECT_EQ(m.state(c), BlockState::Empty);
  m.check_invariants();
  EXPECT_LE(m.device_bytes(), budget);
  // What fits still works, and the failed call changed nothing.
  void* pb = m.acquire(b, *h.compute, Access::ReadOnly);
  EXPECT_TRUE(h.matches(a, pa));
  EXPECT_TRUE(h.matches(b, pb));
  m.release(a, *h.compute);
  m.release(b, *h.compute);
  void* pc = m.acquire(c, *h.compute, Access::WriteOnly);
  h.write(c, pc);
  m.release(c, *h.compute);
  EXPECT_LE(m.device_bytes(), budget);
  for (BlockId id : {a, b, c}) {
    EXPECT_TRUE(h.holds(id));
  }
  EXPECT_LE(m.metrics().peak_device_bytes, budget);
}

TEST(ManagerBudget, BlockLargerThanTheBudgetThrowsAtAcquire) {
  const std::size_t budget = kMiB;
  Harness h(host_of(std::size_t{1} << 30), with_budget(budget));
  OffloadManager& m = h.m();
  const BlockId big = m.register_block(budget + 1, "too big");
  try {
    m.acquire(big, *h.compute, Access::WriteOnly);
    FAIL() << "a block one byte over the budget was acquired";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(budget)), std::string::npos) << e.what();
  }
  EXPECT_EQ(m.device_bytes(), 0u);
  // Exactly the budget fits.
  const BlockId exact = h.put(budget, "exact");
  EXPECT_EQ(m.device_bytes(), budget);
  EXPECT_TRUE(h.holds(exact));

  // Adoption over the budget is refused too; the caller keeps its memory then.
  void* dev = h.backend->allocate_device(2 * budget, h.compute->handle());
  auto released = std::make_shared<bool>(false);
  EXPECT_THROW(m.adopt(
                   dev, 2 * budget, [released](StreamHandle) { *released = true; }, *h.compute),
               OutOfMemory);
  EXPECT_FALSE(*released) << "the caller keeps memory whose adoption failed";
  h.backend->free_device(dev, h.compute->handle());
  m.unregister(big);
  m.unregister(exact);
  expect_no_leak(h);
}

TEST(ManagerBudget, LoweredBudgetIsMetByLaterAcquires) {
  const std::size_t n = kMiB;
  Harness h(host_of(std::size_t{1} << 30), with_budget(4 * n));
  OffloadManager& m = h.m();
  std::vector<BlockId> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(h.put(n));
  EXPECT_EQ(m.device_bytes(), 4 * n);
  m.set_budget_bytes(2 * n);
  EXPECT_EQ(m.budget_bytes(), 2 * n);
  EXPECT_EQ(m.metrics().budget_bytes, 2 * n);
  ids.push_back(h.put(n));  // needs room: evicts down to the new budget
  EXPECT_LE(m.device_bytes(), 2 * n);
  for (BlockId id : ids) {
    EXPECT_TRUE(h.holds(id));
    EXPECT_LE(m.device_bytes(), 2 * n);
  }
  m.synchronize();
  EXPECT_LE(m.device_bytes(), 2 * n);

  // Raised: everything fits again and nothing more is evicted.
  m.set_budget_bytes(8 * n);
  for (BlockId id : ids) {
    EXPECT_TRUE(h.holds(id));
  }
  const std::uint64_t evictions = m.metrics().evictions;
  for (BlockId id : ids) {
    EXPECT_TRUE(h.holds(id));
  }
  EXPECT_EQ(m.metrics().evictions, evictions);
  EXPECT_EQ(m.device_bytes(), 5 * n);
  for (BlockId id : ids) m.unregister(id);
  expect_no_leak(h);
}

// ---------------------------------------------------------------------------------------------
// Policies through the manager: a cyclic access pattern one block larger than the budget. LRU
// evicts exactly the block needed next; Belady, from the second step on, does far better.

std::uint64_t fetched_bytes_over_steps(PolicyKind policy) {
  const std::size_t n = 256 * kKiB;
  const int blocks = 6;
  Harness h(host_of(std::size_t{1} << 30), with_budget((blocks - 1) * n, policy));
  OffloadManager& m = h.m();
  EXPECT_EQ(m.policy_name(), make_policy(policy)->name());
  std::vector<BlockId> ids;
  for (int i = 0; i < blocks; ++i) ids.push_back(h.put(n));
  m.end_step();
  std::uint64_t fetched = 0;
  for (int step = 0; step < 3; ++step) {
    m.synchronize();
    const std::uint64_t before = m.metrics().bytes_to_device;
    for (BlockId id : ids) {
      EXPECT_TRUE(h.holds(id));
    }
    m.synchronize();
    if (step > 0) fetched += m.metrics().bytes_to_device - before;
    m.end_step();
  }
  return fetched;
}

TEST(ManagerPolicies, BeladyFetchesLessThanLruOnARepeatedCycle) {
  const std::uint64_t lru = fetched_bytes_over_steps(PolicyKind::Lru);
  const std::uint64_t belady = fetched_bytes_over_steps(PolicyKind::Belady);
  EXPECT_GT(lru, 0u);
  EXPECT_LT(belady, lru);
}

TEST(ManagerPolicies, CustomPolicyObjectIsUsed) {
  // A policy that records what it is told: the manager reports registrations, accesses,
  // evictions and step ends, and only offers resident, unpinned candidates.
  struct Recorder : EvictionPolicy {
    std::shared_ptr<std::vector<std::string>> log = std::make_shared<std::vector<std::string>>();
    std::shared_ptr<std::set<BlockId>> pinned_ids = std::make_shared<std::set<BlockId>>();
    std::string name() const override { return "recorder"; }
    void on_register(BlockId id, std::size_t) override { log->push_back("register " + s(id)); }
    void on_unregister(BlockId id) override { log->push_back("unregister " + s(id)); }
    void on_access(BlockId id) override { log->push_back("access " + s(id)); }
    void on_evict(BlockId id) override { log->push_back("evict " + s(id)); }
    void on_step_end() override { log->push_back("step"); }
    BlockId choose_victim(std::span<const BlockId> candidates) override {
      for (BlockId c : candidates) {
        EXPECT_EQ(pinned_ids->count(c), 0u) << "pinned candidate";
      }
      return candidates.back();
    }
    static std::string s(BlockId id) { return std::to_string(id); }
  };
  auto policy = std::make_unique<Recorder>();
  auto log = policy->log;
  auto pinned_ids = policy->pinned_ids;
  const std::size_t n = 128 * kKiB;
  Harness h(host_of(std::size_t{1} << 30), with_budget(2 * n), std::move(policy));
  OffloadManager& m = h.m();
  EXPECT_EQ(m.policy_name(), "recorder");
  const BlockId a = h.put(n), b = h.put(n);
  void* pa = m.acquire(a, *h.compute, Access::ReadOnly);
  pinned_ids->insert(a);
  const BlockId c = h.put(n);  // needs room: b is the only candidate
  EXPECT_EQ(m.state(a), BlockState::Device);
  EXPECT_NE(m.state(b), BlockState::Device);
  EXPECT_TRUE(h.matches(a, pa));
  m.release(a, *h.compute);
  pinned_ids->clear();
  m.end_step();
  m.unregister(c);
  auto has = [&](const std::string& entry) {
    return std::find(log->begin(), log->end(), entry) != log->end();
  };
  for (BlockId id : {a, b, c}) {
    EXPECT_TRUE(has("register " + std::to_string(id)));
    EXPECT_TRUE(has("access " + std::to_string(id)));
  }
  EXPECT_TRUE(has("evict " + std::to_string(b)));
  EXPECT_FALSE(has("evict " + std::to_string(a)));
  EXPECT_TRUE(has("step"));
  EXPECT_TRUE(has("unregister " + std::to_string(c)));
  EXPECT_TRUE(h.holds(b));
}

// ---------------------------------------------------------------------------------------------
// Rule 5: no backend call while the manager's mutex is held. A backend that forwards to the host
// backend and, on every call, asks the manager from another thread for its block list (which
// needs the mutex): if that does not answer promptly, the call was made under the mutex.

class ProbingBackend final : public Backend {
 public:
  explicit ProbingBackend(std::shared_ptr<Backend> inner) : inner_(std::move(inner)) {}
  ~ProbingBackend() override { join(); }

  void watch(OffloadManager* manager) { target_ = manager; }
  void join() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& t : stuck_) t.join();
    stuck_.clear();
  }
  std::vector<std::string> violations() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return violations_;
  }
  std::uint64_t probes() const { return probes_; }

  BackendKind kind() const noexcept override { return inner_->kind(); }
  std::string name() const override { return inner_->name(); }
  int device_index() const noexcept override { return inner_->device_index(); }
  StreamHandle create_stream(StreamPriority p) override {
    probe("create_stream");
    return inner_->create_stream(p);
  }
  void destroy_stream(StreamHandle s) noexcept override {
    probe("destroy_stream");
    inner_->destroy_stream(s);
  }
  void synchronize_stream(StreamHandle s) override {
    probe("synchronize_stream");
    inner_->synchronize_stream(s);
  }
  void stream_wait_event(StreamHandle s, EventHandle e) override {
    probe("stream_wait_event");
    inner_->stream_wait_event(s, e);
  }
  void launch_host_func(StreamHandle s, std::function<void()> fn) override {
    probe("launch_host_func");
    inner_->launch_host_func(s, std::move(fn));
  }
  EventHandle create_event(bool timing) override {
    probe("create_event");
    return inner_->create_event(timing);
  }
  void destroy_event(EventHandle e) noexcept override {
    probe("destroy_event");
    inner_->destroy_event(e);
  }
  void record_event(EventHandle e, StreamHandle s) override {
    probe("record_event");
    inner_->record_event(e, s);
  }
  bool query_event(EventHandle e) override {
    probe("query_event");
    return inner_->query_event(e);
  }
  void synchronize_event(EventHandle e) override {
    probe("synchronize_event");
    inner_->synchronize_event(e);
  }
  float elapsed_ms(EventHandle a, EventHandle b) override {
    probe("elapsed_ms");
    return inner_->elapsed_ms(a, b);
  }
  void* allocate_pinned_host(std::size_t bytes) override {
    probe("allocate_pinned_host");
    return inner_->allocate_pinned_host(bytes);
  }
  void free_pinned_host(void* p) noexcept override {
    probe("free_pinned_host");
    inner_->free_pinned_host(p);
  }
  void* allocate_device(std::size_t bytes, StreamHandle s) override {
    probe("allocate_device");
    return inner_->allocate_device(bytes, s);
  }
  void free_device(void* p, StreamHandle s) noexcept override {
    probe("free_device");
    inner_->free_device(p, s);
  }
  DeviceMemoryInfo device_memory_info() override {
    probe("device_memory_info");
    return inner_->device_memory_info();
  }
  MemoryKind memory_kind(const void* p) override {
    probe("memory_kind");
    return inner_->memory_kind(p);
  }
  std::size_t vmm_granularity() override { return inner_->vmm_granularity(); }
  void* reserve_address(std::size_t bytes) override {
    probe("reserve_address");
    return inner_->reserve_address(bytes);
  }
  void release_address(void* p, std::size_t bytes) noexcept override {
    probe("release_address");
    inner_->release_address(p, bytes);
  }
  void map_memory(void* p, std::size_t bytes) override {
    probe("map_memory");
    inner_->map_memory(p, bytes);
  }
  void unmap_memory(void* p, std::size_t bytes) noexcept override {
    probe("unmap_memory");
    inner_->unmap_memory(p, bytes);
  }
  void copy_async(void* dst, const void* src, std::size_t bytes, StreamHandle s) override {
    probe("copy_async");
    inner_->copy_async(dst, src, bytes, s);
  }
  void copy_segments_async(const CopySegment* seg, std::size_t count, StreamHandle s) override {
    probe("copy_segments_async");
    inner_->copy_segments_async(seg, count, s);
  }
  void memset_async(void* dst, int value, std::size_t bytes, StreamHandle s) override {
    probe("memset_async");
    inner_->memset_async(dst, value, bytes, s);
  }
  void dequantize_fp8_rows_async(const Fp8Rows& rows, void* out, HalfType type,
                                 StreamHandle s) override {
    probe("dequantize_fp8_rows_async");
    inner_->dequantize_fp8_rows_async(rows, out, type, s);
  }
  void gather_rows_async(const RowGather& gather, StreamHandle s) override {
    probe("gather_rows_async");
    inner_->gather_rows_async(gather, s);
  }
  void attend_fp8_decode_async(const Fp8DecodeAttention& attention, StreamHandle s) override {
    probe("attend_fp8_decode_async");
    inner_->attend_fp8_decode_async(attention, s);
  }
  std::size_t fp8_decode_workspace_bytes(const Fp8DecodeAttention& attention) const override {
    return inner_->fp8_decode_workspace_bytes(attention);
  }
  void rms_norm_async(const RmsNorm& norm, StreamHandle s) override {
    probe("rms_norm_async");
    inner_->rms_norm_async(norm, s);
  }
  void rotary_async(const Rotary& rotary, StreamHandle s) override {
    probe("rotary_async");
    inner_->rotary_async(rotary, s);
  }
  void silu_mul_async(const SiluMul& op, StreamHandle s) override {
    probe("silu_mul_async");
    inner_->silu_mul_async(op, s);
  }

 private:
  void probe(const char* call) noexcept {
    OffloadManager* manager = target_;
    if (!manager) return;
    ++probes_;
    try {
      auto answered = std::make_shared<std::promise<void>>();
      auto future = answered->get_future();
      std::thread asker([manager, answered] {
        (void)manager->blocks();
        answered->set_value();
      });
      if (future.wait_for(milliseconds(2000)) == std::future_status::ready) {
        asker.join();
        return;
      }
      std::lock_guard<std::mutex> lock(mutex_);
      violations_.push_back(call);
      stuck_.push_back(std::move(asker));  // joined once the mutex is free again
    } catch (...) {
    }
  }

  std::shared_ptr<Backend> inner_;
  std::atomic<OffloadManager*> target_{nullptr};
  std::atomic<std::uint64_t> probes_{0};
  mutable std::mutex mutex_;
  std::vector<std::string> violations_;  // guarded by mutex_
  std::vector<std::thread> stuck_;       // guarded by mutex_
};

TEST(ManagerLocking, NoBackendCallWhileTheManagersMutexIsHeld) {
  auto probing = std::make_shared<ProbingBackend>(host_of(std::size_t{1} << 30));
  const std::size_t n = 256 * kKiB;
  {
    Harness h(probing, with_budget(3 * n, PolicyKind::Belady));
    OffloadManager& m = h.m();
    probing->watch(&m);
    struct Unwatch {
      ProbingBackend& backend;
      ~Unwatch() {
        backend.watch(nullptr);
        backend.join();
      }
    } unwatch{*probing};
    std::vector<BlockId> ids;
    for (int i = 0; i < 5; ++i) ids.push_back(h.put(n + i));
    for (int round = 0; round < 2; ++round) {
      for (BlockId id : ids) {
        void* p = m.acquire(id, *h.compute, round ? Access::ReadWrite : Access::ReadOnly);
        EXPECT_TRUE(h.matches(id, p));
        if (round) h.write(id, p);
        m.release(id, *h.compute);
      }
      m.offload(ids[0]);
      m.prefetch(ids[0]);
      m.poll();
      m.end_step();
      (void)m.metrics();
      (void)m.timeline();
    }
    m.discard(ids[1]);
    for (BlockId id : ids) m.unregister(id);
    m.synchronize();
    probing->watch(nullptr);
    probing->join();
    EXPECT_GT(probing->probes(), 0u);
    const auto violations = probing->violations();
    std::string calls;
    for (const auto& v : violations) calls += v + " ";
    EXPECT_TRUE(violations.empty()) << "backend calls made under the manager's mutex: " << calls;
  }
}

// ---------------------------------------------------------------------------------------------
// Many threads, each with its own compute stream and blocks, against one manager (also the
// ThreadSanitizer case).

class ManagerConcurrencyTest : public ::testing::TestWithParam<PolicyKind> {};

TEST_P(ManagerConcurrencyTest, ThreadsWithTheirOwnStreamsShareOneManager) {
  const int threads = 4;
  const std::size_t largest = 256 * kKiB;
  const std::size_t budget = threads * largest + largest / 2;
  Harness h(host_of(std::size_t{1} << 30), with_budget(budget, GetParam()));
  OffloadManager& m = h.m();
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0};

  auto worker = [&](int t) {
    std::mt19937_64 rng(1000 + t);
    auto stream = std::make_shared<Stream>(h.backend);
    std::vector<BlockId> ids;
    std::vector<bool> has_contents;
    for (int i = 0; i < 5; ++i) {
      ids.push_back(
          m.register_block(32 * kKiB + rng() % (largest - 32 * kKiB), detail::concat("t", t)));
      has_contents.push_back(false);
    }
    auto fail = [&](const std::string& what) {
      ++failures;
      ADD_FAILURE() << "thread " << t << ": " << what;
    };
    for (int op = 0; op < scaled(300) && failures == 0; ++op) {
      const std::size_t i = rng() % ids.size();
      const BlockId id = ids[i];
      try {
        switch (rng() % 8) {
          case 0: m.offload(id); break;
          case 1: m.prefetch(id); break;
          case 2:
            if (rng() % 4 == 0) {
              m.discard(id);
              has_contents[i] = false;
            }
            break;
          case 3:
            if (t == 0) m.end_step();
            break;
          default: {
            const int a = static_cast<int>(rng() % 3);
            const Access access = a == 0   ? Access::ReadWrite
                                  : a == 1 ? Access::ReadOnly
                                           : Access::WriteOnly;
            void* p = m.acquire(id, *stream, access);
            if (access != Access::WriteOnly && has_contents[i]) {
              auto r = h.matches(id, p, *stream);
              if (!r) fail(r.message());
            }
            if (access != Access::ReadOnly) {
              if (rng() % 4 == 0) stall(*stream, 300);
              h.write(id, p, 0, m.bytes(id), stream);
              has_contents[i] = true;
            }
            m.release(id, *stream);
          }
        }
      } catch (const std::exception& e) {
        fail(e.what());
      }
    }
    for (std::size_t i = 0; i < ids.size(); ++i) {
      try {
        if (has_contents[i]) {
          void* p = m.acquire(ids[i], *stream, Access::ReadOnly);
          auto r = h.matches(ids[i], p, *stream);
          if (!r) fail(r.message());
          m.release(ids[i], *stream);
        }
        m.unregister(ids[i]);
      } catch (const std::exception& e) {
        fail(e.what());
      }
    }
    stream->synchronize();
  };

  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(worker, t);
  std::thread observer([&] {
    while (!stop) {
      EXPECT_LE(m.device_bytes(), m.budget_bytes());
      m.poll();
      (void)m.metrics();
      m.check_invariants();
      std::this_thread::sleep_for(milliseconds(1));
    }
  });
  for (auto& t : pool) t.join();
  stop = true;
  observer.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_LE(m.metrics().peak_device_bytes, budget);
  EXPECT_GT(m.metrics().evictions, 0u);
  expect_no_leak(h);
}

INSTANTIATE_TEST_SUITE_P(
    Policies, ManagerConcurrencyTest,
    ::testing::Values(PolicyKind::Lru, PolicyKind::TwoQ, PolicyKind::Belady), [](const auto& info) {
      std::string s = to_string(info.param);
      s.erase(std::remove_if(s.begin(), s.end(), [](char c) { return !std::isalnum(c); }), s.end());
      return s;
    });

}  // namespace
}  // namespace reviva::test
