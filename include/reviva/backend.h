// Backend: the mechanism under every policy in the core. The pool, the transfer engine and the
// managers above them call only this interface, never CUDA directly, so all of their logic runs
// and is tested without a GPU (the host backend) and unchanged on one (the CUDA backend).
//
// Semantics follow CUDA's: work submitted to one stream runs in order; streams run concurrently;
// an event completes when the stream that recorded it reaches it; a stream that waits on an event
// waits for the most recent record made before the wait was submitted (a never-recorded event is
// complete). The host backend reproduces these with one worker thread per stream.
#pragma once

#include <reviva/export.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace reviva {

enum class BackendKind { Host, Cuda };
enum class StreamPriority { Normal, High };

// Opaque handles: cudaStream_t / cudaEvent_t on CUDA, host objects on the host backend.
using StreamHandle = void*;
using EventHandle = void*;

// One piece of a coalesced copy (layout shared with kernels::CopySegment).
struct CopySegment {
  const void* src;
  void* dst;
  std::size_t bytes;
};

// fp8 K/V rows (Note [fp8 K/V rows] in python/reviva/cache/fp8.py): each row is head_dim e4m3
// bytes followed by an fp32 scale. `base` points at row [0][0][0] of a 3-D index of rows with
// these byte strides (a view of a KVStore's token-major rows); head_dim, `base` and the strides
// are multiples of 4.
struct Fp8Rows {
  const void* base = nullptr;
  std::size_t count[3] = {0, 0, 0};
  std::int64_t stride[3] = {0, 0, 0};  // bytes
  std::size_t head_dim = 0;
};

// Rows of a table gathered by index, an embedding's lookup: row i of `out` is row ids[i] of
// `table`, row_bytes bytes each. The table is device memory or pinned host memory that the device
// reads in place over the bus (Note [Embedding on the host] in
// python/reviva/weights/host_embedding.py: no host work, no synchronization); `ids` (int64) and
// `out` are device memory. An index outside [0, rows) gives a row of zeros: callers check the
// indices they did not produce themselves.
struct RowGather {
  const void* table = nullptr;
  std::size_t rows = 0;       // rows in the table
  std::size_t row_bytes = 0;  // bytes of one row
  const std::int64_t* ids = nullptr;
  std::size_t count = 0;  // rows to gather
  void* out = nullptr;    // [count][row_bytes]
};

// The 16-bit float types a kernel writes.
enum class HalfType { BFloat16, Float16 };

// One decode step's attention over fp8 K/V rows read in place (Note [fp8 decode attention] in
// src/fp8_attention.cpp): each sequence's query of each head attends the keys [first_key,
// length) of its kv head (heads / kv_heads query heads share one), after the new token's key and
// value (when given) are quantized into row length - 1 of the rows (Note [fp8 K/V rows]).
// Strides of q, k_new, v_new and out count elements (their last dimension is dense); those of
// the rows count bytes (K and V rows share them: one token-major store holds both).
struct Fp8DecodeAttention {
  HalfType type = HalfType::BFloat16;  // of q, k_new, v_new and out
  std::size_t batch = 0;
  std::size_t heads = 0;
  std::size_t kv_heads = 0;
  std::size_t head_dim = 0;  // a multiple of 4, at most kFp8DecodeMaxHeadDim
  const void* q = nullptr;   // [batch][heads][head_dim]
  std::int64_t q_stride[2] = {0, 0};
  const void* k_new = nullptr;  // [batch][kv_heads][head_dim], or null: the rows hold the token
  const void* v_new = nullptr;  // [batch][kv_heads][head_dim], null exactly when k_new is
  std::int64_t k_new_stride[2] = {0, 0};
  std::int64_t v_new_stride[2] = {0, 0};
  void* k_rows = nullptr;  // [batch][kv_heads][tokens] rows of head_dim + 4 bytes
  void* v_rows = nullptr;
  std::int64_t row_stride[3] = {0, 0, 0};  // bytes
  std::size_t first_key = 0;               // a sliding window's first key, else 0
  std::size_t length = 0;                  // keys [0, length) are valid after the step
  // Captured in a CUDA graph (Note [fp8 attention in the decode graphs]): with device_length,
  // the step's length is read from there when the kernel runs (`length` above is then the
  // most it can be, the layer's capacity, which sets the splits), and the first key is
  // length - window (0 without a window: `first_key` is not read); with device_rows, the K and
  // V rows' addresses are read from device_rows[0] and [1] (k_rows and v_rows are not read).
  // A length read there outside [1, length] writes NaN to `out` and leaves the rows (the step
  // cannot throw from the stream it runs on).
  const std::int64_t* device_length = nullptr;
  const std::uint64_t* device_rows = nullptr;
  std::size_t window = 0;
  float scale = 1.0f;   // of the scores (1 / sqrt(head_dim) in most models)
  void* out = nullptr;  // [batch][heads][head_dim]
  std::int64_t out_stride[2] = {0, 0};
  void* workspace = nullptr;  // device memory of Backend::fp8_decode_workspace_bytes()
  std::size_t workspace_bytes = 0;
};
constexpr std::size_t kFp8DecodeMaxHeadDim = 256;

