// DiskFile and crc32c on torch tensors (include/reviva/disk_file.h): a saved prompt cache's
// file (Note [Saved caches] in reviva/cache/saved.py). A tensor is read or written as its bytes:
// on the CPU (pinned or pageable), contiguous; each call waits for its blocks with the GIL
// released, so the tensor outlives every request that uses it.
#include <reviva/checksum.h>
#include <reviva/disk_file.h>

#include <pybind11/stl.h>
#include <torch/extension.h>

#include <string>
#include <vector>

namespace py = pybind11;

namespace reviva::python {
namespace {

std::size_t tensor_bytes(const torch::Tensor& t, const char* op) {
  REVIVA_CHECK_ARG(t.defined(), op, ": the tensor is None");
  REVIVA_CHECK_ARG(t.device().is_cpu() && t.is_contiguous(), op,
                   ": needs a contiguous CPU tensor (pinned or not), got one on ", t.device().str(),
                   t.is_contiguous() ? "" : ", not contiguous");
  return static_cast<std::size_t>(t.numel()) * t.element_size();
}

template <typename E>
E parse(const std::string& v, const char* what,
        std::initializer_list<std::pair<const char*, E>> opts) {
  std::string names;
  for (const auto& [name, value] : opts) {
    if (v == name) return value;
    names += names.empty() ? name : std::string(", ") + name;
  }
  throw InvalidArgument(detail::concat("DiskFile: ", what, "=", v, " is not one of ", names));
}

std::size_t blocks_of(const DiskFile& f, std::size_t bytes) {
  return (bytes + f.options().block_bytes - 1) / f.options().block_bytes;
}

}  // namespace

void bind_disk(py::module_& m) {
  m.def(
      "crc32c",
      [](const torch::Tensor& t, std::uint32_t crc) {
        const std::size_t n = tensor_bytes(t, "crc32c");
        py::gil_scoped_release release;
        return crc32c(t.data_ptr(), n, crc);
      },
      py::arg("tensor"), py::arg("crc") = 0,
      "CRC-32C of a contiguous CPU tensor's bytes, continuing from `crc`.");

  py::class_<DiskFile, std::shared_ptr<DiskFile>>(m, "DiskFile")
      .def(py::init([](const std::string& path, const std::string& mode, std::size_t block_bytes,
                       unsigned queue_depth, const std::string& engine, const std::string& direct) {
             DiskFileOptions o;
             o.block_bytes = block_bytes;
             o.queue_depth = queue_depth;
             o.engine = parse<DiskEngine>(engine, "engine",
                                          {{"auto", DiskEngine::Auto},
                                           {"io_uring", DiskEngine::IoUring},
                                           {"threads", DiskEngine::Threads}});
             o.direct = parse<DirectIo>(
                 direct, "direct",
                 {{"auto", DirectIo::Auto}, {"on", DirectIo::On}, {"off", DirectIo::Off}});
             const auto kind = parse<DiskFileMode>(mode, "mode",
                                                   {{"temporary", DiskFileMode::Temporary},
                                                    {"create", DiskFileMode::Create},
                                                    {"read", DiskFileMode::Read}});
             py::gil_scoped_release release;
             return std::make_shared<DiskFile>(path, kind, o);
           }),
           py::arg("path"), py::arg("mode"), py::arg("block_bytes") = std::size_t{1} << 20,
           py::arg("queue_depth") = 8, py::arg("engine") = "auto", py::arg("direct") = "auto")
      .def(
          "write",
          [](DiskFile& f, const torch::Tensor& t, std::uint64_t offset) {
            const std::size_t n = tensor_bytes(t, "DiskFile.write");
            std::vector<std::uint32_t> sums(blocks_of(f, n));
            py::gil_scoped_release release;
            f.write(offset, t.data_ptr(), n, sums.data()).wait();
            return sums;
          },
          py::arg("tensor"), py::arg("offset"),
          "Writes the tensor's bytes at `offset` (a multiple of block_bytes); returns each "
          "block's CRC-32C, which a read of them is given.")
      .def(
          "read",
          [](DiskFile& f, const torch::Tensor& t, std::uint64_t offset,
             const std::vector<std::uint32_t>& sums) {
            const std::size_t n = tensor_bytes(t, "DiskFile.read");
            REVIVA_CHECK_ARG(sums.size() == blocks_of(f, n), "DiskFile.read: ", sums.size(),
                             " checksums for ", n, " bytes (", blocks_of(f, n), " blocks of ",
                             f.options().block_bytes, ")");
            py::gil_scoped_release release;
            f.read(offset, t.data_ptr(), n, sums.data()).wait();
          },
          py::arg("tensor"), py::arg("offset"), py::arg("checksums"),
          "Reads the tensor's bytes from `offset`, each block checked against `checksums`; "
          "RevivaDiskError names the block, the offset and the file on any failure.")
      .def("reserve", &DiskFile::reserve, py::arg("bytes"),
           py::call_guard<py::gil_scoped_release>())
      .def("size", &DiskFile::size)
      .def("sync", &DiskFile::sync, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("path", &DiskFile::path)
      .def_property_readonly("block_bytes",
                             [](const DiskFile& f) { return f.options().block_bytes; })
      .def_property_readonly("direct_io", &DiskFile::direct_io)
      .def_property_readonly("io_uring", &DiskFile::io_uring)
      .def_property_readonly("why_not_io_uring", &DiskFile::why_not_io_uring)
      .def("counters", [](const DiskFile& f) {
        const DiskFileCounters c = f.counters();
        py::dict d;
        d["blocks_written"] = c.blocks_written;
        d["blocks_read"] = c.blocks_read;
        d["bytes_written"] = c.bytes_written;
        d["bytes_read"] = c.bytes_read;
        d["failed_blocks"] = c.failed_blocks;
        d["checksum_failures"] = c.checksum_failures;
        d["staged_blocks"] = c.staged_blocks;
        return d;
      });
}

}  // namespace reviva::python
