// DiskFile's named files (a saved prompt cache is one): written, closed, opened again for
// reading with the sums kept, in both engines; what a named file refuses.
#include <reviva/disk_file.h>

#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

#include "test_util.h"

namespace reviva {
namespace {

using test::what_of;

constexpr std::size_t kBlock = 16 << 10;

class DiskFileTest : public ::testing::TestWithParam<DiskEngine> {
 protected:
  void SetUp() override {
    path_ = std::filesystem::temp_directory_path() /
            ("reviva-file-" + std::to_string(::getpid()) + "-" +
             std::to_string(GetParam() == DiskEngine::IoUring));
    std::filesystem::remove(path_);
    if (GetParam() == DiskEngine::IoUring) {
      DiskFile probe("", DiskFileMode::Temporary);
      if (!probe.io_uring())
        GTEST_SKIP() << "the kernel refuses io_uring here (" << probe.why_not_io_uring()
                     << "): the thread engine's variant runs";
    }
  }
  void TearDown() override { std::filesystem::remove(path_); }
  DiskFileOptions options() const {
    DiskFileOptions o;
    o.block_bytes = kBlock;
    o.engine = GetParam();
    return o;
  }
  std::string path_;
};

TEST_P(DiskFileTest, ANamedFileReadsBackInAnotherOpeningWithItsSums) {
  std::mt19937 rng(3);
  std::vector<char> data(5 * kBlock + 1234);
  for (auto& c : data) c = static_cast<char>(rng());
  std::vector<std::uint32_t> sums(6);
  {
    DiskFile f(path_, DiskFileMode::Create, options());
    f.reserve(data.size());
    f.write(0, data.data(), data.size(), sums.data()).wait();
    f.sync();
    EXPECT_GE(f.size(), data.size());
    EXPECT_EQ(f.counters().bytes_written, data.size());
  }
  struct stat st {};
  ASSERT_EQ(::stat(path_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  DiskFile r(path_, DiskFileMode::Read, options());
  std::vector<char> back(data.size());
  r.read(0, back.data(), back.size(), sums.data()).wait();
  EXPECT_EQ(back, data);
  // a part: blocks 2.. to the end
  std::vector<char> part(data.size() - 2 * kBlock);
  r.read(2 * kBlock, part.data(), part.size(), sums.data() + 2).wait();
  EXPECT_EQ(std::memcmp(part.data(), data.data() + 2 * kBlock, part.size()), 0);
  // a wrong sum is a damaged block, named
  sums[3] ^= 1;
  const std::string bad = what_of([&] { r.read(0, back.data(), back.size(), sums.data()).wait(); });
  EXPECT_NE(bad.find("read of block 3 (file offset " + std::to_string(3 * kBlock)),
            std::string::npos)
      << bad;
  EXPECT_NE(bad.find(path_), std::string::npos) << bad;
  sums[3] ^= 1;
  // past the end of a truncated file: a short read, named
  ASSERT_EQ(::truncate(path_.c_str(), static_cast<off_t>(4 * kBlock + 100)), 0);
  DiskFile cut(path_, DiskFileMode::Read, options());
  const std::string s = what_of([&] { cut.read(0, back.data(), back.size(), sums.data()).wait(); });
  EXPECT_NE(s.find("short read"), std::string::npos) << s;
  EXPECT_NE(s.find("block 4"), std::string::npos) << s;
}

TEST_P(DiskFileTest, WhatANamedFileRefuses) {
  { DiskFile f(path_, DiskFileMode::Create, options()); }
  const std::string exists = what_of([&] { DiskFile f(path_, DiskFileMode::Create, options()); });
  EXPECT_NE(exists.find("cannot create " + path_ + ": EEXIST"), std::string::npos) << exists;
  DiskFile r(path_, DiskFileMode::Read, options());
  char b[16] = {};
  EXPECT_NE(what_of([&] { r.write(0, b, 16); }).find("open for reading"), std::string::npos);
  EXPECT_NE(what_of([&] { r.read(100, b, 16, nullptr); }).find("no checksums"), std::string::npos);
  std::uint32_t sum = 0;
  EXPECT_NE(what_of([&] { r.read(100, b, 16, &sum); }).find("file offset 100 is not on a block"),
            std::string::npos);
  const std::string missing =
      what_of([&] { DiskFile f(path_ + ".no", DiskFileMode::Read, options()); });
  EXPECT_NE(missing.find("ENOENT"), std::string::npos) << missing;
}

INSTANTIATE_TEST_SUITE_P(Engines, DiskFileTest,
                         ::testing::Values(DiskEngine::Threads, DiskEngine::IoUring),
                         [](const auto& info) {
                           return std::string(info.param == DiskEngine::IoUring ? "io_uring"
                                                                                : "threads");
                         });

}  // namespace
}  // namespace reviva
