// PrefetchScheduler (host backend): the next `window` groups of a declared order are on their way
// when a group is acquired, wrapping into the next step; a recorded first step is replayed from
// the second, with prefetch hits replacing demand fetches; eager offload moves out only blocks
// needed beyond the window; the adaptive window stays within its bounds, widening when copies
// are late and narrowing when prefetches find no room; contents survive every step bit-exactly.
#include "test_util.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <thread>

namespace reviva::test {
namespace {

constexpr std::size_t kKiB = 1024;
constexpr std::size_t kMiB = 1024 * 1024;
using Group = std::vector<BlockId>;

// Compute work that takes `ms` on the stream (what a layer's kernels would).
void compute_for(const Stream& stream, double ms) {
  stream.launch_host_func([ms] {
    std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int>(ms * 1000)));
  });
}

bool on_the_way(BlockState s) { return s == BlockState::ToDevice || s == BlockState::Device; }
bool leaving(BlockState s) { return s == BlockState::ToHost || s == BlockState::Host; }

// A manager on the host backend with `groups` groups of `per_group` blocks, each block filled
// with random contents, offloaded, and shadowed by the test.
class Rig {
 public:
  Rig(std::size_t budget, int groups, int per_group, std::size_t block_bytes,
      PolicyKind policy = PolicyKind::Lru) {
    HostBackendOptions bo;
    bo.simulated_device_bytes = std::size_t{1} << 30;
    backend = make_host_backend(bo);
    pool = PinnedHostPool::create(backend, {});
    staging = PinnedHostPool::create(backend, {});
    engine = std::make_shared<TransferEngine>(pool);
    compute = std::make_shared<Stream>(backend);
    OffloadManagerOptions o;
    o.budget_bytes = budget;
    o.policy = policy;
    manager = std::make_unique<OffloadManager>(engine, make_backend_device_allocator(backend), o);
    for (int g = 0; g < groups; ++g) {
      Group group;
      for (int b = 0; b < per_group; ++b) {
        const std::size_t bytes = block_bytes + 8 * static_cast<std::size_t>(g * per_group + b);
        const BlockId id = manager->register_block(bytes);
        void* p = manager->acquire(id, *compute, Access::WriteOnly);
        write(id, p);
        manager->release(id, *compute);
        manager->offload(id);
        group.push_back(id);
      }
      order.push_back(group);
    }
    manager->synchronize();
  }
  ~Rig() {
    compute->synchronize();
    manager->synchronize();
    manager.reset();
  }

  void write(BlockId id, void* dev) {
    auto& shadow = shadows[id];
    shadow.resize(manager->bytes(id));
    PinnedBlock st = staging->allocate(shadow.size());
    fill_random(st.data(), shadow.size(), ++seed);
    std::memcpy(shadow.data(), st.data(), shadow.size());
    backend->copy_async(dev, st.data(), shadow.size(), compute->handle());
    st.record_use(compute);
  }
  ::testing::AssertionResult matches(BlockId id, const void* dev) {
    const auto& shadow = shadows.at(id);
    PinnedBlock st = staging->allocate(shadow.size());
    backend->copy_async(st.data(), dev, shadow.size(), compute->handle());
    compute->synchronize();
    if (std::memcmp(st.data(), shadow.data(), shadow.size()) == 0)
      return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "block " << id << " does not hold its contents";
  }

  // One group access as a compute loop does it: acquire, check and rewrite, compute, release.
  void use(PrefetchScheduler& scheduler, const Group& group, double compute_ms = 0.0,
           bool check = true) {
    const std::vector<void*> ptrs = scheduler.acquire_group(group, *compute);
    ASSERT_EQ(ptrs.size(), group.size());
    for (std::size_t i = 0; i < group.size(); ++i) {
      ASSERT_NE(ptrs[i], nullptr);
      if (check) {
        ASSERT_TRUE(matches(group[i], ptrs[i]));
        write(group[i], ptrs[i]);
      }
    }
    if (compute_ms > 0) compute_for(*compute, compute_ms);
    scheduler.release_group(group, *compute);
    ASSERT_LE(manager->device_bytes(), manager->budget_bytes());
  }

