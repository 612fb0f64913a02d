// PrefetchScheduler: replays a step's group order, keeping `window` groups in flight ahead of
// compute and moving out early what is needed late (see prefetch_scheduler.h).
#include <reviva/error.h>
#include <reviva/prefetch_scheduler.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

namespace reviva {

namespace {
constexpr std::size_t kNowhere = std::numeric_limits<std::size_t>::max();
constexpr std::size_t kAdaptEvents = 16;  // accesses the adaptive window looks back over
}  // namespace

PrefetchScheduler::PrefetchScheduler(OffloadManager& manager, PrefetchSchedulerOptions options)
    : manager_(manager), options_(options), window_(options.prefetch_groups) {
  REVIVA_CHECK_ARG(options.prefetch_groups >= 0, "prefetch_groups must be >= 0, got ",
                   options.prefetch_groups);
  REVIVA_CHECK_ARG(options.min_window >= 0 && options.min_window <= options.max_window,
                   "need 0 <= min_window <= max_window, got ", options.min_window, " and ",
                   options.max_window);
  if (options.adaptive) window_ = std::clamp(window_, options.min_window, options.max_window);
  stats_.window = window_;
}

PrefetchScheduler::~PrefetchScheduler() = default;

void PrefetchScheduler::declare_order(std::vector<std::vector<BlockId>> order) {
  for (std::size_t i = 0; i < order.size(); ++i)
    REVIVA_CHECK_ARG(!order[i].empty(), "declare_order: group ", i, " is empty");
  order_ = std::move(order);
  declared_ = true;
  recording_.clear();
  position_ = 0;
  on_schedule_ = false;
  rebuild_index();
}

void PrefetchScheduler::rebuild_index() {
  uses_.clear();
  for (std::size_t i = 0; i < order_.size(); ++i)
    for (BlockId id : order_[i]) {
      auto& positions = uses_[id];
      if (positions.empty() || positions.back() != i) positions.push_back(i);
    }
  // Kept groups (every block kept resident: a K/V layer the plan holds) take no place in the
  // window: rank_[i] counts the other groups before position i.
  rank_.assign(order_.size() + 1, 0);
  for (std::size_t i = 0; i < order_.size(); ++i) {
    bool all_kept = true;
    for (BlockId id : order_[i]) {
      try {
        all_kept = all_kept && manager_.kept(id);
      } catch (const InvalidArgument&) {
        all_kept = false;  // not registered (yet): counts as an ordinary group
      }
    }
    rank_[i + 1] = rank_[i] + (all_kept ? 0 : 1);
  }
  stats_.groups_in_order = order_.size();
}

// Groups of the window between `from` and `to` (positions, cyclic: `to` may wrap into the next
// step), kept groups not counted; `to`'s own group counts unless kept.
std::size_t PrefetchScheduler::counted_distance(std::size_t from, std::size_t to) const {
  const std::size_t n = order_.size();
  const std::size_t cycle = rank_[n];
  if (to < n) return to >= from ? rank_[to + 1] - rank_[from + 1] : kNowhere;
  return cycle - rank_[from + 1] + rank_[to - n + 1];
}

// The position of `group` in the order: the expected next one, else the first match after it
// (wrapping). kNowhere when the group is not in the order.
std::size_t PrefetchScheduler::locate(std::span<const BlockId> group) {
  const std::size_t n = order_.size();
  if (n == 0) return kNowhere;
  const std::size_t expected = on_schedule_ ? (position_ + 1) % n : position_ % n;
  for (std::size_t k = 0; k < n; ++k) {
    const std::size_t i = (expected + k) % n;
    if (std::equal(order_[i].begin(), order_[i].end(), group.begin(), group.end())) return i;
  }
  return kNowhere;
}

std::vector<void*> PrefetchScheduler::acquire_group(std::span<const BlockId> group,
                                                    const Stream& compute, Access access) {
  REVIVA_CHECK_ARG(!group.empty(), "acquire_group: the group is empty");
  const std::size_t p = locate(group);
  // The current group first: prefetches must not take the room it needs. A call that fails part
  // way (a block that does not fit beside the others, a failed copy) holds nothing afterwards:
  // it releases what it acquired, and the access is neither recorded nor moves the cursor.
  std::vector<void*> addresses;
  addresses.reserve(group.size());
  try {
    for (BlockId id : group) addresses.push_back(manager_.acquire(id, compute, access));
    if (p != kNowhere) prefetch_ahead(p);
    if (options_.adaptive) adapt(compute);
    if (!declared_) recording_.emplace_back(group.begin(), group.end());
  } catch (...) {
    release_after_failure(group.first(addresses.size()), compute);
    throw;
  }
  if (p == kNowhere) {
    ++stats_.off_schedule_accesses;
    on_schedule_ = false;
  } else {
    position_ = p;
    on_schedule_ = true;
  }
  return addresses;
}

// Newest first; a release that fails too is reported, not thrown: the caller needs the error that
// made the acquire fail.
void PrefetchScheduler::release_after_failure(std::span<const BlockId> acquired,
                                              const Stream& compute) noexcept {
  for (std::size_t i = acquired.size(); i-- > 0;) {
    try {
      manager_.release(acquired[i], compute);
    } catch (const std::exception& e) {
      std::fprintf(stderr,
                   "reviva: warning: acquire_group: releasing block %llu after a failed "
                   "acquire: %s\n",
                   static_cast<unsigned long long>(acquired[i]), e.what());
    }
  }
}

void PrefetchScheduler::prefetch_ahead(std::size_t position) {
  const std::size_t n = order_.size();
  const std::size_t limit = options_.max_ahead_bytes;
  // The lead: every block prefetched and not used yet, in the window or not (an access out of
  // the order's sequence leaves prefetched blocks behind the position).
  std::size_t ahead = limit > 0 ? manager_.prefetched_bytes() : 0;
  int counted = 0;  // groups of the window seen (kept ones are not counted)
  for (std::size_t k = 1; k < n && counted < window_; ++k) {
    const std::size_t at = (position + k) % n;
    if (rank_[at + 1] == rank_[at]) continue;  // a kept group: nothing to bring
    ++counted;
    for (BlockId id : order_[at]) {
      BlockState state;
      std::size_t bytes = 0;
      try {
        state = manager_.state(id);
        if (limit > 0) bytes = manager_.bytes(id);
      } catch (const InvalidArgument&) {
        continue;  // a recorded block that has since been unregistered
      }
      if (state != BlockState::Host) continue;
      if (limit > 0 && ahead + bytes > limit) {
        ++stats_.stops_at_max_ahead;
        return;  // the lead is as long as allowed: later blocks wait for this one
      }
      if (manager_.prefetch(id)) {
        ++stats_.prefetches_issued;
        ahead += bytes;
        continue;
      }
      // No free room: with eager offload, move out what is needed later than the window (e.g.
      // at the start of a replayed step, the budget is full of the groups the order needs
      // last), then try again. (Without it, no scan: a training backward tops the window up
      // after every block it drops, and a scan of the whole order each time cost the host
      // more than the copies, H200 at 35c0d1e.)
      if (options_.eager_offload && make_room(position) && manager_.prefetch(id)) {
        ++stats_.prefetches_issued;
        ahead += bytes;
        continue;
      }
      ++stats_.prefetches_without_room;
      return;  // the budget is full now; later groups would not fit either
    }
  }
}

// Offloads resident blocks of the order whose next use lies beyond the window. Returns whether
// any was started (its memory frees when the copy lands).
bool PrefetchScheduler::make_room(std::size_t position) {
  bool started = false;
  for (const auto& [id, positions] : uses_) {
    if (distance_to_next_use(id, position) <= static_cast<std::size_t>(window_)) continue;
    try {
      if (manager_.state(id) != BlockState::Device) continue;
      manager_.offload(id);
      ++stats_.eager_offloads;
      started = true;
    } catch (const InvalidArgument&) {
      // acquired by compute right now, or unregistered since the order was recorded
    }
  }
  return started;
}

std::size_t PrefetchScheduler::distance_to_next_use(BlockId id, std::size_t position) const {
  auto it = uses_.find(id);
  if (it == uses_.end() || it->second.empty()) return kNowhere;
  const auto& positions = it->second;
  auto next = std::upper_bound(positions.begin(), positions.end(), position);
  if (next != positions.end()) return counted_distance(position, *next);
  return counted_distance(position, order_.size() + positions.front());  // in the next step
}

void PrefetchScheduler::release_group(std::span<const BlockId> group, const Stream& compute,
                                      bool discard) {
  for (BlockId id : group) manager_.release(id, compute);
  after_release(group, discard);
}

void PrefetchScheduler::after_release(std::span<const BlockId> group, bool discard) {
  if (discard) {
    for (BlockId id : group) manager_.discard(id);
  } else if (options_.eager_offload && on_schedule_) {
    for (BlockId id : group) {
      // A block still acquired (by another group in use, or by a tensor that the Python binding
      // keeps alive) stays; it leaves when room is next needed after its last release.
      if (distance_to_next_use(id, position_) > static_cast<std::size_t>(window_) &&
          manager_.state(id) == BlockState::Device && !manager_.acquired(id)) {
        manager_.offload(id);
        ++stats_.eager_offloads;
      }
    }
  }
  // Room may have been made (now or by copies that landed since): try the window again.
  if (on_schedule_) prefetch_ahead(position_);
}

void PrefetchScheduler::end_step() {
  if (!declared_ && !recording_.empty()) {
    order_ = std::move(recording_);
    recording_.clear();
    rebuild_index();
  }
  ++stats_.steps;
  position_ = 0;
  on_schedule_ = false;
  manager_.end_step();
}

// Adaptive window: the copy of a group must finish within the compute of the groups before it.
void PrefetchScheduler::adapt(const Stream& compute) {
  access_events_.emplace_back(manager_.engine().pool().backend_ptr(), /*enable_timing=*/true);
  access_events_.back().record(compute);
  while (access_events_.size() > kAdaptEvents) access_events_.pop_front();
  // Compute time per group: between the oldest and newest completed access events.
  std::size_t last_done = kNowhere;
  for (std::size_t i = access_events_.size(); i-- > 0;)
    if (access_events_[i].query()) {
      last_done = i;
      break;
    }
  if (last_done == kNowhere || last_done == 0) return;
  const double compute_ms = Event::elapsed_ms(access_events_.front(), access_events_[last_done]) /
                            static_cast<double>(last_done);
  const ManagerMetrics mm = manager_.metrics();
  if (mm.to_device_busy_ms <= 0.0 || order_.empty()) return;
  const double h2d_bytes_per_ms = static_cast<double>(mm.bytes_to_device) / mm.to_device_busy_ms;
  std::size_t bytes = 0;
  for (const auto& g : order_)
    for (BlockId id : g) {
      try {
        bytes += manager_.bytes(id);
      } catch (const InvalidArgument&) {
      }
    }
  const double copy_ms =
      static_cast<double>(bytes) / static_cast<double>(order_.size()) / h2d_bytes_per_ms;
  int target =
      compute_ms > 0 ? static_cast<int>(std::ceil(copy_ms / compute_ms)) + 1 : options_.max_window;
  if (mm.prefetch_late > late_seen_) target = std::max(target, window_ + 1);  // still stalling
  if (stats_.prefetches_without_room > hits_seen_) target = std::min(target, window_ - 1);
  late_seen_ = mm.prefetch_late;
  hits_seen_ = stats_.prefetches_without_room;
  window_ = std::clamp(target, options_.min_window, options_.max_window);
  stats_.measured_compute_ms_per_group = compute_ms;
  stats_.measured_copy_ms_per_group = copy_ms;
}

PrefetchSchedulerStats PrefetchScheduler::stats() const {
  PrefetchSchedulerStats s = stats_;
  s.window = window_;
  return s;
}

}  // namespace reviva
