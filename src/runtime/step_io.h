// What a Runtime (runtime/executor.h) is given and what one of its steps reports: the
// runtime's options (RuntimeOptions), how one call of step() fits into an optimizer step
// (StepControl), and the step's result with its timeline (StepResult, TraceSpan, on the
// clock now_s reads). Apart from the Runtime class, so that the parts a step is made of
// read the options and write the result without depending on the class that runs them.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "comm/comm.h"
#include "core/layout.h"
#include "runtime/memory.h"
#include "schedule/ir.h"

namespace sppo {

struct RuntimeOptions {
  i64 device_budget = 0;    // bytes; 0 = unlimited
  i64 host_budget = 0;      // bytes of the host tier (offloaded copies, host K/V, optimizer state); 0 = unlimited
  bool recompute = false;   // baseline: keep only block inputs, recompute the rest in backward
  int head_chunk = 1024;    // rows of logits computed at once
  bool record_memory = false;  // keep the device tier's timeline in StepResult::memory
  // Several ranks: which op list this process runs, the layers it owns [begin, end)
  // ({0, 0}: all), and how the AdamW state is sharded (ZeRO-1 over `zero_shards` ranks of
  // the data-parallel group; 1: not sharded).
  int rank = 0;
  comm::Comm* comm = nullptr;  // null: the schedule must have one rank
  std::pair<int, int> layers{0, 0};
  int zero_shards = 1;
  int zero_index = 0;
  // The fp32 master weights and AdamW m, v of the rank's shard in the host tier, updated
  // there (runtime/host_optimizer.h); false: the device tier.
  bool optimizer_host = false;
  // The layers' fp32 weights and gradients in the host tier too, each layer's brought to
  // the device for the F/B ops that run it (--weights host; runtime/host_weights.h, Note
  // [Weights on the host] in schedule/weights.h); needs optimizer_host, whose master they are.
  bool weights_host = false;
  // The ZeRO stage over the zero_shards ranks (Notes [ZeRO-2] and [ZeRO-3] in
  // schedule/weights.h): from 2 the gradients sharded as the AdamW state is, each layer's
  // whole only while the step uses it (no tp or recompute); at 3 the weights too, each
  // layer's gathered whole for the ops that run it.
  ZeroStage zero = ZeroStage::None;
  bool grads_sharded() const { return shards_gradients(zero); }
  bool weights_sharded() const { return shards_weights(zero); }
  // Kernel scratch taken from the device tier with each layer's workspace and the head's
  // (Backend::block_scratch, head_scratch); zero: the kernels' own memory.
  KernelScratch block_scratch, head_scratch;
  Backend* backend = nullptr;  // null: a CPU backend of the runtime's own
  // Tensor parallelism with sequence-parallel regions (model/tensor_parallel.h): this rank
  // is member tp.index of the group of consecutive world ranks that share its ops; its
  // parameters, saved tensors and workspaces are its shards (core/layout.h TpShard).
  TpShard tp;
  // Ulysses sequence parallelism (runtime/ulysses.h): this rank is member ulysses.index of
  // its Ulysses group; its saved tensors and workspaces are its rows' and heads' (core/layout.h
  // UlyssesShard). Not beside tp.
  UlyssesShard ulysses;
  // An evaluation's runtime (`sppo eval`): the weights alone, no gradients or AdamW state;
  // it runs forward-only schedules only (Schedule::forward_only).
  bool inference = false;
};

// One span of the step's timeline: the op that ran, on which lane, when.
enum class Lane { Compute, CopyOut, CopyIn, Network };
struct TraceSpan {
  std::string name;   // "F3", "O2", "wait P1", "send hidden s2 -> r1", ...
  sched::OpKind kind;
  Lane lane;
  double start_s = 0;  // since the step started
  double dur_s = 0;
};

struct StepResult {
  double loss = 0;                // summed cross-entropy over StepControl::loss_tokens (last stage)
  i64 predicted = 0;              // positions of this sequence predicted: S, or those with targets
  bool has_loss = false;          // this rank holds the LM head, so loss and losses are set
  std::vector<float> losses;      // [S] per-position losses
  // A forward-only step: [S], 1 where the position's most likely next token is its target
  // (empty otherwise).
  std::vector<std::uint8_t> hits;
  MemoryStats device;             // device tier over the step (peak = high-water mark)
  MemoryStats host;               // host tier (the offloaded copies) over the step
  i64 offloaded_bytes = 0;        // bytes copied to the host tier during the step
  double exposed_copy_s = 0;      // compute time spent waiting on copies
  double comm_wait_s = 0;         // compute time spent waiting on messages and reductions
  double ring_wait_s = 0;         // the part of it inside F and B ops, on ring attention's messages
  double compute_s = 0;           // time in F and B ops
  i64 sent_bytes = 0;             // point-to-point bytes sent: Send ops' messages and ring attention's
  i64 collective_bytes = 0;       // the weight collectives' buffers: gradient buckets reduced, layers
                                  // gathered (sched::collective_bytes predicts them)
  double step_s = 0;              // wall time of the step
  double start_s = 0;             // steady-clock time the step started (aligns ranks' traces)
  std::vector<TraceSpan> trace;
  std::vector<std::pair<double, i64>> memory;  // (s since step start, device bytes in use)
};

// How one call of step() fits into an optimizer step of several sequences.
struct StepControl {
  bool accumulate = false;  // add to the gradients instead of zeroing them first
  bool reduce = true;       // run the schedule's AllReduce ops (the last micro-batch only)
  // The targets [S] of the inputs tokens[0..S) (kNoTarget where a position is not
  // predicted): a bidirectional model's masked tokens, or a causal model's next tokens under
  // packed documents or labels (Schedule::targets_given); else null, the next tokens.
  const std::int32_t* targets = nullptr;
  // Packed documents (--pack; Schedule::packed): the starts of the step's documents
  // (sorted, the first 0), which the blocks' attention and RoPE keep apart, and `targets`
  // (kNoTarget at each document's last position, which would predict the next document).
  const std::vector<i64>* docs = nullptr;
  // The positions the loss averages over: those predicted in all the sequences of the
  // optimizer step, so that each sequence's loss and gradients are its share of the step's
  // mean (0: this sequence's predicted positions alone).
  i64 loss_tokens = 0;
};

// Seconds on the steady clock, which every process on a machine shares, so that the
// spans of several ranks line up in one trace.
inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline constexpr double kShownWaitS = 1e-4;  // waits shorter than this stay out of the trace

// Adds the span [t0, t1] (now_s() seconds) to the step's timeline, which starts at
// result.start_s.
inline void add_span(StepResult& result, std::string name, sched::OpKind kind, Lane lane, double t0, double t1) {
  result.trace.push_back({std::move(name), kind, lane, t0 - result.start_s, t1 - t0});
}

}  // namespace sppo
