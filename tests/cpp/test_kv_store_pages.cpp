// KVStore with paged layers (Note [Paged layers] in kv_store_pages.cpp): layers not resident from
// the start live in pages of page_tokens tokens, written as compute's tokens arrive and read back
// page by page. Compute is held behind a gate so that every copy provably waits for what it
// must; every page's contents match what compute wrote at every use; appends move only the new
// tokens and fetches only a page's valid tokens; the staging room is pages, not layers; a
// promotion keeps a layer's pages; misuse is refused naming the values.
#include "test_util.h"

namespace reviva::test {
namespace {

constexpr std::size_t kTokenBytes = 160;  // one token of one layer: its K and V

struct PagedRig {
  PagedRig(std::shared_ptr<Backend> b, int layers, std::size_t capacity, std::size_t page,
           int prefetch, int page_slots, std::vector<int> resident_layers)
      : backend(std::move(b)) {
    pool = PinnedHostPool::create(backend, {});
    staging = PinnedHostPool::create(backend, {});
    engine = std::make_shared<TransferEngine>(pool);
    arena = DeviceArena::create(backend, {});
    compute = std::make_shared<Stream>(backend);
    KVStoreOptions o;
    o.num_layers = layers;
    o.token_bytes = kTokenBytes;
    o.capacity_tokens = capacity;
    o.prefetch_layers = prefetch;
    o.page_tokens = page;
    store = std::make_unique<KVStore>(engine, arena, o);
    // Host copies pinned ahead (a new slab may synchronize the device, which would wait for
    // the gates below forever): the pages' allocations are then cache hits.
    const std::size_t pages = (capacity + page - 1) / page;
    pool->reserve(static_cast<std::size_t>(layers) * pages, page * kTokenBytes);
    for (int l : resident_layers) store->make_resident(l);  // (they need no slot)
    EXPECT_TRUE(store->set_page_slots(page_slots));
    expected.resize(static_cast<std::size_t>(layers));
  }

  ~PagedRig() {
    store.reset();
    compute->synchronize();
  }

  std::size_t page() const { return store->page_tokens(); }

  // Compute writes `count` new random tokens at the end of `layer`: page by page, each behind
  // a gate opened only after wrote_page (the write-through D2H must wait for the write: rule 1).
  void write_tokens(int layer, std::size_t count, std::uint64_t seed) {
    std::vector<std::uint8_t> bytes = random_bytes(count * kTokenBytes, seed * 7);
    auto& e = expected[static_cast<std::size_t>(layer)];
    std::size_t first = store->length(layer);
    std::size_t done = 0;
    while (done < count) {
      const std::size_t j = first / page(), at = first % page();
      const std::size_t n = std::min(count - done, page() - at);
      void* buffer = store->acquire_page(layer, j, *compute);
      store->reserve_page(layer, j, at + n);
      EXPECT_GE(store->reserved_page_tokens(layer, j), at + n);
      PinnedBlock block = staging->allocate(n * kTokenBytes);
      StreamGate gate;
      gate.block(*compute);
      std::memcpy(block.data(), bytes.data() + done * kTokenBytes, n * kTokenBytes);
      backend->copy_async(static_cast<char*>(buffer) + at * kTokenBytes, block.data(),
                          n * kTokenBytes, compute->handle());
      block.record_use(compute);
      store->wrote_page(layer, j, at, n, *compute);
      gate.open();
      store->release_page(layer, j, *compute);
      first += n;
      done += n;
    }
    e.insert(e.end(), bytes.begin(), bytes.end());
  }

  // Compute reads each page of the layer (after acquire_page: its fetch must have landed).
  void check_contents(int layer) {
    ASSERT_EQ(expected[static_cast<std::size_t>(layer)].size(), store->length(layer) * kTokenBytes);
    read_pages(layer, store->length(layer));
  }

  // Compute reads the pages holding tokens [0, end) of `layer` (a prefill chunk's attention to
  // the tokens before it), each checked against what was written.
  void read_pages(int layer, std::size_t end) {
    const auto& e = expected[static_cast<std::size_t>(layer)];
    for (std::size_t j = 0; j * page() < end; ++j) {
      void* buffer = store->acquire_page(layer, j, *compute);
      const std::size_t n = std::min(page(), end - j * page()) * kTokenBytes;
      ASSERT_EQ(download(*staging, *compute, buffer, n),
                std::vector<std::uint8_t>(
                    e.begin() + static_cast<std::ptrdiff_t>(j * page() * kTokenBytes),
                    e.begin() + static_cast<std::ptrdiff_t>(j * page() * kTokenBytes + n)))
          << "layer " << layer << " page " << j << " up to " << end;
      store->release_page(layer, j, *compute);
    }
  }

