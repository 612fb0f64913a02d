// OffloadManager: the residency of every registered block (a tensor's bytes), under a device
// memory budget that it never exceeds.
//
// States of a block (DESIGN.md, "Core concepts"):
//   Empty     no valid contents anywhere, no memory (registered, or discarded)
//   Device    resident; the host may also hold a valid copy ("clean")
//   ToHost    a D2H copy is in flight; its device memory is freed when the copy completes
//   Host      only the pinned host copy holds the contents
//   ToDevice  an H2D copy is in flight into fresh device memory
//   Disk      an append block whose contents the caller's disk tier holds: its host copy was
//             handed over (detach_host) and nothing here holds them until attach_host
// Every transition is a copy on a copy stream bracketed by events, following the lifetime
// protocol to the letter (see Note [Lifetime protocol] in offload_manager_impl.h).
//
// Compute uses a block between acquire() and release(): acquire makes it resident (fetching it if
// needed), makes the compute stream wait for any copy still bringing it in, and pins it (a pinned
// block is never evicted); release records the point on the compute stream after which it may
// leave. When room is needed the eviction policy picks victims among resident, unpinned blocks.
// The manager is thread-safe and makes no backend call while holding its mutex.
#pragma once

#include <reviva/device_allocator.h>
#include <reviva/eviction_policy.h>
#include <reviva/export.h>
#include <reviva/metrics.h>
#include <reviva/stream.h>
#include <reviva/transfer_engine.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace reviva {

enum class BlockState { Empty, Device, ToHost, Host, ToDevice, Disk };
REVIVA_API const char* to_string(BlockState state) noexcept;

// How compute will use an acquired block.
enum class Access {
  ReadWrite,  // contents needed, and changed: the host copy becomes stale
  ReadOnly,   // contents needed, unchanged: a valid host copy stays valid (clean eviction later)
  WriteOnly,  // contents not needed (overwritten entirely): nothing is fetched
};

struct OffloadManagerOptions {
  // Bytes of device memory the manager may hold. 0: `budget_fraction` of the device's total.
  std::size_t budget_bytes = 0;
  double budget_fraction = 0.8;
  PolicyKind policy = PolicyKind::Lru;                   // ignored when a policy object is passed
  std::size_t timeline_capacity = std::size_t{1} << 16;  // events kept (then counted as dropped)
};

class REVIVA_API OffloadManager {
 public:
  OffloadManager(std::shared_ptr<TransferEngine> engine, std::shared_ptr<DeviceAllocator> allocator,
                 OffloadManagerOptions options = {},
                 std::unique_ptr<EvictionPolicy> policy = nullptr);
  ~OffloadManager();
  OffloadManager(const OffloadManager&) = delete;
  OffloadManager& operator=(const OffloadManager&) = delete;

  // A new block of `bytes` (> 0) in state Empty: no memory is taken until first acquired.
  BlockId register_block(std::size_t bytes, std::string name = {});
  // Takes over `bytes` of device memory the caller already holds (state Device, contents valid
  // once `producer`'s work so far completes). `release` gives the memory back when the block
  // leaves the device; it is called once, with a stream after whose current work the memory is
  // free. Throws OutOfMemory if the budget cannot make room for it.
  BlockId adopt(void* device_ptr, std::size_t bytes, std::function<void(StreamHandle)> release,
                const Stream& producer, std::string name = {});
  // A block whose contents are the pinned host block `host` (all host.size() bytes, > 0), in
  // state Host: its first acquire fetches them, and an acquire with Access::ReadOnly keeps the
  // host copy valid, so the block leaves the device without a copy (weights streamed from
  // pinned host memory). The caller may write the host block's contents only before the block
  // is first acquired.
  BlockId register_host_block(PinnedBlock host, std::string name = {});
  // Frees the block's memory (stream-ordered) and forgets it. It must not be acquired.
  void unregister(BlockId id);

