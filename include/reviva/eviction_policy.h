// Eviction policies: which resident block leaves the device when room is needed.
//
// A policy only decides; the OffloadManager keeps the blocks and does the moving. Policies see
// every registration, access (acquire), eviction and step boundary, and are asked to choose among
// the blocks that may leave now (resident, not in use). They are called with the manager's mutex
// held and never call the backend.
//
//   LRU     the least recently accessed block.
//   2Q      Johnson & Shasha's 2Q: blocks seen once wait in a FIFO (A1in) and are evicted first;
//           blocks seen again, or re-admitted while remembered in the ghost queue (A1out), live
//           in an LRU (Am). Scans of one-time blocks do not flush the hot set.
//   Belady  schedule-aware: the block whose next access is farthest away, read from the access
//           trace of the previous step (transformer steps repeat, so the trace of step N is a
//           near-perfect oracle for step N+1). Until a trace exists it behaves as LRU.
#pragma once

#include <reviva/export.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

namespace reviva {

using BlockId = std::uint64_t;
inline constexpr BlockId kInvalidBlock = 0;

enum class PolicyKind { Lru, TwoQ, Belady };
REVIVA_API const char* to_string(PolicyKind kind) noexcept;
// "lru", "2q", "belady" (case-insensitive); InvalidArgument naming the value otherwise.
REVIVA_API PolicyKind parse_policy(std::string_view name);

class REVIVA_API EvictionPolicy {
 public:
  virtual ~EvictionPolicy();
  virtual std::string name() const = 0;
  virtual void on_register(BlockId id, std::size_t bytes) = 0;
  virtual void on_unregister(BlockId id) = 0;
  virtual void on_access(BlockId id) = 0;
  virtual void on_evict(BlockId id) = 0;
  virtual void on_step_end() {}
  // The block to evict among `candidates` (non-empty, each registered and resident).
  virtual BlockId choose_victim(std::span<const BlockId> candidates) = 0;
};

REVIVA_API std::unique_ptr<EvictionPolicy> make_policy(PolicyKind kind);

}  // namespace reviva
