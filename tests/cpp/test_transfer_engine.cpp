// TransferEngine: bit-exact round trips of random data at many sizes (chunked and coalesced),
// ordering against producer events and within a direction, completion handles, statistics,
// input checks.
#include "test_util.h"

#include <chrono>
#include <thread>

namespace reviva::test {
namespace {

constexpr std::size_t kKiB = 1024;
constexpr std::size_t kMiB = 1024 * 1024;

class EngineTest : public BackendTest {
 protected:
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped()) return;
    pool_ = PinnedHostPool::create(backend_, {});
    TransferEngineOptions o;
    o.chunk_bytes = kMiB;  // small chunks, so that chunking is exercised at test sizes
    o.coalesce_below = 64 * kKiB;
    engine_ = std::make_unique<TransferEngine>(pool_, o);
    compute_ = std::make_unique<Stream>(backend_);
  }
  void TearDown() override {
    if (engine_) engine_->synchronize();
    engine_.reset();
  }
  std::shared_ptr<PinnedHostPool> pool_;
  std::unique_ptr<TransferEngine> engine_;
  std::unique_ptr<Stream> compute_;
};

TEST_P(EngineTest, RoundTripsRandomDataOfManySizesBitExactly) {
  const std::vector<std::size_t> sizes = {
      1,        3,    512,      4095,          64 * kKiB,    64 * kKiB + 3,
      kMiB - 1, kMiB, kMiB + 1, 5 * kMiB + 17, 33 * kMiB + 5};
  std::uint64_t seed = 7;
  for (std::size_t n : sizes) {
    SCOPED_TRACE("bytes=" + std::to_string(n));
    const auto data = random_bytes(n, ++seed);
    PinnedBlock src = pool_->allocate(n);
    std::memcpy(src.data(), data.data(), n);
    DeviceBuffer dev(*backend_, *compute_, n);
    compute_->synchronize();
    Transfer up = engine_->restore(src, dev.data(), n);
    PinnedBlock dst = pool_->allocate(n);
    std::memset(dst.data(), 0xcd, n);  // poison: every byte must be written
    Transfer down = [&] {
      up.enqueue_wait(engine_->stream(Direction::DeviceToHost));
      return engine_->offload(dev.data(), dst, n);
    }();
    down.wait();
    EXPECT_TRUE(down.ready());
    EXPECT_EQ(std::memcmp(dst.data(), data.data(), n), 0);
  }
  const TransferStats st = engine_->stats();
  EXPECT_EQ(st.h2d.transfers_completed, sizes.size());
  EXPECT_EQ(st.d2h.transfers_completed, sizes.size());
  std::size_t total = 0;
  for (std::size_t n : sizes) total += n;
  EXPECT_EQ(st.h2d.bytes_completed, total);
  EXPECT_EQ(st.d2h.bytes_completed, total);
  EXPECT_GT(st.h2d.chunks, sizes.size());  // the large ones were split
  EXPECT_GT(st.d2h.busy_ms, 0.0);
}

TEST_P(EngineTest, CoalescesManySmallCopiesIntoOneOperation) {
  std::mt19937 rng(99);
  const int count = scaled(2000);
  std::vector<std::size_t> sizes(count), offsets(count);
  std::size_t total = 0;
  for (int i = 0; i < count; ++i) {
    sizes[i] = 1 + rng() % 9000;
    offsets[i] = total + rng() % 3;  // unaligned starts too
    total = offsets[i] + sizes[i];
  }
  const auto data = random_bytes(total, 5);
  PinnedBlock src = pool_->allocate(total);
  std::memcpy(src.data(), data.data(), total);
  DeviceBuffer dev(*backend_, *compute_, total);
  backend_->memset_async(dev.data(), 0, total, compute_->handle());
  compute_->synchronize();

  std::vector<CopyRequest> up(count), down(count);
  PinnedBlock dst = pool_->allocate(total);
  std::memset(dst.data(), 0xee, total);
  for (int i = 0; i < count; ++i) {
    up[i] = {static_cast<char*>(dev.data()) + offsets[i],
             static_cast<const char*>(src.data()) + offsets[i], sizes[i]};
    down[i] = {static_cast<char*>(dst.data()) + offsets[i],
               static_cast<const char*>(dev.data()) + offsets[i], sizes[i]};
  }
  Transfer t_up = engine_->copy_batch(Direction::HostToDevice, up);
  Event uploaded(backend_);
  t_up.enqueue_wait(*compute_);
  uploaded.record(*compute_);
  Transfer t_down = engine_->copy_batch(Direction::DeviceToHost, down, &uploaded);
  t_down.wait();
  const auto* got = static_cast<const std::uint8_t*>(dst.data());
  for (int i = 0; i < count; ++i)
    ASSERT_EQ(std::memcmp(got + offsets[i], data.data() + offsets[i], sizes[i]), 0)
        << "segment " << i << " of " << sizes[i] << " bytes at " << offsets[i];
  const TransferStats st = engine_->stats();
  EXPECT_EQ(st.h2d.coalesced_requests, static_cast<std::uint64_t>(count));
  EXPECT_EQ(st.h2d.segment_launches, 1u);
  EXPECT_EQ(st.d2h.segment_launches, 1u);
  EXPECT_EQ(st.d2h.bytes_completed, [&] {
    std::size_t s = 0;
    for (auto n : sizes) s += n;
    return s;
  }());
}

