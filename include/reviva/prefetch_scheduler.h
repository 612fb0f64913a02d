// PrefetchScheduler: keeps the next groups of blocks in flight ahead of compute.
//
// A step is a sequence of group accesses (a group: the blocks one layer needs). The order is
// declared, or recorded during the first step and replayed from then on. A group whose blocks
// are all kept resident (OffloadManager::keep_resident, as of the declaration) takes no place in
// the window: the window counts the groups that may need bringing in (a decode step's streamed
// layers among resident ones). At each access the
// scheduler acquires the group (its blocks resident, compute ordered after their copies), starts
// H2D copies for the next `window` groups of the order (wrapping into the next step), and when a
// group is released, starts offloading those of its blocks whose next use is beyond the window,
// so that room is ready before it is needed.
//
// Adaptive mode sizes the window from measurements: the copy time of a group at the measured H2D
// bandwidth against the measured compute time between accesses, widened after late prefetches
// and narrowed when prefetches find no room. Single-threaded: one scheduler per compute loop.
#pragma once

#include <reviva/offload_manager.h>

#include <cstddef>
#include <deque>
#include <span>
#include <unordered_map>
#include <vector>

namespace reviva {

struct PrefetchSchedulerOptions {
  int prefetch_groups = 2;  // the window: groups kept in flight ahead of the current one
  bool adaptive = false;
  int min_window = 1;
  int max_window = 16;
  // Offload blocks on release whose next use is farther than the window, and when a prefetch
  // finds no room.
  bool eager_offload = true;
  // Bytes that may be prefetched ahead of compute and not used yet (the manager's
  // prefetched_bytes()); 0: as many as the budget holds. With a budget that also holds what
  // compute uses, this keeps the lead to its own size (a training backward: see
  // activations/backward.py).
  std::size_t max_ahead_bytes = 0;
};

struct PrefetchSchedulerStats {
  int window = 0;
  std::size_t steps = 0;
  std::size_t groups_in_order = 0;
  std::uint64_t off_schedule_accesses = 0;  // accesses that did not match the order
  std::uint64_t prefetches_issued = 0;
  std::uint64_t prefetches_without_room = 0;
  std::uint64_t stops_at_max_ahead = 0;  // prefetch stopped: the window's lead was max_ahead_bytes
  std::uint64_t eager_offloads = 0;
  double measured_compute_ms_per_group = 0.0;  // adaptive mode's last estimates
  double measured_copy_ms_per_group = 0.0;
};

class REVIVA_API PrefetchScheduler {
 public:
  explicit PrefetchScheduler(OffloadManager& manager, PrefetchSchedulerOptions options = {});
  ~PrefetchScheduler();
  PrefetchScheduler(const PrefetchScheduler&) = delete;
  PrefetchScheduler& operator=(const PrefetchScheduler&) = delete;

  // Declares the order of one step; replaces any recorded order.
  void declare_order(std::vector<std::vector<BlockId>> order);

  // Compute is about to use `group`: acquires its blocks (addresses in the group's order) and
  // prefetches the next groups of the order. On failure nothing stays acquired (with WriteOnly,
  // blocks acquired before the failure keep no contents: the access declared them dead).
  std::vector<void*> acquire_group(std::span<const BlockId> group, const Stream& compute,
                                   Access access = Access::ReadWrite);
  // Releases the group's blocks; with eager offload, starts moving out those needed far later.
  // With `discard`, their contents are dead (e.g. activations after their backward use): they
  // are dropped instead of copied out. Then retries prefetches that found no room before.
  void release_group(std::span<const BlockId> group, const Stream& compute, bool discard = false);
  // release_group without the releases, for a caller that releases the blocks itself (the Python
  // binding ends a block's use only once its tensors are gone too). Blocks still acquired are
  // not offloaded; discarding one throws, as OffloadManager::discard does.
  void after_release(std::span<const BlockId> group, bool discard = false);
  // Ends a step: a recorded order becomes the order of the next step.
  void end_step();

  int window() const noexcept { return window_; }
  std::size_t max_ahead_bytes() const noexcept { return options_.max_ahead_bytes; }
  void set_max_ahead_bytes(std::size_t bytes) noexcept { options_.max_ahead_bytes = bytes; }
  const std::vector<std::vector<BlockId>>& order() const noexcept { return order_; }
  PrefetchSchedulerStats stats() const;

 private:
  std::size_t locate(std::span<const BlockId> group);
  void release_after_failure(std::span<const BlockId> acquired, const Stream& compute) noexcept;
  void prefetch_ahead(std::size_t position);
  bool make_room(std::size_t position);
  std::size_t distance_to_next_use(BlockId id, std::size_t position) const;
  std::size_t counted_distance(std::size_t from, std::size_t to) const;
  void rebuild_index();
  void adapt(const Stream& compute);

  OffloadManager& manager_;
  PrefetchSchedulerOptions options_;
  int window_;
  bool declared_ = false;
  std::vector<std::vector<BlockId>> order_;
  std::vector<std::vector<BlockId>> recording_;
  std::unordered_map<BlockId, std::vector<std::size_t>> uses_;  // positions in order_
  std::vector<std::size_t> rank_;  // rank_[i]: groups before position i that are not all kept
  std::size_t position_ = 0;       // index in order_ of the group being used (or next expected)
  bool on_schedule_ = false;
  PrefetchSchedulerStats stats_;
  // Adaptive mode: timing events at successive accesses on the compute stream.
  std::deque<Event> access_events_;
  std::uint64_t late_seen_ = 0;
  std::uint64_t hits_seen_ = 0;
};

}  // namespace reviva
