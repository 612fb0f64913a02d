// What the OffloadManager measured: bytes moved, copy time, time compute waited for copies
// (stall), the overlap of copies with compute, device memory held against the budget, and a
// timeline of every copy and every wait that tools turn into a trace.
#pragma once

#include <reviva/eviction_policy.h>
#include <reviva/export.h>

#include <cstddef>
#include <cstdint>

namespace reviva {

// Note [Overlap ratio]
// The one definition of how well copies hid under compute, used by every figure Reviva reports
// (the transfer engine's, the offload manager's, RevivaManager's and the training offload's):
// the part of the copy streams' busy time (both directions) that compute did not wait for,
//     overlap_ratio = 1 - compute_stall_ms / copy_busy_ms, clamped to [0, 1]; 1 with no copies.
// A stall is compute waiting for a copy it needs (measured on the compute stream, between two
// events around the wait); host-side waits are reported apart (the device may be busy then).
REVIVA_API double overlap_ratio(double compute_stall_ms, double copy_busy_ms) noexcept;

struct ManagerMetrics {
  std::uint64_t bytes_to_host = 0;    // completed D2H copies
  std::uint64_t bytes_to_device = 0;  // completed H2D copies
  double to_host_busy_ms = 0.0;       // copy-stream time of those copies
  double to_device_busy_ms = 0.0;
  // Time compute streams waited at acquire() for a block still being copied (measured on the
  // GPU between two events around the wait): copy time that compute did not hide.
  double compute_stall_ms = 0.0;
  // Time the calling thread blocked waiting for device memory to be freed (evictions in flight).
  double host_wait_ms = 0.0;
  // Note [Overlap ratio], over this manager's copies and stalls.
  double overlap_ratio = 1.0;
  std::size_t budget_bytes = 0;
  std::size_t device_bytes = 0;  // held now (resident, in flight, being freed)
  std::size_t peak_device_bytes = 0;
  std::size_t registered_bytes = 0;    // bytes of all registered blocks
  std::size_t device_bytes_saved = 0;  // registered - held now
  std::size_t peak_registered_bytes = 0;
  std::uint64_t evictions = 0;         // blocks that left the device
  std::uint64_t clean_evictions = 0;   // of those, with a valid host copy: no D2H needed
  std::uint64_t prefetches = 0;        // H2D started ahead of use
  std::uint64_t prefetch_hits = 0;     // acquires of prefetched blocks that did not stall
  std::uint64_t prefetch_late = 0;     // acquires of prefetched blocks that stalled
  std::uint64_t prefetch_misses = 0;   // acquires that found the block on the host (demand fetch)
  std::uint64_t timeline_dropped = 0;  // timeline events not kept (capacity reached)
  // Append blocks (K/V): D2H submitted by wrote() (bytes_to_host counts them once they land),
  // and host time taking their host copies from the pinned pool (pinning, when not reserved).
  std::uint64_t bytes_written_through = 0;
  // prefetch() calls that had room under the budget but no device memory (the allocator refused).
  std::uint64_t prefetches_without_memory = 0;
  double host_copy_alloc_ms = 0.0;
};

enum class TimelineKind { CopyToHost, CopyToDevice, ComputeStall, HostWait };
REVIVA_API const char* to_string(TimelineKind kind) noexcept;

// Times in milliseconds since the manager's origin event (host waits: on the host clock,
// aligned to the same origin).
struct TimelineEvent {
  TimelineKind kind;
  BlockId block;
  double start_ms;
  double end_ms;
  std::size_t bytes;
};

}  // namespace reviva
