#include "train/profile_machine.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "backends/cpu/attention.h"
#include "backends/cpu/ops.h"
#include "core/layout.h"
#include "core/timing.h"
#include "model/gpt.h"
#include "train/peak.h"

namespace sppo {

namespace {

template <typename F>
double median_seconds(int reps, F&& f) {
  f();  // warm-up: page faults, caches, thread pools
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(seconds_since(t0));
  }
  return median(std::move(t));
}

std::vector<float> randn(i64 n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = d(rng);
  return v;
}

// 64-byte aligned kernel scratch of `bytes` inside `storage`.
Workspace aligned_workspace(std::vector<char>& storage, i64 bytes) {
  storage.assign(std::size_t(bytes) + 64, 0);
  const auto at = (reinterpret_cast<std::uintptr_t>(storage.data()) + 63) & ~std::uintptr_t(63);
  return {reinterpret_cast<void*>(at), std::size_t(bytes)};
}

// Note [Streamed chunks] (planner/profile.h), measured in the pattern of
// runtime/kv_stream.cpp on the backend's own kernels and copy streams: the attention of
// 256 query rows of H 128 (2 heads of 64) on chunks of kKvChunkMinRows keys (the chunks of
// short subsequences, whose fixed costs count), all before the queries.
struct StreamCosts {
  double copy_issue = 0, copy_compute_share = 0, attention_chunk = 0;
};

StreamCosts measure_stream_costs(double copy_bw, bool quick) {
  constexpr int Tq = 256, C = int(kKvChunkMinRows), Z = 2, A = 64, D = Z * A;
  const auto be = make_backend("cpu");
  ModelConfig c;
  c.vocab = 64;
  c.hidden = D;
  c.heads = Z;
  c.layers = 1;
  std::vector<char> scratch_storage;
  const Workspace scratch = aligned_workspace(scratch_storage, be->block_scratch(c).bytes(C));
  const int n = quick ? 4 : 8;  // chunks
  auto q = randn(i64(Tq) * D, 21), dout = randn(i64(Tq) * D, 22), k = randn(i64(n) * C * D, 23),
       v = randn(i64(n) * C * D, 24);
  std::vector<float> out(q.size()), lse(std::size_t(Z) * Tq), part(q.size()), part_lse(lse.size()),
      delta(lse.size()), dq(q.size()), dk(k.size()), dv(k.size());
  AttnShape d;
  d.Tq = Tq;
  d.Z = Z;
  d.A = A;
  d.q_pos0 = i64(n) * C;
  auto chunk = [&](int b, bool grads) {
    const std::size_t at = std::size_t(b) * C * D;
    return KVRef{k.data() + at, v.data() + at, grads ? dk.data() + at : nullptr, grads ? dv.data() + at : nullptr, C,
                 i64(b) * C};
  };
  const KVRef whole{k.data(), v.data(), dk.data(), dv.data(), n * C, 0};
  const KVRef whole_fwd{k.data(), v.data(), nullptr, nullptr, n * C, 0};
  be->attention_forward(out.data(), lse.data(), q.data(), {whole_fwd}, d, scratch);
  be->attention_backward_delta(delta.data(), dout.data(), out.data(), d);
  StreamCosts r;

  // The fixed cost of a chunk's kernel call: n calls on one chunk each (the forward with
  // its log-sum-exp merge) against one call on all n chunks, forward and backward averaged.
  {
    auto timed = [](auto&& f) {
      const auto t0 = std::chrono::steady_clock::now();
      f();
      return seconds_since(t0);
    };
    std::vector<double> whole_f, chunked_f, whole_b, chunked_b;
    for (int rep = 0; rep < (quick ? 5 : 9) + 1; ++rep) {
      const double wf = timed([&] { be->attention_forward(out.data(), lse.data(), q.data(), {whole_fwd}, d, scratch); });
      const double cf = timed([&] {
        be->attention_forward(out.data(), lse.data(), q.data(), {chunk(0, false)}, d, scratch);
        for (int b = 1; b < n; ++b) {
          be->attention_forward(part.data(), part_lse.data(), q.data(), {chunk(b, false)}, d, scratch);
          be->attention_merge(out.data(), lse.data(), part.data(), part_lse.data(), d);
        }
      });
      const double wb = timed([&] {
        be->attention_backward(dq.data(), dout.data(), q.data(), {whole}, lse.data(), delta.data(), d, scratch);
      });
      const double cb = timed([&] {
        for (int b = 0; b < n; ++b)
          be->attention_backward(dq.data(), dout.data(), q.data(), {chunk(b, true)}, lse.data(), delta.data(), d,
                                 scratch);
      });
      if (rep == 0) continue;  // warm-up
      whole_f.push_back(wf), chunked_f.push_back(cf), whole_b.push_back(wb), chunked_b.push_back(cb);
    }
    const double extra = median(chunked_f) - median(whole_f) + median(chunked_b) - median(whole_b);
    r.attention_chunk = std::max(0.0, extra / (2.0 * (n - 1)));
  }

  // A copy's cost to the compute stream: after each kernel call the next chunk's K and V
  // go to a copy stream, and each slot is waited for two chunks later; the seconds the
  // compute thread spends issuing and waiting, per copy, at two copy sizes give the fixed
  // part (copy_issue) and the share of the copy's seconds (copy_compute_share). The
  // sources rotate through host memory past the caches, as a long K/V cache's do.
  {
    const auto stream = be->make_copy_stream();
    const std::size_t small = 4096, large = std::size_t(C) * D * sizeof(float);
    const std::size_t pool = std::size_t(quick ? 16 : 64) << 20;
    std::vector<char> src(pool, 1), slots(4 * large, 0);
    const int iters = quick ? 48 : 160;
    std::size_t at = 0;
    auto lost_per_copy = [&](std::size_t bytes) {
      std::shared_ptr<Event> loaded[2];
      double lost = 0;
      for (int b = 0; b < iters; ++b) {
        auto t0 = std::chrono::steady_clock::now();
        if (loaded[b % 2]) loaded[b % 2]->wait();
        lost += seconds_since(t0);
        be->attention_forward(part.data(), part_lse.data(), q.data(), {chunk(b % n, false)}, d, scratch);
        t0 = std::chrono::steady_clock::now();
        char* slot = slots.data() + std::size_t(b % 2) * 2 * large;
        for (int kv = 0; kv < 2; ++kv) {
          loaded[b % 2] = stream->copy(slot + kv * large, src.data() + at, bytes, {});
          at = (at + large) % (pool - large);
        }
        lost += seconds_since(t0);
      }
      const auto t0 = std::chrono::steady_clock::now();
      for (auto& e : loaded)
        if (e) e->wait();
      return (lost + seconds_since(t0)) / (2.0 * iters);
    };
    lost_per_copy(large);  // warm-up: the stream's thread, the pool's pages
    std::vector<double> at_small, at_large;
    for (int rep = 0; rep < (quick ? 3 : 5); ++rep) {
      at_small.push_back(lost_per_copy(small));
      at_large.push_back(lost_per_copy(large));
    }
    const double s = median(at_small), l = median(at_large);
    r.copy_compute_share = std::clamp((l - s) / (double(large - small) / copy_bw), 0.0, 1.0);
    r.copy_issue = std::max(0.0, s - r.copy_compute_share * double(small) / copy_bw);
  }
  return r;
}

}  // namespace

