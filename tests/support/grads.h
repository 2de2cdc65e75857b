// Test helper: compares two `sppo grads` exports tensor by tensor.
#pragma once

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "core/layout.h"
#include "io/safetensors.h"

namespace sppo::testing {

// Relative L2 error of every tensor of two `sppo grads` exports' grads.safetensors; the
// worst, and the name where it occurs.
inline std::pair<double, std::string> worst_grad_error(const std::string& a_dir, const std::string& b_dir,
                                                       const ModelConfig& c) {
  io::SafetensorsReader a(a_dir + "/grads.safetensors"), b(b_dir + "/grads.safetensors");
  std::pair<double, std::string> worst{0.0, ""};
  for (const auto& s : parameter_specs(c)) {
    std::vector<float> x(std::size_t(s.numel())), y(x.size());
    a.read<float>(s.name, s.shape, x.data());
    b.read<float>(s.name, s.shape, y.data());
    double num = 0, den = 0;
    for (std::size_t k = 0; k < x.size(); ++k) {
      num += (double(x[k]) - y[k]) * (double(x[k]) - y[k]);
      den += double(x[k]) * x[k];
    }
    const double e = std::sqrt(num / std::max(den, 1e-30));
    if (e > worst.first) worst = {e, s.name};
  }
  return worst;
}

}  // namespace sppo::testing
