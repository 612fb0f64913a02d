// A synthetic layer pipeline: the shape of a training step, in pure C++, for the example program
// (examples/layer_pipeline_main.cpp) and the benchmark (benchmarks/bench_pipeline.cpp).
//
// N layers. Forward, layer i: compute (cuBLAS GEMMs sized to take a chosen time) writes the
// activation A_i; backward, layers N-1..0: compute reads A_i (it is an input matrix of the
// backward GEMM), after which A_i is dropped. The activations are what a budget forces off the
// GPU; the same step runs in three modes:
//   none    every activation stays resident: the compute-only baseline (no budget);
//   naive   after each forward layer a synchronous D2H into pinned memory, before each backward
//           layer a synchronous H2D: what "just offload it" costs (one activation resident);
//   reviva  the activations are blocks of an OffloadManager under a budget of a few activations,
//           driven by a PrefetchScheduler with the step's order declared (forward groups, then
//           backward groups), so offloads and prefetches overlap the compute.
// Offloading is lossless, so every mode must produce bit-identical backward results (checked by
// a checksum of the backward output after every step).
//
// On the CUDA backend the compute is cuBLAS (bf16 or fp32). On the host backend (no GPU) it is
// simulated: host functions on the compute stream fill A_i with a pattern derived from (step,
// layer), sleep for the compute time, and in backward check A_i word for word against the pattern,
// so the residency logic is exercised, and verified, without a GPU.
#pragma once

#include <reviva/reviva.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace reviva::examples {

enum class PipelineMode { None, Naive, Reviva };
const char* to_string(PipelineMode mode) noexcept;
// "none", "naive", "reviva"; InvalidArgument naming the value otherwise.
PipelineMode parse_pipeline_mode(std::string_view name);

enum class ComputeType { BF16, FP32 };
const char* to_string(ComputeType type) noexcept;
// "bf16", "fp32"; InvalidArgument naming the value otherwise.
ComputeType parse_compute_type(std::string_view name);

struct PipelineConfig {
  int layers = 16;
  // One activation: [tokens, hidden] elements of the compute type, so a multiple of
  // hidden * element size (the CUDA compute checks; the host simulation takes any multiple of 8).
  std::size_t activation_bytes = std::size_t{64} << 20;
  int hidden = 4096;
  ComputeType compute_type = ComputeType::BF16;

  // Reviva mode: the scheduler's window (groups in flight ahead of compute) and the device budget
  // in activations (0: window + 2).
  int prefetch_window = 2;
  int budget_activations = 0;
  PolicyKind policy = PolicyKind::Lru;
  bool adaptive_window = false;
  bool eager_offload = true;

  // Steps of each mode: warm-up steps first (pinned slabs, cuBLAS heuristics, pool growth), then
  // timed steps, of which the median counts.
  int warmup_steps = 2;
  int timed_steps = 5;

  std::size_t budget_bytes() const;  // budget_activations (or window + 2) * activation_bytes
};

// One large copy each way, timed with events on a stream of its own.
struct MeasuredBandwidth {
  double d2h_gbps = 0.0;
  double h2d_gbps = 0.0;
  std::size_t bytes_per_copy = 0;
  int copies = 0;
};

// Compute time per layer as measured after calibration (no copies in flight).
struct ComputeCalibration {
  double target_ms = 0.0;
  double forward_ms = 0.0;   // per layer
  double backward_ms = 0.0;  // per layer
  std::string description;   // e.g. "cuBLAS bf16 GEMM 8192x4096x4096 x1 + filler 3x + 2048 rows"
};

struct ModeResult {
  PipelineMode mode = PipelineMode::None;
  int steps = 0;             // timed steps
  double step_ms = 0.0;      // median wall time of a step (submission to completion)
  double forward_ms = 0.0;   // median, compute-stream events around the forward pass
  double backward_ms = 0.0;  // median, compute-stream events around the backward pass
  std::vector<double> step_ms_samples;
  // Checksum of the backward output after each step (warm-up and timed, in order). Modes with
  // the same config must agree step for step: offloading is lossless.
  std::vector<std::uint64_t> step_checksums;
  // Host simulation only: (step, layer) activations that came back different from what forward
  // wrote. -1 on CUDA (there, the cross-mode checksum comparison is the check).
  std::int64_t corrupted_activations = -1;
  // Device memory held for activations, at most (for reviva: the manager's peak over all steps),
  // and the budget (0: none).
  std::size_t peak_device_bytes = 0;
  std::size_t budget_bytes = 0;
  // Copies per step, each way (none: 0; naive: every activation; reviva: the manager's).
  double bytes_to_host_per_step = 0.0;
  double bytes_to_device_per_step = 0.0;
  // Reviva only: the manager's metrics over the timed steps (peak_device_bytes over all steps)
  // and the scheduler's statistics.
  bool has_manager_metrics = false;
  ManagerMetrics metrics;
  PrefetchSchedulerStats scheduler;
  std::string policy;
};

class LayerCompute;

class LayerPipeline {
 public:
  // The compute is cuBLAS on the CUDA backend, the simulation on the host backend.
  LayerPipeline(std::shared_ptr<Backend> backend, PipelineConfig config);
  ~LayerPipeline();
  LayerPipeline(const LayerPipeline&) = delete;
  LayerPipeline& operator=(const LayerPipeline&) = delete;

  // D2H and H2D of one activation, `copies` times back to back each way, pinned memory.
  MeasuredBandwidth measure_bandwidth(int copies = 8);
  // Sizes the compute of one layer (each pass) to take `ms` (on CUDA: GEMMs calibrated by
  // timing them; a layer never takes less than its one GEMM, whatever `ms` says).
  ComputeCalibration set_compute_ms(double ms);

  // Runs warm-up + timed steps of `mode`. Throws on misuse; a wrong result is reported in the
  // returned checksums / corrupted_activations, not thrown.
  ModeResult run(PipelineMode mode);

  const PipelineConfig& config() const noexcept { return config_; }
  Backend& backend() const noexcept { return *backend_; }
  std::string compute_description() const;

 private:
  std::shared_ptr<Backend> backend_;
  PipelineConfig config_;
  std::shared_ptr<PinnedHostPool> pool_;
  std::unique_ptr<Stream> compute_stream_;
  std::unique_ptr<LayerCompute> compute_;  // uses compute_stream_: declared (destroyed) after it
};

// The roofline of one step that offloads `bytes_each_way` during forward and brings it back
// during backward: max(T_forward, bytes / BW_d2h) + max(T_backward, bytes / BW_h2d), in ms.
double roofline_ms(double compute_forward_ms, double compute_backward_ms, double bytes_each_way,
                   const MeasuredBandwidth& bandwidth);

// 64-bit hash of a byte range (word-wise; for checksums of outputs, not for security).
std::uint64_t hash_bytes(const void* data, std::size_t bytes, std::uint64_t seed = 0);

// "64MiB", "256KiB", "1GiB", "4096" (bytes; KiB/MiB/GiB and KB/MB/GB, case-insensitive).
// InvalidArgument naming the value otherwise.
std::size_t parse_size(std::string_view text);

// Applies one of the command-line flags that set PipelineConfig fields, shared by the pipeline's
// programs: --hidden N, --dtype bf16|fp32, --window N, --budget-activations N, --policy NAME,
// --adaptive, --no-eager-offload, --warmup N, --steps N. `value` yields the flag's argument.
// Returns false when `flag` is none of them.
bool apply_config_flag(const std::string& flag, const std::function<std::string()>& value,
                       PipelineConfig& config);

}  // namespace reviva::examples
