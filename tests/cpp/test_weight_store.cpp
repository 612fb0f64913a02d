// WeightStore: a decoder's weights in pinned host memory, resident layers held on the device and
// the others streamed ahead of use. Every use reads exactly the bytes written into the layer's
// host copy; streamed layers come in once per pass, ahead of use, and leave without a copy;
// residency changes between calls; an arena that cannot hold the resident layers leaves the store
// usable; misuse is refused naming the values.
#include "test_util.h"

#include <algorithm>
#include <chrono>
#include <thread>

namespace reviva::test {
namespace {

struct WeightRig {
  WeightRig(std::shared_ptr<Backend> b, std::vector<std::size_t> sizes, std::size_t arena_limit = 0,
            std::size_t slot_bytes = 0, std::size_t timeline = 0,
            std::vector<WeightView> views = {})
      : backend(std::move(b)) {
    pool = PinnedHostPool::create(backend, {});
    staging = PinnedHostPool::create(backend, {});
    engine = std::make_shared<TransferEngine>(pool);
    DeviceArenaOptions ao;
    ao.limit_bytes = arena_limit;
    arena = DeviceArena::create(backend, ao);
    compute = std::make_shared<Stream>(backend);
    WeightStoreOptions o;
    o.layer_bytes = sizes;
    o.slot_bytes = slot_bytes;
    o.timeline_capacity = timeline;
    o.views = views;
    store = std::make_unique<WeightStore>(engine, arena, o);
    for (std::size_t l = 0; l < sizes.size(); ++l) {
      weights.push_back(random_bytes(sizes[l], 31 + static_cast<int>(l)));
      std::memcpy(store->host_data(static_cast<int>(l)), weights.back().data(),
                  weights.back().size());
    }
    for (const WeightView& v : views) {  // (a view's bytes are its range of the layer's)
      const auto& of = weights[static_cast<std::size_t>(v.of)];
      const auto at = of.begin() + static_cast<std::ptrdiff_t>(v.offset);
      weights.emplace_back(at, at + static_cast<std::ptrdiff_t>(v.bytes));
    }
  }

  ~WeightRig() {
    store.reset();
    compute->synchronize();
  }

  // One pass over every layer (a decode step): compute reads each layer's weights after acquire
  // (the fill must have landed: rule 3) and before release (its memory is reused only after: rule
  // 2), with compute held behind a gate until the layer is released.
  void pass() {
    std::vector<int> all;
    for (int l = 0; l < store->num_layers(); ++l) all.push_back(l);
    pass(all);
  }

  void pass(const std::vector<int>& layers) {
    for (int l : layers) {
      void* ptr = store->acquire(l, *compute);
      const std::size_t n = store->layer_bytes(l);
      PinnedBlock block = staging->allocate(n);
      StreamGate gate;
      gate.block(*compute);
      backend->copy_async(block.data(), ptr, n, compute->handle());
      block.record_use(compute);
      store->release(l, *compute);
      gate.open();
      compute->synchronize();
      const auto* p = static_cast<const std::uint8_t*>(block.data());
      ASSERT_EQ(std::vector<std::uint8_t>(p, p + n), weights[static_cast<std::size_t>(l)])
          << "layer " << l;
    }
  }

