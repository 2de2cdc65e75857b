// Numerics of the CPU kernels of kernels/ops.h (docs/design.md, Conventions 7): every
// kernel against a deliberately naive float64 reference written here, element-wise
// |got - ref| <= atol + rtol |ref| plus a norm-relative bound, on fresh random inputs and
// odd shapes; backward kernels also against central finite differences of a float64
// forward; accumulation (+=) and overwrite (=) semantics checked from non-zero starts;
// reductions checked for the same bits under different thread counts.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/check.h"
#include "core/config.h"
#include "core/rope.h"
#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/ops.h"

namespace sppo::cpu {
namespace {

using Vec = std::vector<float>;
using DVec = std::vector<double>;
using Ids = std::vector<std::int32_t>;

constexpr double kRtol = 1e-5;   // fp32 element-wise
constexpr double kNormTol = 1e-5;  // fp32 norm-relative
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

Vec randn(std::size_t n, std::mt19937& rng, float scale = 1.0f, float shift = 0.0f) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  Vec v(n);
  for (float& x : v) x = shift + scale * dist(rng);
  return v;
}

Ids rand_ids(std::size_t n, int V, std::mt19937& rng) {
  std::uniform_int_distribution<std::int32_t> dist(0, V - 1);
  Ids ids(n);
  for (auto& id : ids) id = dist(rng);
  return ids;
}

DVec to_double(const Vec& v) { return DVec(v.begin(), v.end()); }

// |got - ref| <= atol + rtol |ref| element-wise, and ||got - ref|| <= norm_tol ||ref||.
void expect_close(const Vec& got, const DVec& ref, double atol, double rtol,
                  const std::string& what, double norm_tol = kNormTol) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  std::size_t bad = 0;
  double err2 = 0.0, ref2 = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double d = static_cast<double>(got[i]) - ref[i];
    err2 += d * d;
    ref2 += ref[i] * ref[i];
    if (!(std::fabs(d) <= atol + rtol * std::fabs(ref[i]))) {
      if (bad < 5) ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << ref[i];
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " out of tolerance";
  if (ref2 > 0.0) {
    EXPECT_LT(std::sqrt(err2 / ref2), norm_tol) << what;
  }
}

// Sets the OpenMP thread count for a scope.
class ThreadCount {
 public:
  explicit ThreadCount(int n) : saved_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~ThreadCount() { omp_set_num_threads(saved_); }
  ThreadCount(const ThreadCount&) = delete;
  ThreadCount& operator=(const ThreadCount&) = delete;

 private:
  int saved_;
};

// d/dx_i of f at x, central differences in double.
DVec finite_diff(const std::function<double(const DVec&)>& f, DVec x, double h) {
  DVec grad(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double fp = f(x);
    x[i] = x0 - h;
    const double fm = f(x);
    x[i] = x0;
    grad[i] = (fp - fm) / (2.0 * h);
  }
  return grad;
}

double dot(const DVec& a, const DVec& b) {
  double s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// ---- GEMM -----------------------------------------------------------------------------

TEST(Gemm, AllTransposesWithRowStrides) {
  std::mt19937 rng(101);
  struct Shape { int M, N, K; };
  for (Shape sh : {Shape{5, 7, 9}, Shape{1, 3, 1}, Shape{37, 41, 131}}) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        const int M = sh.M, N = sh.N, K = sh.K;
        const int a_rows = ta ? K : M, a_cols = ta ? M : K;
        const int b_rows = tb ? N : K, b_cols = tb ? K : N;
        const int lda = a_cols + 3, ldb = b_cols + 2, ldc = N + 5;
        const Vec a = randn(static_cast<std::size_t>(a_rows) * lda, rng);
        const Vec b = randn(static_cast<std::size_t>(b_rows) * ldb, rng);
        Vec c = randn(static_cast<std::size_t>(M) * ldc, rng);
        const float alpha = 0.75f, beta = -0.5f;
        DVec ref = to_double(c);  // the padding columns must stay as they are
        for (int i = 0; i < M; ++i) {
          for (int j = 0; j < N; ++j) {
            double s = 0.0;
            for (int k = 0; k < K; ++k) {
              const double aik = ta ? a[k * lda + i] : a[i * lda + k];
              const double bkj = tb ? b[j * ldb + k] : b[k * ldb + j];
              s += aik * bkj;
            }
            ref[i * ldc + j] = alpha * s + beta * static_cast<double>(c[i * ldc + j]);
          }
        }
        gemm(ta, tb, M, N, K, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);
        expect_close(c, ref, 2e-6 * std::sqrt(K), kRtol,
                     "gemm ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) +
                         " K=" + std::to_string(K));
      }
    }
  }
}

// ---- linear ---------------------------------------------------------------------------

TEST(Linear, ForwardWithAndWithoutBiasAndStrides) {
  std::mt19937 rng(102);
  const int I = 24, O = 40;
  for (int T : {1, 3, 17}) {
    for (bool bias : {false, true}) {
      for (bool strided : {false, true}) {
        const int ld_in = strided ? I + 8 : I, ld_out = strided ? O + 3 : O;
        const Vec in = randn(static_cast<std::size_t>(T) * ld_in, rng);
        const Vec w = randn(static_cast<std::size_t>(O) * I, rng);
        const Vec b = randn(O, rng);
        // Garbage in the output (overwritten) and a sentinel in its padding (untouched).
        Vec out(static_cast<std::size_t>(T) * ld_out, 7.25f);
        for (int t = 0; t < T; ++t)
          for (int o = 0; o < O; ++o) out[t * ld_out + o] = kNaN;
        DVec ref = to_double(out);
        for (int t = 0; t < T; ++t) {
          for (int o = 0; o < O; ++o) {
            double s = bias ? b[o] : 0.0;
            for (int i = 0; i < I; ++i) s += static_cast<double>(in[t * ld_in + i]) * w[o * I + i];
            ref[t * ld_out + o] = s;
          }
        }
        linear_forward(out.data(), in.data(), w.data(), bias ? b.data() : nullptr, T, I, O,
                       strided ? ld_out : 0, strided ? ld_in : 0);
        expect_close(out, ref, 1e-5, kRtol,
                     "linear_forward T=" + std::to_string(T) + " bias=" + std::to_string(bias) +
                         " strided=" + std::to_string(strided));
      }
    }
  }
}

struct LinearGrads {
  Vec din, dw, db;
};

LinearGrads run_linear_backward(const Vec& dout, const Vec& in, const Vec& w, const Vec& dw0,
                                const Vec& db0, int T, int I, int O, int ld_dout, int ld_in) {
  LinearGrads g{Vec(static_cast<std::size_t>(T) * I, kNaN), dw0, db0};
  linear_backward(g.din.data(), g.dw.data(), g.db.data(), dout.data(), in.data(), w.data(), T, I,
                  O, ld_dout, ld_in);
  return g;
}

TEST(Linear, BackwardOverwritesDinAccumulatesDwDb) {
  std::mt19937 rng(103);
  const int I = 24, O = 40;
  for (int T : {1, 3, 300}) {  // 300 rows: more than one block of the bias reduction
    const int ld_dout = O + 7, ld_in = I + 3;
    const Vec dout = randn(static_cast<std::size_t>(T) * ld_dout, rng);
    const Vec in = randn(static_cast<std::size_t>(T) * ld_in, rng);
    const Vec w = randn(static_cast<std::size_t>(O) * I, rng);
    const Vec dw0 = randn(static_cast<std::size_t>(O) * I, rng);
    const Vec db0 = randn(O, rng);
    DVec din_ref(static_cast<std::size_t>(T) * I), dw_ref = to_double(dw0), db_ref = to_double(db0);
    for (int t = 0; t < T; ++t) {
      for (int i = 0; i < I; ++i) {
        double s = 0.0;
        for (int o = 0; o < O; ++o) s += static_cast<double>(dout[t * ld_dout + o]) * w[o * I + i];
        din_ref[t * I + i] = s;
      }
    }
    for (int o = 0; o < O; ++o) {
      for (int t = 0; t < T; ++t) {
        db_ref[o] += dout[t * ld_dout + o];
        for (int i = 0; i < I; ++i)
          dw_ref[o * I + i] += static_cast<double>(dout[t * ld_dout + o]) * in[t * ld_in + i];
      }
    }
    const std::string name = "linear_backward T=" + std::to_string(T);
    const double atol = 2e-6 * std::sqrt(T);
    const LinearGrads g = run_linear_backward(dout, in, w, dw0, db0, T, I, O, ld_dout, ld_in);
    expect_close(g.din, din_ref, 1e-5, kRtol, name + " din");
    expect_close(g.dw, dw_ref, atol, kRtol, name + " dw");
    expect_close(g.db, db_ref, atol, kRtol, name + " db");

    // din == nullptr skips the input gradient only.
    Vec dw = dw0, db = db0;
    linear_backward(nullptr, dw.data(), db.data(), dout.data(), in.data(), w.data(), T, I, O,
                    ld_dout, ld_in);
    expect_close(dw, dw_ref, atol, kRtol, name + " dw (no din)");
    expect_close(db, db_ref, atol, kRtol, name + " db (no din)");
  }
}

