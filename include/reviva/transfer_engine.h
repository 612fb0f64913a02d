// TransferEngine: asynchronous copies between device memory and pinned host memory on two
// dedicated copy streams, one per direction, so that both PCIe directions run at once.
//
// Every transfer (DESIGN.md, lifetime protocol):
//   - first makes its copy stream wait on the producer's event, if one is given (rule 1: nothing
//     is read before the stream that wrote it has reached that point);
//   - is bracketed by two timing events on the copy stream; the second is the completion handle
//     that callers wait on, on the host or from another stream (rule 3).
// Large copies are split into chunks of `chunk_bytes`; batches of small copies are coalesced
// into one segment-copy operation (one kernel launch on CUDA) instead of one DMA submission each.
// The engine counts bytes and busy time per direction.
#pragma once

#include <reviva/backend.h>
#include <reviva/export.h>
#include <reviva/metrics.h>
#include <reviva/pinned_host_pool.h>
#include <reviva/stream.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace reviva {

enum class Direction { DeviceToHost = 0, HostToDevice = 1 };
REVIVA_API const char* to_string(Direction direction) noexcept;

struct TransferEngineOptions {
  // Copies larger than this are issued as several chunks of at most this many bytes.
  std::size_t chunk_bytes = std::size_t{64} << 20;
  // In copy_batch, requests smaller than this are coalesced into one segment copy. 0: never.
  std::size_t coalesce_below = std::size_t{256} << 10;
  // Check that host-side pointers are pinned (a pageable pointer would silently make the copy
  // synchronous and slow, or fault in the segment kernel). Pool blocks are known to be pinned.
  bool check_host_pointers = true;
  StreamPriority d2h_priority = StreamPriority::Normal;
  // Prefetches are usually on the critical path of compute: give H2D the higher priority.
  StreamPriority h2d_priority = StreamPriority::High;
  // Streams owned by someone else to copy on (not destroyed by the engine), e.g. streams that
  // must outlive the engine because another allocator recorded them (torch's record_stream).
  // nullptr: the engine creates its own.
  StreamHandle d2h_stream = nullptr;
  StreamHandle h2d_stream = nullptr;
};

struct CopyRequest {
  void* dst;
  const void* src;
  std::size_t bytes;
};

struct DirectionStats {
  std::uint64_t transfers_submitted = 0;
  std::uint64_t transfers_completed = 0;
  std::uint64_t bytes_submitted = 0;
  std::uint64_t bytes_completed = 0;
  std::uint64_t chunks = 0;              // backend copy calls made for large copies
  std::uint64_t coalesced_requests = 0;  // small requests that went through segment copies
  std::uint64_t segment_launches = 0;    // segment-copy operations issued
  double busy_ms = 0.0;                  // copy-stream time of completed transfers
  double bandwidth_gbps() const noexcept {
    return busy_ms > 0 ? static_cast<double>(bytes_completed) / (busy_ms * 1e6) : 0.0;
  }
};

struct REVIVA_API TransferStats {
  DirectionStats d2h;
  DirectionStats h2d;
  // Compute waiting for transfers it needs (wait_on), measured on the compute stream; waits
  // shorter than timer noise (0.01 ms) are not stalls.
  double compute_stall_ms = 0.0;
  std::uint64_t stalls = 0;
  // Note [Overlap ratio] (metrics.h), over both directions.
  double overlap_ratio() const noexcept;
};

namespace detail {
struct TransferState;
}

// Completion handle of one transfer. Copyable (shared); cheap.
class REVIVA_API Transfer {
 public:
  Transfer() = default;
  bool valid() const noexcept { return state_ != nullptr; }
  bool ready() const;                             // the copy has completed
  void wait() const;                              // blocks the calling thread until it has
  void enqueue_wait(const Stream& stream) const;  // later work on `stream` waits for it
  const Event& completion_event() const;
  const Event& start_event() const;  // recorded when the copy stream began this transfer
  std::size_t bytes() const noexcept;
  Direction direction() const noexcept;
  std::uint64_t id() const noexcept;

 private:
  friend class TransferEngine;
  explicit Transfer(std::shared_ptr<detail::TransferState> state) : state_(std::move(state)) {}
  std::shared_ptr<detail::TransferState> state_;
};

class REVIVA_API TransferEngine {
 public:
  TransferEngine(std::shared_ptr<PinnedHostPool> pool, TransferEngineOptions options = {});
  ~TransferEngine();
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  // One copy of `bytes` from `src` to `dst` in `direction`. The host side must be pinned memory.
  // If `producer` is given, the copy starts only after it completes.
  Transfer copy(Direction direction, void* dst, const void* src, std::size_t bytes,
                const Event* producer = nullptr);

  // Many copies in one direction, one completion handle. Small ones are coalesced.
  Transfer copy_batch(Direction direction, std::span<const CopyRequest> requests,
                      const Event* producer = nullptr);

  // Device -> pinned block (the block records the D2H stream's use, so it is not reused before
  // the copy finishes), and pinned block -> device.
  Transfer offload(const void* device_src, PinnedBlock& dst, std::size_t bytes,
                   const Event* producer = nullptr);
  // (`offset`: bytes [offset, offset + bytes) of the block into the same bytes at device_dst.)
  Transfer restore(const PinnedBlock& src, void* device_dst, std::size_t bytes,
                   const Event* producer = nullptr, std::size_t offset = 0);

  // Later work on `compute` waits for `transfer` (lifetime rule 3), with timing events around
  // the wait: the time compute spends waiting counts as a stall in stats(). The one stall meter
  // of every path that copies through this engine.
  void wait_on(const Transfer& transfer, const Stream& compute);

  const Stream& stream(Direction direction) const noexcept;
  const std::shared_ptr<const Stream>& stream_ptr(Direction direction) const noexcept;
  // Blocks until every submitted transfer has completed.
  void synchronize();
  // Current statistics (first folds in every transfer that has completed since the last call).
  TransferStats stats();
  void reset_stats();

  PinnedHostPool& pool() const noexcept { return *pool_; }
  Backend& backend() const noexcept { return *backend_; }
  const TransferEngineOptions& options() const noexcept { return options_; }

 private:
  struct Impl;
  Transfer submit(Direction direction, std::span<const CopyRequest> requests, const Event* producer,
                  const PinnedBlock* block);
  void check_request(Direction direction, const CopyRequest& request, std::size_t index) const;

  std::shared_ptr<PinnedHostPool> pool_;
  std::shared_ptr<Backend> backend_;
  TransferEngineOptions options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace reviva