  std::shared_ptr<Backend> backend;
  std::shared_ptr<PinnedHostPool> pool, staging;
  std::shared_ptr<TransferEngine> engine;
  std::shared_ptr<DeviceArena> arena;
  std::shared_ptr<Stream> compute;
  std::unique_ptr<WeightStore> store;
  std::vector<std::vector<std::uint8_t>> weights;  // [layer]
};

// Layer sizes in the arena's mapping granules (the host backend's and CUDA's differ), so that
// the device bounds below are exact: a layer's buffer is a whole number of granules.
std::vector<std::size_t> layer_sizes(const std::shared_ptr<Backend>& backend) {
  const std::size_t g = DeviceArena::create(backend, {})->granularity();
  return {g * 6 / 10, g, g * 3 / 4, g, g * 45 / 100, g, g};
}

std::size_t rig_granule(const std::shared_ptr<Backend>& backend) {
  return DeviceArena::create(backend, {})->granularity();
}

std::size_t total(const std::vector<std::size_t>& sizes, const std::vector<int>& layers) {
  std::size_t n = 0;
  for (int l : layers) n += sizes[static_cast<std::size_t>(l)];
  return n;
}

class WeightStoreTest : public BackendTest {};

// What `f` throws as InvalidArgument ("no exception" when it returns).
template <typename F>
std::string message(F&& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return std::string(e.what());
  }
  return std::string("no exception");
}

TEST_P(WeightStoreTest, ResidentAndStreamedLayersReadTheirWeightsExactly) {
  const std::vector<std::size_t> kSizes = layer_sizes(backend_);
  WeightRig rig(backend_, kSizes);
  rig.store->set_residency({1, 4}, 3, 2, *rig.compute);
  const int passes = scaled(8);
  for (int s = 0; s < passes; ++s) rig.pass();
  rig.store->synchronize();
  const WeightStoreStats st = rig.store->stats();
  EXPECT_EQ(st.resident_layers, 2);
  EXPECT_EQ(st.streamed_layers, 5);
  EXPECT_EQ(st.slots, 3);
  EXPECT_EQ(st.prefetch_layers, 2);
  EXPECT_EQ(st.resident_bytes, kSizes[1] + kSizes[4]);
  EXPECT_EQ(st.host_bytes, total(kSizes, {0, 1, 2, 3, 4, 5, 6}));
  // Each streamed layer comes in once a pass; the last pass's window wraps into the next (2
  // layers); the resident ones once.
  const std::size_t streamed = total(kSizes, {0, 2, 3, 5, 6});
  EXPECT_EQ(st.bytes_to_device, streamed * static_cast<std::size_t>(passes) + kSizes[0] +
                                    kSizes[2] + kSizes[1] + kSizes[4]);
  EXPECT_EQ(st.fills, 5u * static_cast<std::size_t>(passes) + 2 + 2);
  // Only the resident ones were not prefetched (the first streamed layers are, at
  // set_residency).
  EXPECT_EQ(st.fills - st.prefetched_fills, 2u);
  EXPECT_EQ(st.bytes_to_host, 0u) << "weights leave the device without a copy";
  EXPECT_LE(st.peak_device_bytes, (2 + 3) * rig.arena->granularity())
      << "the resident layers and 3 slots";
}

TEST_P(WeightStoreTest, OneSlotWithAWindowOfOnePrefetchesIntoTheMemoryJustReleased) {
  // The planner's usual pick: one slot. Each streamed layer's fill is started at the release of
  // the one before it (into its memory, after compute's read of it: pass() holds compute behind
  // a gate across the release, and checks what compute read), so every fill but the very first
  // is a prefetch, across passes too.
  const std::vector<std::size_t> kSizes = layer_sizes(backend_);
  WeightRig rig(backend_, kSizes);
  rig.store->set_residency({1, 4}, 1, 1, *rig.compute);
  const int passes = scaled(6);
  for (int s = 0; s < passes; ++s) rig.pass();
  rig.store->synchronize();
  const WeightStoreStats st = rig.store->stats();
  const std::size_t streamed = total(kSizes, {0, 2, 3, 5, 6});
  // the last pass's release of layer 6 brought layer 0 of the next in
  EXPECT_EQ(st.bytes_to_device,
            streamed * static_cast<std::size_t>(passes) + kSizes[0] + kSizes[1] + kSizes[4]);
  EXPECT_EQ(st.fills - st.prefetched_fills, 2u) << "the 2 resident (the first streamed layer is "
                                                   "prefetched at set_residency)";
  EXPECT_LE(st.peak_device_bytes, (2 + 1) * rig.arena->granularity()) << "2 resident, 1 slot";
}

TEST_P(WeightStoreTest, LayersInTwoPartsShareOneSlotOfAWholeLayer) {
  // Note [Layers in parts] (python/reviva/weights/packing.py): 4 layers of a small part (1 granule)
  // then a large one (3), one slot of a whole layer (4 granules) and a window of one block. The
  // next part's copy goes into the memory its predecessor just freed: every fill but the first is a
  // prefetch, and the store never holds more than one layer's bytes (two slots of the largest block
  // would be 6).
  const std::size_t g = DeviceArena::create(backend_, {})->granularity();
  std::vector<std::size_t> sizes;
  for (int l = 0; l < 4; ++l) {
    sizes.push_back(g);
    sizes.push_back(3 * g);
  }
  WeightRig rig(backend_, sizes, 0, 4 * g);
  rig.store->set_residency({}, 1, 1, *rig.compute);
  const int passes = scaled(5);
  for (int s = 0; s < passes; ++s) rig.pass();
  rig.store->synchronize();
  const WeightStoreStats st = rig.store->stats();
  EXPECT_EQ(st.fills - st.prefetched_fills, 0u)
      << "every block prefetched (the first layer's at set_residency)";
  EXPECT_LE(st.peak_device_bytes, 4 * g) << "one slot of a whole layer";
  EXPECT_EQ(st.bytes_to_host, 0u);
}

TEST_P(WeightStoreTest, ASlotLoweredToTwoConsecutiveBlocksHoldsNoMoreThanThem) {
  // Note [Layers in parts] (python/reviva/weights/packing.py): layers of a small block (1 granule)
  // then three larger ones (2 each), as a decoder layer's attention then its MLP's three
  // projections. A prefill takes a whole layer at once (a slot of 7 granules); a decode step takes
  // one block at a time, so the slot is lowered to two blocks of the largest (4), every streamed
  // block's buffer of that one size: the store then maps no more than that (with each block in its
  // own size, a 1-granule buffer cached beside two of 2 made 5), every fill after the change is a
  // prefetch, and each use reads its exact bytes.
  const std::size_t g = DeviceArena::create(backend_, {})->granularity();
  std::vector<std::size_t> sizes;
  for (int l = 0; l < 4; ++l) {
    sizes.push_back(g);
    for (int k = 0; k < 3; ++k) sizes.push_back(2 * g);
  }
  WeightRig rig(backend_, sizes, 0, 7 * g);
  rig.store->set_residency({}, 1, 1, *rig.compute);
  rig.pass();
  EXPECT_EQ(rig.store->slot_bytes(), 7 * g);
  rig.store->set_slot_bytes(4 * g, 2 * g);
  EXPECT_EQ(rig.store->slot_bytes(), 4 * g);
  const WeightStoreStats before = rig.store->stats();
  EXPECT_LE(before.device_bytes, 2 * g) << "what was held beyond the new slot went back";
  std::size_t most = 0;
  const int passes = scaled(5);
  for (int s = 0; s < passes; ++s) {
    rig.pass();
    most = std::max(most, rig.store->stats().device_bytes);
  }
  rig.store->synchronize();
  const WeightStoreStats st = rig.store->stats();
  EXPECT_LE(most, 4 * g) << "the store maps no more than two consecutive blocks (live and cached)";
  EXPECT_EQ(st.fills - st.prefetched_fills, before.fills - before.prefetched_fills)
      << "every fill after the change prefetched";
  EXPECT_EQ(st.bytes_to_host, 0u);
  // Raised again (the next call's prefill), a whole layer is held at once.
  rig.store->set_slot_bytes(7 * g);
  for (int l = 0; l < 4; ++l) rig.store->acquire(l, *rig.compute);
  for (int l = 0; l < 4; ++l) rig.store->release(l, *rig.compute);
  rig.pass();
}

TEST_P(WeightStoreTest, TheFirstStreamedLayerIsCopiedBeforeTheResidentOnes) {
  // The copy stream is FIFO: the call's first layer (streamed) must not wait behind resident
  // layers' fills. set_residency queues the cycle's first streamed layers (as many as the slots
  // hold) before the resident layers near the start (Note [Resident fills as compute nears]).
  const std::vector<std::size_t> kSizes = layer_sizes(backend_);
  WeightRig rig(backend_, kSizes, 0, 0, 64);
  rig.store->set_residency({1, 2}, 1, 1, *rig.compute);
  rig.store->synchronize();
  std::vector<TimelineEvent> copies;
  for (const TimelineEvent& e : rig.store->timeline())
    if (e.kind == TimelineKind::CopyToDevice) copies.push_back(e);
  ASSERT_EQ(copies.size(), 3u) << "layer 0 (streamed), then the resident layers 1 and 2";
  std::sort(copies.begin(), copies.end(),
            [](const TimelineEvent& a, const TimelineEvent& b) { return a.start_ms < b.start_ms; });
  EXPECT_EQ(copies[0].bytes, kSizes[0]);
  EXPECT_EQ(copies[1].bytes + copies[2].bytes, kSizes[1] + kSizes[2]);
  rig.pass();  // layer 0 found on the device: its acquire is no fill of its own
  rig.store->synchronize();
  const WeightStoreStats st = rig.store->stats();
  EXPECT_EQ(st.fills - st.prefetched_fills, 2u) << "the 2 resident layers only";
}

TEST_P(WeightStoreTest, AResidentLayersFillIsIssuedAsComputeComesNearIt) {
  // Note [Resident fills as compute nears]: a process's first call loads each kernel at its
  // first launch, and a load waits for the copies in flight; set_residency queued every resident
  // fill (the H200, 32B shape at 60c6625: HF's first kernel of call 1 waited 0.26 s for ~15.6
  // GB of them). A resident layer's fill is issued when compute acquires a layer within two
  // whole layers' bytes before it; its memory is mapped at set_residency all the same.
  const std::vector<std::size_t> kSizes = layer_sizes(backend_);  // 0.6, 1, .75, 1, .45, 1, 1 g
  const std::size_t g = rig_granule(backend_);
  WeightRig rig(backend_, kSizes);
  rig.store->set_residency({1, 5, 6}, 1, 1, *rig.compute);
  rig.store->synchronize();
  WeightStoreStats st = rig.store->stats();
  EXPECT_EQ(st.bytes_to_device, kSizes[0] + kSizes[1]) << "layer 0 (streamed) and 1 (near)";
  EXPECT_NO_THROW(rig.store->resident_data(1));
  EXPECT_THROW(rig.store->resident_data(5), InvalidArgument) << "its fill is not issued yet";
  // (the streamed layer 0 may take one of the buffers mapped for them from the allocator's cache)
  EXPECT_GE(st.device_bytes, 3 * g) << "the 3 resident layers' memory is mapped already";
  for (int l = 0; l < 3; ++l) {  // (layer 2 starts 2.2 whole layers before layer 5)
    rig.store->acquire(l, *rig.compute);
    rig.store->release(l, *rig.compute);
  }
  rig.store->synchronize();
  EXPECT_THROW(rig.store->resident_data(5), InvalidArgument);
  rig.store->acquire(3, *rig.compute);  // 1.45 layers before layer 5 and 2.45 before 6
  rig.store->release(3, *rig.compute);
  EXPECT_NO_THROW(rig.store->resident_data(5));
  EXPECT_THROW(rig.store->resident_data(6), InvalidArgument);
  rig.store->acquire(4, *rig.compute);
  rig.store->release(4, *rig.compute);
  EXPECT_NO_THROW(rig.store->resident_data(6));
  rig.store->acquire(5, *rig.compute);
  rig.store->release(5, *rig.compute);
  rig.store->acquire(6, *rig.compute);
  rig.store->release(6, *rig.compute);
  rig.pass();
  rig.pass();  // exact bytes: each acquire orders compute after the layer's fill
  rig.store->synchronize();
  st = rig.store->stats();
  EXPECT_EQ(st.fills - st.prefetched_fills, 3u) << "one fill per resident layer, ever";
  EXPECT_LE(st.peak_device_bytes, 4 * g) << "the 3 resident layers and one slot";
}

TEST_P(WeightStoreTest, AFarResidentLayerIsFilledAtItsOwnAcquire) {
  // A layer acquired out of order (a decode graph captured ahead of prefill's later layers reads
  // a resident layer early) gets its fill then.
  const std::vector<std::size_t> kSizes = layer_sizes(backend_);
  WeightRig rig(backend_, kSizes);
  rig.store->set_residency({6}, 1, 1, *rig.compute);
  EXPECT_THROW(rig.store->resident_data(6), InvalidArgument);
  void* at = rig.store->acquire(6, *rig.compute);
  rig.store->release(6, *rig.compute);
  EXPECT_EQ(rig.store->resident_data(6), at);
  rig.pass();
}

TEST_P(WeightStoreTest, ComputeIsNotOrderedAfterTheResidentFillsUntilItAcquiresThem) {
  // set_residency queues the resident layers' fills; compute must not wait for them until it
  // acquires such a layer: a call's first synchronization (a token id check, a small copy)
  // waited behind ~15.6 GB of them on the H200 (32B shape, 0.27 s of call 1, 10ddabe).
  const std::vector<std::size_t> kSizes = layer_sizes(backend_);
  WeightRig rig(backend_, kSizes);
  StreamGate copies;  // the copy stream held: no fill can land
  copies.block(rig.engine->stream(Direction::HostToDevice));
  rig.store->set_residency({1, 4}, 1, 1, *rig.compute);
  void* layer1 = rig.store->resident_data(1);  // (its address is known before its fill lands)
  EXPECT_NE(rig.store->buffer(1), nullptr);
  Event mark(backend_);
  mark.record(*rig.compute);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!mark.query() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const bool free_to_run = mark.query();
  copies.open();
  EXPECT_TRUE(free_to_run) << "compute waits for fills it has not acquired";
  EXPECT_EQ(rig.store->acquire(1, *rig.compute), layer1);
  rig.store->release(1, *rig.compute);
  rig.pass();  // an acquire of a resident layer orders compute after its fill: exact bytes
}

TEST_P(WeightStoreTest, SlotBytesSmallerThanALayerAreRefused) {
  const std::vector<std::size_t> kSizes = layer_sizes(backend_);
  try {
    WeightRig rig(backend_, kSizes, 0, 1000);
    ADD_FAILURE() << "a slot of 1000 bytes was taken";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("slot_bytes 1000"), std::string::npos) << e.what();
  }
}