// A decode step's row-wise operations (Note [Decode row ops] in src/row_ops.cpp): each is one
// kernel on CUDA where torch runs several, computing as HF's modules do. Strides count elements;
// the last dimension of every operand is dense.

// RMS normalization of `rows` rows of `width` values as HF's LlamaRMSNorm computes it: in fp32,
// x * rsqrt(mean(x^2) + eps), rounded to `type`, times `weight` (rounded again). With
// `residual`, x is residual + x rounded to `type`, which is also written back into `residual`
// (a decoder layer's residual add and the next norm in one).
struct RmsNorm {
  HalfType type = HalfType::BFloat16;
  std::size_t rows = 0;
  std::size_t width = 0;
  const void* x = nullptr;  // [rows][width]
  std::int64_t x_stride = 0;
  void* residual = nullptr;  // [rows][width], or null
  std::int64_t residual_stride = 0;
  const void* weight = nullptr;  // [width]
  float eps = 0.0f;
  void* out = nullptr;  // [rows][width]; may be x itself, not residual
  std::int64_t out_stride = 0;
};

// Rotary position embedding applied in place to queries and keys as HF's apply_rotary_pos_emb
// computes it with rotate_half: x * cos + rotate_half(x) * sin, each product and the sum rounded
// to `type` (cos and sin of `type`, [batch][head_dim], one position per sequence).
struct Rotary {
  HalfType type = HalfType::BFloat16;
  std::size_t batch = 0;
  std::size_t q_heads = 0;
  std::size_t k_heads = 0;
  std::size_t head_dim = 0;  // even
  void* q = nullptr;         // [batch][q_heads][head_dim]
  std::int64_t q_stride[2] = {0, 0};
  void* k = nullptr;  // [batch][k_heads][head_dim]
  std::int64_t k_stride[2] = {0, 0};
  const void* cos = nullptr;  // [batch][head_dim]
  const void* sin = nullptr;
  std::int64_t cos_stride = 0;
  std::int64_t sin_stride = 0;
};

// silu(gate) * up as HF's gated MLP computes it: silu in fp32 rounded to `type`, then the product
// rounded. `out` may be gate or up itself.
struct SiluMul {
  HalfType type = HalfType::BFloat16;
  std::size_t rows = 0;
  std::size_t width = 0;
  const void* gate = nullptr;  // [rows][width]
  std::int64_t gate_stride = 0;
  const void* up = nullptr;
  std::int64_t up_stride = 0;
  void* out = nullptr;
  std::int64_t out_stride = 0;
};

struct DeviceMemoryInfo {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
};

// Where a pointer lives, as far as the backend can tell.
enum class MemoryKind { Unknown, Pageable, PinnedHost, Device, Managed };

REVIVA_API const char* to_string(BackendKind kind) noexcept;
REVIVA_API const char* to_string(MemoryKind kind) noexcept;

class REVIVA_API Backend {
 public:
  virtual ~Backend();

  virtual BackendKind kind() const noexcept = 0;
  // For messages and reports: "cuda:0 (NVIDIA H200)", "host".
  virtual std::string name() const = 0;
  virtual int device_index() const noexcept = 0;

