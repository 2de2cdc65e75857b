#include "bench/bench.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <random>

#include "core/check.h"
#include "core/timing.h"
#include "core/layout.h"
#include "backends/cpu/blas_setup.h"
#include "model/gpt.h"
#include "runtime/memory.h"
#include "train/peak.h"
#include "train/device_bench.h"
#include "bench/timed_backend.h"

namespace sppo {

namespace {

void fill_normal(float* p, i64 n, float sd, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.0f, sd);
  for (i64 k = 0; k < n; ++k) p[k] = d(rng);
}

}  // namespace

nlohmann::json bench_layer(Backend& be, int hidden, int heads, i64 S, int reps, bool breakdown) {
  ModelConfig c;
  c.vocab = 256;
  c.hidden = hidden;
  c.heads = heads;
  c.layers = 1;
  c.validate();
  SPPO_CHECK(reps >= 1, "options") << "--reps must be at least 1 (got " << reps << ")";
  SPPO_CHECK(S >= 2 && S <= INT_MAX, "options")
      << "--seq-len " << S << " is outside [2, " << INT_MAX << "]: the kernels index tokens with 32-bit ints";
  const bool cpu = std::string(be.name()) == "cpu";
  const DType act = be.act();
  const ActPrecision prec = act == DType::F32 ? ActPrecision::F32 : ActPrecision::BF16;
  const i64 ab = dtype_bytes(act);
  {
    // What the benchmark holds at once, in doubles so that nothing overflows: the block's
    // saved tensors and workspace, output, dK, dV, parameters, their working copy and gradients.
    const double H = hidden, bytes_per_token = double(total_bytes(block_saved_specs(c, 1, prec)) +
                                                      total_bytes(block_workspace_specs(c, 1, prec))) +
                                               H * double(ab + 8);
    const double need = double(S) * bytes_per_token + double(c.num_params()) * double(8 + ab);
    const double have = double(be.device_memory());
    SPPO_CHECK(have <= 0 || need <= have, "options")
        << "bench layer at --seq-len " << S << " with --hidden " << hidden << " needs about " << format_bytes(need)
        << " of device memory, more than the " << format_bytes(have) << " the " << be.name()
        << " backend has; use --seq-len " << i64(double(S) * have / need * 0.8) << " or less";
  }
  const int T = int(S);
  const AttentionServed attention = be.prepare_attention(c);
  // The rates the block is measured against, in the same run: on the CPU the FMA peak and
  // OpenBLAS's SGEMM; elsewhere the backend's own GEMM in the activation type.
  FmaPeak fma;
  GemmPeak peak;
  if (cpu) {
    fma = measure_fma_peak();
    peak = measure_gemm_peak();
  } else {
    peak.flops_per_s = time_gemm_flops(be, 8192, 5);
  }

  MemoryTier device(Tier::Device, 0, &be);
  std::mt19937_64 rng(11);
  const i64 P = c.num_params();
  Buffer params = device.alloc(P * 4, "parameters"), grads = device.alloc_zeroed(P * 4, "gradients");
  {
    std::vector<float> host(std::size_t(P), 0.0f);
    fill_normal(host.data(), P, 0.02f, rng);
    const ParamView hv = param_view(c, host.data());
    std::fill(hv.blocks[0].ln1_w, hv.blocks[0].ln1_w + hidden, 1.0f);
    std::fill(hv.blocks[0].ln2_w, hv.blocks[0].ln2_w + hidden, 1.0f);
    be.to_device(params.data(), host.data(), std::size_t(P) * 4);
  }
  // The matrices' working copy in the activation type (fp32: the weights themselves).
  Buffer matrices;
  if (act != DType::F32) {
    matrices = device.alloc(P * ab, "weight copy");
    be.to_act(matrices.data(), params.f32(), P);
  }
  ParamView pv = param_view(c, params.f32()), gv = param_view(c, grads.f32());
  const MatrixView mv = matrix_view(c, act == DType::F32 ? params.data() : matrices.data(), act, 0, c.layers);
  // Random activations: drawn on the host, converted on the device (untimed, outside the tier).
  DeviceBuffer staging(be, std::size_t(T) * hidden * sizeof(float));
  std::vector<float> host(std::size_t(T) * hidden);
  auto random_activations = [&](void* dst) {
    fill_normal(host.data(), i64(host.size()), 1.0f, rng);
    be.to_device(staging.get(), host.data(), host.size() * sizeof(float));
    be.to_act(dst, staging.f32(), i64(host.size()));
    be.synchronize();
  };

  // One step: the saved tensors and dK/dV made untimed, then the workspace, the forward
  // and the backward timed. The block runs on `run`: the backend itself, or the timing one.
  auto step = [&](Backend& run) {
    std::vector<Buffer> saved, ws;
    for (const auto& s : block_saved_specs(c, T, prec)) saved.push_back(device.alloc(s.bytes(), s.name));
    Buffer x_out = device.alloc(i64(T) * hidden * ab, "block output");
    random_activations(saved[0].data());
    Buffer dk = device.alloc_zeroed(i64(T) * hidden * 4, "dK"), dv = device.alloc_zeroed(i64(T) * hidden * 4, "dV");
    be.synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (const auto& s : block_workspace_specs(c, T, prec)) ws.push_back(device.alloc(s.bytes(), s.name));
    std::vector<void*> sp, wp;
    for (auto& b : saved) sp.push_back(b.data());
    for (auto& b : ws) wp.push_back(b.data());
    BlockSaved bs = block_saved_from(sp);
    const BlockWorkspace w = block_workspace_from(wp);
    const Subseq q{0, T};
    block_forward(run, x_out.data(), bs, pv.blocks[0], mv.blocks[0], w, KVBlocks{}, c, q);
    be.synchronize();
    const double t_fwd = seconds_since(t0);
    // The gradient arriving from above: a random tensor in the output's buffer (untimed).
    random_activations(x_out.data());
    const auto t1 = std::chrono::steady_clock::now();
    block_backward(run, x_out.data(), gv.blocks[0], dk.f32(), dv.f32(), bs, pv.blocks[0], mv.blocks[0], w,
                   KVBlocks{}, c, q);
    be.synchronize();
    return t_fwd + seconds_since(t1);
  };

  std::vector<double> times;
  device.reset_peak();
  for (int r = 0; r < reps + 1; ++r) {
    const double s = step(be);
    if (r > 0) times.push_back(s);
  }
  const double t = median(times);
  const double H = hidden, Sd = double(S);
  const double fwd = 24.0 * Sd * H * H + 4.0 * Sd * H * (Sd + 1.0) / 2.0;
  const double model_flops = 3.0 * fwd;
  nlohmann::json j = {{"backend", be.name()},
                      {"precision", act == DType::F32 ? "fp32" : "bf16"},
                      {"hidden", hidden},
                      {"heads", heads},
                      {"attention", attention.description},
                      {"seq_len", S},
                      {"step_time_s", t},
                      {"tokens_per_s", Sd / t},
                      {"model_flops", model_flops},
                      {"model_flops_per_s", model_flops / t},
                      {"gemm_peak_flops_per_s", peak.flops_per_s},
                      {"peak_memory_bytes", device.stats().peak}};
  if (cpu) {
    j["threads"] = omp_get_max_threads();
    j["blas_core"] = peak.blas_core;
    j["blas_core_description"] = cpu::blas_core_description();
    j["openmp_wait"] = cpu::openmp_wait_description();
    j["cpu_peak_flops_per_s"] = fma.flops_per_s;
    j["cpu_peak_isa"] = fma.isa;
    j["sgemm_flops_per_s"] = peak.flops_per_s;
    j["fraction_of_peak"] = model_flops / t / fma.flops_per_s;
    j["fraction_of_sgemm"] = model_flops / t / peak.flops_per_s;
  } else {
    j["fraction_of_peak"] = model_flops / t / peak.flops_per_s;  // of the GEMM rate measured here
  }
  if (breakdown) {
    // One more step, every kernel timed on its own (bench/timed_backend.h); "between_s" is
    // the step's time outside the kernels: allocation, argument set-up, launches, waits.
    TimedBackend timed(be);
    const double s = step(timed);
    const KernelTimes& k = timed.times();
    j["breakdown"] = {{"step_s", s},
                      {"attention_forward_s", k.attention_forward_s},
                      {"attention_backward_s", k.attention_backward_s},
                      {"gemm_s", k.gemm_s},
                      {"other_s", k.other_s},
                      {"between_s", s - k.attention_forward_s - k.attention_backward_s - k.gemm_s - k.other_s}};
    // The measure of a lean step: what is neither attention nor a GEMM, the kernels
    // between them and the gaps, as a fraction of the timed step.
    j["outside_attention_gemm_fraction"] = (s - k.attention_forward_s - k.attention_backward_s - k.gemm_s) / s;
  }
  return j;
}

}  // namespace sppo