TEST_P(WeightStoreTest, EveryMixOfResidentAndStreamedLayers) {
  const std::vector<std::size_t> kSizes = layer_sizes(backend_);
  for (const std::vector<int>& resident :
       {std::vector<int>{}, std::vector<int>{0, 1, 2, 3, 4, 5, 6}, std::vector<int>{6},
        std::vector<int>{0, 2, 4, 6}}) {
    WeightRig rig(backend_, kSizes);
    const bool streams = resident.size() < kSizes.size();
    rig.store->set_residency(resident, streams ? 2 : 0, streams ? 1 : 0, *rig.compute);
    for (int s = 0; s < 3; ++s) rig.pass();
    rig.store->synchronize();
    const WeightStoreStats st = rig.store->stats();
    EXPECT_EQ(st.resident_layers, static_cast<int>(resident.size()));
    EXPECT_EQ(st.bytes_to_host, 0u);
    if (!streams) {
      EXPECT_EQ(st.bytes_to_device, st.resident_bytes) << "one fill each, ever";
    }
  }
}

TEST_P(WeightStoreTest, ResidencyChangesBetweenCallsAndTrimGivesTheSlotsBack) {
  const std::vector<std::size_t> kSizes = layer_sizes(backend_);
  WeightRig rig(backend_, kSizes);
  rig.store->set_residency({}, 2, 1, *rig.compute);
  rig.pass();
  rig.store->set_residency({0, 1, 2}, 2, 1, *rig.compute);
  rig.pass();
  rig.pass();
  rig.store->trim();
  rig.store->synchronize();
  rig.arena->reclaim(true);
  WeightStoreStats st = rig.store->stats();
  EXPECT_EQ(st.resident_layers, 3);
  const std::size_t granule = rig.arena->granularity();
  EXPECT_EQ(st.device_bytes, 3 * granule) << "only the resident layers stay";
  rig.store->set_residency({5}, 2, 1, *rig.compute);  // 0-2 leave, 5 comes
  rig.pass();
  rig.store->trim();
  rig.store->synchronize();
  st = rig.store->stats();
  EXPECT_EQ(st.resident_bytes, kSizes[5]);
  EXPECT_EQ(st.device_bytes, granule);
  EXPECT_EQ(st.bytes_to_host, 0u);
}