  // --- streams ---------------------------------------------------------------------------------
  virtual StreamHandle create_stream(StreamPriority priority) = 0;
  virtual void destroy_stream(StreamHandle stream) noexcept = 0;
  virtual void synchronize_stream(StreamHandle stream) = 0;
  virtual void stream_wait_event(StreamHandle stream, EventHandle event) = 0;
  // Runs `fn` on a host thread once all earlier work of `stream` has completed; later work of the
  // stream waits for it. `fn` must not call the backend (CUDA forbids API calls in host funcs).
  virtual void launch_host_func(StreamHandle stream, std::function<void()> fn) = 0;

  // --- events ----------------------------------------------------------------------------------
  virtual EventHandle create_event(bool enable_timing) = 0;
  virtual void destroy_event(EventHandle event) noexcept = 0;
  virtual void record_event(EventHandle event, StreamHandle stream) = 0;
  virtual bool query_event(EventHandle event) = 0;  // true once complete
  virtual void synchronize_event(EventHandle event) = 0;
  // Milliseconds between two completed timing events.
  virtual float elapsed_ms(EventHandle start, EventHandle end) = 0;

  // --- memory ----------------------------------------------------------------------------------
  // Page-locked host memory that copies and kernels can use directly. Throws OutOfMemory.
  virtual void* allocate_pinned_host(std::size_t bytes) = 0;
  virtual void free_pinned_host(void* ptr) noexcept = 0;
  // Stream-ordered device memory: usable by work submitted to `stream` after this call; the free
  // takes effect once work submitted to `stream` before it has completed.
  virtual void* allocate_device(std::size_t bytes, StreamHandle stream) = 0;
  virtual void free_device(void* ptr, StreamHandle stream) noexcept = 0;
  virtual DeviceMemoryInfo device_memory_info() = 0;
  virtual MemoryKind memory_kind(const void* ptr) = 0;

  // --- virtual memory (the DeviceArena's mechanism) --------------------------------------------
  // Physical device memory is mapped into reserved address ranges in multiples of this many
  // bytes (2 MiB on current GPUs). 0: the device cannot (no virtual memory management).
  virtual std::size_t vmm_granularity() = 0;
  // Reserves `bytes` (a multiple of the granularity) of device address space, backed by nothing.
  virtual void* reserve_address(std::size_t bytes) = 0;
  // Gives back a reservation (exactly as reserved); nothing may be mapped in it any more.
  virtual void release_address(void* ptr, std::size_t bytes) noexcept = 0;
  // Backs [ptr, ptr + bytes) of a reservation (granule-aligned) with new physical memory that the
  // device reads and writes. Throws OutOfMemory, naming the numbers, when the device has none.
  virtual void map_memory(void* ptr, std::size_t bytes) = 0;
  // Unmaps a range mapped by one map_memory call (exactly that range) and frees its memory. No
  // work may use it any more: callers order this after the events of every stream that did.
  virtual void unmap_memory(void* ptr, std::size_t bytes) noexcept = 0;

  // --- copies ----------------------------------------------------------------------------------
  // Asynchronous copy between any two of device / pinned host memory, ordered on `stream`.
  virtual void copy_async(void* dst, const void* src, std::size_t bytes, StreamHandle stream) = 0;
  // Copies many segments as one operation (one kernel launch on CUDA). `segments` must be in
  // pinned host memory and stay valid until the copy completes on `stream`.
  virtual void copy_segments_async(const CopySegment* segments, std::size_t count,
                                   StreamHandle stream) = 0;
  // Fills device or pinned memory with a byte value (tests, poisoning).
  virtual void memset_async(void* dst, int value, std::size_t bytes, StreamHandle stream) = 0;

