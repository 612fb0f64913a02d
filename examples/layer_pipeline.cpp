// The synthetic layer pipeline (see layer_pipeline.h): the compute (cuBLAS on CUDA, a simulation
// on the host backend), the three ways of keeping activations (resident, naive synchronous
// offload, Reviva), and the step loop that times them.
#include "layer_pipeline.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#if REVIVA_EXAMPLES_WITH_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

namespace reviva::examples {

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

std::uint64_t rotl(std::uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

std::uint64_t combine(std::uint64_t h, std::uint64_t v) {
  return rotl(h ^ (v * 0x9e3779b97f4a7c15ull), 29) * 0xbf58476d1ce4e5b9ull;
}

}  // namespace

// --- small public helpers ----------------------------------------------------------------------

const char* to_string(PipelineMode mode) noexcept {
  switch (mode) {
    case PipelineMode::None: return "none";
    case PipelineMode::Naive: return "naive";
    case PipelineMode::Reviva: return "reviva";
  }
  return "?";
}

PipelineMode parse_pipeline_mode(std::string_view name) {
  if (name == "none") return PipelineMode::None;
  if (name == "naive") return PipelineMode::Naive;
  if (name == "reviva") return PipelineMode::Reviva;
  throw InvalidArgument(
      detail::concat("unknown pipeline mode '", name, "' (expected none, naive or reviva)"));
}

const char* to_string(ComputeType type) noexcept {
  return type == ComputeType::BF16 ? "bf16" : "fp32";
}

ComputeType parse_compute_type(std::string_view name) {
  if (name == "bf16") return ComputeType::BF16;
  if (name == "fp32") return ComputeType::FP32;
  throw InvalidArgument(
      detail::concat("unknown compute type '", name, "' (expected bf16 or fp32)"));
}

std::size_t PipelineConfig::budget_bytes() const {
  const int n = budget_activations > 0 ? budget_activations : prefetch_window + 2;
  return static_cast<std::size_t>(n) * activation_bytes;
}

double roofline_ms(double compute_forward_ms, double compute_backward_ms, double bytes_each_way,
                   const MeasuredBandwidth& bandwidth) {
  REVIVA_CHECK_ARG(bandwidth.d2h_gbps > 0 && bandwidth.h2d_gbps > 0,
                   "roofline_ms: bandwidths must be measured (d2h ", bandwidth.d2h_gbps,
                   " GB/s, h2d ", bandwidth.h2d_gbps, " GB/s)");
  const double d2h_ms = bytes_each_way / (bandwidth.d2h_gbps * 1e6);
  const double h2d_ms = bytes_each_way / (bandwidth.h2d_gbps * 1e6);
  return std::max(compute_forward_ms, d2h_ms) + std::max(compute_backward_ms, h2d_ms);
}

std::uint64_t hash_bytes(const void* data, std::size_t bytes, std::uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t h = splitmix64(seed ^ bytes);
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    std::uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = combine(h, w);
  }
  std::uint64_t tail = 0;
  for (std::size_t k = 0; i < bytes; ++i, ++k) tail |= std::uint64_t{p[i]} << (8 * k);
  return splitmix64(combine(h, tail));
}

std::size_t parse_size(std::string_view text) {
  std::size_t pos = 0;
  while (pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos]))) ++pos;
  REVIVA_CHECK_ARG(pos > 0, "cannot read a size from '", text, "' (e.g. 64MiB, 4096)");
  std::uint64_t value = 0;
  for (std::size_t i = 0; i < pos; ++i) value = value * 10 + (text[i] - '0');
  std::string unit;
  for (char c : text.substr(pos)) unit += static_cast<char>(std::tolower(c));
  std::uint64_t scale = 1;
  if (unit.empty() || unit == "b")
    scale = 1;
  else if (unit == "kib" || unit == "k")
    scale = 1ull << 10;
  else if (unit == "mib" || unit == "m")
    scale = 1ull << 20;
  else if (unit == "gib" || unit == "g")
    scale = 1ull << 30;
  else if (unit == "kb")
    scale = 1000ull;
  else if (unit == "mb")
    scale = 1000ull * 1000;
  else if (unit == "gb")
    scale = 1000ull * 1000 * 1000;
  else
    throw InvalidArgument(detail::concat("unknown size unit in '", text, "' (use KiB, MiB, GiB)"));
  return static_cast<std::size_t>(value * scale);
}

