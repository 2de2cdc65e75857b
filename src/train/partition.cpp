#include "train/partition.h"

#include <cstdlib>

#include "core/check.h"

namespace sppo {

std::vector<i64> choose_partition(const std::string& mode, const ModelConfig& c, i64 S, int N) {
  SPPO_CHECK(mode == "length" || mode == "flops" || mode == "adaptive", "options")
      << "--partition '" << mode << "' is unknown; use length, flops or adaptive";
  std::vector<i64> lengths(std::size_t(N), S / N);
  for (i64 k = 0; k < S % N; ++k) ++lengths[std::size_t(k)];
  return lengths;
}

std::vector<double> choose_alpha(const std::string& mode, const ModelConfig& c,
                                 const std::vector<i64>& lengths, i64 device_budget) {
  const std::size_t N = lengths.size();
  std::vector<double> alpha(N, 0.0);
  double ratio = 0;
  if (mode == "none") return alpha;
  if (mode == "full") {
    ratio = 1;
  } else if (mode == "adaptive") {
    ratio = 1;
  } else {
    char* end = nullptr;
    ratio = std::strtod(mode.c_str(), &end);
    SPPO_CHECK(end != mode.c_str() && *end == '\0' && ratio >= 0 && ratio <= 1, "options")
        << "--offload '" << mode << "' is unknown; use none, full, adaptive or a ratio in [0, 1]";
  }
  for (std::size_t i = 0; i + 1 < N; ++i) alpha[i] = ratio;
  return alpha;
}

}  // namespace sppo