TEST(Linear, BiasGradientSameBitsForAnyThreadCount) {
  std::mt19937 rng(104);
  const int T = 1000, I = 16, O = 40;
  const Vec dout = randn(static_cast<std::size_t>(T) * O, rng);
  const Vec in = randn(static_cast<std::size_t>(T) * I, rng);
  const Vec w = randn(static_cast<std::size_t>(O) * I, rng);
  const Vec dw0 = randn(static_cast<std::size_t>(O) * I, rng);
  const Vec db0 = randn(O, rng);
  LinearGrads one, two;
  {
    ThreadCount tc(1);
    one = run_linear_backward(dout, in, w, dw0, db0, T, I, O, 0, 0);
  }
  {
    ThreadCount tc(2);
    two = run_linear_backward(dout, in, w, dw0, db0, T, I, O, 0, 0);
  }
  EXPECT_EQ(one.db, two.db);
}

// ---- embedding ------------------------------------------------------------------------

TEST(Embedding, ForwardGathersBackwardScatterAccumulates) {
  std::mt19937 rng(105);
  const int V = 11;
  for (int H : {24, 40}) {
    for (int T : {1, 3, 37}) {  // 37 tokens over 11 ids: repeated ids
      const Ids ids = rand_ids(T, V, rng);
      const Vec embed = randn(static_cast<std::size_t>(V) * H, rng);
      Vec out(static_cast<std::size_t>(T) * H, kNaN);
      embedding_forward(out.data(), ids.data(), embed.data(), T, H);
      DVec out_ref(out.size());
      for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h) out_ref[t * H + h] = embed[ids[t] * H + h];
      const std::string name = "embedding H=" + std::to_string(H) + " T=" + std::to_string(T);
      expect_close(out, out_ref, 0.0, 0.0, name + " forward");

      const Vec dout = randn(static_cast<std::size_t>(T) * H, rng);
      Vec dembed = randn(static_cast<std::size_t>(V) * H, rng);
      DVec ref = to_double(dembed);
      for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h) ref[ids[t] * H + h] += dout[t * H + h];
      embedding_backward(dembed.data(), dout.data(), ids.data(), T, H, V);
      expect_close(dembed, ref, 1e-6, kRtol, name + " backward");
    }
  }
}

TEST(Embedding, BackwardSameBitsForAnyThreadCount) {
  std::mt19937 rng(106);
  const int V = 7, H = 40, T = 3000;
  const Ids ids = rand_ids(T, V, rng);
  const Vec dout = randn(static_cast<std::size_t>(T) * H, rng);
  const Vec dembed0 = randn(static_cast<std::size_t>(V) * H, rng);
  Vec one = dembed0, two = dembed0;
  {
    ThreadCount tc(1);
    embedding_backward(one.data(), dout.data(), ids.data(), T, H, V);
  }
  {
    ThreadCount tc(2);
    embedding_backward(two.data(), dout.data(), ids.data(), T, H, V);
  }
  EXPECT_EQ(one, two);
  EXPECT_NE(one, dembed0);
}

TEST(Embedding, BackwardRejectsIdsOutsideVocabulary) {
  const int V = 5, H = 8;
  Vec dembed(static_cast<std::size_t>(V) * H, 0.0f);
  const Vec dout(2 * H, 1.0f);
  for (std::int32_t bad : {-1, V}) {
    const Ids ids = {0, bad};
    EXPECT_THROW(embedding_backward(dembed.data(), dout.data(), ids.data(), 2, H, V), Error);
  }
}

// ---- vocabulary-parallel embedding ----------------------------------------------------

// Starts of `parts` shards of a V-row vocabulary, and V: shard p is [s[p], s[p + 1]), uneven
// when parts does not divide V (37 over 3: 13, 12, 12; over 2: 19, 18).
std::vector<int> shard_starts(int V, int parts) {
  std::vector<int> s(static_cast<std::size_t>(parts) + 1);
  for (int p = 0; p <= parts; ++p) s[p] = (p * V + parts - 1) / parts;
  return s;
}

TEST(EmbeddingShard, ForwardsSumToTheLookupBackwardsAreTheFullRows) {
  std::mt19937 rng(121);
  const int V = 37, H = 24;
  for (int parts : {2, 3}) {
    const std::vector<int> starts = shard_starts(V, parts);
    for (int T : {7, 61, 2000}) {  // 2000 x 24: the multi-threaded column bands
      const std::string name = "embedding shard parts=" + std::to_string(parts) + " T=" + std::to_string(T);
      // Every shard's first and last row, a repeated id, the rest random (and repeated).
      Ids ids = rand_ids(T, V, rng);
      for (int p = 0; p < parts; ++p) {
        ids[2 * p] = starts[p];
        ids[2 * p + 1] = starts[p + 1] - 1;
      }
      ids[T - 1] = ids[1];
      const Vec embed = randn(static_cast<std::size_t>(V) * H, rng);
      const Vec dout = randn(static_cast<std::size_t>(T) * H, rng);
      const Vec dembed0 = randn(static_cast<std::size_t>(V) * H, rng);
      DVec lookup(static_cast<std::size_t>(T) * H);
      DVec full_ref = to_double(dembed0);  // the full backward, from a non-zero start
      for (int t = 0; t < T; ++t) {
        for (int h = 0; h < H; ++h) {
          lookup[t * H + h] = embed[ids[t] * H + h];
          full_ref[ids[t] * H + h] += dout[t * H + h];
        }
      }
      Vec full = dembed0;
      embedding_backward(full.data(), dout.data(), ids.data(), T, H, V);
      DVec sum(static_cast<std::size_t>(T) * H, 0.0);
      for (int p = 0; p < parts; ++p) {
        const int v0 = starts[p], Vr = starts[p + 1] - starts[p];
        const std::string pn = name + " shard " + std::to_string(p);
        const Vec shard_embed(embed.begin() + v0 * H, embed.begin() + (v0 + Vr) * H);
        Vec out(static_cast<std::size_t>(T) * H, kNaN);
        embedding_shard_forward(out.data(), ids.data(), shard_embed.data(), T, H, v0, Vr);
        DVec out_ref(out.size(), 0.0);
        for (int t = 0; t < T; ++t) {
          if (ids[t] < v0 || ids[t] >= v0 + Vr) continue;
          for (int h = 0; h < H; ++h) out_ref[t * H + h] = embed[ids[t] * H + h];
        }
        expect_close(out, out_ref, 0.0, 0.0, pn + " forward");
        for (std::size_t i = 0; i < out.size(); ++i) sum[i] += out[i];

        Vec dembed(dembed0.begin() + v0 * H, dembed0.begin() + (v0 + Vr) * H);
        embedding_shard_backward(dembed.data(), dout.data(), ids.data(), T, H, v0, Vr);
        const DVec rows_ref(full_ref.begin() + v0 * H, full_ref.begin() + (v0 + Vr) * H);
        // A row adds about T/V unit-size gradients: fp32 rounds every partial sum, so the
        // error grows with their count while cancellation can leave the total small.
        const double sum_atol = std::max(1e-6, 4 * 6e-8 * (T / V + 2));
        expect_close(dembed, rows_ref, sum_atol, kRtol, pn + " backward");
        // The same additions in the same order as the full kernel: the same bits.
        EXPECT_EQ(dembed, Vec(full.begin() + v0 * H, full.begin() + (v0 + Vr) * H)) << pn;
      }
      expect_close(Vec(sum.begin(), sum.end()), lookup, 0.0, 0.0, name + " sum of the shards' forwards");
    }
  }
}