  std::size_t group_bytes(const Group& g) const {
    std::size_t n = 0;
    for (BlockId id : g) n += manager->bytes(id);
    return n;
  }

  std::shared_ptr<Backend> backend;
  std::shared_ptr<PinnedHostPool> pool;
  std::shared_ptr<PinnedHostPool> staging;
  std::shared_ptr<TransferEngine> engine;
  std::shared_ptr<Stream> compute;
  std::unique_ptr<OffloadManager> manager;
  std::vector<Group> order;
  std::map<BlockId, std::vector<std::uint8_t>> shadows;
  std::uint64_t seed = 1;
};

TEST(PrefetchScheduler, DeclaredOrderKeepsTheNextGroupsOnTheirWay) {
  const int groups = 6, window = 2;
  Rig rig(64 * kMiB, groups, 2, 192 * kKiB + 3);
  PrefetchSchedulerOptions o;
  o.prefetch_groups = window;
  PrefetchScheduler scheduler(*rig.manager, o);
  scheduler.declare_order(rig.order);
  EXPECT_EQ(scheduler.window(), window);
  EXPECT_EQ(scheduler.order(), rig.order);
  for (int step = 0; step < 3; ++step) {
    for (int i = 0; i < groups; ++i) {
      SCOPED_TRACE("step " + std::to_string(step) + ", group " + std::to_string(i));
      // Blocks of the next `window` groups (wrapping into the next step) that are on the host.
      std::vector<BlockId> ahead_on_host;
      for (int k = 1; k <= window; ++k)
        for (BlockId id : rig.order[(i + k) % groups])
          if (rig.manager->state(id) == BlockState::Host) ahead_on_host.push_back(id);
      const auto ptrs = scheduler.acquire_group(rig.order[i], *rig.compute);
      for (BlockId id : ahead_on_host) {
        EXPECT_TRUE(on_the_way(rig.manager->state(id)))
            << "block " << id << " ahead in the window is " << to_string(rig.manager->state(id));
      }
      for (std::size_t b = 0; b < ptrs.size(); ++b) {
        EXPECT_TRUE(rig.matches(rig.order[i][b], ptrs[b]));
        rig.write(rig.order[i][b], ptrs[b]);
      }
      scheduler.release_group(rig.order[i], *rig.compute);
      rig.manager->check_invariants();
      // Let the eager offloads land, so that the next groups are on the host when checked.
      rig.manager->synchronize();
    }
    scheduler.end_step();
  }
  const auto st = scheduler.stats();
  EXPECT_GT(st.prefetches_issued, 0u);
  EXPECT_EQ(st.off_schedule_accesses, 0u);
  EXPECT_EQ(st.groups_in_order, static_cast<std::size_t>(groups));
  EXPECT_EQ(st.window, window);
  EXPECT_GT(rig.manager->metrics().prefetches, 0u);
}

