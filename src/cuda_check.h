// REVIVA_CUDA_CHECK: the check macro for CUDA runtime calls (private to the core). Throws
// BackendError naming the call, the file and line, and CUDA's own error name and message.
#pragma once

#include <reviva/error.h>

#include <cuda_runtime.h>

#include <cstdio>

namespace reviva::detail {

[[noreturn]] inline void throw_cuda_error(cudaError_t status, const char* call, const char* file,
                                          int line) {
  throw BackendError(concat(call, " failed at ", file, ":", line, ": ", cudaGetErrorName(status),
                            " (", cudaGetErrorString(status), ")"));
}

// For destructors and other noexcept paths: report, never throw.
inline void warn_cuda_error(cudaError_t status, const char* call, const char* file,
                            int line) noexcept {
  std::fprintf(stderr, "reviva: warning: %s failed at %s:%d: %s (%s)\n", call, file, line,
               cudaGetErrorName(status), cudaGetErrorString(status));
}

}  // namespace reviva::detail

#define REVIVA_CUDA_CHECK(expr)                                                      \
  do {                                                                               \
    const cudaError_t reviva_status_ = (expr);                                       \
    if (reviva_status_ != cudaSuccess)                                               \
      ::reviva::detail::throw_cuda_error(reviva_status_, #expr, __FILE__, __LINE__); \
  } while (false)

#define REVIVA_CUDA_WARN(expr)                                                      \
  do {                                                                              \
    const cudaError_t reviva_status_ = (expr);                                      \
    if (reviva_status_ != cudaSuccess)                                              \
      ::reviva::detail::warn_cuda_error(reviva_status_, #expr, __FILE__, __LINE__); \
  } while (false)
