// The KVStore tests' rig (test_kv_store.cpp, test_kv_store_disk.cpp): a store on a backend whose
// compute writes random tokens behind a gate, and what every layer should hold.
#pragma once

#include "test_util.h"

#include <functional>

namespace reviva::test {

constexpr std::size_t kTokenBytes = 192;  // one token of one layer: its K and V

struct Rig {
  Rig(std::shared_ptr<Backend> b, int layers, std::size_t capacity, int prefetch, int slots,
      std::vector<int> resident_layers, std::size_t arena_limit = 0,
      std::vector<std::size_t> layer_capacities = {},
      const std::function<void(KVStoreOptions&)>& more = nullptr)
      : backend(std::move(b)) {
    pool = PinnedHostPool::create(backend, {});
    staging = PinnedHostPool::create(backend, {});
    engine = std::make_shared<TransferEngine>(pool);
    DeviceArenaOptions ao;
    ao.limit_bytes = arena_limit;
    arena = DeviceArena::create(backend, ao);
    compute = std::make_shared<Stream>(backend);
    KVStoreOptions o;
    o.num_layers = layers;
    o.token_bytes = kTokenBytes;
    o.capacity_tokens = capacity;
    o.prefetch_layers = prefetch;
    o.layer_capacity_tokens = std::move(layer_capacities);
    if (more) more(o);  // (options a test sets beyond these)
    store = std::make_unique<KVStore>(engine, arena, o);
    // Host copies are pinned ahead (a new slab may synchronize the device, which would wait for
    // the gates below forever): the store's allocations are then cache hits.
    pool->reserve(static_cast<std::size_t>(layers), store->layer_bytes());
    for (int l : resident_layers) store->make_resident(l);
    for (int s = 0; s < slots; ++s) store->add_slot();
    expected.resize(static_cast<std::size_t>(layers));
  }

  ~Rig() {
    store.reset();
    compute->synchronize();
  }

  // Compute writes `count` new random tokens at the end of `layer`, behind a gate that opens
  // only after wrote() was called: the append's D2H must wait for the write (rule 1).
  void write_tokens(int layer, void* buffer, std::size_t count, std::uint64_t seed) {
    const std::size_t first = store->length(layer);
    store->reserve(layer, first + count);
    EXPECT_GE(store->reserved_tokens(layer), first + count);
    // Pinned allocations before the gate: one may synchronize the device (a new slab).
    PinnedBlock block = staging->allocate(count * kTokenBytes);
    StreamGate gate;
    gate.block(*compute);
    std::vector<std::uint8_t> bytes = random_bytes(count * kTokenBytes, seed * 7);
    std::memcpy(block.data(), bytes.data(), bytes.size());
    backend->copy_async(static_cast<char*>(buffer) + first * kTokenBytes, block.data(),
                        bytes.size(), compute->handle());
    block.record_use(compute);
    auto& e = expected[static_cast<std::size_t>(layer)];
    e.insert(e.end(), bytes.begin(), bytes.end());
    store->wrote(layer, first, count, *compute);
    gate.open();
  }

  // Compute reads the layer's valid tokens (after acquire: the fill must have landed, rule 3).
  void check_contents(int layer, void* buffer) {
    const std::size_t n = store->length(layer) * kTokenBytes;
    const auto& e = expected[static_cast<std::size_t>(layer)];
    ASSERT_EQ(e.size(), n);
    if (n == 0) return;
    ASSERT_EQ(download(*staging, *compute, buffer, n), e)
        << "layer " << layer << " length " << store->length(layer);
  }

  // One pass over all layers: check what each holds, append `count` tokens.
  void step(std::size_t count, std::uint64_t seed, bool check = true) {
    for (int l = 0; l < store->options().num_layers; ++l) {
      void* buffer = store->acquire(l, *compute);
      if (check) check_contents(l, buffer);
      if (count > 0) write_tokens(l, buffer, count, seed * 1000 + static_cast<std::uint64_t>(l));
      store->release(l, *compute);
    }
  }

  std::shared_ptr<Backend> backend;
  std::shared_ptr<PinnedHostPool> pool, staging;
  std::shared_ptr<TransferEngine> engine;
  std::shared_ptr<DeviceArena> arena;
  std::shared_ptr<Stream> compute;
  std::unique_ptr<KVStore> store;
  std::vector<std::vector<std::uint8_t>> expected;  // [layer]
};

}  // namespace reviva::test
