// PinnedHostPool's frees: the streams a block's copies used, and its release, deferred until
// they are done (Note [Deferred free]); the pending frees checked without blocking, or waited
// for. The pool's slabs and allocation are pinned_host_pool.cpp's.
//
// Note [Deferred free]
// A block handed to a copy stream may still be read or written by that copy after its owner
// drops it. So a block that recorded uses is not returned to the free list on release: an event
// is recorded on every stream that used it, and the block stays "pending" until all of those
// events have completed (checked without blocking on every allocate(), or by
// synchronize_pending()). This is DESIGN.md's lifetime protocol rule 4 for host memory.
#include "pinned_host_pool_impl.h"

#include <cstdio>
#include <optional>
#include <utility>

namespace reviva {

void PinnedHostPool::record_use(PoolBlock* block, std::shared_ptr<const Stream> stream) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  for (const auto& s : block->uses)
    if (s->handle() == stream->handle()) return;
  block->uses.push_back(std::move(stream));
}

void PinnedHostPool::add_share(PoolBlock* block) noexcept {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  ++block->holders;
}

void PinnedHostPool::release(PoolBlock* block) noexcept {
  std::vector<std::shared_ptr<const Stream>> uses;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    if (--block->holders > 0) return;  // Note [Shared blocks]: a share or the block lives on
    auto& st = impl_->stats;
    uses.swap(block->uses);
    ++st.frees;
    st.bytes_in_use -= block->size;
    st.bytes_requested -= block->requested;
    if (uses.empty()) {
      impl_->insert_free(block);
      return;
    }
    st.bytes_pending += block->size;
    impl_->pending_count.fetch_add(1);
  }

  // Record one event per stream that used the block (backend calls: no mutex held).
  PendingFree pending{block, {}};
  try {
    pending.events.reserve(uses.size());
    for (const auto& stream : uses) {
      std::optional<Event> event;
      {
        std::lock_guard<std::mutex> lock(impl_->mutex);
        if (!impl_->idle_events.empty()) {
          event.emplace(std::move(impl_->idle_events.back()));
          impl_->idle_events.pop_back();
        }
      }
      if (!event) event.emplace(backend_);
      event->record(*stream);
      pending.events.push_back(std::move(*event));
    }
  } catch (const std::exception& e) {
    // Could not record: wait for the streams instead, so the block is safe to reuse now.
    std::fprintf(stderr, "reviva: warning: PinnedHostPool: recording a free event: %s\n", e.what());
    try {
      for (const auto& stream : uses) stream->synchronize();
      pending.events.clear();
    } catch (const std::exception& e2) {
      std::fprintf(stderr,
                   "reviva: warning: PinnedHostPool: leaking a block of %zu bytes whose copies "
                   "may still be running: %s\n",
                   block->size, e2.what());
      return;
    }
  }
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->pending.push_back(std::move(pending));
}

void PinnedHostPool::process_pending() {
  if (impl_->pending_count.load() == 0) return;
  std::vector<PendingFree> batch;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    batch.swap(impl_->pending);
  }
  if (batch.empty()) return;
  std::vector<bool> done(batch.size(), false);
  for (std::size_t i = 0; i < batch.size(); ++i) {
    bool all = true;
    try {
      for (const Event& e : batch[i].events) {
        if (!e.query()) {
          all = false;
          break;
        }
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "reviva: warning: PinnedHostPool: querying a free event: %s\n",
                   e.what());
      all = false;
    }
    done[i] = all;
  }
  std::lock_guard<std::mutex> lock(impl_->mutex);
  for (std::size_t i = 0; i < batch.size(); ++i) {
    if (done[i]) {
      impl_->finish_pending(batch[i]);
    } else {
      impl_->pending.push_back(std::move(batch[i]));
    }
  }
}

void PinnedHostPool::synchronize_pending() {
  std::vector<PendingFree> batch;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    batch.swap(impl_->pending);
  }
  for (PendingFree& p : batch)
    for (const Event& e : p.events) e.synchronize();
  std::lock_guard<std::mutex> lock(impl_->mutex);
  for (PendingFree& p : batch) impl_->finish_pending(p);
}

}  // namespace reviva