bool apply_config_flag(const std::string& flag, const std::function<std::string()>& value,
                       PipelineConfig& config) {
  if (flag == "--hidden")
    config.hidden = std::stoi(value());
  else if (flag == "--dtype")
    config.compute_type = parse_compute_type(value());
  else if (flag == "--window")
    config.prefetch_window = std::stoi(value());
  else if (flag == "--budget-activations")
    config.budget_activations = std::stoi(value());
  else if (flag == "--policy")
    config.policy = parse_policy(value());
  else if (flag == "--adaptive")
    config.adaptive_window = true;
  else if (flag == "--no-eager-offload")
    config.eager_offload = false;
  else if (flag == "--warmup")
    config.warmup_steps = std::stoi(value());
  else if (flag == "--steps")
    config.timed_steps = std::stoi(value());
  else
    return false;
  return true;
}

// --- compute -----------------------------------------------------------------------------------

// What a layer computes. Forward writes the layer's activation; backward reads it and folds it
// into the step's output, whose checksum end_step() returns.
class LayerCompute {
 public:
  virtual ~LayerCompute() = default;
  virtual std::string description() const = 0;
  // Outside the timed region: resets the step's inputs and output on `stream`.
  virtual void begin_step(std::uint64_t step, const Stream& stream) = 0;
  virtual void forward(int layer, void* activation, const Stream& stream) = 0;
  virtual void backward(int layer, const void* activation, const Stream& stream) = 0;
  // Synchronizes `stream` and returns the checksum of the step's output.
  virtual std::uint64_t end_step(const Stream& stream) = 0;
  virtual ComputeCalibration calibrate(double target_ms, const Stream& stream) = 0;
  // Activations found corrupted since the last reset (-1: this compute cannot tell).
  virtual std::int64_t corrupted() const { return -1; }
  virtual void reset_corrupted() {}
};

namespace {

// Forward and backward timed over all layers on `stream` (activations in one scratch buffer).
struct PassTimes {
  double forward_ms_per_layer = 0.0;
  double backward_ms_per_layer = 0.0;
};

PassTimes time_passes(LayerCompute& compute, Backend& backend,
                      const std::shared_ptr<Backend>& backend_ptr, const Stream& stream, int layers,
                      std::size_t activation_bytes) {
  void* scratch = backend.allocate_device(activation_bytes, stream.handle());
  Event start(backend_ptr, true), middle(backend_ptr, true), end(backend_ptr, true);
  compute.begin_step(~std::uint64_t{0}, stream);
  start.record(stream);
  for (int i = 0; i < layers; ++i) compute.forward(i, scratch, stream);
  middle.record(stream);
  // Backward reads the scratch, which holds the last layer's activation: only that layer's
  // contents would pass a check, which calibration does not need.
  for (int i = layers - 1; i >= 0; --i) compute.backward(i, scratch, stream);
  end.record(stream);
  stream.synchronize();
  backend.free_device(scratch, stream.handle());
  stream.synchronize();
  return {Event::elapsed_ms(start, middle) / layers, Event::elapsed_ms(middle, end) / layers};
}

// The host backend's stand-in for the GEMMs. Its "device" memory is ordinary host memory (see
// host_backend.cpp), so host functions on the compute stream may read and write it, in stream
// order, exactly as a kernel would: forward writes a pattern derived from (step, layer) into the
// activation, backward checks every word of it and folds its hash into the step's output. Each
// takes at least the compute time (it sleeps for what the fill or check did not use).
class SimulatedCompute final : public LayerCompute {
 public:
  SimulatedCompute(std::shared_ptr<Backend> backend, const PipelineConfig& config)
      : backend_(std::move(backend)), config_(config) {
    REVIVA_CHECK_ARG(config.activation_bytes % 8 == 0,
                     "the host simulation needs activation_bytes to be a multiple of 8, got ",
                     config.activation_bytes);
  }

  std::string description() const override {
    return detail::concat("host simulation: fill / check the activation, padded to ", compute_ms_,
                          " ms per layer and pass");
  }

  void begin_step(std::uint64_t step, const Stream& stream) override {
    step_ = step;
    auto* state = &state_;
    stream.launch_host_func([state] { state->output = 0; });
  }

  void forward(int layer, void* activation, const Stream& stream) override {
    const std::uint64_t seed = seed_of(step_, layer);
    const std::size_t words = config_.activation_bytes / 8;
    const double ms = compute_ms_;
    stream.launch_host_func([activation, words, seed, ms] {
      const auto t0 = Clock::now();
      auto* w = static_cast<std::uint64_t*>(activation);
      for (std::size_t k = 0; k < words; ++k) w[k] = pattern(seed, k);
      std::this_thread::sleep_until(t0 + std::chrono::duration<double, std::milli>(ms));
    });
  }

