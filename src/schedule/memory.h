// Device-memory rules of a schedule (DESIGN.md 4), shared by the validator (program order)
// and the simulator (timed). They mirror the runtime's arena exactly:
//  - fixed for the step: the token ids and the loss sum (step_input_bytes); weights,
//    their working copy in the activation type (bf16 only), gradients and AdamW m, v of the
//    owned layers, fp32,
//    `param_state_bytes` (16) per parameter; every SP rank and DP replica of a stage holds
//    a full copy of that stage's weights and gradients, and, under ZeRO-1, only its share
//    of the AdamW state (zero_state_params).
//  - F(i), per layer: workspace (kernel scratch included) for the layer's duration; K_i, V_i (skeletal, until B(i)
//    of that layer) and the unit U(l, i) (offloadable); the layer's output [T, H], which is
//    the next layer's saved input (so part of its unit), or, after the last layer, the
//    head's input, freed at the end of F, or, after a stage's last layer, the hidden state
//    for the next stage, freed as each Send of it ends. After the last layer of the model:
//    the head's workspace transiently and head_grad [T, H] (part of subsequence i's unit).
//  - Recv Hidden / HiddenGrad: the receive is posted when the compute op before it starts
//    (or at the rank's first op), and its [tokens, H] buffer is allocated then. A stage's
//    F uses the received hidden state as its first layer's saved input; its B uses the
//    received gradient as the residual gradient.
//  - O(i) fraction a: the tensors select_offload(a) picks (core/layout.h) released when the
//    copy ends;
//    P(i) allocates them again at its start.
//  - B(i): head_grad of i (or the received gradient) carries the residual gradient, freed
//    at the end on the first stage, else as each Send HiddenGrad of it ends; per layer from
//    the last: workspace; on the
//    first backward touching layer l, dK/dV accumulators (fp32) for every position whose
//    K, V this rank holds for l; at the end of the layer: K_i, V_i, dK/dV rows of i, U(l, i)
//    and the workspace are freed.
// Pieces (pieces > 1: SP ranks or MSP pieces) also hold two chunk buffers of K, V while
// forward runs (ring / stream receive, double-buffered) and of K, V and dK, dV in backward.
// Borrowed weights (MSP): Recv Weights allocates a working copy of the stage's weights
// (activation precision); a lease that another Recv Weights of the same layers follows is
// released at the end of the last F/B on those layers before it. The first backward on
// borrowed layers allocates their fp32 gradients; Send WeightGrads releases both.
#pragma once

#include <map>
#include <set>
#include <utility>
#include <vector>

#include "core/config.h"
#include "core/layout.h"
#include "schedule/ir.h"

namespace sppo::sched {

struct MemoryRules {
  ModelConfig model;
  ActPrecision precision = ActPrecision::BF16;
  i64 head_chunk = 1024;        // logits rows computed at once
  int param_state_bytes = 16;   // fp32 weight + grad + AdamW m + v
  int optimizer_bytes = 8;      // of which AdamW m + v
  int accum_bytes = 4;          // dK/dV accumulators are fp32 on every backend
  int weight_copy_bytes = 0;    // per parameter: the GEMMs' working copy of the weights (2 in bf16)
  bool zero = false;            // ZeRO-1: AdamW state sharded over the gradient all-reduce group
  // Kernel scratch the runtime allocates with each layer's workspace, and with the head's
  // (the CPU backend's, kernels/scratch.h; zero where kernels bring their own).
  KernelScratch block_scratch, head_scratch;

