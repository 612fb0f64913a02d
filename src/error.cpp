// Out-of-line members of the error types (one home for their vtables) and the assert handler.
#include <reviva/error.h>

#include <cstdio>
#include <cstdlib>

namespace reviva {

Error::~Error() = default;
InvalidArgument::~InvalidArgument() = default;
OutOfMemory::~OutOfMemory() = default;
BackendError::~BackendError() = default;

namespace detail {

void assert_fail(const char* condition, const char* file, int line,
                 const std::string& message) noexcept {
  std::fprintf(stderr, "reviva: internal invariant broken at %s:%d: %s%s%s\n", file, line,
               condition, message.empty() ? "" : ": ", message.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace detail
}  // namespace reviva
