// Numerics of the CPU causal flash-attention kernels (kernels/attention.h) against a naive
// float64 reference: the full score matrix per head, causal by global position, softmax, LSE,
// and the backward by the textbook formulas. Inputs are fresh N(0, 1) draws (never exactly 0)
// from a generator seeded per test. Every comparison is element-wise,
//   |a - ref| <= atol + rtol * |ref|,
// plus a norm-relative bound ||a - ref|| / ||ref|| for tensors that are sums of many terms.
// Outputs and gradients are sums of terms that cancel (dS = P (dP - delta) is exactly 0 for a
// query that sees one key), so atol follows the size of the terms: the reference also returns
// |terms| summed, and atol is a fraction of its largest entry.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backends/cpu/attention.h"

namespace sppo::cpu {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
// fp32 tolerances: the issue asks for relative error below 1e-5.
constexpr double kRtol = 1e-5;
constexpr double kNormRtol = 1e-5;
// atol is this fraction of the largest sum of |terms| of the tensor.
constexpr double kAtolScale = 1e-5;

int hidden(const AttnDims& d) { return d.Z * d.A; }
// Columns of k and v: Zkv heads (grouped-query attention), or Z.
int kv_heads(const AttnDims& d) { return d.Zkv ? d.Zkv : d.Z; }
int kv_hidden(const AttnDims& d) { return kv_heads(d) * d.A; }
int ldq(const AttnDims& d) { return d.ldq ? d.ldq : hidden(d); }
int ldk(const AttnDims& d) { return d.ldk ? d.ldk : kv_hidden(d); }
int ldv(const AttnDims& d) { return d.ldv ? d.ldv : kv_hidden(d); }
int ldo(const AttnDims& d) { return d.ldo ? d.ldo : hidden(d); }

std::vector<float> randn(std::size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& e : x) {
    do e = dist(rng);
    while (e == 0.0f);
    e *= scale;
  }
  return x;
}

// One attention problem in the caller's layout: q[Tq, ldq], k[Tk, ldk], v[Tk, ldv],
// dout[Tq, ldo]. Columns past Z*A of a row are padding the kernels must not write.
struct Problem {
  AttnDims d;
  std::vector<float> q, k, v, dout;
};

Problem make_problem(const AttnDims& d, std::mt19937& rng, float qk_scale = 1.0f) {
  Problem p{d, {}, {}, {}, {}};
  p.q = randn(std::size_t(d.Tq) * ldq(d), rng, qk_scale);
  p.k = randn(std::size_t(d.Tk) * ldk(d), rng, qk_scale);
  p.v = randn(std::size_t(d.Tk) * ldv(d), rng);
  p.dout = randn(std::size_t(d.Tq) * ldo(d), rng);
  return p;
}

AttnDims dims(int Tq, int Tk, int Z, int A, i64 q_pos0, i64 k_pos0) {
  AttnDims d;
  d.Tq = Tq;
  d.Tk = Tk;
  d.Z = Z;
  d.A = A;
  d.q_pos0 = q_pos0;
  d.k_pos0 = k_pos0;
  return d;
}

std::string describe(const AttnDims& d) {
  return "Tq " + std::to_string(d.Tq) + " Tk " + std::to_string(d.Tk) + " Z " +
         std::to_string(d.Z) + (d.Zkv ? " Zkv " + std::to_string(d.Zkv) : std::string()) + " A " +
         std::to_string(d.A) + " q_pos0 " + std::to_string(d.q_pos0) +
         " k_pos0 " + std::to_string(d.k_pos0) + " ldq " + std::to_string(ldq(d)) + " ldk " +
         std::to_string(ldk(d)) + " ldv " + std::to_string(ldv(d)) + " ldo " +
         std::to_string(ldo(d));
}

// ---- float64 reference ------------------------------------------------------------------
// Size of the terms a tensor sums: the largest entry and the norm of the tensor of sums of
// |terms| (out = sum_j P_j v_j has terms P_j |v_j|, and so on).
struct Magnitude {
  double max = 0.0, norm = 0.0;
};

Magnitude magnitude(const std::vector<double>& abs_sums) {
  Magnitude m;
  for (double x : abs_sums) {
    m.max = std::max(m.max, x);
    m.norm += x * x;
  }
  m.norm = std::sqrt(m.norm);
  return m;
}

struct Reference {
  std::vector<double> out;         // [Tq, Z*A]; 0 in rows that see no key
  std::vector<double> lse;         // [Z, Tq]; -inf in rows that see no key
  std::vector<double> delta;       // [Z, Tq] rowsum(dout * out)
  std::vector<double> dq, dk, dv;  // [Tq, Z*A], [Tk, Zkv*A], [Tk, Zkv*A] of sum(dout * out)
  Magnitude out_mag, delta_mag, dq_mag, dk_mag, dv_mag;
};

// Grouped-query attention: query head z reads key/value head z / (Z / Zkv), and dk, dv of a
// key/value head sum the terms of every query head that reads it.
Reference reference(const Problem& p) {
  const AttnDims& d = p.d;
  const int H = hidden(d), Hkv = kv_hidden(d), A = d.A;
  const double scale = 1.0 / std::sqrt(double(A));
  Reference r;
  r.out.assign(std::size_t(d.Tq) * H, 0.0);
  r.lse.assign(std::size_t(d.Z) * d.Tq, -kInf);
  r.delta.assign(std::size_t(d.Z) * d.Tq, 0.0);
  r.dq.assign(std::size_t(d.Tq) * H, 0.0);
  r.dk.assign(std::size_t(d.Tk) * Hkv, 0.0);
  r.dv.assign(std::size_t(d.Tk) * Hkv, 0.0);
  std::vector<double> s(d.Tk), pr(d.Tk);
  // Sums of |terms|, the same shapes as out, delta, dq, dk, dv.
  std::vector<double> out_abs(r.out.size(), 0.0), delta_abs(r.delta.size(), 0.0);
  std::vector<double> dq_abs(r.dq.size(), 0.0), dk_abs(r.dk.size(), 0.0), dv_abs(r.dv.size(), 0.0);
  for (int z = 0; z < d.Z; ++z) {
    const int zk = z / (d.Z / kv_heads(d));  // the key/value head
    for (int t = 0; t < d.Tq; ++t) {
      const float* qt = p.q.data() + std::size_t(t) * ldq(d) + z * A;
      const float* dot = p.dout.data() + std::size_t(t) * ldo(d) + z * A;
      int visible = 0;
      double mx = -kInf;
      for (int j = 0; j < d.Tk; ++j) {
        if (d.k_pos0 + j > d.q_pos0 + t) continue;
        ++visible;
        const float* kj = p.k.data() + std::size_t(j) * ldk(d) + zk * A;
        double acc = 0.0;
        for (int a = 0; a < A; ++a) acc += double(qt[a]) * kj[a];
        s[j] = acc * scale;
        mx = std::max(mx, s[j]);
      }
      if (visible == 0) continue;
      double sum = 0.0;
      for (int j = 0; j < d.Tk; ++j)
        if (d.k_pos0 + j <= d.q_pos0 + t) sum += std::exp(s[j] - mx);
      r.lse[std::size_t(z) * d.Tq + t] = mx + std::log(sum);
      const std::size_t row = std::size_t(t) * H + z * A;
      double* o = r.out.data() + row;
      for (int j = 0; j < d.Tk; ++j) {
        pr[j] = d.k_pos0 + j <= d.q_pos0 + t ? std::exp(s[j] - mx) / sum : 0.0;
        const float* vj = p.v.data() + std::size_t(j) * ldv(d) + zk * A;
        for (int a = 0; a < A; ++a) {
          o[a] += pr[j] * vj[a];
          out_abs[row + a] += pr[j] * std::abs(vj[a]);
        }
      }
      double delta = 0.0;
      for (int a = 0; a < A; ++a) {
        delta += double(dot[a]) * o[a];
        delta_abs[std::size_t(z) * d.Tq + t] += std::abs(double(dot[a]) * o[a]);
      }
      r.delta[std::size_t(z) * d.Tq + t] = delta;
      double* dqt = r.dq.data() + row;
      for (int j = 0; j < d.Tk; ++j) {
        if (pr[j] == 0.0) continue;
        const float* kj = p.k.data() + std::size_t(j) * ldk(d) + zk * A;
        const float* vj = p.v.data() + std::size_t(j) * ldv(d) + zk * A;
        double dpj = 0.0;
        for (int a = 0; a < A; ++a) dpj += double(dot[a]) * vj[a];
        const double ds = pr[j] * (dpj - delta) * scale;
        // |dS| before cancellation: the terms of dP - delta.
        const double ds_abs = pr[j] * (std::abs(dpj) + std::abs(delta)) * scale;
        const std::size_t krow = std::size_t(j) * Hkv + zk * A;
        double* dkj = r.dk.data() + krow;
        double* dvj = r.dv.data() + krow;
        for (int a = 0; a < A; ++a) {
          dqt[a] += ds * kj[a];
          dkj[a] += ds * qt[a];
          dvj[a] += pr[j] * dot[a];
          dq_abs[row + a] += ds_abs * std::abs(kj[a]);
          dk_abs[krow + a] += ds_abs * std::abs(qt[a]);
          dv_abs[krow + a] += pr[j] * std::abs(dot[a]);
        }
      }
    }
  }
  r.out_mag = magnitude(out_abs);
  r.delta_mag = magnitude(delta_abs);
  r.dq_mag = magnitude(dq_abs);
  r.dk_mag = magnitude(dk_abs);
  r.dv_mag = magnitude(dv_abs);
  return r;
}

