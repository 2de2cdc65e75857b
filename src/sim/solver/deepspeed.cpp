// The DeepSpeed-Ulysses baseline as a schedule (plan --system deepspeed): the layouts DeepSpeed
// runs a long sequence with, each built by sched::build_step and priced by the simulator and
// the memory rules that price SPPO's plans, so that `train --plan` runs the plan it returns.
//
// Note [DeepSpeed-Ulysses as a schedule]
// DeepSpeed-Ulysses with ZeRO-3 and FPDT (Yao et al. 2024) trains a long sequence as: Ulysses
// over u ranks (the heads split by all-to-alls around attention; u as ulysses_runs allows),
// the other devices data-parallel replicas, no pipeline and no tensor parallelism; ZeRO-3 over
// every rank that holds the layers (u x dp); FPDT's chunks of 8192 local tokens, in order, the
// K/V of earlier chunks fetched back from the host for each chunk's attention, and each
// layer's input checkpointed to the host and the layer recomputed in backward. In sppo's IR:
// --ulysses u, --dp G / u, --zero 3, N = S / (8192 u) equal subsequences, every layer's K/V on
// the host (streamed back a chunk at a time), every saved tensor recomputed that Ulysses can
// recompute, and the rest offloaded whole (alpha 1). Where it differs from DeepSpeed:
//  - the attention's output and log-sum-exp are kept across a chunk's forward and backward
//    (sppo does not run Ulysses' all-to-alls again inside a backward), FPDT recomputes them;
//  - the backward runs chunk by chunk through every layer (the paper's order), FPDT's inner
//    loop runs over later query chunks for each K/V chunk;
//  - the embedding, final norm and LM head stay whole on every rank, and the head runs 1024
//    rows at a time (Megatron-DeepSpeed's loss holds the logits of the local sequence).
// The closed form of Note [Baseline models] (sim/baselines.cpp), which `plan --system
// deepspeed` returned until 2026-12-07, stays as the note a plan carries (or the error when
// nothing fits), from DeepSpeed's and FPDT's published accounting.
#include <algorithm>

#include "planner/partition.h"
#include "sim/solver/search.h"

namespace sppo::sim::solver {

using plan::divisors;

namespace {

constexpr i64 kFpdtChunkTokens = 8192;  // FPDT's local tokens a chunk

}  // namespace

PlanOutcome solve_deepspeed(const PlanRequest& req) {
  const ModelConfig& c = req.model;
  const int G = req.gpus;
  BaselinePick pick(req);
  for (int u : divisors(G)) {
    if (!ulysses_runs(c, u)) continue;
    const int N = int(std::max<i64>(1, std::min<i64>(kMaxPlanSubseqs, req.seq_len / (i64(u) * kFpdtChunkTokens))));
    const std::vector<i64> lengths = plan::partition_length(req.seq_len, N);
    if (lengths.back() < u) continue;
    plan::Plan p = pick.start();
    p.par.ulysses = u;
    p.par.dp = G / u;
    p.par.zero = G > 1 ? ZeroStage::Weights : ZeroStage::None;
    p.subseqs = N;
    p.lengths = lengths;
    p.alpha.assign(std::size_t(N), 1.0);
    p.alpha.back() = 0.0;  // the last chunk's backward follows its forward
    p.alpha_rule = "fpdt: every layer's activations to the host";
    p.offload = plan::OffloadMode::Full;
    p.place.kv.assign(std::size_t(c.layers), KvPlace::Host);
    p.place.recompute = megatron_recompute(p.par);
    p.stage_layers = {c.layers};
    pick.consider(std::move(p));
  }
  return pick.outcome("DeepSpeed-Ulysses as sppo runs it (Note [DeepSpeed-Ulysses as a schedule]): ZeRO-3 where "
                      "there are replicas or Ulysses members, FPDT's "
                      "chunks as subsequences, K/V on the host, every tensor Ulysses can recompute recomputed, the "
                      "rest offloaded",
                      "Ulysses needs a degree the heads allow");
}

}  // namespace sppo::sim::solver
