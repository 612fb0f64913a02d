// How fast the host's cores read K/V rows for one decode query (host_decode_attention, Note
// [Attention on the host]): the 8B shape's heads (32 queries over 8 K/V heads of 128), one
// sequence, a 32k-token layer, bf16, fp32 and fp8 rows (e4m3 values and a scale per head's row),
// 1 to N threads. Prints one JSON line per case: ms per layer and GB/s of K/V read.
//
//   reviva_bench_host_attention [tokens] [max_threads] [repeats]
#include <reviva/host_attention.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

int main(int argc, char** argv) {
  const std::size_t tokens = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 32768;
  const int max_threads =
      argc > 2 ? std::atoi(argv[2]) : static_cast<int>(std::thread::hardware_concurrency());
  const int repeats = argc > 3 ? std::atoi(argv[3]) : 10;
  const reviva::HostAttentionShape s{1, 8, 32, 128};
  const std::size_t n = tokens * 2 * s.batch * s.kv_heads * s.head_dim;
  std::vector<float> rows(n);
  std::vector<std::uint16_t> rows_bf16(n);
  std::mt19937 gen(1);
  std::normal_distribution<float> normal;
  for (std::size_t i = 0; i < n; ++i) {
    rows[i] = normal(gen);
    std::uint32_t bits;
    std::memcpy(&bits, &rows[i], sizeof bits);
    rows_bf16[i] = static_cast<std::uint16_t>(bits >> 16);  // (truncated: any bf16 will do)
  }
  // fp8: every byte an e4m3 value but NaN, each head's row followed by its fp32 scale
  const std::size_t fp8_row = s.head_dim + 4;
  std::vector<std::uint8_t> rows_fp8(tokens * 2 * s.batch * s.kv_heads * fp8_row);
  std::uniform_int_distribution<int> byte(0, 255);
  for (std::size_t r = 0; r < rows_fp8.size() / fp8_row; ++r) {
    std::uint8_t* p = rows_fp8.data() + r * fp8_row;
    for (std::size_t j = 0; j < s.head_dim; ++j) p[j] = static_cast<std::uint8_t>(byte(gen) & 0xF7);
    const float scale = 1.0f / 448.0f;
    std::memcpy(p + s.head_dim, &scale, 4);
  }
  std::vector<float> q(s.batch * s.heads * s.head_dim), out(q.size());
  for (float& x : q) x = normal(gen);
  for (const char* kind : {"bf16", "fp32", "fp8"}) {
    const bool bf16 = kind[1] == 'f', fp8 = kind[2] == '8';
    const void* data = fp8    ? static_cast<const void*>(rows_fp8.data())
                       : bf16 ? static_cast<const void*>(rows_bf16.data())
                              : rows.data();
    const auto type = fp8    ? reviva::RowType::Fp8E4M3
                      : bf16 ? reviva::RowType::BFloat16
                             : reviva::RowType::Float32;
    const double bytes =
        fp8 ? static_cast<double>(rows_fp8.size()) : static_cast<double>(n) * (bf16 ? 2 : 4);
    for (int threads = 1; threads <= max_threads; threads *= 2) {
      reviva::host_decode_attention(data, type, s, 0, tokens, q.data(), 0.088f, out.data(),
                                    threads);  // (warm)
      const auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < repeats; ++r)
        reviva::host_decode_attention(data, type, s, 0, tokens, q.data(), 0.088f, out.data(),
                                      threads);
      const double s_per =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / repeats;
      std::printf(
          "{\"rows\": \"%s\", \"tokens\": %zu, \"threads\": %d, \"ms\": %.3f, \"gb_s\": %.2f}\n",
          kind, tokens, threads, s_per * 1e3, bytes / s_per / 1e9);
    }
  }
  return 0;
}