  void backward(int layer, const void* activation, const Stream& stream) override {
    const std::uint64_t seed = seed_of(step_, layer);
    const std::size_t words = config_.activation_bytes / 8;
    const std::size_t bytes = config_.activation_bytes;
    const double ms = compute_ms_;
    auto* state = &state_;
    const bool check = step_ != kCalibrationStep;
    stream.launch_host_func([activation, words, bytes, seed, ms, state, layer, check] {
      const auto t0 = Clock::now();
      const auto* w = static_cast<const std::uint64_t*>(activation);
      std::size_t wrong = 0;
      if (check)
        for (std::size_t k = 0; k < words; ++k) wrong += w[k] != pattern(seed, k);
      if (wrong) state->corrupted.fetch_add(1, std::memory_order_relaxed);
      state->output = combine(state->output, hash_bytes(activation, bytes, layer));
      std::this_thread::sleep_until(t0 + std::chrono::duration<double, std::milli>(ms));
    });
  }

  std::uint64_t end_step(const Stream& stream) override {
    stream.synchronize();
    return state_.output;  // written by host functions of `stream`, all complete
  }

  ComputeCalibration calibrate(double target_ms, const Stream& stream) override {
    compute_ms_ = std::max(0.0, target_ms);
    const std::uint64_t step = step_;
    step_ = kCalibrationStep;
    const PassTimes t = time_passes(*this, *backend_, backend_, stream, std::min(config_.layers, 4),
                                    config_.activation_bytes);
    step_ = step;
    return {target_ms, t.forward_ms_per_layer, t.backward_ms_per_layer, description()};
  }

  std::int64_t corrupted() const override {
    return static_cast<std::int64_t>(state_.corrupted.load(std::memory_order_relaxed));
  }
  void reset_corrupted() override { state_.corrupted.store(0, std::memory_order_relaxed); }

 private:
  static constexpr std::uint64_t kCalibrationStep = ~std::uint64_t{0};
  static std::uint64_t seed_of(std::uint64_t step, int layer) {
    return splitmix64((step << 20) ^ static_cast<std::uint64_t>(layer) ^ 0x5eed);
  }
  static std::uint64_t pattern(std::uint64_t seed, std::size_t k) {
    return splitmix64(seed + 0x632be59bd9b4e019ull * k);
  }

  struct State {
    std::uint64_t output = 0;  // only touched by host functions of the compute stream
    std::atomic<std::uint64_t> corrupted{0};
  };

  std::shared_ptr<Backend> backend_;
  PipelineConfig config_;
  double compute_ms_ = 0.0;
  std::uint64_t step_ = 0;
  State state_;
};

#if REVIVA_EXAMPLES_WITH_CUDA

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw BackendError(detail::concat(what, " failed: ", cublasGetStatusName(status), " (",
                                      cublasGetStatusString(status), ")"));
}

std::uint16_t to_bf16(float f) {
  std::uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even (inputs are finite)
  return static_cast<std::uint16_t>(bits >> 16);
}

// cuBLAS GEMMs on the compute stream. Row-major shapes (cuBLAS sees their transposes):
//   H  [tokens, hidden]  the hidden state, input of forward layer i
//   W_i [hidden, hidden] layer i's weight, resident
//   A_i [tokens, hidden] layer i's activation
//   G  [tokens, hidden]  the backward output
// Forward i:  A_i = H W_i, then H = A_i (a device-to-device copy);
// Backward i: G += A_i W_i. G after the step depends on every activation, so its checksum shows
// any activation that did not come back intact.
// "Filler" GEMMs (the same product into a scratch buffer; backward's read A_i) bring a layer to
// the chosen compute time: whole GEMMs, then one over a part of the rows.
class CublasCompute final : public LayerCompute {
 public:
  CublasCompute(std::shared_ptr<Backend> backend, const PipelineConfig& config,
                const Stream& stream)
      : backend_(std::move(backend)), config_(config), stream_(&stream) {
    element_bytes_ = config.compute_type == ComputeType::BF16 ? 2 : 4;
    data_type_ = config.compute_type == ComputeType::BF16 ? CUDA_R_16BF : CUDA_R_32F;
    const std::size_t row_bytes = static_cast<std::size_t>(config.hidden) * element_bytes_;
    REVIVA_CHECK_ARG(config.activation_bytes % row_bytes == 0, "activation_bytes (",
                     config.activation_bytes, ") must be a multiple of hidden * element size (",
                     config.hidden, " * ", element_bytes_, " = ", row_bytes, ")");
    tokens_ = static_cast<int>(config.activation_bytes / row_bytes);
    const std::size_t d = static_cast<std::size_t>(config.hidden);
    weight_elements_ = d * d;

    check_cublas(cublasCreate(&handle_), "cublasCreate");
    const StreamHandle s = stream.handle();
    const std::size_t act = config.activation_bytes;
    weights_ = backend_->allocate_device(weight_elements_ * element_bytes_ * config.layers, s);
    hidden0_ = backend_->allocate_device(act, s);
    hidden_ = backend_->allocate_device(act, s);
    grad_ = backend_->allocate_device(act, s);
    scratch_ = backend_->allocate_device(act, s);
    readback_ = backend_->allocate_pinned_host(act);
    initialize(stream);
  }