  int act_bytes() const { return precision == ActPrecision::F32 ? 4 : 2; }
};

// Parameters of layers [b, e) of the model, with the embedding when `embed` and the final
// LayerNorm (and tied head) when `head`.
i64 param_count(const ModelConfig& c, int b, int e, bool embed, bool head);

// The step's inputs on the device: S + 1 token ids (int32) and the loss sum (a double).
inline i64 step_input_bytes(i64 S) { return (S + 1) * 4 + 8; }

// Parameters whose AdamW state rank `index` of `shards` keeps under ZeRO-1 for layers
// [b, e): piece `index` of each bucket (the embedding, each layer, the final LayerNorm;
// core/layout.h piece_range), as the runtime shards them.
i64 zero_state_params(const ModelConfig& c, int b, int e, int shards, int index);

// Peak device bytes of the full-recomputation baseline (one process, the whole sequence
// of S tokens as one subsequence): the runtime keeps each block's input through forward
// and, in backward, recomputes one block's saved tensors at a time (runtime/executor.h).
// The simulator does not run that schedule; this follows its allocations step by step so
// that a budget is checked before training.
i64 recompute_peak_bytes(const MemoryRules& rules, i64 S);

// Bytes per rank an AllReduce op sums: fp32 gradients of its layers (with the embedding
// and final LayerNorm where the layers include the first or last), or of the tied embedding.
i64 allreduce_bytes(const Op& op, const ModelConfig& c, int layers);

// A device-memory change inside an op: `at` in [0, 1] is the position in the op's duration
// (per-layer events of F and B); an offload's release is at 1, the end of its copy.
struct MemEvent {
  double at = 0;
  i64 delta = 0;
};

// The memory state of one rank while its ops are interpreted in program order.
class RankMemory {
 public:
  RankMemory(const MemoryRules& rules, const Schedule& s, int rank);

  i64 fixed_bytes() const { return fixed_; }
  // Appends the events of `op` to `out`: every op of this rank, by reference into the
  // schedule, in program order.
  void events(const Op& op, std::vector<MemEvent>* out);
  // Bytes an Offload op moves (valid after the F ops of its subsequence were seen).
  i64 offload_bytes(const Op& op) const;
  i64 prefetch_bytes(const Op& op) const;
  // Host bytes currently held by offloads not yet prefetched.
  i64 host_bytes() const { return host_; }
  // Device bytes held beyond the fixed part after every event so far (0 when all freed).
  i64 live_bytes() const { return live_; }

  // Per-token sizes, for the planner's closed forms.
  i64 kv_per_token() const { return kv_pt_; }
  i64 unit_per_token() const { return unit_pt_; }
  i64 ws_per_token() const { return ws_pt_; }
  i64 head_grad_per_token() const { return head_pt_; }
  i64 acc_per_token() const { return acc_pt_; }

 private:
  i64 tokens_of(const Op& op) const;
  i64 head_ws(i64 T) const;
  i64 piece_fwd_extra(const Op& op, i64 T) const;
  i64 piece_bwd_extra(const Op& op, i64 T) const;
  void emit(std::vector<MemEvent>* out, double at, i64 delta);

  const MemoryRules& rules_;
  const Schedule& s_;
  int rank_;
  i64 fixed_ = 0;
  i64 kv_pt_ = 0, unit_pt_ = 0, ws_pt_ = 0, head_pt_ = 0, acc_pt_ = 0, weight_work_pp_ = 0;
  std::vector<i64> acc_tokens_;        // per layer: positions whose K, V this rank holds
  std::vector<bool> acc_live_;         // per layer: accumulators allocated
  std::map<int, std::vector<i64>> unit_tensors_;  // subsequence -> its offloadable tensors' bytes
                                                 // on this rank, in select_offload order
  std::map<int, i64> offloaded_;       // subsequence -> bytes on the host
  std::map<size_t, i64> release_after_;            // op index -> borrowed weight bytes freed at its end
  std::map<size_t, i64> posted_at_;                // op index -> receive buffers allocated at its start
  std::set<std::pair<int, int>> borrowed_grads_;   // borrowed layer ranges with gradients
  size_t next_ = 0;                                // index of the next op of this rank
  std::pair<int, int> own_;                        // owned layers [begin, end)
  i64 host_ = 0;
  i64 live_ = 0;
};

}  // namespace sppo::sched