// max_ahead_bytes caps the lead: of a wide window under a roomy budget, only as many blocks as
// fit the cap are on their way ahead of compute (acquired blocks do not count), and each access
// tops the lead up again.
TEST(PrefetchScheduler, MaxAheadBytesCapsTheLead) {
  const int groups = 8;
  const std::size_t block = 192 * kKiB;
  Rig rig(64 * kMiB, groups, 1, block);
  PrefetchSchedulerOptions o;
  o.prefetch_groups = 6;
  o.eager_offload = false;
  o.max_ahead_bytes = 2 * block + 2 * kKiB;  // two blocks (each is a few bytes over `block`)
  PrefetchScheduler scheduler(*rig.manager, o);
  scheduler.declare_order(rig.order);
  for (int i = 0; i < groups; ++i) {
    SCOPED_TRACE("group " + std::to_string(i));
    const auto ptrs = scheduler.acquire_group(rig.order[i], *rig.compute);
    int ahead = 0;
    for (int k = 1; k < groups - i; ++k)
      if (on_the_way(rig.manager->state(rig.order[i + k][0]))) ++ahead;
    EXPECT_EQ(ahead, std::min(2, groups - 1 - i)) << "the lead is two blocks";
    EXPECT_LE(rig.manager->prefetched_bytes(), o.max_ahead_bytes);
    if (i + 3 < groups) {
      EXPECT_EQ(rig.manager->state(rig.order[i + 3][0]), BlockState::Host);
    }
    scheduler.release_group(rig.order[i], *rig.compute);
  }
  EXPECT_GT(scheduler.stats().stops_at_max_ahead, 0u);
  // Without the cap the same window takes six blocks ahead.
  rig.manager->synchronize();
  for (const Group& g : rig.order) rig.manager->offload(g[0]);
  rig.manager->synchronize();
  o.max_ahead_bytes = 0;
  PrefetchScheduler wide(*rig.manager, o);
  wide.declare_order(rig.order);
  wide.acquire_group(rig.order[0], *rig.compute);
  int ahead = 0;
  for (int k = 1; k < groups; ++k)
    if (on_the_way(rig.manager->state(rig.order[k][0]))) ++ahead;
  EXPECT_EQ(ahead, 6);
  wide.release_group(rig.order[0], *rig.compute);
}

TEST(PrefetchScheduler, RecordedFirstStepIsReplayedFromTheSecond) {
  const int groups = 8;
  const std::size_t block = 256 * kKiB;
  // Room for four of the eight groups: blocks go back and forth every step.
  Rig rig(4 * 2 * (block + 8 * 16), groups, 2, block);
  PrefetchScheduler scheduler(*rig.manager);  // window 2, eager offload
  std::vector<ManagerMetrics> after_step;
  rig.manager->synchronize();
  after_step.push_back(rig.manager->metrics());
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    for (const Group& g : rig.order) {
      ASSERT_NO_FATAL_FAILURE(rig.use(scheduler, g, /*compute_ms=*/3.0));
      if (step == 0) {
        EXPECT_TRUE(scheduler.order().empty()) << "the order exists while recording";
      }
    }
    scheduler.end_step();
    EXPECT_EQ(scheduler.order().size(), static_cast<std::size_t>(groups));
    EXPECT_EQ(scheduler.order(), rig.order);
    EXPECT_EQ(scheduler.stats().groups_in_order, static_cast<std::size_t>(groups));
    EXPECT_EQ(scheduler.stats().steps, static_cast<std::size_t>(step + 1));
    rig.compute->synchronize();
    rig.manager->synchronize();
    after_step.push_back(rig.manager->metrics());
    rig.manager->check_invariants();
  }
  auto delta = [&](int step, auto field) {
    return after_step[step + 1].*field - after_step[step].*field;
  };
  const auto misses_1 = delta(0, &ManagerMetrics::prefetch_misses);
  const auto misses_2 = delta(1, &ManagerMetrics::prefetch_misses);
  const auto hits_2 = delta(1, &ManagerMetrics::prefetch_hits);
  EXPECT_GT(misses_1, 0u) << "the first step found nothing on the host";
  EXPECT_EQ(delta(0, &ManagerMetrics::prefetches), 0u) << "prefetches without an order";
  EXPECT_GT(hits_2, 0u) << "second step: " << delta(1, &ManagerMetrics::prefetches)
                        << " prefetches, " << delta(1, &ManagerMetrics::prefetch_late) << " late, "
                        << misses_2 << " misses; " << scheduler.stats().prefetches_without_room
                        << " prefetches found no room so far";
  EXPECT_LT(misses_2, misses_1);
  EXPECT_GT(scheduler.stats().prefetches_issued, 0u);
  EXPECT_LE(rig.manager->metrics().peak_device_bytes, rig.manager->budget_bytes());
}

