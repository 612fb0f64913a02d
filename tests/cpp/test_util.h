// Shared helpers of the core tests: the backend parameter (host always, CUDA when a device is
// present), random bytes, and device buffers filled and read back through the backend.
#pragma once

#include <reviva/reviva.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace reviva::test {

inline std::string backend_param_name(const ::testing::TestParamInfo<BackendKind>& info) {
  return to_string(info.param);
}

// Scale of the randomized tests; compute-sanitizer runs set REVIVA_TEST_SCALE < 1.
inline double test_scale() {
  const char* s = std::getenv("REVIVA_TEST_SCALE");
  return s ? std::atof(s) : 1.0;
}
inline int scaled(int n) { return std::max(1, static_cast<int>(n * test_scale())); }

class BackendTest : public ::testing::TestWithParam<BackendKind> {
 protected:
  void SetUp() override {
    if (GetParam() == BackendKind::Cuda) {
      if (!cuda_available())
        GTEST_SKIP() << "no CUDA device on this machine (or Reviva built without CUDA): the "
                        "CUDA-backend variant runs on the GPU machine (scripts/gpu-check)";
      backend_ = make_cuda_backend(0);
    } else {
      backend_ = make_host_backend();
    }
  }
  std::shared_ptr<Backend> backend_;
};

// 16-bit float bits <-> fp32 for the kernels' tests (rounded to nearest even).
inline float half_value(std::uint16_t bits, HalfType type) {
  if (type == HalfType::BFloat16) {
    const std::uint32_t wide = static_cast<std::uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &wide, 4);
    return f;
  }
  _Float16 h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}

inline std::uint16_t half_bits(float x, HalfType type) {
  if (type == HalfType::BFloat16) {
    std::uint32_t bits;
    std::memcpy(&bits, &x, 4);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return static_cast<std::uint16_t>(bits >> 16);
  }
  const _Float16 h = static_cast<_Float16>(x);
  std::uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

inline std::vector<std::uint8_t> random_bytes(std::size_t n, std::uint64_t seed) {
  std::vector<std::uint8_t> v(n);
  std::mt19937_64 rng(seed);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const std::uint64_t r = rng();
    std::memcpy(v.data() + i, &r, 8);
  }
  for (; i < n; ++i) v[i] = static_cast<std::uint8_t>(rng());
  return v;
}

// Fresh pseudo-random contents at memory speed (splitmix64), for blocks of megabytes.
inline void fill_random(void* dst, std::size_t n, std::uint64_t seed) {
  auto* p = static_cast<std::uint8_t*>(dst);
  std::uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  auto next = [&x] {
    std::uint64_t z = (x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const std::uint64_t r = next();
    std::memcpy(p + i, &r, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<std::uint8_t>(next());
}

// Device memory owned by the test, released through the backend (stream-ordered on `stream`).
class DeviceBuffer {
 public:
  DeviceBuffer(Backend& backend, const Stream& stream, std::size_t bytes)
      : backend_(&backend), stream_(&stream), bytes_(bytes) {
    ptr_ = backend.allocate_device(bytes, stream.handle());
  }
  ~DeviceBuffer() {
    if (ptr_) backend_->free_device(ptr_, stream_->handle());
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* data() const { return ptr_; }
  std::size_t size() const { return bytes_; }

 private:
  Backend* backend_;
  const Stream* stream_;
  std::size_t bytes_;
  void* ptr_ = nullptr;
};

// Copies `bytes` of host data to device memory through a pinned staging block (synchronous).
inline void upload(PinnedHostPool& pool, const Stream& stream, void* device,
                   const std::vector<std::uint8_t>& bytes) {
  PinnedBlock staging = pool.allocate(bytes.size());
  std::memcpy(staging.data(), bytes.data(), bytes.size());
  pool.backend().copy_async(device, staging.data(), bytes.size(), stream.handle());
  stream.synchronize();
}

inline std::vector<std::uint8_t> download(PinnedHostPool& pool, const Stream& stream,
                                          const void* device, std::size_t n) {
  PinnedBlock staging = pool.allocate(n);
  pool.backend().copy_async(staging.data(), device, n, stream.handle());
  stream.synchronize();
  const auto* p = static_cast<const std::uint8_t*>(staging.data());
  return std::vector<std::uint8_t>(p, p + n);
}

// A gate that blocks a stream until the test opens it: makes "still in flight" deterministic.
class StreamGate {
 public:
  void block(const Stream& stream) {
    auto state = state_;
    stream.launch_host_func([state] {
      std::unique_lock<std::mutex> lock(state->mutex);
      state->cv.wait(lock, [&] { return state->open; });
    });
  }
  void open() {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->open = true;
    }
    state_->cv.notify_all();
  }
  ~StreamGate() { open(); }

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable cv;
    bool open = false;
  };
  std::shared_ptr<State> state_ = std::make_shared<State>();
};

// The message of what `f` raises ("(nothing raised)" if nothing): tests match its parts.
inline std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(nothing raised)";
}

}  // namespace reviva::test