  // Append blocks (a K/V layer: Note [Append blocks] in append_blocks.cpp). A block of up to
  // `capacity` bytes whose contents are its first valid_bytes(), which grow by wrote() alone
  // (acquire's access mode does not change its copies). Its device memory backs what grow()
  // asked for (or, with an allocator that cannot grow in place, the capacity), so it grows with
  // its tokens; its pinned host copy (`capacity` bytes, taken at the first write) is kept in
  // step by each wrote() (write-through), so leaving the device never copies, and coming back
  // copies the valid prefix alone. Starts Empty with no valid bytes.
  BlockId register_append_block(std::size_t capacity, std::string name = {});
  // While acquired: backs the block's first `bytes` (<= capacity) with device memory, in place,
  // counted against the budget (evicting other blocks as acquire does). Throws OutOfMemory
  // naming the numbers when the budget or the device cannot give it (the block is unchanged).
  void grow(BlockId id, std::size_t bytes);
  // While acquired: compute wrote [offset, offset + bytes) of the block with the work queued on
  // `compute` so far; offset <= valid_bytes() (no gap), and the range backed (grow()). The valid
  // prefix extends to cover it, and a block with a host copy copies the range there (a D2H after
  // that work). Returns the bytes sent to the host copy.
  std::size_t wrote(BlockId id, std::size_t offset, std::size_t bytes, const Stream& compute);
  // Shortens an append block's contents to their first `bytes` (<= valid_bytes()): later writes
  // continue from there (a rollback: assisted decoding's rejected tokens). Its memory and its
  // host copy stay; the copy's prefix stays valid. It must not be acquired.
  void truncate(BlockId id, std::size_t bytes);
  // An append block's fetches copy only the last `bytes` of its valid prefix (0: all of it):
  // compute reads no byte before them (a sliding-window layer's keys older than its window: Note
  // [Fetch tails] in append_blocks.cpp); the device memory before them holds stale bytes. A
  // device copy fetched with a tail leaves the device when the tail is lifted or lengthened, so
  // that the next acquire fetches what is now asked for. keep_resident fetches the whole prefix.
  // Not while acquired.
  void set_fetch_tail(BlockId id, std::size_t bytes);
  // Keeps an append block on the device from now on: never evicted nor offloaded, its host copy
  // given back once its contents are on the device (later writes stay there). A block on the
  // host is fetched now into fresh memory (not memory the allocator keeps for blocks that come
  // and go), making room as acquire does. False, changing nothing, when the budget
  // or the device cannot hold it. One way: a kept block stays kept until unregistered.
  bool keep_resident(BlockId id);
  bool kept(BlockId id) const;
  std::size_t valid_bytes(BlockId id) const;
  std::size_t capacity(BlockId id) const;  // an append block's; a fixed block's bytes
  // The bytes the block's host copy holds now (0: none).
  std::size_t host_bytes(BlockId id) const;
  // Note [Host-side appends] (append_blocks.cpp): an append block whose reader works on the
  // host. host_rows: its host copy, once every write-through to it has landed (waits for them);
  // valid until the block is unregistered or kept. host_wrote: copies `bytes` from `src` into the
  // host copy at `offset` (<= valid_bytes(): no gap) and extends the valid prefix. The block must
  // not be acquired, kept or on the device (a device copy would turn stale: offload it first),
  // and must have a host copy (it had contents written through). Both throw InvalidArgument
  // naming the block otherwise.
  const void* host_rows(BlockId id);
  void host_wrote(BlockId id, std::size_t offset, const void* src, std::size_t bytes);
  // Note [Spilled layers] (kv_store_disk.cpp): an append block whose host copy moves to the
  // caller's disk tier between uses. detach_host: the block must be Host (not acquired, kept or
  // busy); waits for its last write-through to land, then hands the host copy over (its first
  // valid_bytes() are the contents) and the block is Disk: acquire refuses it by name, prefetch
  // and offload pass it over, discard empties it. attach_host: a Disk block takes `host` (at
  // least its capacity, holding its first valid_bytes() again) as its host copy and is Host.
  // Both throw InvalidArgument naming the block and its state otherwise.
  PinnedBlock detach_host(BlockId id);
  void attach_host(BlockId id, PinnedBlock host);

  // The block's device address, valid for work submitted to `compute` from now until release().
  void* acquire(BlockId id, const Stream& compute, Access access = Access::ReadWrite);
  void release(BlockId id, const Stream& compute);

  // Starts moving an unpinned resident block to the host now. No-op unless Device.
  void offload(BlockId id);
  // Starts bringing a Host block back now if it fits in free room: prefetch never evicts (that
  // could push out a block needed sooner) and never waits. Returns whether the block is resident
  // or on its way (false: no room right now, or the block has no contents).
  bool prefetch(BlockId id);
  // Drops the contents (state Empty) and frees memory on both sides. It must not be acquired.
  // A block whose D2H is in flight becomes Empty when that copy lands (no waiting).
  void discard(BlockId id);

  BlockState state(BlockId id) const;
  // Whether compute holds the block (acquired more often than released): it stays resident, and
  // offload, discard and unregister refuse it.
  bool acquired(BlockId id) const;
  std::size_t bytes(BlockId id) const;
  const std::string& name(BlockId id) const;
  std::vector<BlockId> blocks() const;

  std::size_t budget_bytes() const;
  // Changes the budget. Blocks over a lowered budget leave as room is next needed.
  void set_budget_bytes(std::size_t bytes);
  std::size_t device_bytes() const;  // held now: resident, in flight, or being freed
  // Of those, the blocks prefetch() brought (or is bringing) that no acquire has used yet.
  std::size_t prefetched_bytes() const;

  // Marks the end of a step (policies that learn from the previous step's trace use it).
  void end_step();
  // Waits for every copy in flight and folds all completions into state and metrics.
  void synchronize();
  // Waits for the block's own copy in flight, if any (a prefetch landing, an eviction leaving),
  // and folds it: the block is then Device, Host or Empty. Other copies go on.
  void settle(BlockId id);
  // Folds completed copies and waits into state and metrics without blocking.
  void poll();

  ManagerMetrics metrics();
  std::vector<TimelineEvent> timeline();
  // The events so far, leaving none: a long-lived manager's caller takes each call's events
  // (trace files) before the capacity fills. Metrics stay.
  std::vector<TimelineEvent> take_timeline();
  void reset_metrics();

  TransferEngine& engine() const noexcept { return *engine_; }
  const std::shared_ptr<TransferEngine>& engine_ptr() const noexcept { return engine_; }
  Backend& backend() const noexcept { return engine_->backend(); }
  std::string policy_name() const;

  // For tests: every invariant of the state machine and the accounting (aborts on violation).
  void check_invariants() const;

 private:
  struct Impl;
  std::shared_ptr<TransferEngine> engine_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace reviva