  ~CublasCompute() override {
    try {
      stream_->synchronize();
    } catch (const std::exception&) {
    }
    const StreamHandle s = stream_->handle();
    for (void* p : {weights_, hidden0_, hidden_, grad_, scratch_}) backend_->free_device(p, s);
    try {
      stream_->synchronize();
    } catch (const std::exception&) {
    }
    backend_->free_pinned_host(readback_);
    if (handle_) cublasDestroy(handle_);
  }

  std::string description() const override {
    std::ostringstream out;
    out << "cuBLAS " << to_string(config_.compute_type) << " GEMM [" << tokens_ << " x "
        << config_.hidden << "] x [" << config_.hidden << " x " << config_.hidden
        << "], + filler forward " << describe(forward_filler_) << ", backward "
        << describe(backward_filler_);
    return out.str();
  }

  void begin_step(std::uint64_t, const Stream& stream) override {
    backend_->copy_async(hidden_, hidden0_, config_.activation_bytes, stream.handle());
    backend_->memset_async(grad_, 0, config_.activation_bytes, stream.handle());
  }

  void forward(int layer, void* activation, const Stream& stream) override {
    bind(stream);
    const void* w = weight(layer);
    run_filler(forward_filler_, w, hidden_);
    gemm(w, hidden_, activation, tokens_, 0.0f);
    backend_->copy_async(hidden_, activation, config_.activation_bytes, stream.handle());
  }

  void backward(int layer, const void* activation, const Stream& stream) override {
    bind(stream);
    const void* w = weight(layer);
    run_filler(backward_filler_, w, activation);
    gemm(w, activation, grad_, tokens_, 1.0f);
  }

  std::uint64_t end_step(const Stream& stream) override {
    backend_->copy_async(readback_, grad_, config_.activation_bytes, stream.handle());
    stream.synchronize();
    return hash_bytes(readback_, config_.activation_bytes);
  }

  ComputeCalibration calibrate(double target_ms, const Stream& stream) override {
    forward_filler_ = backward_filler_ = {};
    const int layers = config_.layers;
    for (int warm = 0; warm < 2; ++warm)  // cuBLAS heuristics, clocks
      time_passes(*this, *backend_, backend_, stream, layers, config_.activation_bytes);
    const PassTimes base =
        time_passes(*this, *backend_, backend_, stream, layers, config_.activation_bytes);
    const double gemm = time_gemm(stream);
    double fwd_rows = filler_rows(target_ms, base.forward_ms_per_layer, gemm);
    double bwd_rows = filler_rows(target_ms, base.backward_ms_per_layer, gemm);
    PassTimes got = base;
    // A partial GEMM's time is not linear in its rows (waves of tiles): correct twice by secant.
    for (int round = 0; round < 3; ++round) {
      forward_filler_ = plan(fwd_rows);
      backward_filler_ = plan(bwd_rows);
      got = time_passes(*this, *backend_, backend_, stream, layers, config_.activation_bytes);
      fwd_rows = refine(fwd_rows, target_ms, base.forward_ms_per_layer, got.forward_ms_per_layer);
      bwd_rows = refine(bwd_rows, target_ms, base.backward_ms_per_layer, got.backward_ms_per_layer);
    }
    return {target_ms, got.forward_ms_per_layer, got.backward_ms_per_layer, description()};
  }

 private:
  struct Filler {
    int whole = 0;  // GEMMs over all rows
    int rows = 0;   // then one over this many rows (0: none)
  };

  static std::string describe(const Filler& f) {
    return detail::concat(f.whole, " GEMMs + ", f.rows, " rows");
  }

  double filler_rows(double target_ms, double base_ms, double gemm_ms) const {
    if (target_ms <= base_ms || gemm_ms <= 0) return 0.0;
    return (target_ms - base_ms) / gemm_ms * tokens_;
  }

  static double refine(double rows, double target_ms, double base_ms, double got_ms) {
    if (rows <= 0) return rows;
    const double added = got_ms - base_ms;
    if (added <= 0 || std::abs(got_ms - target_ms) < 0.01 * target_ms) return rows;
    return std::max(0.0, rows * (target_ms - base_ms) / added);
  }

