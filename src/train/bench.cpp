#include "train/bench.h"

#include <cblas.h>
#include <immintrin.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <random>

#include "core/check.h"
#include "core/layout.h"
#include "backends/cpu/blas_setup.h"
#include "backends/cpu/ops.h"
#include "model/gpt.h"
#include "runtime/memory.h"

namespace sppo {

namespace {

// Note [FMA peak loop]
// Each iteration updates kChains independent accumulators, acc = acc * m + a, all in
// registers. Chains hide the FMA latency: a core retiring two FMAs a cycle with a 4-5
// cycle latency needs 8-10 chains in flight; 12 (16 for AVX-512, which has 32 registers)
// leave a margin. acc converges to a / (1 - m), so values stay normal and finite.
// Each function is compiled for its instruction set whatever the build flags, and chosen
// at run time from cpuid.
constexpr float kFmaMul = 0.999999f, kFmaAdd = 1e-7f;

__attribute__((target("avx512f"))) float fma_loop_avx512(i64 iters) {
  constexpr int kChains = 16;
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(float(c));
  const __m512 m = _mm512_set1_ps(kFmaMul), a = _mm512_set1_ps(kFmaAdd);
  for (i64 k = 0; k < iters; ++k)
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
    for (int c = 0; c < kChains; ++c) acc[c] = _mm_add_ps(_mm_mul_ps(acc[c], m), a);
  __m128 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm_add_ps(sum, acc[c]);
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, sum);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
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

nlohmann::json bench_layer(int hidden, int heads, i64 S, int reps) {
  ModelConfig c;
  c.vocab = 256;
  c.hidden = hidden;
  c.heads = heads;
  c.layers = 1;
  c.validate();
  SPPO_CHECK(reps >= 1, "options") << "--reps must be at least 1 (got " << reps << ")";
  SPPO_CHECK(S >= 2 && S <= INT_MAX, "options")
      << "--seq-len " << S << " is outside [2, " << INT_MAX << "]: the kernels index tokens with 32-bit ints";
  {
    // What the benchmark holds at once, in doubles so that nothing overflows: the block's
    // saved tensors and workspace, output, dK, dV, parameters and gradients.
    const double H = hidden, bytes_per_token =
                                  double(total_bytes(block_saved_specs(c, 1, ActPrecision::F32)) +
                                         total_bytes(block_workspace_specs(c, 1, ActPrecision::F32))) +
                                  3 * H * 4;
    const double need = double(S) * bytes_per_token + 2.0 * double(c.num_params()) * 4;
    const double have = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
    SPPO_CHECK(have <= 0 || need <= have, "options")
        << "bench layer at --seq-len " << S << " with --hidden " << hidden << " needs about "
        << format_bytes(need) << " of memory, more than this machine's " << format_bytes(have)
        << "; use --seq-len " << i64(double(S) * have / need * 0.8) << " or less";
  }
  const int T = int(S);
  const FmaPeak fma = measure_fma_peak();
  const GemmPeak peak = measure_gemm_peak();

  MemoryTier device(Tier::Device, 0);
  std::mt19937_64 rng(11);
  const i64 P = c.num_params();
  Buffer params = device.alloc(P * 4, "parameters"), grads = device.alloc_zeroed(P * 4, "gradients");
  fill_normal(params.f32(), P, 0.02f, rng);
  ParamView pv = param_view(c, params.f32()), gv = param_view(c, grads.f32());
  const MatrixView mv = matrix_view(c, params.data(), DType::F32, 0, c.layers);
  const auto be = make_backend("cpu");
  std::fill(pv.blocks[0].ln1_w, pv.blocks[0].ln1_w + hidden, 1.0f);
  std::fill(pv.blocks[0].ln2_w, pv.blocks[0].ln2_w + hidden, 1.0f);

  std::vector<double> times;
  device.reset_peak();
  for (int r = 0; r < reps + 1; ++r) {
    std::vector<Buffer> saved, ws;
    for (const auto& s : block_saved_specs(c, T, ActPrecision::F32)) saved.push_back(device.alloc(s.bytes(), s.name));
    Buffer x_out = device.alloc(i64(T) * hidden * 4, "block output");
    fill_normal(saved[0].f32(), i64(T) * hidden, 1.0f, rng);
    Buffer dk = device.alloc_zeroed(i64(T) * hidden * 4, "dK"), dv = device.alloc_zeroed(i64(T) * hidden * 4, "dV");
    const auto t0 = std::chrono::steady_clock::now();
    for (const auto& s : block_workspace_specs(c, T, ActPrecision::F32)) ws.push_back(device.alloc(s.bytes(), s.name));
    std::vector<void*> sp, wp;
    for (auto& b : saved) sp.push_back(b.data());
    for (auto& b : ws) wp.push_back(b.data());
    BlockSaved bs = block_saved_from(sp);
    const BlockWorkspace w = block_workspace_from(wp);
    const Subseq q{0, T};
    block_forward(*be, x_out.data(), bs, pv.blocks[0], mv.blocks[0], w, KVBlocks{}, c, q);
    const double t_fwd = seconds_since(t0);
    // The gradient arriving from above: a random tensor in the output's buffer (untimed).
    fill_normal(x_out.f32(), i64(T) * hidden, 1.0f, rng);
    const auto t1 = std::chrono::steady_clock::now();
    block_backward(*be, x_out.data(), gv.blocks[0], dk.f32(), dv.f32(), bs, pv.blocks[0], mv.blocks[0], w, KVBlocks{},
                   c, q);
    if (r > 0) times.push_back(t_fwd + seconds_since(t1));
  }
  const double t = median(times);
  const double H = hidden, Sd = double(S);
  const double fwd = 24.0 * Sd * H * H + 4.0 * Sd * H * (Sd + 1.0) / 2.0;
  const double model_flops = 3.0 * fwd;
  nlohmann::json j = {{"hidden", hidden},
                      {"heads", heads},
                      {"seq_len", S},
                      {"threads", omp_get_max_threads()},
                      {"blas_core", peak.blas_core},
                      {"blas_core_description", cpu::blas_core_description()},
                      {"step_time_s", t},
                      {"tokens_per_s", Sd / t},
                      {"model_flops", model_flops},
                      {"model_flops_per_s", model_flops / t},
                      {"cpu_peak_flops_per_s", fma.flops_per_s},
                      {"cpu_peak_isa", fma.isa},
                      {"sgemm_flops_per_s", peak.flops_per_s},
                      {"gemm_peak_flops_per_s", peak.flops_per_s},  // the SGEMM rate, as before
                      {"fraction_of_peak", model_flops / t / fma.flops_per_s},
                      {"fraction_of_sgemm", model_flops / t / peak.flops_per_s},
                      {"peak_memory_bytes", device.stats().peak}};
  return j;
}

}  // namespace sppo