  // A paged layer's prefill by chunks: each chunk reads the pages before it, then writes its
  // tokens; with `declare`, in the order declared to the store (Note [Paged prefill order]).
  void chunked_prefill(int layer, std::size_t tokens, std::size_t chunk, bool declare) {
    if (declare) store->declare_prefill_order(layer, 0, tokens, chunk);
    for (std::size_t s = 0; s < tokens; s += chunk) {
      read_pages(layer, s);
      write_tokens(layer, std::min(chunk, tokens - s), 500 + s);
    }
    if (declare) store->end_prefill_order();
  }

  // A whole (resident) layer, as in test_kv_store.cpp.
  void whole_step(int layer, std::size_t count, std::uint64_t seed, bool check) {
    void* buffer = store->acquire(layer, *compute);
    const std::size_t first = store->length(layer);
    auto& e = expected[static_cast<std::size_t>(layer)];
    if (check && first > 0) {
      ASSERT_EQ(download(*staging, *compute, buffer, first * kTokenBytes), e);
    }
    if (count > 0) {
      store->reserve(layer, first + count);
      std::vector<std::uint8_t> bytes = random_bytes(count * kTokenBytes, seed * 7);
      upload(*staging, *compute, static_cast<char*>(buffer) + first * kTokenBytes, bytes);
      e.insert(e.end(), bytes.begin(), bytes.end());
      store->wrote(layer, first, count, *compute);
    }
    store->release(layer, *compute);
  }