  Filler plan(double rows) const {
    Filler f;
    if (rows <= 0) return f;
    f.whole = static_cast<int>(rows / tokens_);
    const double rest = rows - static_cast<double>(f.whole) * tokens_;
    f.rows = static_cast<int>(std::lround(rest / 64.0)) * 64;
    if (f.rows >= tokens_) {
      ++f.whole;
      f.rows = 0;
    }
    return f;
  }

  void run_filler(const Filler& f, const void* w, const void* input) {
    for (int k = 0; k < f.whole; ++k) gemm(w, input, scratch_, tokens_, 0.0f);
    if (f.rows > 0) gemm(w, input, scratch_, f.rows, 0.0f);
  }

  double time_gemm(const Stream& stream) {
    bind(stream);
    Event start(backend_, true), end(backend_, true);
    const int reps = 2 * config_.layers;
    start.record(stream);
    for (int k = 0; k < reps; ++k) gemm(weight(k % config_.layers), hidden_, scratch_, tokens_, 0);
    end.record(stream);
    stream.synchronize();
    return Event::elapsed_ms(start, end) / reps;
  }

  void bind(const Stream& stream) {
    check_cublas(cublasSetStream(handle_, static_cast<cudaStream_t>(stream.handle())),
                 "cublasSetStream");
  }

  const void* weight(int layer) const {
    return static_cast<const char*>(weights_) +
           static_cast<std::size_t>(layer) * weight_elements_ * element_bytes_;
  }

  // out[rows, d] = in[rows, d] W[d, d] + beta out (row-major; column-major out^T = W^T in^T).
  void gemm(const void* w, const void* in, void* out, int rows, float beta) {
    const float alpha = 1.0f;
    const int d = config_.hidden;
    check_cublas(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, d, rows, d, &alpha, w, data_type_,
                              d, in, data_type_, d, &beta, out, data_type_, d, CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT),
                 "cublasGemmEx");
  }

  // Random weights (variance 1/d, so the hidden state keeps its scale through the layers) and a
  // random input, generated on the host once; the layers' weights are distinct shifted windows of
  // one random buffer, which keeps start-up fast at any layer count.
  void initialize(const Stream& stream) {
    const std::size_t d = static_cast<std::size_t>(config_.hidden);
    const std::size_t shift = 64;  // elements between layers' windows (keeps 16-byte alignment)
    const std::size_t source_elements = weight_elements_ + shift * config_.layers;
    const std::size_t input_elements = config_.activation_bytes / element_bytes_;
    const std::size_t staging_bytes = std::max(source_elements, input_elements) * element_bytes_;
    void* staging = backend_->allocate_pinned_host(staging_bytes);
    void* source = backend_->allocate_device(source_elements * element_bytes_, stream.handle());
    auto fill = [&](std::size_t n, float scale, std::uint64_t seed) {
      for (std::size_t k = 0; k < n; ++k) {
        const double u = static_cast<double>(splitmix64(seed + k) >> 11) * 0x1.0p-53;  // [0, 1)
        const float v = static_cast<float>((2.0 * u - 1.0) * scale);
        if (element_bytes_ == 2)
          static_cast<std::uint16_t*>(staging)[k] = to_bf16(v);
        else
          static_cast<float*>(staging)[k] = v;
      }
    };
    fill(source_elements, static_cast<float>(std::sqrt(3.0 / static_cast<double>(d))), 1);
    backend_->copy_async(source, staging, source_elements * element_bytes_, stream.handle());
    stream.synchronize();
    for (int i = 0; i < config_.layers; ++i)
      backend_->copy_async(const_cast<void*>(weight(i)),
                           static_cast<char*>(source) + i * shift * element_bytes_,
                           weight_elements_ * element_bytes_, stream.handle());
    fill(input_elements, 1.0f, 2);
    backend_->copy_async(hidden0_, staging, config_.activation_bytes, stream.handle());
    backend_->memset_async(grad_, 0, config_.activation_bytes, stream.handle());
    backend_->memset_async(scratch_, 0, config_.activation_bytes, stream.handle());
    stream.synchronize();
    backend_->free_device(source, stream.handle());
    stream.synchronize();
    backend_->free_pinned_host(staging);
  }

  std::shared_ptr<Backend> backend_;
  PipelineConfig config_;
  const Stream* stream_;  // the pipeline's compute stream, which outlives this object
  cublasHandle_t handle_ = nullptr;
  cudaDataType data_type_ = CUDA_R_16BF;
  std::size_t element_bytes_ = 2;
  int tokens_ = 0;
  std::size_t weight_elements_ = 0;
  void* weights_ = nullptr;
  void* hidden0_ = nullptr;
  void* hidden_ = nullptr;
  void* grad_ = nullptr;
  void* scratch_ = nullptr;
  void* readback_ = nullptr;  // pinned
  Filler forward_filler_;
  Filler backward_filler_;
};

