// KVStore: a decoder's K/V cache with resident and streamed layers. Prefill then decode steps,
// with compute held behind a gate so that every copy provably waits for what it must: the
// contents of every layer match what compute wrote, token for token, at every use; appends move
// only the new tokens; fills move only the valid prefix; misuse is refused naming the values.
#include "kv_store_rig.h"

#include <map>

namespace reviva::test {
namespace {

class KVStoreTest : public BackendTest {};

TEST_P(KVStoreTest, TruncateRollsBackAndLaterWritesContinueFromThere) {
  // Assisted decoding: a step writes several candidate tokens, the rejected ones are cut, and
  // the next step writes from the cut. Resident and streamed layers alike hold exactly the kept
  // tokens and the new ones, and a streamed layer's fill moves only those.
  Rig rig(backend_, 5, 96, 2, 3, {0, 3});
  rig.step(40, 1, /*check=*/false);
  for (int s = 0; s < 3; ++s) {
    rig.step(5, 10 + s);
    for (int l = 0; l < 5; ++l) {
      const std::size_t keep = rig.store->length(l) - 3;
      rig.store->truncate(l, keep);
      rig.expected[static_cast<std::size_t>(l)].resize(keep * kTokenBytes);
      EXPECT_EQ(rig.store->length(l), keep);
    }
  }
  rig.step(1, 70);
  rig.step(0, 99);  // checks every layer
  EXPECT_EQ(rig.store->length(2), 40u + 3 * 2 + 1);
  EXPECT_THROW(rig.store->truncate(1, 48), InvalidArgument);  // more than it holds
  rig.store->acquire(1, *rig.compute);
  EXPECT_THROW(rig.store->truncate(1, 10), InvalidArgument);  // acquired
  rig.store->release(1, *rig.compute);
}

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
  EXPECT_EQ(st.bytes_to_host, 4u * kTokenBytes * (prompt + steps));
  // Fills move only valid prefixes, at most one per streamed layer per pass.
  std::uint64_t max_fill_bytes = 0;
  for (int s = 0; s <= steps; ++s) max_fill_bytes += 4u * kTokenBytes * (prompt + s);
  // ... and the window wraps into the next pass: the last pass prefetched 2 layers of it.
  max_fill_bytes += 2u * kTokenBytes * (prompt + steps);
  EXPECT_EQ(st.bytes_to_device, max_fill_bytes);
  EXPECT_EQ(st.fills, 4u * (steps + 1) + 2) << "one fill per streamed layer per pass";
  EXPECT_EQ(st.fills, st.prefetched_fills) << "with a window of 2 every fill is a prefetch";
  EXPECT_EQ(st.host_bytes, 4u * rig.store->layer_bytes());
  // Device memory: what the tokens need, by granules, no more (3 resident layers, 3 slots).
  const std::size_t g = rig.arena->granularity();
  const std::size_t per_buffer = rig.arena->round_up((prompt + steps) * kTokenBytes);
  EXPECT_EQ(st.device_bytes, 6 * per_buffer);
  EXPECT_EQ(st.peak_device_bytes, 6 * per_buffer);
  EXPECT_EQ(per_buffer % g, 0u);
  rig.store->close();
  rig.arena->reclaim(/*wait=*/true);
  EXPECT_EQ(rig.arena->stats().mapped_bytes, 0u) << "close gives every byte back";
  EXPECT_EQ(rig.arena->stats().buffers, 0u);
}

TEST_P(KVStoreTest, LayersOfManyGranulesMapNoMoreThanTheirResidentLayersAndSlots) {
  // Layers of several granules each, prefilled from nothing then decoded: every streamed layer
  // starts small and grows; the store's memory stays what 2 resident layers and 2 slots need
  // (each fetch reuses a freed layer's memory, grown in place), not a buffer per layer.
  const std::size_t prompt = 40000;  // 7.3 MiB of K/V per layer: 4 granules of 2 MiB
  Rig rig(backend_, 6, 44000, 1, 2, {0, 3});
  rig.step(prompt, 1, /*check=*/false);
  for (int s = 0; s < 3; ++s) rig.step(1, 10 + s);
  rig.step(0, 99);
  rig.store->synchronize();
  const std::size_t per_layer = rig.arena->round_up((prompt + 3) * kTokenBytes);
  const KVStoreStats st = rig.store->stats();
  EXPECT_LE(st.peak_device_bytes, 4 * per_layer) << "more than 2 resident layers and 2 slots";
  EXPECT_LE(rig.arena->stats().peak_bytes, 4 * per_layer);
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
  EXPECT_TRUE(rig.store->promote(1));
  EXPECT_TRUE(rig.store->promote(4));
  EXPECT_TRUE(rig.store->resident(1));
  const KVStoreStats before = rig.store->stats();
  EXPECT_EQ(before.promotions, 2u);
  EXPECT_EQ(before.resident_layers, 3);
  EXPECT_EQ(before.host_bytes, 3u * rig.store->layer_bytes());
  for (int s = 0; s < scaled(8); ++s) rig.step(1, 10 + s);
  rig.step(0, 99);
  rig.store->synchronize();
  const KVStoreStats after = rig.store->stats();
  // From here on only the 3 streamed layers append to the host.
  EXPECT_EQ(after.bytes_to_host - before.bytes_to_host,
            3u * kTokenBytes * static_cast<std::size_t>(scaled(8)));
}

TEST_P(KVStoreTest, AFetchWindowMovesTheLastTokensAloneAndLiftingItBringsAllBack) {
  // Note [Fetch tails] (append_blocks.cpp): a sliding-window layer's streamed K/V comes in as
  // its last `window` tokens alone, at their own offsets (the tokens before are stale on the
  // device, and not read); the host copy stays whole, so lifting the window brings every token
  // back, and a promotion keeps every token.
  constexpr std::size_t kWindow = 8;
  Rig rig(backend_, 4, 96, 1, 1, {0});
  rig.step(40, 1, /*check=*/false);  // prefill: 40 tokens each
  for (int l = 1; l < 4; ++l) rig.store->set_fetch_window(l, l == 3 ? 0 : kWindow);
  rig.store->synchronize();
  const KVStoreStats before = rig.store->stats();
  const int steps = 6;
  for (int s = 0; s < steps; ++s) {
    for (int l = 0; l < 4; ++l) {
      void* buffer = rig.store->acquire(l, *rig.compute);
      const std::size_t length = rig.store->length(l);
      const auto& e = rig.expected[static_cast<std::size_t>(l)];
      const std::size_t from = (l == 1 || l == 2) ? length - kWindow : 0;
      // the last kWindow tokens (or all) exactly, at their own offsets
      ASSERT_EQ(
          download(*rig.staging, *rig.compute, static_cast<char*>(buffer) + from * kTokenBytes,
                   (length - from) * kTokenBytes),
          std::vector<std::uint8_t>(e.begin() + static_cast<std::ptrdiff_t>(from * kTokenBytes),
                                    e.end()))
          << "layer " << l << " step " << s;
      rig.write_tokens(l, buffer, 1, 500 + static_cast<std::uint64_t>(s * 10 + l));
      rig.store->release(l, *rig.compute);
    }
  }
  rig.store->synchronize();
  const KVStoreStats after = rig.store->stats();
  // Each step fetched layers 1 and 2's last 8 tokens and layer 3's whole prefix (41..46); the
  // window wraps around the cycle, so every fetch of the 6 steps is counted once.
  std::size_t want = 0;
  for (int s = 0; s < steps; ++s)
    want += (2 * kWindow + 40 + static_cast<std::size_t>(s)) * kTokenBytes;
  EXPECT_EQ(after.bytes_to_device - before.bytes_to_device, want);
  // Lifted: every token again, exactly (a device copy fetched with a tail leaves first).
  rig.store->set_fetch_window(1, 0);
  EXPECT_TRUE(rig.store->promote(2));  // fetched whole, kept
  rig.step(0, 999);                    // checks every layer's every token
  rig.store->acquire(3, *rig.compute);
  EXPECT_THROW(rig.store->set_fetch_window(3, kWindow), InvalidArgument) << "acquired";
  rig.store->release(3, *rig.compute);
}

TEST_P(KVStoreTest, APromotionGetsRoomOfItsOwnNotTheSlots) {
  // One slot streams three layers; a promotion raises the budget by the layer it keeps, so the
  // slot's room stays for the layers still streamed (a budget raised one layer short once let
  // the promotion take the slot's room: the next streamed layer found none).
  // Layers nearly full, so that the budget's bytes are what the layers hold.
  Rig rig(backend_, 4, 24, 0, 1, {});
  rig.step(20, 1, false);
  rig.step(1, 2);
  EXPECT_TRUE(rig.store->promote(0));
  for (int s = 0; s < 2; ++s) rig.step(1, 10 + s);  // layers 1-3 still stream through the slot
  rig.step(0, 99);
  EXPECT_TRUE(rig.store->promote(2));
  rig.step(1, 20);
  rig.step(0, 98);
  const KVStoreStats st = rig.store->stats();
  EXPECT_EQ(st.resident_layers, 2);
  EXPECT_EQ(st.promotions, 2u);
  EXPECT_EQ(st.promotion_failures, 0u);
}

TEST_P(KVStoreTest, DroppedSlotsGiveTheirMemoryBackAndDecodeGoesOn) {
  Rig rig(backend_, 6, 64, 2, 3, {0});
  rig.step(30, 1, false);
  rig.step(1, 2);
  const std::size_t before = rig.store->stats().device_bytes;
  EXPECT_TRUE(rig.store->drop_slot());
  EXPECT_EQ(rig.store->stats().slots, 2);
  EXPECT_LT(rig.store->stats().device_bytes, before);
  EXPECT_TRUE(rig.store->drop_slot());
  EXPECT_FALSE(rig.store->drop_slot()) << "the last slot of streamed layers stays";
  for (int s = 0; s < scaled(6); ++s) rig.step(1, 10 + s);  // every layer still exact
  rig.step(0, 99);
  rig.store->clear();  // a cleared store does not bring dropped slots back
  for (auto& e : rig.expected) e.clear();
  rig.step(3, 200, false);
  rig.step(0, 201);
  EXPECT_EQ(rig.store->stats().slots, 1);
}

TEST_P(KVStoreTest, HostAttendedLayersAreReadAndWrittenOnTheHostAndNeverFetched) {
  // Note [Host-side appends]: after prefill, streamed layers 1, 2, 4 are attended on the host.
  // Their rows are read in place (exactly what compute wrote, its last write-through landed),
  // decode's new rows go into the host copy by memcpy, nothing of theirs moves over the link,
  // the slots can all go, and the other layers keep streaming or staying exact.
  Rig rig(backend_, 6, 64, 2, 2, {0, 3});
  rig.step(30, 1, /*check=*/false);  // prefill: every layer on the device, streamed ones through
  rig.store->attend_on_host(1);
  rig.store->attend_on_host(2);
  rig.store->attend_on_host(4);
  rig.store->attend_on_host(4);  // (again: no-op)
  EXPECT_TRUE(rig.store->host_attended(2));
  EXPECT_FALSE(rig.store->host_attended(5));
  EXPECT_TRUE(rig.store->drop_slot()) << "layer 5 alone streams: one slot is enough";
  EXPECT_FALSE(rig.store->drop_slot());
  const KVStoreStats before = rig.store->stats();
  const int steps = scaled(6);
  auto host_layer = [&](int l, std::size_t count, std::uint64_t seed) {
    const auto* rows = static_cast<const std::uint8_t*>(rig.store->host_rows(l));
    const auto& e = rig.expected[static_cast<std::size_t>(l)];
    ASSERT_EQ(rig.store->length(l) * kTokenBytes, e.size());
    ASSERT_TRUE(std::equal(e.begin(), e.end(), rows)) << "layer " << l;
    if (count == 0) return;
    std::vector<std::uint8_t> bytes = random_bytes(count * kTokenBytes, seed);
    rig.store->host_wrote(l, rig.store->length(l), count, bytes.data());
    auto& ex = rig.expected[static_cast<std::size_t>(l)];
    ex.insert(ex.end(), bytes.begin(), bytes.end());
  };
  for (int s = 0; s <= steps; ++s) {
    const std::size_t count = s < steps ? 1 : 0;  // (the last pass only checks)
    for (int l = 0; l < 6; ++l) {
      if (rig.store->host_attended(l)) {
        host_layer(l, count, 500 + 10 * static_cast<std::uint64_t>(s) + static_cast<unsigned>(l));
        continue;
      }
      void* buffer = rig.store->acquire(l, *rig.compute);
      rig.check_contents(l, buffer);
      if (count) rig.write_tokens(l, buffer, 1, 900 + 10 * static_cast<std::uint64_t>(s) + l);
      rig.store->release(l, *rig.compute);
    }
  }
  rig.store->synchronize();
  const KVStoreStats st = rig.store->stats();
  EXPECT_EQ(st.host_attended_layers, 3);
  EXPECT_EQ(st.bytes_written_on_host, 3u * kTokenBytes * static_cast<std::size_t>(steps));
  // Only layer 5 moved: its appends to the host, its fills (at most one per pass, plus the
  // window's wrap) of its valid prefix.
  EXPECT_EQ(st.bytes_to_host - before.bytes_to_host, kTokenBytes * static_cast<std::size_t>(steps));
  std::uint64_t most = 0;
  for (int s = 0; s <= steps + 1; ++s) most += kTokenBytes * (30 + static_cast<std::size_t>(s));
  EXPECT_LE(st.bytes_to_device - before.bytes_to_device, most);
  EXPECT_THROW(rig.store->acquire(1, *rig.compute), InvalidArgument);
  EXPECT_THROW(rig.store->promote(2), InvalidArgument);
  EXPECT_THROW(rig.store->attend_on_host(0), InvalidArgument);  // resident
  EXPECT_THROW(rig.store->host_rows(5), InvalidArgument);       // not host-attended
  std::vector<std::uint8_t> row(kTokenBytes);
  EXPECT_THROW(rig.store->host_wrote(1, rig.store->length(1) + 1, 1, row.data()),
               InvalidArgument);                                               // a gap
  EXPECT_THROW(rig.store->host_wrote(1, 64, 1, row.data()), InvalidArgument);  // capacity
  // A rollback on the host side, then a new sequence: clear() forgets the host attendance.
  rig.store->truncate(1, 20);
  EXPECT_EQ(rig.store->length(1), 20u);
  rig.store->clear();
  EXPECT_FALSE(rig.store->host_attended(1));
  for (auto& e : rig.expected) e.clear();
  rig.step(4, 77, false);
  rig.step(0, 78);
}

TEST_P(KVStoreTest, LayersOfTheirOwnSizeHoldRingsThatWrapExactly) {
  // Note [Layers of their own size]: layers 1 and 3 hold 12 tokens (a sliding window's ring),
  // 0 and 2 hold 64. A ring's writes wrap: token p goes to row p mod 12, over the rows written
  // before (a write inside the valid rows is allowed); every fetch of a streamed ring brings its
  // 12 rows exactly as last written, its host copy is 12 rows, and a write past its own
  // capacity is refused naming it. One slot streams layers 1-3: its room is the largest of them.
  constexpr std::size_t kRing = 12;
  Rig rig(backend_, 4, 64, 1, 1, {0}, 0, {64, kRing, 64, kRing});
  EXPECT_EQ(rig.store->capacity(1), kRing);
  EXPECT_EQ(rig.store->capacity(2), 64u);
  EXPECT_EQ(rig.store->layer_bytes(3), kRing * kTokenBytes);
  std::size_t tokens = 0;
  auto pass = [&](std::size_t count, std::uint64_t seed) {
    for (int l = 0; l < 4; ++l) {
      void* buffer = rig.store->acquire(l, *rig.compute);
      rig.check_contents(l, buffer);
      const std::size_t cap = rig.store->capacity(l);
      auto& e = rig.expected[static_cast<std::size_t>(l)];
      for (std::size_t p = tokens; p < tokens + count; ++p) {
        const std::size_t at = p % cap;  // (one token at a time: a wrap splits the writes)
        rig.store->reserve(l, std::max(rig.store->length(l), at + 1));
        PinnedBlock block = rig.staging->allocate(kTokenBytes);
        std::vector<std::uint8_t> bytes = random_bytes(kTokenBytes, seed * 1000 + p * 10 + l);
        std::memcpy(block.data(), bytes.data(), bytes.size());
        rig.backend->copy_async(static_cast<char*>(buffer) + at * kTokenBytes, block.data(),
                                bytes.size(), rig.compute->handle());
        block.record_use(rig.compute);
        if (e.size() < (at + 1) * kTokenBytes) e.resize((at + 1) * kTokenBytes);
        std::copy(bytes.begin(), bytes.end(),
                  e.begin() + static_cast<std::ptrdiff_t>(at * kTokenBytes));
        rig.store->wrote(l, at, 1, *rig.compute);
      }
      rig.store->release(l, *rig.compute);
    }
    tokens += count;
  };
  pass(10, 1);                                          // prefill: 10 tokens, no wrap yet
  for (int s = 0; s < 9; ++s) pass(1 + s % 3, 10 + s);  // wraps the rings (not scaled)
  pass(0, 99);                                          // checks every layer
  ASSERT_GT(tokens, 2 * kRing);
  EXPECT_EQ(rig.store->length(1), kRing) << "a wrapped ring keeps its rows valid";
  EXPECT_EQ(rig.store->length(2), tokens);
  rig.store->synchronize();
  const KVStoreStats st = rig.store->stats();
  EXPECT_EQ(st.host_bytes, (2 * kRing + 64) * kTokenBytes) << "host copies of their own size";
  rig.store->acquire(1, *rig.compute);
  try {
    rig.store->wrote(1, kRing, 1, *rig.compute);
    ADD_FAILURE() << "a write past the ring's capacity was taken";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("layer 1's capacity of 12"), std::string::npos)
        << e.what();
  }
  rig.store->release(1, *rig.compute);
  // A ring promoted keeps its rows and takes a ring's room.
  EXPECT_TRUE(rig.store->promote(3));
  pass(2, 300);
  pass(0, 301);
  auto refused = [&](std::vector<std::size_t> caps, std::size_t page, const char* what) {
    KVStoreOptions o;
    o.num_layers = 2;
    o.token_bytes = kTokenBytes;
    o.capacity_tokens = 64;
    o.page_tokens = page;
    o.layer_capacity_tokens = std::move(caps);
    try {
      KVStore s(rig.engine, rig.arena, o);
      ADD_FAILURE() << "taken: " << what;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  refused({64}, 0, "has 1 entries for 2 layers");
  refused({64, 65}, 0, "layer_capacity_tokens[1] = 65 must be in [1, 64]");
  refused({64, 0}, 0, "layer_capacity_tokens[1] = 0");
  refused({64, 12}, 8, "cannot be paged");
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
  EXPECT_NE(message([&] { rig.store->reserve(1, 1); }).find("not acquired"), std::string::npos);
  rig.store->acquire(1, *rig.compute);
  EXPECT_NE(message([&] { rig.store->acquire(1, *rig.compute); }).find("already acquired"),
            std::string::npos);
  EXPECT_NE(message([&] { rig.store->wrote(1, 0, 17, *rig.compute); }).find("capacity of 16"),
            std::string::npos);
  EXPECT_NE(message([&] { rig.store->reserve(1, 17); }).find("capacity of 16"), std::string::npos);
  EXPECT_NE(message([&] { rig.store->wrote(1, 2, 1, *rig.compute); }).find("gap"),
            std::string::npos);
  if (rig.store->reserved_tokens(1) == 0) {
    EXPECT_NE(message([&] { rig.store->wrote(1, 0, 1, *rig.compute); }).find("not reserved"),
              std::string::npos);
  }
  // The one slot is held by layer 1: layer 2 cannot get one.
  EXPECT_NE(message([&] { rig.store->acquire(2, *rig.compute); }).find("all 1 slots"),
            std::string::npos);
  rig.store->release(1, *rig.compute);
  EXPECT_NE(message([&] { rig.store->release(1, *rig.compute); }).find("not acquired"),
            std::string::npos);
  EXPECT_NE(message([&] { rig.store->make_resident(0); }).find("already resident"),
            std::string::npos);
  EXPECT_NE(message([&] { rig.store->make_resident(2); }).find("residency is fixed"),
            std::string::npos);
  EXPECT_NE(message([&] { rig.store->promote(0); }).find("already resident"), std::string::npos);
  EXPECT_NE(message([&] {
              KVStoreOptions o;
              o.num_layers = 0;
              KVStore s(rig.engine, rig.arena, o);
            }).find("num_layers must be > 0, got 0"),
            std::string::npos);
  rig.store->close();
  EXPECT_NE(message([&] { rig.store->acquire(1, *rig.compute); }).find("closed"),
            std::string::npos);
}

TEST_P(KVStoreTest, DegradesWhenTheArenaIsShort) {
  // One slot streams three layers; then the arena is held at what is mapped (as when another
  // part of the process took the rest) and a second slot is added: it gets no new memory (the
  // streamed layers share what their allocator already holds), a promotion, which needs memory
  // of its own, fails and leaves the layer streamed, and every layer stays exact. (A prefetch
  // refused memory is counted: AppendBlockTest.APrefetchWithoutMemoryIsSkippedAndCounted.)
  Rig rig(backend_, 3, 60, 1, 1, {});
  rig.step(36, 1, /*check=*/false);
  rig.step(1, 2);
  rig.arena->set_limit_bytes(rig.arena->stats().mapped_bytes);
  rig.store->add_slot();
  EXPECT_FALSE(rig.store->promote(0)) << "no memory: the layer stays streamed";
  EXPECT_FALSE(rig.store->resident(0));
  for (int s = 0; s < scaled(4); ++s) rig.step(1, 10 + s);  // every layer still exact
  rig.step(0, 99);
  const KVStoreStats st = rig.store->stats();
  EXPECT_EQ(st.promotion_failures, 1u);
  EXPECT_EQ(st.promotions, 0u);
  EXPECT_LE(rig.arena->stats().peak_bytes, rig.arena->limit_bytes());
  // Given memory again, the layer is promoted.
  rig.arena->set_limit_bytes(0);
  EXPECT_TRUE(rig.store->promote(0));
  rig.step(1, 200);
  rig.step(0, 201);
}

INSTANTIATE_TEST_SUITE_P(Backends, KVStoreTest,
                         ::testing::Values(BackendKind::Host, BackendKind::Cuda),
                         backend_param_name);

}  // namespace
}  // namespace reviva::test
