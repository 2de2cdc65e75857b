// Every CUDA kernel (backends/cuda/ops.h, attention.h) against the CPU kernel of the same
// contract (kernels/ops.h, attention.h) on the same fresh random inputs (never zero), in fp32 and
// in bf16 mode. Needs a GPU: without one every test skips with a message.
//
// Note [Tolerances]
// ~~~~~~~~~~~~~~~~~
// Comparisons are element-wise: |got - ref| <= atol_i + rtol |ref|, where ref is the CPU result.
// In bf16 mode the inputs are rounded to bf16 FIRST and both sides compute from the same rounded
// values, so the bound only has to cover what the GPU rounds on the way, plus the difference of
// two fp32 computations:
//   u = 2^-8, the unit roundoff of bf16 (8 significand bits, round to nearest even).
//   fp32 noise: a sum of K products computed in two orders differs by at most about
//     2 K 2^-24 times mag, mag being the sum of |terms| (computed here per element). In
//     attention the fp32 noise of the scores and of dP also moves P and dS (even where
//     dP - delta cancels); attn_magnitudes bounds those terms too.
//   One rounding of an output to bf16 (every bf16 output is rounded exactly once): u |ref|.
//   A rounding of an intermediate that is multiplied and summed: u times the sum of |terms| it
//     enters: in the tensor-core attention P is rounded before O += P V (out: u sum_j P_j |v_j|,
//     dV: u sum_t P_tj |dO_t|) and dS before dQ += dS K and dK += dS^T Q (u sum |dS| |k|,
//     u sum |dS| |q|). The magnitudes are computed in double by a naive reference below.
// So bf16 tolerances are rtol = u (+ the fp32 rtol) for outputs rounded once, and
// atol_i = 1.1 u mag_i (10% for second-order terms) where an intermediate is rounded; fp32
// tolerances are rtol = 1e-4 with atol_i a small multiple of 2^-24 mag_i or of the largest |ref|,
// stated at each test.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backends/cuda/attention.h"
#include "cuda/cuda_test.h"
#include "backends/cuda/check.h"
#include "backends/cuda/ops.h"
#include "core/check.h"
#include "core/config.h"
#include "core/rope.h"
#include "backends/cpu/attention.h"
#include "backends/cpu/ops.h"

