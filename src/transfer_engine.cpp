// TransferEngine: issues copies on the two copy streams and accounts for them.
//
// Note [Per-direction FIFO accounting]
// Each direction has exactly one stream, so its transfers complete in submission order. The
// engine keeps a FIFO of in-flight transfers per direction and folds completed ones into the
// statistics from the front, stopping at the first that has not completed. Folding queries
// events (backend calls), so it runs with the engine's mutex released (lifetime protocol rule
// 5); an atomic flag keeps folders from overlapping, since each pops from the front.
#include <reviva/error.h>
#include <reviva/transfer_engine.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace reviva {

namespace detail {

// Timing events of completed transfers and stalls, for the next ones: creating and destroying two
// events per transfer is a large part of the fixed cost of a small copy.
struct EventPool {
  static constexpr std::size_t kMost = 256;
  std::mutex mutex;
  std::vector<Event> idle;  // guarded by mutex

  void give(Event&& a, Event&& b) {
    std::lock_guard<std::mutex> lock(mutex);
    if (idle.size() + 2 > kMost) return;
    idle.push_back(std::move(a));
    idle.push_back(std::move(b));
  }
};

// Note [Recycled transfer events]
// A transfer's events go back to the engine's pool when its state is destroyed, i.e. when the
// last handle to it is gone: the engine's (after it folded the completed transfer) and every
// Transfer a caller kept (an OffloadManager reads a completed transfer's events for its
// timeline). The destructor runs after every other holder's last use (shared_ptr's release and
// acquire on its count), so no reader can see an event recorded again for another transfer. The
// engine used to recycle them at folding when use_count() was 1, a relaxed read that orders
// nothing: TSan caught a manager thread's elapsed_ms read racing with the engine moving the event
// (ManagerConcurrencyTest at 2dcf09f). A transfer not complete (an engine torn down with copies
// in flight) keeps its events to itself.
struct TransferState {
  TransferState(std::uint64_t id_, Direction direction_, std::size_t bytes_, Event start_,
                Event done_, std::weak_ptr<EventPool> pool_)
      : id(id_),
        direction(direction_),
        bytes(bytes_),
        start(std::move(start_)),
        done(std::move(done_)),
        pool(std::move(pool_)) {}
  ~TransferState() {
    try {
      if (auto p = pool.lock(); p && done.query()) p->give(std::move(start), std::move(done));
    } catch (...) {  // (a failed query: the events are destroyed with the state)
    }
  }
  TransferState(const TransferState&) = delete;
  TransferState& operator=(const TransferState&) = delete;

  std::uint64_t id;
  Direction direction;
  std::size_t bytes;
  Event start;  // recorded on the copy stream after the producer wait: busy time starts here
  Event done;   // recorded after the last copy: the completion handle
  std::weak_ptr<EventPool> pool;
};

}  // namespace detail

using detail::TransferState;

const char* to_string(Direction direction) noexcept {
  return direction == Direction::DeviceToHost ? "device-to-host" : "host-to-device";
}

// --- Transfer --------------------------------------------------------------------------------

namespace {

// A wait shorter than this is timer noise, not compute waiting for a copy.
constexpr double kStallThresholdMs = 0.01;
const TransferState& checked(const std::shared_ptr<TransferState>& state) {
  REVIVA_CHECK_ARG(state != nullptr, "Transfer: this handle is empty (default-constructed)");
  return *state;
}
}  // namespace

bool Transfer::ready() const { return checked(state_).done.query(); }
void Transfer::wait() const { checked(state_).done.synchronize(); }
void Transfer::enqueue_wait(const Stream& stream) const { stream.wait(checked(state_).done); }
const Event& Transfer::completion_event() const { return checked(state_).done; }
const Event& Transfer::start_event() const { return checked(state_).start; }
std::size_t Transfer::bytes() const noexcept { return state_ ? state_->bytes : 0; }
Direction Transfer::direction() const noexcept {
  return state_ ? state_->direction : Direction::DeviceToHost;
}
std::uint64_t Transfer::id() const noexcept { return state_ ? state_->id : 0; }

// --- TransferEngine --------------------------------------------------------------------------

