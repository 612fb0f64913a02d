// Backend-independent helpers, and the CUDA entry points of a build without CUDA.
#include <reviva/backend.h>
#include <reviva/error.h>

namespace reviva {

Backend::~Backend() = default;

const char* to_string(BackendKind kind) noexcept {
  switch (kind) {
    case BackendKind::Host: return "host";
    case BackendKind::Cuda: return "cuda";
  }
  return "?";
}

const char* to_string(MemoryKind kind) noexcept {
  switch (kind) {
    case MemoryKind::Unknown: return "unknown";
    case MemoryKind::Pageable: return "pageable host";
    case MemoryKind::PinnedHost: return "pinned host";
    case MemoryKind::Device: return "device";
    case MemoryKind::Managed: return "managed";
  }
  return "?";
}

std::shared_ptr<Backend> make_default_backend() {
  if (cuda_available()) return make_cuda_backend(0);
  return make_host_backend();
}

#if !defined(REVIVA_WITH_CUDA)
bool cuda_available() noexcept { return false; }
int cuda_device_count() noexcept { return 0; }
std::shared_ptr<Backend> make_cuda_backend(int device) {
  throw BackendError(detail::concat("cannot create the CUDA backend on device ", device,
                                    ": this build of Reviva has no CUDA (REVIVA_WITH_CUDA=OFF)"));
}
#endif

}  // namespace reviva
