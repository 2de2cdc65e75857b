#include "train/peak.h"

#include <cblas.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <vector>

#include "core/check.h"
#include "core/timing.h"
#include "backends/cpu/blas_setup.h"
#include "backends/cpu/ops.h"

namespace sppo {

namespace {

// Note [FMA peak loop]
// Each iteration updates kChains independent accumulators, acc = acc * m + a, all in
// registers. Chains hide the FMA latency: a core retiring two FMAs a cycle with a 4-5
// cycle latency needs 8-10 chains in flight; 12 (16 for AVX-512, which has 32 registers)
// leave a margin. The chain loop is unrolled by pragma so that acc[] lives in registers at
// any optimisation level. acc converges to a / (1 - m), so values stay normal and finite.
// Each function is compiled for its instruction set whatever the build flags, and chosen
// at run time from cpuid.
constexpr float kFmaMul = 0.999999f, kFmaAdd = 1e-7f;

__attribute__((target("avx512f"))) float fma_loop_avx512(i64 iters) {
  constexpr int kChains = 16;
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(float(c));
  const __m512 m = _mm512_set1_ps(kFmaMul), a = _mm512_set1_ps(kFmaAdd);
  for (i64 k = 0; k < iters; ++k)
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], m, a);
  __m512 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[c]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum);
  float r = 0;
  for (float x : lanes) r += x;
  return r;
}

__attribute__((target("avx2,fma"))) float fma_loop_avx2(i64 iters) {
  constexpr int kChains = 12;
  __m256 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_ps(float(c));
  const __m256 m = _mm256_set1_ps(kFmaMul), a = _mm256_set1_ps(kFmaAdd);
  for (i64 k = 0; k < iters; ++k)
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], m, a);
  __m256 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm256_add_ps(sum, acc[c]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  float r = 0;
  for (float x : lanes) r += x;
  return r;
}

float fma_loop_sse(i64 iters) {  // no FMA: a multiply and an add, two FLOPs as well
  constexpr int kChains = 12;
  __m128 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm_set1_ps(float(c));
  const __m128 m = _mm_set1_ps(kFmaMul), a = _mm_set1_ps(kFmaAdd);
  for (i64 k = 0; k < iters; ++k)
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) acc[c] = _mm_add_ps(_mm_mul_ps(acc[c], m), a);
  __m128 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm_add_ps(sum, acc[c]);
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, sum);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

void fill_normal(float* p, i64 n, float sd, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.0f, sd);
  for (i64 k = 0; k < n; ++k) p[k] = d(rng);
}

}  // namespace

GemmPeak measure_gemm_peak(int n, int reps) {
  std::vector<float> a(std::size_t(n) * n), b(a.size()), c(a.size());
  std::mt19937_64 rng(7);
  fill_normal(a.data(), i64(a.size()), 1.0f, rng);
  fill_normal(b.data(), i64(b.size()), 1.0f, rng);
  std::vector<double> t;
  for (int r = 0; r < reps + 1; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    cpu::gemm(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    if (r > 0) t.push_back(seconds_since(t0));
  }
  GemmPeak g;
  g.flops_per_s = 2.0 * double(n) * n * n / median(t);
  g.blas_core = openblas_get_corename();
  return g;
}

FmaPeak measure_fma_peak(double seconds) {
  const cpu::CpuFeatures f = cpu::cpu_features();
  FmaPeak p;
  float (*loop)(i64) = fma_loop_sse;
  double flops_per_iter = 12 * 4 * 2;
  p.isa = "sse";
  if (f.avx512f) {
    loop = fma_loop_avx512, flops_per_iter = 16 * 16 * 2, p.isa = "avx512";
  } else if (f.avx2 && f.fma) {
    loop = fma_loop_avx2, flops_per_iter = 12 * 8 * 2, p.isa = "avx2+fma";
  }
  // Every thread runs `iters` iterations between two barriers; the rate is all their
  // FLOPs over the wall time between the barriers.
  auto run = [&](i64 iters) {
    double wall = 0;
    int threads = 1;
    float sink = 0;
#pragma omp parallel reduction(+ : sink)
    {
#pragma omp single
      threads = omp_get_num_threads();
#pragma omp barrier
      const auto t0 = std::chrono::steady_clock::now();
      sink += loop(iters);
#pragma omp barrier
#pragma omp master
      wall = seconds_since(t0);
    }
    SPPO_ASSERT(sink == sink);  // keeps the loops' results alive
    p.threads = threads;
    return double(threads) * double(iters) * flops_per_iter / wall;
  };
  i64 iters = 1 << 14;
  while (true) {  // calibrate: long enough to time, and to lift the clock to its running rate
    const auto t0 = std::chrono::steady_clock::now();
    run(iters);
    if (seconds_since(t0) > seconds / 4 || iters > (i64{1} << 40)) break;
    iters *= 2;
  }
  iters *= 4;
  for (int r = 0; r < 3; ++r) p.flops_per_s = std::max(p.flops_per_s, run(iters));
  return p;
}

}  // namespace sppo
