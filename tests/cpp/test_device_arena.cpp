// DeviceArena: buffers that grow by mapping granules in place, a limit never exceeded, memory
// given back only after the streams that used it (a gated stream proves the order: on the host
// backend unmapped memory faults), the reclaim hook when the device itself is full, and many
// threads mapping at once.
#include "test_util.h"

#include <reviva/device_arena.h>

#include <atomic>
#include <thread>

namespace reviva::test {
namespace {

class DeviceArenaTest : public BackendTest {
 protected:
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped()) return;
    if (backend_->vmm_granularity() == 0) GTEST_SKIP() << "no virtual memory management here";
    arena_ = DeviceArena::create(backend_);
    g_ = arena_->granularity();
    pool_ = PinnedHostPool::create(backend_, {});
    stream_ = std::make_shared<Stream>(backend_);
  }
  std::shared_ptr<DeviceArena> arena_;
  std::size_t g_ = 0;
  std::shared_ptr<PinnedHostPool> pool_;
  std::shared_ptr<Stream> stream_;
};

template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

TEST_P(DeviceArenaTest, GrowsInPlaceByGranulesAndKeepsContents) {
  auto buf = arena_->allocate(10 * g_ + 1, "kv");
  EXPECT_EQ(buf->capacity(), 11 * g_);
  EXPECT_EQ(buf->mapped_bytes(), 0u);
  void* base = buf->data();
  buf->grow_to(1);
  EXPECT_EQ(buf->mapped_bytes(), g_);
  const auto first = random_bytes(g_, 1);
  upload(*pool_, *stream_, buf->data(), first);
  buf->grow_to(3 * g_ + 5);  // two more granules (and one more for the 5 bytes)
  EXPECT_EQ(buf->data(), base) << "growing never moves the buffer";
  EXPECT_EQ(buf->mapped_bytes(), 4 * g_);
  const auto rest = random_bytes(3 * g_, 2);
  upload(*pool_, *stream_, static_cast<char*>(buf->data()) + g_, rest);
  EXPECT_EQ(download(*pool_, *stream_, buf->data(), g_), first);
  EXPECT_EQ(download(*pool_, *stream_, static_cast<char*>(buf->data()) + g_, 3 * g_), rest);
  buf->grow_to(2 * g_);  // smaller: nothing changes
  EXPECT_EQ(buf->mapped_bytes(), 4 * g_);
  DeviceArenaStats s = arena_->stats();
  EXPECT_EQ(s.mapped_bytes, 4 * g_);
  EXPECT_EQ(s.maps, 2u);
  EXPECT_EQ(s.buffers, 1u);
  EXPECT_NE(error_of([&] { buf->grow_to(12 * g_); }).find("exceed its capacity"),
            std::string::npos);
  buf->record_use(*stream_);
  buf.reset();
  arena_->reclaim(/*wait=*/true);
  s = arena_->stats();
  EXPECT_EQ(s.mapped_bytes, 0u);
  EXPECT_EQ(s.retiring_bytes, 0u);
  EXPECT_EQ(s.buffers, 0u);
  EXPECT_EQ(s.reserved_address_bytes, 0u);
  EXPECT_EQ(s.unmaps, 2u);
  EXPECT_EQ(s.peak_bytes, 4 * g_);
}

TEST_P(DeviceArenaTest, NeverMapsPastItsLimit) {
  arena_->set_limit_bytes(5 * g_);
  auto a = arena_->allocate(8 * g_, "a");
  auto b = arena_->allocate(8 * g_, "b");
  a->grow_to(3 * g_);
  const std::string e = error_of([&] { b->grow_to(3 * g_); });
  EXPECT_NE(e.find("cannot map"), std::string::npos) << e;
  EXPECT_NE(e.find("'b'"), std::string::npos) << e;
  EXPECT_NE(e.find("limit " + std::to_string(5 * g_)), std::string::npos) << e;
  EXPECT_EQ(b->mapped_bytes(), 0u) << "a refused mapping leaves the buffer as it was";
  EXPECT_FALSE(b->try_grow_to(3 * g_));
  EXPECT_TRUE(b->try_grow_to(2 * g_));
  EXPECT_EQ(arena_->stats().failed_maps, 2u);
  // Memory given back (even still retiring) makes room again once its streams pass.
  a->record_use(*stream_);
  a->release_memory();
  EXPECT_EQ(a->mapped_bytes(), 0u);
  EXPECT_TRUE(b->try_grow_to(5 * g_));
  EXPECT_LE(arena_->stats().peak_bytes, 5 * g_);
}