namespace sppo {
namespace {

using namespace sppo::testing;

constexpr double kU = 1.0 / 256.0;         // bf16 unit roundoff
constexpr double kU32 = 1.0 / 16777216.0;  // fp32 unit roundoff 2^-24
constexpr double kRtol32 = 1e-4;           // fp32 element-wise relative tolerance (the issue's)
constexpr float kInf = std::numeric_limits<float>::infinity();

// =============================================================================================
// GEMM and linear
// =============================================================================================

// mag[i, j] = |alpha| sum_k |op(a)[i,k]| |op(b)[k,j]| + |beta| |c[i,j]|: what an fp32 sum's
// error is proportional to.
std::vector<double> gemm_mag(bool ta, bool tb, int M, int N, int K, float alpha, const Vec& a,
                             int lda, const Vec& b, int ldb, float beta, const Vec& c, int ldc) {
  std::vector<double> mag(std::size_t(M) * N);
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      double s = 0.0;
      for (int k = 0; k < K; ++k) {
        const double av = ta ? a[std::size_t(k) * lda + i] : a[std::size_t(i) * lda + k];
        const double bv = tb ? b[std::size_t(j) * ldb + k] : b[std::size_t(k) * ldb + j];
        s += std::fabs(av * bv);
      }
      mag[std::size_t(i) * N + j] =
          std::fabs(alpha) * s + std::fabs(beta) * std::fabs(c[std::size_t(i) * ldc + j]);
    }
  return mag;
}

std::vector<double> scaled(std::vector<double> v, double f) {
  for (double& x : v) x *= f;
  return v;
}

struct GemmTypes {
  DType ab, cd;
};

TEST_F(Cuda, GemmAllTransposesAndTypes) {
  const int M = 37, N = 53, K = 61;
  const float alpha = 0.7f, beta = 0.3f;
  cuda::Blas blas;
  for (const GemmTypes ty : {GemmTypes{DType::F32, DType::F32}, GemmTypes{DType::BF16, DType::BF16},
                             GemmTypes{DType::BF16, DType::F32}}) {
    for (int tr = 0; tr < 4; ++tr) {
      const bool ta = tr & 1, tb = tr & 2;
      // Padded strides: 16-byte aligned rows (as the model's) for bf16, odd ones for fp32.
      const auto pad = [&](int n, int extra) {
        return ty.ab == DType::F32 && ty.cd == DType::F32 ? n + extra : (n + extra + 7) / 8 * 8;
      };
      const int lda = pad(ta ? M : K, 3), ldb = pad(tb ? K : N, 5), ldc = pad(N, 2);
      const Vec a = rounded(randn(std::size_t(ta ? K : M) * lda, rng_), ty.ab);
      const Vec b = rounded(randn(std::size_t(tb ? N : K) * ldb, rng_), ty.ab);
      const Vec c0 = rounded(randn(std::size_t(M) * ldc, rng_), ty.cd);
      Vec ref = c0;
      cpu::gemm(ta, tb, M, N, K, alpha, a.data(), lda, b.data(), ldb, beta, ref.data(), ldc);
      Dev da = upload(a, ty.ab), db = upload(b, ty.ab), dc = upload(c0, ty.cd);
      cuda::gemm(blas, ta, tb, M, N, K, alpha, da.get(), lda, db.get(), ldb, beta, dc.get(), ldc,
                 ty.ab, ty.cd, stream_);
      const Vec got = download(dc, c0.size(), ty.cd);
      const std::string what = std::string("gemm ") + name(ty.ab) + "/" + name(ty.cd) +
                               " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb);
      // Columns past N are padding the GEMM must leave alone.
      for (int i = 0; i < M; ++i)
        for (int j = N; j < ldc; ++j)
          ASSERT_EQ(got[std::size_t(i) * ldc + j], c0[std::size_t(i) * ldc + j]) << what;
      // Note [Tolerances]: two fp32 sums of K terms, 4 K 2^-24 mag (tensor cores may truncate
      // in their fp32 accumulation), plus one rounding to bf16 of a bf16 result.
      const std::vector<double> mag =
          gemm_mag(ta, tb, M, N, K, alpha, a, lda, b, ldb, beta, c0, ldc);
      const double rtol = ty.cd == DType::BF16 ? kU + kRtol32 : kRtol32;
      expect_close(cols(got, M, N, ldc), cols(ref, M, N, ldc), 0.0, rtol, what,
                   scaled(mag, 4.0 * K * kU32));
    }
  }
}

class CudaLinear : public Cuda, public ::testing::WithParamInterface<std::tuple<DType, bool>> {};

TEST_P(CudaLinear, ForwardBackward) {
  const auto [act, epilogue] = GetParam();
  const int T = 45, I = 40, O = 72, ld_in = I + 8, ld_out = O + 8;
  cuda::Blas blas(epilogue);
  const Vec in = rounded(randn(std::size_t(T) * ld_in, rng_), act);
  const Vec w = rounded(randn(std::size_t(O) * I, rng_, 0.2f), act);
  const Vec bias = rounded(randn(O, rng_), act);
  const Vec out0 = randn(std::size_t(T) * ld_out, rng_);
  Vec out_ref = out0;
  cpu::linear_forward(out_ref.data(), in.data(), w.data(), bias.data(), T, I, O, ld_out, ld_in);
  Dev din_ = upload(in, act), dw_ = upload(w, act), db_ = upload(bias, act),
      dout_ = upload(out0, act);
  cuda::linear_forward(blas, dout_.get(), din_.get(), dw_.get(), db_.get(), T, I, O, act, stream_,
                       ld_out, ld_in);
  const Vec out = download(dout_, out0.size(), act);
  const std::string tag = std::string(name(act)) + (epilogue ? " epilogue" : " prefill");
  {
    Vec zero_c(std::size_t(T) * ld_out, 0.0f);
    const std::vector<double> mag =
        gemm_mag(false, true, T, O, I, 1.0f, in, ld_in, w, I, 0.0f, zero_c, ld_out);
    // Without the epilogue, cuBLASLt (13.1, H200) rounds the bf16 product to bf16 before it
    // adds beta C, the bias: a second rounding, of |in w| <= mag (seen: every failing element
    // equal to bf16(bf16(in w) + b)). The epilogue adds the bias in fp32 and rounds once.
    const double product_rounding = act == DType::BF16 && !epilogue ? kU : 0.0;
    std::vector<double> atol(mag.size());
    for (std::size_t i = 0; i < mag.size(); ++i)
      atol[i] = 4.0 * I * kU32 * (mag[i] + std::fabs(bias[i % O])) + product_rounding * mag[i];
    const double rtol = act == DType::BF16 ? kU + kRtol32 : kRtol32;
    expect_close(cols(out, T, O, ld_out), cols(out_ref, T, O, ld_out), 0.0, rtol,
                 "linear_forward " + tag, atol);
    for (int t = 0; t < T; ++t)
      for (int o = O; o < ld_out; ++o)
        ASSERT_EQ(out[std::size_t(t) * ld_out + o],
                  rounded({out0[std::size_t(t) * ld_out + o]}, act)[0]);
  }

  // Backward: din written, dw and db accumulated into non-zero starts.
  const int ld_dout = O + 4;
  const Vec gout = rounded(randn(std::size_t(T) * ld_dout, rng_), act);
  const Vec dw0 = randn(std::size_t(O) * I, rng_), db0 = randn(O, rng_);
  Vec din_ref(std::size_t(T) * I), dw_ref = dw0, db_ref = db0;
  cpu::linear_backward(din_ref.data(), dw_ref.data(), db_ref.data(), gout.data(), in.data(),
                       w.data(), T, I, O, ld_dout, ld_in);
  Dev g_dev = upload(gout, act), gin_dev(std::size_t(T) * I * dtype_bytes(act));
  Dev gw_dev = upload(dw0, DType::F32), gb_dev = upload(db0, DType::F32);
  cuda::linear_backward(blas, gin_dev.get(), gw_dev.as<float>(), gb_dev.as<float>(), g_dev.get(),
                        din_.get(), dw_.get(), T, I, O, act, stream_, ld_dout, ld_in);
  const Vec din = download(gin_dev, din_ref.size(), act);
  const Vec dwg = download(gw_dev, dw_ref.size(), DType::F32);
  const Vec dbg = download(gb_dev, db_ref.size(), DType::F32);
  {
    const Vec zero_c(std::size_t(T) * I, 0.0f);
    const std::vector<double> mag =
        gemm_mag(false, false, T, I, O, 1.0f, gout, ld_dout, w, I, 0.0f, zero_c, I);
    const double rtol = act == DType::BF16 ? kU + kRtol32 : kRtol32;
    expect_close(din, din_ref, 0.0, rtol, "linear_backward din " + tag,
                 scaled(mag, 4.0 * O * kU32));
  }
  {
    const std::vector<double> mag =
        gemm_mag(true, false, O, I, T, 1.0f, gout, ld_dout, in, ld_in, 1.0f, dw0, I);
    expect_close(dwg, dw_ref, 0.0, kRtol32, "linear_backward dw " + tag,
                 scaled(mag, 4.0 * T * kU32));
  }
  // db: sums in double on both sides; only the final fp32 rounding differs.
  expect_close(dbg, db_ref, 1e-6, 1e-6, "linear_backward db " + tag);
}

INSTANTIATE_TEST_SUITE_P(Types, CudaLinear,
                         ::testing::Combine(::testing::Values(DType::F32, DType::BF16),
                                            ::testing::Bool()));

// =============================================================================================
// Element-wise kernels, copies, conversion
// =============================================================================================

TEST_F(Cuda, ConvertAddCopyColumns) {
  const int T = 29, W = 37, ld = 3 * W + 5;
  const Vec x = randn(std::size_t(T) * ld, rng_);
  // F32 -> BF16 conversion rounds to nearest even, like the host.
  {
    Dev src = upload(x, DType::F32), dst(x.size() * 2);
    cuda::convert(dst.get(), DType::BF16, src.get(), DType::F32, i64(x.size()), stream_);
    expect_equal(download(dst, x.size(), DType::BF16), rounded(x, DType::BF16),
                 "convert f32->bf16");
    Dev back(x.size() * 4);
    cuda::convert(back.get(), DType::F32, dst.get(), DType::BF16, i64(x.size()), stream_);
    expect_equal(download(back, x.size(), DType::F32), rounded(x, DType::BF16),
                 "convert bf16->f32");
  }
  for (const DType act : {DType::F32, DType::BF16}) {
    const std::string tag = name(act);
    // Residual add: one float add, one rounding.
    {
      const Vec y0 = rounded(randn(x.size(), rng_), act), xr = rounded(x, act);
      Vec ref(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) ref[i] = rounded({y0[i] + xr[i]}, act)[0];
      Dev y = upload(y0, act), xd = upload(xr, act);
      cuda::add_inplace(y.get(), act, xd.get(), act, i64(x.size()), stream_);
      expect_equal(download(y, x.size(), act), ref, "add_inplace " + tag);
    }
    // An act gradient into an fp32 accumulator (dK/dV from another buffer).
    {
      const Vec acc0 = randn(x.size(), rng_), xr = rounded(x, act);
      Vec ref(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) ref[i] = acc0[i] + xr[i];
      Dev acc = upload(acc0, DType::F32), xd = upload(xr, act);
      cuda::add_inplace(acc.get(), DType::F32, xd.get(), act, i64(x.size()), stream_);
      expect_equal(download(acc, x.size(), DType::F32), ref, "add_inplace f32 += " + tag);
    }
    // copy_cols / put_cols / zero_cols as gpt.cpp uses them (columns W .. 2W-1 of [T, 3W]).
    {
      const Vec src = rounded(x, act);
      Dev s = upload(src, act), dense(std::size_t(T) * W * 4);
      cuda::copy_cols(dense.get(), act, s.get(), act, T, W, ld, W, stream_);
      Vec want(std::size_t(T) * W);
      for (int t = 0; t < T; ++t)
        for (int c = 0; c < W; ++c) want[std::size_t(t) * W + c] = src[std::size_t(t) * ld + W + c];
      expect_equal(download(dense, want.size(), act), want, "copy_cols " + tag);

      // put_cols of an fp32 accumulator into act columns (rounding once), then zero_cols.
      const Vec acc = randn(std::size_t(T) * W, rng_);
      Dev a = upload(acc, DType::F32), d = upload(src, act);
      cuda::put_cols(d.get(), act, a.get(), DType::F32, T, W, ld, 2 * W, stream_);
      cuda::zero_cols(d.get(), act, T, W, ld, 0, stream_);
      Vec want2 = src;
      for (int t = 0; t < T; ++t)
        for (int c = 0; c < W; ++c) {
          want2[std::size_t(t) * ld + 2 * W + c] = rounded({acc[std::size_t(t) * W + c]}, act)[0];
          want2[std::size_t(t) * ld + c] = 0.0f;
        }
      expect_equal(download(d, want2.size(), act), want2, "put_cols/zero_cols " + tag);
    }
  }
}

TEST_F(Cuda, ScaleAndSumSquares) {
  const i64 n = 3 * (i64{1} << 16) + 123;
  const Vec g = randn(std::size_t(n), rng_, 3.0f);
  Dev gd = upload(g, DType::F32);
  Dev acc = upload_raw(std::vector<double>{2.0});
  cuda::sum_squares(acc.as<double>(), gd.as<float>(), n, stream_);
  const double want = 2.0 + cpu::sum_squares(g.data(), n);
  // Both in double, in different blocks: a few double roundings apart.
  EXPECT_NEAR(download_double(acc), want, 1e-12 * want);
  Vec ref = g;
  cpu::scale_inplace(ref.data(), n, 0.37f);
  cuda::scale_inplace(gd.as<float>(), n, 0.37f, stream_);
  expect_equal(download(gd, g.size(), DType::F32), ref, "scale_inplace");
}

TEST_F(Cuda, AdamW) {
  const i64 n = 10007;
  for (const int t : {1, 7}) {
    const Vec p0 = randn(n, rng_), m0 = randn(n, rng_, 0.1f), g = randn(n, rng_);
    Vec v0 = randn(n, rng_, 0.01f);
    for (float& e : v0) e = std::fabs(e);
    Vec p = p0, m = m0, v = v0;
    cpu::adamw_step(p.data(), m.data(), v.data(), g.data(), n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, t);
    Dev pd = upload(p0, DType::F32), md = upload(m0, DType::F32), vd = upload(v0, DType::F32);
    Dev gd = upload(g, DType::F32), pb(std::size_t(n) * 2);
    cuda::adamw_step(pd.as<float>(), md.as<float>(), vd.as<float>(), gd.as<float>(), n, 1e-3f, 0.9f,
                     0.95f, 1e-8f, 0.1f, t, stream_, pb.get());
    const Vec pg = download(pd, n, DType::F32);
    // The same float formula; FMA contraction may differ by an ulp or two.
    const std::string tag = " t=" + std::to_string(t);
    expect_close(pg, p, 1e-7, 1e-6, "adamw p" + tag);
    // m and v are sums of two products that may cancel: atol from the terms.
    std::vector<double> m_terms(n), v_terms(n);
    for (i64 i = 0; i < n; ++i) {
      m_terms[i] = 4 * kU32 * (0.9 * std::fabs(m0[i]) + 0.1 * std::fabs(g[i]));
      v_terms[i] = 4 * kU32 * (0.95 * v0[i] + 0.05 * double(g[i]) * g[i]);
    }
    expect_close(download(md, n, DType::F32), m, 0.0, 1e-6, "adamw m" + tag, m_terms);
    expect_close(download(vd, n, DType::F32), v, 0.0, 1e-6, "adamw v" + tag, v_terms);
    expect_equal(download(pb, n, DType::BF16), rounded(pg, DType::BF16), "adamw p_bf16" + tag);
  }
}

// AdamW over many tensors at once: the same bits as adamw_step on each, past one launch's table
// (40 spans), spans of every size from one element, elements between spans left alone, the
// moments at offsets of their own.
TEST_F(Cuda, AdamWSpansEqualsOneStepATensor) {
  std::uniform_int_distribution<int> size(1, 3000);
  std::vector<AdamwSpan> spans;
  i64 at = 0, state = 0;
  for (int j = 0; j < 40; ++j) {
    const i64 n = j == 0 ? 1 : size(rng_);
    spans.push_back({at + 3, n, state, j % 3 == 0 ? 0.0f : 0.1f});  // 3 untouched elements before each
    at += n + 3;
    state += n;
  }
  const i64 n = at, ns = state;
  const Vec p0 = randn(n, rng_), g = randn(n, rng_), m0 = randn(ns, rng_, 0.1f);
  Vec v0 = randn(ns, rng_, 0.01f);
  for (float& e : v0) e = std::fabs(e);
  const Vec b0 = rounded(randn(n, rng_), DType::BF16);
  Dev gd = upload(g, DType::F32);
  Dev pa = upload(p0, DType::F32), ma = upload(m0, DType::F32), va = upload(v0, DType::F32),
      ba = upload(b0, DType::BF16);
  for (const AdamwSpan& s : spans)
    cuda::adamw_step(pa.as<float>() + s.offset, ma.as<float>() + s.state_offset, va.as<float>() + s.state_offset,
                     gd.as<float>() + s.offset, s.count, 1e-3f, 0.9f, 0.95f, 1e-8f, s.weight_decay, 3, stream_,
                     static_cast<std::uint16_t*>(ba.get()) + s.offset);
  Dev pb = upload(p0, DType::F32), mb = upload(m0, DType::F32), vb = upload(v0, DType::F32),
      bb = upload(b0, DType::BF16);
  cuda::adamw_spans(pb.as<float>(), mb.as<float>(), vb.as<float>(), gd.as<float>(), spans.data(), int(spans.size()),
                    1e-3f, 0.9f, 0.95f, 1e-8f, 3, stream_, bb.get());
  expect_equal(download(pb, n, DType::F32), download(pa, n, DType::F32), "adamw_spans p");
  expect_equal(download(mb, ns, DType::F32), download(ma, ns, DType::F32), "adamw_spans m");
  expect_equal(download(vb, ns, DType::F32), download(va, ns, DType::F32), "adamw_spans v");
  expect_equal(download(bb, n, DType::BF16), download(ba, n, DType::BF16), "adamw_spans p_bf16");
  // The elements between spans, and the first span's one element, against the inputs and the
  // formula.
  const Vec p = download(pb, n, DType::F32);
  for (const AdamwSpan& s : spans)
    for (i64 i = s.offset - 3; i < s.offset; ++i) ASSERT_EQ(p[i], p0[i]) << "element " << i << " between spans";
  Vec p1{p0[3]}, m1{m0[0]}, v1{v0[0]};
  cpu::adamw_step(p1.data(), m1.data(), v1.data(), &g[3], 1, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, 3);
  expect_close({p[3]}, p1, 1e-7, 1e-6, "adamw_spans one element");
}

TEST_F(Cuda, Gelu) {
  const i64 n = 10007;
  Vec x = randn(n, rng_, 3.0f);
  x[0] = -30.0f, x[1] = 30.0f, x[2] = -12.5f, x[3] = 1e-3f;
  for (const DType act : {DType::F32, DType::BF16}) {
    const Vec xin = rounded(x, act), dy = rounded(randn(n, rng_), act);
    Vec y(n), dx(n);
    cpu::gelu_forward(y.data(), xin.data(), n);
    cpu::gelu_backward(dx.data(), dy.data(), xin.data(), n);
    Dev xd = upload(xin, act), yd(std::size_t(n) * 4), dyd = upload(dy, act);
    cuda::gelu_forward(yd.get(), xd.get(), n, act, stream_);
    cuda::gelu_backward(dyd.get(), dyd.get(), xd.get(), n, act, stream_);  // din aliases dout
    // fp32: expf vs the CPU's polynomial exp, a few ulp; gelu' crosses zero near x = -0.75, where
    // the relative error of a difference grows: atol 1e-6 of the largest term.
    const double rtol = act == DType::BF16 ? kU + kRtol32 : kRtol32;
    expect_close(download(yd, n, act), y, 1e-6, rtol, std::string("gelu_forward ") + name(act));
    expect_close(download(dyd, n, act), dx, 1e-6 * max_abs(dy), rtol,
                 std::string("gelu_backward ") + name(act));
  }
}

TEST_F(Cuda, SwiGlu) {
  const int T = 37, F = 300;
  Vec gu = randn(std::size_t(T) * 2 * F, rng_, 3.0f);
  gu[0] = -100.0f, gu[1] = 100.0f, gu[2] = -30.0f, gu[3] = 1e-3f, gu[4] = -12.5f;  // gates
  for (const DType act : {DType::F32, DType::BF16}) {
    const std::string tag = name(act);
    const Vec guin = rounded(gu, act), dout = rounded(randn(std::size_t(T) * F, rng_), act);
    Vec out(std::size_t(T) * F), dgu(gu.size(), 7.0f);
    for (int t = 0; t < T; ++t)  // d out in the gate columns; the up columns are written
      for (int j = 0; j < F; ++j) dgu[std::size_t(t) * 2 * F + j] = dout[std::size_t(t) * F + j];
    const Vec dgu0 = dgu;
    cpu::swiglu_forward(out.data(), guin.data(), T, F);
    cpu::swiglu_backward(dgu.data(), guin.data(), T, F);
    Dev gud = upload(guin, act), od(out.size() * 4), dgud = upload(dgu0, act);
    cuda::swiglu_forward(od.get(), gud.get(), T, F, act, stream_);
    cuda::swiglu_backward(dgud.get(), gud.get(), T, F, act, stream_);
    // fp32: expf against the CPU's polynomial exp, a few ulp; silu' crosses zero near
    // g = -1.28, where a relative bound does not hold: atol 1e-6 of the largest value.
    const double rtol = act == DType::BF16 ? kU + kRtol32 : kRtol32;
    expect_close(download(od, out.size(), act), out, 1e-6 * max_abs(out), rtol,
                 "swiglu_forward " + tag);
    expect_close(download(dgud, dgu.size(), act), dgu, 1e-6 * max_abs(dgu), rtol,
                 "swiglu_backward " + tag);
  }
}

// A Llama-family model's table of head size A with yarn scaling: cos and sin scaled by its
// attention factor (0.1 ln 8 + 1), the frequencies ramped (core/rope.h).
RopeTable yarn_table(int A) {
  ModelConfig c;
  c.family = Family::Llama;
  c.heads = 4;
  c.hidden = 4 * A;
  c.rope_theta = 500000.0f;
  c.max_positions = 4096;
  c.rope_scaling.type = RopeScaling::Type::Yarn;
  c.rope_scaling.factor = 8.0;
  return rope_table(c);
}

TEST_F(Cuda, Rope) {
  for (const int A : {16, 128}) {
    for (const RopeTable& table : {rope_table(A, 10000.0), yarn_table(A)}) {
      for (const DType act : {DType::F32, DType::BF16}) {
        const int T = 37, Z = 3, ld = 3 * Z * A + 4;
        const i64 pos0 = 1000003;
        const Vec x0 = rounded(randn(std::size_t(T) * ld, rng_), act);
        Vec fwd = x0, bwd = x0;
        cpu::rope_forward(fwd.data(), T, Z, A, pos0, table, ld);
        cpu::rope_backward(bwd.data(), T, Z, A, pos0, table, ld);
        Dev f = upload(x0, act), b = upload(x0, act);
        cuda::rope_forward(f.get(), T, Z, A, pos0, table, ld, act, stream_);
        cuda::rope_backward(b.get(), T, Z, A, pos0, table, ld, act, stream_);
        const Vec fg = download(f, x0.size(), act), bg = download(b, x0.size(), act);
        // A rotation (times the scale): fp32 errors are absolute, a few ulp of the row's largest
        // entry.
        const std::string tag = std::string(name(act)) + " A=" + std::to_string(A) +
                                " scale=" + std::to_string(table.scale);
        const double rtol = act == DType::BF16 ? kU + kRtol32 : kRtol32;
        expect_close(cols(fg, T, Z * A, ld), cols(fwd, T, Z * A, ld), 1e-5 * max_abs(x0), rtol,
                     "rope_forward " + tag);
        expect_close(cols(bg, T, Z * A, ld), cols(bwd, T, Z * A, ld), 1e-5 * max_abs(x0), rtol,
                     "rope_backward " + tag);
        for (int t = 0; t < T; ++t)
          for (int c = Z * A; c < ld; ++c) {
            ASSERT_EQ(fg[std::size_t(t) * ld + c], x0[std::size_t(t) * ld + c]);
            ASSERT_EQ(bg[std::size_t(t) * ld + c], x0[std::size_t(t) * ld + c]);
          }
      }
    }
  }
}

// =============================================================================================
// LayerNorm, embedding, cross-entropy
// =============================================================================================

TEST_F(Cuda, LayerNorm) {
  for (const int H : {96, 1000}) {
    for (const DType act : {DType::F32, DType::BF16}) {
      const int T = 300;  // more than one row block of the dw/db reduction
      const std::string tag = std::string(name(act)) + " H=" + std::to_string(H);
      Vec x = randn(std::size_t(T) * H, rng_, 2.0f);
      for (std::size_t i = 0; i < x.size(); ++i) x[i] += 3.0f;  // a mean far from 0
      x = rounded(x, act);
      const Vec w = randn(H, rng_), b = randn(H, rng_);
      Vec out(x.size()), mean(T), rstd(T);
      cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), T,
                             H, 1e-5f);
      Dev xd = upload(x, act), wd = upload(w, DType::F32), bd = upload(b, DType::F32);
      Dev od(x.size() * 4), md(T * 4), rd(T * 4);
      cuda::layernorm_forward(od.get(), md.as<float>(), rd.as<float>(), xd.get(), wd.as<float>(),
                              bd.as<float>(), T, H, 1e-5f, act, stream_);
      // Statistics in double on both sides, rounded to fp32 once.
      expect_close(download(md, T, DType::F32), mean, 0.0, 1e-6, "layernorm mean " + tag);
      expect_close(download(rd, T, DType::F32), rstd, 0.0, 1e-6, "layernorm rstd " + tag);
      const double rtol = act == DType::BF16 ? kU + kRtol32 : kRtol32;
      expect_close(download(od, x.size(), act), out, 1e-5 * max_abs(out), rtol,
                   "layernorm out " + tag);

      // Backward: dx, dw, db accumulate into non-zero starts.
      const Vec dout = rounded(randn(x.size(), rng_), act);
      const Vec dx0 = rounded(randn(x.size(), rng_), act), dw0 = randn(H, rng_),
                db0 = randn(H, rng_);
      Vec dx = dx0, dw = dw0, db = db0;
      cpu::layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(),
                              mean.data(), rstd.data(), T, H);
      Dev gd = upload(dout, act), dxd = upload(dx0, act), dwd = upload(dw0, DType::F32),
          dbd = upload(db0, DType::F32);
      Dev meand = upload(mean, DType::F32), rstdd = upload(rstd, DType::F32);
      cuda::layernorm_backward(dxd.get(), dwd.as<float>(), dbd.as<float>(), gd.get(), xd.get(),
                               wd.as<float>(), meand.as<float>(), rstdd.as<float>(), T, H, act,
                               stream_);
      expect_close(download(dxd, x.size(), act), dx, 1e-5 * max_abs(dx), rtol,
                   "layernorm dx " + tag);
      // dw, db: the same partials of 256 rows in double, added in the same order.
      expect_close(download(dwd, H, DType::F32), dw, 1e-6 * max_abs(dw), 1e-5,
                   "layernorm dw " + tag);
      expect_close(download(dbd, H, DType::F32), db, 1e-6 * max_abs(db), 1e-5,
                   "layernorm db " + tag);
    }
  }
}