TEST(EmbeddingShard, BackwardRejectsNegativeIds) {
  const int H = 8;
  Vec dembed(static_cast<std::size_t>(4) * H, 0.0f);
  const Vec dout(2 * H, 1.0f);
  const Ids ids = {5, -1};
  EXPECT_THROW(embedding_shard_backward(dembed.data(), dout.data(), ids.data(), 2, H, 4, 4), Error);
}

// ---- LayerNorm ------------------------------------------------------------------------

struct LnRef {
  DVec out, mean, rstd;
};

LnRef layernorm_ref(const DVec& x, const DVec& w, const DVec& b, int T, int H, double eps) {
  LnRef r{DVec(x.size()), DVec(T), DVec(T)};
  for (int t = 0; t < T; ++t) {
    double mu = 0.0;
    for (int h = 0; h < H; ++h) mu += x[t * H + h];
    mu /= H;
    double var = 0.0;
    for (int h = 0; h < H; ++h) var += (x[t * H + h] - mu) * (x[t * H + h] - mu);
    var /= H;
    const double rs = 1.0 / std::sqrt(var + eps);
    for (int h = 0; h < H; ++h) r.out[t * H + h] = (x[t * H + h] - mu) * rs * w[h] + b[h];
    r.mean[t] = mu;
    r.rstd[t] = rs;
  }
  return r;
}

struct LnCase {
  Vec x, w, b, dout, dx0, dw0, db0;
};

LnCase make_ln_case(int T, int H, std::mt19937& rng) {
  const auto n = static_cast<std::size_t>(T) * H;
  return {randn(n, rng, 2.0f, 3.0f), randn(H, rng, 0.5f, 1.0f), randn(H, rng),
          randn(n, rng),             randn(n, rng),             randn(H, rng),
          randn(H, rng)};
}

TEST(LayerNorm, ForwardMatchesFloat64) {
  std::mt19937 rng(107);
  const float eps = 1e-5f;
  for (int H : {24, 40}) {
    for (int T : {1, 3, 33}) {
      const LnCase c = make_ln_case(T, H, rng);
      Vec out(c.x.size(), kNaN), mean(T, kNaN), rstd(T, kNaN);
      layernorm_forward(out.data(), mean.data(), rstd.data(), c.x.data(), c.w.data(), c.b.data(),
                        T, H, eps);
      const LnRef r = layernorm_ref(to_double(c.x), to_double(c.w), to_double(c.b), T, H, eps);
      const std::string name = "layernorm H=" + std::to_string(H) + " T=" + std::to_string(T);
      expect_close(out, r.out, 1e-5, kRtol, name + " out");
      expect_close(mean, r.mean, 1e-6, kRtol, name + " mean");
      expect_close(rstd, r.rstd, 0.0, kRtol, name + " rstd");
    }
  }
}

TEST(LayerNorm, BackwardAccumulatesAndMatchesFloat64) {
  std::mt19937 rng(108);
  const float eps = 1e-5f;
  for (int H : {24, 40}) {
    for (int T : {1, 3, 300}) {  // 300 rows: more than one block of the dw/db reduction
      const LnCase c = make_ln_case(T, H, rng);
      Vec out(c.x.size()), mean(T), rstd(T);
      layernorm_forward(out.data(), mean.data(), rstd.data(), c.x.data(), c.w.data(), c.b.data(),
                        T, H, eps);
      Vec dx = c.dx0, dw = c.dw0, db = c.db0;
      layernorm_backward(dx.data(), dw.data(), db.data(), c.dout.data(), c.x.data(), c.w.data(),
                         mean.data(), rstd.data(), T, H);

      const LnRef r = layernorm_ref(to_double(c.x), to_double(c.w), to_double(c.b), T, H, eps);
      DVec dx_ref = to_double(c.dx0), dw_ref = to_double(c.dw0), db_ref = to_double(c.db0);
      for (int t = 0; t < T; ++t) {
        double mean_g = 0.0, mean_gx = 0.0;
        for (int h = 0; h < H; ++h) {
          const double xhat = (c.x[t * H + h] - r.mean[t]) * r.rstd[t];
          const double g = static_cast<double>(c.dout[t * H + h]) * c.w[h];
          mean_g += g / H;
          mean_gx += g * xhat / H;
          dw_ref[h] += c.dout[t * H + h] * xhat;
          db_ref[h] += c.dout[t * H + h];
        }
        for (int h = 0; h < H; ++h) {
          const double xhat = (c.x[t * H + h] - r.mean[t]) * r.rstd[t];
          const double g = static_cast<double>(c.dout[t * H + h]) * c.w[h];
          dx_ref[t * H + h] += r.rstd[t] * (g - mean_g - xhat * mean_gx);
        }
      }
      const std::string name = "layernorm H=" + std::to_string(H) + " T=" + std::to_string(T);
      const double atol = 2e-6 * std::sqrt(T);
      expect_close(dx, dx_ref, 1e-5, kRtol, name + " dx");
      expect_close(dw, dw_ref, atol, kRtol, name + " dw");
      expect_close(db, db_ref, atol, kRtol, name + " db");
    }
  }
}

TEST(LayerNorm, BackwardMatchesFiniteDifferences) {
  std::mt19937 rng(109);
  const int T = 3, H = 24;
  const float eps = 1e-5f;
  const LnCase c = make_ln_case(T, H, rng);
  Vec out(c.x.size()), mean(T), rstd(T);
  layernorm_forward(out.data(), mean.data(), rstd.data(), c.x.data(), c.w.data(), c.b.data(), T,
                    H, eps);
  Vec dx(c.x.size(), 0.0f), dw(H, 0.0f), db(H, 0.0f);
  layernorm_backward(dx.data(), dw.data(), db.data(), c.dout.data(), c.x.data(), c.w.data(),
                     mean.data(), rstd.data(), T, H);

  // L = sum(dout * layernorm(x, w, b)), differenced in each argument.
  const DVec x = to_double(c.x), w = to_double(c.w), b = to_double(c.b), g = to_double(c.dout);
  const auto loss = [&](const DVec& xx, const DVec& ww, const DVec& bb) {
    return dot(layernorm_ref(xx, ww, bb, T, H, eps).out, g);
  };
  const double h = 1e-6;
  expect_close(dx, finite_diff([&](const DVec& v) { return loss(v, w, b); }, x, h), 1e-5, 1e-4,
               "layernorm dx vs finite differences", 1e-4);
  expect_close(dw, finite_diff([&](const DVec& v) { return loss(x, v, b); }, w, h), 1e-5, 1e-4,
               "layernorm dw vs finite differences", 1e-4);
  expect_close(db, finite_diff([&](const DVec& v) { return loss(x, w, v); }, b, h), 1e-5, 1e-4,
               "layernorm db vs finite differences", 1e-4);
}

TEST(LayerNorm, ParameterGradientsSameBitsForAnyThreadCount) {
  std::mt19937 rng(110);
  const int T = 1000, H = 40;
  const LnCase c = make_ln_case(T, H, rng);
  Vec out(c.x.size()), mean(T), rstd(T);
  layernorm_forward(out.data(), mean.data(), rstd.data(), c.x.data(), c.w.data(), c.b.data(), T,
                    H, 1e-5f);
  auto run = [&](int threads) {
    ThreadCount tc(threads);
    LnCase r = c;
    layernorm_backward(r.dx0.data(), r.dw0.data(), r.db0.data(), c.dout.data(), c.x.data(),
                       c.w.data(), mean.data(), rstd.data(), T, H);
    return r;
  };
  const LnCase one = run(1), two = run(2);
  EXPECT_EQ(one.dw0, two.dw0);
  EXPECT_EQ(one.db0, two.db0);
  EXPECT_EQ(one.dx0, two.dx0);
}

// ---- RMSNorm --------------------------------------------------------------------------

struct RmsRef {
  DVec out, rstd;
};