TEST_P(DeviceArenaTest, MemoryGoesBackOnlyAfterTheStreamsThatUsedIt) {
  auto buf = arena_->allocate(2 * g_, "gated");
  buf->grow_to(2 * g_);
  PinnedBlock src = pool_->allocate(2 * g_);
  fill_random(src.data(), 2 * g_, 3);
  StreamGate gate;
  gate.block(*stream_);
  // Queued behind the gate: writes into the buffer after the buffer object is gone.
  backend_->copy_async(buf->data(), src.data(), 2 * g_, stream_->handle());
  src.record_use(stream_);
  buf->record_use(*stream_);
  buf.reset();
  arena_->reclaim(/*wait=*/false);
  DeviceArenaStats s = arena_->stats();
  EXPECT_EQ(s.retiring_bytes, 2 * g_) << "unmapped while a stream still had to use it";
  EXPECT_EQ(s.mapped_bytes, 0u);
  gate.open();
  arena_->reclaim(/*wait=*/true);
  s = arena_->stats();
  EXPECT_EQ(s.retiring_bytes, 0u);
  EXPECT_EQ(s.reserved_address_bytes, 0u);
}

TEST_P(DeviceArenaTest, ManyThreadsMappingNeverOvershootTheLimit) {
  arena_->set_limit_bytes(16 * g_);
  std::atomic<int> refused{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < scaled(20); ++i) {
        auto buf = arena_->allocate(6 * g_, "t" + std::to_string(t));
        for (std::size_t k = 1; k <= 6; ++k)
          if (!buf->try_grow_to(k * g_)) ++refused;
      }
    });
  }
  for (auto& th : threads) th.join();
  arena_->reclaim(true);
  const DeviceArenaStats s = arena_->stats();
  EXPECT_LE(s.peak_bytes, 16 * g_);
  EXPECT_EQ(s.mapped_bytes, 0u);
  EXPECT_EQ(s.buffers, 0u);
  EXPECT_EQ(s.failed_maps, static_cast<std::uint64_t>(refused.load()));
}

TEST(DeviceArenaHost, AFullDeviceCallsTheReclaimHookThenFailsNamingTheNumbers) {
  HostBackendOptions o;
  o.simulated_device_bytes = 8 << 20;
  o.vmm_granularity = 1 << 20;
  auto backend = make_host_backend(o);
  auto stream = std::make_shared<Stream>(backend);
  // "Another allocator" holds 6 of the 8 MiB.
  void* other = backend->allocate_device(6 << 20, stream->handle());
  int calls = 0;
  DeviceArenaOptions ao;
  ao.reclaim = [&] {
    ++calls;
    if (other == nullptr) return false;
    backend->free_device(other, nullptr);
    other = nullptr;
    return true;
  };
  auto arena = DeviceArena::create(backend, ao);
  auto buf = arena->allocate(8 << 20, "kv");
  buf->grow_to(2 << 20);
  EXPECT_EQ(calls, 0);
  buf->grow_to(5 << 20);  // needs the other allocator's memory: the hook frees it
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(buf->mapped_bytes(), std::size_t{5} << 20);
  void* again = backend->allocate_device(3 << 20, stream->handle());
  const std::string e = error_of([&] { buf->grow_to(7 << 20); });
  EXPECT_EQ(calls, 2) << "the hook is asked once more, frees nothing";
  EXPECT_NE(e.find("cannot map"), std::string::npos) << e;
  EXPECT_NE(e.find("device arena"), std::string::npos) << e;
  EXPECT_EQ(buf->mapped_bytes(), std::size_t{5} << 20);
  EXPECT_EQ(arena->stats().reclaim_calls, 2u);
  backend->free_device(again, nullptr);
}

TEST(DeviceArenaHost, RefusesBadSizes) {
  auto arena = DeviceArena::create(make_host_backend());
  EXPECT_NE(error_of([&] { arena->allocate(0, "zero"); }).find("capacity must be > 0"),
            std::string::npos);
  EXPECT_NE(error_of([&] { arena->allocate(std::size_t{1} << 62, "huge"); }).find("exceeds"),
            std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Backends, DeviceArenaTest,
                         ::testing::Values(BackendKind::Host, BackendKind::Cuda),
                         backend_param_name);

}  // namespace
}  // namespace reviva::test