// Rows of the hidden size, and (H = A) the rows of a model's per-head query/key norms: T Z
// rows of one head's A values, many row blocks of a narrow dw (Note [Query/key norms]).
TEST_F(Cuda, RmsNorm) {
  for (const int H : {96, 1000, 24, 128}) {
    for (const DType act : {DType::F32, DType::BF16}) {
      const int T = H <= 128 ? 300 * 4 : 300;  // more than one row block of the dw reduction
      const std::string tag = std::string(name(act)) + " H=" + std::to_string(H);
      Vec x = randn(std::size_t(T) * H, rng_, 2.0f);
      for (std::size_t i = 0; i < x.size(); ++i) x[i] += 1.5f;  // not centred (no mean taken)
      x = rounded(x, act);
      const Vec w = randn(H, rng_);
      Vec out(x.size()), rstd(T);
      cpu::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), T, H, 1e-6f);
      Dev xd = upload(x, act), wd = upload(w, DType::F32), od(x.size() * 4), rd(T * 4);
      cuda::rmsnorm_forward(od.get(), rd.as<float>(), xd.get(), wd.as<float>(), T, H, 1e-6f, act,
                            stream_);
      // rstd from a sum of squares in double on both sides, rounded to fp32 once.
      expect_close(download(rd, T, DType::F32), rstd, 0.0, 1e-6, "rmsnorm rstd " + tag);
      const double rtol = act == DType::BF16 ? kU + kRtol32 : kRtol32;
      expect_close(download(od, x.size(), act), out, 1e-5 * max_abs(out), rtol,
                   "rmsnorm out " + tag);
      // Without rstd (a recomputed key norm keeps none): the same output, bit for bit.
      Dev od2(x.size() * 4);
      cuda::rmsnorm_forward(od2.get(), nullptr, xd.get(), wd.as<float>(), T, H, 1e-6f, act, stream_);
      expect_close(download(od2, x.size(), act), download(od, x.size(), act), 0.0, 0.0,
                   "rmsnorm out without rstd " + tag);

      // Backward: dx and dw accumulate into non-zero starts.
      const Vec dout = rounded(randn(x.size(), rng_), act);
      const Vec dx0 = rounded(randn(x.size(), rng_), act), dw0 = randn(H, rng_);
      Vec dx = dx0, dw = dw0;
      cpu::rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), w.data(), rstd.data(), T,
                            H);
      Dev gd = upload(dout, act), dxd = upload(dx0, act), dwd = upload(dw0, DType::F32),
          rstdd = upload(rstd, DType::F32);
      cuda::rmsnorm_backward(dxd.get(), dwd.as<float>(), gd.get(), xd.get(), wd.as<float>(),
                             rstdd.as<float>(), T, H, act, stream_);
      expect_close(download(dxd, x.size(), act), dx, 1e-5 * max_abs(dx), rtol,
                   "rmsnorm dx " + tag);
      // dw: the same partials of 256 rows in double, added in the same order.
      expect_close(download(dwd, H, DType::F32), dw, 1e-6 * max_abs(dw), 1e-5,
                   "rmsnorm dw " + tag);
    }
  }
}