// ---- runs of the kernels ------------------------------------------------------------------
constexpr float kSentinel = 12345.0f;  // fills padding columns that must stay untouched

struct Forward {
  std::vector<float> out;  // [Tq, ldo]
  std::vector<float> lse;  // [Z, Tq]
};

Forward run_forward(const Problem& p) {
  Forward f;
  f.out.assign(std::size_t(p.d.Tq) * ldo(p.d), kSentinel);
  f.lse.assign(std::size_t(p.d.Z) * p.d.Tq, kSentinel);
  attention_forward(f.out.data(), f.lse.data(), p.q.data(), p.k.data(), p.v.data(), p.d, false);
  return f;
}

struct Grads {
  std::vector<float> dq, dk, dv;  // [Tq, ldq], [Tk, ldk], [Tk, ldv]
};

Grads zero_grads(const AttnDims& d) {
  Grads g;
  g.dq.assign(std::size_t(d.Tq) * ldq(d), 0.0f);
  g.dk.assign(std::size_t(d.Tk) * ldk(d), 0.0f);
  g.dv.assign(std::size_t(d.Tk) * ldv(d), 0.0f);
  return g;
}

std::vector<float> run_delta(const Problem& p, const Forward& f) {
  std::vector<float> delta(std::size_t(p.d.Z) * p.d.Tq, kSentinel);
  attention_backward_delta(delta.data(), p.dout.data(), f.out.data(), p.d);
  return delta;
}

// Forward, delta and backward as one call each, gradients accumulated onto `g`.
void run_backward(const Problem& p, const Forward& f, Grads& g) {
  const std::vector<float> delta = run_delta(p, f);
  attention_backward(g.dq.data(), g.dk.data(), g.dv.data(), p.dout.data(), p.q.data(), p.k.data(),
                     p.v.data(), f.lse.data(), delta.data(), p.d);
}

// ---- comparisons --------------------------------------------------------------------------
struct Stats {
  long bad = 0;            // elements outside atol + rtol |ref| (NaN counts)
  double max_abs = 0.0;    // max |a - ref|
  double max_rel = 0.0;    // max |a - ref| / |ref| over |ref| >= 1e-2 max |ref|
  double norm_rel = 0.0;   // ||a - ref|| / max(||ref||, 1e-2 ||sum of |terms| ||)
  double ref_scale = 0.0;  // max |ref|
};

// a[rows, cols] with row stride lda against ref[rows, cols] with row stride ldr; atol is
// atol_scale * mag.max. A reference that is zero by cancellation (||ref|| below 1% of the
// terms' norm) makes the norm check relative to 1% of the terms' norm instead.
Stats compare(const float* a, std::size_t lda, const double* ref, std::size_t ldr, int rows,
              int cols, const Magnitude& mag, double atol_scale, double rtol) {
  Stats st;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c)
      st.ref_scale = std::max(st.ref_scale, std::abs(ref[r * ldr + c]));
  const double atol = atol_scale * std::max(mag.max, st.ref_scale);
  double err2 = 0.0, ref2 = 0.0;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      const double x = a[r * lda + c], y = ref[r * ldr + c];
      const double err = std::abs(x - y);
      if (!(err <= atol + rtol * std::abs(y))) ++st.bad;
      if (std::isnan(err)) st.max_abs = err;
      st.max_abs = std::max(st.max_abs, err);
      if (std::abs(y) >= 1e-2 * st.ref_scale && std::abs(y) > 0)
        st.max_rel = std::max(st.max_rel, err / std::abs(y));
      err2 += err * err;
      ref2 += y * y;
    }
  const double denom = std::max(std::sqrt(ref2), 1e-2 * mag.norm);
  st.norm_rel = denom > 0 ? std::sqrt(err2) / denom : std::sqrt(err2);
  return st;
}

void expect_close(const char* what, const float* a, std::size_t lda, const double* ref,
                  std::size_t ldr, int rows, int cols, const Magnitude& mag,
                  double atol_scale = kAtolScale, double rtol = kRtol,
                  double norm_rtol = kNormRtol) {
  const Stats st = compare(a, lda, ref, ldr, rows, cols, mag, atol_scale, rtol);
  std::printf("    %-10s max|err| %.2e  max rel %.2e  norm rel %.2e  (max|ref| %.3g, terms %.3g)\n",
              what, st.max_abs, st.max_rel, st.norm_rel, st.ref_scale, mag.max);
  EXPECT_EQ(st.bad, 0) << what << ": elements outside " << atol_scale << " * max|terms| + " << rtol
                       << " * |ref|; max|err| " << st.max_abs << ", max|ref| " << st.ref_scale
                       << ", max|terms| " << mag.max;
  EXPECT_LE(st.norm_rel, norm_rtol) << what << ": norm-relative error";
}

// lse[Z, Tq]: -inf exactly where the reference has no visible key, close elsewhere.
void expect_lse_close(const std::vector<float>& lse, const std::vector<double>& ref,
                      double tol = 1e-5) {
  ASSERT_EQ(lse.size(), ref.size());
  double max_err = 0.0;
  long bad = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (ref[i] == -kInf) {
      if (lse[i] != -std::numeric_limits<float>::infinity()) ++bad;
      continue;
    }
    const double err = std::abs(double(lse[i]) - ref[i]);
    max_err = std::max(max_err, err);
    if (!(err <= tol * std::max(1.0, std::abs(ref[i])))) ++bad;
  }
  std::printf("    %-10s max|err| %.2e\n", "lse", max_err);
  EXPECT_EQ(bad, 0) << "lse entries off by more than " << tol << " * max(1, |ref|), max|err| "
                    << max_err;
}

// Columns from `first` to `last` (exclusive) of every row of a [rows, ld] buffer still hold
// `value` bit for bit.
void expect_untouched(const char* what, const std::vector<float>& buf, int rows, std::size_t ld,
                      std::size_t first, std::size_t last, float value) {
  long touched = 0;
  for (int r = 0; r < rows; ++r)
    for (std::size_t c = first; c < last; ++c)
      if (std::memcmp(&buf[r * ld + c], &value, sizeof value) != 0) ++touched;
  EXPECT_EQ(touched, 0) << what << ": padding columns were written";
}

void check_forward(const Problem& p, const Forward& f, const Reference& r,
                   double atol_scale = kAtolScale, double rtol = kRtol,
                   double norm_rtol = kNormRtol, double lse_tol = 1e-5) {
  const AttnDims& d = p.d;
  expect_close("out", f.out.data(), ldo(d), r.out.data(), hidden(d), d.Tq, hidden(d), r.out_mag,
               atol_scale, rtol, norm_rtol);
  expect_lse_close(f.lse, r.lse, lse_tol);
  expect_untouched("out", f.out, d.Tq, ldo(d), hidden(d), ldo(d), kSentinel);
}

void check_backward(const Problem& p, const Grads& g, const Reference& r,
                    double atol_scale = kAtolScale, double rtol = kRtol,
                    double norm_rtol = kNormRtol) {
  const AttnDims& d = p.d;
  const int H = hidden(d), Hkv = kv_hidden(d);
  expect_close("dq", g.dq.data(), ldq(d), r.dq.data(), H, d.Tq, H, r.dq_mag, atol_scale, rtol,
               norm_rtol);
  expect_close("dk", g.dk.data(), ldk(d), r.dk.data(), Hkv, d.Tk, Hkv, r.dk_mag, atol_scale, rtol,
               norm_rtol);
  expect_close("dv", g.dv.data(), ldv(d), r.dv.data(), Hkv, d.Tk, Hkv, r.dv_mag, atol_scale, rtol,
               norm_rtol);
}