struct TransferEngine::Impl {
  std::shared_ptr<const Stream> streams[2];
  std::mutex mutex;
  std::deque<std::shared_ptr<TransferState>> in_flight[2];  // guarded by mutex
  DirectionStats stats[2];                                  // guarded by mutex
  std::shared_ptr<detail::EventPool> events = std::make_shared<detail::EventPool>();
  std::atomic<std::uint64_t> next_id{1};
  std::atomic<bool> folding{false};  // Note [Per-direction FIFO accounting]
  struct Stall {
    Event before, after;
  };
  std::deque<Stall> stalls;       // guarded by mutex: waits not measured yet, in submission order
  double compute_stall_ms = 0;    // guarded by mutex
  std::uint64_t stall_count = 0;  // guarded by mutex

  // A timing event, recycled from completed transfers when possible (Note [Recycled transfer
  // events]).
  Event take_event(const std::shared_ptr<Backend>& backend) {
    {
      std::lock_guard<std::mutex> lock(events->mutex);
      if (!events->idle.empty()) {
        Event e = std::move(events->idle.back());
        events->idle.pop_back();
        return e;
      }
    }
    return Event(backend, /*enable_timing=*/true);
  }

  // Folds completed transfers into stats. With `wait_for_turn`, waits for a concurrent folder
  // to finish instead of returning at once.
  void fold_completed(bool wait_for_turn) {
    while (folding.exchange(true, std::memory_order_acquire)) {
      if (!wait_for_turn) return;
      std::this_thread::yield();
    }
    try {
      for (int d = 0; d < 2; ++d) {
        for (;;) {
          std::shared_ptr<TransferState> front;
          {
            std::lock_guard<std::mutex> lock(mutex);
            if (in_flight[d].empty()) break;
            front = in_flight[d].front();
          }
          if (!front->done.query()) break;  // FIFO: the later ones are not done either
          const double ms = Event::elapsed_ms(front->start, front->done);
          std::lock_guard<std::mutex> lock(mutex);
          in_flight[d].pop_front();  // (its events are recycled with its last handle)
          DirectionStats& st = stats[d];
          ++st.transfers_completed;
          st.bytes_completed += front->bytes;
          st.busy_ms += ms;
        }
      }
      // Stalls of compute streams complete in the order they were enqueued only per stream;
      // the front one not done yet ends this pass (the rest are folded later).
      for (;;) {
        std::optional<Stall> front;
        {
          std::lock_guard<std::mutex> lock(mutex);
          if (stalls.empty()) break;
          if (!stalls.front().after.query()) break;
          front.emplace(std::move(stalls.front()));
          stalls.pop_front();
        }
        const double ms = Event::elapsed_ms(front->before, front->after);
        std::lock_guard<std::mutex> lock(mutex);
        if (ms > kStallThresholdMs) {
          compute_stall_ms += ms;
          ++stall_count;
        }
        events->give(std::move(front->before), std::move(front->after));
      }
    } catch (...) {
      folding.store(false, std::memory_order_release);
      throw;
    }
    folding.store(false, std::memory_order_release);
  }
};

double TransferStats::overlap_ratio() const noexcept {
  return ::reviva::overlap_ratio(compute_stall_ms, d2h.busy_ms + h2d.busy_ms);
}

void TransferEngine::wait_on(const Transfer& transfer, const Stream& compute) {
  if (!transfer.valid()) return;
  REVIVA_CHECK_ARG(compute.backend().kind() == backend_->kind(),
                   "TransferEngine::wait_on: the stream belongs to another kind of backend");
  Impl::Stall stall{impl_->take_event(backend_), impl_->take_event(backend_)};
  stall.before.record(compute);
  transfer.enqueue_wait(compute);
  stall.after.record(compute);
  bool fold = false;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->stalls.push_back(std::move(stall));
    fold = impl_->stalls.size() > 256;
  }
  if (fold) impl_->fold_completed(/*wait_for_turn=*/false);
}