// The residual add and the norm after it in one kernel: the same bits as add_inplace then the
// norm (which the tests above check against the CPU), and against a float64 naive norm of the
// stored sum.
TEST_F(Cuda, AddNormEqualsTheAddThenTheNorm) {
  for (const bool rms : {false, true}) {
    for (const int H : {96, 1000}) {
      for (const DType act : {DType::F32, DType::BF16}) {
        const int T = 37;  // rows past a block of eight warps
        const std::string tag = std::string(rms ? "rmsnorm " : "layernorm ") + name(act) + " H=" + std::to_string(H);
        Vec y0 = randn(std::size_t(T) * H, rng_, 2.0f);
        for (float& e : y0) e += 1.5f;  // a mean away from 0
        y0 = rounded(y0, act);
        const Vec x = rounded(randn(y0.size(), rng_), act);
        const Vec w = randn(H, rng_), b = randn(H, rng_);
        Dev xd = upload(x, act), wd = upload(w, DType::F32), bd = upload(b, DType::F32);
        // Unfused: the add, then the norm.
        Dev ya = upload(y0, act), oa(y0.size() * 4), ma(T * 4), ra(T * 4);
        cuda::add_inplace(ya.get(), act, xd.get(), act, i64(T) * H, stream_);
        if (rms)
          cuda::rmsnorm_forward(oa.get(), ra.as<float>(), ya.get(), wd.as<float>(), T, H, 1e-6f, act, stream_);
        else
          cuda::layernorm_forward(oa.get(), ma.as<float>(), ra.as<float>(), ya.get(), wd.as<float>(), bd.as<float>(),
                                  T, H, 1e-6f, act, stream_);
        // Fused.
        Dev yf = upload(y0, act), of(y0.size() * 4), mf(T * 4), rf(T * 4);
        cuda::add_norm_forward(yf.get(), xd.get(), of.get(), mf.as<float>(), rf.as<float>(), wd.as<float>(),
                               bd.as<float>(), T, H, 1e-6f, rms, act, stream_);
        const Vec y = download(yf, y0.size(), act), out = download(of, y0.size(), act);
        expect_equal(y, download(ya, y0.size(), act), "sum " + tag);
        expect_equal(out, download(oa, y0.size(), act), "out " + tag);
        expect_equal(download(rf, T, DType::F32), download(ra, T, DType::F32), "rstd " + tag);
        if (!rms) expect_equal(download(mf, T, DType::F32), download(ma, T, DType::F32), "mean " + tag);
        // Float64: the sum rounded once to the activation type, then the norm of it.
        Vec sum(y0.size()), ref(y0.size());
        for (std::size_t i = 0; i < sum.size(); ++i) sum[i] = y0[i] + x[i];
        sum = rounded(sum, act);
        expect_equal(y, sum, "sum against float64 " + tag);
        for (int t = 0; t < T; ++t) {
          double mu = 0, ss = 0;
          std::vector<double> v(H);
          for (int h = 0; h < H; ++h) {
            v[h] = sum[std::size_t(t) * H + h];
            mu += v[h];
          }
          mu = rms ? 0.0 : mu / H;
          for (int h = 0; h < H; ++h) ss += (v[h] - mu) * (v[h] - mu);
          const double r = 1.0 / std::sqrt(ss / H + 1e-6);
          for (int h = 0; h < H; ++h)
            ref[std::size_t(t) * H + h] = float((v[h] - mu) * r * w[h] + (rms ? 0.0 : b[h]));
        }
        const double rtol = act == DType::BF16 ? kU + kRtol32 : kRtol32;
        expect_close(out, ref, 1e-5 * max_abs(ref), rtol, "out against float64 " + tag);
      }
    }
  }
}