#endif  // REVIVA_EXAMPLES_WITH_CUDA

// --- where activations live ----------------------------------------------------------------------

// One mode's handling of the activations. begin_* returns where compute writes (forward) or
// reads (backward) the layer's activation; end_* is called after the compute was submitted.
class ActivationStore {
 public:
  virtual ~ActivationStore() = default;
  virtual void* begin_forward(int layer) = 0;
  virtual void end_forward(int layer) = 0;
  virtual void* begin_backward(int layer) = 0;
  virtual void end_backward(int layer) = 0;
  virtual void end_step() {}
  // Outside the timed region, after the compute stream has drained: wait for stray copies.
  virtual void settle() {}
  // Between warm-up and timed steps.
  virtual void start_timing() {}
  virtual void report(ModeResult& result, int timed_steps) = 0;
};

// Mode none: every activation resident, allocated up front.
class ResidentStore final : public ActivationStore {
 public:
  ResidentStore(Backend& backend, const Stream& stream, const PipelineConfig& config)
      : backend_(backend), stream_(stream), bytes_(config.activation_bytes) {
    for (int i = 0; i < config.layers; ++i)
      activations_.push_back(backend_.allocate_device(bytes_, stream_.handle()));
    stream_.synchronize();
  }
  ~ResidentStore() override {
    for (void* p : activations_) backend_.free_device(p, stream_.handle());
  }
  void* begin_forward(int layer) override { return activations_[layer]; }
  void end_forward(int) override {}
  void* begin_backward(int layer) override { return activations_[layer]; }
  void end_backward(int) override {}
  void report(ModeResult& r, int) override {
    r.peak_device_bytes = bytes_ * activations_.size();
    r.budget_bytes = 0;
  }

 private:
  Backend& backend_;
  const Stream& stream_;
  std::size_t bytes_;
  std::vector<void*> activations_;
};

// Mode naive: one device buffer (what a caching allocator would hand back each time), and
// per layer a pinned host copy. Forward ends each layer with D2H on the compute stream and a
// stream synchronize; backward begins each layer with H2D and a synchronize. No overlap at all.
class SyncOffloadStore final : public ActivationStore {
 public:
  SyncOffloadStore(Backend& backend, const Stream& stream, PinnedHostPool& pool,
                   const PipelineConfig& config)
      : backend_(backend), stream_(stream), bytes_(config.activation_bytes) {
    device_ = backend_.allocate_device(bytes_, stream_.handle());
    for (int i = 0; i < config.layers; ++i) host_.push_back(pool.allocate(bytes_));
    stream_.synchronize();
  }
  ~SyncOffloadStore() override {
    backend_.free_device(device_, stream_.handle());
    try {
      stream_.synchronize();  // no copy may still read or write the pinned blocks
    } catch (const std::exception&) {
    }
  }
  void* begin_forward(int) override { return device_; }
  void end_forward(int layer) override {
    backend_.copy_async(host_[layer].data(), device_, bytes_, stream_.handle());
    stream_.synchronize();
  }
  void* begin_backward(int layer) override {
    backend_.copy_async(device_, host_[layer].data(), bytes_, stream_.handle());
    stream_.synchronize();
    return device_;
  }
  void end_backward(int) override {}
  void report(ModeResult& r, int) override {
    r.peak_device_bytes = bytes_;
    r.budget_bytes = 0;
    r.bytes_to_host_per_step = static_cast<double>(bytes_) * host_.size();
    r.bytes_to_device_per_step = r.bytes_to_host_per_step;
  }

 private:
  Backend& backend_;
  const Stream& stream_;
  std::size_t bytes_;
  void* device_ = nullptr;
  std::vector<PinnedBlock> host_;
};

// Mode reviva: one block per activation in an OffloadManager under the budget, accessed through
// a PrefetchScheduler that knows the step's order (forward 0..N-1, then backward N-1..0), so it
// offloads each activation as soon as the forward is done with it and brings it back `window`
// groups ahead of the backward. After its backward use an activation is dead: discarded.
class RevivaStore final : public ActivationStore {
 public:
  RevivaStore(const std::shared_ptr<PinnedHostPool>& pool, const Stream& stream,
              const PipelineConfig& config)
      : stream_(stream) {
    engine_ = std::make_shared<TransferEngine>(pool);
    OffloadManagerOptions options;
    options.budget_bytes = config.budget_bytes();
    options.policy = config.policy;
    manager_ = std::make_unique<OffloadManager>(
        engine_, make_backend_device_allocator(pool->backend_ptr()), options);
    for (int i = 0; i < config.layers; ++i)
      blocks_.push_back(
          manager_->register_block(config.activation_bytes, detail::concat("activation.", i)));
    PrefetchSchedulerOptions sched;
    sched.prefetch_groups = config.prefetch_window;
    sched.adaptive = config.adaptive_window;
    sched.eager_offload = config.eager_offload;
    scheduler_ = std::make_unique<PrefetchScheduler>(*manager_, sched);
    std::vector<std::vector<BlockId>> order;
    for (int i = 0; i < config.layers; ++i) order.push_back({blocks_[i]});
    for (int i = config.layers - 1; i >= 0; --i) order.push_back({blocks_[i]});
    scheduler_->declare_order(std::move(order));
  }

