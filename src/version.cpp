// The library's version string, with the backend set it was built with.
#include <reviva/version.h>

namespace reviva {

const char* version_string() noexcept {
#if defined(REVIVA_WITH_CUDA)
  return "0.1.0+cuda";
#else
  return "0.1.0+host";
#endif
}

}  // namespace reviva
