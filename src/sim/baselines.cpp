#include "sim/baselines.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "schedule/memory.h"
#include "planner/partition.h"
#include "sim/solver.h"

namespace sppo::sim {

// Note [Baseline models]
// Both baselines are closed-form step timelines built from the CostModel's primitives
// (layer forward/backward seconds, message and copy seconds), with memory from the same
// layout tables (core/layout.h) as SPPO; weights, gradients and AdamW state are 16 bytes a
// parameter in every system.
//
// Megatron-LM: TP (t | heads, inside a node) x CP (ring attention, zigzag-balanced) x PP
// x DP, full activation recomputation, 1F1B with one micro-batch (so a PP of P runs its
// stages one after another: bubble ratio P - 1). Each stage keeps one checkpoint per layer
// (its input, [S/(cp t), H], sequence-parallel across TP) and, while a layer is
// recomputed and back-propagated, that layer's whole saved set, workspace, K/V ring
// buffers and dK/dV accumulators for its S/cp tokens (divided by t), plus the full fp32
// logits [S/cp, V/t] of the last stage (Megatron does not chunk them). Time per layer: the
// forward, then recompute + backward; GEMMs divide by t, attention by t * cp; TP costs
// 4 all-gathers/reduce-scatters of the layer input per forward pass (3 passes), exposed;
// the CP ring's K/V transfers overlap attention (max of the two). Weights are divided by
// t and P; the DP all-reduce of the gradients ends the step.
//
// DeepSpeed-Ulysses + ZeRO-3 + FPDT: Ulysses degree u (u | heads, may span nodes), the
// other devices are DP replicas; ZeRO-3 shards weights, gradients and optimizer state over
// all devices and gathers one layer's bf16 weights ahead (two layers resident). FPDT
// processes the S/u local tokens in chunks of kFpdtChunk, offloading every layer's
// checkpoint to the host and recomputing in backward; a layer's K/V and fp32 dK/dV for
// its S/u tokens stay on the device while that layer runs; the rest of the working set is
// per chunk, double-buffered. Time per layer: max(compute, ZeRO-3 gathers, host copies)
// plus the all-to-alls (4 per pass, 4 passes counting the backward's two), exposed.

namespace {

constexpr i64 kFpdtChunk = 8192;  // local tokens per FPDT chunk

ActPrecision precision_of(const HardwareProfile& hw) {
  return hw.precision == "f32" ? ActPrecision::F32 : ActPrecision::BF16;
}

struct Layout {
  int tp = 1, cp = 1, pp = 1, dp = 1;
};

struct Estimate {
  double step = 0, busy = 0, exposed_copy = 0;
  i64 peak = 0;
  i64 host = 0;
  int chunks = 1;
};

double layer_params(const ModelConfig& c) { return double(sched::param_count(c, 0, 1, false, false)); }

Estimate megatron(const ModelConfig& c, i64 S, const Layout& l, const CostModel& cost) {
  const ActPrecision prec = cost.precision();
  const double e = prec == ActPrecision::F32 ? 4 : 2;
  const double H = c.hidden, t = l.tp;
  const i64 T = (S + l.cp - 1) / l.cp;  // tokens per CP rank
  const int stage_layers = (c.layers + l.pp - 1) / l.pp;
  const HardwareProfile& hw = cost.hw();
  Estimate est;
  // Memory of the busiest stage (the last: it has the logits and the tied head).
  const double weights = double(sched::param_count(c, c.layers - stage_layers, c.layers, l.pp == 1, true)) / t * 16;
  const double ckpt = double(stage_layers) * T * H * e / t;
  const double unit = double(offloadable_bytes_per_token(c, prec) + skeletal_bytes_per_token(c, prec)) * T / t;
  const double ws = double(total_bytes(block_workspace_specs(c, 1, prec))) * T / t;
  const double ring = l.cp > 1 ? 2.0 * skeletal_bytes_per_token(c, prec) * T / t * 2 : 0;
  const double acc = 2.0 * H * 4 * T / t;
  const double logits = double(T) * c.vocab / t * 4;
  est.peak = i64(weights + ckpt + unit + ws + ring + acc + std::max(logits, 0.0));
  // Time of one stage.
  const double gemm = cost.gemm_flops(T) / t / hw.gemm_flops;
  const double attn = cost.attention_flops(0, 0, S) / (t * l.cp) / hw.attention_flops();
  const double elem = hw.elementwise_bw > 0 ? plan::kElementwiseWordsPerToken * H * e * T / t / hw.elementwise_bw : 0;
  const double tp_comm = t > 1 ? 4 * ((t - 1) / t * T * H * e / hw.intra_node_bw + hw.intra_node_latency) : 0;
  const double kv_bytes = double(skeletal_bytes_per_token(c, prec)) * T / t;
  // Ring partners are neighbours in the CP group: in a node when tp * cp fits in one.
  const int partner = l.tp * l.cp <= hw.devices_per_node ? 1 : hw.devices_per_node;
  const double cp_comm = l.cp > 1 ? (l.cp - 1) * cost.message_s(i64(kv_bytes), 0, partner) : 0;
  const double fwd = gemm + elem + std::max(attn, cp_comm) + tp_comm + hw.layer_overhead;
  const double bwd = 2 * gemm + 2 * elem + std::max(2.5 * attn, 2 * cp_comm) + 2 * tp_comm + hw.layer_overhead;
  const double head = cost.head_flops(T) / t / hw.gemm_flops;
  const double stage_busy = stage_layers * (2 * fwd + bwd) + head;
  const double p2p = l.pp > 1 ? 2.0 * (l.pp - 1) * cost.message_s(i64(T * H * e / t), 0, hw.devices_per_node) : 0;
  std::vector<int> group(l.dp);
  for (int d = 0; d < l.dp; ++d) group[d] = d * l.tp * l.cp * l.pp;
  const double allreduce = cost.allreduce_s(i64(weights / 16 * 4), group);
  est.busy = stage_busy;
  est.step = l.pp * stage_busy + p2p + allreduce;
  return est;
}

Estimate deepspeed(const ModelConfig& c, i64 S, const Layout& l, int gpus, const CostModel& cost) {
  const ActPrecision prec = cost.precision();
  const double e = prec == ActPrecision::F32 ? 4 : 2;
  const double H = c.hidden;
  const int u = l.cp;
  const i64 T = (S + u - 1) / u;
  const HardwareProfile& hw = cost.hw();
  Estimate est;
  est.chunks = int((T + kFpdtChunk - 1) / kFpdtChunk);
  const i64 chunk = std::min(T, kFpdtChunk);
  const double weights = double(c.num_params()) * 16 / gpus + 2 * layer_params(c) * e;
  const double kv_acc = double(skeletal_bytes_per_token(c, prec) + 2 * i64(H) * 4) * T;
  const double per_chunk = double(offloadable_bytes_per_token(c, prec) + total_bytes(block_workspace_specs(c, 1, prec))) * chunk;
  const double staging = 2.0 * chunk * H * e;
  const double logits = double(std::min<i64>(chunk, 1024)) * c.vocab * 4;
  est.peak = i64(weights + kv_acc + 2 * per_chunk + staging + logits);
  est.host = i64(double(c.layers) * T * H * e);
  const double gemm = cost.gemm_flops(T) / hw.gemm_flops;
  const double attn = cost.attention_flops(0, 0, S) / u / hw.attention_flops();
  const double elem = hw.elementwise_bw > 0 ? plan::kElementwiseWordsPerToken * H * e * T / hw.elementwise_bw : 0;
  // forward, recomputed forward, backward
  const double compute = 4 * gemm + 4 * elem + 4.5 * attn + 3 * hw.layer_overhead;
  const bool intra = u <= hw.devices_per_node;
  const double bw = intra ? hw.intra_node_bw : hw.inter_node_bw;
  const double lat = intra ? hw.intra_node_latency : hw.inter_node_latency;
  const double a2a = u > 1 ? 16 * ((u - 1.0) / u * T * H * e / bw + (u - 1) * lat) : 0;
  const bool zero_intra = gpus <= hw.devices_per_node;
  const double zbw = zero_intra ? hw.intra_node_bw : hw.inter_node_bw;
  const double gather = 4 * (gpus - 1.0) / gpus * layer_params(c) * e / zbw;
  const double copies = T * H * e / hw.d2h_bw + T * H * e / hw.h2d_bw;
  const double layer = std::max({compute, gather, copies}) + a2a;
  est.exposed_copy = c.layers * std::max(0.0, copies - std::max(compute, gather));
  est.busy = c.layers * compute + cost.head_flops(T) / hw.gemm_flops;
  est.step = c.layers * layer + cost.head_flops(T) / hw.gemm_flops;
  return est;
}

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int k = 1; k <= n; ++k)
    if (n % k == 0) d.push_back(k);
  return d;
}