TEST(PrefetchScheduler, EagerOffloadMovesOutOnlyBlocksNeededBeyondTheWindow) {
  const std::size_t block = 128 * kKiB;
  for (bool eager : {true, false}) {
    SCOPED_TRACE(eager ? "eager offload" : "no eager offload");
    Rig rig(64 * kMiB, 5, 2, block);  // room for everything: nothing leaves for lack of room
    // `shared` is in groups 0 and 1: its next use after group 0 is inside the window.
    const BlockId shared = rig.order[1][0];
    std::vector<Group> order = rig.order;
    order[0].push_back(shared);
    PrefetchSchedulerOptions o;
    o.prefetch_groups = 2;
    o.eager_offload = eager;
    PrefetchScheduler scheduler(*rig.manager, o);
    scheduler.declare_order(order);
    for (std::size_t i = 0; i < order.size(); ++i) {
      SCOPED_TRACE("group " + std::to_string(i));
      ASSERT_NO_FATAL_FAILURE(rig.use(scheduler, order[i]));
      for (BlockId id : order[i]) {
        const BlockState s = rig.manager->state(id);
        // Next use: group 1 for `shared` after group 0, otherwise the next step (5 groups on).
        const bool needed_soon = id == shared && i == 0;
        if (eager && !needed_soon) {
          EXPECT_TRUE(leaving(s)) << "block " << id << " needed far later is " << to_string(s);
        } else {
          EXPECT_EQ(s, BlockState::Device) << "block " << id;
        }
      }
    }
    if (eager) {
      EXPECT_GT(scheduler.stats().eager_offloads, 0u);
    } else {
      EXPECT_EQ(scheduler.stats().eager_offloads, 0u);
    }
  }
}

TEST(PrefetchScheduler, EagerOffloadWorksWhenTheHostRunsAheadOfTheCopies) {
  // As on a GPU: the group's H2D copies have not run yet (the copy stream is gated) when compute
  // work is queued and the group released. Its blocks, needed only in the next step, must still
  // start leaving: the offload is ordered after the copies and the compute work.
  const std::size_t block = 256 * kKiB;
  Rig rig(64 * kMiB, 4, 2, block);
  PrefetchScheduler scheduler(*rig.manager);  // window 2, eager offload
  scheduler.declare_order(rig.order);
  for (std::size_t i = 0; i < rig.order.size(); ++i) {
    SCOPED_TRACE("group " + std::to_string(i));
    {
      StreamGate gate;
      gate.block(rig.engine->stream(Direction::HostToDevice));
      const auto ptrs = scheduler.acquire_group(rig.order[i], *rig.compute);
      for (std::size_t b = 0; b < ptrs.size(); ++b) rig.write(rig.order[i][b], ptrs[b]);
      scheduler.release_group(rig.order[i], *rig.compute);
      for (BlockId id : rig.order[i]) {
        EXPECT_TRUE(leaving(rig.manager->state(id)))
            << "block " << id << " needed next step is " << to_string(rig.manager->state(id));
      }
      gate.open();
    }
    rig.manager->synchronize();
  }
  rig.manager->synchronize();
  for (const Group& g : rig.order) {
    for (BlockId id : g) {
      void* p = rig.manager->acquire(id, *rig.compute, Access::ReadOnly);
      EXPECT_TRUE(rig.matches(id, p));
      rig.manager->release(id, *rig.compute);
    }
  }
}