TEST_P(WeightStoreTest, AnArenaTooSmallForTheResidentLayersLeavesTheStoreUsable) {
  const std::vector<std::size_t> kSizes = layer_sizes(backend_);
  const std::size_t granule = DeviceArena::create(backend_, {})->granularity();
  WeightRig rig(backend_, kSizes, 4 * granule);  // room for 4 of the 7 layers
  EXPECT_THROW(rig.store->set_residency({0, 1, 2, 3, 4, 5, 6}, 0, 0, *rig.compute), OutOfMemory);
  EXPECT_EQ(rig.store->stats().resident_layers, 0);
  rig.store->set_residency({1}, 2, 1, *rig.compute);
  rig.pass();
  rig.pass();
}

// Note [Blocks within a block]: two layers of attention and experts (4 experts: a gate_up view
// and a down view each, ranges of the experts' block). A prefill pass takes every layer whole;
// in decode the experts' blocks are on demand, and a step takes the attention blocks (prefetched
// in the cycle) and the chosen experts' views alone, each exact, each fetched at its acquire
// and gone at its release: the bytes moved are the attention's and the chosen views', and the
// device holds no more than the slot; the views have no host memory of their own.
TEST_P(WeightStoreTest, ExpertViewsMoveOnlyTheChosenExpertsBytes) {
  const std::size_t g = rig_granule(backend_);
  const std::size_t attn = g / 2, gu = g / 4, dn = g / 8;
  const std::size_t experts = 4 * (gu + dn);
  std::vector<WeightView> views;
  for (int of : {1, 3})
    for (std::size_t e = 0; e < 4; ++e) {
      views.push_back({of, e * gu, gu});
      views.push_back({of, 4 * gu + e * dn, dn});
    }
  auto view = [](int layer, int e, int proj) { return 4 + (layer == 1 ? 0 : 8) + 2 * e + proj; };
  WeightRig rig(backend_, {attn, experts, attn, experts}, 0, attn + experts, 0, views);
  EXPECT_EQ(rig.store->num_layers(), 4 + 16);
  EXPECT_TRUE(rig.store->view(4) && rig.store->on_demand(4) && !rig.store->view(3));
  EXPECT_EQ(rig.store->layer_bytes(view(3, 2, 1)), dn);
  EXPECT_EQ(rig.pool->stats().allocations, 4u) << "a view took host memory of its own";
  rig.store->set_residency({}, 1, 1, *rig.compute);
  rig.pass({0, 1, 2, 3});  // a prefill: whole layers
  rig.store->synchronize();
  WeightStoreStats st = rig.store->stats();
  EXPECT_EQ(st.host_bytes, 2 * (attn + experts));
  EXPECT_EQ(st.streamed_layers, 4);
  const std::size_t prefill_bytes = st.bytes_to_device;
  EXPECT_GE(prefill_bytes, 2 * (attn + experts));
  // Decode: experts on demand, one slot of two of the largest block with a window of one.
  rig.store->set_on_demand({1, 3});
  EXPECT_TRUE(rig.store->on_demand(1) && !rig.store->on_demand(0));
  rig.store->set_slot_bytes(2 * attn, attn);
  const int steps = scaled(6);
  std::size_t before = 0;
  for (int s = 0; s < steps; ++s) {
    const int e1 = s % 4, e3 = (s + 1) % 4;
    rig.pass({0, view(1, e1, 0), view(1, e1, 1), 2, view(3, e3, 0), view(3, e3, 1)});
    rig.store->synchronize();
    st = rig.store->stats();
    // each buffer maps whole granules: two of them, never an experts' block (two granules)
    EXPECT_LE(st.device_bytes, 2 * g) << "step " << s;
    if (s == 0) before = st.bytes_to_device;  // (the cycle's start under the new slot)
  }
  // From the second step on, each step moves its two attention blocks (the first one prefetched
  // in the step before, at its last block of the cycle) and the chosen experts' views alone.
  EXPECT_EQ(st.bytes_to_device - before,
            static_cast<std::size_t>(steps - 1) * (2 * attn + 2 * (gu + dn)));
  EXPECT_EQ(st.bytes_to_host, 0u);
  // Views are fetched on demand, never resident; the experts' whole block still serves a prefill.
  EXPECT_NE(message([&] {
              rig.store->set_residency({0, 5}, 1, 1, *rig.compute);
            }).find("layer 5 is a view (of layer 1): views are fetched on demand"),
            std::string::npos);
  rig.store->set_on_demand({});
  EXPECT_TRUE(rig.store->on_demand(view(1, 0, 0)));  // (views stay on demand)
  rig.store->set_slot_bytes(attn + experts, 0);
  rig.pass({0, 1, 2, 3});
  rig.store->acquire(0, *rig.compute);
  EXPECT_NE(message([&] { rig.store->set_on_demand({1}); }).find("layer 0 is acquired"),
            std::string::npos);
  rig.store->release(0, *rig.compute);
  rig.store->set_residency({0, 1, 2, 3}, 0, 0, *rig.compute);  // (views need no slot then)
  rig.pass({0, 1, 2, 3});
  EXPECT_NE(message([&] { rig.store->set_on_demand({24}); }).find("layer 24 out of range [0, 20)"),
            std::string::npos);
  WeightStoreOptions bad;
  bad.layer_bytes = {attn, experts};
  bad.views = {{1, experts - 8, 16}};
  EXPECT_NE(message([&] { WeightStore(rig.engine, rig.arena, bad); })
                .find("view 0 (16 bytes from offset " + std::to_string(experts - 8) +
                      ") is not inside layer 1's"),
            std::string::npos);
  bad.views = {{2, 0, 16}};
  EXPECT_NE(message([&] {
              WeightStore(rig.engine, rig.arena, bad);
            }).find("view 0 is of layer 2, out of range [0, 2)"),
            std::string::npos);
  rig.store->close();
  rig.engine->synchronize();
  rig.pool->synchronize_pending();
  EXPECT_EQ(rig.pool->stats().bytes_in_use, 0u) << "a view kept its layer's host copy";
}

