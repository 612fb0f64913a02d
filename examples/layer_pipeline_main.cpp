// Runs the synthetic layer pipeline (layer_pipeline.h) with Reviva offloading its activations
// under a device budget of a few activations, and prints what the manager measured.
//
//   layer_pipeline_main [--backend auto|host|cuda] [--modes reviva[,none,naive]] [--layers N]
//                       [--activation SIZE] [--hidden D] [--dtype bf16|fp32]
//                       [--compute-ms MS | --compute-ratio R] [--window W]
//                       [--budget-activations B] [--policy lru|2q|belady] [--adaptive]
//                       [--no-eager-offload] [--warmup S] [--steps S] [--no-verify]
//
// The compute of a layer takes --compute-ms, or --compute-ratio times the time to copy one
// activation at the bandwidth measured first (default 2: copies can hide under compute).
// Unless --no-verify, the resident run (mode none) runs too and every mode's backward output must
// match it bit for bit; the manager's peak device memory must stay within the budget; on the host
// backend every activation is also checked word for word. Exit status 1 when a check fails.
// On the host backend (no GPU) the defaults are small: 8 layers of 1 MiB, 2 ms per layer.
#include "layer_pipeline.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <vector>

namespace {

namespace rx = reviva::examples;

struct Options {
  std::string backend = "auto";
  std::vector<rx::PipelineMode> modes{rx::PipelineMode::Reviva};
  std::optional<int> layers;
  std::optional<std::size_t> activation_bytes;
  std::optional<double> compute_ms;
  double compute_ratio = 2.0;
  bool verify = true;
  rx::PipelineConfig config;
};

std::vector<rx::PipelineMode> parse_modes(const std::string& list) {
  std::vector<rx::PipelineMode> modes;
  std::size_t begin = 0;
  while (begin <= list.size()) {
    const std::size_t comma = std::min(list.find(',', begin), list.size());
    modes.push_back(rx::parse_pipeline_mode(std::string_view(list).substr(begin, comma - begin)));
    begin = comma + 1;
  }
  return modes;
}

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "layer_pipeline_main: %s (see the top of layer_pipeline_main.cpp)\n",
               message.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(a + " needs a value");
      return argv[++i];
    };
    if (rx::apply_config_flag(a, value, o.config)) continue;
    if (a == "--backend")
      o.backend = value();
    else if (a == "--modes")
      o.modes = parse_modes(value());
    else if (a == "--layers")
      o.layers = std::stoi(value());
    else if (a == "--activation")
      o.activation_bytes = rx::parse_size(value());
    else if (a == "--compute-ms")
      o.compute_ms = std::stod(value());
    else if (a == "--compute-ratio")
      o.compute_ratio = std::stod(value());
    else if (a == "--no-verify")
      o.verify = false;
    else
      usage_error("unknown argument " + a);
  }
  if (o.backend != "auto" && o.backend != "host" && o.backend != "cuda")
    usage_error("--backend must be auto, host or cuda, got " + o.backend);
  return o;
}

double mib(double bytes) { return bytes / (1 << 20); }

void print_mode(const rx::ModeResult& r) {
  std::printf(
      "%-7s step %9.3f ms  (forward %8.3f, backward %8.3f)  D2H %8.1f MiB  H2D %8.1f MiB"
      "  peak %8.1f MiB\n",
      rx::to_string(r.mode), r.step_ms, r.forward_ms, r.backward_ms, mib(r.bytes_to_host_per_step),
      mib(r.bytes_to_device_per_step), mib(static_cast<double>(r.peak_device_bytes)));
  if (!r.has_manager_metrics) return;
  const reviva::ManagerMetrics& m = r.metrics;
  const reviva::PrefetchSchedulerStats& s = r.scheduler;
  std::printf(
      "        manager (%s, %d timed steps): budget %.1f MiB, peak %.1f MiB\n"
      "          to host %.1f MiB in %.3f ms busy, to device %.1f MiB in %.3f ms busy\n"
      "          overlap ratio %.4f, compute stall %.3f ms, host wait %.3f ms\n"
      "          evictions %llu (clean %llu), prefetches %llu: hits %llu, late %llu, misses %llu\n"
      "        scheduler: window %d, prefetches issued %llu (no room %llu), eager offloads %llu,"
      " off-schedule accesses %llu\n",
      r.policy.c_str(), r.steps, mib(static_cast<double>(m.budget_bytes)),
      mib(static_cast<double>(m.peak_device_bytes)), mib(static_cast<double>(m.bytes_to_host)),
      m.to_host_busy_ms, mib(static_cast<double>(m.bytes_to_device)), m.to_device_busy_ms,
      m.overlap_ratio, m.compute_stall_ms, m.host_wait_ms,
      static_cast<unsigned long long>(m.evictions),
      static_cast<unsigned long long>(m.clean_evictions),
      static_cast<unsigned long long>(m.prefetches),
      static_cast<unsigned long long>(m.prefetch_hits),
      static_cast<unsigned long long>(m.prefetch_late),
      static_cast<unsigned long long>(m.prefetch_misses), s.window,
      static_cast<unsigned long long>(s.prefetches_issued),
      static_cast<unsigned long long>(s.prefetches_without_room),
      static_cast<unsigned long long>(s.eager_offloads),
      static_cast<unsigned long long>(s.off_schedule_accesses));
}

