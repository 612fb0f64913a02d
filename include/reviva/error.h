// Errors and the three tiers of checks (STYLE.md):
//   bad user input        -> REVIVA_CHECK_ARG   throws InvalidArgument naming the values;
//   broken invariant      -> REVIVA_ASSERT      prints where and aborts (always on: a broken
//                                               invariant means state can no longer be trusted);
//   failed backend call   -> REVIVA_CUDA_CHECK  (src/cuda_check.h) throws BackendError with
//                                               file/line, the call, and the driver's message.
// Budgets that cannot be met throw OutOfMemory with the numbers.
#pragma once

#include <reviva/export.h>

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace reviva {

class REVIVA_API Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
  ~Error() override;
};

// Bad input from a user of the library (a size, a pointer, an option).
class REVIVA_API InvalidArgument : public Error {
 public:
  using Error::Error;
  ~InvalidArgument() override;
};

// A memory budget or capacity that cannot be met; the message names the numbers.
class REVIVA_API OutOfMemory : public Error {
 public:
  using Error::Error;
  ~OutOfMemory() override;
};

// A CUDA (or other backend) call failed.
class REVIVA_API BackendError : public Error {
 public:
  using Error::Error;
  ~BackendError() override;
};

namespace detail {

template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

[[noreturn]] REVIVA_API void assert_fail(const char* condition, const char* file, int line,
                                         const std::string& message) noexcept;

}  // namespace detail
}  // namespace reviva

#define REVIVA_CHECK_ARG(cond, ...)                                                      \
  do {                                                                                   \
    if (!(cond)) throw ::reviva::InvalidArgument(::reviva::detail::concat(__VA_ARGS__)); \
  } while (false)

#define REVIVA_ASSERT(cond, ...)                                                              \
  do {                                                                                        \
    if (!(cond))                                                                              \
      ::reviva::detail::assert_fail(#cond, __FILE__, __LINE__,                                \
                                    ::reviva::detail::concat("" __VA_OPT__(, ) __VA_ARGS__)); \
  } while (false)
