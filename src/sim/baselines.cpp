#include "sim/baselines.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/check.h"
#include "planner/partition.h"
#include "schedule/memory.h"
#include "sim/solver.h"

namespace sppo::sim {

using plan::divisors;

// Note [Baseline models]
// Both baselines are closed-form step timelines built from the CostModel's primitives
// (layer forward/backward seconds, message and copy seconds), with memory from each
// system's published accounting (Note [Baseline memory]).
//
// Megatron-LM: TP (t | heads, inside a node) x CP (ring attention, zigzag-balanced) x PP
// x DP, full activation recomputation, 1F1B with one micro-batch (so a PP of P runs its
// stages one after another: bubble ratio P - 1). Time per layer: the forward, then
// recompute + backward; GEMMs divide by t, attention by t * cp; TP costs 4 all-gathers /
// reduce-scatters of the layer input per pass (3 passes), exposed; the CP ring's K/V
// transfers overlap attention (max of the two). The DP all-reduce of the gradients ends
// the step.
//
// DeepSpeed-Ulysses + ZeRO-3 + FPDT: Ulysses degree u (u | heads, may span nodes), the
// other devices are DP replicas; ZeRO-3 shards weights, gradients and optimizer state over
// all devices and gathers each layer's bf16 weights ahead. FPDT (Yao et al. 2024,
// deepspeed/sequence/fpdt_layer.py) cuts the s = S/u local tokens into chunks of c; a
// layer's q, k, v and attention output go to the host chunk by chunk, and the attention of
// chunk j fetches the K, V of chunks 0..j back, double-buffered (j(j+1)/2 chunk loads in a
// layer's forward); the backward loops over K/V chunks and, inside, over the later query
// chunks, fetching q, o, dO and the fp32 dQ of each and writing dQ back. Every layer's
// input is checkpointed to the host and the layer recomputed in backward. Time per layer:
// max(compute, ZeRO-3 gathers, copies each way) plus the all-to-alls (4 per chunk and pass,
// 3 passes), exposed.

namespace {

constexpr i64 kFpdtChunk = 8192;           // local tokens per FPDT chunk
constexpr double kZero3Prefetch = 5e7;     // DeepSpeed's default stage3_prefetch_bucket_size, parameters

// A baseline's layout: for Megatron-LM, its TP, CP (ring), PP and DP; for DeepSpeed, `cp`
// is its Ulysses degree (ParallelDims::ulysses).
struct Layout {
  int tp = 1, cp = 1, pp = 1, dp = 1;
};

struct Estimate {
  double step = 0, busy = 0, exposed_copy = 0;
  i64 peak = 0;
  i64 host = 0;
  int chunks = 1;
  std::string where;
  std::vector<MemoryLine> lines;
};

std::string formula_num(double v) {
  char buf[48];
  if (std::fabs(v) >= 1e6 || (std::fabs(v) < 1e-2 && v != 0)) std::snprintf(buf, sizeof buf, "%.4g", v);
  else std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

void add(Estimate* e, Row row, double device, double host, const std::string& formula) {
  e->lines.push_back({row, i64(std::llround(device)), i64(std::llround(host)), formula});
}

i64 total_device(const Estimate& e) {
  i64 t = 0;
  for (const auto& l : e.lines) t += l.device;
  return t;
}

// Note [Baseline memory]
// Megatron-LM, per device of the fullest stage (the first holds the embedding, the last the
// tied output embedding and the loss), bf16 parameters, fp32 main gradients, distributed
// optimizer over the data-parallel group (which includes CP), full recomputation:
//   weights 2 Psi_s / t, main gradients 4 Psi_s / t, fp32 master weights and Adam m, v
//   12 Psi_s / (t d c) (Megatron-LM docs, distributed optimizer: 6 + 12/d bytes a parameter);
//   (a Llama-family block: H becomes the K/V width G A in the K, V terms below, and 34 H
//   its own count, layer_activation_bytes)
//   one checkpoint per layer, its input with sequence parallelism, 2 s H / t bytes
//   (Korthikanti et al. 2022, full recomputation; s = S / c tokens per CP rank);
//   the layer being recomputed holds its activations, 34 s H / t bytes (their Table 2 with
//   sequence parallelism; flash attention removes the 5 a s^2 / t score terms);
//   flash attention's backward keeps an fp32 dQ accumulator, 4 s H / t;
//   CP ring: K, V of s tokens double-buffered in flight, 2 x 2 s H e / t, and in backward
//   dK, dV travelling the same way, 2 x 2 s H e / t, plus the local dK, dV, 2 s H e / t;
//   TP all-gathers the layer input into a buffer of the whole local sequence, 2 s H;
//   PP sends and receives [s / t, H] per message, 2 x 2 s H / t;
//   logits: bf16 [s, V / t] and the fp32 copy the vocab-parallel cross entropy works on,
//   (2 + 4) s V / t (the 4 s V / t is Korthikanti's).
// The loss and a layer's backward do not overlap, so the peak is the larger of the two.
//
// DeepSpeed-Ulysses + ZeRO-3 + FPDT, per device (G = u d devices, s = S / u, c = FPDT chunk):
//   ZeRO-3 (Rajbhandari et al. 2020): bf16 weights 2 Psi / G, bf16 gradients 2 Psi / G,
//   fp32 master weights and Adam m, v 12 Psi / G; gathered bf16 weights of the running layer
//   and the prefetch bucket, 2 (Psi_layer + min(Psi_layer, 5e7)); the running layer's whole
//   bf16 gradient before its reduce-scatter, 2 Psi_layer;
//   checkpoints on the host, 2 s H L bytes; one layer's q, k, v, o chunks on the host,
//   4 x 2 s H, with the fp32 dQ of every chunk, 4 s H;
//   on the device, FPDT keeps whole-local-sequence tensors of the layer: its input, the
//   attention output gathered from the chunks, and in backward the layer-norm output's
//   gradient and the residual gradient, 4 x 2 s H;
//   per chunk: K, V double-buffered, 2 x 2 x 2 c H; q, o, dO, 3 x 2 c H; fp32 dK, dV, dQ
//   accumulators, 3 x 4 c H; the chunk's dq, dk, dv, 3 x 2 c H; the chunk's other
//   activations (MLP and projections), 34 c H - 8 c H counted above;
//   all-to-all send and receive of a chunk's q, k, v or o, 2 x 3 x 2 c H;
//   logits of the local sequence in bf16 and fp32, (2 + 4) s V (Megatron-DeepSpeed's GPT
//   loss is not chunked).
// Bytes a token keeps in one layer's activations at bf16 with sequence parallelism and
// flash attention: Korthikanti et al.'s 34 H for the GPT block; for a Llama-family block
// (no dropout) its inputs of the two norms 4 H, the q/k/v input 2 H, q and the attention
// output 4 Z A, k and v 4 G A, the MLP input 2 H and gate, up, silu(gate) and their
// product 8 F; query/key norms keep their inputs, 2 Z A + 2 G A more.
double layer_activation_bytes(const ModelConfig& c) {
  if (!c.llama()) return 34.0 * c.hidden;
  const double qk_norms = c.qk_norm ? 2.0 * (c.q_width() + c.kv_width()) : 0.0;
  return 8.0 * c.hidden + 4.0 * c.q_width() + 4.0 * c.kv_width() + 8.0 * c.ffn() + qk_norms;
}

Estimate megatron(const ModelConfig& c, i64 S, const Layout& l, const CostModel& cost) {
  const ActPrecision prec = cost.precision();
  const double e = prec == ActPrecision::F32 ? 4 : 2;
  const double H = c.hidden, V = c.vocab, t = l.tp;
  const i64 T = (S + l.cp - 1) / l.cp;  // tokens per CP rank
  const double s = double(T);
  const int stage_layers = (c.layers + l.pp - 1) / l.pp;
  const HardwareProfile& hw = cost.hw();
  const double shards = double(l.dp) * l.cp;
  Estimate best;
  // The first stage (embedding) and the last (tied output embedding and the loss).
  for (int which = 0; which < (l.pp > 1 ? 2 : 1); ++which) {
    const bool first = which == 0, last = which == 1 || l.pp == 1;
    const int b = last && l.pp > 1 ? c.layers - stage_layers : 0;
    const int en = last ? c.layers : stage_layers;
    const double psi = double(sched::param_count(c, b, en, first, last));
    Estimate est;
    const std::string psi_text = "Psi_s = " + formula_num(psi) + " parameters of layers " + std::to_string(b) + "-" +
                                 std::to_string(en - 1) + (first ? " + embedding" : "") +
                                 (last && !first ? " + output embedding" : "");
    add(&est, Row::Weights, 2 * psi / t, 0, "2 B x Psi_s / t (bf16); " + psi_text);
    add(&est, Row::Gradients, 4 * psi / t, 0, "4 B x Psi_s / t (fp32 main gradients)");
    add(&est, Row::Optimizer, 12 * psi / t / shards, 0,
        "12 B x Psi_s / (t x d x cp) = 12 x " + formula_num(psi) + " / " + formula_num(t * shards) +
            " (fp32 master + Adam m, v; distributed optimizer)");
    add(&est, Row::Checkpoints, stage_layers * s * H * e / t, 0,
        std::to_string(stage_layers) + " layers x s H e / t, s = S / cp = " + formula_num(s));
    // The layer phase.
    const double KV = c.kv_width();  // K and V's width (H without grouped-query attention)
    const double recompute = layer_activation_bytes(c) * s / t * (e / 2);
    const double fa = 4 * s * c.q_width() / t;  // Z A (H for GPT's heads)
    const double kv_ring = l.cp > 1 ? 2 * 2 * s * KV * e / t : 0;
    const double dkv_ring = l.cp > 1 ? 2 * 2 * s * KV * e / t : 0;
    const double dkv = 2 * s * KV * e / t;
    const double tp_gather = t > 1 ? 2 * s * H * (e / 2) : 0;
    const double pp_buf = l.pp > 1 ? 2 * 2 * s * H * (e / 2) / t : 0;
    const double layer_phase = recompute + fa + kv_ring + dkv_ring + dkv + tp_gather + pp_buf;
    const double logits = last ? (2 + 4) * s * V / t : 0;
    const double loss_phase = logits + pp_buf + s * H * e / t;  // with the final hidden state
    const bool at_loss = loss_phase > layer_phase;
    add(&est, Row::KVCache, 0, 0, "none kept: each layer's K, V are recomputed with it");
    add(&est, Row::KVGradAccum, at_loss ? 0 : dkv, 0, "2 s H e / t (dK, dV of the local tokens)");
    add(&est, Row::Recompute, at_loss ? 0 : recompute, 0,
        c.llama() ? "(12 H + 4 G A + 8 F) s / t x (e / 2) (a Llama-family block's activations, as Korthikanti et al. "
                    "2022 count them, with sequence parallelism, flash attention)"
                  : "34 s H / t x (e / 2) (Korthikanti et al. 2022, with sequence parallelism, flash attention)");
    add(&est, Row::AttentionWorkspace, at_loss ? 0 : fa, 0,
        c.q_width() == c.hidden ? "4 s H / t (flash attention's fp32 dQ accumulator)"
                                : "4 s Z A / t (flash attention's fp32 dQ accumulator)");
    add(&est, Row::Logits, at_loss ? logits : 0, 0,
        last ? "(2 + 4) s V / t: bf16 logits and their fp32 copy for the cross entropy" : "on the last stage only");
    std::string comm;
    double comm_bytes = at_loss ? pp_buf : kv_ring + dkv_ring + tp_gather + pp_buf;
    if (l.cp > 1 && !at_loss) comm += "CP ring K, V and dK, dV double-buffered 8 s H e / t";
    if (t > 1 && !at_loss) comm += std::string(comm.empty() ? "" : "; ") + "TP all-gather 2 s H";
    if (l.pp > 1) comm += std::string(comm.empty() ? "" : "; ") + "PP send + receive 4 s H / t";
    add(&est, Row::CommBuffers, comm_bytes, 0, comm.empty() ? "none" : comm);
    add(&est, Row::Hidden, at_loss ? s * H * e / t : 0, 0, "the final hidden state [s / t, H] at the loss");
    est.where = std::string(first && l.pp > 1 ? "first" : "last") + " stage, " +
                (at_loss ? "at the loss" : "during the backward of a recomputed layer");
    est.peak = total_device(est);
    if (est.peak > best.peak) best = est;
  }
  // Time of one stage.
  const double gemm = cost.gemm_flops(T) / t / cost.gemm_rate();
  const double attn = cost.attention_flops(0, 0, S) / (t * l.cp) / hw.attention_rate(c.head_size());
  const double elem = hw.elementwise_bw > 0 ? plan::kElementwiseWordsPerToken * H * e * T / t / hw.elementwise_bw : 0;
  const double tp_comm = t > 1 ? 4 * ((t - 1) / t * T * H * e / hw.intra_node_bw + hw.intra_node_latency) : 0;
  const double kv_bytes = double(skeletal_bytes_per_token(c, prec)) * T / t;
  // Ring partners are neighbours in the CP group: in a node when tp * cp fits in one.
  const int partner = l.tp * l.cp <= hw.devices_per_node ? 1 : hw.devices_per_node;
  const double cp_comm = l.cp > 1 ? (l.cp - 1) * cost.message_s(i64(kv_bytes), 0, partner) : 0;
  const double fwd = gemm + elem + std::max(attn, cp_comm) + tp_comm + hw.layer_overhead;
  const double bwd = 2 * gemm + 2 * elem + std::max(2.5 * attn, 2 * cp_comm) + 2 * tp_comm + hw.layer_overhead;
  const double head = cost.head_flops(T) / t / cost.gemm_rate();
  const double stage_busy = stage_layers * (2 * fwd + bwd) + head;
  const double p2p = l.pp > 1 ? 2.0 * (l.pp - 1) * cost.message_s(i64(T * H * e / t), 0, hw.devices_per_node) : 0;
  std::vector<int> group(l.dp * l.cp);
  for (int d = 0; d < l.dp * l.cp; ++d) group[d] = d * l.tp * l.pp;
  const double stage_params = double(sched::param_count(c, 0, stage_layers, true, l.pp == 1)) / t;
  const double allreduce = cost.allreduce_s(i64(stage_params * 4), group);
  best.busy = stage_busy;
  best.step = l.pp * stage_busy + p2p + allreduce;
  return best;
}

Estimate deepspeed(const ModelConfig& c, i64 S, const Layout& l, int gpus, const CostModel& cost) {
  const ActPrecision prec = cost.precision();
  const double e = prec == ActPrecision::F32 ? 4 : 2;
  const double H = c.hidden, V = c.vocab;
  const int u = l.cp;
  const i64 T = (S + u - 1) / u;
  const double s = double(T);
  const HardwareProfile& hw = cost.hw();
  Estimate est;
  est.chunks = int((T + kFpdtChunk - 1) / kFpdtChunk);
  const double ch = double(std::min(T, kFpdtChunk));
  const double n = est.chunks;
  const double psi = double(c.num_params());
  const double psi_l = double(sched::param_count(c, 0, 1, false, false));
  const double G = gpus;
  add(&est, Row::Weights, 2 * psi / G + 2 * (psi_l + std::min(psi_l, kZero3Prefetch)), 0,
      "2 B x Psi / G + 2 B x (Psi_layer + min(Psi_layer, 5e7)): bf16 shards, the running layer and the ZeRO-3 "
      "prefetch bucket gathered; Psi = " + formula_num(psi) + ", G = " + std::to_string(gpus));
  add(&est, Row::Gradients, 2 * psi / G + 2 * psi_l, 0,
      "2 B x Psi / G + 2 B x Psi_layer: bf16 shards and the running layer's gradient before its reduce-scatter");
  add(&est, Row::Optimizer, 12 * psi / G, 0, "12 B x Psi / G (fp32 master + Adam m, v; ZeRO-3)");
  const double ckpt_host = c.layers * s * H * e;
  add(&est, Row::Checkpoints, 0, ckpt_host, "L s H e on the host, s = S / u = " + formula_num(s));
  const double KV = c.kv_width();  // K and V's width (H without grouped-query attention)
  const double QW = c.q_width();   // q's and o's, Z A (H for GPT's heads)
  const double kv_dev = 2 * 2 * ch * KV * e;
  const double layer_host = (2 * QW + 2 * KV) * s * e + 4 * s * QW;
  add(&est, Row::KVCache, kv_dev, 0, "K, V chunks double-buffered, 2 x 2 c H e, c = " + formula_num(ch));
  add(&est, Row::Units, 3 * ch * QW * e, layer_host,
      "device: q, o, dO of a chunk 3 c H e; host: one layer's q, k, v, o 4 s H e and fp32 dQ 4 s H");
  add(&est, Row::KVGradAccum, (2 * KV + QW) * ch * 4, 0, "fp32 dK, dV, dQ of the running chunks, 3 x 4 c H");
  add(&est, Row::Recompute, (layer_activation_bytes(c) - 4 * QW - 4 * KV) * ch * (e / 2), 0,
      "the chunk's other activations, (34 - 8) c H (e / 2) (Korthikanti et al. 2022, q, k, v, o counted above)");
  add(&est, Row::Hidden, 4 * s * H * e, 0,
      "whole local sequence: layer input, gathered attention output, two gradients, 4 s H e");
  add(&est, Row::AttentionWorkspace, (QW + 2 * KV) * ch * e, 0, "the chunk's dq, dk, dv before accumulation, 3 c H e");
  add(&est, Row::CommBuffers, 2 * (QW + 2 * KV) * ch * e, 0, "all-to-all send + receive of a chunk's q, k, v, 2 x 3 c H e");
  const double logits = (2 + 4) * s * V;
  add(&est, Row::Logits, logits, 0, "(2 + 4) s V: bf16 logits of the local sequence and their fp32 copy");
  // The loss and the layers' backward do not overlap: the larger phase is the peak.
  double layer_phase = 0, loss_phase = logits + s * H * e;
  for (const auto& line : est.lines)
    if (line.row != Row::Weights && line.row != Row::Gradients && line.row != Row::Optimizer && line.row != Row::Logits)
      layer_phase += double(line.device);
  const bool at_loss = loss_phase > layer_phase;
  for (auto& line : est.lines) {
    const bool fixed = line.row == Row::Weights || line.row == Row::Gradients || line.row == Row::Optimizer;
    if (fixed) continue;
    if (at_loss && line.row != Row::Logits) line.device = line.row == Row::Hidden ? i64(s * H * e) : 0;
    if (!at_loss && line.row == Row::Logits) line.device = 0;
  }
  est.where = at_loss ? "every device, at the loss" : "every device, during a layer's backward";
  est.peak = total_device(est);
  est.host = i64(ckpt_host + layer_host);
  // Time: compute of forward, recomputed forward and backward of one layer.
  const double gemm = cost.gemm_flops(T) / cost.gemm_rate();
  const double attn = cost.attention_flops(0, 0, S) / u / hw.attention_rate(c.head_size());
  const double elem = hw.elementwise_bw > 0 ? plan::kElementwiseWordsPerToken * H * e * T / hw.elementwise_bw : 0;
  const double compute = 4 * gemm + 4 * elem + 4.5 * attn + 3 * hw.layer_overhead;
  const bool intra = u <= hw.devices_per_node;
  const double bw = intra ? hw.intra_node_bw : hw.inter_node_bw;
  const double lat = intra ? hw.intra_node_latency : hw.inter_node_latency;
  const double a2a = u > 1 ? 3 * 4 * ((u - 1.0) / u * T * H * e / bw + n * (u - 1) * lat) : 0;
  const bool zero_intra = gpus <= hw.devices_per_node;
  const double zbw = zero_intra ? hw.intra_node_bw : hw.inter_node_bw;
  const double gather = 4 * (gpus - 1.0) / gpus * psi_l * e / zbw;
  // Host traffic of one layer (forward, recomputed forward, backward): the checkpoint out
  // and in; q, k, v, o out twice; K, V chunk loads, n (n - 1) / 2 per forward; in the
  // backward's n (n + 1) / 2 steps, q, o, dO and fp32 dQ in, dQ out.
  const double cH = ch * H;
  const double d2h = s * H * e + 2 * 4 * s * H * e + n * (n + 1) / 2 * cH * 4;
  const double h2d = s * H * e + 2 * n * (n - 1) / 2 * 2 * cH * e + n * (n + 1) / 2 * (3 * cH * e + cH * 4);
  const double copies = std::max(d2h / hw.d2h_bw, h2d / hw.h2d_bw);
  const double layer = std::max({compute, gather, copies}) + a2a;
  est.exposed_copy = c.layers * std::max(0.0, copies - std::max(compute, gather));
  est.busy = c.layers * compute + cost.head_flops(T) / cost.gemm_rate();
  est.step = c.layers * layer + cost.head_flops(T) / cost.gemm_rate();
  return est;
}

Estimate estimate(const plan::Plan& p, const CostModel& cost) {
  const bool ulysses = p.system == plan::System::Deepspeed;
  Layout l{p.par.tp, ulysses ? p.par.ulysses : p.par.cp, p.par.pp, p.par.dp};
  return p.system == plan::System::Megatron ? megatron(p.model, p.seq_len, l, cost) : deepspeed(p.model, p.seq_len, l, p.gpus, cost);
}

HardwareProfile node_hardware(const HardwareProfile& hw_in, int gpus_per_node) {
  HardwareProfile hw = hw_in;
  hw.devices_per_node = gpus_per_node;
  return hw;
}

}  // namespace

SimResult simulate_baseline(const plan::Plan& p, const HardwareProfile& hw_in, const SimOptions& options) {
  const HardwareProfile hw = node_hardware(hw_in, p.gpus_per_node);
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
  r.tokens_per_device_per_s = double(p.seq_len) * p.par.dp / (double(p.gpus) * est.step);
  if (options.record) {
    // One block per device: the busy part of the step, the rest a gap.
    for (int d = 0; d < p.gpus; ++d) {
      const int stage = p.par.coord_of(d).stage;
      const double start = p.system == plan::System::Megatron ? stage * est.busy : 0;
      r.events.push_back({d, Lane::Compute, sched::OpKind::Forward, std::string(to_string(p.system)) + " step", start,
                          est.busy});
    }
    r.memory.assign(p.gpus, {{0.0, est.peak}, {est.step, est.peak}});
  }
  return r;
}

MemoryExplain explain_baseline(const plan::Plan& p, const HardwareProfile& hw_in) {
  const HardwareProfile hw = node_hardware(hw_in, p.gpus_per_node);
  const CostModel cost(hw, p.model, precision_of(hw));
  const Estimate est = estimate(p, cost);
  MemoryExplain m;
  m.system = to_string(p.system);
  m.where = est.where;
  m.lines = est.lines;
  if (p.system == plan::System::Megatron) {
    m.notes.push_back("S " + std::to_string(p.seq_len) + ", H " + std::to_string(p.model.hidden) + ", V " +
                      std::to_string(p.model.vocab) + ", e 2 (bf16); t = tp " + std::to_string(p.par.tp) + ", cp " +
                      std::to_string(p.par.cp) + ", pp " + std::to_string(p.par.pp) + ", d = dp " + std::to_string(p.par.dp));
    m.notes.push_back("sources: Korthikanti et al. 2022 (activations, full recomputation, sequence parallelism); "
                      "Megatron-LM docs, distributed optimizer (6 + 12/d bytes a parameter)");
  } else {
    m.notes.push_back("S " + std::to_string(p.seq_len) + ", H " + std::to_string(p.model.hidden) + ", V " +
                      std::to_string(p.model.vocab) + ", e 2 (bf16); u = ulysses " + std::to_string(p.par.ulysses) + ", dp " +
                      std::to_string(p.par.dp) + ", " + std::to_string(est.chunks) + " FPDT chunks");
    m.notes.push_back("sources: Rajbhandari et al. 2020 (ZeRO-3: 2 + 2 + 12 bytes a parameter, sharded); "
                      "Yao et al. 2024 and deepspeed/sequence/fpdt_layer.py (FPDT chunks, host tensors)");
  }
  return m;
}

PlanOutcome solve_baseline(const PlanRequest& req) {
  const ModelConfig& c = req.model;
  const HardwareProfile hw = node_hardware(req.hw, req.gpus_per_node);
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
    p.par.tp = l.tp;
    (req.system == plan::System::Deepspeed ? p.par.ulysses : p.par.cp) = l.cp;
    p.par.pp = l.pp;
    p.par.dp = l.dp;
    p.budget = budget;
    p.offload = req.system == plan::System::Deepspeed ? plan::OffloadMode::Full : plan::OffloadMode::None;
    const Estimate est = estimate(p, cost);
    const bool host_ok = hw.host_memory == 0 || est.host <= hw.host_memory;
    if (est.peak > budget || !host_ok) {
      if (least_peak == 0 || est.peak < least_peak) {
        least_peak = est.peak;
        least_layout = layout_text(p.par) +
                       (host_ok ? "" : "; host memory " + format_bytes(double(est.host)) + " over " +
                                           format_bytes(double(hw.host_memory)));
      }
      return;
    }
    const double tput = double(req.seq_len) * l.dp / (double(G) * est.step);
    if (tput <= best_tput) return;
    best_tput = tput;
    p.lengths = req.system == plan::System::Deepspeed ? plan::partition_length(req.seq_len, est.chunks)
                                          : std::vector<i64>{req.seq_len};
    p.subseqs = int(p.lengths.size());
    p.alpha.assign(p.lengths.size(), req.system == plan::System::Deepspeed ? 1.0 : 0.0);
    p.alpha_rule = req.system == plan::System::Deepspeed ? "fpdt: every checkpoint to the host" : "none: full recomputation";
    for (int s = 0; s < l.pp; ++s) p.stage_layers.push_back(c.layers / l.pp + (s < c.layers % l.pp ? 1 : 0));
    best = p;
  };
  if (req.system == plan::System::Megatron) {
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
    out.error = std::string(to_string(req.system)) + ": no layout of " + std::to_string(G) + " devices fits " +
                std::to_string(req.seq_len) + " tokens in " + format_bytes(double(budget)) +
                " per device (least peak " + format_bytes(double(least_peak)) + " with " + least_layout +
                (req.system == plan::System::Deepspeed ? "; Ulysses needs SP <= heads = " + std::to_string(c.heads) : "") + ")";
    return out;
  }
  const SimResult r = simulate_baseline(best, req.hw);
  best.predicted = {r.step_time_s,    r.tokens_per_device_per_s, r.bubble_ratio, r.peak_device_bytes,
                    r.exposed_copy_s, r.peak_host_bytes,         r.host_update_s};
  out.ok = true;
  out.plan = best;
  return out;
}

}  // namespace sppo::sim
