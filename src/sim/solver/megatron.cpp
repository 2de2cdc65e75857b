// The Megatron-LM baseline as a schedule (plan --system megatron): the layouts Megatron-LM
// runs a long sequence with, each built by sched::build_step and priced by the simulator and
// the memory rules that price SPPO's plans, so that the comparison is of two schedules, and
// `train --plan` runs the plan it returns.
//
// Note [Megatron-LM as a schedule]
// Megatron-LM trains one long sequence as one micro-batch: tensor parallelism with
// sequence-parallel regions (tp, inside a node, dividing the heads), context parallelism
// by ring attention (cp, zigzag), pipeline stages of even layer counts (pp) and data-parallel
// replicas (dp), the distributed optimizer (its fp32 master and AdamW state sharded over
// dp x cp: ZeRO-1 over the layer group), and full activation recomputation. In sppo's IR
// that is a step of N = 1 with nothing offloaded (alpha 0), every saved tensor recomputed
// that this layout can recompute, and K/V recomputed from each layer's input where neither
// tp nor cp splits the rows (--kv-cache recompute). Where it differs from Megatron-LM:
//  - under tp or cp each layer keeps its K and V beside its input x (sppo recomputes K/V
//    from one rank's whole rows only): 2 G A values a token a layer that Megatron-LM's full
//    recomputation does not keep (G A the K/V width);
//  - under a ring the attention's output and log-sum-exp are kept, not recomputed (sppo's
//    backward does not run the ring's forward again);
//  - the LM head runs in the forward, as Megatron-LM's does; its loss gradient is kept.
// The closed form of Note [Baseline models] (sim/baselines.cpp), which `plan --system
// megatron` returned until 2026-12-07, prices Megatron-LM's own full recomputation from its
// published accounting, K/V recomputed: it stays, as the note a plan carries (or the error
// when nothing fits) beside the schedule's figures, since the first difference above is
// most of what the schedule holds beyond it at long sequences (gpt-7b at 1M on 8 H200s:
// tp 8 keeps 64 GiB of K/V a device). The step times and peaks of the plan are the
// simulator's, as SPPO's are (docs/planning.md#the-baselines).
#include <algorithm>
#include <cstdio>

#include "planner/partition.h"
#include "sim/baselines.h"
#include "sim/solver/search.h"

namespace sppo::sim::solver {

using plan::divisors;

SavedSet megatron_recompute(const ParallelDims& par) {
  SavedSet all = recompute_levels().back() & ~kHeadGradGroup;
  if (par.cp > 1 || par.ulysses > 1) all &= ~kAttentionGroup;
  return all;
}

namespace {

std::string tput_text(double t) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", t);
  return buf;
}

}  // namespace

PlanOutcome solve_megatron(const PlanRequest& req) {
  const ModelConfig& c = req.model;
  const HardwareProfile hw = plan_hardware(req.hw, req.gpus_per_node);
  const ActPrecision prec = precision_of(hw);
  const i64 budget = req.budget > 0 ? req.budget : hw.usable_memory();
  const i64 host_limit = hw.host_memory;
  const int G = req.gpus, node = std::min(G, req.gpus_per_node);
  PlanOutcome out;
  plan::Plan best;
  double best_tput = 0;
  double closest = 0;  // the least need over limit of a layout that does not fit
  std::string closest_text;
  for (int tp : divisors(node)) {
    if (tp > c.heads || c.heads % tp || (c.llama() && !sched::llama_tp_runs(c, tp))) continue;
    for (int cp : divisors(G / tp)) {
      if (cp > kMaxRing || req.seq_len < i64(2) * cp * tp) continue;
      for (int pp : divisors(G / tp / cp)) {
        if (pp > c.layers) continue;
        plan::Plan p;
        p.system = plan::System::Megatron;
        p.model_name = req.model_name;
        p.model = c;
        p.hardware = req.hardware;
        p.seq_len = req.seq_len;
        p.gpus = G;
        p.gpus_per_node = req.gpus_per_node;
        p.par.tp = tp;
        p.par.cp = cp;
        p.par.pp = pp;
        p.par.dp = G / tp / cp / pp;
        p.par.ring_layout = RingLayout::Zigzag;
        p.par.zero = req.zero.value_or(cp * p.par.dp > 1 ? ZeroStage::OptimizerState : ZeroStage::None);
        p.subseqs = 1;
        p.lengths = {req.seq_len};
        p.alpha = {0.0};
        p.alpha_rule = "none: full recomputation";
        p.offload = plan::OffloadMode::None;
        p.budget = budget;
        p.precision = prec;
        p.block_scratch = req.block_scratch;
        p.head_scratch = req.head_scratch;
        p.place.recompute = megatron_recompute(p.par);
        // Without tp or cp a rank recomputes its K/V from the layer's input, as Megatron-LM's
        // full recomputation does (--kv-cache recompute; not over the tp or ring ranks).
        if (tp == 1 && cp == 1) p.place.kv.assign(std::size_t(c.layers), KvPlace::Recompute);
        p.stage_layers = plan::balanced_stage_layers(c.layers, pp, 0.0);
        predict(&p, req.hw);
        const double device = double(p.predicted.peak_device_bytes) / double(budget);
        const double host = host_limit > 0 ? double(p.predicted.peak_host_bytes) / double(host_limit) : 0.0;
        if (device > 1 || host > 1) {
          const double need = std::max(device, host);
          if (closest == 0 || need < closest) {
            closest = need;
            closest_text = layout_text(p.par) + ": " +
                           (device >= host ? format_bytes(double(p.predicted.peak_device_bytes)) + " of device memory"
                                           : format_bytes(double(p.predicted.peak_host_bytes)) + " of host memory");
          }
          continue;
        }
        if (p.predicted.tokens_per_gpu_per_s <= best_tput) continue;
        best_tput = p.predicted.tokens_per_gpu_per_s;
        best = p;
      }
    }
  }
  // Megatron-LM's own accounting, K/V recomputed (the closed form).
  const PlanOutcome formula = solve_baseline(req);
  const std::string own =
      "Megatron-LM's full recomputation, K/V recomputed too, by the closed form (Note [Baseline models]): " +
      (formula.ok ? plan::layout_text(formula.plan) + " at " + tput_text(formula.plan.predicted.tokens_per_gpu_per_s) +
                        " tokens/GPU/s, peak " + format_bytes(double(formula.plan.predicted.peak_device_bytes))
                  : std::string("nothing fits"));
  if (best_tput == 0) {
    out.error = "megatron: no layout of " + std::to_string(G) + " devices fits " + std::to_string(req.seq_len) +
                " tokens in " + format_bytes(double(budget)) + " per device as sppo runs it (K/V kept where tp or cp splits the rows)" +
                (closest_text.empty() ? std::string(" (no layout divides the heads and the sequence)")
                                      : " (the closest, " + closest_text + ")") +
                "; " + own;
    return out;
  }
  best.notes.push_back("Megatron-LM as sppo runs it (Note [Megatron-LM as a schedule]): one subsequence, nothing "
                       "offloaded, " + recompute_tensors_text(best.place.recompute) +
                       (best.place.any_kv_streamed() ? " recomputed, K/V recomputed too"
                                                     : " recomputed, K/V kept on the device"));
  best.notes.push_back(own);
  out.ok = true;
  out.plan = best;
  return out;
}

}  // namespace sppo::sim::solver