Estimate estimate(const plan::Plan& p, const CostModel& cost) {
  Layout l{p.tp, p.sp, p.pp, p.dp};
  return p.system == "megatron" ? megatron(p.model, p.seq_len, l, cost) : deepspeed(p.model, p.seq_len, l, p.gpus, cost);
}

}  // namespace

SimResult simulate_baseline(const plan::Plan& p, const HardwareProfile& hw_in, const SimOptions& options) {
  HardwareProfile hw = hw_in;
  hw.devices_per_node = p.gpus_per_node;
  const CostModel cost(hw, p.model, precision_of(hw));
  const Estimate est = estimate(p, cost);
  SimResult r;
  r.step_time_s = est.step;
  r.compute_s = est.busy;
  r.bubble_ratio = est.busy > 0 ? (est.step - est.busy) / est.busy : 0;
  r.exposed_copy_s = est.exposed_copy;
  r.peak_device_bytes = est.peak;
  r.peak_host_bytes = est.host;
  r.peak_bytes.assign(p.gpus, est.peak);
  r.tokens_per_device_per_s = double(p.seq_len) * p.dp / (double(p.gpus) * est.step);
  if (options.record) {
    // One block per device: the busy part of the step, the rest a gap.
    for (int d = 0; d < p.gpus; ++d) {
      const int stage = (d / (p.tp * p.sp)) % p.pp;
      const double start = p.system == "megatron" ? stage * est.busy : 0;
      r.events.push_back({d, Lane::Compute, sched::OpKind::Forward, p.system + " step", start, est.busy});
    }
    r.memory.assign(p.gpus, {{0.0, est.peak}, {est.step, est.peak}});
  }
  return r;
}