  // --- kernels of what is moved ----------------------------------------------------------------
  // fp8 rows to 16-bit values: `out` gets them contiguous, [count0][count1][count2][head_dim] of
  // `type`, each the e4m3 value times its row's scale in fp32, rounded to nearest even; ordered
  // on `stream` (one kernel on CUDA, no temporaries).
  virtual void dequantize_fp8_rows_async(const Fp8Rows& rows, void* out, HalfType type,
                                         StreamHandle stream) = 0;
  // Table rows by index (RowGather), ordered on `stream` (one kernel on CUDA).
  virtual void gather_rows_async(const RowGather& gather, StreamHandle stream) = 0;
  // Fp8DecodeAttention, ordered on `stream`: on CUDA a split-K kernel over the keys and a merge
  // of the splits (two launches, no allocation); on the host the reference loop.
  virtual void attend_fp8_decode_async(const Fp8DecodeAttention& attention,
                                       StreamHandle stream) = 0;
  // Bytes of device workspace attend_fp8_decode_async needs for `attention` (its splits'
  // partial outputs); 0 on the host and when one split covers the keys.
  virtual std::size_t fp8_decode_workspace_bytes(const Fp8DecodeAttention& attention) const = 0;
  // The decode row operations (RmsNorm, Rotary, SiluMul), ordered on `stream`: one kernel each
  // on CUDA; on the host the references below.
  virtual void rms_norm_async(const RmsNorm& norm, StreamHandle stream) = 0;
  virtual void rotary_async(const Rotary& rotary, StreamHandle stream) = 0;
  virtual void silu_mul_async(const SiluMul& op, StreamHandle stream) = 0;
};

struct HostBackendOptions {
  // What device_memory_info() reports as total "device" memory (the host backend's device
  // memory is ordinary host memory). Lets budget logic be tested at any size.
  std::size_t simulated_device_bytes = std::size_t{16} << 30;
  // Granularity of the simulated virtual memory mappings (a multiple of the page size).
  std::size_t vmm_granularity = std::size_t{2} << 20;
};

// Threads play the role of streams; "device" memory is host memory. Always available.
REVIVA_API std::shared_ptr<Backend> make_host_backend(HostBackendOptions options = {});

// Checks the arguments of Backend::dequantize_fp8_rows_async; throws InvalidArgument naming the
// bad value (null pointers, head_dim, base or a stride not a multiple of 4).
REVIVA_API void check_fp8_rows(const Fp8Rows& rows, const void* out);
// Dequantizes fp8 rows on the calling thread (the host backend's way, and the reference the CUDA
// kernel is tested against: the same values to the bit).
REVIVA_API void dequantize_fp8_rows(const Fp8Rows& rows, void* out, HalfType type);

// Checks the arguments of Backend::attend_fp8_decode_async (not the workspace); throws
// InvalidArgument naming the bad value.
REVIVA_API void check_fp8_decode_attention(const Fp8DecodeAttention& attention);
// Runs Fp8DecodeAttention on the calling thread: the new token quantized exactly as
// python/reviva/cache/fp8.py quantizes, the attention in fp32 (the host backend's way, and the
// reference the CUDA kernel is tested against).
REVIVA_API void attend_fp8_decode(const Fp8DecodeAttention& attention);

// Checks the arguments of Backend::gather_rows_async; throws InvalidArgument naming the bad
// value (null pointers with rows to gather, an empty row, an empty table).
REVIVA_API void check_row_gather(const RowGather& gather);
// Gathers on the calling thread (the host backend's way, and the CUDA kernel's reference).
REVIVA_API void gather_rows(const RowGather& gather);

// Check the arguments of the decode row operations; throw InvalidArgument naming the bad value
// (null pointers with rows to compute, a width or head_dim of 0, an odd head_dim, strides shorter
// than a row, `out` aliasing `residual`).
REVIVA_API void check_rms_norm(const RmsNorm& norm);
REVIVA_API void check_rotary(const Rotary& rotary);
REVIVA_API void check_silu_mul(const SiluMul& op);
// The row operations on the calling thread (the host backend's way, and the references the CUDA
// kernels are tested against: Rotary and SiluMul's rounding alike, RmsNorm's sum in another order).
REVIVA_API void rms_norm(const RmsNorm& norm);
REVIVA_API void rotary(const Rotary& rotary);
REVIVA_API void silu_mul(const SiluMul& op);

// True when the library was built with CUDA and at least one device is usable.
REVIVA_API bool cuda_available() noexcept;
REVIVA_API int cuda_device_count() noexcept;
// The CUDA backend on `device`. Throws BackendError (naming why) when CUDA is unavailable.
REVIVA_API std::shared_ptr<Backend> make_cuda_backend(int device = 0);
// CUDA device 0 when available, the host backend otherwise.
REVIVA_API std::shared_ptr<Backend> make_default_backend();

}  // namespace reviva
