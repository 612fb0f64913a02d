// OffloadManager's append blocks (Note [Append blocks]): device memory that grows with the
// contents, write-through to the host copy (so leaving the device copies nothing), fetches of the
// valid prefix alone, kept blocks that never leave, the budget counting growth, the lifetime
// rules with gated streams (a write-through waits for compute's write; a fetch waits for the
// last write-through), misuse named, and a randomized run against a shadow copy with the
// invariants checked after every operation. On the arena's allocator (grows in place) and on the
// backend's (allocates the capacity at once), on both backends.
#include "test_util.h"

#include <reviva/arena_device_allocator.h>

#include <chrono>
#include <map>
#include <random>
#include <thread>

namespace reviva::test {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
using std::chrono::milliseconds;

class AppendBlockTest : public BackendTest {
 protected:
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped()) return;
    if (backend_->vmm_granularity() == 0) GTEST_SKIP() << "no virtual memory management here";
    pool_ = PinnedHostPool::create(backend_, {});
    engine_ = std::make_shared<TransferEngine>(pool_);
    arena_ = DeviceArena::create(backend_);
    compute_ = std::make_unique<Stream>(backend_);
    make(64 * kMiB);
  }
  void TearDown() override {
    m_.reset();
    compute_.reset();
  }
  void make(std::size_t budget, bool grows = true) {
    m_.reset();
    std::shared_ptr<DeviceAllocator> alloc =
        grows ? std::shared_ptr<DeviceAllocator>(std::make_shared<ArenaDeviceAllocator>(arena_))
              : make_backend_device_allocator(backend_);
    OffloadManagerOptions o;
    o.budget_bytes = budget;
    m_ = std::make_unique<OffloadManager>(engine_, alloc, o);
  }
  // Writes `bytes` of `data` at `offset` of the acquired block at `p`, on compute (after a
  // synchronous staging copy), and tells the manager.
  void write(BlockId id, void* p, std::size_t offset, const std::vector<std::uint8_t>& data) {
    PinnedBlock staging = pool_->allocate(data.size());
    std::memcpy(staging.data(), data.data(), data.size());
    backend_->copy_async(static_cast<char*>(p) + offset, staging.data(), data.size(),
                         compute_->handle());
    staging.record_use(compute_ptr());
    m_->wrote(id, offset, data.size(), *compute_);
  }
  std::shared_ptr<const Stream> compute_ptr() {
    return std::shared_ptr<const Stream>(compute_.get(), [](const Stream*) {});
  }
  std::vector<std::uint8_t> read(BlockId id, std::size_t n) {
    void* p = m_->acquire(id, *compute_, Access::ReadOnly);
    auto got = download(*pool_, *compute_, p, n);
    m_->release(id, *compute_);
    return got;
  }
  const Stream& d2h() { return engine_->stream(Direction::DeviceToHost); }
  const Stream& h2d() { return engine_->stream(Direction::HostToDevice); }

  std::shared_ptr<PinnedHostPool> pool_;
  std::shared_ptr<TransferEngine> engine_;
  std::shared_ptr<DeviceArena> arena_;
  std::unique_ptr<Stream> compute_;
  std::unique_ptr<OffloadManager> m_;
};

