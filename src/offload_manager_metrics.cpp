// OffloadManager's metrics, timeline and invariant checks.
#include "offload_manager_impl.h"

namespace reviva {

ManagerMetrics OffloadManager::metrics() {
  Impl& m = *impl_;
  m.poll(/*wait_for_turn=*/true);
  std::lock_guard<std::mutex> lock(m.mutex);
  ManagerMetrics r = m.metrics;
  r.budget_bytes = m.budget;
  r.device_bytes = m.held;
  r.registered_bytes = m.registered;
  r.device_bytes_saved = m.registered > m.held ? m.registered - m.held : 0;
  const double copy_ms = r.to_host_busy_ms + r.to_device_busy_ms;
  // Host waits are not counted: the GPU may be busy with queued work while the caller waits.
  // Their cost shows in end-to-end time, and host_wait_ms reports them on their own.
  r.overlap_ratio = overlap_ratio(r.compute_stall_ms, copy_ms);
  return r;
}

std::vector<TimelineEvent> OffloadManager::timeline() {
  impl_->poll(/*wait_for_turn=*/true);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->timeline;
}

std::vector<TimelineEvent> OffloadManager::take_timeline() {
  impl_->poll(/*wait_for_turn=*/true);
  std::vector<TimelineEvent> taken;
  std::lock_guard<std::mutex> lock(impl_->mutex);
  taken.swap(impl_->timeline);
  return taken;
}

void OffloadManager::reset_metrics() {
  Impl& m = *impl_;
  m.poll(/*wait_for_turn=*/true);
  std::lock_guard<std::mutex> lock(m.mutex);
  m.metrics = ManagerMetrics{};
  m.metrics.budget_bytes = m.budget;
  m.metrics.peak_device_bytes = m.held;
  m.metrics.peak_registered_bytes = m.registered;
  m.timeline.clear();
}

std::string OffloadManager::policy_name() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->policy->name();
}

void OffloadManager::check_invariants() const {
  const Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mutex);
  std::size_t held = 0, leaving = 0, registered = 0;
  for (const auto& [id, bp] : m.blocks) {
    const Impl::Block& b = *bp;
    REVIVA_ASSERT(b.id == id);
    registered += b.capacity;
    if (b.append) {
      REVIVA_ASSERT(b.valid <= b.capacity && b.bytes <= b.capacity, "append block ", id,
                    " over its capacity");
      REVIVA_ASSERT(!b.keep || !b.host || b.busy, "kept block ", id, " with a host copy");
      // A host copy is kept whole by the writes (stale only after a write-through that failed,
      // while the block is on the device: its eviction then copies the valid prefix).
      if (!b.busy && b.host && b.state == BlockState::Host)
        REVIVA_ASSERT(b.host_valid, "append block ", id, " on the host with a stale host copy");
      if (!b.busy && (b.state == BlockState::Device || b.state == BlockState::ToDevice))
        REVIVA_ASSERT(b.valid <= b.bytes, "append block ", id, " contents beyond its memory");
      if (b.state == BlockState::Empty && !b.drop_on_landing)
        REVIVA_ASSERT(b.valid == 0, "Empty append block ", id, " with contents");
    }
    REVIVA_ASSERT(b.pins >= 0);
    if (b.busy) continue;  // in transition: checked once it settles
    switch (b.state) {
      case BlockState::Empty:
        REVIVA_ASSERT(b.device == nullptr && !b.host_valid && b.pins == 0 && !b.transfer.valid(),
                      "Empty block ", id, " holds memory or a copy");
        break;
      case BlockState::Device:
        REVIVA_ASSERT(b.device != nullptr, "Device block ", id, " without device memory");
        held += b.bytes;
        break;
      case BlockState::ToDevice:
        REVIVA_ASSERT(b.device != nullptr && b.transfer.valid() && b.pins == 0 &&
                      (b.host_valid || b.keep));
        held += b.bytes;
        break;
      case BlockState::ToHost:
        REVIVA_ASSERT(b.device == nullptr && b.transfer.valid() && b.pins == 0 && b.host);
        held += b.bytes;
        leaving += b.bytes;
        break;
      case BlockState::Host:
        REVIVA_ASSERT(b.device == nullptr && b.host && b.host_valid && b.pins == 0, "Host block ",
                      id, " without a valid host copy");
        break;
      case BlockState::Disk:
        REVIVA_ASSERT(b.append && b.device == nullptr && !b.host && !b.host_valid && b.pins == 0 &&
                          !b.keep && !b.transfer.valid(),
                      "Disk block ", id, " holds memory, a host copy or a copy");
        break;
    }
    if (b.pins > 0) REVIVA_ASSERT(b.state == BlockState::Device);
  }
  for (const auto& f : m.freeing) {
    held += f.bytes;
    leaving += f.bytes;
  }
  REVIVA_ASSERT(registered == m.registered, "registered ", registered, " != ", m.registered);
  bool any_busy = false;
  for (const auto& [id, b] : m.blocks) any_busy = any_busy || b->busy;
  if (!any_busy) {
    REVIVA_ASSERT(held == m.held, "blocks hold ", held, " bytes, the account says ", m.held);
    REVIVA_ASSERT(leaving == m.freeing_bytes, "leaving ", leaving, " != ", m.freeing_bytes);
  }
  REVIVA_ASSERT(m.held <= m.budget, "held ", m.held, " over the budget ", m.budget);
  REVIVA_ASSERT(m.metrics.peak_device_bytes <= std::max(m.budget, m.metrics.budget_bytes));
}

}  // namespace reviva