TransferEngine::TransferEngine(std::shared_ptr<PinnedHostPool> pool, TransferEngineOptions options)
    : pool_(std::move(pool)), options_(options), impl_(std::make_unique<Impl>()) {
  REVIVA_CHECK_ARG(pool_ != nullptr, "TransferEngine: pool is null");
  REVIVA_CHECK_ARG(options_.chunk_bytes > 0, "TransferEngineOptions.chunk_bytes must be > 0");
  backend_ = pool_->backend_ptr();
  auto make_stream = [&](StreamHandle external, StreamPriority priority) {
    return external ? std::make_shared<const Stream>(Stream::wrap(backend_, external))
                    : std::make_shared<const Stream>(backend_, priority);
  };
  impl_->streams[0] = make_stream(options_.d2h_stream, options_.d2h_priority);
  impl_->streams[1] = make_stream(options_.h2d_stream, options_.h2d_priority);
  REVIVA_CHECK_ARG(impl_->streams[0]->handle() != impl_->streams[1]->handle(),
                   "TransferEngine: the D2H and H2D streams must differ (one per direction)");
}

TransferEngine::~TransferEngine() {
  try {
    synchronize();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "reviva: warning: ~TransferEngine: %s\n", e.what());
  }
}

const Stream& TransferEngine::stream(Direction direction) const noexcept {
  return *impl_->streams[static_cast<int>(direction)];
}

const std::shared_ptr<const Stream>& TransferEngine::stream_ptr(
    Direction direction) const noexcept {
  return impl_->streams[static_cast<int>(direction)];
}

void TransferEngine::check_request(Direction direction, const CopyRequest& request,
                                   std::size_t index) const {
  if (request.bytes == 0) return;
  REVIVA_CHECK_ARG(request.dst != nullptr && request.src != nullptr, "copy request ", index,
                   ": null ", request.dst == nullptr ? "dst" : "src", " pointer for ",
                   request.bytes, " bytes");
  const void* host = direction == Direction::DeviceToHost ? request.dst : request.src;
  const void* device = direction == Direction::DeviceToHost ? request.src : request.dst;
  REVIVA_CHECK_ARG(
      static_cast<const char*>(host) + request.bytes <= static_cast<const char*>(device) ||
          static_cast<const char*>(device) + request.bytes <= static_cast<const char*>(host),
      "copy request ", index, ": source and destination overlap");
  if (!options_.check_host_pointers) return;
  if (!pool_->owns(host)) {
    const MemoryKind kind = backend_->memory_kind(host);
    REVIVA_CHECK_ARG(kind == MemoryKind::PinnedHost || kind == MemoryKind::Unknown, "copy request ",
                     index, " (", to_string(direction), "): the host pointer ", host, " is ",
                     to_string(kind),
                     " memory; the transfer engine needs pinned host memory (allocate it from "
                     "the PinnedHostPool)");
  }
  // The device side is not checked: with unified addressing any pointer copies correctly, and
  // a driver query per request would double the fixed cost of a small copy.
}

Transfer TransferEngine::copy(Direction direction, void* dst, const void* src, std::size_t bytes,
                              const Event* producer) {
  const CopyRequest request{dst, src, bytes};
  return submit(direction, std::span<const CopyRequest>(&request, 1), producer, nullptr);
}

Transfer TransferEngine::copy_batch(Direction direction, std::span<const CopyRequest> requests,
                                    const Event* producer) {
  return submit(direction, requests, producer, nullptr);
}

Transfer TransferEngine::offload(const void* device_src, PinnedBlock& dst, std::size_t bytes,
                                 const Event* producer) {
  REVIVA_CHECK_ARG(static_cast<bool>(dst), "offload: the destination block is empty");
  REVIVA_CHECK_ARG(bytes <= dst.size(), "offload: ", bytes, " bytes do not fit a block of ",
                   dst.size(), " bytes");
  const CopyRequest request{dst.data(), device_src, bytes};
  return submit(Direction::DeviceToHost, std::span<const CopyRequest>(&request, 1), producer, &dst);
}

Transfer TransferEngine::restore(const PinnedBlock& src, void* device_dst, std::size_t bytes,
                                 const Event* producer, std::size_t offset) {
  REVIVA_CHECK_ARG(static_cast<bool>(src), "restore: the source block is empty");
  REVIVA_CHECK_ARG(offset <= src.size() && bytes <= src.size() - offset, "restore: ", bytes,
                   " bytes from offset ", offset, " requested from a block of ", src.size(),
                   " bytes");
  const CopyRequest request{static_cast<char*>(device_dst) + offset,
                            static_cast<const char*>(src.data()) + offset, bytes};
  return submit(Direction::HostToDevice, std::span<const CopyRequest>(&request, 1), producer, &src);
}