std::vector<std::uint8_t> concat(std::vector<std::uint8_t> a, const std::vector<std::uint8_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST_P(AppendBlockTest, GrowsWithItsWritesLeavesWithoutACopyAndReturnsItsPrefix) {
  const std::size_t cap = 16 * kMiB;
  const BlockId id = m_->register_append_block(cap, "kv.0");
  EXPECT_EQ(m_->state(id), BlockState::Empty);
  EXPECT_EQ(m_->capacity(id), cap);
  EXPECT_EQ(m_->valid_bytes(id), 0u);
  const auto first = random_bytes(5 * kMiB / 2 + 3, 1);
  void* p = m_->acquire(id, *compute_);
  m_->grow(id, first.size());
  EXPECT_EQ(m_->device_bytes(), first.size()) << "the budget counts what was grown, no more";
  write(id, p, 0, first);
  EXPECT_EQ(m_->valid_bytes(id), first.size());
  EXPECT_EQ(m_->host_bytes(id), cap) << "the first write takes a host copy of the capacity";
  m_->release(id, *compute_);
  m_->offload(id);
  m_->synchronize();
  ManagerMetrics mm = m_->metrics();
  EXPECT_EQ(m_->state(id), BlockState::Host);
  EXPECT_EQ(m_->device_bytes(), 0u);
  EXPECT_EQ(mm.clean_evictions, 1u) << "written through: leaving copies nothing";
  EXPECT_EQ(mm.bytes_to_host, first.size()) << "only the write-through went to the host";
  EXPECT_EQ(mm.bytes_written_through, first.size());

  // Back with its prefix alone, then one more append.
  const auto second = random_bytes(kMiB + 7, 2);
  p = m_->acquire(id, *compute_);
  EXPECT_EQ(m_->device_bytes(), first.size()) << "fetched: its contents' bytes";
  m_->grow(id, first.size() + second.size());
  write(id, p, first.size(), second);
  m_->release(id, *compute_);
  m_->synchronize();
  mm = m_->metrics();
  EXPECT_EQ(mm.bytes_to_device, first.size()) << "the fetch copied the valid prefix alone";
  EXPECT_EQ(mm.bytes_written_through, first.size() + second.size())
      << "an append sends the appended range alone";
  m_->offload(id);
  m_->synchronize();
  EXPECT_EQ(m_->metrics().clean_evictions, 2u);
  EXPECT_EQ(read(id, first.size() + second.size()), concat(first, second));
  m_->check_invariants();
  m_->unregister(id);
  EXPECT_EQ(m_->device_bytes(), 0u);
}

TEST_P(AppendBlockTest, AWriteThroughWaitsForComputesWrite) {
  // Rule 1: the D2H that wrote() starts runs after the compute work queued before the call.
  const BlockId id = m_->register_append_block(8 * kMiB);
  const auto data = random_bytes(3 * kMiB, 3);
  void* p = m_->acquire(id, *compute_);
  m_->grow(id, data.size());
  StreamGate gate;
  gate.block(*compute_);
  write(id, p, 0, data);  // queued behind the gate
  m_->release(id, *compute_);
  std::this_thread::sleep_for(milliseconds(30));
  m_->poll();
  EXPECT_EQ(m_->metrics().bytes_to_host, 0u) << "the write-through ran before compute's write";
  gate.open();
  m_->offload(id);
  m_->synchronize();
  EXPECT_EQ(m_->state(id), BlockState::Host);
  EXPECT_EQ(read(id, data.size()), data) << "the host copy holds compute's write";
}

TEST_P(AppendBlockTest, AFetchWaitsForTheLastWriteThrough) {
  // Rule 4: a block evicted while its write-through is still queued comes back from a host copy
  // that holds that write (the H2D waits for the D2H), not from what was there before. On the
  // backend's allocator: the arena's would order the fetch after the free on the D2H stream
  // anyway (it reuses the freed buffer), hiding a missing wait.
  make(64 * kMiB, /*grows=*/false);
  const BlockId id = m_->register_append_block(8 * kMiB);
  const auto a = random_bytes(2 * kMiB, 4);
  const auto b = random_bytes(2 * kMiB, 5);
  void* p = m_->acquire(id, *compute_);
  m_->grow(id, a.size() + b.size());
  write(id, p, 0, a);
  compute_->synchronize();
  m_->synchronize();
  StreamGate gate;
  gate.block(d2h());
  write(id, p, a.size(), b);  // its D2H waits behind the gate
  m_->release(id, *compute_);
  m_->offload(id);  // clean: frees on the D2H stream, behind the gate too
  EXPECT_EQ(m_->state(id), BlockState::Host);
  void* q = m_->acquire(id, *compute_, Access::ReadOnly);
  PinnedBlock out = pool_->allocate(a.size() + b.size());
  backend_->copy_async(out.data(), q, out.size(), compute_->handle());
  Event used(backend_);
  used.record(*compute_);
  std::this_thread::sleep_for(milliseconds(30));
  EXPECT_FALSE(used.query()) << "the fetch ran before the write-through it needs";
  gate.open();
  used.synchronize();
  const auto* got = static_cast<const std::uint8_t*>(out.data());
  EXPECT_EQ(std::vector<std::uint8_t>(got, got + out.size()), concat(a, b));
  m_->release(id, *compute_);
}

TEST_P(AppendBlockTest, KeptBlocksStayGiveUpTheirHostCopyAndAreNeverVictims) {
  const std::size_t n = 4 * kMiB;
  make(10 * kMiB);
  const BlockId kept = m_->register_append_block(n, "kept");
  const auto data = random_bytes(n, 6);
  void* p = m_->acquire(kept, *compute_);
  m_->grow(kept, n);
  write(kept, p, 0, data);
  m_->release(kept, *compute_);
  m_->offload(kept);
  m_->synchronize();
  ASSERT_EQ(m_->state(kept), BlockState::Host);
  ASSERT_TRUE(m_->keep_resident(kept)) << "room for it: fetched now";
  EXPECT_TRUE(m_->kept(kept));
  EXPECT_EQ(m_->host_bytes(kept), 0u) << "its host copy is given back";
  m_->offload(kept);
  EXPECT_NE(m_->state(kept), BlockState::Host) << "offload() of a kept block is a no-op";
  const std::uint64_t through = m_->metrics().bytes_written_through;
  p = m_->acquire(kept, *compute_);
  m_->grow(kept, n);
  write(kept, p, 0, random_bytes(kMiB, 7));  // rewritten on the device alone
  m_->release(kept, *compute_);
  m_->synchronize();
  EXPECT_EQ(m_->metrics().bytes_written_through, through) << "a kept block wrote through";
  // Two more blocks of 4 MiB: the second finds no victim (the kept one never is).
  const BlockId x = m_->register_block(n, "x");
  const BlockId y = m_->register_block(n, "y");
  m_->acquire(x, *compute_, Access::WriteOnly);
  EXPECT_THROW(m_->acquire(y, *compute_, Access::WriteOnly), OutOfMemory);
  m_->release(x, *compute_);
  m_->acquire(y, *compute_, Access::WriteOnly);  // x is the victim
  m_->release(y, *compute_);
  EXPECT_EQ(m_->state(kept), BlockState::Device);
  m_->check_invariants();
}

TEST_P(AppendBlockTest, KeepingABlockThatCannotFitChangesNothing) {
  make(3 * kMiB);
  const BlockId id = m_->register_append_block(8 * kMiB);
  const BlockId other = m_->register_block(2 * kMiB);
  const auto data = random_bytes(2 * kMiB, 8);
  void* p = m_->acquire(id, *compute_);
  m_->grow(id, data.size());
  write(id, p, 0, data);
  m_->release(id, *compute_);
  m_->offload(id);
  m_->acquire(other, *compute_, Access::WriteOnly);  // pinned: no room for id beside it
  m_->synchronize();
  EXPECT_FALSE(m_->keep_resident(id));
  EXPECT_FALSE(m_->kept(id));
  EXPECT_EQ(m_->state(id), BlockState::Host);
  EXPECT_EQ(m_->host_bytes(id), 8 * kMiB);
  m_->release(other, *compute_);
  EXPECT_EQ(read(id, data.size()), data);
  m_->check_invariants();
}

TEST_P(AppendBlockTest, GrowthIsCountedAgainstTheBudgetAndRefusedPastIt) {
  make(6 * kMiB);
  const BlockId a = m_->register_block(3 * kMiB, "a");
  m_->acquire(a, *compute_, Access::WriteOnly);
  m_->release(a, *compute_);
  const BlockId id = m_->register_append_block(16 * kMiB, "kv");
  void* p = m_->acquire(id, *compute_);
  m_->grow(id, 5 * kMiB);  // a is evicted to make room
  m_->synchronize();
  EXPECT_EQ(m_->state(a), BlockState::Host);
  EXPECT_LE(m_->device_bytes(), 6 * kMiB);
  EXPECT_THROW(m_->grow(id, 7 * kMiB), OutOfMemory);
  EXPECT_EQ(m_->device_bytes(), 5 * kMiB) << "a refused growth changed the account";
  write(id, p, 0, random_bytes(5 * kMiB, 9));
  EXPECT_THROW(m_->wrote(id, 0, 6 * kMiB, *compute_), InvalidArgument) << "beyond what is backed";
  m_->release(id, *compute_);
  m_->check_invariants();
}

TEST_P(AppendBlockTest, SettleWaitsForTheBlocksOwnCopyAlone) {
  const BlockId id = m_->register_append_block(4 * kMiB);
  void* p = m_->acquire(id, *compute_);
  m_->grow(id, kMiB);
  write(id, p, 0, random_bytes(kMiB, 12));
  m_->release(id, *compute_);
  m_->offload(id);
  m_->synchronize();
  StreamGate gate;
  gate.block(h2d());
  ASSERT_TRUE(m_->prefetch(id));
  EXPECT_EQ(m_->state(id), BlockState::ToDevice);
  std::thread opener([&] {
    std::this_thread::sleep_for(milliseconds(50));
    gate.open();
  });
  const auto start = std::chrono::steady_clock::now();
  m_->settle(id);
  EXPECT_GE(std::chrono::steady_clock::now() - start, milliseconds(40)) << "did not wait";
  EXPECT_EQ(m_->state(id), BlockState::Device);
  opener.join();
  m_->settle(id);  // nothing in flight: returns at once
}

TEST_P(AppendBlockTest, APrefetchWithoutMemoryIsSkippedAndCounted) {
  // Room under the budget, but the arena can map nothing more: the prefetch is skipped (false),
  // counted, changes nothing, and the acquire fetches the block once memory is there.
  const BlockId a = m_->register_append_block(4 * kMiB, "a");
  const BlockId b = m_->register_append_block(4 * kMiB, "b");
  const auto data = random_bytes(kMiB, 13);
  for (BlockId id : {a, b}) {
    void* p = m_->acquire(id, *compute_);
    m_->grow(id, data.size());
    write(id, p, 0, data);
    m_->release(id, *compute_);
    m_->offload(id);
  }
  m_->synchronize();
  m_->acquire(a, *compute_, Access::ReadOnly);  // takes the one mapped buffer
  arena_->set_limit_bytes(arena_->stats().mapped_bytes);
  EXPECT_FALSE(m_->prefetch(b));
  EXPECT_EQ(m_->state(b), BlockState::Host);
  EXPECT_EQ(m_->metrics().prefetches_without_memory, 1u);
  m_->release(a, *compute_);
  m_->offload(a);  // its buffer goes back to the allocator's cache
  m_->synchronize();
  EXPECT_EQ(read(b, data.size()), data) << "fetched into the memory a left";
  m_->check_invariants();
}

TEST_P(AppendBlockTest, MisuseIsNamed) {
  const BlockId id = m_->register_append_block(4 * kMiB, "kv.3");
  const BlockId fixed = m_->register_block(kMiB, "w");
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { m_->grow(id, kMiB); }).find("not acquired"), std::string::npos);
  EXPECT_NE(message([&] { m_->wrote(id, 0, 1, *compute_); }).find("not acquired"),
            std::string::npos);
  m_->acquire(id, *compute_);
  EXPECT_NE(message([&] { m_->grow(id, 5 * kMiB); }).find("capacity"), std::string::npos);
  m_->grow(id, 2 * kMiB);
  EXPECT_NE(message([&] { m_->wrote(id, 10, 1, *compute_); }).find("gap"), std::string::npos);
  m_->acquire(fixed, *compute_, Access::WriteOnly);
  EXPECT_NE(message([&] { m_->grow(fixed, kMiB); }).find("not an append block"), std::string::npos);
  EXPECT_NE(message([&] { m_->wrote(fixed, 0, 1, *compute_); }).find("not an append block"),
            std::string::npos);
  EXPECT_NE(message([&] { m_->keep_resident(fixed); }).find("not an append block"),
            std::string::npos);
  m_->release(fixed, *compute_);
  m_->release(id, *compute_);
}