TEST_P(EngineTest, MixedBatchOfSmallAndChunkedCopies) {
  const std::vector<std::size_t> sizes = {100, 3 * kMiB + 7, 2000, 128 * kKiB, 1};
  std::size_t total = 0;
  for (auto n : sizes) total += n;
  const auto data = random_bytes(total, 11);
  PinnedBlock src = pool_->allocate(total), dst = pool_->allocate(total);
  std::memcpy(src.data(), data.data(), total);
  DeviceBuffer dev(*backend_, *compute_, total);
  compute_->synchronize();
  std::vector<CopyRequest> up, down;
  std::size_t off = 0;
  for (auto n : sizes) {
    up.push_back({static_cast<char*>(dev.data()) + off, static_cast<char*>(src.data()) + off, n});
    down.push_back({static_cast<char*>(dst.data()) + off, static_cast<char*>(dev.data()) + off, n});
    off += n;
  }
  engine_->copy_batch(Direction::HostToDevice, up).wait();
  engine_->copy_batch(Direction::DeviceToHost, down).wait();
  EXPECT_EQ(std::memcmp(dst.data(), data.data(), total), 0);
  const auto st = engine_->stats();
  EXPECT_EQ(st.h2d.coalesced_requests, 3u);  // 100, 2000, 1 (128 KiB is above the threshold)
  EXPECT_EQ(st.h2d.chunks, 4u + 1u);         // 3 MiB + 7 in four chunks, and 128 KiB
}

TEST_P(EngineTest, CopyWaitsForTheProducerEvent) {
  // The compute stream overwrites the device buffer with B after a delay; an offload that names
  // the compute stream's event as producer must see B, never the older A.
  const std::size_t n = 2 * kMiB;
  const auto a = random_bytes(n, 21), b = random_bytes(n, 22);
  DeviceBuffer dev(*backend_, *compute_, n);
  upload(*pool_, *compute_, dev.data(), a);
  PinnedBlock b_host = pool_->allocate(n);
  std::memcpy(b_host.data(), b.data(), n);

  StreamGate gate;
  gate.block(*compute_);
  backend_->copy_async(dev.data(), b_host.data(), n, compute_->handle());
  Event produced(backend_);
  produced.record(*compute_);

  PinnedBlock out = pool_->allocate(n);
  Transfer t = engine_->offload(dev.data(), out, n, &produced);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(t.ready()) << "the copy ran before its producer";
  gate.open();
  t.wait();
  EXPECT_EQ(std::memcmp(out.data(), b.data(), n), 0);
}

TEST_P(EngineTest, TransfersInOneDirectionCompleteInOrder) {
  const std::size_t n = kMiB;
  const auto a = random_bytes(n, 31), b = random_bytes(n, 32);
  DeviceBuffer da(*backend_, *compute_, n), db(*backend_, *compute_, n);
  upload(*pool_, *compute_, da.data(), a);
  upload(*pool_, *compute_, db.data(), b);
  PinnedBlock out = pool_->allocate(n);
  StreamGate gate;
  gate.block(engine_->stream(Direction::DeviceToHost));
  Transfer first = engine_->offload(da.data(), out, n);
  Transfer second = engine_->offload(db.data(), out, n);
  EXPECT_FALSE(first.ready());
  EXPECT_FALSE(second.ready());
  gate.open();
  second.wait();
  EXPECT_TRUE(first.ready());  // FIFO on the copy stream
  EXPECT_EQ(std::memcmp(out.data(), b.data(), n), 0);
  EXPECT_LT(first.id(), second.id());
}

