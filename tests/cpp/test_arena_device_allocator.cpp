// ArenaDeviceAllocator: freed buffers reused in stream order (a gated stream proves that a
// reuse on another stream waits for the free, on the device), best fit within twice the size,
// trim and out-of-memory give the cache back, many threads at once, and the OffloadManager's
// blocks kept exact on arena memory under a tight budget.
#include "test_util.h"

#include <reviva/arena_device_allocator.h>

#include <chrono>
#include <future>
#include <thread>

namespace reviva::test {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

class ArenaAllocatorTest : public BackendTest {
 protected:
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped()) return;
    if (backend_->vmm_granularity() == 0) GTEST_SKIP() << "no virtual memory management here";
    arena_ = DeviceArena::create(backend_);
    g_ = arena_->granularity();
    alloc_ = std::make_shared<ArenaDeviceAllocator>(arena_);
    pool_ = PinnedHostPool::create(backend_, {});
  }
  std::shared_ptr<DeviceArena> arena_;
  std::size_t g_ = 0;
  std::shared_ptr<ArenaDeviceAllocator> alloc_;
  std::shared_ptr<PinnedHostPool> pool_;
};

TEST_P(ArenaAllocatorTest, AFreedBufferIsReusedOnlyAfterTheStreamThatFreedIt) {
  Stream a(backend_), b(backend_);
  void* p = alloc_->allocate(g_, a.handle());
  StreamGate gate;
  gate.block(a);
  backend_->memset_async(p, 1, g_, a.handle());  // still to run when freed
  alloc_->deallocate(p, g_, a.handle());
  void* q = alloc_->allocate(g_ / 2, b.handle());
  EXPECT_EQ(q, p) << "a cached buffer of the same granule serves the request";
  backend_->memset_async(q, 2, g_ / 2, b.handle());
  Event done(backend_);
  done.record(b);
  EXPECT_FALSE(done.query()) << "stream b used the memory before stream a's free";
  gate.open();
  done.synchronize();
  const auto bytes = download(*pool_, b, q, g_);
  EXPECT_EQ(bytes[0], 2);
  EXPECT_EQ(bytes[g_ - 1], 1) << "a's write, ordered before the free, came first";
  alloc_->deallocate(q, g_ / 2, b.handle());
  const ArenaAllocatorStats st = alloc_->stats();
  EXPECT_EQ(st.allocations, 2u);
  EXPECT_EQ(st.cache_hits, 1u);
  EXPECT_EQ(st.live_bytes, 0u);
  EXPECT_EQ(st.cached_bytes, g_);
}

TEST_P(ArenaAllocatorTest, BestFitWithinTwiceTheSizeAndTrimGivesTheCacheBack) {
  Stream s(backend_);
  void* small = alloc_->allocate(g_, s.handle());
  void* large = alloc_->allocate(8 * g_, s.handle());
  alloc_->deallocate(small, g_, s.handle());
  alloc_->deallocate(large, 8 * g_, s.handle());
  EXPECT_EQ(alloc_->allocate(g_ / 4, s.handle()), small);
  void* fresh = alloc_->allocate(2 * g_, s.handle());  // 8 granules is more than twice 2
  EXPECT_NE(fresh, large);
  EXPECT_EQ(alloc_->stats().cached_bytes, 8 * g_);
  alloc_->trim();
  s.synchronize();
  arena_->reclaim(/*wait=*/true);
  EXPECT_EQ(alloc_->stats().cached_bytes, 0u);
  EXPECT_EQ(arena_->stats().mapped_bytes, 3 * g_) << "the two live buffers alone";
  alloc_->deallocate(small, g_, s.handle());
  alloc_->deallocate(fresh, 2 * g_, s.handle());
}