int run(const Options& opt) {
  std::shared_ptr<reviva::Backend> backend;
  if (opt.backend == "host" || (opt.backend == "auto" && !reviva::cuda_available()))
    backend = reviva::make_host_backend();
  else
    backend = reviva::make_cuda_backend(0);
  const bool host = backend->kind() == reviva::BackendKind::Host;

  rx::PipelineConfig config = opt.config;
  config.layers = opt.layers.value_or(host ? 8 : config.layers);
  config.activation_bytes =
      opt.activation_bytes.value_or(host ? std::size_t{1} << 20 : config.activation_bytes);
  std::optional<double> compute_ms = opt.compute_ms;
  if (!compute_ms && host) compute_ms = 2.0;

  rx::LayerPipeline pipeline(backend, config);
  const rx::MeasuredBandwidth bw = pipeline.measure_bandwidth();
  const double copy_ms =
      static_cast<double>(config.activation_bytes) / (std::min(bw.d2h_gbps, bw.h2d_gbps) * 1e6);
  const rx::ComputeCalibration cal =
      pipeline.set_compute_ms(compute_ms.value_or(opt.compute_ratio * copy_ms));

  std::printf("layer pipeline on %s: %d layers, activation %.2f MiB, budget %.2f MiB (%s)\n",
              backend->name().c_str(), config.layers,
              mib(static_cast<double>(config.activation_bytes)),
              mib(static_cast<double>(config.budget_bytes())),
              config.budget_activations > 0 ? "--budget-activations" : "window + 2 activations");
  std::printf("bandwidth: D2H %.2f GB/s, H2D %.2f GB/s (copy of one activation %.3f ms)\n",
              bw.d2h_gbps, bw.h2d_gbps, copy_ms);
  std::printf("compute per layer: target %.3f ms, forward %.3f ms, backward %.3f ms\n  %s\n",
              cal.target_ms, cal.forward_ms, cal.backward_ms, cal.description.c_str());

  std::vector<rx::PipelineMode> modes = opt.modes;
  const bool has_none =
      std::find(modes.begin(), modes.end(), rx::PipelineMode::None) != modes.end();
  if (opt.verify && !has_none) modes.insert(modes.begin(), rx::PipelineMode::None);

  std::vector<rx::ModeResult> results;
  for (rx::PipelineMode mode : modes) {
    results.push_back(pipeline.run(mode));
    print_mode(results.back());
  }

  bool ok = true;
  auto check = [&](bool pass, const std::string& what) {
    std::printf("%s  %s\n", pass ? "PASS" : "FAIL", what.c_str());
    ok = ok && pass;
  };
  const rx::ModeResult* reference = nullptr;
  for (const rx::ModeResult& r : results)
    if (r.mode == rx::PipelineMode::None) reference = &r;
  for (const rx::ModeResult& r : results) {
    const std::string name = rx::to_string(r.mode);
    if (r.corrupted_activations >= 0)
      check(r.corrupted_activations == 0, name + ": activations intact in backward (" +
                                              std::to_string(r.corrupted_activations) +
                                              " corrupted)");
    if (opt.verify && reference && &r != reference) {
      int differ = 0;
      for (std::size_t k = 0; k < r.step_checksums.size(); ++k)
        differ += r.step_checksums[k] != reference->step_checksums.at(k);
      check(differ == 0, name + ": backward output identical to mode none in every step (" +
                             std::to_string(differ) + " of " +
                             std::to_string(r.step_checksums.size()) + " steps differ)");
    }
    if (r.has_manager_metrics)
      check(r.peak_device_bytes <= r.budget_bytes,
            name + ": peak device bytes " + std::to_string(r.peak_device_bytes) + " <= budget " +
                std::to_string(r.budget_bytes));
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const reviva::InvalidArgument& e) {
    usage_error(e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "layer_pipeline_main: %s\n", e.what());
    return 1;
  }
}