RmsRef rmsnorm_ref(const DVec& x, const DVec& w, int T, int H, double eps) {
  RmsRef r{DVec(x.size()), DVec(T)};
  for (int t = 0; t < T; ++t) {
    double ms = 0.0;
    for (int h = 0; h < H; ++h) ms += x[t * H + h] * x[t * H + h];
    const double rs = 1.0 / std::sqrt(ms / H + eps);
    for (int h = 0; h < H; ++h) r.out[t * H + h] = x[t * H + h] * rs * w[h];
    r.rstd[t] = rs;
  }
  return r;
}

struct RmsCase {
  Vec x, w, dout, dx0, dw0;
};

// x with a mean far from 0 (RMSNorm does not subtract it) and weights around 1.
RmsCase make_rms_case(int T, int H, std::mt19937& rng) {
  const auto n = static_cast<std::size_t>(T) * H;
  return {randn(n, rng, 2.0f, 1.5f), randn(H, rng, 0.5f, 1.0f), randn(n, rng), randn(n, rng),
          randn(H, rng)};
}

TEST(RmsNorm, ForwardMatchesFloat64) {
  std::mt19937 rng(131);
  const float eps = 1e-6f;
  for (int H : {24, 40}) {
    for (int T : {1, 3, 33}) {
      const RmsCase c = make_rms_case(T, H, rng);
      Vec out(c.x.size(), kNaN), rstd(T, kNaN);
      rmsnorm_forward(out.data(), rstd.data(), c.x.data(), c.w.data(), T, H, eps);
      const RmsRef r = rmsnorm_ref(to_double(c.x), to_double(c.w), T, H, eps);
      const std::string name = "rmsnorm H=" + std::to_string(H) + " T=" + std::to_string(T);
      expect_close(out, r.out, 1e-5, kRtol, name + " out");
      expect_close(rstd, r.rstd, 0.0, kRtol, name + " rstd");
      // Without rstd (not kept): the same output.
      Vec again(c.x.size(), kNaN);
      rmsnorm_forward(again.data(), nullptr, c.x.data(), c.w.data(), T, H, eps);
      EXPECT_EQ(again, out) << name;
    }
  }
}

TEST(RmsNorm, BackwardAccumulatesAndMatchesFloat64) {
  std::mt19937 rng(132);
  const float eps = 1e-6f;
  for (int H : {24, 40}) {
    for (int T : {1, 3, 300}) {  // 300 rows: more than one block of the dw reduction
      const RmsCase c = make_rms_case(T, H, rng);
      Vec out(c.x.size()), rstd(T);
      rmsnorm_forward(out.data(), rstd.data(), c.x.data(), c.w.data(), T, H, eps);
      Vec dx = c.dx0, dw = c.dw0;
      rmsnorm_backward(dx.data(), dw.data(), c.dout.data(), c.x.data(), c.w.data(), rstd.data(),
                       T, H);

      // dx = rstd (g - xhat mean_h(g xhat)), g = dout w, xhat = x rstd; dw = sum_t dout xhat.
      const RmsRef r = rmsnorm_ref(to_double(c.x), to_double(c.w), T, H, eps);
      DVec dx_ref = to_double(c.dx0), dw_ref = to_double(c.dw0);
      for (int t = 0; t < T; ++t) {
        double mean_gx = 0.0;
        for (int h = 0; h < H; ++h) {
          const double xhat = c.x[t * H + h] * r.rstd[t];
          mean_gx += static_cast<double>(c.dout[t * H + h]) * c.w[h] * xhat / H;
          dw_ref[h] += c.dout[t * H + h] * xhat;
        }
        for (int h = 0; h < H; ++h) {
          const double xhat = c.x[t * H + h] * r.rstd[t];
          const double g = static_cast<double>(c.dout[t * H + h]) * c.w[h];
          dx_ref[t * H + h] += r.rstd[t] * (g - xhat * mean_gx);
        }
      }
      const std::string name = "rmsnorm H=" + std::to_string(H) + " T=" + std::to_string(T);
      expect_close(dx, dx_ref, 1e-5, kRtol, name + " dx");
      expect_close(dw, dw_ref, 2e-6 * std::sqrt(T), kRtol, name + " dw");
    }
  }
}

TEST(RmsNorm, BackwardMatchesFiniteDifferences) {
  std::mt19937 rng(133);
  const int T = 3, H = 24;
  const float eps = 1e-6f;
  const RmsCase c = make_rms_case(T, H, rng);
  Vec out(c.x.size()), rstd(T);
  rmsnorm_forward(out.data(), rstd.data(), c.x.data(), c.w.data(), T, H, eps);
  Vec dx(c.x.size(), 0.0f), dw(H, 0.0f);
  rmsnorm_backward(dx.data(), dw.data(), c.dout.data(), c.x.data(), c.w.data(), rstd.data(), T, H);

  // L = sum(dout * rmsnorm(x, w)), differenced in each argument.
  const DVec x = to_double(c.x), w = to_double(c.w), g = to_double(c.dout);
  const auto loss = [&](const DVec& xx, const DVec& ww) {
    return dot(rmsnorm_ref(xx, ww, T, H, eps).out, g);
  };
  const double h = 1e-6;
  expect_close(dx, finite_diff([&](const DVec& v) { return loss(v, w); }, x, h), 1e-5, 1e-4,
               "rmsnorm dx vs finite differences", 1e-4);
  expect_close(dw, finite_diff([&](const DVec& v) { return loss(x, v); }, w, h), 1e-5, 1e-4,
               "rmsnorm dw vs finite differences", 1e-4);
}

TEST(RmsNorm, BackwardSameBitsForAnyThreadCountAndWithScratch) {
  std::mt19937 rng(134);
  const int T = 1000, H = 40;
  const RmsCase c = make_rms_case(T, H, rng);
  Vec out(c.x.size()), rstd(T);
  rmsnorm_forward(out.data(), rstd.data(), c.x.data(), c.w.data(), T, H, 1e-6f);
  auto run = [&](int threads, Scratch* scratch) {
    ThreadCount tc(threads);
    RmsCase r = c;
    rmsnorm_backward(r.dx0.data(), r.dw0.data(), c.dout.data(), c.x.data(), c.w.data(), rstd.data(),
                     T, H, scratch);
    return r;
  };
  const RmsCase one = run(1, nullptr), two = run(2, nullptr);
  EXPECT_EQ(one.dw0, two.dw0);
  EXPECT_EQ(one.dx0, two.dx0);
  EXPECT_NE(one.dw0, c.dw0);
  // The partials from a caller's scratch, sized by rmsnorm_backward_scratch and left dirty by
  // an earlier kernel: the same bits.
  const std::size_t bytes = static_cast<std::size_t>(rmsnorm_backward_scratch(H).bytes(T));
  std::vector<double> buf((bytes + Scratch::kAlign) / sizeof(double), kNaN);
  void* base = buf.data();
  std::size_t space = buf.size() * sizeof(double);
  ASSERT_NE(std::align(Scratch::kAlign, bytes, base, space), nullptr);
  Scratch scratch(base, bytes);
  const RmsCase with_scratch = run(2, &scratch);
  EXPECT_EQ(with_scratch.dw0, one.dw0);
  EXPECT_EQ(with_scratch.dx0, one.dx0);
}

// A model's per-head norms (Note [Query/key norms]): Z rows of A a token, their partials in
// rmsnorm_backward_scratch(A, Z) for T tokens, for token counts on and off the row blocks.
TEST(RmsNorm, PerHeadRowsFitTheirScratch) {
  std::mt19937 rng(135);
  const int A = 24, Z = 7;
  for (int T : {1, 37, 256, 301}) {
    const int rows = T * Z;
    const RmsCase c = make_rms_case(rows, A, rng);
    Vec out(c.x.size()), rstd(rows);
    rmsnorm_forward(out.data(), rstd.data(), c.x.data(), c.w.data(), rows, A, 1e-6f);
    RmsCase own = c;
    rmsnorm_backward(own.dx0.data(), own.dw0.data(), c.dout.data(), c.x.data(), c.w.data(), rstd.data(), rows, A);
    const std::size_t bytes = static_cast<std::size_t>(rmsnorm_backward_scratch(A, Z).bytes(T));
    std::vector<double> buf((bytes + Scratch::kAlign) / sizeof(double), kNaN);
    void* base = buf.data();
    std::size_t space = buf.size() * sizeof(double);
    ASSERT_NE(std::align(Scratch::kAlign, bytes, base, space), nullptr);
    Scratch scratch(base, bytes);
    RmsCase with = c;
    rmsnorm_backward(with.dx0.data(), with.dw0.data(), c.dout.data(), c.x.data(), c.w.data(), rstd.data(), rows, A,
                     &scratch);
    EXPECT_EQ(with.dw0, own.dw0) << "T " << T;
    EXPECT_EQ(with.dx0, own.dx0) << "T " << T;
  }
}