// The gradients of a split computation against those of one whole call (same tolerances
// as against the reference, scaled by the reference's magnitudes).
void expect_grads_match(const Grads& g, const Grads& whole_g, const AttnDims& d, const Reference& r) {
  const int H = hidden(d), Hkv = kv_hidden(d);
  const std::vector<double> wdq(whole_g.dq.begin(), whole_g.dq.end());
  const std::vector<double> wdk(whole_g.dk.begin(), whole_g.dk.end());
  const std::vector<double> wdv(whole_g.dv.begin(), whole_g.dv.end());
  expect_close("dq/whole", g.dq.data(), ldq(d), wdq.data(), ldq(d), d.Tq, H, r.dq_mag);
  expect_close("dk/whole", g.dk.data(), ldk(d), wdk.data(), ldk(d), d.Tk, Hkv, r.dk_mag);
  expect_close("dv/whole", g.dv.data(), ldv(d), wdv.data(), ldv(d), d.Tk, Hkv, r.dv_mag);
}

// Forward and backward of one problem against the reference.
void check_problem(const Problem& p) {
  SCOPED_TRACE(describe(p.d));
  std::printf("  %s\n", describe(p.d).c_str());
  const Reference r = reference(p);
  const Forward f = run_forward(p);
  check_forward(p, f, r);
  const std::vector<float> delta = run_delta(p, f);
  expect_close("delta", delta.data(), p.d.Tq, r.delta.data(), p.d.Tq, p.d.Z, p.d.Tq, r.delta_mag);
  Grads g = zero_grads(p.d);
  run_backward(p, f, g);
  check_backward(p, g, r);
}

// ---- the reference itself -----------------------------------------------------------------
// The reference backward is the gradient of L = sum(dout * out) of the reference forward:
// central finite differences in float64 on a tiny problem with offsets.
void check_reference_gradients(Problem p) {
  const Reference r = reference(p);
  const auto loss = [](const Problem& pp) {
    const Reference rr = reference(pp);
    double l = 0.0;
    for (int t = 0; t < pp.d.Tq; ++t)
      for (int c = 0; c < hidden(pp.d); ++c)
        l += double(pp.dout[std::size_t(t) * ldo(pp.d) + c]) *
             rr.out[std::size_t(t) * hidden(pp.d) + c];
    return l;
  };
  // The inputs are floats, so the steps x + h and x - h are rounded to float; the quotient
  // divides by the distance between the rounded steps.
  const auto check = [&](std::vector<float> Problem::*field, const std::vector<double>& grad,
                         const char* what) {
    double max_err = 0.0;
    for (std::size_t i = 0; i < (p.*field).size(); ++i) {
      const float x = (p.*field)[i];
      const float h = 1.0f / 4096;
      (p.*field)[i] = x + h;
      const double lp = loss(p);
      (p.*field)[i] = x - h;
      const double lm = loss(p);
      (p.*field)[i] = x;
      const double fd = (lp - lm) / (double(x + h) - double(x - h));
      max_err = std::max(max_err, std::abs(fd - grad[i]));
      EXPECT_NEAR(fd, grad[i], 1e-5 * (1.0 + std::abs(grad[i]))) << what << "[" << i << "]";
    }
    std::printf("    %-10s max|fd - ref| %.2e\n", what, max_err);
  };
  check(&Problem::q, r.dq, "dq");
  check(&Problem::k, r.dk, "dk");
  check(&Problem::v, r.dv, "dv");
}

TEST(AttentionReference, BackwardMatchesFiniteDifferences) {
  std::mt19937 rng(101);
  check_reference_gradients(make_problem(dims(4, 6, 2, 3, 3, 1), rng));
}

// Grouped-query attention: the query heads of a group add into one key/value head's dk, dv.
TEST(AttentionReference, GroupedBackwardMatchesFiniteDifferences) {
  std::mt19937 rng(102);
  for (int Zkv : {1, 2}) {
    AttnDims d = dims(4, 6, 4, 3, 3, 1);
    d.Zkv = Zkv;
    check_reference_gradients(make_problem(d, rng));
  }
}

// ---- forward and backward against the reference ------------------------------------------
TEST(Attention, PlainCausalOddLengths) {
  std::mt19937 rng(1);
  for (int T : {1, 3, 67, 130, 257}) check_problem(make_problem(dims(T, T, 2, 64, 0, 0), rng));
  // Equal nonzero offsets: a later subsequence's diagonal block.
  check_problem(make_problem(dims(200, 200, 2, 64, 5000, 5000), rng));
}

TEST(Attention, HeadSizesNotMultiplesOfTheVector) {
  std::mt19937 rng(2);
  for (int A : {1, 24, 80, 128}) check_problem(make_problem(dims(97, 97, 3, A, 0, 0), rng));
}

TEST(Attention, SingleQueryAndSingleKey) {
  std::mt19937 rng(3);
  check_problem(make_problem(dims(1, 300, 2, 64, 400, 200), rng));  // sees keys 200..400
  check_problem(make_problem(dims(1, 300, 2, 64, 1000, 0), rng));   // sees all keys
  check_problem(make_problem(dims(100, 1, 2, 64, 0, 50), rng));     // rows 50.. see the key
  check_problem(make_problem(dims(1, 1, 2, 64, 7, 7), rng));
}

TEST(Attention, KeysEntirelyInThePast) {
  std::mt19937 rng(4);
  check_problem(make_problem(dims(67, 300, 2, 64, 1000, 0), rng));
  check_problem(make_problem(dims(130, 130, 2, 64, 130, 0), rng));  // adjacent blocks
  check_problem(make_problem(dims(20, 600, 2, 64, 600, 0), rng));   // Tk >> Tq
}

TEST(Attention, OverlappingOffsets) {
  std::mt19937 rng(5);
  check_problem(make_problem(dims(130, 257, 2, 64, 100, 37), rng));   // keys start earlier
  check_problem(make_problem(dims(130, 257, 2, 64, 100, 150), rng));  // rows 100..149 see none
  check_problem(make_problem(dims(257, 67, 3, 64, 0, 190), rng));     // Tk < Tq
  check_problem(make_problem(dims(67, 130, 1, 64, 64, 0), rng));
  // First key 127 positions after the first query: one short of a 64-column block boundary.
  check_problem(make_problem(dims(300, 300, 2, 64, 0, 127), rng));
}

// Lengths, offsets and head sizes drawn at random, so that every alignment of the query and key
// blocks against the kernels' tiles comes up.
TEST(Attention, RandomOffsetsAndLengths) {
  std::mt19937 rng(15);
  std::uniform_int_distribution<int> length(1, 400), offset(0, 700), head(0, 3), heads(1, 3);
  const int head_sizes[] = {16, 40, 64, 72};
  for (int trial = 0; trial < 24; ++trial) {
    const int Tq = length(rng), Tk = length(rng);
    const i64 q_pos0 = offset(rng);
    // Keys from well before the queries to just past the last one.
    const i64 k_pos0 =
        std::uniform_int_distribution<i64>(std::max<i64>(0, q_pos0 - Tk - 64), q_pos0 + Tq)(rng);
    check_problem(
        make_problem(dims(Tq, Tk, heads(rng), head_sizes[head(rng)], q_pos0, k_pos0), rng));
  }
}

TEST(Attention, StridedRowsInsideQkvBuffer) {
  std::mt19937 rng(6);
  // q, k, v are thirds of one [T, 3H] buffer; out and dout have their own padded stride.
  AttnDims d = dims(130, 130, 4, 64, 0, 0);
  const int H = hidden(d);
  d.ldq = d.ldk = d.ldv = 3 * H;
  d.ldo = H + 16;
  Problem p = make_problem(d, rng);
  check_problem(p);

  // q from the qkv buffer, k and v from a dense KV cache [S, H] that reaches further back.
  AttnDims c = dims(67, 300, 4, 64, 233, 0);
  c.ldq = 3 * H;
  c.ldo = 2 * H;
  check_problem(make_problem(c, rng));

  // Padding columns of the gradient buffers must not be written either.
  const Forward f = run_forward(p);
  Grads g{std::vector<float>(std::size_t(d.Tq) * d.ldq, kSentinel),
          std::vector<float>(std::size_t(d.Tk) * d.ldk, kSentinel),
          std::vector<float>(std::size_t(d.Tk) * d.ldv, kSentinel)};
  run_backward(p, f, g);
  expect_untouched("dq", g.dq, d.Tq, d.ldq, H, d.ldq, kSentinel);
  expect_untouched("dk", g.dk, d.Tk, d.ldk, H, d.ldk, kSentinel);
  expect_untouched("dv", g.dv, d.Tk, d.ldv, H, d.ldv, kSentinel);
}