Transfer TransferEngine::submit(Direction direction, std::span<const CopyRequest> requests,
                                const Event* producer, const PinnedBlock* block) {
  std::size_t total = 0;
  std::vector<std::size_t> small;  // indices coalesced into one segment copy
  for (std::size_t i = 0; i < requests.size(); ++i) {
    check_request(direction, requests[i], i);
    total += requests[i].bytes;
    if (requests[i].bytes > 0 && requests[i].bytes < options_.coalesce_below) small.push_back(i);
  }
  if (small.size() < 2) small.clear();  // one small copy is cheapest as a plain copy
  if (producer)
    REVIVA_CHECK_ARG(&producer->backend() == backend_.get(),
                     "the producer event belongs to another backend");

  const int d = static_cast<int>(direction);
  const std::shared_ptr<const Stream>& stream = impl_->streams[d];
  auto state = std::make_shared<TransferState>(impl_->next_id.fetch_add(1), direction, total,
                                               impl_->take_event(backend_),
                                               impl_->take_event(backend_), impl_->events);
  if (block) block->record_use(stream);
  if (producer) stream->wait(*producer);  // rule 1: read nothing before the producer is done
  state->start.record(*stream);

  std::uint64_t chunks = 0;
  if (!small.empty()) {
    // The descriptors live in a pinned block the segment copy reads; dropping the block at the
    // end of this scope is safe: the pool reuses it only after the copy stream passes this point.
    PinnedBlock descriptors = pool_->allocate(small.size() * sizeof(CopySegment));
    auto* segments = static_cast<CopySegment*>(descriptors.data());
    for (std::size_t k = 0; k < small.size(); ++k) {
      const CopyRequest& r = requests[small[k]];
      segments[k] = CopySegment{r.src, r.dst, r.bytes};
    }
    descriptors.record_use(stream);
    backend_->copy_segments_async(segments, small.size(), stream->handle());
  }
  std::size_t next_small = 0;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    if (next_small < small.size() && small[next_small] == i) {
      ++next_small;
      continue;
    }
    const CopyRequest& r = requests[i];
    for (std::size_t offset = 0; offset < r.bytes; offset += options_.chunk_bytes) {
      const std::size_t n = std::min(options_.chunk_bytes, r.bytes - offset);
      backend_->copy_async(static_cast<char*>(r.dst) + offset,
                           static_cast<const char*>(r.src) + offset, n, stream->handle());
      ++chunks;
    }
  }
  state->done.record(*stream);

  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->in_flight[d].push_back(state);
    DirectionStats& st = impl_->stats[d];
    ++st.transfers_submitted;
    st.bytes_submitted += total;
    st.chunks += chunks;
    st.coalesced_requests += small.size();
    st.segment_launches += small.empty() ? 0 : 1;
  }
  impl_->fold_completed(/*wait_for_turn=*/false);  // keeps the in-flight FIFOs short
  return Transfer(std::move(state));
}

void TransferEngine::synchronize() {
  impl_->streams[0]->synchronize();
  impl_->streams[1]->synchronize();
  impl_->fold_completed(/*wait_for_turn=*/true);
}

TransferStats TransferEngine::stats() {
  impl_->fold_completed(/*wait_for_turn=*/true);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  TransferStats st{impl_->stats[0], impl_->stats[1]};
  st.compute_stall_ms = impl_->compute_stall_ms;
  st.stalls = impl_->stall_count;
  return st;
}

void TransferEngine::reset_stats() {
  impl_->fold_completed(/*wait_for_turn=*/true);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  for (int d = 0; d < 2; ++d) {
    // Transfers still in flight count as submitted after the reset, so that completed never
    // exceeds submitted.
    DirectionStats fresh;
    for (const auto& t : impl_->in_flight[d]) {
      ++fresh.transfers_submitted;
      fresh.bytes_submitted += t->bytes;
    }
    impl_->stats[d] = fresh;
  }
  // Waits still unmeasured count after the reset.
  impl_->compute_stall_ms = 0;
  impl_->stall_count = 0;
}

}  // namespace reviva