  ~RevivaStore() override {
    try {
      stream_.synchronize();
      manager_->synchronize();
    } catch (const std::exception&) {
    }
    scheduler_.reset();
    manager_.reset();
  }

  void* begin_forward(int layer) override { return acquire(layer, Access::WriteOnly); }
  void end_forward(int layer) override { scheduler_->release_group(group(layer), stream_); }
  void* begin_backward(int layer) override { return acquire(layer, Access::ReadOnly); }
  void end_backward(int layer) override {
    // The activation is dead after its backward use: dropped, never copied out again.
    scheduler_->release_group(group(layer), stream_, /*discard=*/true);
  }
  void end_step() override { scheduler_->end_step(); }  // ends the manager's step too
  void settle() override { manager_->synchronize(); }
  void start_timing() override {
    manager_->synchronize();
    warmup_peak_ = manager_->metrics().peak_device_bytes;
    manager_->reset_metrics();
  }

  void report(ModeResult& r, int timed_steps) override {
    manager_->synchronize();
    r.has_manager_metrics = true;
    r.metrics = manager_->metrics();
    r.metrics.peak_device_bytes = std::max(r.metrics.peak_device_bytes, warmup_peak_);
    r.scheduler = scheduler_->stats();
    r.policy = manager_->policy_name();
    r.peak_device_bytes = r.metrics.peak_device_bytes;
    r.budget_bytes = manager_->budget_bytes();
    r.bytes_to_host_per_step = static_cast<double>(r.metrics.bytes_to_host) / timed_steps;
    r.bytes_to_device_per_step = static_cast<double>(r.metrics.bytes_to_device) / timed_steps;
  }

 private:
  std::span<const BlockId> group(int layer) const { return {&blocks_[layer], 1}; }
  void* acquire(int layer, Access access) {
    const std::vector<void*> ptrs = scheduler_->acquire_group(group(layer), stream_, access);
    REVIVA_ASSERT(ptrs.size() == 1 && ptrs[0] != nullptr, "acquire_group of activation ", layer,
                  " returned ", ptrs.size(), " addresses");
    return ptrs[0];
  }

  const Stream& stream_;
  std::shared_ptr<TransferEngine> engine_;
  std::unique_ptr<OffloadManager> manager_;
  std::unique_ptr<PrefetchScheduler> scheduler_;
  std::vector<BlockId> blocks_;
  std::size_t warmup_peak_ = 0;
};

}  // namespace

// --- the pipeline --------------------------------------------------------------------------------

LayerPipeline::LayerPipeline(std::shared_ptr<Backend> backend, PipelineConfig config)
    : backend_(std::move(backend)), config_(config) {
  REVIVA_CHECK_ARG(backend_ != nullptr, "LayerPipeline: null backend");
  REVIVA_CHECK_ARG(config_.layers >= 1, "layers must be >= 1, got ", config_.layers);
  REVIVA_CHECK_ARG(config_.activation_bytes > 0, "activation_bytes must be > 0");
  REVIVA_CHECK_ARG(config_.hidden >= 1, "hidden must be >= 1, got ", config_.hidden);
  REVIVA_CHECK_ARG(config_.prefetch_window >= 0, "prefetch_window must be >= 0, got ",
                   config_.prefetch_window);
  REVIVA_CHECK_ARG(config_.budget_activations >= 0, "budget_activations must be >= 0, got ",
                   config_.budget_activations);
  REVIVA_CHECK_ARG(config_.warmup_steps >= 0 && config_.timed_steps >= 1,
                   "need warmup_steps >= 0 and timed_steps >= 1, got ", config_.warmup_steps,
                   " and ", config_.timed_steps);
  PinnedHostPoolOptions pool_options;
  pool_options.slab_bytes = std::max(std::size_t{256} << 20, config_.activation_bytes);
  pool_ = PinnedHostPool::create(backend_, pool_options);
  compute_stream_ = std::make_unique<Stream>(backend_);
  if (backend_->kind() == BackendKind::Cuda) {
#if REVIVA_EXAMPLES_WITH_CUDA
    compute_ = std::make_unique<CublasCompute>(backend_, config_, *compute_stream_);
#else
    throw InvalidArgument(
        "the layer pipeline was built without CUDA (no cuBLAS): use the host backend");
#endif
  } else {
    compute_ = std::make_unique<SimulatedCompute>(backend_, config_);
  }
}

