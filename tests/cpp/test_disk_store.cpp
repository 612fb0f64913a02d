// DiskStore: round trips through both engines, with and without O_DIRECT, aligned and staged
// buffers; every failure a disk can give (EIO, a short read, no space, a damaged byte) raised by
// name and the store usable after; the file's mode and that nothing is left behind.
#include <reviva/checksum.h>
#include <reviva/disk_store.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test_util.h"

namespace reviva {
namespace {

using test::what_of;

constexpr std::size_t kBlock = 64 << 10;  // small blocks: many per extent

struct AlignedBuffer {
  explicit AlignedBuffer(std::size_t n) : bytes(n) {
    data = static_cast<char*>(std::aligned_alloc(kDiskAlignment, round(n + kDiskAlignment)));
  }
  ~AlignedBuffer() { std::free(data); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  static std::size_t round(std::size_t n) {
    return (n + kDiskAlignment - 1) / kDiskAlignment * kDiskAlignment;
  }
  char* data;
  std::size_t bytes;
};

std::vector<char> random_bytes(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<char> out(n);
  for (auto& c : out) c = static_cast<char>(rng());
  return out;
}

// The file descriptor of the store's (unlinked) file, found through /proc.
int store_fd(const DiskStore& store) {
  const std::string want = store.stats().file + " (deleted)";
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    if (std::filesystem::read_symlink(entry.path(), ec).string() == want)
      return std::stoi(entry.path().filename().string());
  }
  return -1;
}

struct Mode {
  DiskEngine engine;
  DirectIo direct;
};
std::string mode_name(const ::testing::TestParamInfo<Mode>& info) {
  return std::string(info.param.engine == DiskEngine::IoUring ? "io_uring" : "threads") +
         (info.param.direct == DirectIo::Off ? "_cached" : "_direct");
}

class DiskStoreTest : public ::testing::TestWithParam<Mode> {
 protected:
  DiskStoreOptions options(std::size_t block = kBlock) const {
    DiskStoreOptions o;
    o.file.block_bytes = block;
    o.file.engine = GetParam().engine;
    o.file.direct = GetParam().direct == DirectIo::Off ? DirectIo::Off : DirectIo::Auto;
    o.file.queue_depth = 4;
    return o;
  }
  void SetUp() override {
    if (GetParam().engine == DiskEngine::IoUring) {
      DiskStoreOptions probe;
      DiskStore s(probe);
      if (!s.stats().io_uring)
        GTEST_SKIP() << "the kernel refuses io_uring here (" << s.stats().why_not_io_uring
                     << "): the thread engine's variants run";
    }
  }
};

TEST(Checksum, MatchesTheStandardCheckValueAndTheTablePath) {
  const char* check = "123456789";
  EXPECT_EQ(crc32c(check, 9), 0xE3069283u);
  EXPECT_EQ(detail::crc32c_portable(check, 9), 0xE3069283u);
  const auto data = random_bytes(10000, 1);
  for (std::size_t start : {0, 1, 3, 7}) {
    for (std::size_t n : {0, 1, 7, 8, 9, 63, 64, 1000, 9000}) {
      EXPECT_EQ(crc32c(data.data() + start, n), detail::crc32c_portable(data.data() + start, n))
          << start << " " << n;
      // (a sum continues: the sum of a + b from the sum of a)
      EXPECT_EQ(crc32c(data.data() + start + n, 100, crc32c(data.data() + start, n)),
                crc32c(data.data() + start, n + 100));
    }
  }
}

TEST_P(DiskStoreTest, RoundTripsRandomBytesOfManySizes) {
  DiskStore store(options());
  const auto st0 = store.stats();
  EXPECT_EQ(st0.io_uring, GetParam().engine == DiskEngine::IoUring);
  if (GetParam().direct == DirectIo::Off) {
    EXPECT_FALSE(st0.direct_io);
  }
  const std::size_t sizes[] = {
      1, 4095, 4096, 4097, kBlock - 1, kBlock, kBlock + 1, 3 * kBlock + 123, 10 * kBlock};
  unsigned seed = 0;
  for (std::size_t n : sizes) {
    for (std::size_t shift : {std::size_t{0}, std::size_t{1}}) {  // aligned, and staged
      const auto data = random_bytes(n, ++seed);
      AlignedBuffer src(n + shift), dst(n + shift);
      std::memcpy(src.data + shift, data.data(), n);
      const DiskExtent e = store.allocate(n);
      EXPECT_EQ(store.extent_bytes(e), n);
      store.write(e, 0, src.data + shift, n).wait();
      std::memset(dst.data, 0x5A, n + shift);
      store.read(e, 0, dst.data + shift, n).wait();
      ASSERT_EQ(std::memcmp(dst.data + shift, data.data(), n), 0) << n << " " << shift;
      if (n > 2 * kBlock) {  // a part, from its second block to the end
        std::vector<char> part(n - kBlock);
        store.read(e, kBlock, part.data(), part.size()).wait();
        ASSERT_EQ(std::memcmp(part.data(), data.data() + kBlock, part.size()), 0);
      }
      store.release(e);
    }
  }
  const auto st = store.stats();
  EXPECT_EQ(st.io.failed_blocks, 0u);
  EXPECT_EQ(st.extents, 0u);
  EXPECT_EQ(st.bytes_in_use, 0u);
  EXPECT_EQ(st.peak_bytes_in_use, 10 * kBlock);
  // (released space is used again: the file holds the largest extent, not their sum)
  EXPECT_EQ(st.file_bytes, 10 * kBlock);
  if (st.direct_io) {
    EXPECT_GT(st.io.staged_blocks, 0u);  // the shifted buffers and partial pages
  } else {
    EXPECT_EQ(st.io.staged_blocks, 0u);
  }
}

TEST_P(DiskStoreTest, ManyRequestsInFlightFromSeveralThreads) {
  DiskStore store(options());
  constexpr int kThreads = 4, kExtents = 16;
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<DiskExtent> ids;
      std::vector<std::vector<char>> data;
      std::vector<DiskRequest> writes;
      std::vector<std::unique_ptr<AlignedBuffer>> bufs;
      for (int i = 0; i < kExtents; ++i) {
        const std::size_t n = kBlock * (1 + i % 3) + 512 * (i % 2);
        data.push_back(random_bytes(n, 1000 * t + i));
        bufs.push_back(std::make_unique<AlignedBuffer>(n));
        std::memcpy(bufs.back()->data, data.back().data(), n);
        ids.push_back(store.allocate(n));
        writes.push_back(store.write(ids.back(), 0, bufs.back()->data, n));  // not waited yet
      }
      for (auto& w : writes) w.wait();
      std::vector<std::vector<char>> back(kExtents);
      std::vector<DiskRequest> reads;
      for (int i = 0; i < kExtents; ++i) {
        back[i].resize(data[i].size());
        reads.push_back(store.read(ids[i], 0, back[i].data(), back[i].size()));
      }
      for (int i = 0; i < kExtents; ++i) {
        reads[i].wait();
        bad += back[i] != data[i];
        store.release(ids[i]);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(store.stats().extents, 0u);
}

TEST_P(DiskStoreTest, AnEioOnWriteOrReadIsRaisedByNameAndTheStoreGoesOn) {
  std::atomic<bool> fail_write{true}, fail_read{false};
  DiskStoreOptions o = options();
  o.file.inject = [&](const DiskCompletion& c, long result) -> long {
    if (c.write && fail_write && c.block % 3 == 1) return -EIO;
    if (!c.write && fail_read && c.block % 3 == 1) return -EIO;
    return result;
  };
  DiskStore store(o);
  const auto data = random_bytes(3 * kBlock, 5);
  const DiskExtent e = store.allocate(data.size());
  const std::string w = what_of([&] { store.write(e, 0, data.data(), data.size()).wait(); });
  EXPECT_NE(w.find("write of block 1 (file offset " + std::to_string(kBlock)), std::string::npos)
      << w;
  EXPECT_NE(w.find("EIO"), std::string::npos) << w;
  EXPECT_NE(w.find(store.stats().file), std::string::npos) << w;
  // (a block whose write failed holds nothing to read; its neighbours do)
  const std::string never = what_of([&] {
    std::vector<char> b(kBlock);
    store.read(e, kBlock, b.data(), kBlock).wait();
  });
  EXPECT_NE(never.find("block 1 of extent " + std::to_string(e) + " was never written"),
            std::string::npos)
      << never;
  std::vector<char> back(data.size());
  store.read(e, 0, back.data(), kBlock).wait();
  EXPECT_EQ(std::memcmp(back.data(), data.data(), kBlock), 0);
  fail_write = false;
  store.write(e, 0, data.data(), data.size()).wait();
  fail_read = true;
  const std::string r = what_of([&] { store.read(e, 0, back.data(), back.size()).wait(); });
  EXPECT_NE(r.find("read of block 1"), std::string::npos) << r;
  EXPECT_NE(r.find("EIO"), std::string::npos) << r;
  fail_read = false;
  std::fill(back.begin(), back.end(), 0);
  store.read(e, 0, back.data(), back.size()).wait();
  EXPECT_EQ(back, data);
  EXPECT_EQ(store.stats().io.failed_blocks, 2u);
}

TEST_P(DiskStoreTest, AShortReadIsRaisedNotPassedOn) {
  std::atomic<bool> cut{false};
  DiskStoreOptions o = options();
  o.file.inject = [&](const DiskCompletion& c, long result) -> long {
    return (!c.write && cut) ? result - 512 : result;
  };
  DiskStore store(o);
  const auto data = random_bytes(2 * kBlock, 6);
  const DiskExtent e = store.allocate(data.size());
  store.write(e, 0, data.data(), data.size()).wait();
  cut = true;
  std::vector<char> back(data.size());
  const std::string r = what_of([&] { store.read(e, 0, back.data(), back.size()).wait(); });
  EXPECT_NE(r.find("short read (" + std::to_string(kBlock - 512) + " of " + std::to_string(kBlock)),
            std::string::npos)
      << r;
  EXPECT_NE(r.find("and 1 more blocks"), std::string::npos) << r;
  cut = false;
  store.read(e, 0, back.data(), back.size()).wait();
  EXPECT_EQ(back, data);
}

TEST_P(DiskStoreTest, ADamagedByteOnDiskFailsItsChecksum) {
  DiskStore store(options());
  const auto data = random_bytes(3 * kBlock + 100, 7);
  const DiskExtent e = store.allocate(data.size());
  store.write(e, 0, data.data(), data.size()).wait();
  // one byte of block 2 changed in the file itself (the page cache is written back before an
  // O_DIRECT read of the range)
  const int direct_fd = store.fd();
  ASSERT_GE(direct_fd, 0);
  // (opened again without O_DIRECT, which refuses a one-byte write)
  const int fd = ::open(("/proc/self/fd/" + std::to_string(direct_fd)).c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  const off_t at = static_cast<off_t>(2 * kBlock + 777);
  char byte = 0;
  ASSERT_EQ(::pread(fd, &byte, 1, at), 1);
  byte = static_cast<char>(byte ^ 0x10);
  ASSERT_EQ(::pwrite(fd, &byte, 1, at), 1);
  ::close(fd);
  std::vector<char> back(data.size(), 0);
  const std::string r = what_of([&] { store.read(e, 0, back.data(), back.size()).wait(); });
  EXPECT_NE(r.find("read of block 2 (file offset " + std::to_string(2 * kBlock)), std::string::npos)
      << r;
  EXPECT_NE(r.find("checksum 0x"), std::string::npos) << r;
  EXPECT_EQ(store.stats().io.checksum_failures, 1u);
  // the undamaged blocks read, and a rewrite heals the damaged one
  store.read(e, 0, back.data(), 2 * kBlock).wait();
  EXPECT_EQ(std::memcmp(back.data(), data.data(), 2 * kBlock), 0);
  store.write(e, 2 * kBlock, data.data() + 2 * kBlock, data.size() - 2 * kBlock).wait();
  store.read(e, 0, back.data(), back.size()).wait();
  EXPECT_EQ(back, data);
}

TEST_P(DiskStoreTest, AFlippedByteInAStagedReadNeverReachesTheCallersMemory) {
  std::atomic<bool> flip{false};
  DiskStoreOptions o = options();
  o.file.inject = [&](const DiskCompletion& c, long result) -> long {
    if (!c.write && flip) static_cast<char*>(c.buffer)[100] ^= 1;
    return result;
  };
  DiskStore store(o);
  const auto data = random_bytes(kBlock, 8);
  const DiskExtent e = store.allocate(data.size());
  store.write(e, 0, data.data(), data.size()).wait();
  flip = true;
  AlignedBuffer dst(kBlock + 1);
  std::memset(dst.data, 0x33, kBlock + 1);
  const std::string r = what_of([&] { store.read(e, 0, dst.data + 1, kBlock).wait(); });
  EXPECT_NE(r.find("checksum"), std::string::npos) << r;
  if (store.stats().direct_io) {  // (staged: the caller's bytes untouched)
    for (std::size_t i = 1; i <= kBlock; ++i) ASSERT_EQ(dst.data[i], 0x33) << i;
  }
}

TEST_P(DiskStoreTest, NoSpaceOnAnEnospcInjectedWriteIsRaisedByName) {
  DiskStoreOptions o = options();
  o.file.inject = [](const DiskCompletion& c, long result) -> long {
    return c.write && c.block == 0 ? -ENOSPC : result;
  };
  DiskStore store(o);
  const auto data = random_bytes(kBlock, 9);
  const DiskExtent e = store.allocate(kBlock);
  const std::string w = what_of([&] { store.write(e, 0, data.data(), kBlock).wait(); });
  EXPECT_NE(w.find("ENOSPC"), std::string::npos) << w;
}

TEST_P(DiskStoreTest, RequestsInFlightHoldTheirBlocks) {
  std::atomic<bool> hold{true};
  DiskStoreOptions o = options();
  o.file.inject = [&](const DiskCompletion&, long result) -> long {
    while (hold) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return result;
  };
  DiskStore store(o);
  const auto data = random_bytes(kBlock, 10);
  const DiskExtent e = store.allocate(kBlock);
  DiskRequest w = store.write(e, 0, data.data(), kBlock);
  EXPECT_FALSE(w.ready());
  std::vector<char> back(kBlock);
  EXPECT_NE(what_of([&] { store.read(e, 0, back.data(), kBlock); }).find("has a write in flight"),
            std::string::npos);
  EXPECT_NE(what_of([&] { store.write(e, 0, data.data(), kBlock); }).find("has a write in flight"),
            std::string::npos);
  EXPECT_NE(what_of([&] { store.release(e); }).find("requests in flight"), std::string::npos);
  hold = false;
  w.wait();
  EXPECT_TRUE(w.ready());
  store.read(e, 0, back.data(), kBlock).wait();
  EXPECT_EQ(back, data);
  store.release(e);
}

TEST_P(DiskStoreTest, BadInputIsRefusedNamingTheValue) {
  DiskStoreOptions bad = options(1000);
  EXPECT_NE(what_of([&] { DiskStore s(bad); }).find("block_bytes 1000"), std::string::npos);
  bad = options();
  bad.file.queue_depth = 0;
  EXPECT_NE(what_of([&] { DiskStore s(bad); }).find("queue_depth 0"), std::string::npos);
  bad = options();
  bad.directory = "/no/such/folder";
  EXPECT_NE(what_of([&] { DiskStore s(bad); }).find("/no/such/folder"), std::string::npos);
  DiskStore store(options());
  std::vector<char> b(2 * kBlock);
  EXPECT_NE(what_of([&] { store.read(42, 0, b.data(), 1); }).find("no extent 42"),
            std::string::npos);
  const DiskExtent e = store.allocate(2 * kBlock);
  EXPECT_NE(what_of([&] { store.write(e, 100, b.data(), 10); }).find("do not start on a block"),
            std::string::npos);
  EXPECT_NE(what_of([&] {
              store.write(e, 0, b.data(), 3 * kBlock);
            }).find("(" + std::to_string(2 * kBlock) + " bytes)"),
            std::string::npos);
  EXPECT_NE(what_of([&] { store.read(e, 0, b.data(), kBlock); }).find("never written"),
            std::string::npos);
  EXPECT_NE(what_of([&] { store.allocate(0); }).find("0 bytes"), std::string::npos);
  EXPECT_NE(what_of([&] { store.release(e + 1); }).find("no extent"), std::string::npos);
}

TEST_P(DiskStoreTest, CapacityIsAnOutOfMemoryNamingTheBytesAndReleasedSpaceIsReused) {
  DiskStoreOptions o = options();
  o.capacity_bytes = 4 * kBlock;
  DiskStore store(o);
  const DiskExtent a = store.allocate(kBlock), b = store.allocate(2 * kBlock);
  try {
    store.allocate(2 * kBlock);
    ADD_FAILURE() << "no OutOfMemory";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("no room for " + std::to_string(2 * kBlock) + " bytes"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("capacity " + std::to_string(4 * kBlock)),
              std::string::npos)
        << e.what();
  }
  store.release(a);
  store.release(b);  // (merged with a's blocks: three free blocks in a row)
  const DiskExtent c = store.allocate(3 * kBlock);
  const auto data = random_bytes(3 * kBlock, 11);
  store.write(c, 0, data.data(), data.size()).wait();
  std::vector<char> back(data.size());
  store.read(c, 0, back.data(), back.size()).wait();
  EXPECT_EQ(back, data);
  EXPECT_EQ(store.stats().file_bytes, 3 * kBlock);
}

TEST_P(DiskStoreTest, TheFileIsPrivateUnlinkedAndItsFolderGoesAtClose) {
  std::string folder;
  {
    DiskStore store(options());
    const auto st = store.stats();
    folder = std::filesystem::path(st.file).parent_path();
    EXPECT_FALSE(std::filesystem::exists(st.file));  // (unlinked once open)
    EXPECT_TRUE(std::filesystem::is_empty(folder));
    const int fd = store.fd();
    EXPECT_EQ(fd, store_fd(store));  // (the file's only name is the process's descriptor)
    struct stat s {};
    ASSERT_EQ(::fstat(fd, &s), 0);
    EXPECT_EQ(s.st_mode & 0777, 0600u);
    const DiskExtent e = store.allocate(kBlock);
    const auto data = random_bytes(kBlock, 12);
    store.write(e, 0, data.data(), kBlock);  // (not waited: the request's destructor waits)
  }
  EXPECT_FALSE(std::filesystem::exists(folder));
  // a folder the caller gives is kept, and left empty
  const std::string mine =
      std::filesystem::temp_directory_path() / ("reviva-test-" + std::to_string(::getpid()));
  std::filesystem::create_directory(mine);
  {
    DiskStoreOptions o = options();
    o.directory = mine;
    DiskStore store(o);
    EXPECT_EQ(std::filesystem::path(store.stats().file).parent_path(), mine);
  }
  EXPECT_TRUE(std::filesystem::is_empty(mine));
  std::filesystem::remove(mine);
}

// A real full file system: a 1 MiB tmpfs, where mounting is allowed (root here and in CI).
TEST_P(DiskStoreTest, AFullFileSystemIsRaisedByNameAndTheStoreGoesOn) {
  const std::string at =
      std::filesystem::temp_directory_path() / ("reviva-small-" + std::to_string(::getpid()));
  std::filesystem::create_directory(at);
  if (::mount("tmpfs", at.c_str(), "tmpfs", 0, "size=1m") != 0) {
    const int error = errno;
    std::filesystem::remove(at);
    GTEST_SKIP() << "cannot mount a small tmpfs here (" << std::strerror(error)
                 << "): the injected ENOSPC test covers the message, RLIMIT_FSIZE the rest";
  }
  {
    DiskStoreOptions o = options();
    o.directory = at;
    DiskStore store(o);
    const std::string full = what_of([&] { store.allocate(4 << 20); });
    EXPECT_NE(full.find("no space for " + std::to_string(4 << 20) + " bytes"), std::string::npos)
        << full;
    EXPECT_NE(full.find("ENOSPC"), std::string::npos) << full;
    const auto data = random_bytes(4 * kBlock, 13);
    const DiskExtent e = store.allocate(data.size());
    store.write(e, 0, data.data(), data.size()).wait();
    std::vector<char> back(data.size());
    store.read(e, 0, back.data(), back.size()).wait();
    EXPECT_EQ(back, data);
  }
  ::umount(at.c_str());
  std::filesystem::remove(at);
}

// A file-size limit (RLIMIT_FSIZE, unprivileged): the kernel's EFBIG, by name.
TEST_P(DiskStoreTest, AFileSizeLimitIsRaisedByName) {
  DiskStore store(options());
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit small = old;
  small.rlim_cur = 2 * kBlock;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const std::string big = what_of([&] { store.allocate(8 * kBlock); });
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_NE(big.find("no space for " + std::to_string(8 * kBlock)), std::string::npos) << big;
  EXPECT_NE(big.find("EFBIG"), std::string::npos) << big;
  const DiskExtent e = store.allocate(kBlock);
  const auto data = random_bytes(kBlock, 14);
  store.write(e, 0, data.data(), kBlock).wait();
}

INSTANTIATE_TEST_SUITE_P(Engines, DiskStoreTest,
                         ::testing::Values(Mode{DiskEngine::Threads, DirectIo::Auto},
                                           Mode{DiskEngine::Threads, DirectIo::Off},
                                           Mode{DiskEngine::IoUring, DirectIo::Auto},
                                           Mode{DiskEngine::IoUring, DirectIo::Off}),
                         mode_name);

}  // namespace
}  // namespace reviva