TEST_P(EngineTest, ComputeStreamWaitsOnRestore) {
  const std::size_t n = 4 * kMiB;
  const auto data = random_bytes(n, 41);
  PinnedBlock src = pool_->allocate(n);
  std::memcpy(src.data(), data.data(), n);
  DeviceBuffer dev(*backend_, *compute_, n), copy(*backend_, *compute_, n);
  compute_->synchronize();
  StreamGate gate;
  gate.block(engine_->stream(Direction::HostToDevice));
  Transfer t = engine_->restore(src, dev.data(), n);
  t.enqueue_wait(*compute_);  // rule 3: compute uses the block only after its H2D
  backend_->copy_async(copy.data(), dev.data(), n, compute_->handle());
  Event used(backend_);
  used.record(*compute_);
  EXPECT_FALSE(used.query());
  gate.open();
  used.synchronize();
  EXPECT_EQ(download(*pool_, *compute_, copy.data(), n), data);
}

TEST_P(EngineTest, WaitOnMeasuresHowLongComputeWaited) {
  const std::size_t n = kMiB;
  PinnedBlock src = pool_->allocate(n);
  DeviceBuffer dev(*backend_, *compute_, n);
  compute_->synchronize();
  // A transfer already done: compute does not wait (on the host backend, a loaded machine may
  // still show thread hand-over time between the two events: well under a millisecond).
  Transfer done = engine_->restore(src, dev.data(), n);
  done.wait();
  engine_->wait_on(done, *compute_);
  compute_->synchronize();
  TransferStats st = engine_->stats();
  const double noise_ms = st.compute_stall_ms;
  EXPECT_LT(noise_ms, 5.0);
  EXPECT_LE(st.stalls, 1u);
  // A transfer held back ~30 ms behind a gate: compute waits about that long.
  StreamGate gate;
  gate.block(engine_->stream(Direction::HostToDevice));
  Transfer late = engine_->restore(src, dev.data(), n);
  engine_->wait_on(late, *compute_);
  Event after(backend_);
  after.record(*compute_);
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_FALSE(after.query()) << "compute ran on before the transfer it waits for";
  gate.open();
  compute_->synchronize();
  st = engine_->stats();
  EXPECT_GE(st.stalls, 1u);
  EXPECT_GE(st.compute_stall_ms - noise_ms, 20.0);
  EXPECT_LT(st.overlap_ratio(), 1.0);
  EXPECT_DOUBLE_EQ(st.overlap_ratio(),
                   overlap_ratio(st.compute_stall_ms, st.d2h.busy_ms + st.h2d.busy_ms));
  engine_->reset_stats();
  EXPECT_EQ(engine_->stats().stalls, 0u);
}

TEST(OverlapRatio, IsOneDefinition) {
  EXPECT_DOUBLE_EQ(overlap_ratio(0.0, 0.0), 1.0);
  EXPECT_DOUBLE_EQ(overlap_ratio(5.0, 0.0), 1.0);
  EXPECT_DOUBLE_EQ(overlap_ratio(25.0, 100.0), 0.75);
  EXPECT_DOUBLE_EQ(overlap_ratio(200.0, 100.0), 0.0);
}

TEST_P(EngineTest, BothDirectionsAtOnce) {
  const std::size_t n = 8 * kMiB;
  const auto up_data = random_bytes(n, 51), down_data = random_bytes(n, 52);
  DeviceBuffer d_up(*backend_, *compute_, n), d_down(*backend_, *compute_, n);
  upload(*pool_, *compute_, d_down.data(), down_data);
  PinnedBlock src = pool_->allocate(n), dst = pool_->allocate(n);
  std::memcpy(src.data(), up_data.data(), n);
  for (int rep = 0; rep < scaled(4); ++rep) {
    Transfer a = engine_->restore(src, d_up.data(), n);
    Transfer b = engine_->offload(d_down.data(), dst, n);
    a.wait();
    b.wait();
  }
  EXPECT_EQ(std::memcmp(dst.data(), down_data.data(), n), 0);
  EXPECT_EQ(download(*pool_, *compute_, d_up.data(), n), up_data);
}

TEST_P(EngineTest, PinnedBlockIsNotReusedWhileItsCopyRuns) {
  const std::size_t n = kMiB;
  const auto data = random_bytes(n, 61);
  DeviceBuffer dev(*backend_, *compute_, n);
  upload(*pool_, *compute_, dev.data(), data);
  StreamGate gate;
  gate.block(engine_->stream(Direction::DeviceToHost));
  void* first;
  {
    PinnedBlock out = pool_->allocate(n);
    first = out.data();
    engine_->offload(dev.data(), out, n);
  }  // dropped while the copy is still queued
  PinnedBlock other = pool_->allocate(n);
  EXPECT_NE(other.data(), first);
  gate.open();
  engine_->synchronize();
}