// q and k scaled by 30: scaled scores reach the thousands. The result must stay finite and be
// as accurate as fp32 scores allow. A dot product of A terms summed in fp32 is typically off by
// u * sum_a |q_a k_a| (u = eps / 2: a rounding walk of A steps over partial sums of size
// sum_a |q_a k_a| / sqrt(A)), times the score scale 1 / sqrt(A). An error e in every scaled
// score moves P by up to 2 e P, so outputs and gradients move by up to 2 e times their terms.
// The tolerance is 4 times that, with e the root mean square of that estimate over all pairs.
TEST(Attention, LargeLogits) {
  std::mt19937 rng(7);
  for (const AttnDims& d : {dims(130, 130, 2, 64, 0, 0), dims(67, 257, 2, 64, 300, 0)}) {
    SCOPED_TRACE(describe(d));
    std::printf("  %s, q and k scaled by 30\n", describe(d).c_str());
    const Problem p = make_problem(d, rng, 30.0f);
    const Reference r = reference(p);
    double sum_sq_abs_qk = 0.0, max_score = 0.0;
    for (int t = 0; t < d.Tq; ++t)
      for (int j = 0; j < d.Tk; ++j)
        for (int z = 0; z < d.Z; ++z) {
          double abs_sum = 0.0, dot = 0.0;
          for (int a = 0; a < d.A; ++a) {
            const double x = double(p.q[std::size_t(t) * ldq(d) + z * d.A + a]) *
                             p.k[std::size_t(j) * ldk(d) + z * d.A + a];
            abs_sum += std::abs(x);
            dot += x;
          }
          sum_sq_abs_qk += abs_sum * abs_sum;
          max_score = std::max(max_score, std::abs(dot) / std::sqrt(double(d.A)));
        }
    const double eps = std::numeric_limits<float>::epsilon();
    const double rms_abs_qk = std::sqrt(sum_sq_abs_qk / (double(d.Tq) * d.Tk * d.Z));
    const double score_err = eps / 2 * rms_abs_qk / std::sqrt(double(d.A));
    const double rtol = 4 * 2 * score_err;
    std::printf("    max |scaled score| %.0f, typical fp32 score error %.1e, rtol %.1e\n",
                max_score, score_err, rtol);
    const Forward f = run_forward(p);
    for (float x : f.out) ASSERT_TRUE(std::isfinite(x));
    for (float x : f.lse) ASSERT_TRUE(std::isfinite(x));
    check_forward(p, f, r, rtol, rtol, rtol, rtol);
    Grads g = zero_grads(d);
    run_backward(p, f, g);
    for (const auto* buf : {&g.dq, &g.dk, &g.dv})
      for (float x : *buf) ASSERT_TRUE(std::isfinite(x));
    check_backward(p, g, r, rtol, rtol, rtol);
  }
}

// ---- keys and queries split into blocks --------------------------------------------------
// A sub-block of p: queries [t0, t1), keys [s0, s1), pointing into p's buffers.
struct Block {
  AttnDims d;
  std::size_t q_off, k_off;  // first query row, first key row
};

Block block(const AttnDims& d, int t0, int t1, int s0, int s1) {
  Block b{d, std::size_t(t0), std::size_t(s0)};
  b.d.Tq = t1 - t0;
  b.d.Tk = s1 - s0;
  b.d.q_pos0 = d.q_pos0 + t0;
  b.d.k_pos0 = d.k_pos0 + s0;
  b.d.ldq = ldq(d);
  b.d.ldk = ldk(d);
  b.d.ldv = ldv(d);
  b.d.ldo = ldo(d);
  return b;
}

// Random cut points: n pieces of [0, len), each non-empty.
std::vector<int> cuts(int len, int n, std::mt19937& rng) {
  std::vector<int> c(len - 1);
  std::iota(c.begin(), c.end(), 1);
  std::shuffle(c.begin(), c.end(), rng);
  c.resize(n - 1);
  c.push_back(0);
  c.push_back(len);
  std::sort(c.begin(), c.end());
  return c;
}

// The full problem's queries cut into `nq` blocks and keys into `nk` blocks; every (query
// block, key block) pair runs in a shuffled key order, merging forward results by LSE, and
// the backward accumulates dq over key blocks and dk/dv over query blocks.
void check_split(const Problem& p, int nq, int nk, std::mt19937& rng) {
  const AttnDims& d = p.d;
  SCOPED_TRACE(describe(d) + " split " + std::to_string(nq) + " x " + std::to_string(nk));
  std::printf("  %s, queries in %d blocks, keys in %d\n", describe(d).c_str(), nq, nk);
  const std::vector<int> qc = cuts(d.Tq, nq, rng), kc = cuts(d.Tk, nk, rng);
  const Reference r = reference(p);
  const Forward whole = run_forward(p);

  Forward f;
  f.out.assign(std::size_t(d.Tq) * ldo(d), kSentinel);
  f.lse.assign(std::size_t(d.Z) * d.Tq, kSentinel);
  std::vector<std::vector<float>> lse_parts(nq);
  for (int bq = 0; bq < nq; ++bq) {
    std::vector<int> order(nk);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    const int t0 = qc[bq], t1 = qc[bq + 1];
    lse_parts[bq].assign(std::size_t(d.Z) * (t1 - t0), kSentinel);
    for (int i = 0; i < nk; ++i) {
      const Block b = block(d, t0, t1, kc[order[i]], kc[order[i] + 1]);
      attention_forward(f.out.data() + b.q_off * ldo(d), lse_parts[bq].data(),
                        p.q.data() + b.q_off * ldq(d), p.k.data() + b.k_off * ldk(d),
                        p.v.data() + b.k_off * ldv(d), b.d, /*merge=*/i > 0);
    }
    for (int z = 0; z < d.Z; ++z)
      for (int t = t0; t < t1; ++t)
        f.lse[std::size_t(z) * d.Tq + t] = lse_parts[bq][std::size_t(z) * (t1 - t0) + (t - t0)];
  }
  check_forward(p, f, r);
  // Merged blocks against one call: both fp32, so only rounding apart.
  std::vector<double> whole_out(whole.out.begin(), whole.out.end());
  expect_close("out/whole", f.out.data(), ldo(d), whole_out.data(), ldo(d), d.Tq, hidden(d),
               r.out_mag);
  std::vector<double> whole_lse(whole.lse.begin(), whole.lse.end());
  expect_lse_close(f.lse, whole_lse);

  // Backward per block pair against one call over everything, from the same forward.
  Grads whole_g = zero_grads(d);
  run_backward(p, whole, whole_g);
  const std::vector<float> delta = run_delta(p, whole);
  Grads g = zero_grads(d);
  for (int bq = 0; bq < nq; ++bq) {
    const int t0 = qc[bq], t1 = qc[bq + 1];
    std::vector<float> lse_b(std::size_t(d.Z) * (t1 - t0)), delta_b(lse_b.size());
    for (int z = 0; z < d.Z; ++z)
      for (int t = t0; t < t1; ++t) {
        lse_b[std::size_t(z) * (t1 - t0) + (t - t0)] = whole.lse[std::size_t(z) * d.Tq + t];
        delta_b[std::size_t(z) * (t1 - t0) + (t - t0)] = delta[std::size_t(z) * d.Tq + t];
      }
    for (int bk = nk - 1; bk >= 0; --bk) {
      const Block b = block(d, t0, t1, kc[bk], kc[bk + 1]);
      attention_backward(g.dq.data() + b.q_off * ldq(d), g.dk.data() + b.k_off * ldk(d),
                         g.dv.data() + b.k_off * ldv(d), p.dout.data() + b.q_off * ldo(d),
                         p.q.data() + b.q_off * ldq(d), p.k.data() + b.k_off * ldk(d),
                         p.v.data() + b.k_off * ldv(d), lse_b.data(), delta_b.data(), b.d);
    }
  }
  check_backward(p, g, r);
  expect_grads_match(g, whole_g, d, r);
}

TEST(Attention, MergedKeyBlocksEqualOneCall) {
  std::mt19937 rng(8);
  for (int nk : {2, 3, 4}) check_split(make_problem(dims(257, 257, 2, 64, 0, 0), rng), 1, nk, rng);
  // Keys reaching back before the queries, and keys running past them.
  check_split(make_problem(dims(130, 400, 2, 64, 300, 0), rng), 1, 3, rng);
  check_split(make_problem(dims(130, 300, 2, 64, 100, 50), rng), 1, 4, rng);
}

