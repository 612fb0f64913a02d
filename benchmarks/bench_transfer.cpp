// Transfer bandwidth and pool latency of the Reviva core, against the plain CUDA calls.
//
//   reviva_bench_transfer [--json PATH] [--min-size BYTES] [--max-size BYTES] [--reps N]
//
// For each size (64 KiB to 1 GiB, x4 steps) and each direction (D2H, H2D, both at once):
//   - reviva: TransferEngine transfers, N back to back, then wait for the last;
//   - cuda:   plain cudaMemcpyAsync of the same buffers on one stream per direction.
// Bandwidth = bytes moved / wall time from the first submission to the last completion (so the
// submission cost is included), median and best of `reps` samples; each sample moves about
// 1 GiB (at least 3 copies). The same pinned and device buffers serve both contenders.
// Pool latency: allocate+free of a cached block (median over batches), also with a stream use
// recorded (the deferred-free path), against cudaHostAlloc+cudaFreeHost of the same size.
// torch's copy_ is measured by benchmarks/bench_transfer.py, which runs this program in the
// same job and merges the results.
#include <reviva/reviva.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "%s failed: %s\n", what, cudaGetErrorString(status));
    std::exit(2);
  }
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Samples {
  std::vector<double> gbps;
  double med() const { return median(gbps); }
  double best() const { return *std::max_element(gbps.begin(), gbps.end()); }
};

// Runs `submit(count)` then `sync()`, `reps` times after one warm-up; returns GB/s of each.
Samples measure(std::size_t bytes_per_copy, int count, int reps,
                const std::function<void(int)>& submit, const std::function<void()>& sync) {
  submit(1);
  sync();
  Samples s;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    submit(count);
    sync();
    const double sec = seconds_since(t0);
    s.gbps.push_back(static_cast<double>(bytes_per_copy) * count / sec / 1e9);
  }
  return s;
}

