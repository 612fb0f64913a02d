// The library's version string, with the backend set it was built with.
#include <reviva/version.h>

namespace reviva {

// REVIVA_VERSION_STRING: the project's version, pyproject.toml's (the top-level CMakeLists).
const char* version_string() noexcept {
#if defined(REVIVA_WITH_CUDA)
  return REVIVA_VERSION_STRING "+cuda";
#else
  return REVIVA_VERSION_STRING "+host";
#endif
}

}  // namespace reviva
