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

#include "planner/partition.h"
#include "sim/solver/search.h"

namespace sppo::sim::solver {

using plan::divisors;

SavedSet megatron_recompute(const ParallelDims& par) {
  SavedSet all = recompute_levels().back() & ~kHeadGradGroup;
  if (par.cp > 1 || par.ulysses > 1) all &= ~kAttentionGroup;
  return all;
}

PlanOutcome solve_megatron(const PlanRequest& req) {
  const ModelConfig& c = req.model;
  const int G = req.gpus, node = std::min(G, req.gpus_per_node);
  BaselinePick pick(req);
  for (int tp : divisors(node)) {
    if (tp > c.heads || c.heads % tp || (c.llama() && !sched::llama_tp_runs(c, tp))) continue;
    for (int cp : divisors(G / tp)) {
      if (cp > kMaxRing || req.seq_len < i64(2) * cp * tp) continue;
      for (int pp : divisors(G / tp / cp)) {
        if (pp > c.layers) continue;
        plan::Plan p = pick.start();
        p.par.tp = tp;
        p.par.cp = cp;
        p.par.pp = pp;
        p.par.dp = G / tp / cp / pp;
        p.par.ring_layout = RingLayout::Zigzag;
        p.par.zero = req.zero.value_or(cp * p.par.dp > 1 ? ZeroStage::OptimizerState : ZeroStage::None);
        if (shards_gradients(p.par.zero) && p.par.zero_sharding_refused()) continue;
        p.subseqs = 1;
        p.lengths = {req.seq_len};
        p.alpha = {0.0};
        p.alpha_rule = "none: full recomputation";
        p.offload = plan::OffloadMode::None;
        p.place.recompute = megatron_recompute(p.par);
        // Without tp or cp a rank recomputes its K/V from the layer's input, as Megatron-LM's
        // full recomputation does (--kv-cache recompute; not over the tp or ring ranks).
        if (tp == 1 && cp == 1) p.place.kv.assign(std::size_t(c.layers), KvPlace::Recompute);
        p.stage_layers = plan::balanced_stage_layers(c.layers, pp, 0.0);
        pick.consider(std::move(p));
      }
    }
  }
  PlanOutcome out = pick.outcome("Megatron-LM as sppo runs it (Note [Megatron-LM as a schedule]): one subsequence, "
                                 "nothing offloaded, every tensor the layout can recompute recomputed",
                                 "no layout divides the heads and the sequence");
  if (out.ok && out.plan.place.any_kv_streamed()) out.plan.notes.front() += ", K/V too";
  return out;
}

}  // namespace sppo::sim::solver