struct Options {
  std::string json_path;
  std::size_t min_size = std::size_t{64} << 10;
  std::size_t max_size = std::size_t{1} << 30;
  int reps = 7;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--json")
      o.json_path = value();
    else if (a == "--min-size")
      o.min_size = std::stoull(value());
    else if (a == "--max-size")
      o.max_size = std::stoull(value());
    else if (a == "--reps")
      o.reps = std::stoi(value());
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      std::exit(2);
    }
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  if (!reviva::cuda_available()) {
    std::fprintf(stderr, "reviva_bench_transfer: no CUDA device; nothing to measure\n");
    return 3;
  }
  auto backend = reviva::make_cuda_backend(0);
  reviva::PinnedHostPoolOptions po;
  po.slab_bytes = std::size_t{256} << 20;
  auto pool = reviva::PinnedHostPool::create(backend, po);
  reviva::TransferEngine engine(pool);

  cudaStream_t raw_d2h, raw_h2d;
  check(cudaStreamCreateWithFlags(&raw_d2h, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cudaStreamCreateWithFlags(&raw_h2d, cudaStreamNonBlocking), "cudaStreamCreate");

  // One pair of buffers per direction at the largest size, shared by all contenders.
  const std::size_t cap = opt.max_size;
  reviva::PinnedBlock host_src = pool->allocate(cap), host_dst = pool->allocate(cap);
  void* dev_src = nullptr;
  void* dev_dst = nullptr;
  check(cudaMalloc(&dev_src, cap), "cudaMalloc");
  check(cudaMalloc(&dev_dst, cap), "cudaMalloc");
  std::memset(host_src.data(), 0x5a, cap);  // non-zero data, pages touched
  std::memset(host_dst.data(), 0x00, cap);
  check(cudaMemset(dev_src, 0x3c, cap), "cudaMemset");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");

  std::ostringstream js;
  js << "{\n  \"device\": \"" << backend->name() << "\",\n  \"bandwidth\": [\n";
  std::printf("%-10s %-6s %12s %12s %12s %12s\n", "size", "dir", "reviva med", "reviva best",
              "cuda med", "cuda best");
  bool first = true;
  for (std::size_t size = opt.min_size; size <= opt.max_size; size *= 4) {
    const int count =
        static_cast<int>(std::clamp<std::size_t>((std::size_t{1} << 30) / size, 3, 4096));
    for (const char* dir : {"d2h", "h2d", "both"}) {
      const bool d2h = std::strcmp(dir, "h2d") != 0;
      const bool h2d = std::strcmp(dir, "d2h") != 0;
      const std::size_t moved = size * ((d2h && h2d) ? 2 : 1);
      reviva::Transfer last_d2h, last_h2d;
      Samples rv = measure(
          moved, count, opt.reps,
          [&](int n) {
            for (int i = 0; i < n; ++i) {
              if (d2h) last_d2h = engine.offload(dev_src, host_dst, size);
              if (h2d) last_h2d = engine.restore(host_src, dev_dst, size);
            }
          },
          [&] {
            if (d2h) last_d2h.wait();
            if (h2d) last_h2d.wait();
          });
      Samples cu = measure(
          moved, count, opt.reps,
          [&](int n) {
            for (int i = 0; i < n; ++i) {
              if (d2h)
                check(cudaMemcpyAsync(host_dst.data(), dev_src, size, cudaMemcpyDeviceToHost,
                                      raw_d2h),
                      "cudaMemcpyAsync");
              if (h2d)
                check(cudaMemcpyAsync(dev_dst, host_src.data(), size, cudaMemcpyHostToDevice,
                                      raw_h2d),
                      "cudaMemcpyAsync");
            }
          },
          [&] {
            check(cudaStreamSynchronize(raw_d2h), "sync");
            check(cudaStreamSynchronize(raw_h2d), "sync");
          });
      std::printf("%-10zu %-6s %12.2f %12.2f %12.2f %12.2f\n", size, dir, rv.med(), rv.best(),
                  cu.med(), cu.best());
      js << (first ? "" : ",\n") << "    {\"bytes\": " << size << ", \"direction\": \"" << dir
         << "\", \"copies_per_sample\": " << count << ", \"reviva_gbps_median\": " << rv.med()
         << ", \"reviva_gbps_best\": " << rv.best() << ", \"cuda_gbps_median\": " << cu.med()
         << ", \"cuda_gbps_best\": " << cu.best() << "}";
      first = false;
    }
  }
  js << "\n  ],\n  \"pool_latency\": [\n";

  // --- pool latency -----------------------------------------------------------------------
  auto stream = std::make_shared<const reviva::Stream>(backend);
  first = true;
  for (std::size_t size : {std::size_t{64} << 10, std::size_t{1} << 20, std::size_t{16} << 20}) {
    { reviva::PinnedBlock warm = pool->allocate(size); }
    std::vector<double> cached, with_use, cuda_pair;
    const int batch = 2000;
    for (int r = 0; r < 21; ++r) {
      auto t0 = Clock::now();
      for (int i = 0; i < batch; ++i) {
        reviva::PinnedBlock b = pool->allocate(size);
      }
      cached.push_back(seconds_since(t0) / batch * 1e6);
    }
    for (int r = 0; r < 21; ++r) {
      auto t0 = Clock::now();
      for (int i = 0; i < batch; ++i) {
        reviva::PinnedBlock b = pool->allocate(size);
        b.record_use(stream);  // freed through an event on `stream`
      }
      with_use.push_back(seconds_since(t0) / batch * 1e6);
    }
    for (int r = 0; r < 21; ++r) {
      auto t0 = Clock::now();
      void* p = nullptr;
      check(cudaHostAlloc(&p, size, cudaHostAllocPortable | cudaHostAllocMapped), "cudaHostAlloc");
      check(cudaFreeHost(p), "cudaFreeHost");
      cuda_pair.push_back(seconds_since(t0) * 1e6);
    }
    std::printf(
        "pool %-10zu alloc+free median: cached %.3f us, with stream use %.3f us, "
        "cudaHostAlloc+cudaFreeHost %.1f us\n",
        size, median(cached), median(with_use), median(cuda_pair));
    js << (first ? "" : ",\n") << "    {\"bytes\": " << size
       << ", \"reviva_cached_us_median\": " << median(cached)
       << ", \"reviva_cached_with_stream_use_us_median\": " << median(with_use)
       << ", \"cuda_host_alloc_free_us_median\": " << median(cuda_pair) << "}";
    first = false;
  }
  const reviva::PinnedHostPoolStats ps = pool->stats();
  js << "\n  ],\n  \"pool_stats\": {\"allocations\": " << ps.allocations
     << ", \"cache_hits\": " << ps.cache_hits << ", \"slabs_allocated\": " << ps.slabs_allocated
     << ", \"bytes_reserved\": " << ps.bytes_reserved << "}\n}\n";

  check(cudaFree(dev_src), "cudaFree");
  check(cudaFree(dev_dst), "cudaFree");
  check(cudaStreamDestroy(raw_d2h), "cudaStreamDestroy");
  check(cudaStreamDestroy(raw_h2d), "cudaStreamDestroy");
  if (!opt.json_path.empty()) {
    std::ofstream(opt.json_path) << js.str();
    std::printf("wrote %s\n", opt.json_path.c_str());
  }
  return 0;
}