// ---- GeLU -----------------------------------------------------------------------------

double gelu_ref(double x) {
  const double k = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}

double gelu_grad_ref(double x) {
  const double k = std::sqrt(2.0 / M_PI);
  const double th = std::tanh(k * (x + 0.044715 * x * x * x));
  return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * k * (1.0 + 3.0 * 0.044715 * x * x);
}

Vec gelu_inputs(std::size_t n, std::mt19937& rng) {
  Vec x = randn(n, rng, 3.0f);
  const float extremes[] = {-30.0f, -12.0f, -5.0f, -1e-3f, 1e-3f, 5.0f, 12.0f, 30.0f};
  for (std::size_t i = 0; i < std::size(extremes) && i < n; ++i) x[i] = extremes[i];
  return x;
}

TEST(Gelu, ForwardAndBackwardMatchFloat64) {
  std::mt19937 rng(111);
  for (std::size_t n : {std::size_t{1}, std::size_t{1003}, std::size_t{70001}}) {
    const Vec x = gelu_inputs(n, rng);
    const Vec dout = randn(n, rng);
    DVec y_ref(n), dx_ref(n);
    for (std::size_t i = 0; i < n; ++i) {
      y_ref[i] = gelu_ref(x[i]);
      dx_ref[i] = dout[i] * gelu_grad_ref(x[i]);
    }
    const std::string name = "gelu n=" + std::to_string(n);
    Vec y(n, kNaN);
    gelu_forward(y.data(), x.data(), static_cast<i64>(n));
    expect_close(y, y_ref, 1e-6, kRtol, name + " forward");

    Vec dx(n, kNaN);
    gelu_backward(dx.data(), dout.data(), x.data(), static_cast<i64>(n));
    expect_close(dx, dx_ref, 1e-6, kRtol, name + " backward");

    Vec inplace = dout;
    gelu_backward(inplace.data(), inplace.data(), x.data(), static_cast<i64>(n));
    expect_close(inplace, dx_ref, 1e-6, kRtol, name + " backward in place");
  }
}

TEST(Gelu, BackwardMatchesFiniteDifferences) {
  std::mt19937 rng(112);
  const std::size_t n = 200;
  const Vec x = gelu_inputs(n, rng);
  const Vec dout = randn(n, rng);
  Vec dx(n);
  gelu_backward(dx.data(), dout.data(), x.data(), static_cast<i64>(n));
  const DVec g = to_double(dout);
  const auto loss = [&](const DVec& v) {
    double s = 0.0;
    for (std::size_t i = 0; i < n; ++i) s += g[i] * gelu_ref(v[i]);
    return s;
  };
  expect_close(dx, finite_diff(loss, to_double(x), 1e-6), 1e-5, 1e-4,
               "gelu backward vs finite differences", 1e-4);
}

// ---- SwiGLU ---------------------------------------------------------------------------

double silu_ref(double g) { return g / (1.0 + std::exp(-g)); }

double silu_grad_ref(double g) {
  const double s = 1.0 / (1.0 + std::exp(-g));
  return s * (1.0 + g * (1.0 - s));
}

// gu [T, 2F]: gates (with extremes where the sigmoid saturates) | ups.
Vec swiglu_inputs(int T, int F, std::mt19937& rng) {
  Vec gu = randn(static_cast<std::size_t>(T) * 2 * F, rng, 3.0f);
  const float extremes[] = {-100.0f, -30.0f, -12.0f, -5.0f, -1e-3f,
                            1e-3f,   5.0f,   12.0f,  30.0f, 100.0f};
  for (std::size_t i = 0; i < std::size(extremes); ++i) {
    const std::size_t t = i % T, j = (i * 5) % F;  // gate columns only
    gu[t * 2 * F + j] = extremes[i];
  }
  return gu;
}

TEST(SwiGlu, ForwardAndInPlaceBackwardMatchFloat64) {
  std::mt19937 rng(135);
  for (int F : {7, 64, 1000}) {
    for (int T : {1, 3, 300}) {
      const std::string name = "swiglu F=" + std::to_string(F) + " T=" + std::to_string(T);
      const Vec gu = swiglu_inputs(T, F, rng);
      const Vec dout = randn(static_cast<std::size_t>(T) * F, rng);
      DVec out_ref(dout.size()), dgu_ref(gu.size());
      for (int t = 0; t < T; ++t) {
        for (int j = 0; j < F; ++j) {
          const double g = gu[t * 2 * F + j], u = gu[t * 2 * F + F + j], d = dout[t * F + j];
          out_ref[t * F + j] = silu_ref(g) * u;
          dgu_ref[t * 2 * F + j] = d * u * silu_grad_ref(g);
          dgu_ref[t * 2 * F + F + j] = d * silu_ref(g);
        }
      }
      Vec out(dout.size(), kNaN);
      swiglu_forward(out.data(), gu.data(), T, F);
      expect_close(out, out_ref, 1e-6, kRtol, name + " forward");

      // d out in the gate columns, garbage in the up columns (they are written, not read).
      Vec dgu(gu.size(), kNaN);
      for (int t = 0; t < T; ++t)
        for (int j = 0; j < F; ++j) dgu[t * 2 * F + j] = dout[t * F + j];
      swiglu_backward(dgu.data(), gu.data(), T, F);
      expect_close(dgu, dgu_ref, 1e-6, kRtol, name + " backward");
    }
  }
}

TEST(SwiGlu, BackwardMatchesFiniteDifferences) {
  std::mt19937 rng(136);
  const int T = 3, F = 40;
  const Vec gu = swiglu_inputs(T, F, rng);
  const Vec dout = randn(static_cast<std::size_t>(T) * F, rng);
  Vec dgu(gu.size(), kNaN);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < F; ++j) dgu[t * 2 * F + j] = dout[t * F + j];
  swiglu_backward(dgu.data(), gu.data(), T, F);
  // L = sum(dout * swiglu(gu)), differenced in every gate and up.
  const auto loss = [&](const DVec& v) {
    double s = 0.0;
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < F; ++j)
        s += dout[t * F + j] * silu_ref(v[t * 2 * F + j]) * v[t * 2 * F + F + j];
    return s;
  };
  expect_close(dgu, finite_diff(loss, to_double(gu), 1e-6), 1e-5, 1e-4,
               "swiglu backward vs finite differences", 1e-4);
}

// ---- RoPE -----------------------------------------------------------------------------

// Plain RoPE's frequencies, theta^(-2j/A), computed here (not by core/rope.h).
DVec plain_inv_freq(int A, double theta) {
  DVec f(static_cast<std::size_t>(A / 2));
  for (int j = 0; j < A / 2; ++j) f[j] = std::pow(theta, -2.0 * j / A);
  return f;
}

DVec table_inv_freq(const RopeTable& r) { return DVec(r.inv_freq, r.inv_freq + r.half); }

// Rotates the first Z*A columns of each row of x (stride ld) by +angle (sign 1) or -angle,
// angle = pos inv_freq[j], and multiplies by scale (yarn's attention factor).
DVec rope_ref(DVec x, int T, int Z, int A, i64 pos0, const DVec& inv_freq, double scale, int ld,
              double sign) {
  const int half = A / 2;
  for (int t = 0; t < T; ++t) {
    for (int j = 0; j < half; ++j) {
      const double angle = static_cast<double>(pos0 + t) * inv_freq[j];
      const double c = scale * std::cos(angle), s = sign * scale * std::sin(angle);
      for (int z = 0; z < Z; ++z) {
        const std::size_t lo = static_cast<std::size_t>(t) * ld + z * A + j;
        const std::size_t hi = lo + half;
        const double a = x[lo], b = x[hi];
        x[lo] = a * c - b * s;
        x[hi] = b * c + a * s;
      }
    }
  }
  return x;
}

