// Table rows by index (Backend::gather_rows_async; Note [Embedding on the host] in
// python/reviva/weights/host_embedding.py): the host reference's rows and zeros, then each backend
// against it with the table in device memory and in pinned host memory (read in place by the CUDA
// kernel), at row sizes that take each access width, and bad arguments named.
#include "test_util.h"

#include <cstring>
#include <string>
#include <vector>

namespace reviva::test {
namespace {

using GatherRows = BackendTest;

// Indices with repeats, both ends of the table, and three outside it (zeros).
std::vector<std::int64_t> some_ids(std::size_t rows) {
  const auto last = static_cast<std::int64_t>(rows) - 1;
  return {3, 0, last, 3, -1, 7, static_cast<std::int64_t>(rows), 1, last, 1 << 30};
}

std::vector<std::uint8_t> reference(const std::vector<std::uint8_t>& table, std::size_t rows,
                                    std::size_t row_bytes, const std::vector<std::int64_t>& ids) {
  std::vector<std::uint8_t> out(ids.size() * row_bytes, 0xEE);
  RowGather g{table.data(), rows, row_bytes, ids.data(), ids.size(), out.data()};
  gather_rows(g);
  return out;
}

TEST(GatherRowsReference, RowsByIndexAndZerosOutsideTheTable) {
  const std::size_t rows = 9, row_bytes = 6;
  const std::vector<std::uint8_t> table = random_bytes(rows * row_bytes, 5);
  const std::vector<std::int64_t> ids = some_ids(rows);
  const std::vector<std::uint8_t> out = reference(table, rows, row_bytes, ids);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::uint8_t* got = out.data() + i * row_bytes;
    if (ids[i] < 0 || ids[i] >= static_cast<std::int64_t>(rows)) {
      for (std::size_t b = 0; b < row_bytes; ++b) EXPECT_EQ(got[b], 0) << "row " << i;
    } else {
      EXPECT_EQ(std::memcmp(got, table.data() + ids[i] * row_bytes, row_bytes), 0) << "row " << i;
    }
  }
}

// The backend's gather of `ids` from `table` placed in device memory (or pinned host memory),
// ids and output in device memory.
std::vector<std::uint8_t> run(const std::shared_ptr<Backend>& backend,
                              const std::vector<std::uint8_t>& table, std::size_t rows,
                              std::size_t row_bytes, const std::vector<std::int64_t>& ids,
                              bool table_on_host, std::size_t out_offset = 0) {
  Stream s(backend);
  const std::size_t ids_bytes = ids.size() * sizeof(std::int64_t);
  const std::size_t out_bytes = ids.size() * row_bytes;
  void* host_table = backend->allocate_pinned_host(table.size());
  void* host_ids = backend->allocate_pinned_host(ids_bytes);
  void* host_out = backend->allocate_pinned_host(out_bytes + out_offset);
  std::memcpy(host_table, table.data(), table.size());
  std::memcpy(host_ids, ids.data(), ids_bytes);
  void* dev_table = table_on_host ? nullptr : backend->allocate_device(table.size(), s.handle());
  void* dev_ids = backend->allocate_device(ids_bytes, s.handle());
  void* dev_out = backend->allocate_device(out_bytes + out_offset, s.handle());
  if (dev_table) backend->copy_async(dev_table, host_table, table.size(), s.handle());
  backend->copy_async(dev_ids, host_ids, ids_bytes, s.handle());
  backend->memset_async(dev_out, 0xEE, out_bytes + out_offset, s.handle());
  RowGather g{dev_table ? dev_table : host_table,
              rows,
              row_bytes,
              static_cast<const std::int64_t*>(dev_ids),
              ids.size(),
              static_cast<std::uint8_t*>(dev_out) + out_offset};
  backend->gather_rows_async(g, s.handle());
  backend->copy_async(host_out, dev_out, out_bytes + out_offset, s.handle());
  s.synchronize();
  std::vector<std::uint8_t> out(out_bytes);
  std::memcpy(out.data(), static_cast<std::uint8_t*>(host_out) + out_offset, out_bytes);
  for (void* p : {dev_table, dev_ids, dev_out})
    if (p) backend->free_device(p, s.handle());
  s.synchronize();
  for (void* p : {host_table, host_ids, host_out}) backend->free_pinned_host(p);
  return out;
}

TEST_P(GatherRows, EveryAccessWidthGivesTheReferenceBytes) {
  // 4096-byte rows (16-byte accesses; a 2048-wide bf16 embedding), 12 (4-byte), 7 (bytes); and
  // 16-byte rows written at an odd offset (the narrow path for an unaligned output).
  struct Case {
    std::size_t rows, row_bytes, out_offset;
  };
  for (const Case c : {Case{33, 4096, 0}, Case{50, 12, 0}, Case{40, 7, 0}, Case{20, 16, 3}}) {
    const std::vector<std::uint8_t> table = random_bytes(c.rows * c.row_bytes, c.row_bytes);
    const std::vector<std::int64_t> ids = some_ids(c.rows);
    const std::vector<std::uint8_t> want = reference(table, c.rows, c.row_bytes, ids);
    for (bool on_host : {false, true}) {
      const std::vector<std::uint8_t> got =
          run(backend_, table, c.rows, c.row_bytes, ids, on_host, c.out_offset);
      EXPECT_EQ(got, want) << c.row_bytes << "-byte rows, table in "
                           << (on_host ? "pinned host" : "device") << " memory";
    }
  }
}

TEST_P(GatherRows, ManyRowsMoreThanTheGridHolds) {
  // More rows than the launch's blocks (8192): each block takes several.
  const std::size_t rows = 1000, row_bytes = 64;
  const std::vector<std::uint8_t> table = random_bytes(rows * row_bytes, 17);
  std::vector<std::int64_t> ids(20000);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int64_t>((i * 7) % rows);
  EXPECT_EQ(run(backend_, table, rows, row_bytes, ids, true),
            reference(table, rows, row_bytes, ids));
}

TEST_P(GatherRows, BadArgumentsAreNamed) {
  Stream s(backend_);
  std::uint8_t table[16] = {};
  std::int64_t ids[1] = {0};
  std::uint8_t out[16];
  RowGather g{table, 1, 0, ids, 1, out};
  try {
    backend_->gather_rows_async(g, s.handle());
    ADD_FAILURE() << "rows of 0 bytes were taken";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("row_bytes"), std::string::npos) << e.what();
  }
  g = RowGather{table, 0, 16, ids, 1, out};
  EXPECT_THROW(backend_->gather_rows_async(g, s.handle()), InvalidArgument);
  g = RowGather{nullptr, 1, 16, ids, 1, out};
  EXPECT_THROW(backend_->gather_rows_async(g, s.handle()), InvalidArgument);
  g = RowGather{nullptr, 0, 0, nullptr, 0, nullptr};  // nothing to gather: nothing checked
  EXPECT_NO_THROW(backend_->gather_rows_async(g, s.handle()));
  s.synchronize();
}

INSTANTIATE_TEST_SUITE_P(Backends, GatherRows,
                         ::testing::Values(BackendKind::Host, BackendKind::Cuda),
                         backend_param_name);

}  // namespace
}  // namespace reviva::test