TEST_F(Cuda, Embedding) {
  const int T = 300, H = 96, V = 50;  // every id repeats
  const auto ids = rand_ids(T, V, rng_);
  const Vec embed = randn(std::size_t(V) * H, rng_);
  Dev idd = upload_raw(ids), ed = upload(embed, DType::F32);
  for (const DType act : {DType::F32, DType::BF16}) {
    const std::string tag = name(act);
    Vec out(std::size_t(T) * H);
    cpu::embedding_forward(out.data(), ids.data(), embed.data(), T, H);
    Dev od(out.size() * 4);
    cuda::embedding_forward(od.get(), idd.as<std::int32_t>(), ed.as<float>(), T, H, V, act,
                            stream_);
    expect_equal(download(od, out.size(), act), rounded(out, act), "embedding_forward " + tag);

    // The backward adds each id's rows in token order, as the CPU: the same bits.
    const Vec dout = rounded(randn(out.size(), rng_), act);
    const Vec de0 = randn(embed.size(), rng_);
    Vec de = de0;
    cpu::embedding_backward(de.data(), dout.data(), ids.data(), T, H, V);
    Dev dd = upload(dout, act), ded = upload(de0, DType::F32);
    cuda::embedding_backward(ded.as<float>(), dd.get(), idd.as<std::int32_t>(), T, H, V, act,
                             stream_);
    expect_equal(download(ded, de.size(), DType::F32), de, "embedding_backward " + tag);
  }
}

TEST_F(Cuda, CrossEntropy) {
  const int T = 13, V = 1000;
  Vec logits = randn(std::size_t(T) * V, rng_, 30.0f);                 // large logits
  for (int v = 0; v < V; ++v) logits[std::size_t(5) * V + v] += 1e4f;  // a row far from 0
  auto targets = rand_ids(T, V, rng_);
  targets[3] = sppo::kNoTarget;  // a position that is not predicted: no loss, no gradient
  const float scale = 1.0f / 37.0f;
  Vec dref = logits, losses(T);
  const double sum =
      cpu::xent_forward_backward(dref.data(), losses.data(), targets.data(), T, V, scale);
  Dev td = upload_raw(targets);
  for (const DType dt : {DType::F32, DType::BF16}) {
    Dev ld = upload(logits, DType::F32), lossd(T * 4), sumd = upload_raw(std::vector<double>{1.5});
    Dev sep(std::size_t(T) * V * 2);
    void* dlogits = dt == DType::F32 ? ld.get() : sep.get();  // in place in fp32
    cuda::xent_forward_backward(dlogits, dt, lossd.as<float>(), sumd.as<double>(), ld.as<float>(),
                                td.as<std::int32_t>(), T, V, scale, stream_);
    const Vec dgot = dt == DType::F32 ? download(ld, dref.size(), DType::F32)
                                      : download(sep, dref.size(), DType::BF16);
    const double rtol = dt == DType::BF16 ? kU + kRtol32 : kRtol32;
    // Probabilities far below the largest are tiny in absolute terms: atol 1e-7 grad_scale.
    expect_close(dgot, dref, 1e-7 * scale, rtol, std::string("xent dlogits ") + name(dt));
    // Losses: log(sum) + max - target, summed in double: fp32 noise of the logits' size.
    expect_close(download(lossd, T, DType::F32), losses, 1e-5, 1e-5, "xent losses");
    EXPECT_NEAR(download_double(sumd), 1.5 + sum, 1e-5 * (1.5 + std::fabs(sum)));
  }
}

TEST_F(Cuda, SoftmaxRows) {
  const i64 rows = 37;
  const int cols = 1000;
  const Vec x = randn(std::size_t(rows) * cols, rng_, 8.0f);
  Vec p = x, lse(rows);
  cpu::softmax_rows(p.data(), lse.data(), rows, cols, false);
  Dev xd = upload(x, DType::F32), lsed(std::size_t(rows) * 4);
  cuda::softmax_rows(xd.as<float>(), lsed.as<float>(), rows, cols, false, stream_);
  expect_close(download(xd, p.size(), DType::F32), p, 1e-7, 1e-5, "softmax_rows");
  expect_close(download(lsed, std::size_t(rows), DType::F32), lse, 1e-5, 1e-6, "softmax_rows lse");
  // From the LSE again (the backward's recomputation).
  Dev again = upload(x, DType::F32);
  cuda::softmax_rows(again.as<float>(), lsed.as<float>(), rows, cols, true, stream_);
  expect_close(download(again, p.size(), DType::F32), p, 1e-7, 1e-4, "softmax_rows from the LSE");
  // Backward: dx = p (dx - rowsum(dx p)).
  const Vec dx = randn(p.size(), rng_);
  Vec ref = dx;
  cpu::softmax_backward_rows(ref.data(), p.data(), rows, cols);
  Dev dxd = upload(dx, DType::F32), pd = upload(p, DType::F32);
  cuda::softmax_backward_rows(dxd.as<float>(), pd.as<float>(), rows, cols, stream_);
  expect_close(download(dxd, ref.size(), DType::F32), ref, 1e-7, 1e-5, "softmax_backward_rows");
}