struct RopeCase {
  int T, Z, A;
  i64 pos0;
};

const RopeCase kRopeCases[] = {
    {3, 2, 8, 0}, {1, 1, 2, 7}, {37, 3, 16, 1'000'000 - 5}, {40, 4, 64, 123'457}, {5, 2, 24, 1'000'000}};

TEST(Rope, ForwardAndBackwardMatchFloat64InsideQkvRows) {
  std::mt19937 rng(113);
  const double theta = 10000.0;
  for (const RopeCase& rc : kRopeCases) {
    const int ld = 3 * rc.Z * rc.A;  // q (or k) inside a [T, 3H] qkv buffer
    const std::string name = "rope T=" + std::to_string(rc.T) + " Z=" + std::to_string(rc.Z) +
                             " A=" + std::to_string(rc.A) + " pos0=" + std::to_string(rc.pos0);
    const RopeTable table = rope_table(rc.A, theta);
    const DVec freq = plain_inv_freq(rc.A, theta);
    const Vec x0 = randn(static_cast<std::size_t>(rc.T) * ld, rng);
    Vec x = x0;
    rope_forward(x.data(), rc.T, rc.Z, rc.A, rc.pos0, table, ld);
    expect_close(x, rope_ref(to_double(x0), rc.T, rc.Z, rc.A, rc.pos0, freq, 1.0, ld, 1.0), 1e-6,
                 kRtol, name + " forward");

    rope_backward(x.data(), rc.T, rc.Z, rc.A, rc.pos0, table, ld);
    expect_close(x, to_double(x0), 1e-6, kRtol, name + " backward(forward(x)) == x");

    const Vec dy = randn(x0.size(), rng);
    Vec dx = dy;
    rope_backward(dx.data(), rc.T, rc.Z, rc.A, rc.pos0, table, ld);
    expect_close(dx, rope_ref(to_double(dy), rc.T, rc.Z, rc.A, rc.pos0, freq, 1.0, ld, -1.0), 1e-6,
                 kRtol, name + " backward");
  }
}

// The table of a Llama-family model of head size A with scaled RoPE (core/rope.h): yarn, whose
// attention factor scales cos and sin, or llama3, which only changes the frequencies.
RopeTable scaled_table(RopeScaling::Type type, int A) {
  ModelConfig c;
  c.family = Family::Llama;
  c.heads = 4;
  c.hidden = 4 * A;
  c.rope_theta = 500000.0f;
  c.max_positions = 4096;
  c.rope_scaling.type = type;
  c.rope_scaling.factor = 8.0;
  c.rope_scaling.original_max_positions = 8192;
  return rope_table(c);
}

TEST(Rope, ScaledTablesMatchFloat64) {
  std::mt19937 rng(116);
  for (const RopeScaling::Type type : {RopeScaling::Type::Yarn, RopeScaling::Type::Llama3}) {
    for (const RopeCase& rc : kRopeCases) {
      if (rc.A < 16) continue;  // enough frequencies for the scalings' ramps
      const int ld = 3 * rc.Z * rc.A;
      const std::string name = std::string("rope ") + rope_scaling_name(type) + " T=" +
                               std::to_string(rc.T) + " A=" + std::to_string(rc.A) +
                               " pos0=" + std::to_string(rc.pos0);
      const RopeTable table = scaled_table(type, rc.A);
      const DVec freq = table_inv_freq(table);
      const double scale = table.scale;
      // The test is only worth something if the table is not plain RoPE's.
      if (type == RopeScaling::Type::Yarn) {
        EXPECT_GT(scale, 1.1) << name;
      }
      EXPECT_NE(freq, plain_inv_freq(rc.A, 500000.0)) << name;

      const Vec x0 = randn(static_cast<std::size_t>(rc.T) * ld, rng);
      Vec x = x0;
      rope_forward(x.data(), rc.T, rc.Z, rc.A, rc.pos0, table, ld);
      expect_close(x, rope_ref(to_double(x0), rc.T, rc.Z, rc.A, rc.pos0, freq, scale, ld, 1.0),
                   1e-6, kRtol, name + " forward");

      // The transpose of scale R is scale R^T: backward(forward(x)) = scale^2 x on the rotated
      // columns, x on the others.
      Vec back = x;
      rope_backward(back.data(), rc.T, rc.Z, rc.A, rc.pos0, table, ld);
      DVec want = to_double(x0);
      for (int t = 0; t < rc.T; ++t)
        for (int c = 0; c < rc.Z * rc.A; ++c)
          want[static_cast<std::size_t>(t) * ld + c] *= scale * scale;
      expect_close(back, want, 1e-6, kRtol, name + " backward(forward(x)) == scale^2 x");

      const Vec dy = randn(x0.size(), rng);
      Vec dx = dy;
      rope_backward(dx.data(), rc.T, rc.Z, rc.A, rc.pos0, table, ld);
      expect_close(dx, rope_ref(to_double(dy), rc.T, rc.Z, rc.A, rc.pos0, freq, scale, ld, -1.0),
                   1e-6, kRtol, name + " backward");
      // The adjoint: <forward(x), dy> = <x, backward(dy)>, to fp32 rounding of the terms.
      double lhs = 0.0, rhs = 0.0, mag = 0.0;
      for (std::size_t i = 0; i < x0.size(); ++i) {
        lhs += static_cast<double>(x[i]) * dy[i];
        rhs += static_cast<double>(x0[i]) * dx[i];
        mag += std::fabs(static_cast<double>(x[i]) * dy[i]);
      }
      EXPECT_NEAR(lhs, rhs, 1e-6 * mag) << name << " adjoint";
    }
  }
}

TEST(Rope, BackwardIsTheTransposeByFiniteDifferences) {
  std::mt19937 rng(114);
  const int T = 3, Z = 2, A = 16, ld = 3 * Z * A;
  const i64 pos0 = 999'999;
  const RopeTable tables[] = {rope_table(A, 10000.0), scaled_table(RopeScaling::Type::Yarn, A)};
  for (const RopeTable& table : tables) {
    const std::string name = "rope scale=" + std::to_string(table.scale);
    const Vec x = randn(static_cast<std::size_t>(T) * ld, rng);
    const Vec g = randn(x.size(), rng);
    Vec dx = g;
    rope_backward(dx.data(), T, Z, A, pos0, table, ld);
    // The columns rope does not touch pass dout through: their gradient is dout itself.
    const DVec gd = to_double(g), freq = table_inv_freq(table);
    const auto loss = [&](const DVec& v) {
      return dot(rope_ref(v, T, Z, A, pos0, freq, table.scale, ld, 1.0), gd);
    };
    expect_close(dx, finite_diff(loss, to_double(x), 1e-3), 1e-5, 1e-4,
                 name + " backward vs finite differences", 1e-4);
  }
}

TEST(Rope, SameBitsWhetherTheSequenceIsSplitOrWhole) {
  std::mt19937 rng(115);
  const int T = 53, Z = 2, A = 16, ld = Z * A + 5;
  const i64 pos0 = 1'000'003;
  const RopeTable tables[] = {rope_table(A, 500000.0), scaled_table(RopeScaling::Type::Yarn, A)};
  for (const RopeTable& table : tables) {
    const Vec x0 = randn(static_cast<std::size_t>(T) * ld, rng);
    Vec whole = x0, split = x0;
    rope_forward(whole.data(), T, Z, A, pos0, table, ld);
    const int T1 = 21;
    rope_forward(split.data(), T1, Z, A, pos0, table, ld);
    rope_forward(split.data() + static_cast<std::size_t>(T1) * ld, T - T1, Z, A, pos0 + T1, table,
                 ld);
    EXPECT_EQ(whole, split);
    EXPECT_NE(whole, x0);
  }
}

// ---- softmax cross-entropy ------------------------------------------------------------

struct XentRef {
  DVec dlogits, losses;
  double total = 0.0;
};

XentRef xent_ref(const DVec& logits, const Ids& targets, int T, int V, double grad_scale) {
  XentRef r{DVec(logits.size()), DVec(T), 0.0};
  for (int t = 0; t < T; ++t) {
    if (targets[t] == kNoTarget) continue;  // loss 0, gradient 0
    double mx = -std::numeric_limits<double>::infinity();
    for (int v = 0; v < V; ++v) mx = std::max(mx, logits[t * V + v]);
    double sum = 0.0;
    for (int v = 0; v < V; ++v) sum += std::exp(logits[t * V + v] - mx);
    const double lse = mx + std::log(sum);
    for (int v = 0; v < V; ++v) {
      r.dlogits[t * V + v] =
          (std::exp(logits[t * V + v] - lse) - (v == targets[t] ? 1.0 : 0.0)) * grad_scale;
    }
    r.losses[t] = lse - logits[t * V + targets[t]];
    r.total += r.losses[t];
  }
  return r;
}

TEST(Xent, MatchesFloat64IncludingLargeLogits) {
  std::mt19937 rng(116);
  struct Case { int T, V; float scale; };
  for (Case c : {Case{1, 7, 1.0f}, Case{3, 50, 50.0f}, Case{9, 1001, 50.0f}, Case{17, 333, 1.0f},
                 Case{4, 40000, 3.0f}}) {
    const std::string name = "xent T=" + std::to_string(c.T) + " V=" + std::to_string(c.V) +
                             " scale=" + std::to_string(c.scale);
    Vec logits = randn(static_cast<std::size_t>(c.T) * c.V, rng, c.scale);
    const Ids targets = rand_ids(c.T, c.V, rng);
    const float grad_scale = 1.0f / (3.0f * c.T);
    const XentRef r = xent_ref(to_double(logits), targets, c.T, c.V, grad_scale);
    Vec losses(c.T, kNaN);
    const double total =
        xent_forward_backward(logits.data(), losses.data(), targets.data(), c.T, c.V, grad_scale);
    expect_close(logits, r.dlogits, 1e-7 * grad_scale, kRtol, name + " dlogits");
    expect_close(losses, r.losses, 1e-6, kRtol, name + " losses");
    EXPECT_NEAR(total, r.total, 1e-6 + 1e-6 * std::fabs(r.total)) << name << " total";
  }
}

TEST(Xent, GradientMatchesFiniteDifferences) {
  std::mt19937 rng(117);
  const int T = 2, V = 5;
  const float grad_scale = 0.25f;
  Vec logits = randn(static_cast<std::size_t>(T) * V, rng, 2.0f);
  const Ids targets = rand_ids(T, V, rng);
  const DVec x = to_double(logits);
  Vec losses(T);
  xent_forward_backward(logits.data(), losses.data(), targets.data(), T, V, grad_scale);
  const auto loss = [&](const DVec& v) { return grad_scale * xent_ref(v, targets, T, V, 1.0).total; };
  expect_close(logits, finite_diff(loss, x, 1e-6), 1e-6, 1e-4, "xent vs finite differences", 1e-4);
}

TEST(Xent, RejectsTargetsOutsideVocabulary) {
  const int T = 2, V = 5;
  Vec logits(static_cast<std::size_t>(T) * V, 0.5f);
  Vec losses(T);
  for (std::int32_t bad : {-2, V}) {
    const Ids targets = {1, bad};
    EXPECT_THROW(xent_forward_backward(logits.data(), losses.data(), targets.data(), T, V, 1.0f),
                 Error);
  }
}

// kNoTarget (-1): the row is not predicted (masked-token training); the other rows are as
// if it were not there.
TEST(Xent, NoTargetRowsHaveNoLossAndNoGradient) {
  const int T = 3, V = 7;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  Vec logits(static_cast<std::size_t>(T) * V);
  for (float& x : logits) x = normal(rng);
  Vec only_last(logits.begin() + 2 * V, logits.end()), losses(T), loss1(1);
  const Ids targets = {3, kNoTarget, 6};
  const Ids last = {6};
  Vec all = logits;
  const double sum = xent_forward_backward(all.data(), losses.data(), targets.data(), T, V, 0.5f);
  const double sum1 = xent_forward_backward(only_last.data(), loss1.data(), last.data(), 1, V, 0.5f);
  EXPECT_EQ(losses[1], 0.0f);
  for (int v = 0; v < V; ++v) EXPECT_EQ(all[std::size_t(V) + v], 0.0f) << v;
  for (int v = 0; v < V; ++v) EXPECT_EQ(all[std::size_t(2 * V) + v], only_last[std::size_t(v)]) << v;
  EXPECT_GT(losses[0], 0.0f);
  EXPECT_NEAR(sum, double(losses[0]) + sum1, 1e-6 * sum);
}

// ---- vocabulary-parallel cross-entropy -------------------------------------------------

TEST(RowLogsumexp, MatchesFloat64IncludingLargeLogits) {
  std::mt19937 rng(122);
  const int T = 5;
  for (int V : {1, 37, 333, 1001}) {
    const std::string name = "row_logsumexp V=" + std::to_string(V);
    Vec logits = randn(static_cast<std::size_t>(T) * V, rng, 3.0f);
    // Row 1 around 80 to 100 (exp overflows fp32 above 88.7 without the max); row 3 around -90.
    const Vec big = randn(V, rng, 5.0f, 90.0f), small = randn(V, rng, 5.0f, -90.0f);
    std::copy(big.begin(), big.end(), logits.begin() + V);
    std::copy(small.begin(), small.end(), logits.begin() + 3 * V);
    const Vec saved = logits;
    Vec lse(T, kNaN);
    row_logsumexp(lse.data(), logits.data(), T, V);
    DVec ref(T);
    for (int t = 0; t < T; ++t) {
      double mx = -std::numeric_limits<double>::infinity(), sum = 0.0;
      for (int v = 0; v < V; ++v) mx = std::max(mx, double(logits[t * V + v]));
      for (int v = 0; v < V; ++v) sum += std::exp(double(logits[t * V + v]) - mx);
      ref[t] = mx + std::log(sum);
    }
    expect_close(lse, ref, 1e-6, kRtol, name);
    EXPECT_EQ(logits, saved) << name << ": the logits are read only";
  }
}

// Three uneven shards (13, 12, 12 columns of V = 37) against the full float64 cross-entropy,
// through the CPU backend with a Workspace of the head's bound (xent_scratch), the gradient both
// in place and into a separate buffer.
TEST(XentShard, ThreeUnevenShardsMatchTheFullFloat64Xent) {
  std::mt19937 rng(123);
  const int V = 37, T = 9, parts = 3;
  const std::vector<int> starts = shard_starts(V, parts);
  Vec logits = randn(static_cast<std::size_t>(T) * V, rng, 3.0f);
  const Vec big = randn(V, rng, 5.0f, 90.0f), small = randn(V, rng, 5.0f, -90.0f);
  std::copy(big.begin(), big.end(), logits.begin() + 4 * V);  // row 4 around 80 to 100
  std::copy(small.begin(), small.end(), logits.begin() + 6 * V);  // row 6 around -90
  Ids targets = rand_ids(T, V, rng);
  targets[0] = starts[0];          // every shard's first and last column
  targets[1] = starts[1] - 1;
  targets[3] = starts[1];
  targets[4] = starts[2] - 1;      // the large row's target in the middle shard
  targets[5] = starts[2];
  targets[6] = V - 1;
  targets[2] = kNoTarget;
  const float grad_scale = 1.0f / (3.0f * T);
  const XentRef r = xent_ref(to_double(logits), targets, T, V, grad_scale);

  const std::unique_ptr<Backend> be = make_cpu_backend();
  // Scratch of exactly the bound head_scratch reserves for T rows (Scratch aborts past it).
  const std::size_t ws_bytes = static_cast<std::size_t>(xent_scratch(T).bytes(T));
  std::vector<unsigned char> ws_mem(ws_bytes + Scratch::kAlign);
  void* ws_base = ws_mem.data() + (Scratch::kAlign - reinterpret_cast<std::uintptr_t>(ws_mem.data()) % Scratch::kAlign);
  for (bool in_place : {true, false}) {
    const std::string name = std::string("xent_shard ") + (in_place ? "in place" : "separate dlogits");
    std::vector<Vec> shard(parts);
    Vec lse_parts(static_cast<std::size_t>(parts) * T, kNaN);
    for (int p = 0; p < parts; ++p) {
      const int Vp = starts[p + 1] - starts[p];
      shard[p].resize(static_cast<std::size_t>(T) * Vp);
      for (int t = 0; t < T; ++t)
        for (int v = 0; v < Vp; ++v) shard[p][t * Vp + v] = logits[t * V + starts[p] + v];
      be->row_logsumexp(lse_parts.data() + p * T, shard[p].data(), T, Vp);
    }
    Vec dlogits(static_cast<std::size_t>(T) * V, kNaN);  // the shards' gradients side by side
    DVec loss_rows(T, 0.0);
    double total = 0.0;
    for (int p = 0; p < parts; ++p) {
      const int v0 = starts[p], Vp = starts[p + 1] - starts[p];
      const Vec saved = shard[p];
      Vec sep(shard[p].size(), kNaN);
      Vec losses(T, kNaN);
      double loss_sum = 0.5;  // accumulates
      const Workspace ws{ws_base, ws_bytes};
      be->xent_shard(in_place ? static_cast<void*>(shard[p].data()) : sep.data(), losses.data(), &loss_sum,
                     shard[p].data(), lse_parts.data(), parts, targets.data(), T, Vp, v0, grad_scale, ws);
      const Vec& d = in_place ? shard[p] : sep;
      if (!in_place) {
        EXPECT_EQ(shard[p], saved) << name << ": a separate dlogits leaves the logits";
      }
      for (int t = 0; t < T; ++t)
        for (int v = 0; v < Vp; ++v) dlogits[t * V + v0 + v] = d[t * Vp + v];
      double own = 0.0;
      for (int t = 0; t < T; ++t) {
        const bool mine = targets[t] >= v0 && targets[t] < v0 + Vp;
        if (!mine) {
          EXPECT_EQ(losses[t], 0.0f) << name << " shard " << p << " row " << t;
        }
        loss_rows[t] += losses[t];
        own += losses[t];
      }
      EXPECT_NEAR(loss_sum - 0.5, own, 1e-5) << name << " shard " << p << ": loss_sum";
      total += loss_sum - 0.5;
    }
    // fp32 lse of rows around 90 carries ~4e-6 of rounding into exp(x - lse) and the losses.
    expect_close(dlogits, r.dlogits, 1e-7 * grad_scale, 2e-5, name + " dlogits", 2e-5);
    for (int v = 0; v < V; ++v) EXPECT_EQ(dlogits[2 * V + v], 0.0f) << name << " kNoTarget row, column " << v;
    expect_close(Vec(loss_rows.begin(), loss_rows.end()), r.losses, 2e-5, kRtol, name + " losses");
    EXPECT_NEAR(total, r.total, 1e-4) << name << " total";
  }
}

// ---- softmax over rows (the two-pass ring's scores) ---------------------------------------

TEST(SoftmaxRows, MatchFloat64) {
  const i64 rows = 9;
  const int cols = 301;
  std::mt19937 rng(17);
  const Vec x = randn(std::size_t(rows) * cols, rng, 6.0f, 40.0f);  // far from 0: max subtraction matters
  Vec p = x, lse(rows);
  softmax_rows(p.data(), lse.data(), rows, cols, false);
  Vec again = x;
  softmax_rows(again.data(), lse.data(), rows, cols, true);
  const Vec dx = randn(p.size(), rng);
  Vec ds = dx;
  softmax_backward_rows(ds.data(), p.data(), rows, cols);
  for (i64 r = 0; r < rows; ++r) {
    double mx = -1e300, sum = 0, dot = 0;
    for (int c = 0; c < cols; ++c) mx = std::max(mx, double(x[r * cols + c]));
    for (int c = 0; c < cols; ++c) sum += std::exp(double(x[r * cols + c]) - mx);
    const double l = mx + std::log(sum);
    EXPECT_NEAR(lse[r], l, 1e-5 * std::fabs(l)) << r;
    std::vector<double> pr(cols);
    for (int c = 0; c < cols; ++c) {
      pr[c] = std::exp(double(x[r * cols + c]) - l);
      dot += pr[c] * dx[r * cols + c];
    }
    for (int c = 0; c < cols; ++c) {
      const std::size_t i = std::size_t(r * cols + c);
      EXPECT_NEAR(p[i], pr[c], 1e-6 * pr[c] + 1e-9) << r << " " << c;
      EXPECT_NEAR(again[i], pr[c], 1e-4 * pr[c] + 1e-9) << r << " " << c;
      const double want = pr[c] * (dx[i] - dot);
      // fp32 rounding of dx - rowsum (a cancellation) bounds the error, not |want|.
      EXPECT_NEAR(ds[i], want, 1e-6 * pr[c] * (std::fabs(dx[i]) + std::fabs(dot)) + 1e-12) << r << " " << c;
    }
  }
}

// ---- optimizer ------------------------------------------------------------------------

TEST(SumSquares, MatchesFloat64) {
  std::mt19937 rng(118);
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{37}, std::size_t{(1 << 20) + 3}}) {
    const Vec g = randn(n, rng, 0.1f);
    double ref = 0.0;
    for (float x : g) ref += static_cast<double>(x) * x;
    EXPECT_NEAR(sum_squares(g.data(), static_cast<i64>(n)), ref, 1e-12 * ref) << "n=" << n;
  }
}

