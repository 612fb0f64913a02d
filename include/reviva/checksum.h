// CRC-32C (Castagnoli): the checksum of the disk tier's blocks and of files Reviva writes
// (Note [Checksums] in src/disk_file.cpp). The SSE4.2 instruction where the CPU has it (checked at
// run time), tables otherwise; both give the same value.
#pragma once

#include <reviva/export.h>

#include <cstddef>
#include <cstdint>

namespace reviva {

// The CRC-32C of `bytes` bytes at `data`, continuing from `crc` (0 starts a new sum).
REVIVA_API std::uint32_t crc32c(const void* data, std::size_t bytes,
                                std::uint32_t crc = 0) noexcept;

namespace detail {
// The table path alone (tests compare it with the instruction's).
REVIVA_API std::uint32_t crc32c_portable(const void* data, std::size_t bytes,
                                         std::uint32_t crc = 0) noexcept;
}  // namespace detail

}  // namespace reviva