TEST_P(EngineTest, RejectsBadRequestsNamingThem) {
  PinnedBlock block = pool_->allocate(1024);
  DeviceBuffer dev(*backend_, *compute_, 4096);
  compute_->synchronize();
  EXPECT_THROW(engine_->offload(dev.data(), block, 4096), InvalidArgument);
  EXPECT_THROW(engine_->copy(Direction::HostToDevice, nullptr, block.data(), 10), InvalidArgument);
  PinnedBlock empty;
  EXPECT_THROW(engine_->restore(empty, dev.data(), 10), InvalidArgument);
  Transfer none;
  EXPECT_THROW(none.wait(), InvalidArgument);
  if (GetParam() == BackendKind::Cuda) {
    std::vector<char> pageable(4096);
    try {
      engine_->copy(Direction::DeviceToHost, pageable.data(), dev.data(), 4096);
      FAIL() << "pageable memory accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("pageable"), std::string::npos) << e.what();
    }
  }
}

TEST_P(EngineTest, StatsCountBytesAndBusyTimePerDirection) {
  const std::size_t n = 3 * kMiB;
  DeviceBuffer dev(*backend_, *compute_, n);
  compute_->synchronize();
  PinnedBlock host = pool_->allocate(n);
  std::memset(host.data(), 1, n);
  engine_->restore(host, dev.data(), n).wait();
  engine_->restore(host, dev.data(), n).wait();
  engine_->offload(dev.data(), host, n).wait();
  auto st = engine_->stats();
  EXPECT_EQ(st.h2d.bytes_submitted, 2 * n);
  EXPECT_EQ(st.h2d.bytes_completed, 2 * n);
  EXPECT_EQ(st.d2h.bytes_completed, n);
  EXPECT_EQ(st.h2d.transfers_completed, 2u);
  EXPECT_GT(st.h2d.busy_ms, 0.0);
  EXPECT_GT(st.h2d.bandwidth_gbps(), 0.0);
  engine_->reset_stats();
  st = engine_->stats();
  EXPECT_EQ(st.h2d.bytes_completed, 0u);
  EXPECT_EQ(st.d2h.transfers_submitted, 0u);
}

INSTANTIATE_TEST_SUITE_P(Backends, EngineTest,
                         ::testing::Values(BackendKind::Host, BackendKind::Cuda),
                         backend_param_name);

}  // namespace
}  // namespace reviva::test

namespace reviva::test {
namespace {

using BackendSemanticsForEngine = BackendTest;

TEST_P(BackendSemanticsForEngine, ExternalStreamsAreUsedAndNotDestroyed) {
  auto pool = PinnedHostPool::create(backend_, {});
  Stream d2h(backend_), h2d(backend_);
  const std::size_t n = 1 << 20;
  const auto data = random_bytes(n, 71);
  PinnedBlock src = pool->allocate(n), dst = pool->allocate(n);
  std::memcpy(src.data(), data.data(), n);
  Stream compute(backend_);
  DeviceBuffer dev(*backend_, compute, n);
  compute.synchronize();
  {
    TransferEngineOptions o;
    o.d2h_stream = d2h.handle();
    o.h2d_stream = h2d.handle();
    TransferEngine engine(pool, o);
    EXPECT_EQ(engine.stream(Direction::DeviceToHost).handle(), d2h.handle());
    EXPECT_FALSE(engine.stream(Direction::HostToDevice).owned());
    engine.restore(src, dev.data(), n).enqueue_wait(engine.stream(Direction::DeviceToHost));
    engine.offload(dev.data(), dst, n).wait();
  }
  // The engine is gone; its streams, which it did not own, still work.
  Event e(backend_);
  e.record(d2h);
  e.record(h2d);
  h2d.synchronize();
  EXPECT_EQ(std::memcmp(dst.data(), data.data(), n), 0);
  TransferEngineOptions same;
  same.d2h_stream = same.h2d_stream = d2h.handle();
  EXPECT_THROW(TransferEngine(pool, same), InvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Backends, BackendSemanticsForEngine,
                         ::testing::Values(BackendKind::Host, BackendKind::Cuda),
                         backend_param_name);

}  // namespace
}  // namespace reviva::test