TEST(SumSquares, SameBitsForAnyThreadCount) {
  std::mt19937 rng(119);
  const std::size_t n = (std::size_t{1} << 21) + 12345;
  const Vec g = randn(n, rng, 1.0f, 0.3f);
  double by_threads[3];
  for (int threads : {1, 2, 3}) {
    ThreadCount tc(threads);
    by_threads[threads - 1] = sum_squares(g.data(), static_cast<i64>(n));
  }
  EXPECT_EQ(by_threads[0], by_threads[1]);
  EXPECT_EQ(by_threads[0], by_threads[2]);
}

TEST(ScaleInplace, MatchesFloat64) {
  std::mt19937 rng(120);
  for (std::size_t n : {std::size_t{1}, std::size_t{1001}, std::size_t{100003}}) {
    Vec x = randn(n, rng);
    const float s = -0.37f;
    DVec ref = to_double(x);
    for (double& r : ref) r *= s;
    scale_inplace(x.data(), static_cast<i64>(n), s);
    // One fp32 rounding of the exact product.
    expect_close(x, ref, 0.0, 6e-8, "scale_inplace n=" + std::to_string(n));
  }
}

TEST(AdamW, ThreeStepsMatchFloat64) {
  std::mt19937 rng(121);
  const float lr = 0.05f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, wd = 0.1f;
  for (std::size_t n : {std::size_t{1}, std::size_t{1003}, std::size_t{100003}}) {
    // From a fresh state (steps 1-3) and from a resumed one (steps 10-12).
    for (int first_step : {1, 10}) {
      Vec p = randn(n, rng);
      Vec m(n, 0.0f), v(n, 0.0f);
      if (first_step > 1) {
        m = randn(n, rng, 0.01f);
        v = randn(n, rng, 0.01f);
        for (float& x : v) x = x * x;
      }
      DVec pr = to_double(p), mr = to_double(m), vr = to_double(v);
      for (int t = first_step; t < first_step + 3; ++t) {
        const Vec g = randn(n, rng, 0.01f);
        const double bc1 = 1.0 - std::pow(double{beta1}, t), bc2 = 1.0 - std::pow(double{beta2}, t);
        for (std::size_t i = 0; i < n; ++i) {
          mr[i] = beta1 * mr[i] + (1.0 - beta1) * g[i];
          vr[i] = beta2 * vr[i] + (1.0 - beta2) * static_cast<double>(g[i]) * g[i];
          pr[i] -= lr * (mr[i] / bc1) / (std::sqrt(vr[i] / bc2) + eps) + double{lr} * wd * pr[i];
        }
        adamw_step(p.data(), m.data(), v.data(), g.data(), static_cast<i64>(n), lr, beta1, beta2,
                   eps, wd, t);
        const std::string name = "adamw n=" + std::to_string(n) + " t=" + std::to_string(t);
        expect_close(p, pr, 1e-6, kRtol, name + " p");
        expect_close(m, mr, 1e-9, kRtol, name + " m");
        expect_close(v, vr, 1e-12, kRtol, name + " v");
      }
    }
  }
}

}  // namespace
}  // namespace sppo::cpu
