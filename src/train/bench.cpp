#include "train/bench.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <random>

#include "core/layout.h"
#include "backends/cpu/ops.h"
#include "model/gpt.h"
#include "runtime/memory.h"

namespace sppo {

namespace {

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

nlohmann::json bench_layer(int hidden, int heads, i64 S, int reps) {
  ModelConfig c;
  c.vocab = 256;
  c.hidden = hidden;
  c.heads = heads;
  c.layers = 1;
  c.validate();
  const int T = int(S);
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
                      {"step_time_s", t},
                      {"tokens_per_s", Sd / t},
                      {"model_flops", model_flops},
                      {"model_flops_per_s", model_flops / t},
                      {"gemm_peak_flops_per_s", peak.flops_per_s},
                      {"fraction_of_peak", model_flops / t / peak.flops_per_s},
                      {"peak_memory_bytes", device.stats().peak}};
  return j;
}

}  // namespace sppo
