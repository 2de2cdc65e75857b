#include "core/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/check.h"

namespace sppo {

RopeTable rope_table(int A, double theta) {
  SPPO_ASSERT_MSG(A > 0 && A % 2 == 0 && A / 2 <= kMaxRopeHalf, "rope: head size " << A);
  RopeTable r;
  r.half = A / 2;
  for (int j = 0; j < r.half; ++j) r.inv_freq[j] = std::pow(theta, -2.0 * j / A);
  return r;
}

namespace {

// yarn: the dim (of A) whose wavelength makes `turns` rotations over `length` positions.
double correction_dim(double turns, int A, double theta, double length) {
  return A * std::log(length / (turns * 2.0 * std::numbers::pi)) / (2.0 * std::log(theta));
}

}  // namespace

RopeTable rope_table(const ModelConfig& c) {
  const int A = c.head_size();
  const RopeScaling& s = c.rope_scaling;
  double theta = c.rope_theta;
  using Type = RopeScaling::Type;
  if (s.type == Type::Dynamic && c.rope_seq_len > c.max_positions) {
    const double ratio = s.factor * double(c.rope_seq_len) / double(c.max_positions) - (s.factor - 1.0);
    theta *= std::pow(ratio, double(A) / double(A - 2));
  }
  RopeTable r = rope_table(A, theta);
  switch (s.type) {
    case Type::None:
    case Type::Dynamic:
      break;
    case Type::Linear:
      for (int j = 0; j < r.half; ++j) r.inv_freq[j] /= s.factor;
      break;
    case Type::Yarn: {
      const double length = double(c.max_positions);
      const double low = std::max(0.0, std::floor(correction_dim(s.beta_fast, A, theta, length)));
      double high = std::min(double(A - 1), std::ceil(correction_dim(s.beta_slow, A, theta, length)));
      if (low == high) high += 0.001;
      for (int j = 0; j < r.half; ++j) {
        const double ramp = std::clamp((j - low) / (high - low), 0.0, 1.0);
        const double keep = 1.0 - ramp;  // weight of the unscaled (extrapolated) frequency
        r.inv_freq[j] = r.inv_freq[j] / s.factor * (1.0 - keep) + r.inv_freq[j] * keep;
      }
      r.scale = s.attention_factor > 0 ? s.attention_factor : (s.factor > 1.0 ? 0.1 * std::log(s.factor) + 1.0 : 1.0);
      break;
    }
    case Type::Llama3: {
      const double original = double(s.original_max_positions);
      const double low_wavelen = original / s.low_freq_factor, high_wavelen = original / s.high_freq_factor;
      for (int j = 0; j < r.half; ++j) {
        const double f = r.inv_freq[j], wavelen = 2.0 * std::numbers::pi / f;
        if (wavelen > low_wavelen) {
          r.inv_freq[j] = f / s.factor;
        } else if (wavelen >= high_wavelen) {
          const double smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
          r.inv_freq[j] = (1.0 - smooth) * f / s.factor + smooth * f;
        }
      }
      break;
    }
  }
  return r;
}

}  // namespace sppo
