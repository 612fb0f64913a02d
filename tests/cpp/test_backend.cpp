// Backend semantics both backends must share: stream order, events, waits, stream-ordered
// memory, errors.
#include "test_util.h"

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace reviva::test {
namespace {

using BackendSemantics = BackendTest;

TEST_P(BackendSemantics, NeverRecordedEventIsComplete) {
  Event e(backend_);
  EXPECT_TRUE(e.query());
  e.synchronize();  // must not block
}

TEST_P(BackendSemantics, EventCompletesWhenStreamReachesIt) {
  Stream s(backend_);
  Event e(backend_);
  StreamGate gate;
  gate.block(s);
  e.record(s);
  EXPECT_FALSE(e.query());
  gate.open();
  e.synchronize();
  EXPECT_TRUE(e.query());
}

TEST_P(BackendSemantics, StreamWaitsForEventOfAnotherStream) {
  Stream producer(backend_), consumer(backend_);
  PinnedHostPoolOptions po;
  auto pool = PinnedHostPool::create(backend_, po);
  const std::size_t n = 1 << 20;
  DeviceBuffer a(*backend_, producer, n), b(*backend_, producer, n);
  producer.synchronize();
  const auto data = random_bytes(n, 1);
  PinnedBlock src = pool->allocate(n);
  std::memcpy(src.data(), data.data(), n);

  StreamGate gate;
  gate.block(producer);
  backend_->copy_async(a.data(), src.data(), n, producer.handle());
  Event written(backend_);
  written.record(producer);
  consumer.wait(written);
  backend_->copy_async(b.data(), a.data(), n, consumer.handle());
  Event copied(backend_);
  copied.record(consumer);
  EXPECT_FALSE(copied.query());  // the consumer is held behind the gated producer
  gate.open();
  copied.synchronize();
  EXPECT_EQ(download(*pool, consumer, b.data(), n), data);
}

TEST_P(BackendSemantics, WorkOnOneStreamRunsInOrder) {
  Stream s(backend_);
  std::vector<int> order;
  std::mutex m;
  for (int i = 0; i < 100; ++i)
    s.launch_host_func([&, i] {
      std::lock_guard<std::mutex> lock(m);
      order.push_back(i);
    });
  s.synchronize();
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
}

TEST_P(BackendSemantics, TimingEventsMeasureElapsedTime) {
  Stream s(backend_);
  Event start(backend_, true), end(backend_, true);
  start.record(s);
  s.launch_host_func([] { std::this_thread::sleep_for(std::chrono::milliseconds(20)); });
  end.record(s);
  end.synchronize();
  const float ms = Event::elapsed_ms(start, end);
  EXPECT_GE(ms, 15.0f);
  EXPECT_LT(ms, 5000.0f);
}

TEST_P(BackendSemantics, ElapsedNeedsTimingEvents) {
  Stream s(backend_);
  Event a(backend_, false), b(backend_, false);
  a.record(s);
  b.record(s);
  s.synchronize();
  EXPECT_THROW(Event::elapsed_ms(a, b), InvalidArgument);
}

TEST_P(BackendSemantics, DeviceMemoryIsStreamOrderedAndCounted) {
  Stream s(backend_);
  const DeviceMemoryInfo before = backend_->device_memory_info();
  EXPECT_GT(before.total_bytes, 0u);
  void* p = backend_->allocate_device(1 << 20, s.handle());
  EXPECT_EQ(backend_->memory_kind(p), MemoryKind::Device);
  backend_->memset_async(p, 0x5a, 1 << 20, s.handle());
  backend_->free_device(p, s.handle());
  s.synchronize();
}

TEST_P(BackendSemantics, PinnedMemoryIsReportedPinned) {
  void* p = backend_->allocate_pinned_host(4096);
  EXPECT_EQ(backend_->memory_kind(p), MemoryKind::PinnedHost);
  EXPECT_EQ(backend_->memory_kind(static_cast<char*>(p) + 100), MemoryKind::PinnedHost);
  backend_->free_pinned_host(p);
}

TEST_P(BackendSemantics, ZeroSizedAllocationsAreRejected) {
  Stream s(backend_);
  EXPECT_THROW(backend_->allocate_pinned_host(0), InvalidArgument);
  EXPECT_THROW(backend_->allocate_device(0, s.handle()), InvalidArgument);
}

TEST_P(BackendSemantics, MovedStreamsAndEventsStayUsable) {
  Stream a(backend_);
  Stream b = std::move(a);
  EXPECT_EQ(a.handle(), nullptr);
  Event e(backend_);
  Event f = std::move(e);
  f.record(b);
  f.synchronize();
  EXPECT_TRUE(f.query());
}

INSTANTIATE_TEST_SUITE_P(Backends, BackendSemantics,
                         ::testing::Values(BackendKind::Host, BackendKind::Cuda),
                         backend_param_name);

TEST(BackendFactory, CudaDeviceOutOfRangeIsNamed) {
  if (!cuda_available()) {
    EXPECT_THROW(make_cuda_backend(0), Error);
    return;
  }
  try {
    make_cuda_backend(cuda_device_count() + 3);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("does not exist"), std::string::npos) << e.what();
  }
}

TEST(BackendFactory, DefaultBackendMatchesAvailability) {
  auto b = make_default_backend();
  EXPECT_EQ(b->kind(), cuda_available() ? BackendKind::Cuda : BackendKind::Host);
}

}  // namespace
}  // namespace reviva::test