  // One pass over all layers: check what each holds, append `count` tokens.
  void step(std::size_t count, std::uint64_t seed, bool check = true) {
    for (int l = 0; l < store->options().num_layers; ++l) {
      const std::uint64_t s = seed * 1000 + static_cast<std::uint64_t>(l);
      if (!store->paged(l)) {
        whole_step(l, count, s, check);
        continue;
      }
      if (check) check_contents(l);
      if (count > 0) write_tokens(l, count, s);
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

class KVStorePagesTest : public BackendTest {};

TEST_P(KVStorePagesTest, TruncateAcrossPagesThenWritesContinue) {
  // Cuts that end inside a page and across pages; the cycle's pages follow the new length.
  PagedRig rig(backend_, 3, 96, 16, 2, 3, {1});
  rig.step(40, 1, /*check=*/false);
  for (std::size_t cut : {std::size_t{3}, std::size_t{20}, std::size_t{1}}) {
    rig.step(4, 10 + cut);
    for (int l = 0; l < 3; ++l) {
      const std::size_t keep = rig.store->length(l) - cut;
      rig.store->truncate(l, keep);
      rig.expected[static_cast<std::size_t>(l)].resize(keep * kTokenBytes);
      EXPECT_EQ(rig.store->length(l), keep);
    }
    rig.step(0, 90 + cut);  // checks every page
  }
  rig.step(2, 77);
  rig.step(0, 99);
}

TEST_P(KVStorePagesTest, PrefillThenDecodeKeepsEveryPageExact) {
  // 5 layers, layer 1 whole and resident, 4 paged in pages of 16 tokens through 3 page slots
  // with a window of 2 pages; a 40-token prompt (pages of 16, 16, 8) then decode steps that
  // fill the third page and open a fourth.
  PagedRig rig(backend_, 5, 96, 16, 2, 3, {1});
  const std::size_t prompt = 40;
  rig.step(prompt, 1, /*check=*/false);
  EXPECT_EQ(rig.store->length(0), prompt);
  EXPECT_EQ(rig.store->pages(0), 3u);
  const int steps = 12;  // to 52 tokens: 4 pages
  for (int s = 0; s < steps; ++s) rig.step(1, 100 + s);
  rig.step(0, 999);
  rig.store->synchronize();
  EXPECT_EQ(rig.store->pages(0), 4u);
  const KVStoreStats st = rig.store->stats();
  EXPECT_EQ(st.paged_layers, 4);
  EXPECT_EQ(st.resident_layers, 1);
  EXPECT_EQ(st.streamed_layers, 4);
  EXPECT_EQ(st.page_slots, 3);
  // Appends move only the new tokens, per paged layer.
  EXPECT_EQ(st.bytes_to_host, 4u * kTokenBytes * (prompt + steps));
  // Host copies: a page's bytes per page holding tokens (4 of the 6 of 96 tokens).
  EXPECT_EQ(st.host_bytes, 4u * 4u * 16u * kTokenBytes);
  rig.store->close();
  rig.arena->reclaim(/*wait=*/true);
  EXPECT_EQ(rig.arena->stats().mapped_bytes, 0u) << "close gives every byte back";
}

TEST_P(KVStorePagesTest, ExactWithEveryWindowPageSlotsAndPageSize) {
  for (std::size_t page : {std::size_t{5}, std::size_t{16}, std::size_t{64}}) {
    for (int prefetch : {0, 1, 3}) {
      for (int page_slots : {1, 2, 4}) {
        if (page_slots < prefetch + 1 && prefetch > 0) continue;
        SCOPED_TRACE("page " + std::to_string(page) + " prefetch " + std::to_string(prefetch) +
                     " page slots " + std::to_string(page_slots));
        PagedRig rig(backend_, 4, 48, page, prefetch, page_slots, {2});
        rig.step(17, 1, false);
        for (int s = 0; s < scaled(6); ++s) rig.step(1 + s % 3, 10 + s);
        rig.step(0, 99);
        EXPECT_EQ(rig.store->length(0), rig.store->length(2));
      }
    }
  }
}

TEST_P(KVStorePagesTest, FetchesMoveOnlyValidTokensAndTheWindowPrefetches) {
  // One paged layer of 3 pages (16, 16 and 1 tokens): each pass brings the 33 valid tokens in
  // (a page read leaves once its next use is beyond the window); with a window of 2 pages and
  // 3 page slots every fetch after the first pass is a prefetch, without a window none is.
  for (int page_slots : {1, 3}) {
    SCOPED_TRACE("page slots " + std::to_string(page_slots));
    PagedRig rig(backend_, 1, 64, 16, page_slots > 1 ? 2 : 0, page_slots, {});
    rig.step(33, 1, false);
    rig.step(0, 2);
    rig.store->synchronize();
    const KVStoreStats before = rig.store->stats();
    for (int s = 0; s < 3; ++s) rig.step(0, 10 + s);
    rig.store->synchronize();
    const KVStoreStats after = rig.store->stats();
    EXPECT_EQ(after.bytes_to_device - before.bytes_to_device, 3u * 33u * kTokenBytes);
    EXPECT_EQ(after.fills - before.fills, 9u);
    EXPECT_EQ(after.prefetched_fills - before.prefetched_fills, page_slots > 1 ? 9u : 0u);
  }
}

TEST_P(KVStorePagesTest, ChunkedPrefillInItsDeclaredOrderPrefetchesEveryRead) {
  // Note [Paged prefill order]: two paged layers in pages of 16 tokens, 3 page slots, a window
  // of 2 pages; each layer's prefill of 96 tokens in chunks of 24 reads the pages before each
  // chunk again (1, 2, 3, 4 and 5 pages: 15 reads of full or partial pages). In the decode
  // cycle's order some of those reads wait for fetches started on demand; in prefill's declared
  // order (almost) every fetch is started ahead of its use, and fewer bytes move. Every page is
  // exact, in prefill and in the decode steps afterwards.
  KVStoreStats st[2];
  for (bool declare : {false, true}) {
    SCOPED_TRACE(declare ? "declared prefill order" : "decode cycle's order");
    PagedRig rig(backend_, 2, 128, 16, 2, 3, {});
    for (int l = 0; l < 2; ++l) rig.chunked_prefill(l, 96, 24, declare);
    rig.store->synchronize();
    st[declare] = rig.store->stats();
    for (int s = 0; s < 3; ++s) rig.step(1, 10 + s);
    rig.step(0, 99);
  }
  // (Host backend, six runs: the cycle's order 29-32 fills, 7 on demand, 64-72 KB; prefill's
  // 20-22 fills, 0-1 on demand - a prefetch deferred for room and retried too late -, 49-52 KB:
  // knowing each page's next use, the scheduler also keeps the pages read again soon.)
  const auto on_demand = [](const KVStoreStats& x) { return x.fills - x.prefetched_fills; };
  EXPECT_LE(on_demand(st[1]), 1u) << st[1].fills << " fills, " << st[1].prefetched_fills
                                  << " prefetched";
  EXPECT_GE(on_demand(st[0]), on_demand(st[1]) + 4) << "the cycle's order: fetches on demand";
  EXPECT_LT(st[1].bytes_to_device, st[0].bytes_to_device);
  EXPECT_EQ(st[1].bytes_to_host, 2u * 96u * kTokenBytes);
}

TEST_P(KVStorePagesTest, PromotedPagedLayersKeepTheirPagesAndStopMoving) {
  PagedRig rig(backend_, 4, 64, 16, 1, 2, {0});
  rig.step(30, 1, false);
  rig.step(1, 2);
  EXPECT_TRUE(rig.store->promote(2));
  EXPECT_TRUE(rig.store->resident(2));
  EXPECT_TRUE(rig.store->paged(2)) << "a promoted paged layer keeps its pages";
  rig.store->synchronize();
  const KVStoreStats before = rig.store->stats();
  EXPECT_EQ(before.promotions, 1u);
  EXPECT_EQ(before.resident_layers, 2);
  EXPECT_EQ(before.streamed_layers, 2);
  for (int s = 0; s < 8; ++s) rig.step(1, 10 + s);  // to 39 tokens: a third page opens
  rig.step(0, 99);
  rig.store->synchronize();
  const KVStoreStats after = rig.store->stats();
  // Only the 2 layers still streamed append to the host; the promoted one keeps its writes.
  EXPECT_EQ(after.bytes_to_host - before.bytes_to_host, 2u * 8u * kTokenBytes);
}

TEST_P(KVStorePagesTest, MisuseIsRefusedNamingTheValues) {
  PagedRig rig(backend_, 3, 40, 16, 1, 1, {0});
  auto message = [](auto&& fn) {
    try {
      fn();
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  auto& s = *rig.store;
  auto& c = *rig.compute;
  EXPECT_NE(message([&] { s.acquire(1, c); }).find("layer 1 is paged (pages of 16 tokens)"),
            std::string::npos);
  EXPECT_NE(message([&] { s.acquire_page(0, 0, c); }).find("layer 0 is not paged"),
            std::string::npos);
  EXPECT_NE(message([&] { s.acquire_page(1, 3, c); }).find("page 3 of layer 1 out of range [0, 3)"),
            std::string::npos);
  EXPECT_NE(message([&] { s.wrote_page(1, 0, 0, 1, c); }).find("page 0 of layer 1 is not acquired"),
            std::string::npos);
  s.acquire_page(1, 0, c);
  EXPECT_NE(message([&] { s.acquire_page(1, 0, c); }).find("already acquired"), std::string::npos);
  EXPECT_NE(message([&] { s.reserve_page(1, 0, 17); }).find("17 tokens exceed page 0's 16"),
            std::string::npos);
  EXPECT_NE(message([&] { s.wrote_page(1, 0, 2, 1, c); }).find("gap"), std::string::npos);
  // The one page slot is held: another streamed page cannot be had.
  EXPECT_NE(message([&] { s.acquire_page(2, 0, c); }).find("staging room"), std::string::npos);
  s.release_page(1, 0, c);
  s.acquire_page(1, 1, c);
  s.reserve_page(1, 1, 1);
  EXPECT_NE(message([&] { s.wrote_page(1, 1, 0, 1, c); }).find("before page 0 is full"),
            std::string::npos);
  s.release_page(1, 1, c);
  EXPECT_NE(message([&] { s.set_page_slots(-1); }).find("pages must be >= 0, got -1"),
            std::string::npos);
  KVStoreOptions o;
  o.num_layers = 1;
  o.token_bytes = kTokenBytes;
  o.capacity_tokens = 8;
  KVStore whole(rig.engine, rig.arena, o);
  EXPECT_NE(message([&] { whole.set_page_slots(1); }).find("no pages"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Backends, KVStorePagesTest,
                         ::testing::Values(BackendKind::Host, BackendKind::Cuda),
                         backend_param_name);

}  // namespace
}  // namespace reviva::test
