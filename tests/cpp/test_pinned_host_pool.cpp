// PinnedHostPool: allocation, reuse, best fit, splitting and coalescing, the capacity cap,
// deferred reuse of blocks that streams used, many threads at once.
#include "test_util.h"

#include <algorithm>
#include <limits>
#include <set>
#include <string>
#include <thread>
#include <utility>

namespace reviva::test {
namespace {

using PoolTest = BackendTest;

constexpr std::size_t kKiB = 1024;
constexpr std::size_t kMiB = 1024 * 1024;

PinnedHostPoolOptions small_slabs(std::size_t slab = kMiB, std::size_t cap = 0) {
  PinnedHostPoolOptions o;
  o.slab_bytes = slab;
  o.capacity_bytes = cap;
  return o;
}

TEST_P(PoolTest, AllocatesAlignedWritableBlocks) {
  auto pool = PinnedHostPool::create(backend_, small_slabs());
  PinnedBlock b = pool->allocate(1000);
  ASSERT_TRUE(b);
  EXPECT_EQ(b.size(), 1000u);
  EXPECT_EQ(b.capacity(), 1024u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b.data()) % 512, 0u);
  EXPECT_TRUE(pool->owns(b.data()));
  EXPECT_EQ(backend_->memory_kind(b.data()), MemoryKind::PinnedHost);
  std::memset(b.data(), 0xab, b.size());
  const auto st = pool->stats();
  EXPECT_EQ(st.bytes_in_use, 1024u);
  EXPECT_EQ(st.bytes_requested, 1000u);
  EXPECT_EQ(st.allocations, 1u);
  EXPECT_EQ(st.cache_hits, 0u);
  EXPECT_EQ(st.slabs, 1u);
  EXPECT_EQ(st.bytes_reserved, 2 * kMiB);  // slabs come in 2 MiB granules at least
  pool->check_invariants();
}

TEST_P(PoolTest, FreedBlockIsReusedFromCache) {
  auto pool = PinnedHostPool::create(backend_, small_slabs());
  void* first;
  {
    PinnedBlock b = pool->allocate(64 * kKiB);
    first = b.data();
  }
  PinnedBlock again = pool->allocate(64 * kKiB);
  EXPECT_EQ(again.data(), first);
  const auto st = pool->stats();
  EXPECT_EQ(st.allocations, 2u);
  EXPECT_EQ(st.cache_hits, 1u);
  EXPECT_EQ(st.slabs_allocated, 1u);
  EXPECT_DOUBLE_EQ(st.hit_rate(), 0.5);
  pool->check_invariants();
}

TEST_P(PoolTest, ReservedBlocksAreLaterCacheHitsWithoutNewSlabs) {
  auto pool = PinnedHostPool::create(backend_, small_slabs());
  pool->reserve(4, 3 * kMiB);  // larger than a slab: each gets a slab of its own
  const auto reserved = pool->stats();
  EXPECT_EQ(reserved.bytes_in_use, 0u);
  EXPECT_GE(reserved.bytes_reserved, 12 * kMiB);
  std::vector<PinnedBlock> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(pool->allocate(3 * kMiB));
  const auto st = pool->stats();
  EXPECT_EQ(st.slabs_allocated, reserved.slabs_allocated) << "no slab after the reservation";
  EXPECT_EQ(st.cache_hits, 4u);
  pool->check_invariants();
  blocks.clear();
  auto capped = PinnedHostPool::create(backend_, small_slabs(kMiB, 4 * kMiB));
  EXPECT_THROW(capped->reserve(3, 2 * kMiB), OutOfMemory);
  EXPECT_THROW(capped->reserve(1, 0), InvalidArgument);
}

TEST_P(PoolTest, AReservationBeyondTheHostsMemoryIsRefusedBeforePinning) {
  // Without a capacity, a reservation past the host's memory pinned slab after slab (the
  // machine swapped); now it is refused naming the request, with nothing pinned.
  auto pool = PinnedHostPool::create(backend_, small_slabs());
  for (const auto& [count, bytes] : {std::pair<std::size_t, std::size_t>{std::size_t{1} << 62, 1},
                                     {std::size_t{1} << 40, kMiB},
                                     {2, std::numeric_limits<std::size_t>::max() / 4}}) {
    try {
      pool->reserve(count, bytes);
      ADD_FAILURE() << count << " blocks of " << bytes << " bytes were reserved";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("bytes exceed the host's"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(pool->stats().bytes_reserved, 0u);
}

TEST_P(PoolTest, ReservePinsOnlyWhatIsMissing) {
  auto pool = PinnedHostPool::create(backend_, small_slabs());
  pool->reserve(3, 3 * kMiB);
  const auto first = pool->stats();
  EXPECT_EQ(first.slabs_allocated, 3u);
  pool->reserve(3, 3 * kMiB);  // the same again (a second generate call): nothing new
  EXPECT_EQ(pool->stats().slabs_allocated, 3u);
  PinnedBlock held = pool->allocate(3 * kMiB);
  pool->reserve(3, 3 * kMiB);  // one of three is in use: one more
  EXPECT_EQ(pool->stats().slabs_allocated, 4u);
  pool->check_invariants();
}

TEST_P(PoolTest, ReserveOnAHelperThreadIsSharedWithAllocations) {
  // A generate call pins its host copies ahead on a helper thread while the layers allocate
  // them one by one: together they pin each block once (Note [Slabs landing]).
  for (int round = 0; round < scaled(5); ++round) {
    auto pool = PinnedHostPool::create(backend_, small_slabs());
    const std::size_t count = 6;
    std::thread helper([&] { pool->reserve(count, 3 * kMiB); });
    while (pool->stats().bytes_reserved == 0) std::this_thread::yield();  // the helper began
    std::vector<PinnedBlock> taken;
    for (std::size_t i = 0; i < count; ++i) taken.push_back(pool->allocate(3 * kMiB));
    helper.join();
    const auto st = pool->stats();
    EXPECT_EQ(st.slabs_allocated, count) << "round " << round;
    EXPECT_EQ(st.bytes_in_use, count * 3 * kMiB);
    pool->check_invariants();
  }
}

TEST_P(PoolTest, BestFitPicksTheSmallestSufficientBlock) {
  auto pool = PinnedHostPool::create(backend_, small_slabs(2 * kMiB));
  // Carve the slab into [A 256K][sep][B 64K][sep][C 128K][sep][rest], then free A, B, C.
  PinnedBlock a = pool->allocate(256 * kKiB), s1 = pool->allocate(kKiB);
  PinnedBlock b = pool->allocate(64 * kKiB), s2 = pool->allocate(kKiB);
  PinnedBlock c = pool->allocate(128 * kKiB), s3 = pool->allocate(kKiB);
  void* b_ptr = b.data();
  void* c_ptr = c.data();
  a.reset();
  b.reset();
  c.reset();
  pool->check_invariants();
  PinnedBlock x = pool->allocate(60 * kKiB);  // fits B best
  EXPECT_EQ(x.data(), b_ptr);
  PinnedBlock y = pool->allocate(100 * kKiB);  // fits C best
  EXPECT_EQ(y.data(), c_ptr);
  pool->check_invariants();
}

TEST_P(PoolTest, SplitsAndCoalescesBackIntoOneBlock) {
  auto pool = PinnedHostPool::create(backend_, small_slabs(2 * kMiB));
  std::vector<PinnedBlock> blocks;
  for (int i = 0; i < 32; ++i) blocks.push_back(pool->allocate(64 * kKiB));  // fills the slab
  EXPECT_EQ(pool->stats().slabs, 1u);
  EXPECT_EQ(pool->stats().free_blocks, 0u);
  for (int i = 0; i < 32; i += 2) blocks[i].reset();  // checkerboard: 16 holes of 64 KiB
  auto st = pool->stats();
  EXPECT_EQ(st.free_blocks, 16u);
  EXPECT_EQ(st.largest_free_block, 64 * kKiB);
  pool->check_invariants();
  // Fragmented: 128 KiB does not fit any hole, so a second slab is reserved.
  {
    PinnedBlock big = pool->allocate(128 * kKiB);
    EXPECT_EQ(pool->stats().slabs, 2u);
  }
  for (int i = 1; i < 32; i += 2) blocks[i].reset();
  st = pool->stats();
  EXPECT_EQ(st.free_blocks, 2u);  // each slab coalesced into one block
  EXPECT_EQ(st.largest_free_block, 2 * kMiB);
  EXPECT_EQ(st.bytes_in_use, 0u);
  pool->check_invariants();
  // Now 2 MiB fits again without a new slab.
  PinnedBlock whole = pool->allocate(2 * kMiB);
  EXPECT_EQ(pool->stats().slabs, 2u);
}

TEST_P(PoolTest, GrowsInSlabsNotOneHugeAllocation) {
  auto pool = PinnedHostPool::create(backend_, small_slabs(4 * kMiB));
  std::vector<PinnedBlock> blocks;
  for (int i = 0; i < 10; ++i) blocks.push_back(pool->allocate(kMiB));
  const auto st = pool->stats();
  EXPECT_EQ(st.slabs, 3u);  // 4 + 4 + 4 MiB for 10 MiB
  EXPECT_EQ(st.bytes_reserved, 12 * kMiB);
  // A request bigger than a slab gets its own slab, rounded to 2 MiB.
  PinnedBlock big = pool->allocate(9 * kMiB + 1);
  EXPECT_EQ(pool->stats().bytes_reserved, 12 * kMiB + 10 * kMiB);
}

TEST_P(PoolTest, CapacityCapIsEnforcedWithAClearError) {
  auto pool = PinnedHostPool::create(backend_, small_slabs(2 * kMiB, 8 * kMiB));
  std::vector<PinnedBlock> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(pool->allocate(kMiB));
  EXPECT_EQ(pool->stats().bytes_reserved, 8 * kMiB);
  try {
    pool->allocate(kMiB);
    FAIL() << "expected OutOfMemory";
  } catch (const OutOfMemory& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("capacity 8388608"), std::string::npos) << msg;
    EXPECT_NE(msg.find("in use 8388608"), std::string::npos) << msg;
  }
  EXPECT_THROW(pool->allocate(9 * kMiB), OutOfMemory);
  blocks.pop_back();
  PinnedBlock again = pool->allocate(kMiB);  // room again after a free
  EXPECT_LE(pool->stats().peak_bytes_reserved, 8 * kMiB);
  pool->check_invariants();
}

TEST_P(PoolTest, CapReleasesCachedSlabsToFitALargerRequest) {
  auto pool = PinnedHostPool::create(backend_, small_slabs(2 * kMiB, 6 * kMiB));
  {
    std::vector<PinnedBlock> blocks;
    for (int i = 0; i < 3; ++i) blocks.push_back(pool->allocate(2 * kMiB));
  }
  EXPECT_EQ(pool->stats().bytes_reserved, 6 * kMiB);  // three free slabs cached
  PinnedBlock big = pool->allocate(5 * kMiB);         // needs one 6 MiB slab: release first
  const auto st = pool->stats();
  EXPECT_LE(st.bytes_reserved, 6 * kMiB);
  EXPECT_EQ(st.slabs_released, 3u);
  pool->check_invariants();
}

TEST_P(PoolTest, ReleaseCachedReturnsOnlyWhollyFreeSlabs) {
  auto pool = PinnedHostPool::create(backend_, small_slabs(2 * kMiB));
  PinnedBlock keep = pool->allocate(kMiB);
  { PinnedBlock drop = pool->allocate(3 * kMiB); }
  EXPECT_EQ(pool->stats().slabs, 2u);
  EXPECT_EQ(pool->release_cached(), 4 * kMiB);
  EXPECT_EQ(pool->stats().slabs, 1u);
  EXPECT_TRUE(pool->owns(keep.data()));
  pool->check_invariants();
}

TEST_P(PoolTest, BlockUsedByAStreamIsReusedOnlyAfterItsEvent) {
  auto pool = PinnedHostPool::create(backend_, small_slabs());
  auto stream = std::make_shared<const Stream>(backend_);
  StreamGate gate;
  gate.block(*stream);  // the stream's "copy" of the block is still running
  PinnedBlock b = pool->allocate(100 * kKiB);
  void* ptr = b.data();
  b.record_use(stream);
  b.reset();
  auto st = pool->stats();
  EXPECT_EQ(st.pending_blocks, 1u);
  EXPECT_EQ(st.bytes_pending, 100 * kKiB);
  PinnedBlock other = pool->allocate(100 * kKiB);
  EXPECT_NE(other.data(), ptr) << "a block still in use by a stream was handed out again";
  other.reset();
  gate.open();
  stream->synchronize();
  pool->process_pending();
  st = pool->stats();
  EXPECT_EQ(st.pending_blocks, 0u);
  EXPECT_EQ(st.bytes_pending, 0u);
  PinnedBlock reused = pool->allocate(100 * kKiB);
  EXPECT_EQ(reused.data(), ptr);
  pool->check_invariants();
}

// Note [Shared blocks]: a share views part of a block and keeps it alive: the memory goes back
// when the last holder goes, after every stream a share recorded.
TEST_P(PoolTest, SharesKeepTheirBlockUntilTheLastGoesAndItsStreamsPass) {
  auto pool = PinnedHostPool::create(backend_, small_slabs());
  auto stream = std::make_shared<const Stream>(backend_);
  PinnedBlock b = pool->allocate(100 * kKiB);
  void* ptr = b.data();
  PinnedBlock s1 = b.share(10 * kKiB, 30 * kKiB);
  PinnedBlock s2 = b.share(0, 100 * kKiB);
  EXPECT_EQ(s1.data(), static_cast<char*>(ptr) + 10 * kKiB);
  EXPECT_EQ(s1.size(), 30 * kKiB);
  EXPECT_EQ(s2.data(), ptr);
  EXPECT_EQ(pool->stats().allocations, 1u);  // no memory of their own
  std::memset(s1.data(), 0x5a, s1.size());
  EXPECT_EQ(static_cast<unsigned char*>(ptr)[10 * kKiB], 0x5a);
  b.reset();
  s2.reset();
  auto st = pool->stats();
  EXPECT_EQ(st.frees, 0u);
  EXPECT_EQ(st.bytes_in_use, 100 * kKiB) << "a share's block went back while the share lives";
  PinnedBlock other = pool->allocate(100 * kKiB);
  EXPECT_NE(other.data(), ptr);
  other.reset();
  StreamGate gate;
  gate.block(*stream);  // a copy from the share is still running
  s1.record_use(stream);
  s1.reset();
  st = pool->stats();
  EXPECT_EQ(st.pending_blocks, 1u);  // the whole block waits for the share's stream
  EXPECT_EQ(st.bytes_pending, 100 * kKiB);
  gate.open();
  stream->synchronize();
  pool->process_pending();
  EXPECT_EQ(pool->stats().bytes_in_use, 0u);
  EXPECT_EQ(pool->allocate(100 * kKiB).data(), ptr);
  PinnedBlock c = pool->allocate(kKiB);
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no exception");
  };
  EXPECT_NE(message([&] { c.share(512, 513); }).find("513 bytes from offset 512 are not inside"),
            std::string::npos);
  EXPECT_NE(message([&] { c.share(0, 0); }).find("0 bytes from offset 0"), std::string::npos);
  EXPECT_NE(message([] { PinnedBlock().share(0, 1); }).find("empty block"), std::string::npos);
  pool->check_invariants();
}

TEST_P(PoolTest, BlockWaitsForEveryStreamThatUsedIt) {
  auto pool = PinnedHostPool::create(backend_, small_slabs());
  auto s1 = std::make_shared<const Stream>(backend_);
  auto s2 = std::make_shared<const Stream>(backend_);
  StreamGate gate;
  gate.block(*s2);
  PinnedBlock b = pool->allocate(4096);
  b.record_use(s1);
  b.record_use(s2);
  b.record_use(s2);  // recorded once per stream
  b.reset();
  s1->synchronize();
  pool->process_pending();
  EXPECT_EQ(pool->stats().pending_blocks, 1u);  // s2 still holds it
  gate.open();
  pool->synchronize_pending();
  EXPECT_EQ(pool->stats().pending_blocks, 0u);
  pool->check_invariants();
}

TEST_P(PoolTest, CapWaitsForPendingFreesBeforeFailing) {
  auto pool = PinnedHostPool::create(backend_, small_slabs(2 * kMiB, 2 * kMiB));
  auto stream = std::make_shared<const Stream>(backend_);
  {
    PinnedBlock b = pool->allocate(2 * kMiB);
    b.record_use(stream);
    stream->launch_host_func([] { std::this_thread::sleep_for(std::chrono::milliseconds(30)); });
  }
  PinnedBlock again = pool->allocate(2 * kMiB);  // waits for the pending block, no error
  EXPECT_TRUE(again);
}

TEST_P(PoolTest, RejectsBadInputNamingIt) {
  auto pool = PinnedHostPool::create(backend_, small_slabs());
  EXPECT_THROW(pool->allocate(0), InvalidArgument);
  PinnedHostPoolOptions bad;
  bad.alignment = 100;
  try {
    PinnedHostPool::create(backend_, bad);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("got 100"), std::string::npos) << e.what();
  }
  PinnedBlock empty;
  EXPECT_THROW(empty.record_use(std::make_shared<const Stream>(backend_)), InvalidArgument);
}

TEST_P(PoolTest, ManyThreadsAllocateAndFreeWithoutOverlap) {
  auto pool = PinnedHostPool::create(backend_, small_slabs(4 * kMiB, 256 * kMiB));
  auto stream = std::make_shared<const Stream>(backend_);
  const int threads = 8;
  const int iterations = scaled(3000);
  std::atomic<int> failures{0};
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      std::mt19937 rng(1234 + t);
      std::vector<std::pair<PinnedBlock, std::uint8_t>> live;
      for (int i = 0; i < iterations; ++i) {
        if (live.size() < 16 && (live.empty() || rng() % 3 != 0)) {
          const std::size_t bytes = 1 + rng() % (rng() % 8 == 0 ? 2 * kMiB : 16 * kKiB);
          PinnedBlock b = pool->allocate(bytes);
          const auto tag = static_cast<std::uint8_t>(rng());
          std::memset(b.data(), tag, b.size());
          if (rng() % 4 == 0) b.record_use(stream);
          live.emplace_back(std::move(b), tag);
        } else {
          const std::size_t k = rng() % live.size();
          auto& [b, tag] = live[k];
          const auto* p = static_cast<const std::uint8_t*>(b.data());
          for (std::size_t j = 0; j < b.size(); j += 61)
            if (p[j] != tag) {
              ++failures;  // another thread wrote into this block: blocks overlapped
              break;
            }
          live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
        }
      }
    });
  }
  for (auto& w : workers) w.join();
  EXPECT_EQ(failures.load(), 0);
  stream->synchronize();
  pool->synchronize_pending();
  const auto st = pool->stats();
  EXPECT_EQ(st.bytes_in_use, 0u);
  EXPECT_EQ(st.bytes_pending, 0u);
  EXPECT_EQ(st.allocations, st.frees);
  EXPECT_LE(st.peak_bytes_reserved, 256 * kMiB);
  EXPECT_GT(st.hit_rate(), 0.9);
  pool->check_invariants();
}

INSTANTIATE_TEST_SUITE_P(Backends, PoolTest,
                         ::testing::Values(BackendKind::Host, BackendKind::Cuda),
                         backend_param_name);

}  // namespace
}  // namespace reviva::test