// Ring attention's form: each key block's result computed on its own (as another rank
// would), then joined by attention_merge in block order. Rows that see no key of a block
// (-inf on that side) and blocks entirely after the queries are part of the cases.
void check_separate_merge(const Problem& p, int nk, std::mt19937& rng) {
  const AttnDims& d = p.d;
  SCOPED_TRACE(describe(d) + " merged from " + std::to_string(nk) + " separate key blocks");
  const std::vector<int> kc = cuts(d.Tk, nk, rng);
  const Reference r = reference(p);
  Forward f;
  for (int bk = 0; bk < nk; ++bk) {
    const Block b = block(d, 0, d.Tq, kc[bk], kc[bk + 1]);
    Forward part;
    part.out.assign(std::size_t(d.Tq) * ldo(d), kSentinel);
    part.lse.assign(std::size_t(d.Z) * d.Tq, kSentinel);
    attention_forward(part.out.data(), part.lse.data(), p.q.data(), p.k.data() + b.k_off * ldk(d),
                      p.v.data() + b.k_off * ldv(d), b.d, /*merge=*/false);
    if (bk == 0)
      f = part;
    else
      attention_merge(f.out.data(), f.lse.data(), part.out.data(), part.lse.data(), d);
  }
  check_forward(p, f, r);
}

TEST(Attention, SeparateBlocksMergedEqualOneCall) {
  std::mt19937 rng(21);
  for (int nk : {2, 3, 5}) check_separate_merge(make_problem(dims(257, 257, 2, 64, 0, 0), rng), nk, rng);
  check_separate_merge(make_problem(dims(130, 300, 2, 64, 100, 50), rng), 4, rng);
  check_separate_merge(make_problem(dims(64, 512, 3, 32, 200, 0), rng), 6, rng);
}

TEST(Attention, QueryAndKeyBlockGrid) {
  std::mt19937 rng(9);
  AttnDims d = dims(300, 300, 3, 64, 1000, 1000);
  d.ldq = d.ldk = d.ldv = 3 * hidden(d);
  check_split(make_problem(d, rng), 3, 4, rng);
  check_split(make_problem(dims(200, 333, 2, 64, 133, 0), rng), 2, 3, rng);
}

// ---- several key blocks in one call ------------------------------------------------------
// The keys of p cut into blocks in position order, each its own buffer (copied out of p, so a
// read past a block's rows would not find the neighbour's keys); the blocks' gradients go to
// their own buffers and are copied back into a [Tk, .] layout for the comparisons.
struct KeyBlocks {
  std::vector<int> cuts;                      // block b holds keys cuts[b] .. cuts[b+1]-1
  std::vector<std::vector<float>> k, v;       // [len_b, ldk], [len_b, ldv]
  std::vector<std::vector<float>> dk, dv;     // [len_b, ldk], [len_b, ldv]
  std::vector<KVBlock> blocks;
};

KeyBlocks split_keys(const Problem& p, const std::vector<int>& cuts, float grad_fill = 0.0f) {
  const AttnDims& d = p.d;
  KeyBlocks kb;
  kb.cuts = cuts;
  const int n = int(cuts.size()) - 1;
  kb.k.resize(n), kb.v.resize(n), kb.dk.resize(n), kb.dv.resize(n);
  for (int b = 0; b < n; ++b) {
    const int s0 = cuts[b], s1 = cuts[b + 1];
    kb.k[b].assign(p.k.begin() + std::size_t(s0) * ldk(d), p.k.begin() + std::size_t(s1) * ldk(d));
    kb.v[b].assign(p.v.begin() + std::size_t(s0) * ldv(d), p.v.begin() + std::size_t(s1) * ldv(d));
    kb.dk[b].assign(std::size_t(s1 - s0) * ldk(d), grad_fill);
    kb.dv[b].assign(std::size_t(s1 - s0) * ldv(d), grad_fill);
  }
  for (int b = 0; b < n; ++b)
    kb.blocks.push_back({kb.k[b].data(), kb.v[b].data(), kb.dk[b].data(), kb.dv[b].data(),
                         cuts[b + 1] - cuts[b], d.k_pos0 + cuts[b]});
  return kb;
}

Forward run_forward_blocks(const Problem& p, const KeyBlocks& kb) {
  Forward f;
  f.out.assign(std::size_t(p.d.Tq) * ldo(p.d), kSentinel);
  f.lse.assign(std::size_t(p.d.Z) * p.d.Tq, kSentinel);
  AttnDims d = p.d;
  d.Tk = -7;  // ignored
  d.k_pos0 = 123456;
  attention_forward_blocks(f.out.data(), f.lse.data(), p.q.data(), kb.blocks, d);
  return f;
}

// Backward over the blocks from forward f; dq accumulates onto `dq`, the blocks' gradients
// onto their own buffers. Returns the gradients with dk, dv gathered into [Tk, .].
Grads run_backward_blocks(const Problem& p, const Forward& f, KeyBlocks& kb,
                          std::vector<float> dq) {
  const std::vector<float> delta = run_delta(p, f);
  attention_backward_blocks(dq.data(), p.dout.data(), p.q.data(), kb.blocks, f.lse.data(),
                            delta.data(), p.d);
  Grads g{std::move(dq), {}, {}};
  for (std::size_t b = 0; b < kb.dk.size(); ++b) {
    g.dk.insert(g.dk.end(), kb.dk[b].begin(), kb.dk[b].end());
    g.dv.insert(g.dv.end(), kb.dv[b].begin(), kb.dv[b].end());
  }
  return g;
}

// Keys in `n` blocks against the reference and against one single-block call over all keys.
void check_blocks(const Problem& p, const std::vector<int>& cuts) {
  const AttnDims& d = p.d;
  std::string lens;
  for (std::size_t b = 0; b + 1 < cuts.size(); ++b)
    lens += " " + std::to_string(cuts[b + 1] - cuts[b]);
  SCOPED_TRACE(describe(d) + " key blocks" + lens);
  std::printf("  %s, key blocks of%s\n", describe(d).c_str(), lens.c_str());
  const Reference r = reference(p);
  KeyBlocks kb = split_keys(p, cuts);
  const Forward f = run_forward_blocks(p, kb);
  check_forward(p, f, r);
  const Forward whole = run_forward(p);
  const std::vector<double> whole_out(whole.out.begin(), whole.out.end());
  expect_close("out/whole", f.out.data(), ldo(d), whole_out.data(), ldo(d), d.Tq, hidden(d),
               r.out_mag);
  expect_lse_close(f.lse, std::vector<double>(whole.lse.begin(), whole.lse.end()));

  // Backward from the single-block forward, so both backward paths see the same lse and delta.
  const Grads g = run_backward_blocks(p, whole, kb, zero_grads(d).dq);
  check_backward(p, g, r);
  Grads whole_g = zero_grads(d);
  run_backward(p, whole, whole_g);
  expect_grads_match(g, whole_g, d, r);
}

// Cut points of `n` blocks of [0, len) with one block of length 1 when n > 1 and len allows.
std::vector<int> cuts_with_single(int len, int n, std::mt19937& rng) {
  std::vector<int> c = cuts(len, n, rng);
  if (n > 1 && len >= n + 1) {
    const int b = std::uniform_int_distribution<int>(0, n - 1)(rng);
    // Make block b one key long by moving its end (or, for the last block, its start).
    if (b + 1 < n && c[b] + 1 < c[b + 2]) c[b + 1] = c[b] + 1;
    else if (b + 1 == n && c[n] - 1 > c[n - 2]) c[n - 1] = c[n] - 1;
  }
  return c;
}

TEST(AttentionBlocks, KeysInBlocksEqualReferenceAndOneCall) {
  std::mt19937 rng(16);
  for (int n : {1, 2, 3, 4, 5}) {
    // A subsequence against its past (a KV cache from 0) and its own keys.
    check_blocks(make_problem(dims(257, 700, 2, 64, 443, 0), rng), cuts_with_single(700, n, rng));
    // Plain causal, keys running past the queries, and a block that no query sees.
    check_blocks(make_problem(dims(130, 300, 3, 40, 100, 0), rng), cuts_with_single(300, n, rng));
  }
  // Blocks of exactly one key each, and tile-sized blocks.
  check_blocks(make_problem(dims(67, 5, 2, 64, 3, 0), rng), {0, 1, 2, 3, 4, 5});
  check_blocks(make_problem(dims(300, 556, 2, 64, 256, 0), rng), {0, 128, 256, 300, 556});
}

