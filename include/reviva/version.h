// Version of the Reviva core library.
#pragma once

#include <reviva/export.h>

namespace reviva {

inline constexpr int kVersionMajor = 0;
inline constexpr int kVersionMinor = 1;
inline constexpr int kVersionPatch = 0;

// "0.1.0+cuda" or "0.1.0+host": the version, and whether the CUDA backend was built in.
REVIVA_API const char* version_string() noexcept;

}  // namespace reviva