PlanOutcome solve_baseline(const PlanRequest& req) {
  const ModelConfig& c = req.model;
  HardwareProfile hw = req.hw;
  hw.devices_per_node = req.gpus_per_node;
  const CostModel cost(hw, c, precision_of(hw));
  const i64 budget = req.budget > 0 ? req.budget : hw.usable_memory();
  const int G = req.gpus;
  PlanOutcome out;
  plan::Plan best;
  double best_tput = 0;
  i64 least_peak = 0;
  std::string least_layout;
  auto consider = [&](const Layout& l) {
    plan::Plan p;
    p.system = req.system;
    p.model_name = req.model_name;
    p.model = c;
    p.hardware = req.hardware;
    p.seq_len = req.seq_len;
    p.gpus = G;
    p.gpus_per_node = req.gpus_per_node;
    p.tp = l.tp;
    p.sp = l.cp;
    p.pp = l.pp;
    p.dp = l.dp;
    p.budget = budget;
    p.offload = req.system == "deepspeed" ? "full" : "none";
    const Estimate est = estimate(p, cost);
    const bool host_ok = hw.host_memory == 0 || est.host <= hw.host_memory;
    if (est.peak > budget || !host_ok) {
      if (least_peak == 0 || est.peak < least_peak) {
        least_peak = est.peak;
        least_layout = "tp " + std::to_string(l.tp) + ", sp " + std::to_string(l.cp) + ", pp " + std::to_string(l.pp);
      }
      return;
    }
    const double tput = double(req.seq_len) * l.dp / (double(G) * est.step);
    if (tput <= best_tput) return;
    best_tput = tput;
    p.subseqs = req.system == "deepspeed" ? est.chunks : 1;
    p.lengths = req.system == "deepspeed" ? plan::partition_length(req.seq_len, est.chunks)
                                          : std::vector<i64>{req.seq_len};
    p.subseqs = int(p.lengths.size());
    p.alpha.assign(p.lengths.size(), req.system == "deepspeed" ? 1.0 : 0.0);
    p.alpha.back() = req.system == "deepspeed" ? 1.0 : 0.0;
    p.alpha_rule = req.system == "deepspeed" ? "fpdt: every checkpoint to the host" : "none: full recomputation";
    for (int s = 0; s < l.pp; ++s) p.stage_layers.push_back(c.layers / l.pp + (s < c.layers % l.pp ? 1 : 0));
    best = p;
  };
  if (req.system == "megatron") {
    for (int tp : divisors(std::min(G, req.gpus_per_node)))
      if (c.heads % tp == 0)
        for (int pp : divisors(G / tp))
          if (pp <= c.layers)
            for (int cp : divisors(G / tp / pp)) consider({tp, cp, pp, G / tp / pp / cp});
  } else {
    for (int u : divisors(G))
      if (c.heads % u == 0) consider({1, u, 1, G / u});
  }
  if (best_tput == 0) {
    out.error = req.system + ": no layout of " + std::to_string(G) + " devices fits " +
                std::to_string(req.seq_len) + " tokens in " + format_bytes(double(budget)) +
                " per device (least peak " + format_bytes(double(least_peak)) + " with " + least_layout +
                (req.system == "deepspeed" ? "; Ulysses needs SP <= heads = " + std::to_string(c.heads) : "") + ")";
    return out;
  }
  const SimResult r = simulate_baseline(best, req.hw);
  best.predicted = {r.step_time_s, r.tokens_per_device_per_s, r.bubble_ratio, r.peak_device_bytes, r.exposed_copy_s};
  out.ok = true;
  out.plan = best;
  return out;
}

}  // namespace sppo::sim