TEST_P(WeightStoreTest, ALayerTakenBackIntoTheCycleWidensTheSlotsRoom) {
  // slot_bytes 0: a slot holds the cycle's largest layer, which set_on_demand changes. The
  // residency set while layer 1 (the largest) was on demand gives a slot of layer 2's bytes;
  // taking layer 1 back must widen it (the room stayed layer 2's, and layer 1's acquire found
  // none: OutOfMemory, found by the binding's fuzz test).
  const std::size_t g = rig_granule(backend_);
  const std::vector<std::size_t> kSizes = {g / 4, g, g / 2};
  WeightRig rig(backend_, kSizes);
  rig.store->set_on_demand({1});
  rig.store->set_residency({}, 1, 1, *rig.compute);
  rig.pass({0, 2});
  rig.store->set_on_demand({});
  rig.pass();
  rig.pass();
  rig.store->set_on_demand({1});  // (narrowed again: the room follows)
  rig.pass({0, 2});
  // Every streamed layer on demand, the cycle empty: a slot holds the largest of them (a room of
  // the empty cycle's 0 bytes let none in).
  rig.store->set_on_demand({0, 1, 2});
  rig.pass();
  rig.store->set_residency({1}, 1, 1, *rig.compute);  // (the same with a layer resident)
  rig.pass();
  rig.store->synchronize();
  EXPECT_LE(rig.store->stats().peak_device_bytes, 2 * rig.arena->granularity());
}