plan::HardwareProfile measure_cpu_profile(bool quick) {
  plan::HardwareProfile p;
  p.name = "cpu-local";
  p.precision = "f32";
  p.threads = omp_get_max_threads();
  const int reps = quick ? 3 : 7;

  // The SGEMM peak, as `bench layer` measures it: a large square product.
  const GemmPeak peak = measure_gemm_peak(quick ? 1024 : 2048, reps);
  p.gemm_flops = peak.flops_per_s;
  // A block's four GEMMs, forward and backward, at several hidden sizes: CPUs run small
  // shapes far below the peak, and the cost model prices each model at its own size.
  for (int Hb : quick ? std::vector<int>{64, 256, 1024} : std::vector<int>{64, 128, 256, 512, 1024, 2048}) {
    const int Tb = std::max(256, (quick ? 1 << 19 : 1 << 21) / Hb);
    const int shapes[4][2] = {{Hb, 3 * Hb}, {Hb, Hb}, {Hb, 4 * Hb}, {4 * Hb, Hb}};  // {in, out}
    std::vector<std::vector<float>> x, w, y, dw;
    for (const auto& sh : shapes) {
      x.push_back(randn(i64(Tb) * sh[0], 8));
      w.push_back(randn(i64(sh[1]) * sh[0], 9));
      y.emplace_back(static_cast<std::size_t>(i64(Tb) * sh[1]));
      dw.emplace_back(static_cast<std::size_t>(i64(sh[1]) * sh[0]));
    }
    const double sb = median_seconds(reps, [&] {
      for (int k = 0; k < 4; ++k) {
        cpu::linear_forward(y[k].data(), x[k].data(), w[k].data(), nullptr, Tb, shapes[k][0], shapes[k][1]);
        cpu::linear_backward(x[k].data(), dw[k].data(), nullptr, y[k].data(), x[k].data(), w[k].data(), Tb,
                             shapes[k][0], shapes[k][1]);
      }
    });
    p.gemm_flops_by_hidden.emplace_back(Hb, 3.0 * 24.0 * Tb * double(Hb) * Hb / sb);
  }
  // Causal attention forward + backward at several head sizes (the kernel's efficiency
  // depends on A); attention_efficiency itself is the A = 64 figure.
  for (int A : quick ? std::vector<int>{32, 64, 128} : std::vector<int>{16, 32, 64, 128}) {
    const int Ta = quick ? 1024 : 2048, Z = 512 / A, D = Z * A;
    auto q = randn(i64(Ta) * D, 3), k = randn(i64(Ta) * D, 4), v = randn(i64(Ta) * D, 5),
         dout = randn(i64(Ta) * D, 6);
    std::vector<float> out(q.size()), lse(std::size_t(Z) * Ta), delta(lse.size()), dq(q.size()),
        dk(q.size()), dv(q.size());
    cpu::AttnDims d;
    d.Tq = d.Tk = Ta;
    d.Z = Z;
    d.A = A;
    const double s = median_seconds(reps, [&] {
      cpu::attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), d, false);
      cpu::attention_backward_delta(delta.data(), dout.data(), out.data(), d);
      cpu::attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(),
                              v.data(), lse.data(), delta.data(), d);
    });
    const double fwd = 4.0 * A * Z * (double(Ta) * (Ta + 1) / 2);
    const double eff = (3.5 * fwd / s) / p.gemm_flops;  // forward + 2.5x backward
    p.attention_efficiency_by_head.emplace_back(A, eff);
    if (A == 64) p.attention_efficiency = eff;
  }
  // The same kernels after a prefix (Note [Attention after a prefix]): A = 64 queries
  // against keys wholly before them, over the causal rate above, at several query counts
  // (a subsequence's length): the longest gives attention_prefix_ratio. The counts take
  // turns within each repetition, so that the machine's drift moves them alike.
  {
    const int A = 64, Z = 8, D = Z * A, Tk = quick ? 2048 : 4096;
    const std::vector<int> counts = quick ? std::vector<int>{64, 128, 256, 512}
                                          : std::vector<int>{64, 128, 256, 512, 1024};
    const int most = counts.back();
    auto q = randn(i64(most) * D, 13), k = randn(i64(Tk) * D, 14), v = randn(i64(Tk) * D, 15),
         dout = randn(i64(most) * D, 16);
    std::vector<float> out(q.size()), lse(std::size_t(Z) * most), delta(lse.size()), dq(q.size()), dk(k.size()),
        dv(k.size());
    std::vector<std::vector<double>> t(counts.size());
    for (int rep = 0; rep < reps + 1; ++rep)
      for (std::size_t c = 0; c < counts.size(); ++c) {
        cpu::AttnDims d;
        d.Tq = counts[c];
        d.Tk = Tk;
        d.Z = Z;
        d.A = A;
        d.q_pos0 = Tk;  // every key before every query
        const auto t0 = std::chrono::steady_clock::now();
        cpu::attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), d, false);
        cpu::attention_backward_delta(delta.data(), dout.data(), out.data(), d);
        cpu::attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(),
                                lse.data(), delta.data(), d);
        if (rep > 0) t[c].push_back(seconds_since(t0));  // the first round warms up
      }
    for (std::size_t c = 0; c < counts.size(); ++c) {
      const double fwd = 4.0 * A * Z * double(counts[c]) * Tk;
      p.attention_prefix_ratio_by_queries.emplace_back(counts[c], (3.5 * fwd / median(t[c])) / p.attention_rate(A));
    }
    p.attention_prefix_ratio = p.attention_prefix_ratio_by_queries.back().second;
  }
  // Elementwise: a LayerNorm forward reads and writes [T, H].
  {
    const int Te = quick ? 4096 : 16384, He = 1024;
    auto x = randn(i64(Te) * He, 7);
    std::vector<float> y(x.size()), mean(static_cast<std::size_t>(Te)), rstd(static_cast<std::size_t>(Te)),
        w(static_cast<std::size_t>(He), 1.0f), b(static_cast<std::size_t>(He), 0.0f);
    const double s = median_seconds(reps, [&] {
      cpu::layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), Te, He, 1e-5f);
    });
    p.elementwise_bw = 2.0 * double(x.size()) * sizeof(float) / s;
  }
  // Copies: one thread's memcpy (the copy stream), alone and with a second one running.
  {
    const std::size_t n = std::size_t(quick ? 32 : 128) << 20;
    std::vector<char> src(n, 1), dst(n, 0), src2(n, 2), dst2(n, 0);
    const double alone = median_seconds(reps, [&] { std::memcpy(dst.data(), src.data(), n); });
    const double both = median_seconds(reps, [&] {
      std::thread t([&] { std::memcpy(dst2.data(), src2.data(), n); });
      std::memcpy(dst.data(), src.data(), n);
      t.join();
    });
    p.d2h_bw = p.h2d_bw = double(n) / alone;
    p.duplex_factor = std::min(1.0, alone / both);
    p.intra_node_bw = p.inter_node_bw = p.d2h_bw;
    p.intra_node_latency = p.inter_node_latency = 2e-6;
  }
  {
    const StreamCosts sc = measure_stream_costs(p.h2d_bw, quick);
    p.copy_issue = sc.copy_issue;
    p.copy_compute_share = sc.copy_compute_share;
    p.attention_chunk = sc.attention_chunk;
  }
  // Fixed cost per layer: a block on very few tokens is all overhead.
  {
    ModelConfig c;
    c.vocab = 64;
    c.hidden = 64;
    c.heads = 2;
    c.layers = 1;
    const int Tt = 8;
    std::vector<float> params(std::size_t(c.num_params()), 0.01f);
    ParamView pv = param_view(c, params.data());
    const MatrixView mv = matrix_view(c, params.data(), DType::F32, 0, c.layers);
    const auto be = make_backend("cpu");
    std::vector<std::vector<float>> saved, ws;
    std::vector<void*> sp, wp;
    for (const auto& s : block_saved_specs(c, Tt, ActPrecision::F32)) saved.emplace_back(std::size_t(s.numel()), 0.5f);
    for (const auto& s : block_workspace_specs(c, Tt, ActPrecision::F32)) ws.emplace_back(std::size_t(s.numel()), 0.0f);
    for (auto& b : saved) sp.push_back(b.data());
    for (auto& b : ws) wp.push_back(b.data());
    std::vector<float> out(std::size_t(Tt) * c.hidden);
    BlockSaved bs = block_saved_from(sp);
    const BlockWorkspace w = block_workspace_from(wp);
    p.layer_overhead = median_seconds(reps * 5, [&] {
      block_forward(*be, out.data(), bs, pv.blocks[0], mv.blocks[0], w, KVBlocks{}, c, Subseq{0, Tt});
    });
  }
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  p.device_memory = i64(pages) * i64(page);
  p.devices_per_node = 1;
  p.description = "measured on this machine (" + std::to_string(omp_get_max_threads()) +
                  " threads, OpenBLAS core " + peak.blas_core + ")";
  return p;
}

plan::HardwareProfile nominal_cpu_profile() {
  plan::HardwareProfile p;
  p.name = "cpu-nominal";
  p.description = "round CPU-like rates, for memory predictions";
  p.precision = "f32";
  p.gemm_flops = 200e9;
  p.attention_efficiency = 0.5;
  p.elementwise_bw = 20e9;
  p.d2h_bw = p.h2d_bw = p.intra_node_bw = p.inter_node_bw = 20e9;
  p.duplex_factor = 0.6;
  p.intra_node_latency = p.inter_node_latency = 2e-6;
  p.device_memory = i64(1) << 40;
  p.devices_per_node = 1;
  return p;
}

plan::HardwareProfile resolve_cpu_profile(const std::string& hardware) {
  if (!hardware.empty()) return plan::load_profile(hardware);
  // Measured once per process: benchmarks and tests set up many steps.
  static const plan::HardwareProfile measured = measure_cpu_profile(true);
  return measured;
}

}  // namespace sppo
