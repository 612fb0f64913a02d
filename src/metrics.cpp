// The one overlap ratio (Note [Overlap ratio] in metrics.h).
#include <reviva/metrics.h>

#include <algorithm>

namespace reviva {

double overlap_ratio(double compute_stall_ms, double copy_busy_ms) noexcept {
  if (copy_busy_ms <= 0.0) return 1.0;
  return std::clamp(1.0 - compute_stall_ms / copy_busy_ms, 0.0, 1.0);
}

}  // namespace reviva
