// Symbol visibility: the library is built with hidden visibility; REVIVA_API marks the public API.
#pragma once

#if defined(_WIN32)
#define REVIVA_API
#else
#define REVIVA_API __attribute__((visibility("default")))
#endif