LayerPipeline::~LayerPipeline() {
  try {
    compute_stream_->synchronize();
  } catch (const std::exception&) {
  }
  compute_.reset();
}

std::string LayerPipeline::compute_description() const { return compute_->description(); }

MeasuredBandwidth LayerPipeline::measure_bandwidth(int copies) {
  REVIVA_CHECK_ARG(copies >= 1, "measure_bandwidth: copies must be >= 1, got ", copies);
  const std::size_t bytes = config_.activation_bytes;
  Stream stream(backend_);
  void* device = backend_->allocate_device(bytes, stream.handle());
  PinnedBlock host = pool_->allocate(bytes);
  std::memset(host.data(), 0x5a, bytes);
  backend_->memset_async(device, 0x3c, bytes, stream.handle());
  backend_->copy_async(host.data(), device, bytes, stream.handle());  // warm both ways
  backend_->copy_async(device, host.data(), bytes, stream.handle());
  stream.synchronize();
  auto timed = [&](void* dst, const void* src) {
    Event start(backend_, true), end(backend_, true);
    start.record(stream);
    for (int c = 0; c < copies; ++c) backend_->copy_async(dst, src, bytes, stream.handle());
    end.record(stream);
    stream.synchronize();
    const double ms = Event::elapsed_ms(start, end);
    return static_cast<double>(bytes) * copies / (ms * 1e6);
  };
  MeasuredBandwidth bw;
  bw.d2h_gbps = timed(host.data(), device);
  bw.h2d_gbps = timed(device, host.data());
  bw.bytes_per_copy = bytes;
  bw.copies = copies;
  backend_->free_device(device, stream.handle());
  stream.synchronize();
  return bw;
}

ComputeCalibration LayerPipeline::set_compute_ms(double ms) {
  REVIVA_CHECK_ARG(ms >= 0 && std::isfinite(ms), "compute time must be >= 0 ms, got ", ms);
  return compute_->calibrate(ms, *compute_stream_);
}

ModeResult LayerPipeline::run(PipelineMode mode) {
  const Stream& stream = *compute_stream_;
  std::unique_ptr<ActivationStore> store;
  switch (mode) {
    case PipelineMode::None:
      store = std::make_unique<ResidentStore>(*backend_, stream, config_);
      break;
    case PipelineMode::Naive:
      store = std::make_unique<SyncOffloadStore>(*backend_, stream, *pool_, config_);
      break;
    case PipelineMode::Reviva: store = std::make_unique<RevivaStore>(pool_, stream, config_); break;
  }

  ModeResult result;
  result.mode = mode;
  result.steps = config_.timed_steps;
  compute_->reset_corrupted();
  Event start(backend_, true), middle(backend_, true), end(backend_, true);
  std::vector<double> forward_ms, backward_ms;
  const int layers = config_.layers;
  const int total = config_.warmup_steps + config_.timed_steps;
  for (int step = 0; step < total; ++step) {
    const bool timed = step >= config_.warmup_steps;
    if (step == config_.warmup_steps) store->start_timing();
    compute_->begin_step(static_cast<std::uint64_t>(step), stream);
    stream.synchronize();

    const auto t0 = Clock::now();
    start.record(stream);
    for (int i = 0; i < layers; ++i) {
      void* activation = store->begin_forward(i);
      compute_->forward(i, activation, stream);
      store->end_forward(i);
    }
    middle.record(stream);
    for (int i = layers - 1; i >= 0; --i) {
      const void* activation = store->begin_backward(i);
      compute_->backward(i, activation, stream);
      store->end_backward(i);
    }
    end.record(stream);
    store->end_step();
    stream.synchronize();
    const double wall_ms = ms_since(t0);

    result.step_checksums.push_back(compute_->end_step(stream));
    store->settle();
    if (timed) {
      result.step_ms_samples.push_back(wall_ms);
      forward_ms.push_back(Event::elapsed_ms(start, middle));
      backward_ms.push_back(Event::elapsed_ms(middle, end));
    }
  }
  result.step_ms = median(result.step_ms_samples);
  result.forward_ms = median(forward_ms);
  result.backward_ms = median(backward_ms);
  result.corrupted_activations = compute_->corrupted();
  store->report(result, config_.timed_steps);
  store.reset();
  stream.synchronize();
  return result;
}

}  // namespace reviva::examples