TEST(PrefetchScheduler, ReleaseWithDiscardDropsTheContentsWithoutCopying) {
  // Dead contents (activations after their last use) are dropped, not copied out; the next
  // group, needed only in the next step, is still offloaded eagerly.
  Rig rig(64 * kMiB, 4, 2, 128 * kKiB);
  PrefetchScheduler scheduler(*rig.manager);  // window 2, eager offload
  scheduler.declare_order(rig.order);
  const std::uint64_t to_host = rig.manager->metrics().bytes_to_host;
  const Group& dead = rig.order[0];
  const Group& live = rig.order[1];
  auto ptrs = scheduler.acquire_group(dead, *rig.compute);
  for (std::size_t b = 0; b < ptrs.size(); ++b) rig.write(dead[b], ptrs[b]);
  scheduler.release_group(dead, *rig.compute, /*discard=*/true);
  for (BlockId id : dead) {
    EXPECT_EQ(rig.manager->state(id), BlockState::Empty) << "block " << id;
  }
  ASSERT_NO_FATAL_FAILURE(rig.use(scheduler, live));
  for (BlockId id : live) EXPECT_TRUE(leaving(rig.manager->state(id))) << "block " << id;
  rig.manager->synchronize();
  EXPECT_EQ(rig.manager->metrics().bytes_to_host, to_host + rig.group_bytes(live))
      << "only the live group is copied out";
  // The dropped group can be written afresh; the live one comes back intact.
  ptrs = scheduler.acquire_group(dead, *rig.compute, Access::WriteOnly);
  for (std::size_t b = 0; b < ptrs.size(); ++b) rig.write(dead[b], ptrs[b]);
  scheduler.release_group(dead, *rig.compute);
  for (const Group& g : {dead, live}) {
    for (BlockId id : g) {
      void* p = rig.manager->acquire(id, *rig.compute, Access::ReadOnly);
      EXPECT_TRUE(rig.matches(id, p));
      rig.manager->release(id, *rig.compute);
    }
  }
  rig.manager->check_invariants();
}

TEST(PrefetchScheduler, FailedGroupAcquireReleasesWhatItAcquired) {
  // `big` fits the budget alone but not beside a and b: acquire_group([a, b, big]) throws. The
  // call must give back a and b (before the fix they stayed acquired: never evictable, and
  // offload() refused them), and leave no trace in the recorded order.
  Rig rig(256 * kKiB, 2, 1, 64 * kKiB);
  const BlockId a = rig.order[0][0];
  const BlockId b = rig.order[1][0];
  const BlockId big = rig.manager->register_block(160 * kKiB);
  PrefetchScheduler scheduler(*rig.manager);  // recording: no declared order
  const Group group{a, b, big};
  EXPECT_THROW(scheduler.acquire_group(group, *rig.compute), OutOfMemory);
  for (BlockId id : {a, b}) {
    EXPECT_NO_THROW(rig.manager->offload(id)) << "block " << id << " is still acquired";
  }
  // `big` alone fits once a and b can leave; then a and b come back with their contents.
  const auto ptrs = scheduler.acquire_group(Group{big}, *rig.compute, Access::WriteOnly);
  ASSERT_EQ(ptrs.size(), 1u);
  rig.write(big, ptrs[0]);
  scheduler.release_group(Group{big}, *rig.compute);
  ASSERT_NO_FATAL_FAILURE(rig.use(scheduler, Group{a, b}));
  scheduler.end_step();
  EXPECT_EQ(scheduler.order(), (std::vector<Group>{{big}, {a, b}}));
  rig.manager->check_invariants();
}

TEST(PrefetchScheduler, ReleaseLeavesABlockStillAcquiredElsewhereResident) {
  // A block acquired twice (by two groups in use at once) and released by one of them is still in
  // use: eager offload must pass it by, not fail the release (it threw InvalidArgument before).
  const std::size_t block = 64 * kKiB;
  Rig rig(64 * kMiB, 4, 1, block);
  PrefetchScheduler scheduler(*rig.manager);  // window 2, eager offload
  scheduler.declare_order(rig.order);
  const BlockId held = rig.order[0][0];
  void* p = rig.manager->acquire(held, *rig.compute);  // e.g. a second user of the block
  ASSERT_NO_FATAL_FAILURE(rig.use(scheduler, rig.order[0]));
  EXPECT_EQ(rig.manager->state(held), BlockState::Device);
  EXPECT_TRUE(rig.matches(held, p));
  rig.manager->release(held, *rig.compute);
  EXPECT_NO_THROW(rig.manager->offload(held));
  rig.manager->check_invariants();
}