TEST_P(ArenaAllocatorTest, AMinimumSizeMakesBuffersOfDifferentSizesServeEachOther) {
  // Blocks of 1 and 2 granules used in turn, two live at a time: each in its own size, the
  // 1-granule buffer cached cannot serve the next 2-granule block and a third buffer is mapped;
  // with a minimum of 2 granules two buffers serve them all.
  Stream s(backend_);
  auto cycle = [&] {
    std::size_t most = 0;
    void* prev = alloc_->allocate(g_, s.handle());
    const std::size_t sizes[] = {2 * g_, 2 * g_, 2 * g_, g_, 2 * g_, 2 * g_, 2 * g_, g_};
    std::size_t prev_bytes = g_;
    for (std::size_t bytes : sizes) {
      void* next = alloc_->allocate(bytes, s.handle());
      const ArenaAllocatorStats st = alloc_->stats();
      most = std::max(most, st.live_bytes + st.cached_bytes);
      alloc_->deallocate(prev, prev_bytes, s.handle());
      prev = next;
      prev_bytes = bytes;
    }
    alloc_->deallocate(prev, prev_bytes, s.handle());
    alloc_->trim();
    return most;
  };
  EXPECT_EQ(cycle(), 5 * g_) << "each its own size: a third buffer beside the cached small one";
  alloc_->set_min_bytes(2 * g_);
  EXPECT_EQ(alloc_->min_bytes(), 2 * g_);
  EXPECT_EQ(cycle(), 4 * g_) << "one size: two buffers";
  alloc_->set_min_bytes(0);
  s.synchronize();
}

TEST_P(ArenaAllocatorTest, AFullArenaGivesTheCacheBackBeforeFailing) {
  arena_->set_limit_bytes(6 * g_);
  Stream s(backend_);
  void* a = alloc_->allocate(2 * g_, s.handle());
  void* b = alloc_->allocate(2 * g_, s.handle());
  void* c = alloc_->allocate(2 * g_, s.handle());
  alloc_->deallocate(a, 2 * g_, s.handle());
  alloc_->deallocate(b, 2 * g_, s.handle());
  // 4 granules fit only once the two cached buffers go back to the arena.
  void* d = alloc_->allocate(4 * g_, s.handle());
  EXPECT_NE(d, nullptr);
  EXPECT_GE(alloc_->stats().trims, 1u);
  EXPECT_THROW(alloc_->allocate(g_, s.handle()), OutOfMemory);
  alloc_->deallocate(c, 2 * g_, s.handle());
  alloc_->deallocate(d, 4 * g_, s.handle());
  EXPECT_LE(arena_->stats().peak_bytes, 6 * g_);
}

// Note [Memory held by views]: a buffer someone holds past its free (a view's buffer_of) is
// never handed to the next allocation; it counts against the arena's limit until its holder
// drops it, and an allocation that cannot fit beside it says so.
TEST_P(ArenaAllocatorTest, ABufferHeldPastItsFreeIsNotReusedUntilItsHolderDropsIt) {
  arena_->set_limit_bytes(2 * g_);
  Stream s(backend_);
  void* p = alloc_->allocate(g_, s.handle());
  std::shared_ptr<ArenaBuffer> view = alloc_->buffer_of(p);
  ASSERT_NE(view, nullptr);
  alloc_->deallocate(p, g_, s.handle());
  void* q = alloc_->allocate(g_, s.handle());
  EXPECT_NE(q, p) << "the memory a view still holds went to the next allocation";
  alloc_->deallocate(q, g_, s.handle());  // (cached: the next one takes it)
  void* r = alloc_->allocate(g_, s.handle());
  EXPECT_EQ(r, q);
  try {
    alloc_->allocate(g_, s.handle());  // (2 granules mapped: p's, held, and r's)
    ADD_FAILURE() << "mapped beyond the arena's limit";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("still held by views"), std::string::npos) << e.what();
  }
  view.reset();  // (p's memory goes back to the arena now)
  s.synchronize();
  arena_->reclaim(/*wait=*/true);
  void* t = alloc_->allocate(g_, s.handle());
  EXPECT_NE(t, nullptr);
  alloc_->deallocate(r, g_, s.handle());
  alloc_->deallocate(t, g_, s.handle());
  EXPECT_LE(arena_->stats().peak_bytes, 2 * g_);
}

TEST_P(ArenaAllocatorTest, ManyThreadsAllocateAndFree) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      Stream s(backend_);
      for (int i = 0; i < scaled(50); ++i) {
        const std::size_t bytes = g_ * static_cast<std::size_t>(1 + (i + t) % 3);
        void* p = alloc_->allocate(bytes, s.handle());
        backend_->memset_async(p, t, bytes, s.handle());
        alloc_->deallocate(p, bytes, s.handle());
      }
      s.synchronize();
    });
  }
  for (auto& th : threads) th.join();
  const ArenaAllocatorStats st = alloc_->stats();
  EXPECT_EQ(st.live_bytes, 0u);
  EXPECT_GT(st.cache_hits, 0u);
  alloc_->trim();
  arena_->reclaim(/*wait=*/true);
  EXPECT_EQ(arena_->stats().mapped_bytes, 0u);
}

