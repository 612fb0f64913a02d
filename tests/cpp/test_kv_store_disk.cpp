// KVStore's spilled layers (Note [Spilled layers] in kv_store_disk.cpp): layers whose K/V lives on
// disk between uses hold every token exactly through prefill, decode, truncation, promotion and
// clear; no more than the staged limit hold pinned host copies; only the rows a layer gained go
// back to disk; a disk failure is raised by name and never turns into wrong rows.
#include "kv_store_rig.h"

#include <atomic>

namespace reviva::test {
namespace {

constexpr std::size_t kDiskBlock = 16 * 1024;  // 85 tokens of 192 bytes: rows cross blocks

std::shared_ptr<DiskStore> small_disk(
    std::function<long(const DiskCompletion&, long)> inject = {}) {
  DiskStoreOptions o;
  o.file.block_bytes = kDiskBlock;
  o.file.queue_depth = 4;
  o.file.inject = std::move(inject);
  return std::make_shared<DiskStore>(o);
}

// `layers` layers of 600 tokens, layer 0 resident, the others streamed; `spill` of them spill.
struct SpillRig : Rig {
  SpillRig(std::shared_ptr<Backend> b, int layers, std::vector<int> spill, int staged,
           std::shared_ptr<DiskStore> disk_store, int prefetch = 2, int slots = 3)
      : Rig(std::move(b), layers, 600, prefetch, slots, {0}, 0, {},
            [&](KVStoreOptions& o) {
              o.disk = disk_store;
              o.disk_staged_layers = staged;
            }),
        disk(std::move(disk_store)) {
    for (int l : spill) store->spill_to_disk(l);
  }
  std::shared_ptr<DiskStore> disk;
};

class KVStoreDiskTest : public BackendTest {};

TEST_P(KVStoreDiskTest, SpilledLayersHoldEveryTokenThroughPrefillAndDecode) {
  for (int staged : {2, 0}) {  // the least, and the default (prefetch_layers + 3 = 5)
    SCOPED_TRACE("disk_staged_layers " + std::to_string(staged));
    SpillRig rig(backend_, 9, {1, 2, 3, 4, 5, 6, 7}, staged, small_disk());
    rig.step(300, 1, /*check=*/false);  // prefill: 300 tokens, several disk blocks a layer
    for (int s = 0; s < 40; ++s) rig.step(1, 10 + static_cast<std::uint64_t>(s));  // checks all
    rig.step(0, 99);
    const KVStoreStats st = rig.store->stats();
    EXPECT_EQ(st.spilled_layers, 7);
    EXPECT_LE(st.peak_staged_layers, staged == 0 ? 5 : staged);
    EXPECT_GE(st.peak_staged_layers, 2);
    EXPECT_GT(st.disk_reads, 0u);
    EXPECT_GT(st.bytes_from_disk, 0u);
    EXPECT_GT(st.disk_bytes, 0u);
    EXPECT_GT(rig.disk->stats().io.blocks_read, 0u);
    // Decode writes back the rows each layer gained: the disk block holding them, not the layer.
    const std::size_t layer_on_disk =
        (340 * kTokenBytes + kDiskBlock - 1) / kDiskBlock * kDiskBlock;
    EXPECT_LT(st.bytes_to_disk, 7 * layer_on_disk + 7 * 42 * 2 * kDiskBlock);
    EXPECT_EQ(rig.store->length(5), 340u);
  }
}

TEST_P(KVStoreDiskTest, OnlyTheStagedLimitHoldsPinnedCopies) {
  SpillRig rig(backend_, 8, {1, 2, 3, 4, 5, 6, 7}, 3, small_disk(), /*prefetch=*/1, /*slots=*/2);
  rig.step(200, 1, false);
  for (int s = 0; s < 5; ++s) {
    for (int l = 0; l < 8; ++l) {
      void* buffer = rig.store->acquire(l, *rig.compute);
      rig.check_contents(l, buffer);
      EXPECT_LE(rig.store->stats().staged_layers, 3) << "step " << s << " layer " << l;
      rig.write_tokens(l, buffer, 1, 500 + static_cast<std::uint64_t>(s * 8 + l));
      rig.store->release(l, *rig.compute);
    }
  }
  const KVStoreStats st = rig.store->stats();
  EXPECT_LE(st.peak_staged_layers, 3);
  // The host copies on the host are those staged (and nothing for the other spilled layers).
  EXPECT_LE(st.host_bytes, 3 * rig.store->layer_bytes());
}

TEST_P(KVStoreDiskTest, TruncatePromoteAndClearKeepSpilledLayersExact) {
  SpillRig rig(backend_, 7, {1, 2, 3, 4, 5, 6}, 2, small_disk());
  rig.step(250, 1, false);
  for (int s = 0; s < 3; ++s) {
    rig.step(4, 10 + static_cast<std::uint64_t>(s));
    for (int l = 0; l < 7; ++l) {  // assisted decoding's rollback, across a disk block's edge
      const std::size_t keep = rig.store->length(l) - 3;
      rig.store->truncate(l, keep);
      rig.expected[static_cast<std::size_t>(l)].resize(keep * kTokenBytes);
    }
  }
  rig.step(1, 40);
  ASSERT_TRUE(rig.store->promote(4));  // read back from disk, then on the device for good
  EXPECT_FALSE(rig.store->spilled(4));
  EXPECT_TRUE(rig.store->resident(4));
  for (int s = 0; s < 4; ++s) rig.step(1, 50 + static_cast<std::uint64_t>(s));
  EXPECT_EQ(rig.store->stats().spilled_layers, 5);
  rig.store->clear();  // a new sequence: the disk's room goes back
  for (auto& e : rig.expected) e.clear();
  EXPECT_EQ(rig.store->stats().disk_bytes, 0u);
  rig.step(120, 60, false);
  for (int s = 0; s < 4; ++s) rig.step(1, 70 + static_cast<std::uint64_t>(s));
  EXPECT_TRUE(rig.store->spilled(2));
}

TEST_P(KVStoreDiskTest, AFailedWriteBackIsRaisedAndTheRowsStayExact) {
  std::atomic<int> fail_writes{0};
  auto disk = small_disk([&](const DiskCompletion& c, long result) -> long {
    if (c.write && fail_writes.load() > 0) {
      --fail_writes;
      return -5;  // EIO
    }
    return result;
  });
  SpillRig rig(backend_, 6, {1, 2, 3, 4, 5}, 2, disk);
  // The first write-back (a prefilled layer's, many blocks) fails on one block. The failure
  // surfaces from the call that waits for it, naming the disk's file; the host copy still holds
  // the rows, which go to disk again, from that write's first block, at the next write-back.
  fail_writes = 1;
  bool raised = false;
  for (int s = 0; s < 3 && !raised; ++s) {
    try {
      rig.step(s == 0 ? 200 : 1, 10 + static_cast<std::uint64_t>(s), /*check=*/s > 0);
    } catch (const DiskError& e) {
      raised = true;
      EXPECT_NE(std::string(e.what()).find(rig.disk->stats().file), std::string::npos) << e.what();
    }
  }
  ASSERT_TRUE(raised);
  // The step was cut short where the error was raised: release what it held, then every layer
  // must still hold exactly what was written.
  rig.compute->synchronize();
  for (int l = 0; l < 6; ++l) {
    try {
      rig.store->release(l, *rig.compute);
    } catch (const InvalidArgument&) {
    }
  }
  for (int l = 0; l < 6; ++l)
    rig.expected[static_cast<std::size_t>(l)].resize(rig.store->length(l) * kTokenBytes);
  for (int s = 0; s < 4; ++s) rig.step(0, 90);  // every layer checked, several cycles
}

TEST_P(KVStoreDiskTest, AFailedReadIsRaisedByNameAndTheLayerRefusedUntilClear) {
  std::atomic<bool> fail_reads{false};
  auto disk = small_disk([&](const DiskCompletion& c, long result) -> long {
    if (!c.write && fail_reads.load()) {
      unsigned char* p = static_cast<unsigned char*>(c.buffer);
      p[7] ^= 0x40;  // a flipped bit: the checksum must catch it
    }
    return result;
  });
  SpillRig rig(backend_, 6, {1, 2, 3, 4, 5}, 2, disk);
  rig.step(200, 1, false);
  rig.step(1, 2);
  fail_reads = true;
  std::string what;
  int failed = -1;
  for (int l = 0; l < 6 && failed < 0; ++l) {
    try {
      void* buffer = rig.store->acquire(l, *rig.compute);
      rig.check_contents(l, buffer);
      rig.store->release(l, *rig.compute);
    } catch (const DiskError& e) {
      what = e.what();
      failed = l;
    }
  }
  ASSERT_GE(failed, 0);
  EXPECT_NE(what.find("checksum"), std::string::npos) << what;
  fail_reads = false;
  // The layer whose rows were lost is refused by name (never served with wrong rows).
  int lost = -1;
  for (int l = 1; l < 6; ++l) {
    const std::string w = what_of([&] {
      rig.store->acquire(l, *rig.compute);
      rig.store->release(l, *rig.compute);
    });
    if (w.find("lost to a disk error") != std::string::npos) lost = l;
  }
  EXPECT_GE(lost, 1);
  rig.store->clear();
  for (auto& e : rig.expected) e.clear();
  rig.step(50, 3, false);
  for (int s = 0; s < 3; ++s) rig.step(1, 4 + static_cast<std::uint64_t>(s));
}

TEST_P(KVStoreDiskTest, MisuseIsRefusedNamingTheValues) {
  Rig plain(backend_, 3, 64, 1, 1, {0});
  EXPECT_NE(what_of([&] { plain.store->spill_to_disk(1); }).find("has no disk"), std::string::npos);
  SpillRig rig(backend_, 4, {2}, 2, small_disk());
  EXPECT_NE(what_of([&] { rig.store->spill_to_disk(0); }).find("is resident"), std::string::npos);
  EXPECT_NE(what_of([&] { rig.store->make_resident(2); }).find("spills to disk"),
            std::string::npos);
  EXPECT_NE(what_of([&] {
              Rig bad(backend_, 3, 64, 1, 1, {0}, 0, {},
                      [](KVStoreOptions& o) { o.disk_staged_layers = 1; });
            }).find("disk_staged_layers must be"),
            std::string::npos);
  rig.step(10, 1, false);
  EXPECT_NE(what_of([&] { rig.store->spill_to_disk(3); }).find("residency is fixed"),
            std::string::npos);
  EXPECT_NE(what_of([&] { rig.store->attend_on_host(2); }).find("spills to disk"),
            std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Backends, KVStoreDiskTest,
                         ::testing::Values(BackendKind::Host, BackendKind::Cuda),
                         backend_param_name);

}  // namespace
}  // namespace reviva::test