TEST(PrefetchScheduler, OffScheduleAccessesAreCountedAndStillCorrect) {
  Rig rig(64 * kMiB, 4, 2, 64 * kKiB);
  PrefetchScheduler scheduler(*rig.manager);
  const std::vector<Group> declared(rig.order.begin(), rig.order.begin() + 3);
  scheduler.declare_order(declared);
  ASSERT_NO_FATAL_FAILURE(rig.use(scheduler, declared[0]));
  ASSERT_NO_FATAL_FAILURE(rig.use(scheduler, rig.order[3]));  // not in the order
  EXPECT_EQ(scheduler.stats().off_schedule_accesses, 1u);
  ASSERT_NO_FATAL_FAILURE(rig.use(scheduler, declared[2]));  // in the order, out of turn
  ASSERT_NO_FATAL_FAILURE(rig.use(scheduler, declared[0]));
  ASSERT_NO_FATAL_FAILURE(rig.use(scheduler, declared[1]));
  ASSERT_NO_FATAL_FAILURE(rig.use(scheduler, declared[2]));
  EXPECT_LE(scheduler.stats().off_schedule_accesses, 2u);
  rig.manager->check_invariants();
}

TEST(PrefetchScheduler, ContentsSurviveManyStepsUnderATightBudget) {
  // Groups of different sizes, a budget of about three groups, a window of two: prefetches, eager
  // offloads and evictions interleave; every access checks and rewrites every block.
  for (PolicyKind policy : {PolicyKind::Lru, PolicyKind::TwoQ, PolicyKind::Belady}) {
    for (bool declared : {true, false}) {
      SCOPED_TRACE(std::string(to_string(policy)) + (declared ? ", declared" : ", recorded"));
      const std::size_t block = 160 * kKiB;
      Rig rig(3 * 3 * (block + 8 * 24), 8, 3, block, policy);
      PrefetchScheduler scheduler(*rig.manager);
      if (declared) scheduler.declare_order(rig.order);
      for (int step = 0; step < scaled(4); ++step) {
        for (const Group& g : rig.order) {
          ASSERT_NO_FATAL_FAILURE(rig.use(scheduler, g, 0.2));
        }
        scheduler.end_step();
        rig.manager->check_invariants();
      }
      EXPECT_LE(rig.manager->metrics().peak_device_bytes, rig.manager->budget_bytes());
    }
  }
}

TEST(PrefetchScheduler, AdaptiveWindowWidensWhenCopiesAreLate) {
  // Copies of megabytes against compute that takes no time: every prefetch is late, so the
  // window grows, never past max_window. Paced: the host waits for each access's compute (as a
  // loop that reads a result does); not paced: the host runs ahead of the copies, as on a GPU.
  for (bool paced : {true, false}) {
    SCOPED_TRACE(paced ? "host paced by compute" : "host running ahead");
    PrefetchSchedulerOptions o;
    o.adaptive = true;
    o.prefetch_groups = 1;
    o.min_window = 1;
    o.max_window = 4;
    Rig rig(256 * kMiB, 6, 1, 4 * kMiB);
    PrefetchScheduler scheduler(*rig.manager, o);
    scheduler.declare_order(rig.order);
    int widest = scheduler.window();
    for (int step = 0; step < 3; ++step) {
      for (const Group& g : rig.order) {
        ASSERT_NO_FATAL_FAILURE(rig.use(scheduler, g, 0.0, /*check=*/paced));
        EXPECT_GE(scheduler.window(), o.min_window);
        EXPECT_LE(scheduler.window(), o.max_window);
        EXPECT_EQ(scheduler.stats().window, scheduler.window());
        widest = std::max(widest, scheduler.window());
      }
      scheduler.end_step();
    }
    EXPECT_GT(widest, o.prefetch_groups) << "late prefetches did not widen the window";
    EXPECT_GT(scheduler.stats().measured_copy_ms_per_group, 0.0);
  }
}

