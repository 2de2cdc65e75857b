// Schedule builders: pure functions from a plan's shape to a Schedule (docs/design.md,
// Conventions 1). They print nothing and keep no state; passes that need a cost model live
// in sim/.
#pragma once

#include <vector>

#include "core/config.h"
#include "core/dims.h"
#include "core/step_shape.h"
#include "schedule/ir.h"

namespace sppo::sched {

// The single-process SPPO schedule (docs/design.md 4), one rank, layers [0, layers):
//   F s0, O s0 a0, F s1, WO s0, O s1 a1, F s2, WO s1, ..., F s(N-1), WO s(N-2),
//   P s(N-2), B s(N-1), WP s(N-2), P s(N-3), B s(N-2), WP s(N-3), ..., B s0.
// The offload of i hides behind the forward of i+1; the prefetch of i behind the backward
// of i+1. Offload/prefetch/wait ops of a subsequence with alpha 0 are omitted.
// Requires alpha.size() == lengths.size(), every alpha in [0, 1] and alpha.back() == 0.
Schedule build_single(int layers, const std::vector<i64>& lengths, const std::vector<double>& alpha);

// The shape of a multi-rank SPPO schedule: its lengths and offload fractions, its
// parallelism (of which the builder lays out pp, cp and dp, with MSP and the ring's layout;
// expand_tensor_parallel adds tp), the stages' layer split. Ranks are numbered as Note [Rank
// layout] in core/parallel.h says (par.rank_of).
struct PipelineSpec {
  int layers = 0;                  // L
  std::vector<i64> lengths;        // l_i, N = lengths.size()
  std::vector<double> alpha;       // per subsequence; empty means no offload
  ParallelDims par;
  // One of par.dp identical replicas, built alone with par.dp 1 (the planner's search
  // simulates one and prices its all-reduce across all: CostModel::price_replicas): the
  // step ends in the all-reduce even where this replica's own group is a single rank.
  bool replicated = false;
  std::vector<int> stage_layers;   // layers per stage; empty means as even as possible
  bool tied = true;                // the LM head is the embedding (GPT): its gradients summed across stages
};

// Layer split [begin, end) per stage: `stage_layers` when given, else L/P each with the
// remainder on the first stages.
std::vector<std::pair<int, int>> stage_ranges(const PipelineSpec& spec);
std::vector<std::pair<int, int>> stage_ranges(int layers, int pp, const std::vector<int>& stage_layers);

// The sequence pipeline (docs/design.md 6): stage p runs F(0..N-1) then B(N-1..0) over its
// layer block; Send/Recv Hidden after each F to p+1 and HiddenGrad after each B to p-1;
// with cp > 1 every F and B is preceded by its ring-attention steps; with MSP the
// bubble-adjacent subsequences run in pieces on the idle stages; with dp > 1 the step
// ends in an all-reduce of each stage's weight gradients across replicas, and with pp > 1
// in one of the tied embedding's gradient between the first and last stage. With tp > 1,
// expanded for tensor parallelism (expand_tensor_parallel).
Schedule build_pipeline(const PipelineSpec& spec);

// Whether build_step builds every replica of the shape, or, for the planner's search, one
// of shape.par.dp identical replicas alone (PipelineSpec::replicated) and of each Ulysses
// group the first member's ops alone (Note [One Ulysses member in the search] in
// builders.cpp).
enum class Replicas : char { All, One };

// The schedule of one step of `shape` (core/step_shape.h) for model `c`: build_single for
// one process, else the sequence pipeline of the shape's parallelism, in its backward order
// (to_layer_major), carrying its placements. The one builder the setup, the planner and
// the benchmarks call.
Schedule build_step(const ModelConfig& c, const std::vector<i64>& lengths, const std::vector<double>& alpha,
                    const StepShape& shape, Replicas replicas = Replicas::All);

// Tensor parallelism with sequence-parallel regions (--tp; model/tensor_parallel.h): every
// rank r of `s` becomes the tp ranks of its tensor-parallel group, members t = 0 .. tp - 1
// (consecutive: Note [Rank layout] in core/parallel.h), which run r's op list together,
// member t on its shards. Peers and all-reduce groups map to the member
// with the same index (its shards have the same shapes), and a hidden-state message
// carries that member's rows piece_range(tokens, t, tp) of the piece; under MSP, where two
// tasks split a subsequence differently, the runs of positions two members' rows share,
// inside a group too (Note [Hidden states of MSP pieces under tensor parallelism] in
// builders.cpp).
Schedule expand_tensor_parallel(Schedule s, int tp);  // tp 1: s itself

// Ulysses sequence parallelism (--ulysses; runtime/ulysses.h): every rank r of `s` becomes
// the U ranks of its Ulysses group (consecutive, inside the tensor-parallel index: Note [Rank
// layout] in core/parallel.h), which run r's op list together, member u on its rows
// piece_range(T, u, U) of every piece, each F and B after an AllToAll of the group (Note
// [Ulysses members] in builders.cpp). Before expand_tensor_parallel, which refuses s with
// Ulysses in it; throws for MSP's pieces, and for a piece of fewer than U tokens.
Schedule expand_ulysses(Schedule s, int U);  // U 1: s itself

// The same schedule with a layer-major backward (BackwardOrder::Layer; Note [Layer-major
// backward] in builders.cpp), each stage's layers; throws naming what runs for MSP's
// pieces.
Schedule to_layer_major(Schedule s);

// The evaluation step of `s` (Schedule::forward_only; Note [Forward-only steps] in
// builders.cpp): its F ops with their ring steps, all-to-alls and hidden states, in the same
// order; throws naming what runs for MSP's pieces.
Schedule to_forward_only(Schedule s);

// Gives every Offload and Prefetch of `s` the fraction alpha[subseq]. The builders' ops
// depend on alpha only through which subsequences offload (alpha_i > 0 adds the copies and
// their waits) and those fractions, so for an alpha under which the same subsequences
// offload as under the one `s` was built with, this returns `s` to what the builder
// would build for it, without building it again.
void set_offload_fractions(Schedule* s, const std::vector<double>& alpha);

}  // namespace sppo::sched