TEST_P(WeightStoreTest, ATrainingOrderFetchesEachStreamedLayerForItsForwardAndItsBackward) {
  // Note [Declared orders]: a training step uses layers 0..6 (forward), then 6..0 (backward).
  // Every use reads the layer's exact bytes; a streamed layer comes in once for its forward and
  // once for its backward, except where its two uses are adjacent: the last layer (forward then
  // backward) and layer 0 (backward, then the next step's forward) stay on the device between
  // them. The device never holds more than the resident layers and the slots.
  const std::vector<std::size_t> kSizes = layer_sizes(backend_);
  WeightRig rig(backend_, kSizes);
  std::vector<int> order = {0, 1, 2, 3, 4, 5, 6, 6, 5, 4, 3, 2, 1, 0};
  rig.store->set_order(order);
  EXPECT_EQ(rig.store->order(), order);
  rig.store->set_residency({1, 4}, 2, 1, *rig.compute);
  const int steps = scaled(5);
  for (int s = 0; s < steps; ++s) rig.pass(order);
  rig.store->synchronize();
  const WeightStoreStats st = rig.store->stats();
  const std::size_t per_step = 2 * total(kSizes, {2, 3, 5}) + kSizes[6] + kSizes[0];
  // step 1's layer 0 came in once more (at set_residency), the resident ones once
  EXPECT_EQ(st.bytes_to_device,
            per_step * static_cast<std::size_t>(steps) + kSizes[0] + kSizes[1] + kSizes[4]);
  EXPECT_EQ(st.fills - st.prefetched_fills, 2u) << "every streamed fill was a prefetch";
  EXPECT_EQ(st.bytes_to_host, 0u);
  EXPECT_LE(st.peak_device_bytes, (2 + 2) * rig.arena->granularity()) << "2 resident, 2 slots";
  // Back to the default cycle: each layer once a pass.
  rig.store->set_order({});
  EXPECT_TRUE(rig.store->order().empty());
  rig.pass();
  // Misuse, named.
  EXPECT_NE(message([&] {
              rig.store->set_order({0, 1, 2, 3, 4, 5});
            }).find("layer 6 is not in the order (6 uses)"),
            std::string::npos);
  EXPECT_NE(message([&] {
              rig.store->set_order({0, 9});
            }).find("layer 9 out of range [0, 7)"),
            std::string::npos);
  rig.store->acquire(2, *rig.compute);
  EXPECT_NE(message([&] { rig.store->set_order(order); }).find("layer 2 is acquired"),
            std::string::npos);
  rig.store->release(2, *rig.compute);
}