TEST(PrefetchScheduler, AdaptiveWindowNarrowsWhenPrefetchesFindNoRoom) {
  // Room for one group and a half: prefetches of the next group never fit; compute is slow, so
  // copies are never late. The window shrinks, never below min_window.
  PrefetchSchedulerOptions o;
  o.adaptive = true;
  o.prefetch_groups = 4;
  o.min_window = 2;
  o.max_window = 4;
  const std::size_t block = 128 * kKiB;
  Rig rig(3 * block + block / 2, 6, 2, block);
  PrefetchScheduler scheduler(*rig.manager, o);
  scheduler.declare_order(rig.order);
  int narrowest = scheduler.window();
  for (int step = 0; step < 3; ++step) {
    for (const Group& g : rig.order) {
      ASSERT_NO_FATAL_FAILURE(rig.use(scheduler, g, 2.0));
      EXPECT_GE(scheduler.window(), o.min_window);
      EXPECT_LE(scheduler.window(), o.max_window);
      narrowest = std::min(narrowest, scheduler.window());
    }
    scheduler.end_step();
  }
  EXPECT_GT(scheduler.stats().prefetches_without_room, 0u);
  EXPECT_LT(narrowest, o.prefetch_groups) << "prefetches without room did not narrow the window";
  EXPECT_GT(scheduler.stats().measured_compute_ms_per_group, 0.0);
}

TEST(PrefetchScheduler, KeptGroupsTakeNoPlaceInTheWindow) {
  // A decode cycle of 6 K/V layers, 0 2 3 kept resident: with a window of 1, using layer 1
  // brings in layer 4 (the next one that may need it, past the kept 2 and 3), and releasing
  // layer 1 lets it go (its next use is 3 counted groups away), while layer 4 stays.
  HostBackendOptions bo;
  bo.simulated_device_bytes = std::size_t{1} << 30;
  auto backend = make_host_backend(bo);
  auto pool = PinnedHostPool::create(backend, {});
  auto engine = std::make_shared<TransferEngine>(pool);
  Stream compute(backend);
  OffloadManagerOptions o;
  o.budget_bytes = 64 * kMiB;
  OffloadManager m(engine, make_backend_device_allocator(backend), o);
  std::vector<BlockId> layers;
  for (int i = 0; i < 6; ++i) layers.push_back(m.register_append_block(kMiB));
  for (int i : {0, 2, 3}) ASSERT_TRUE(m.keep_resident(layers[static_cast<std::size_t>(i)]));
  for (BlockId id : layers) {  // prefill: every layer written once, the streamed ones offloaded
    void* p = m.acquire(id, compute);
    backend->memset_async(p, 7, 1000, compute.handle());
    m.wrote(id, 0, 1000, compute);
    m.release(id, compute);
    m.offload(id);
  }
  m.synchronize();
  PrefetchSchedulerOptions so;
  so.prefetch_groups = 1;
  PrefetchScheduler s(m, so);
  std::vector<Group> order;
  for (BlockId id : layers) order.push_back({id});
  s.declare_order(order);
  s.acquire_group(order[0], compute);  // kept: brings in layer 1
  EXPECT_TRUE(on_the_way(m.state(layers[1])));
  s.release_group(order[0], compute);
  s.acquire_group(order[1], compute);
  EXPECT_TRUE(on_the_way(m.state(layers[4]))) << "the window skips the kept layers 2 and 3";
  EXPECT_EQ(m.state(layers[5]), BlockState::Host) << "one group of window, not more";
  s.release_group(order[1], compute);
  m.synchronize();
  EXPECT_EQ(m.state(layers[1]), BlockState::Host) << "needed again only next step: let go";
  EXPECT_TRUE(on_the_way(m.state(layers[4])));
  for (int i : {0, 2, 3})
    EXPECT_EQ(m.state(layers[static_cast<std::size_t>(i)]), BlockState::Device);
}

TEST(PrefetchScheduler, FixedWindowIsTheConfiguredOne) {
  for (int w : {1, 3}) {
    Rig rig(64 * kMiB, 4, 1, 64 * kKiB);
    PrefetchSchedulerOptions o;
    o.prefetch_groups = w;
    PrefetchScheduler scheduler(*rig.manager, o);
    EXPECT_EQ(scheduler.window(), w);
    scheduler.declare_order(rig.order);
    for (const Group& g : rig.order) {
      ASSERT_NO_FATAL_FAILURE(rig.use(scheduler, g));
    }
    EXPECT_EQ(scheduler.window(), w);
  }
}

}  // namespace
}  // namespace reviva::test