TEST_P(ArenaAllocatorTest, OffloadManagerBlocksStayExactOnArenaMemory) {
  auto engine = std::make_shared<TransferEngine>(pool_);
  OffloadManagerOptions o;
  o.budget_bytes = 3 * g_;
  OffloadManager m(engine, alloc_, o);
  Stream compute(backend_);
  std::vector<BlockId> ids;
  std::vector<std::vector<std::uint8_t>> expected;
  for (int i = 0; i < 6; ++i) {
    ids.push_back(m.register_block(g_));
    expected.push_back(random_bytes(g_, 100 + static_cast<std::uint64_t>(i)));
  }
  for (int round = 0; round < scaled(3); ++round) {
    for (std::size_t i = 0; i < ids.size(); ++i) {
      void* p = m.acquire(ids[i], compute, round == 0 ? Access::WriteOnly : Access::ReadWrite);
      if (round == 0) {
        upload(*pool_, compute, p, expected[i]);
      } else {
        ASSERT_EQ(download(*pool_, compute, p, g_), expected[i]) << "block " << i;
      }
      m.release(ids[i], compute);
      EXPECT_LE(m.device_bytes(), 3 * g_);
    }
  }
  m.synchronize();
  EXPECT_GT(m.metrics().evictions, 0u);
  EXPECT_GT(alloc_->stats().cache_hits, 0u) << "evicted blocks' memory served later fetches";
  for (BlockId id : ids) m.unregister(id);
  m.synchronize();
}

// Note [Stream-ordered frees]: on arena memory a discarded block's bytes are free at once, while
// its last use still waits on a gated stream, and the next block takes its memory with its
// stream waiting on the device (no host wait); with an allocator that does not promise that, the
// bytes stay counted until the free is seen.
TEST_P(ArenaAllocatorTest, OffloadManagerCountsArenaFreesAtOnce) {
  auto engine = std::make_shared<TransferEngine>(pool_);
  OffloadManagerOptions o;
  o.budget_bytes = g_;
  OffloadManager m(engine, alloc_, o);
  Stream compute(backend_), other(backend_);
  const BlockId a = m.register_block(g_), b = m.register_block(g_);
  StreamGate gate;
  std::promise<void> finished;
  std::thread watchdog([&gate, done = finished.get_future()] {
    // A host wait below would otherwise never end.
    if (done.wait_for(std::chrono::seconds(10)) == std::future_status::timeout) gate.open();
  });
  const auto t0 = std::chrono::steady_clock::now();
  void* pa = m.acquire(a, compute, Access::WriteOnly);
  gate.block(compute);
  backend_->memset_async(pa, 1, g_, compute.handle());  // still to run when discarded
  m.release(a, compute);
  m.discard(a);
  EXPECT_EQ(m.device_bytes(), 0u) << "the arena orders reuse after the free on the device";
  void* pb = m.acquire(b, other, Access::WriteOnly);
  const double host_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(host_s, 5.0) << "the host waited for the gated stream";
  EXPECT_EQ(pb, pa) << "b took a's cached buffer";
  backend_->memset_async(pb, 2, g_ / 2, other.handle());
  Event done(backend_);
  done.record(other);
  EXPECT_FALSE(done.query()) << "b's stream used the memory before a's free";
  gate.open();
  done.synchronize();
  const auto bytes = download(*pool_, other, pb, g_);
  EXPECT_EQ(bytes[0], 2);
  EXPECT_EQ(bytes[g_ - 1], 1) << "a's write, ordered before the free, came first";
  m.release(b, other);
  m.unregister(a);
  m.unregister(b);
  m.synchronize();
  finished.set_value();
  watchdog.join();
  m.check_invariants();

  // The backend's allocator promises nothing: the freed bytes stay counted until seen free.
  OffloadManager plain(engine, make_backend_device_allocator(backend_), o);
  const BlockId c = plain.register_block(g_);
  StreamGate gate2;
  plain.acquire(c, compute, Access::WriteOnly);
  gate2.block(compute);
  plain.release(c, compute);
  plain.discard(c);
  EXPECT_EQ(plain.device_bytes(), g_);
  gate2.open();
  plain.synchronize();
  EXPECT_EQ(plain.device_bytes(), 0u);
  plain.unregister(c);
}

INSTANTIATE_TEST_SUITE_P(Backends, ArenaAllocatorTest,
                         ::testing::Values(BackendKind::Host, BackendKind::Cuda),
                         backend_param_name);

}  // namespace
}  // namespace reviva::test
