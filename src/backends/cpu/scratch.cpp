#include "backends/cpu/scratch.h"

#include <algorithm>
#include <cstdint>

#include "core/check.h"

namespace sppo::cpu {

void* Scratch::take(std::size_t n) {
  const std::size_t at = used_.fetch_add(cost(n));
  SPPO_ASSERT_MSG(at + cost(n) <= bytes_, "kernel scratch of " << bytes_ << " B is short: "
                                                               << at + cost(n) << " B taken (a size function undercounts)");
  SPPO_ASSERT(reinterpret_cast<std::uintptr_t>(base_) % kAlign == 0);
  return base_ + at;
}

KernelScratch max(const KernelScratch& a, const KernelScratch& b) {
  return {std::max(a.fixed_bytes, b.fixed_bytes), std::max(a.bytes_per_token, b.bytes_per_token)};
}

}  // namespace sppo::cpu