TEST(AttentionBlocks, RandomBlocksAndStrides) {
  std::mt19937 rng(17);
  std::uniform_int_distribution<int> length(1, 400), offset(0, 700), head(0, 3), heads(1, 4),
      nblocks(1, 5);
  const int head_sizes[] = {16, 40, 64, 72};
  for (int trial = 0; trial < 16; ++trial) {
    const int Tq = length(rng), Tk = length(rng) + 5;
    const i64 q_pos0 = offset(rng);
    const i64 k_pos0 =
        std::uniform_int_distribution<i64>(std::max<i64>(0, q_pos0 - Tk - 64), q_pos0 + Tq)(rng);
    AttnDims d = dims(Tq, Tk, heads(rng), head_sizes[head(rng)], q_pos0, k_pos0);
    if (trial % 2 == 1) {
      d.ldq = d.ldk = d.ldv = 3 * hidden(d);
      d.ldo = hidden(d) + 16;
    }
    check_blocks(make_problem(d, rng), cuts_with_single(Tk, nblocks(rng), rng));
  }
}

TEST(AttentionBlocks, BackwardAccumulatesAndLeavesPaddingUntouched) {
  std::mt19937 rng(18);
  AttnDims d = dims(130, 400, 2, 64, 270, 0);
  d.ldq = d.ldk = d.ldv = 3 * hidden(d);
  const Problem p = make_problem(d, rng);
  const std::vector<int> c = {0, 1, 150, 270, 400};
  // Forward padding columns stay untouched (check_forward), gradients accumulate.
  KeyBlocks kb = split_keys(p, c, kSentinel);
  const Forward f = run_forward_blocks(p, kb);
  check_forward(p, f, reference(p));
  const Grads g =
      run_backward_blocks(p, f, kb, std::vector<float>(std::size_t(d.Tq) * d.ldq, kSentinel));
  const int H = hidden(d);
  expect_untouched("dq", g.dq, d.Tq, d.ldq, H, d.ldq, kSentinel);
  expect_untouched("dk", g.dk, d.Tk, d.ldk, H, d.ldk, kSentinel);
  expect_untouched("dv", g.dv, d.Tk, d.ldv, H, d.ldv, kSentinel);
  KeyBlocks zero = split_keys(p, c);
  const Grads g0 = run_backward_blocks(p, f, zero, zero_grads(d).dq);
  long bad = 0;
  for (const auto& [acc, fresh] : {std::pair{&g.dq, &g0.dq}, std::pair{&g.dk, &g0.dk},
                                   std::pair{&g.dv, &g0.dv}})
    for (std::size_t i = 0; i < acc->size(); ++i)
      if (i % (3 * H) < std::size_t(H) && (*acc)[i] != kSentinel + (*fresh)[i]) ++bad;
  EXPECT_EQ(bad, 0) << "gradients must be added to what the buffers held";
}

TEST(AttentionBlocks, NoVisibleKeysAndNoBlocks) {
  std::mt19937 rng(19);
  const AttnDims d = dims(67, 130, 2, 64, 0, 67);  // every key after the last query
  const Problem p = make_problem(d, rng);
  for (const std::vector<int>& c : {std::vector<int>{0, 130}, std::vector<int>{0, 1, 60, 130}}) {
    KeyBlocks kb = split_keys(p, c);
    const Forward f = run_forward_blocks(p, kb);
    for (float x : f.lse) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());
    for (int t = 0; t < d.Tq; ++t)
      for (int col = 0; col < hidden(d); ++col)
        EXPECT_EQ(f.out[std::size_t(t) * ldo(d) + col], 0.0f);
    const Grads g = run_backward_blocks(p, f, kb, zero_grads(d).dq);
    for (const auto* buf : {&g.dq, &g.dk, &g.dv})
      for (float x : *buf) EXPECT_EQ(x, 0.0f);
  }
  KeyBlocks none;
  const Forward f = run_forward_blocks(p, none);
  for (float x : f.lse) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());
  std::vector<float> dq(std::size_t(d.Tq) * ldq(d), 1.0f);
  const std::vector<float> delta(std::size_t(d.Z) * d.Tq, 0.0f);
  attention_backward_blocks(dq.data(), p.dout.data(), p.q.data(), none.blocks, f.lse.data(),
                            delta.data(), d);
  for (float x : dq) EXPECT_EQ(x, 1.0f);
}

