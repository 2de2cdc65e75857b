// AdamW with decoupled weight decay, one parameter at a time: the formula every backend
// runs, on the CPU (cpu::adamw_step), in the CUDA kernel (cuda::adamw_step) and on the
// host's processor for a device backend (Backend::host_adamw, runtime/host_optimizer.h).
// Step t >= 1; the bias corrections are folded into two scalars, computed once a step in
// double:
//   m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2;
//   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps) + lr wd p
#pragma once

#include <math.h>

#include <cmath>

#include "core/check.h"

#ifdef __CUDACC__
#define SPPO_HOST_DEVICE __host__ __device__
#else
#define SPPO_HOST_DEVICE
#endif

namespace sppo {

struct AdamwScalars {
  float beta1 = 0, beta2 = 0, eps = 0;
  float step = 0;       // lr / (1 - beta1^t)
  float rsqrt_bc2 = 0;  // 1 / sqrt(1 - beta2^t)
  float decay = 0;      // lr * weight_decay
};

// One tensor's share of an AdamW step over many (Backend::adamw_spans): elements [offset,
// offset + count) of the weights, the moments' from state_offset, the gradients' from
// grad_offset (below 0: offset; ZeRO-2's gradients are laid out as the moments), and its
// weight decay.
struct AdamwSpan {
  long long offset = 0, count = 0, state_offset = 0;
  float weight_decay = 0;
  long long grad_offset = -1;
  SPPO_HOST_DEVICE long long grad_at() const { return grad_offset < 0 ? offset : grad_offset; }
};

inline AdamwScalars adamw_scalars(float lr, float beta1, float beta2, float eps, float weight_decay, int t) {
  SPPO_ASSERT_MSG(t >= 1, "adamw: step " << t << " must be >= 1");
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), t);
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), t);
  return {beta1, beta2, eps, static_cast<float>(lr / bc1), static_cast<float>(1.0 / std::sqrt(bc2)),
          lr * weight_decay};
}

// The new p; m and v updated in place.
SPPO_HOST_DEVICE inline float adamw_update(float p, float& m, float& v, float g, const AdamwScalars& k) {
  const float mi = k.beta1 * m + (1.0f - k.beta1) * g;
  const float vi = k.beta2 * v + (1.0f - k.beta2) * g * g;
  m = mi;
  v = vi;
  return p - k.step * mi / (sqrtf(vi) * k.rsqrt_bc2 + k.eps) - k.decay * p;
}

}  // namespace sppo