TEST_P(WeightStoreTest, MisuseIsRefusedNamingTheValues) {
  WeightRig rig(backend_, layer_sizes(backend_));
  EXPECT_NE(message([&] {
              rig.store->set_residency({}, 0, 0, *rig.compute);
            }).find("7 layers stream, which needs a slot"),
            std::string::npos);
  EXPECT_NE(message([&] {
              rig.store->set_residency({1, 1}, 2, 1, *rig.compute);
            }).find("layer 1 is listed twice"),
            std::string::npos);
  EXPECT_NE(message([&] {
              rig.store->set_residency({9}, 2, 1, *rig.compute);
            }).find("layer 9 out of range [0, 7)"),
            std::string::npos);
  EXPECT_NE(message([&] {
              rig.store->set_residency({}, 2, 3, *rig.compute);
            }).find("prefetch_layers must be in [0, slots] = [0, 2], got 3"),
            std::string::npos);
  EXPECT_NE(message([&] { rig.store->acquire(0, *rig.compute); }).find("no slots"),
            std::string::npos);
  rig.store->set_residency({}, 2, 1, *rig.compute);
  rig.store->acquire(0, *rig.compute);
  EXPECT_NE(message([&] { rig.store->acquire(0, *rig.compute); }).find("already acquired"),
            std::string::npos);
  EXPECT_NE(message([&] {
              rig.store->set_residency({}, 2, 1, *rig.compute);
            }).find("layer 0 is acquired"),
            std::string::npos);
  EXPECT_NE(message([&] { rig.store->trim(); }).find("layer 0 is acquired"), std::string::npos);
  EXPECT_NE(message([&] { rig.store->set_slot_bytes(0); }).find("layer 0 is acquired"),
            std::string::npos);
  EXPECT_NE(message([&] { rig.store->release(1, *rig.compute); }).find("layer 1 is not acquired"),
            std::string::npos);
  EXPECT_NE(message([&] { rig.store->resident_data(1); }).find("layer 1 is not resident"),
            std::string::npos);
  EXPECT_NE(message([&] { rig.store->buffer(1); }).find("layer 1 is neither acquired nor resident"),
            std::string::npos);
  rig.store->release(0, *rig.compute);
  EXPECT_NE(message([&] { rig.store->set_slot_bytes(1000); }).find("slot_bytes 1000 cannot hold"),
            std::string::npos);
  EXPECT_NE(message([&] {
              rig.store->set_slot_bytes(0, 1000);
            }).find("block_bytes 1000 cannot hold the largest streamed layer"),
            std::string::npos);
  rig.store->close();
  EXPECT_NE(message([&] { rig.store->acquire(0, *rig.compute); }).find("closed"),
            std::string::npos);
  WeightStoreOptions none;
  EXPECT_THROW(WeightStore(rig.engine, rig.arena, none), InvalidArgument);
  WeightStoreOptions zero;
  zero.layer_bytes = {10, 0};
  EXPECT_NE(message([&] { WeightStore(rig.engine, rig.arena, zero); }).find("layer 1 has 0 bytes"),
            std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Backends, WeightStoreTest,
                         ::testing::Values(BackendKind::Host, BackendKind::Cuda),
                         backend_param_name);

}  // namespace
}  // namespace reviva::test