// Same inputs, same thread count: bit-identical, both backward layouts of Note [Deterministic
// backward] included; any thread count matches the reference.
TEST(AttentionBlocks, RepeatedRunsAreBitIdenticalAtAnyThreadCount) {
  std::mt19937 rng(20);
  const int saved = omp_get_max_threads();
  for (int Z : {1, 2, 3, 6}) {
    const Problem p = make_problem(dims(333, 900, Z, 64, 567, 0), rng);
    const std::vector<int> c = cuts_with_single(900, 5, rng);
    const Reference r = reference(p);
    for (int threads : {1, 2, 3, 7}) {
      SCOPED_TRACE("Z " + std::to_string(Z) + " threads " + std::to_string(threads));
      omp_set_num_threads(threads);
      KeyBlocks kb1 = split_keys(p, c), kb2 = split_keys(p, c);
      const Forward f1 = run_forward_blocks(p, kb1), f2 = run_forward_blocks(p, kb2);
      EXPECT_EQ(0, std::memcmp(f1.out.data(), f2.out.data(), f1.out.size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(f1.lse.data(), f2.lse.data(), f1.lse.size() * sizeof(float)));
      const Grads g1 = run_backward_blocks(p, f1, kb1, zero_grads(p.d).dq);
      const Grads g2 = run_backward_blocks(p, f1, kb2, zero_grads(p.d).dq);
      EXPECT_EQ(0, std::memcmp(g1.dq.data(), g2.dq.data(), g1.dq.size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(g1.dk.data(), g2.dk.data(), g1.dk.size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(g1.dv.data(), g2.dv.data(), g1.dv.size() * sizeof(float)));
      if (threads == 1 || threads == 7) {
        check_forward(p, f1, r);
        check_backward(p, g1, r);
      }
    }
  }
  omp_set_num_threads(saved);
}

// ---- nothing visible, merge of empty rows, accumulation ----------------------------------
TEST(Attention, KeysEntirelyInTheFuture) {
  std::mt19937 rng(10);
  const AttnDims d = dims(67, 130, 2, 64, 0, 67);  // first key right after the last query
  const Problem p = make_problem(d, rng);

  // A fresh call writes the empty result: out = 0, lse = -inf.
  const Forward f = run_forward(p);
  const Reference r = reference(p);
  check_forward(p, f, r);
  for (float x : f.lse) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());
  for (int t = 0; t < d.Tq; ++t)
    for (int c = 0; c < hidden(d); ++c) EXPECT_EQ(f.out[std::size_t(t) * ldo(d) + c], 0.0f);

  // A merge leaves out and lse exactly as they were.
  std::vector<float> out = randn(std::size_t(d.Tq) * ldo(d), rng);
  std::vector<float> lse = randn(std::size_t(d.Z) * d.Tq, rng);
  const std::vector<float> out0 = out, lse0 = lse;
  attention_forward(out.data(), lse.data(), p.q.data(), p.k.data(), p.v.data(), d, true);
  EXPECT_EQ(0, std::memcmp(out.data(), out0.data(), out.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(lse.data(), lse0.data(), lse.size() * sizeof(float)));

  // The backward writes nothing.
  Grads g{randn(std::size_t(d.Tq) * ldq(d), rng), randn(std::size_t(d.Tk) * ldk(d), rng),
          randn(std::size_t(d.Tk) * ldv(d), rng)};
  const Grads g0 = g;
  const std::vector<float> fin_lse = randn(std::size_t(d.Z) * d.Tq, rng);
  const std::vector<float> delta = randn(fin_lse.size(), rng);
  attention_backward(g.dq.data(), g.dk.data(), g.dv.data(), p.dout.data(), p.q.data(), p.k.data(),
                     p.v.data(), fin_lse.data(), delta.data(), d);
  EXPECT_EQ(0, std::memcmp(g.dq.data(), g0.dq.data(), g.dq.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(g.dk.data(), g0.dk.data(), g.dk.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(g.dv.data(), g0.dv.data(), g.dv.size() * sizeof(float)));
}

TEST(Attention, MergeLeavesRowsWithoutVisibleKeysUntouched) {
  std::mt19937 rng(11);
  // Queries at 100..229, keys at 150..406: rows 0..49 see no key of this block.
  const AttnDims d = dims(130, 257, 2, 64, 100, 150);
  const Problem p = make_problem(d, rng);
  std::vector<float> out = randn(std::size_t(d.Tq) * ldo(d), rng);
  std::vector<float> lse = randn(std::size_t(d.Z) * d.Tq, rng);
  const std::vector<float> out0 = out, lse0 = lse;
  attention_forward(out.data(), lse.data(), p.q.data(), p.k.data(), p.v.data(), d, true);
  const int blind = 50;
  EXPECT_EQ(0, std::memcmp(out.data(), out0.data(), std::size_t(blind) * ldo(d) * sizeof(float)));
  for (int z = 0; z < d.Z; ++z)
    for (int t = 0; t < d.Tq; ++t) {
      const float now = lse[std::size_t(z) * d.Tq + t], before = lse0[std::size_t(z) * d.Tq + t];
      if (t < blind)
        EXPECT_EQ(0, std::memcmp(&now, &before, sizeof now)) << "row " << t;
      else
        EXPECT_GT(now, before) << "row " << t << " saw new keys, its lse must grow";
    }
}

TEST(Attention, BackwardAccumulatesIntoExistingGradients) {
  std::mt19937 rng(12);
  const Problem p = make_problem(dims(130, 197, 2, 64, 67, 0), rng);
  const Reference r = reference(p);
  const Forward f = run_forward(p);
  Grads g{randn(std::size_t(p.d.Tq) * ldq(p.d), rng), randn(std::size_t(p.d.Tk) * ldk(p.d), rng),
          randn(std::size_t(p.d.Tk) * ldv(p.d), rng)};
  Reference want = r;
  for (std::size_t i = 0; i < g.dq.size(); ++i) want.dq[i] += g.dq[i];
  for (std::size_t i = 0; i < g.dk.size(); ++i) want.dk[i] += g.dk[i];
  for (std::size_t i = 0; i < g.dv.size(); ++i) want.dv[i] += g.dv[i];
  run_backward(p, f, g);
  check_backward(p, g, want);
}

// ---- threads --------------------------------------------------------------------------
// Same inputs, same thread count: bit-identical results, run after run. Covers both backward
// layouts of Note [Deterministic backward] (one task per head, and key tiles of a head split
// across tasks with partial dq).
TEST(Attention, RepeatedRunsAreBitIdentical) {
  std::mt19937 rng(13);
  const int saved = omp_get_max_threads();
  for (int threads : {2, 3}) {
    omp_set_num_threads(threads);
    for (int Z : {1, 3, 6}) {
      const Problem p = make_problem(dims(333, 333, Z, 64, 0, 0), rng);
      const Forward f1 = run_forward(p), f2 = run_forward(p);
      EXPECT_EQ(0, std::memcmp(f1.out.data(), f2.out.data(), f1.out.size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(f1.lse.data(), f2.lse.data(), f1.lse.size() * sizeof(float)));
      Grads g1 = zero_grads(p.d), g2 = zero_grads(p.d);
      run_backward(p, f1, g1);
      run_backward(p, f1, g2);
      EXPECT_EQ(0, std::memcmp(g1.dq.data(), g2.dq.data(), g1.dq.size() * sizeof(float)))
          << "threads " << threads << " Z " << Z;
      EXPECT_EQ(0, std::memcmp(g1.dk.data(), g2.dk.data(), g1.dk.size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(g1.dv.data(), g2.dv.data(), g1.dv.size() * sizeof(float)));
    }
  }
  omp_set_num_threads(saved);
}

// Any thread count gives the reference result (the dq partials of a split head included).
TEST(Attention, AnyThreadCountMatchesReference) {
  std::mt19937 rng(14);
  const int saved = omp_get_max_threads();
  const Problem p = make_problem(dims(257, 300, 3, 64, 43, 0), rng);
  const Reference r = reference(p);
  for (int threads : {1, 2, 4, 7}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    std::printf("  threads %d\n", threads);
    omp_set_num_threads(threads);
    const Forward f = run_forward(p);
    check_forward(p, f, r);
    Grads g = zero_grads(p.d);
    run_backward(p, f, g);
    check_backward(p, g, r);
  }
  omp_set_num_threads(saved);
}

// ---- grouped-query attention ------------------------------------------------------------
// Z query heads over Zkv key/value heads, query head z reading head z / (Z / Zkv): both forms
// against the float64 reference at thread counts that take both backward layouts of Note
// [Deterministic backward] (a key/value head's key tiles in one task, or dealt to several),
// with offsets, several key blocks, and q, k, v as parts of one fused [T, (Z + 2 Zkv) A] row.
AttnDims grouped(AttnDims d, int Zkv) {
  d.Zkv = Zkv;
  return d;
}

TEST(AttentionGqa, OneCallAgainstReference) {
  std::mt19937 rng(30);
  const int saved = omp_get_max_threads();
  for (int Zkv : {2, 1})
    for (int threads : {1, 2, 3}) {
      std::printf("  threads %d\n", threads);
      omp_set_num_threads(threads);
      // Keys reaching back before the queries, and keys starting after the first query.
      check_problem(make_problem(grouped(dims(257, 400, 4, 64, 300, 0), Zkv), rng));
      check_problem(make_problem(grouped(dims(130, 257, 4, 40, 100, 150), Zkv), rng));
    }
  omp_set_num_threads(saved);
}

TEST(AttentionGqa, KeyBlocksAgainstReferenceAndOneCall) {
  std::mt19937 rng(31);
  const int saved = omp_get_max_threads();
  for (int Zkv : {2, 1})
    for (int threads : {1, 2, 3}) {
      std::printf("  threads %d\n", threads);
      omp_set_num_threads(threads);
      // A subsequence against its KV cache and its own keys.
      check_blocks(make_problem(grouped(dims(257, 700, 4, 64, 443, 0), Zkv), rng),
                   cuts_with_single(700, 4, rng));
      // The fused q/k/v projection's output: q, k, v at the same row stride; out padded.
      AttnDims d = grouped(dims(200, 333, 4, 64, 133, 0), Zkv);
      d.ldq = d.ldk = d.ldv = hidden(d) + 2 * kv_hidden(d);
      d.ldo = hidden(d) + 16;
      check_blocks(make_problem(d, rng), cuts_with_single(333, 3, rng));
    }
  omp_set_num_threads(saved);
}

// Ring attention's forms: key blocks merged in the forward, gradients summed over block pairs.
TEST(AttentionGqa, SplitAndMergedBlocks) {
  std::mt19937 rng(32);
  for (int Zkv : {2, 1}) {
    check_split(make_problem(grouped(dims(200, 333, 4, 64, 133, 0), Zkv), rng), 2, 3, rng);
    check_separate_merge(make_problem(grouped(dims(130, 300, 4, 64, 100, 50), Zkv), rng), 4, rng);
  }
}

TEST(AttentionGqa, BackwardAccumulatesAndLeavesPaddingUntouched) {
  std::mt19937 rng(33);
  AttnDims d = grouped(dims(130, 400, 4, 64, 270, 0), 2);
  const int H = hidden(d), Hkv = kv_hidden(d);
  d.ldq = d.ldk = d.ldv = H + 2 * Hkv;
  const Problem p = make_problem(d, rng);
  const std::vector<int> c = {0, 1, 150, 270, 400};
  KeyBlocks kb = split_keys(p, c, kSentinel);
  const Forward f = run_forward_blocks(p, kb);
  check_forward(p, f, reference(p));
  const Grads g =
      run_backward_blocks(p, f, kb, std::vector<float>(std::size_t(d.Tq) * d.ldq, kSentinel));
  expect_untouched("dq", g.dq, d.Tq, d.ldq, H, d.ldq, kSentinel);
  expect_untouched("dk", g.dk, d.Tk, d.ldk, Hkv, d.ldk, kSentinel);
  expect_untouched("dv", g.dv, d.Tk, d.ldv, Hkv, d.ldv, kSentinel);
  // dq is added to once per element; a key tile's dk and dv once per query head of the group
  // (Note [Deterministic backward]), so up to Z / Zkv roundings at the size of what they held.
  KeyBlocks zero = split_keys(p, c);
  const Grads g0 = run_backward_blocks(p, f, zero, zero_grads(d).dq);
  const double share = d.Z / d.Zkv, eps = std::numeric_limits<float>::epsilon();
  long bad = 0;
  for (const auto& [acc, fresh, width, adds] :
       {std::tuple{&g.dq, &g0.dq, H, 1.0}, std::tuple{&g.dk, &g0.dk, Hkv, share},
        std::tuple{&g.dv, &g0.dv, Hkv, share}})
    for (std::size_t i = 0; i < acc->size(); ++i) {
      if (i % d.ldq >= std::size_t(width)) continue;
      const double want = double(kSentinel) + (*fresh)[i];
      const double tol = adds == 1.0 ? 0.0 : adds * eps * (std::abs(want) + std::abs((*fresh)[i]));
      if (!(std::abs((*acc)[i] - want) <= tol) && (*acc)[i] != kSentinel + (*fresh)[i]) ++bad;
    }
  EXPECT_EQ(bad, 0) << "gradients must be added to what the buffers held";
}

// Same inputs, same thread count: bit-identical, although several tasks' query heads share a
// key/value head (each (key/value head, key tile) has one owner that runs the heads in order).
TEST(AttentionGqa, RepeatedRunsAreBitIdentical) {
  std::mt19937 rng(34);
  const int saved = omp_get_max_threads();
  for (int Zkv : {1, 2}) {
    const Problem p = make_problem(grouped(dims(333, 900, 4, 64, 567, 0), Zkv), rng);
    const std::vector<int> c = cuts_with_single(900, 5, rng);
    for (int threads : {1, 2, 3, 7}) {
      SCOPED_TRACE("Zkv " + std::to_string(Zkv) + " threads " + std::to_string(threads));
      omp_set_num_threads(threads);
      KeyBlocks kb1 = split_keys(p, c), kb2 = split_keys(p, c);
      const Forward f1 = run_forward_blocks(p, kb1), f2 = run_forward_blocks(p, kb2);
      EXPECT_EQ(0, std::memcmp(f1.out.data(), f2.out.data(), f1.out.size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(f1.lse.data(), f2.lse.data(), f1.lse.size() * sizeof(float)));
      const Grads g1 = run_backward_blocks(p, f1, kb1, zero_grads(p.d).dq);
      const Grads g2 = run_backward_blocks(p, f1, kb2, zero_grads(p.d).dq);
      EXPECT_EQ(0, std::memcmp(g1.dq.data(), g2.dq.data(), g1.dq.size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(g1.dk.data(), g2.dk.data(), g1.dk.size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(g1.dv.data(), g2.dv.data(), g1.dv.size() * sizeof(float)));
      Grads h1 = zero_grads(p.d), h2 = zero_grads(p.d);
      run_backward(p, f1, h1);
      run_backward(p, f1, h2);
      EXPECT_EQ(0, std::memcmp(h1.dq.data(), h2.dq.data(), h1.dq.size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(h1.dk.data(), h2.dk.data(), h1.dk.size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(h1.dv.data(), h2.dv.data(), h1.dv.size() * sizeof(float)));
    }
  }
  omp_set_num_threads(saved);
}

// Zkv = Z is plain multi-head attention: the same bits as Zkv = 0, in every kernel.
TEST(AttentionGqa, AsManyKeyValueHeadsAsQueryHeadsIsPlainAttention) {
  std::mt19937 rng(35);
  const int saved = omp_get_max_threads();
  for (int Z : {1, 3, 4}) {
    const Problem p0 = make_problem(dims(333, 600, Z, 64, 267, 0), rng);
    Problem pz = p0;
    pz.d.Zkv = Z;
    const std::vector<int> c = cuts_with_single(600, 3, rng);
    const auto same = [](const std::vector<float>& a, const std::vector<float>& b,
                         const char* what) {
      ASSERT_EQ(a.size(), b.size()) << what;
      EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << what;
    };
    for (int threads : {1, 2, 3}) {
      SCOPED_TRACE("Z " + std::to_string(Z) + " threads " + std::to_string(threads));
      omp_set_num_threads(threads);
      const Forward f0 = run_forward(p0), fz = run_forward(pz);
      same(f0.out, fz.out, "out");
      same(f0.lse, fz.lse, "lse");
      Grads g0 = zero_grads(p0.d), gz = zero_grads(pz.d);
      run_backward(p0, f0, g0);
      run_backward(pz, f0, gz);
      same(g0.dq, gz.dq, "dq");
      same(g0.dk, gz.dk, "dk");
      same(g0.dv, gz.dv, "dv");
      KeyBlocks kb0 = split_keys(p0, c), kbz = split_keys(pz, c);
      const Forward b0 = run_forward_blocks(p0, kb0), bz = run_forward_blocks(pz, kbz);
      same(b0.out, bz.out, "blocks out");
      same(b0.lse, bz.lse, "blocks lse");
      const Grads h0 = run_backward_blocks(p0, b0, kb0, zero_grads(p0.d).dq);
      const Grads hz = run_backward_blocks(pz, b0, kbz, zero_grads(pz.d).dq);
      same(h0.dq, hz.dq, "blocks dq");
      same(h0.dk, hz.dk, "blocks dk");
      same(h0.dv, hz.dv, "blocks dv");
    }
  }
  omp_set_num_threads(saved);
}

// The backward's tasks are per key/value head, so its scratch depends on Zkv: a Scratch of
// exactly attention_*_scratch(..., Zkv) bytes (taking more aborts), left dirty, gives the same
// bits as the kernels' own memory.
TEST(AttentionGqa, CallerScratchOfTheStatedSize) {
  std::mt19937 rng(37);
  const int saved = omp_get_max_threads();
  for (int Zkv : {1, 2})
    for (int threads : {1, 2, 3, 7}) {
      SCOPED_TRACE("Zkv " + std::to_string(Zkv) + " threads " + std::to_string(threads));
      omp_set_num_threads(threads);
      const Problem p = make_problem(grouped(dims(300, 700, 4, 64, 400, 0), Zkv), rng);
      const std::vector<int> c = cuts_with_single(700, 3, rng);
      const KernelScratch ks = max(attention_forward_scratch(p.d.A, threads),
                                   attention_backward_scratch(p.d.Z, p.d.A, threads, Zkv));
      const std::size_t bytes = std::size_t(ks.bytes(p.d.Tq));
      std::vector<float> buf((bytes + Scratch::kAlign) / sizeof(float) + 1,
                             std::numeric_limits<float>::quiet_NaN());
      void* base = buf.data();
      std::size_t space = buf.size() * sizeof(float);
      ASSERT_NE(std::align(Scratch::kAlign, bytes, base, space), nullptr);
      Scratch scratch(base, bytes);
      KeyBlocks kb = split_keys(p, c), kb_own = split_keys(p, c);
      Forward f;
      f.out.assign(std::size_t(p.d.Tq) * ldo(p.d), kSentinel);
      f.lse.assign(std::size_t(p.d.Z) * p.d.Tq, kSentinel);
      attention_forward_blocks(f.out.data(), f.lse.data(), p.q.data(), kb.blocks, p.d, &scratch);
      scratch.reset();
      const Forward f_own = run_forward_blocks(p, kb_own);
      EXPECT_EQ(0, std::memcmp(f.out.data(), f_own.out.data(), f.out.size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(f.lse.data(), f_own.lse.data(), f.lse.size() * sizeof(float)));
      const std::vector<float> delta = run_delta(p, f_own);
      std::vector<float> dq = zero_grads(p.d).dq;
      attention_backward_blocks(dq.data(), p.dout.data(), p.q.data(), kb.blocks, f_own.lse.data(),
                                delta.data(), p.d, &scratch);
      const Grads own = run_backward_blocks(p, f_own, kb_own, zero_grads(p.d).dq);
      EXPECT_EQ(0, std::memcmp(dq.data(), own.dq.data(), dq.size() * sizeof(float)));
      for (std::size_t b = 0; b < kb.dk.size(); ++b) {
        const std::size_t n = kb.dk[b].size() * sizeof(float);
        EXPECT_EQ(0, std::memcmp(kb.dk[b].data(), kb_own.dk[b].data(), n)) << "dk block " << b;
        EXPECT_EQ(0, std::memcmp(kb.dv[b].data(), kb_own.dv[b].data(), n)) << "dv block " << b;
      }
    }
  omp_set_num_threads(saved);
}

TEST(AttentionGqa, RefusesKeyValueHeadsThatDoNotDivideTheHeads) {
  std::mt19937 rng(36);
  for (int Zkv : {3, 5, -1}) {
    AttnDims d = dims(8, 8, 4, 16, 0, 0);
    const Problem p = make_problem(d, rng);
    d.Zkv = Zkv;
    std::vector<float> out(std::size_t(d.Tq) * hidden(d)), lse(std::size_t(d.Z) * d.Tq);
    EXPECT_ANY_THROW(attention_forward(out.data(), lse.data(), p.q.data(), p.k.data(), p.v.data(),
                                       d, false))
        << "Zkv " << Zkv;
  }
}

}  // namespace
}  // namespace sppo::cpu
