#include "planner/partition.h"

#include <cmath>

#include "core/check.h"

namespace sppo::plan {

std::vector<i64> partition_length(i64 S, int N) {
  SPPO_CHECK(N >= 1 && S >= N, "planner") << "cannot cut " << S << " tokens into " << N << " subsequences";
  std::vector<i64> l(N, S / N);
  for (int i = 0; i < S % N; ++i) ++l[i];
  return l;
}

double subseq_flops(const ModelConfig& c, i64 o, i64 l) {
  const double QW = c.q_width();  // the attention's width, Z A (Note [Head size])
  return double(l) * 2.0 * c.layer_matmul_params() + 4.0 * QW * double(l) * (double(o) + (double(l) + 1) / 2);
}

std::vector<i64> partition_flops(const ModelConfig& c, i64 S, int N, i64 quantum) {
  SPPO_CHECK(N >= 1 && S >= N, "planner") << "cannot cut " << S << " tokens into " << N << " subsequences";
  // Prefix cost G(x) = g x + 2 H x (x + 1) = 2H x^2 + (g + 2H) x, g = GEMM FLOPs per token,
  // H here the attention's width Z A (Note [Head size]).
  const double H = c.q_width(), g = 2.0 * c.layer_matmul_params();
  const double a = 2 * H, b = g + 2 * H;
  const double total = a * double(S) * double(S) + b * double(S);
  std::vector<i64> bound(N + 1, 0);
  bound[N] = S;
  for (int k = 1; k < N; ++k) {
    const double target = total * k / N;
    const double x = (-b + std::sqrt(b * b + 4 * a * target)) / (2 * a);
    bound[k] = std::llround(x);
    // Boundaries on multiples of the kernels' tile keep every tile full.
    if (quantum > 1 && S / N >= 4 * quantum) bound[k] = std::llround(x / double(quantum)) * quantum;
  }
  // Keep every length >= 1 (only matters when S is close to N).
  for (int k = 1; k <= N; ++k) bound[k] = std::max(bound[k], bound[k - 1] + 1);
  for (int k = N - 1; k >= 0; --k) bound[k] = std::min(bound[k], bound[k + 1] - 1);
  std::vector<i64> l(N);
  for (int k = 0; k < N; ++k) l[k] = bound[k + 1] - bound[k];
  return l;
}

std::vector<int> balanced_stage_layers(int L, int P, double head_layers) {
  SPPO_CHECK(P >= 1 && P <= L, "planner") << "cannot split " << L << " layers over " << P << " stages";
  if (P == 1) return {L};
  int best_last = 1;
  double best = 1e300;
  for (int last = 1; last <= L - (P - 1); ++last) {
    const int rest = L - last;
    const double busiest = std::max(last + head_layers, double((rest + P - 2) / (P - 1)));
    if (busiest <= best) {
      best = busiest;
      best_last = last;
    }
  }
  std::vector<int> n(P);
  const int rest = L - best_last;
  for (int p = 0; p + 1 < P; ++p) n[p] = rest / (P - 1) + (p < rest % (P - 1) ? 1 : 0);
  n[P - 1] = best_last;
  return n;
}

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int k = 1; k <= n; ++k)
    if (n % k == 0) d.push_back(k);
  return d;
}

}  // namespace sppo::plan
