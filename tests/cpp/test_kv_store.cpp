// KVStore: a decoder's K/V cache with resident and streamed layers. Prefill then decode steps,
// with compute held behind a gate so that every copy provably waits for what it must: the
// contents of every layer match what compute wrote, token for token, at every use; appends move
// only the new tokens; fills move only the valid prefix; misuse is refused naming the values.
#include "test_util.h"

#include <map>

namespace reviva::test {
namespace {

constexpr std::size_t kTokenBytes = 96;  // one token of one tensor of one layer
constexpr int kTensors = 2;              // K and V

struct Rig {
  Rig(std::shared_ptr<Backend> b, int layers, std::size_t capacity, int prefetch, int slots,
      std::vector<int> resident_layers)
      : backend(std::move(b)) {
    pool = PinnedHostPool::create(backend, {});
    staging = PinnedHostPool::create(backend, {});
    engine = std::make_shared<TransferEngine>(pool);
    compute = std::make_shared<Stream>(backend);
    KVStoreOptions o;
    o.num_layers = layers;
    o.tensors_per_layer = kTensors;
    o.token_bytes = kTokenBytes;
    o.capacity_tokens = capacity;
    o.prefetch_layers = prefetch;
    store = std::make_unique<KVStore>(engine, o);
    for (int l : resident_layers) store->make_resident(l, buffers());
    for (int s = 0; s < slots; ++s) store->add_slot(buffers());
    expected.resize(static_cast<std::size_t>(layers * kTensors));
  }
  std::vector<void*> buffers() {
    std::vector<void*> v;
    for (int t = 0; t < kTensors; ++t) {
      device.push_back(std::make_unique<DeviceBuffer>(*backend, *compute, store->buffer_bytes()));
      v.push_back(device.back()->data());
    }
    return v;
  }

  ~Rig() {
    store.reset();
    compute->synchronize();
  }

  // Compute writes `count` new random tokens at the end of `layer`, behind a gate that opens
  // only after wrote() was called: the append's D2H must wait for the write (rule 1).
  void write_tokens(int layer, const std::vector<void*>& buffers, std::size_t count,
                    std::uint64_t seed) {
    const std::size_t first = store->length(layer);
    // Pinned allocations before the gate: one may synchronize the device (a new slab).
    std::vector<PinnedBlock> blocks;
    for (int t = 0; t < kTensors; ++t) blocks.push_back(staging->allocate(count * kTokenBytes));
    StreamGate gate;
    gate.block(*compute);
    for (int t = 0; t < kTensors; ++t) {
      std::vector<std::uint8_t> bytes = random_bytes(count * kTokenBytes, seed * 7 + t);
      PinnedBlock& block = blocks[static_cast<std::size_t>(t)];
      std::memcpy(block.data(), bytes.data(), bytes.size());
      backend->copy_async(static_cast<char*>(buffers[t]) + first * kTokenBytes, block.data(),
                          bytes.size(), compute->handle());
      block.record_use(compute);
      auto& e = expected[static_cast<std::size_t>(layer * kTensors + t)];
      e.insert(e.end(), bytes.begin(), bytes.end());
    }
    store->wrote(layer, first, count, *compute);
    gate.open();
  }

  // Compute reads the layer's valid tokens (after acquire: the fill must have landed, rule 3).
  void check_contents(int layer, const std::vector<void*>& buffers) {
    const std::size_t n = store->length(layer) * kTokenBytes;
    for (int t = 0; t < kTensors; ++t) {
      const auto& e = expected[static_cast<std::size_t>(layer * kTensors + t)];
      ASSERT_EQ(e.size(), n);
      if (n == 0) continue;
      ASSERT_EQ(download(*staging, *compute, buffers[t], n), e)
          << "layer " << layer << " tensor " << t << " length " << store->length(layer);
    }
  }