TEST_F(Cuda, AttentionMerge) {
  const int Tq = 29, Z = 3, A = 40, ld = Z * A + 8;
  cpu::AttnDims d;
  d.Tq = Tq;
  d.Z = Z;
  d.A = A;
  d.ldq = d.ldk = d.ldv = d.ldo = ld;
  for (const DType dt : {DType::F32, DType::BF16}) {
    const Vec out = rounded(randn(std::size_t(Tq) * ld, rng_), dt), part = rounded(randn(out.size(), rng_), dt);
    Vec lse = randn(std::size_t(Z) * Tq, rng_, 3.0f), part_lse = randn(lse.size(), rng_, 3.0f);
    // Rows that see no key on one side, and on both.
    lse[1] = -std::numeric_limits<float>::infinity();
    part_lse[2] = -std::numeric_limits<float>::infinity();
    lse[4] = part_lse[4] = -std::numeric_limits<float>::infinity();
    Vec out_ref = out, lse_ref = lse;
    cpu::attention_merge(out_ref.data(), lse_ref.data(), part.data(), part_lse.data(), d);
    cuda::AttnDims gd;
    gd.Tq = Tq;
    gd.Z = Z;
    gd.A = A;
    gd.ldq = gd.ldk = gd.ldv = gd.ldo = ld;
    Dev od = upload(out, dt), pd = upload(part, dt), lsed = upload(lse, DType::F32), plsed = upload(part_lse, DType::F32);
    cuda::attention_merge(od.get(), lsed.as<float>(), pd.get(), plsed.as<float>(), gd, dt, stream_);
    const double rtol = dt == DType::BF16 ? kU + kRtol32 : kRtol32;
    expect_close(download(od, out.size(), dt), rounded(out_ref, dt), 1e-6, rtol,
                 std::string("attention_merge out ") + name(dt));
    expect_close(download(lsed, lse.size(), DType::F32), lse_ref, 1e-6, 1e-6, "attention_merge lse");
  }
}

// =============================================================================================
// Attention
// =============================================================================================

struct AttnCase {
  std::string name;
  int Tq;
  i64 q_pos0;
  std::vector<std::pair<int, i64>> blocks;  // (Tk, k_pos0) of each KV block, in call order
  float qk_scale = 1.0f;
  bool strided = false;  // q/k/v with the row stride of a [T, 3H] qkv buffer; out, dq padded
};

std::vector<AttnCase> attn_cases() {
  return {
      {"whole", 197, 0, {{197, 0}}},
      // Unequal blocks, an empty one, and one no query sees.
      {"blocks",
       150,
       204,
       {{70, 0}, {129, 70}, {5, 199}, {0, 204}, {150, 204}, {40, 10000}},
       1.0f,
       true},
      {"one_query", 1, 300, {{300, 0}, {1, 300}}},
      {"prefix", 256, 3000, {{3000, 0}, {256, 3000}}, 1.0f, true},
      {"unseen_rows", 30, 0, {{40, 10}}},
      {"large_logits", 133, 0, {{133, 0}}, 3.0f},
  };
}

struct AttnProblem {
  cpu::AttnDims d;  // the GPU's strides too (the CPU's backward gets q in dq's stride)
  int lddq = 0;     // dq's stride
  Vec q, dout;
  std::vector<Vec> k, v;
  std::vector<std::pair<int, i64>> blocks;
};

// Zkv: key/value heads (grouped-query attention; 0 means Z). Strided q, k, v share the row of a
// fused [T, (Z + 2 Zkv) A] q/k/v projection.
AttnProblem make_problem(const AttnCase& c, int Z, int A, DType act, std::mt19937& rng,
                         int Zkv = 0) {
  AttnProblem p;
  const int H = Z * A, Hkv = (Zkv ? Zkv : Z) * A;
  p.d.Tq = c.Tq;
  p.d.Z = Z;
  p.d.Zkv = Zkv;
  p.d.A = A;
  p.d.q_pos0 = c.q_pos0;
  p.d.ldq = c.strided ? H + 2 * Hkv : H;
  p.d.ldk = p.d.ldv = c.strided ? H + 2 * Hkv : Hkv;
  p.d.ldo = c.strided ? H + 8 : H;
  p.lddq = c.strided ? 3 * H + 8 : H;
  p.blocks = c.blocks;
  p.q = rounded(randn(std::size_t(c.Tq) * p.d.ldq, rng, c.qk_scale), act);
  p.dout = rounded(randn(std::size_t(c.Tq) * p.d.ldo, rng), act);
  for (const auto& [Tk, pos] : c.blocks) {
    p.k.push_back(rounded(randn(std::size_t(Tk) * p.d.ldk, rng, c.qk_scale), act));
    p.v.push_back(rounded(randn(std::size_t(Tk) * p.d.ldv, rng), act));
  }
  return p;
}

// Sums of |terms| of every output (Note [Tolerances]), from a float64 softmax. Two kinds:
//   bf16 rounding of an intermediate: out = sum_j P_j |v_j|, dq = sum_j |dS_j| |k_j|,
//     dk = sum_t |dS_tj| |q_t|, dv = sum_t P_tj |dO_t|.
//   fp32 noise ("full"): the two sides compute S = q.k and dP = dO.v in fp32 in different
//     orders (errors up to 2 A 2^-24 sum |q||k|, resp. sum |dO||v|), which moves P by
//     scale * that (relative) and dS = P (dP - delta) scale by P times that even where
//     dP - delta cancels; the sums over keys (queries) then add n 2^-24 of their terms.
//     So the fp32 part of an error is at most 2 (A + n + 8) 2^-24 (twice that where tensor
//     cores truncate in their fp32 accumulation) times
//       out_full = sum_j P_j f_j |v_j|, dq_full = sum_j D_j |k_j|, dk_full = sum_t D_tj |q_t|,
//       dv_full = sum_t P_tj f_tj |dO_t|,
//     with f = 1 + scale sum |q||k| and D = P (sum |dO||v| + |delta|) f scale.
struct AttnMagnitudes {
  std::vector<double> out, dq, out_full, dq_full;             // [Tq, H]
  std::vector<std::vector<double>> dk, dv, dk_full, dv_full;  // per block [Tk, Zkv A]
  int max_terms = 0;  // the largest number of keys a query sees, or queries a key sees
};

AttnMagnitudes attn_magnitudes(const AttnProblem& p) {
  const auto& d = p.d;
  const int Zkv = d.Zkv ? d.Zkv : d.Z;
  const int H = d.Z * d.A, Hkv = Zkv * d.A, A = d.A;
  const double scale = 1.0 / std::sqrt(double(A));
  AttnMagnitudes m;
  m.out.assign(std::size_t(d.Tq) * H, 0.0);
  m.dq.assign(std::size_t(d.Tq) * H, 0.0);
  m.out_full.assign(std::size_t(d.Tq) * H, 0.0);
  m.dq_full.assign(std::size_t(d.Tq) * H, 0.0);
  for (const auto& [Tk, pos] : p.blocks) {
    for (auto* v : {&m.dk, &m.dv, &m.dk_full, &m.dv_full})
      v->emplace_back(std::size_t(Tk) * Hkv, 0.0);
  }
  m.max_terms = d.Tq * (d.Z / Zkv);  // a key's dk, dv sum over every query head that reads it
  struct Key {
    int b, s;
  };
  std::vector<Key> keys;
  std::vector<double> sc, pr, dp, sqk, sdv;
  for (int z = 0; z < d.Z; ++z)
    for (int t = 0; t < d.Tq; ++t) {
      const int zk = z / (d.Z / Zkv);  // the key/value head query head z reads
      const float* qt = p.q.data() + std::size_t(t) * d.ldq + z * A;
      const float* dot = p.dout.data() + std::size_t(t) * d.ldo + z * A;
      keys.clear();
      sc.clear();
      dp.clear();
      sqk.clear();
      sdv.clear();
      for (int b = 0; b < int(p.blocks.size()); ++b)
        for (int s = 0; s < p.blocks[b].first; ++s) {
          if (p.blocks[b].second + s > d.q_pos0 + t) break;
          const float* kr = p.k[b].data() + std::size_t(s) * d.ldk + zk * A;
          const float* vr = p.v[b].data() + std::size_t(s) * d.ldv + zk * A;
          double a1 = 0.0, a2 = 0.0, a3 = 0.0, a4 = 0.0;
          for (int a = 0; a < A; ++a) {
            a1 += double(qt[a]) * kr[a];
            a2 += double(dot[a]) * vr[a];
            a3 += std::fabs(double(qt[a]) * kr[a]);
            a4 += std::fabs(double(dot[a]) * vr[a]);
          }
          keys.push_back({b, s});
          sc.push_back(a1 * scale);
          dp.push_back(a2);
          sqk.push_back(a3);
          sdv.push_back(a4);
        }
      if (keys.empty()) continue;
      m.max_terms = std::max(m.max_terms, int(keys.size()));
      const double mx = *std::max_element(sc.begin(), sc.end());
      pr.assign(keys.size(), 0.0);
      double l = 0.0;
      for (std::size_t j = 0; j < keys.size(); ++j) l += pr[j] = std::exp(sc[j] - mx);
      double delta = 0.0;
      for (std::size_t j = 0; j < keys.size(); ++j) {
        pr[j] /= l;
        delta += pr[j] * dp[j];
      }
      for (std::size_t j = 0; j < keys.size(); ++j) {
        const auto [b, s] = keys[j];
        const double ds = std::fabs(pr[j] * (dp[j] - delta) * scale);
        const double f = 1.0 + scale * sqk[j];
        const double ds_full = pr[j] * (sdv[j] + std::fabs(delta)) * f * scale;
        const float* kr = p.k[b].data() + std::size_t(s) * d.ldk + zk * A;
        const float* vr = p.v[b].data() + std::size_t(s) * d.ldv + zk * A;
        for (int a = 0; a < A; ++a) {
          const std::size_t qi = std::size_t(t) * H + z * A + a;
          const std::size_t ki = std::size_t(s) * Hkv + zk * A + a;
          m.out[qi] += pr[j] * std::fabs(vr[a]);
          m.dq[qi] += ds * std::fabs(kr[a]);
          m.dk[b][ki] += ds * std::fabs(qt[a]);
          m.dv[b][ki] += pr[j] * std::fabs(dot[a]);
          m.out_full[qi] += pr[j] * f * std::fabs(vr[a]);
          m.dq_full[qi] += ds_full * std::fabs(kr[a]);
          m.dk_full[b][ki] += ds_full * std::fabs(qt[a]);
          m.dv_full[b][ki] += pr[j] * f * std::fabs(dot[a]);
        }
      }
    }
  return m;
}