TEST_P(AppendBlockTest, AnAllocatorThatCannotGrowGetsTheCapacityAtOnce) {
  make(64 * kMiB, /*grows=*/false);
  const BlockId id = m_->register_append_block(6 * kMiB);
  const auto data = random_bytes(kMiB, 10);
  void* p = m_->acquire(id, *compute_);
  EXPECT_EQ(m_->device_bytes(), 6 * kMiB) << "the capacity, counted";
  m_->grow(id, 6 * kMiB);  // already backed
  write(id, p, 0, data);
  m_->release(id, *compute_);
  m_->offload(id);
  m_->synchronize();
  EXPECT_EQ(m_->metrics().clean_evictions, 1u);
  EXPECT_EQ(read(id, data.size()), data);
  EXPECT_EQ(m_->metrics().bytes_to_device, data.size()) << "the fetch copied the prefix alone";
}

TEST_P(AppendBlockTest, RandomAppendsEvictionsKeepsAndDiscardsMatchAShadowCopy) {
  // Several append blocks and a fixed one under a budget of about three blocks: random appends
  // (acquire, grow, write, release), offloads, prefetches, keeps and discards; the copy streams
  // stalled now and then. After every operation the invariants hold, and every block read back
  // equals its shadow.
  const std::size_t cap = 3 * kMiB;
  make(9 * kMiB + kMiB / 2);
  std::mt19937_64 rng(GetParam() == BackendKind::Host ? 11 : 12);
  std::vector<BlockId> ids;
  std::map<BlockId, std::vector<std::uint8_t>> shadow;
  for (int i = 0; i < 5; ++i) {
    ids.push_back(m_->register_append_block(cap, "kv." + std::to_string(i)));
    shadow[ids.back()] = {};
  }
  int kept = 0;
  const int steps = scaled(400);
  for (int step = 0; step < steps; ++step) {
    const BlockId id = ids[rng() % ids.size()];
    auto& sh = shadow[id];
    const int op = static_cast<int>(rng() % 10);
    if (rng() % 8 == 0) {
      const Stream& s = rng() % 2 ? d2h() : h2d();
      s.launch_host_func([] { std::this_thread::sleep_for(std::chrono::microseconds(300)); });
    }
    if (op < 5) {  // append
      if (sh.size() == cap) continue;
      const std::size_t n = 1 + rng() % std::min<std::size_t>(cap - sh.size(), kMiB);
      const auto data = random_bytes(n, rng());
      void* p = nullptr;
      try {
        p = m_->acquire(id, *compute_);
        m_->grow(id, sh.size() + n);
      } catch (const OutOfMemory&) {  // every other block kept or held: skip
        if (p) m_->release(id, *compute_);
        continue;
      }
      write(id, p, sh.size(), data);
      m_->release(id, *compute_);
      sh.insert(sh.end(), data.begin(), data.end());
    } else if (op == 5) {
      m_->offload(id);
    } else if (op == 6) {
      m_->prefetch(id);
    } else if (op == 7 && kept < 2 && !m_->kept(id)) {
      kept += m_->keep_resident(id) ? 1 : 0;
    } else if (op == 8 && !m_->kept(id)) {
      m_->discard(id);
      sh.clear();
    } else if (!sh.empty()) {
      void* p = nullptr;
      try {
        p = m_->acquire(id, *compute_, Access::ReadOnly);
      } catch (const OutOfMemory&) {
        continue;
      }
      const auto got = download(*pool_, *compute_, p, sh.size());
      m_->release(id, *compute_);
      ASSERT_EQ(got, sh) << "block " << id << " at step " << step;
    }
    m_->check_invariants();
    ASSERT_EQ(m_->valid_bytes(id), sh.size());
  }
  m_->synchronize();
  m_->check_invariants();
  for (BlockId id : ids) m_->unregister(id);
  EXPECT_EQ(m_->device_bytes(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Backends, AppendBlockTest,
                         ::testing::Values(BackendKind::Host, BackendKind::Cuda),
                         backend_param_name);

}  // namespace
}  // namespace reviva::test