  // One pass over all layers: check what each holds, append `count` tokens.
  void step(std::size_t count, std::uint64_t seed, bool check = true) {
    for (int l = 0; l < store->options().num_layers; ++l) {
      std::vector<void*> buffers = store->acquire(l, *compute);
      if (check) check_contents(l, buffers);
      if (count > 0) write_tokens(l, buffers, count, seed * 1000 + static_cast<std::uint64_t>(l));
      store->release(l, *compute);
    }
  }

  std::shared_ptr<Backend> backend;
  std::shared_ptr<PinnedHostPool> pool, staging;
  std::shared_ptr<TransferEngine> engine;
  std::shared_ptr<Stream> compute;
  std::vector<std::unique_ptr<DeviceBuffer>> device;
  std::unique_ptr<KVStore> store;
  std::vector<std::vector<std::uint8_t>> expected;  // [layer * kTensors + tensor]
};

class KVStoreTest : public BackendTest {};

TEST_P(KVStoreTest, PrefillThenDecodeKeepsEveryLayerExact) {
  // 7 layers, 3 resident, 4 streamed through 3 slots with a window of 2.
  Rig rig(backend_, 7, 96, 2, 3, {0, 3, 5});
  const std::size_t prompt = 40;
  rig.step(prompt, 1, /*check=*/false);
  const int steps = scaled(24);
  for (int s = 0; s < steps; ++s) rig.step(1, 100 + s);
  rig.step(0, 999);  // a last pass that only checks
  rig.store->synchronize();

  const KVStoreStats st = rig.store->stats();
  EXPECT_EQ(st.resident_layers, 3);
  EXPECT_EQ(st.streamed_layers, 4);
  EXPECT_EQ(st.slots, 3);
  // Appends move only the new tokens: prompt + one per step, per streamed layer and tensor.
  EXPECT_EQ(st.bytes_to_host, 4u * kTensors * kTokenBytes * (prompt + steps));
  // Fills move only valid prefixes, at most one per streamed layer per pass.
  std::uint64_t max_fill_bytes = 0;
  for (int s = 0; s <= steps; ++s) max_fill_bytes += 4u * kTensors * kTokenBytes * (prompt + s);
  // ... and the window wraps into the next pass: the last pass prefetched 2 layers of it.
  max_fill_bytes += 2u * kTensors * kTokenBytes * (prompt + steps);
  EXPECT_EQ(st.bytes_to_device, max_fill_bytes);
  EXPECT_EQ(st.fills, 4u * (steps + 1) + 2) << "one fill per streamed layer per pass";
  EXPECT_EQ(st.fills, st.prefetched_fills) << "with a window of 2 every fill is a prefetch";
  EXPECT_EQ(st.host_bytes, 4u * kTensors * rig.store->buffer_bytes());
}

TEST_P(KVStoreTest, ExactWithEveryWindowAndSlotCount) {
  for (int prefetch : {0, 1, 3}) {
    for (int slots : {1, 2, 5}) {
      if (slots < 1) continue;
      Rig rig(backend_, 5, 64, prefetch, slots, {2});
      rig.step(17, 1, false);
      for (int s = 0; s < scaled(6); ++s) rig.step(1 + s % 2, 10 + s);
      rig.step(0, 99);
      SCOPED_TRACE("prefetch " + std::to_string(prefetch) + " slots " + std::to_string(slots));
      EXPECT_EQ(rig.store->length(0), rig.store->length(4));
    }
  }
}

TEST_P(KVStoreTest, PromotedLayersKeepTheirContentsAndStopMoving) {
  Rig rig(backend_, 6, 64, 2, 3, {0});
  rig.step(30, 1, false);  // prefill: layers 1-5 streamed
  rig.step(1, 2);
  // Memory freed after prefill: two streamed layers become resident (one of them may sit in a
  // slot, reserved by a prefetch).
  std::vector<void*> b1 = rig.buffers(), b2 = rig.buffers();
  rig.store->promote(1, b1);
  rig.store->promote(4, b2);
  EXPECT_TRUE(rig.store->resident(1));
  const KVStoreStats before = rig.store->stats();
  EXPECT_EQ(before.promotions, 2u);
  EXPECT_EQ(before.resident_layers, 3);
  EXPECT_EQ(before.host_bytes, 3u * kTensors * rig.store->buffer_bytes());
  for (int s = 0; s < scaled(8); ++s) rig.step(1, 10 + s);
  rig.step(0, 99);
  rig.store->synchronize();
  const KVStoreStats after = rig.store->stats();
  // From here on only the 3 streamed layers append to the host.
  EXPECT_EQ(after.bytes_to_host - before.bytes_to_host,
            3u * kTensors * kTokenBytes * static_cast<std::size_t>(scaled(8)));
}

TEST_P(KVStoreTest, AllResidentMovesNothing) {
  Rig rig(backend_, 3, 32, 2, 0, {0, 1, 2});
  rig.step(10, 1, false);
  for (int s = 0; s < 5; ++s) rig.step(1, 2 + s);
  rig.step(0, 9);
  const KVStoreStats st = rig.store->stats();
  EXPECT_EQ(st.bytes_to_device, 0u);
  EXPECT_EQ(st.bytes_to_host, 0u);
  EXPECT_EQ(st.host_bytes, 0u);
}

TEST_P(KVStoreTest, ClearStartsANewSequence) {
  Rig rig(backend_, 4, 32, 1, 2, {1});
  rig.step(12, 1, false);
  rig.step(1, 2);
  rig.store->clear();
  for (auto& e : rig.expected) e.clear();
  for (int l = 0; l < 4; ++l) EXPECT_EQ(rig.store->length(l), 0u);
  rig.step(5, 3, false);
  rig.step(1, 4);
  rig.step(0, 5);
}

TEST_P(KVStoreTest, MisuseIsRefusedNamingTheValues) {
  Rig rig(backend_, 3, 16, 1, 1, {0});
  auto message = [](auto&& fn) {
    try {
      fn();
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { rig.store->acquire(3, *rig.compute); }).find("layer 3 out of range"),
            std::string::npos);
  EXPECT_NE(message([&] { rig.store->wrote(1, 0, 1, *rig.compute); }).find("not acquired"),
            std::string::npos);
  auto b = rig.store->acquire(1, *rig.compute);
  EXPECT_NE(message([&] { rig.store->acquire(1, *rig.compute); }).find("already acquired"),
            std::string::npos);
  EXPECT_NE(message([&] { rig.store->wrote(1, 0, 17, *rig.compute); }).find("capacity of 16"),
            std::string::npos);
  EXPECT_NE(message([&] { rig.store->wrote(1, 2, 1, *rig.compute); }).find("gap"),
            std::string::npos);
  // The one slot is held by layer 1: layer 2 cannot get one.
  EXPECT_NE(message([&] { rig.store->acquire(2, *rig.compute); }).find("all 1 slots"),
            std::string::npos);
  rig.store->release(1, *rig.compute);
  EXPECT_NE(message([&] { rig.store->release(1, *rig.compute); }).find("not acquired"),
            std::string::npos);
  EXPECT_NE(message([&] {
              rig.store->make_resident(0, {b[0], b[1]});
            }).find("already resident"),
            std::string::npos);
  EXPECT_NE(message([&] {
              rig.store->make_resident(2, {b[0], b[1]});
            }).find("residency is fixed"),
            std::string::npos);
  EXPECT_NE(message([&] { rig.store->add_slot({b[0]}); }).find("expected 2"), std::string::npos);
  EXPECT_NE(message([&] {
              rig.store->promote(0, {b[0], b[1]});
            }).find("already resident"),
            std::string::npos);
  EXPECT_NE(message([&] {
              KVStoreOptions o;
              o.num_layers = 0;
              KVStore s(rig.engine, o);
            }).find("num_layers must be > 0, got 0"),
            std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Backends, KVStoreTest,
                         ::testing::Values(BackendKind::Host, BackendKind::Cuda),
                         backend_param_name);

}  // namespace
}  // namespace reviva::test