// Per-element atol (Note [Tolerances]): `bf16_frac` times the rounding magnitude plus `fp32_frac`
// times the fp32-noise magnitude.
std::vector<double> attn_atol(const std::vector<double>& mag, double bf16_frac,
                              const std::vector<double>& full, double fp32_frac) {
  std::vector<double> a(mag.size());
  for (std::size_t i = 0; i < mag.size(); ++i) a[i] = bf16_frac * mag[i] + fp32_frac * full[i];
  return a;
}

// Runs one case on the GPU with `kernel` and compares forward (out, lse), delta and backward
// (dq, dk, dv) with the CPU kernels. Returns the GPU's backward results for determinism checks.
struct AttnGrads {
  Vec out, lse;  // the forward's
  Vec dq;
  std::vector<Vec> dk, dv;
};

// Zkv: key/value heads (grouped-query attention; 0 means Z).
AttnGrads check_attention(const AttnCase& c, int Z, int A, DType act, cuda::AttnKernel kernel,
                          std::mt19937& rng, cudaStream_t stream, int Zkv = 0) {
  const AttnProblem p = make_problem(c, Z, A, act, rng, Zkv);
  const cpu::AttnDims& d = p.d;
  const int H = Z * A, Hkv = (Zkv ? Zkv : Z) * A, nb = int(p.blocks.size());
  const std::string tag = c.name + " " + name(act) + " A=" + std::to_string(A) +
                          (Zkv ? " Z=" + std::to_string(Z) + " Zkv=" + std::to_string(Zkv) : "") +
                          (kernel == cuda::AttnKernel::Simt         ? " simt"
                           : kernel == cuda::AttnKernel::TensorCore ? " tc"
                                                                    : " auto");
  const AttnMagnitudes mag = attn_magnitudes(p);
  const bool bf = act == DType::BF16;
  // Note [Tolerances]: fp32 rtol 1e-4 and the fp32 noise of attn_magnitudes; bf16 adds one
  // rounding of the output (rtol u) and the rounding of P (forward, dV) or dS (dQ, dK) before
  // their products (atol 1.1 u mag, 10% for second-order terms).
  const double rtol = bf ? kU + kRtol32 : kRtol32;
  const double bf16_frac = bf ? 1.1 * kU : 0.0;
  // Two fp32 sums of A + n terms, one of them maybe in tensor cores that truncate: 4, not 2.
  const double fp32_frac = 4.0 * (A + mag.max_terms + 8) * kU32;

  // ---- forward ----
  std::vector<cpu::KVBlock> cblocks;
  for (int b = 0; b < nb; ++b)
    cblocks.push_back(
        {p.k[b].data(), p.v[b].data(), nullptr, nullptr, p.blocks[b].first, p.blocks[b].second});
  const Vec out0 =
      randn(std::size_t(c.Tq) * d.ldo, rng);  // poison: must be overwritten (or left, past H)
  Vec out_ref = out0, lse_ref(std::size_t(Z) * c.Tq);
  cpu::attention_forward_blocks(out_ref.data(), lse_ref.data(), p.q.data(), cblocks, d);

  Dev qd = upload(p.q, act), dod = upload(p.dout, act), outd = upload(out0, act);
  Dev lsed(lse_ref.size() * 4);
  std::vector<Dev> kd, vd, dkd, dvd;
  std::vector<Vec> dk0, dv0;
  std::vector<cuda::KVBlock> gblocks;
  for (int b = 0; b < nb; ++b) {
    kd.push_back(upload(p.k[b], act));
    vd.push_back(upload(p.v[b], act));
    dk0.push_back(randn(p.k[b].size(), rng));
    dv0.push_back(randn(p.v[b].size(), rng));
    dkd.push_back(upload(dk0[b], DType::F32));
    dvd.push_back(upload(dv0[b], DType::F32));
    gblocks.push_back({kd[b].get(), vd[b].get(), dkd[b].as<float>(), dvd[b].as<float>(),
                       p.blocks[b].first, p.blocks[b].second});
  }
  cuda::AttnDims gd;
  gd.Tq = c.Tq;
  gd.Z = Z;
  gd.A = A;
  gd.q_pos0 = c.q_pos0;
  gd.ldq = d.ldq;
  gd.ldk = d.ldk;
  gd.ldv = d.ldv;
  gd.ldo = d.ldo;
  gd.lddq = p.lddq;
  gd.Zkv = Zkv;
  cuda::attention_forward_blocks(outd.get(), lsed.as<float>(), qd.get(), gblocks, gd, act, stream,
                                 kernel);
  const Vec out = download(outd, out0.size(), act);
  expect_close(cols(out, c.Tq, H, d.ldo), cols(out_ref, c.Tq, H, d.ldo), 0.0, rtol, "out " + tag,
               attn_atol(mag.out, bf16_frac, mag.out_full, fp32_frac));
  for (int t = 0; t < c.Tq; ++t)
    for (int col = H; col < d.ldo; ++col)
      EXPECT_EQ(out[std::size_t(t) * d.ldo + col],
                rounded({out0[std::size_t(t) * d.ldo + col]}, act)[0])
          << "out padding " << tag;
  // lse is fp32 from fp32 scores: fp32 noise of the scores' size (|scores| up to ~10).
  const Vec lse = download(lsed, lse_ref.size(), DType::F32);
  expect_close(lse, lse_ref, 1e-5 * (1.0 + c.qk_scale * c.qk_scale), 1e-5, "lse " + tag);

  // ---- delta, on the CPU's output (rounded as the GPU would hold it) ----
  const Vec out_act = rounded(out_ref, act);
  Vec delta_ref(std::size_t(Z) * c.Tq);
  cpu::attention_backward_delta(delta_ref.data(), p.dout.data(), out_act.data(), d);
  Dev outa = upload(out_act, act), deltad(delta_ref.size() * 4);
  cuda::attention_backward_delta(deltad.as<float>(), dod.get(), outa.get(), gd, act, stream);
  {
    // Sums in double on both sides: only the final rounding to fp32 differs.
    expect_close(download(deltad, delta_ref.size(), DType::F32), delta_ref,
                 1e-6 * max_abs(delta_ref), 1e-6, "delta " + tag);
  }

  // ---- backward, both sides given the CPU's lse and delta; dq, dk, dv from non-zero starts ----
  // The CPU reads q and writes dq with one stride: give it q laid out with dq's stride.
  cpu::AttnDims dc = d;
  dc.ldq = p.lddq;
  Vec q_cpu(std::size_t(c.Tq) * p.lddq, 0.0f);
  for (int t = 0; t < c.Tq; ++t)
    for (int col = 0; col < H; ++col)
      q_cpu[std::size_t(t) * p.lddq + col] = p.q[std::size_t(t) * d.ldq + col];
  const Vec dq0 = rounded(randn(std::size_t(c.Tq) * p.lddq, rng), act);
  Vec dq_ref = dq0;
  std::vector<Vec> dk_ref = dk0, dv_ref = dv0;
  for (int b = 0; b < nb; ++b) {
    cblocks[b].dk = dk_ref[b].data();
    cblocks[b].dv = dv_ref[b].data();
  }
  cpu::attention_backward_blocks(dq_ref.data(), p.dout.data(), q_cpu.data(), cblocks,
                                 lse_ref.data(), delta_ref.data(), dc);

  Dev dqd = upload(dq0, act);
  Dev lse_cpu = upload(lse_ref, DType::F32), delta_cpu = upload(delta_ref, DType::F32);
  cuda::attention_backward_blocks(dqd.get(), dod.get(), qd.get(), gblocks, lse_cpu.as<float>(),
                                  delta_cpu.as<float>(), gd, act, stream, kernel);
  AttnGrads g;
  g.out = out;
  g.lse = lse;
  g.dq = download(dqd, std::size_t(c.Tq) * p.lddq, act);
  expect_close(cols(g.dq, c.Tq, H, p.lddq), cols(dq_ref, c.Tq, H, p.lddq), 0.0, rtol, "dq " + tag,
               attn_atol(mag.dq, bf16_frac, mag.dq_full, fp32_frac));
  for (int b = 0; b < nb; ++b) {
    const int Tk = p.blocks[b].first;
    g.dk.push_back(download(dkd[b], dk0[b].size(), DType::F32));
    g.dv.push_back(download(dvd[b], dv0[b].size(), DType::F32));
    const std::string bt = " block " + std::to_string(b) + " " + tag;
    // dk, dv are fp32 accumulators: no final rounding, only the products' roundings.
    expect_close(cols(g.dk[b], Tk, Hkv, d.ldk), cols(dk_ref[b], Tk, Hkv, d.ldk), 0.0, kRtol32,
                 "dk" + bt, attn_atol(mag.dk[b], bf16_frac, mag.dk_full[b], fp32_frac));
    expect_close(cols(g.dv[b], Tk, Hkv, d.ldv), cols(dv_ref[b], Tk, Hkv, d.ldv), 0.0, kRtol32,
                 "dv" + bt, attn_atol(mag.dv[b], bf16_frac, mag.dv_full[b], fp32_frac));
  }
  return g;
}

TEST_F(Cuda, AttentionFp32) {
  for (const AttnCase& c : attn_cases())
    for (const int A : {16, 64})
      check_attention(c, 2, A, DType::F32, cuda::AttnKernel::Auto, rng_, stream_);
  // The largest head size the SIMT kernels take.
  check_attention(attn_cases()[1], 1, 256, DType::F32, cuda::AttnKernel::Auto, rng_, stream_);
}

TEST_F(Cuda, AttentionBf16TensorCores) {
  for (const AttnCase& c : attn_cases())
    for (const int A : {64, 128})
      check_attention(c, 2, A, DType::BF16, cuda::AttnKernel::TensorCore, rng_, stream_);
}

TEST_F(Cuda, AttentionBf16Simt) {
  for (const AttnCase& c : attn_cases())
    check_attention(c, 2, 32, DType::BF16, cuda::AttnKernel::Auto, rng_, stream_);
  // The SIMT kernels on a head size the tensor cores also take.
  check_attention(attn_cases()[1], 2, 64, DType::BF16, cuda::AttnKernel::Simt, rng_, stream_);
}

// The same inputs twice give the same bits: no atomics in either backward kernel.
TEST_F(Cuda, AttentionBackwardIsDeterministic) {
  for (const auto kernel : {cuda::AttnKernel::TensorCore, cuda::AttnKernel::Simt}) {
    std::mt19937 r1(7), r2(7);
    const AttnCase c = attn_cases()[3];  // prefix
    const AttnGrads a = check_attention(c, 2, 64, DType::BF16, kernel, r1, stream_);
    const AttnGrads b = check_attention(c, 2, 64, DType::BF16, kernel, r2, stream_);
    expect_equal(a.dq, b.dq, "dq run to run");
    for (std::size_t i = 0; i < a.dk.size(); ++i) {
      expect_equal(a.dk[i], b.dk[i], "dk run to run");
      expect_equal(a.dv[i], b.dv[i], "dv run to run");
    }
  }
}

// Grouped-query attention: Z = 4 query heads over Zkv = 2 and 1 key/value heads, so that a
// dkdv block sums the terms of 2 or 4 query heads (its query-tile pipeline running on from one
// head into the next). Cases: strided blocks (an empty one, one no query sees), and causal
// offsets with several query tiles per head and key tiles first seen mid-way.
std::vector<AttnCase> gqa_cases() {
  return {attn_cases()[1], {"gqa_offsets", 200, 100, {{64, 0}, {100, 64}, {200, 164}}}};
}

TEST_F(Cuda, AttentionGqaFp32) {
  for (const int Zkv : {2, 1})
    for (const AttnCase& c : gqa_cases())
      check_attention(c, 4, 64, DType::F32, cuda::AttnKernel::Auto, rng_, stream_, Zkv);
}

TEST_F(Cuda, AttentionGqaBf16TensorCores) {
  for (const int Zkv : {2, 1})
    for (const AttnCase& c : gqa_cases())
      for (const int A : {64, 128})
        check_attention(c, 4, A, DType::BF16, cuda::AttnKernel::TensorCore, rng_, stream_, Zkv);
}

TEST_F(Cuda, AttentionGqaBf16Simt) {
  for (const int Zkv : {2, 1})
    for (const AttnCase& c : gqa_cases())
      check_attention(c, 4, 32, DType::BF16, cuda::AttnKernel::Auto, rng_, stream_, Zkv);
}

// Zkv = Z is plain multi-head attention: the same bits as Zkv = 0 (the same inputs: strides and
// draws do not change), and the grouped backward is deterministic too.
TEST_F(Cuda, AttentionGqaSameBitsAsMultiHeadAndDeterministic) {
  for (const auto kernel : {cuda::AttnKernel::TensorCore, cuda::AttnKernel::Simt}) {
    const AttnCase c = gqa_cases()[1];
    std::mt19937 r1(7), r2(7);
    const AttnGrads a = check_attention(c, 2, 64, DType::BF16, kernel, r1, stream_, 0);
    const AttnGrads b = check_attention(c, 2, 64, DType::BF16, kernel, r2, stream_, 2);
    expect_equal(a.out, b.out, "out Zkv = Z against Zkv = 0");
    expect_equal(a.lse, b.lse, "lse Zkv = Z against Zkv = 0");
    expect_equal(a.dq, b.dq, "dq Zkv = Z against Zkv = 0");
    for (std::size_t i = 0; i < a.dk.size(); ++i) {
      expect_equal(a.dk[i], b.dk[i], "dk Zkv = Z against Zkv = 0");
      expect_equal(a.dv[i], b.dv[i], "dv Zkv = Z against Zkv = 0");
    }
    std::mt19937 r3(8), r4(8);
    const AttnGrads g1 = check_attention(c, 4, 64, DType::BF16, kernel, r3, stream_, 1);
    const AttnGrads g2 = check_attention(c, 4, 64, DType::BF16, kernel, r4, stream_, 1);
    expect_equal(g1.dq, g2.dq, "grouped dq run to run");
    for (std::size_t i = 0; i < g1.dk.size(); ++i) {
      expect_equal(g1.dk[i], g2.dk[i], "grouped dk run to run");
      expect_equal(g1.dv[i], g2.dv[i], "grouped dv run to run");
    }
  }
}

// Bad arguments are refused with a message naming the component.
TEST_F(Cuda, AttentionRefusesWhatItCannotRun) {
  cuda::AttnDims d;
  d.Tq = 4;
  d.Z = 1;
  d.A = 48;
  Dev buf(4096);
  const std::vector<cuda::KVBlock> blocks{{buf.get(), buf.get(), nullptr, nullptr, 4, 0}};
  EXPECT_THROW(cuda::attention_forward_blocks(buf.get(), buf.as<float>(), buf.get(), blocks, d,
                                              DType::BF16, stream_, cuda::AttnKernel::TensorCore),
               Error);
  d.A = 3;
  EXPECT_THROW(cuda::attention_forward_blocks(buf.get(), buf.as<float>(), buf.get(), blocks, d,
                                              DType::F32, stream_),
               Error);
  std::vector<cuda::KVBlock> many(cuda::kMaxKVBlocks + 1, blocks[0]);
  d.A = 16;
  EXPECT_THROW(cuda::attention_forward_blocks(buf.get(), buf.as<float>(), buf.get(), many, d,
                                              DType::F32, stream_),
               Error);
  // Key/value heads that do not divide the query heads.
  d.Z = 4;
  d.Zkv = 3;
  EXPECT_THROW(cuda::attention_forward_blocks(buf.get(), buf.as<float>(), buf.get(), blocks, d,
                                              DType::F32, stream_),
               Error);
}

}  // namespace
}  // namespace sppo
