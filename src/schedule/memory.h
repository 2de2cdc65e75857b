// Device-memory rules of a schedule (docs/design.md 4), shared by the validator (program order)
// and the simulator (timed). They mirror the runtime's arena exactly:
//  - fixed for the step: the token ids and the loss sum (step_input_bytes); weights,
//    their working copy in the activation type (bf16 only), gradients and AdamW m, v of the
//    owned layers, fp32,
//    `param_state_bytes` (16) per parameter; every SP rank and DP replica of a stage holds
//    a full copy of that stage's weights and gradients, and, under ZeRO-1, only its share
//    of the AdamW state (zero_state_params). With the optimizer state on the host
//    (optimizer_host, Note [Optimizer state on the host] in runtime/host_optimizer.h) the
//    device keeps the weights and gradients, and the host tier holds, for the parameters
//    whose state the rank keeps, an fp32 master copy, AdamW m, v and a copy of their
//    gradients, fixed for the run (host_fixed_terms).
//  - With the layers' weights on the host (Schedule::weights_host, Note [Weights on the
//    host] in schedule/weights.h) the fixed part keeps only the embedding's, the final
//    norm's and the LM head's weights and gradients; each layer's working copy is held
//    (MemTerm::LayerWeights) from the start of the use before its own (the rank's first:
//    its own) to the end of its last use in a row, and its fp32 gradient
//    (MemTerm::LayerGrads) from the start of its first backward to the end of the use after
//    its last (LayerUses says which). The host's fixed part is the optimizer state's: its
//    fp32 master is the layers' weights and its gradients' copy their gradients (in bf16 it
//    also keeps the layers' working copies, which the copies bring over).
//  - F(i), per layer: workspace (kernel scratch included) for the layer's duration; K_i, V_i (skeletal, until B(i)
//    of that layer) and the unit U(l, i) (offloadable); the layer's output [T, H], which is
//    the next layer's saved input (so part of its unit), or, after the last layer, the
//    head's input, freed at the end of F, or, after a stage's last layer, the hidden state
//    for the next stage, freed as each Send of it ends. After the last layer of the model:
//    the head's workspace transiently and head_grad [T, H] (part of subsequence i's unit).
//  - A forward-only step (Schedule::forward_only): F as above but that each layer's unit
//    is freed at the layer's end, the head allocates no head_grad, and the K/V held (on
//    the device and the host) are freed at the end of the rank's last F.
//  - Recv Hidden / HiddenGrad: the receive is posted when the compute op before it starts
//    (or at the rank's first op), and its [tokens, H] buffer is allocated then. A stage's
//    F uses the received hidden state as its first layer's saved input; its B uses the
//    received gradient as the residual gradient.
//  - O(i) fraction a: the tensors select_offload(a) picks (core/layout.h) released when the
//    copy ends;
//    P(i) allocates them again at its start. On the host, O(i)'s copies are held from its
//    issue, and those P(i) brings back until the wait for it (Note [Host copies leave at
//    the wait]).
//  - Recomputed tensors (Schedule::recompute, Note [Recomputed tensors] in core/layout.h):
//    allocated with the unit at the start of each layer's F and freed at its end, and
//    again for the layer's B, freed with the unit; they are not part of the unit that O(i)
//    offloads.
//  - MLP tiles (Schedule::mlp_tile_rows, Note [MLP tiles] in core/layout.h): the
//    workspace's mlp_act, and fc_tile where fc_pre is recomputed, have min(T, R) rows, and
//    a recomputed fc_pre is not among the recomputed tensors.
//  - A layer's K/V (Schedule::kv_place): Device, as above; Host: K_i, V_i go to the host at
//    the end of F, come back at the start of B with the complete dK/dV sums of i, and the
//    earlier blocks stream through a window (MemTerm::KVWindow); Recompute: K_i, V_i are
//    freed at the end of F and recomputed at the start of B, with zeroed dK/dV accumulators
//    of its own rows and, from the host, the d(LayerNorm-1 output) sums [T, H] fp32 that
//    later subsequences' backward left there (Note [dK/dV into the layer input] in
//    runtime/kv_stream.h: H fp32 a position on the host, not 2H); the window holds the
//    earlier blocks' x as well as their recomputed K, V.
//  - B(i): head_grad of i (or the received gradient) carries the residual gradient, freed
//    at the end on the first stage, else as each Send HiddenGrad of it ends; per layer from
//    the last: workspace; on the
//    first backward touching layer l, dK/dV accumulators (fp32) for every position whose
//    K, V this rank holds for l; at the end of the layer: K_i, V_i, dK/dV rows of i, U(l, i)
//    and the workspace are freed.
// Tensor parallelism (Schedule::tp > 1): every size above is that of the rank's shards
// (core/layout.h TpShard: block_saved_specs, block_workspace_specs, head_*_specs and
// parameter_specs with the rank's TpShard), hidden states [rows of T, H].
// Pieces (pieces > 1: SP ranks, or the pieces of an MSP task) also hold the ring
// attention's buffers while each layer runs (RankMemory::piece_fwd_extra).
// MSP (Note [MSP pieces] in builders.cpp): Recv KV allocates the owner's copy of a helper
// piece's K, V; Send KVGrad frees it with its dK/dV rows; Recv KVGrad allocates the
// helper's accumulators of the layers if they are not yet. Borrowed weights: Recv Weights
// allocates a working copy of the stage's weights (activation precision); a lease that
// another Recv Weights of the same layers follows is released at the end of the last F/B
// on those layers before it. The first backward on borrowed layers allocates their fp32
// gradients; Send WeightGrads releases both; Recv WeightGrads holds the received
// gradients while the owner adds them to its own.
//
// Note [Host copies leave at the wait]: a host copy must exist while its copy runs, so
// the runtime allocates it when O(i) is issued; and it frees the copies P(i) read back
// only at the wait for P(i), not when each copy ends on the copy stream. Both are points
// of the program, so the host's peak is the same under every timing, and this model,
// which counts them at those points, predicts it to the byte (freeing at the copy's end
// would let a slow copy stream hold them past the next op's host allocations).
#pragma once

#include <array>
#include <map>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "core/config.h"
#include "core/layout.h"
#include "schedule/ir.h"
#include "schedule/weights.h"

namespace sppo::sched {

struct MemoryRules {
  ModelConfig model;
  ActPrecision precision = ActPrecision::BF16;
  i64 head_chunk = 1024;        // logits rows computed at once
  int param_state_bytes = 16;   // fp32 weight + grad + AdamW m + v
  int optimizer_bytes = 8;      // of which AdamW m + v
  int grad_bytes = 4;           // and the fp32 gradient
  int accum_bytes = 4;          // dK/dV accumulators are fp32 on every backend
  int weight_copy_bytes = 0;    // per parameter: the GEMMs' working copy of the weights (2 in bf16)
  bool zero = false;            // ZeRO-1: AdamW state sharded over the gradient all-reduce group
  bool optimizer_host = false;  // the fp32 master and AdamW m, v on the host (--optimizer-state host)
  // Under ZeRO-1, shards of the AdamW state: 0 means the size of the rank's WeightGrads
  // all-reduce group (as the runtime shards); the planner, which simulates one replica of
  // a data-parallel layout, gives the whole group's size (its largest shard is counted).
  int zero_shards = 0;
  // Kernel scratch the runtime allocates with each layer's workspace, and with the head's
  // (the CPU backend's, kernels/scratch.h; zero where kernels bring their own).
  KernelScratch block_scratch, head_scratch;

  int act_bytes() const { return precision == ActPrecision::F32 ? 4 : 2; }
  int weight_bytes() const { return param_state_bytes - optimizer_bytes - grad_bytes; }  // the fp32 weight
  // Device bytes per parameter of the owned layers beside their AdamW state: the weight,
  // its working copy and its gradient.
  int device_param_bytes() const { return weight_bytes() + weight_copy_bytes + grad_bytes; }
  // Device bytes per parameter whose AdamW state the rank keeps: m, v, unless on the host.
  int device_state_bytes() const { return optimizer_host ? 0 : optimizer_bytes; }
  // Host bytes per such parameter: its fp32 master, m, v and its gradient's copy, when the
  // state is on the host.
  int host_state_bytes() const { return optimizer_host ? weight_bytes() + optimizer_bytes + grad_bytes : 0; }
};

// Parameters of layers [b, e) of the model, with the embedding when `embed` and the final
// LayerNorm (and tied head) when `head`.
i64 param_count(const ModelConfig& c, int b, int e, bool embed, bool head);

// The step's inputs on the device: S + 1 token ids (int32; a causal model's targets are its
// inputs shifted by one), or S inputs and S targets (a bidirectional model's masked-token
// objective), and the loss sum (a double).
// Targets given beside the ids (Schedule::targets_given: packed documents, labels) add a
// causal model's S targets.
inline i64 step_input_bytes(const ModelConfig& c, i64 S, bool targets_given = false) {
  return (c.causal ? S + 1 + (targets_given ? S : 0) : 2 * S) * 4 + 8;
}

// Parameters whose AdamW state rank `index` of `shards` keeps under ZeRO-1 for layers
// [b, e): piece `index` of each bucket (the embedding, each layer, the final LayerNorm;
// core/layout.h piece_range), as the runtime shards them.
i64 zero_state_params(const ModelConfig& c, int b, int e, int shards, int index, const TpShard& tp = {});
// Parameters of one layer, and of a stage holding layers [b, e) (with the embedding on the
// first and last stage, the final LayerNorm on the last), as tensor-parallel member tp
// holds them (parameter_specs(c, b, e, tp)).
i64 layer_params(const ModelConfig& c, const TpShard& tp);
i64 param_count(const ModelConfig& c, int b, int e, const TpShard& tp);
// Bytes of one layer's weights on the device (Note [Weights on the host]): the fp32 weights
// that come from the host, and in bf16 beside them their working copy, converted there.
i64 layer_copy_bytes(const ModelConfig& c, ActPrecision p, const TpShard& tp = {});

// Peak device bytes of the full-recomputation baseline (one process, the whole sequence
// of S tokens as one subsequence): the runtime keeps each block's input through forward
// and, in backward, recomputes one block's saved tensors at a time (runtime/executor.h).
// The simulator does not run that schedule; this follows its allocations step by step so
// that a budget is checked before training.
i64 recompute_peak_bytes(const MemoryRules& rules, i64 S);

// Bytes per rank an AllReduce op sums: fp32 gradients of its layers (with the embedding
// and final LayerNorm where the layers include the first or last), or of the tied embedding.
// Under tensor parallelism, of member tp's shards.
i64 allreduce_bytes(const Op& op, const ModelConfig& c, int layers, const TpShard& tp = {});
// Bytes of the buffers rank `rank`'s weight collectives cover in a step: each gradient
// bucket its AllReduce ops reduce (or reduce-scatter, under ZeRO), the piece of the tied
// embedding's gradient that its TiedGrads op sums (the rank's ZeRO piece), and each layer's
// fp32 weights its AllGather ops gather (Note [ZeRO-3 gathers] in schedule/weights.h). A
// ring sends (R - 1) / R of a gather's or reduce-scatter's over a group of R, and twice that
// of an all-reduce's. The runtime counts the same buffers as it reduces and gathers them
// (StepResult::collective_bytes); tensor parallelism's reductions are not counted.
i64 collective_bytes(const Schedule& s, int rank, const ModelConfig& c);

// What device bytes hold, term by term (`sppo plan --explain` prints them at the peak).
enum class MemTerm {
  Weights,          // fp32 master weights of the owned layers (on the host: of the rank's shard)
  WeightCopy,       // their working copy in the activation type, for the GEMMs (bf16 only)
  Gradients,        // their fp32 gradients (on the host: the shard's copy the update reads)
  Optimizer,        // AdamW m, v (under ZeRO-1 only this rank's shard)
  KVCache,          // K, V of every subsequence whose backward has not run (skeletal)
  KVGradAccum,      // fp32 dK, dV accumulators of the positions whose K, V this rank holds
  Units,            // offloadable saved activations on the device (with head_grad)
  Hidden,           // layer outputs, and hidden states (and gradients) passed between stages,
                    // including receive buffers posted ahead of their message
  Workspace,        // one layer's forward or backward scratch and kernel scratch
  HeadWorkspace,    // logits and loss of the LM head, a chunk of rows at a time
  RingBuffers,      // the ring attention's buffers of pieces (ring, MSP)
  KVWindow,         // the window host-resident or recomputed K/V stream through (kv_window_bytes)
  Recomputed,       // saved tensors a layer recomputes (Schedule::recompute), while it runs
  BorrowedWeights,  // MSP helpers' working copy of another stage's weights
  BorrowedGrads,    // and its fp32 weight gradients until they go home
  StepInputs,       // the step's token ids and loss sum
  LayerWeights,     // --weights host: working copies of the layers in use and next (Note [Weights on the host])
  LayerGrads,       // --weights host: fp32 gradients of the layers the backward has reached and not let go
  kCount
};
inline constexpr int kMemTerms = int(MemTerm::kCount);
const char* to_string(MemTerm t);

// A device-memory change inside an op: `at` in [0, 1] is the position in the op's duration
// (per-layer events of F and B); an offload's release is at 1, the end of its copy. Bytes
// that change term without being freed (a layer's output becoming the next layer's saved
// input) are a decrease of one term and an increase of another at the same `at`, the
// decrease first, so no partial sum exceeds the true one.
struct MemEvent {
  double at = 0;
  i64 delta = 0;
  MemTerm term = MemTerm::Units;
};

// One layer's offloadable tensors' bytes (block_saved_specs, in select_offload order) for
// every (tensor-parallel member, tokens) that a schedule's forwards run on, worked out
// once for all its ranks: building the specs for each rank's every forward is most of the
// cost of a RankMemory on a long schedule of many ranks.
class UnitSizes {
 public:
  UnitSizes(const MemoryRules& rules, const Schedule& s);
  const std::vector<i64>* find(const RankShard& shard, i64 tokens) const;  // null: not a forward's

 private:
  std::map<std::tuple<int, int, i64>, std::vector<i64>> sizes_;  // (tp index, Ulysses index, tokens)
};

// One layer's offloadable tensors' bytes on T tokens, as rank shard `shard` holds them, less
// those backward recomputes.
std::vector<i64> unit_tensor_bytes(const MemoryRules& rules, i64 T, const RankShard& shard, SavedSet recompute = 0);

// The memory state of one rank while its ops are interpreted in program order.
class RankMemory {
 public:
  // `sizes`: the schedule's UnitSizes when the caller has them (else worked out here).
  RankMemory(const MemoryRules& rules, const Schedule& s, int rank, const UnitSizes* sizes = nullptr);

  i64 fixed_bytes() const { return fixed_; }
  // The fixed bytes by term (Weights, WeightCopy, Gradients, Optimizer, StepInputs; the
  // rest zero).
  const std::array<i64, kMemTerms>& fixed_terms() const { return fixed_terms_; }
  // Host bytes held for the whole run, by term (Weights, Gradients, Optimizer: the
  // optimizer state on the host; zero without it). host_bytes() and the host peaks count
  // them.
  i64 host_fixed_bytes() const { return host_fixed_; }
  const std::array<i64, kMemTerms>& host_fixed_terms() const { return host_fixed_terms_; }
  // Parameters of the owned layers, and those whose AdamW state this rank keeps.
  i64 owned_params() const { return owned_params_; }
  // Of them, those the device keeps all step: every one, or with the layers' weights on the
  // host the embedding's, final norm's and LM head's.
  i64 resident_params() const { return resident_params_; }
  i64 state_params() const { return state_params_; }
  // Appends the events of `op` to `out`: every op of this rank, by reference into the
  // schedule, in program order.
  void events(const Op& op, std::vector<MemEvent>* out);
  // The sizes of subsequence i's offloadable tensors on this rank, in select_offload order
  // (empty when this rank offloads none of it).
  std::vector<i64> unit_tensors(int subseq) const;
  // The layer of each of them (head_grad's: the last layer's).
  std::vector<int> unit_layers(int subseq) const;
  // Bytes an Offload op moves (valid after the F ops of its subsequence were seen).
  i64 offload_bytes(const Op& op) const;
  i64 prefetch_bytes(const Op& op) const;
  // Host bytes currently held: the fixed ones and offloads not yet prefetched.
  i64 host_bytes() const { return host_; }
  // The most host bytes held at any point so far (the fixed ones, offloaded copies,
  // host-resident K/V and their dK/dV sums).
  i64 host_peak() const { return host_peak_; }
  // The most host bytes held during the last events() call.
  i64 op_host_peak() const { return op_host_peak_; }
  // Device bytes held beyond the fixed part after every event so far (0 when all freed).
  i64 live_bytes() const { return live_; }

  // Per-token sizes, for the planner's closed forms.
  i64 kv_per_token() const { return kv_pt_; }
  i64 unit_per_token() const { return unit_pt_; }
  i64 recompute_per_token() const { return rc_pt_; }
  i64 ws_per_token() const { return ws_pt_; }
  i64 head_grad_per_token() const { return head_pt_; }
  i64 acc_per_token() const { return acc_pt_; }
  // --weights host: the device bytes of one layer's weights (in bf16 with their working
  // copy), the bytes its copy from the host moves (the fp32 weights), and its gradient's.
  i64 layer_copy() const { return layer_w_; }
  i64 layer_copy_in() const { return layer_in_; }
  // The owned layers [begin, end), and the bytes of B op `op`'s residual gradient (Note
  // [Residual gradients on the host] in builders.cpp).
  std::pair<int, int> owned() const { return own_; }
  i64 residual_bytes(const Op& op) const;
  i64 layer_grad() const { return layer_g_; }
  // Host bytes a position's dK/dV sums take on layer l: 2H fp32 (Device and Host layers'
  // dK, dV), or H fp32 (a Recompute layer's d(LayerNorm-1 output)).
  i64 sums_per_token(int l) const { return s_.place.kv_recomputed(l) ? i64(rules_.model.hidden) * rules_.accum_bytes : acc_pt_; }

 private:
  i64 tokens_of(const Op& op) const;
  i64 head_ws(i64 T) const;
  // Bytes on T tokens of one layer (one subsequence's head_grad), this rank's shards.
  i64 saved_bytes(i64 T, Role role) const;  // block_saved_specs of one role, less the recomputed
  i64 recomputed_bytes(i64 T) const;        // the tensors the schedule recomputes
  i64 kv_bytes(i64 T) const;
  i64 unit_bytes(i64 T) const;
  i64 ws_bytes(i64 T) const;
  // Note [The loss in backward] (core/layout.h): the head runs in the last layer's backward.
  bool loss_in_backward() const { return in_set(s_.place.recompute, kSavedHeadGrad); }
  i64 head_bytes(i64 T) const;
  i64 rows_of(i64 T) const { return shard_.rows(T); }  // of the residual regions
  // A layer's K/V, unit and workspace bytes on T tokens, worked out once per T: under
  // tensor parallelism each is a sum over the layer's tensor specs.
  struct LayerBytes {
    i64 kv, unit, rc, ws;
  };
  const LayerBytes& layer_bytes(i64 T);
  i64 ring_piece_max(const Op& op) const;
  // A ring piece's buffer rows: the other pieces' (that travel), the partial results this
  // piece receives for its rows and those it sends for theirs (RankMemory::ring_rows).
  struct RingRows {
    i64 others = 0, in = 0, out = 0;
  };
  RingRows ring_rows(const Op& op) const;
  bool rsa_piece(const Op& op) const { return s_.rsa_piece(op); }
  i64 piece_fwd_extra(const Op& op, i64 T) const;
  i64 piece_bwd_extra(const Op& op, i64 T) const;
  void emit(std::vector<MemEvent>* out, double at, i64 delta, MemTerm term);
  // `bytes` change from term `from` to term `to` at `at` (the decrease first).
  void move(std::vector<MemEvent>* out, double at, i64 bytes, MemTerm from, MemTerm to);

  const MemoryRules& rules_;
  const Schedule& s_;
  int rank_;
  RankShard shard_;                    // this rank's shards (none: sizes 1)
  TpShard tp_;                         // its tensor-parallel shards: its parameters
  TpShard heads_;                      // the heads its attention runs (shard_.heads())
  i64 fixed_ = 0;
  std::array<i64, kMemTerms> fixed_terms_{};
  i64 host_fixed_ = 0;
  std::array<i64, kMemTerms> host_fixed_terms_{};
  i64 owned_params_ = 0, state_params_ = 0, resident_params_ = 0;
  i64 kv_pt_ = 0, unit_pt_ = 0, rc_pt_ = 0, ws_pt_ = 0, head_pt_ = 0, acc_pt_ = 0, weight_work_pp_ = 0;
  std::vector<i64> acc_tokens_;        // per layer: positions whose K, V this rank holds
  std::vector<bool> acc_live_;         // per layer: accumulators allocated
  // Layers whose K/V stream (Schedule::kv_streamed): the tokens of this rank's blocks
  // of subsequences j < i ([L][N + 1]; empty for a device layer), and how far the dK/dV
  // sums on the host reach (those of every block j < sums_below_[l] exist: a backward
  // reaches every earlier block).
  std::vector<std::vector<i64>> kv_rows_before_;
  std::vector<int> sums_below_;
  void host_change(i64 delta);
  // Whether layer l's K/V stream on this rank: a host or recompute layer of its own (an MSP
  // helper keeps its pieces of another stage's layers on the device).
  bool streamed(int l) const { return s_.place.kv_streamed(l) && l >= own_.first && l < own_.second; }
  // Device bytes of layer l's K/V window while subsequence `subseq` (T tokens) attends.
  // `span_rows`: the most rows of one query span that meets the window (forward's partial
  // output): T, or on a ring the largest span of any member's piece.
  i64 kv_window(int l, int subseq, i64 T, i64 span_rows, bool backward) const;
  // The most rows of one span of any member's piece of op's task.
  i64 ring_span_max(const Op& op) const;
  i64 host_peak_ = 0, op_host_peak_ = 0;
  std::map<int, std::vector<i64>> unit_tensors_;  // subsequence -> its offloadable tensors' bytes
                                                 // on this rank, in select_offload order
  std::map<int, std::vector<int>> unit_layers_;   // subsequence -> the layer of each of those tensors
                                                 // (head_grad's: the last layer)
  std::map<int, i64> offloaded_;       // subsequence -> bytes on the host
  std::map<int, i64> coming_back_;     // subsequence -> bytes P(i) copies back, freed on the host at its wait
  // A layer-major backward's prefetches of one layer: (subsequence, layer) -> bytes of O(i)
  // that are that layer's, and those its P copies back.
  std::map<std::pair<int, int>, i64> offloaded_layer_, coming_back_layer_;
  // The bytes of subsequence i's offload of layers [b, e) still on the host.
  i64 offloaded_layers(int subseq, int b, int e) const;
  std::map<i64, LayerBytes> layer_bytes_;          // tokens -> layer_bytes
  mutable std::map<std::pair<int, int>, i64> piece_max_;  // (subsequence, pieces) -> ring_piece_max
  std::map<size_t, i64> release_after_;            // op index -> borrowed weight bytes freed at its end
  std::map<size_t, i64> posted_at_;                // op index -> receive buffers allocated at its start
  std::set<std::pair<int, int>> borrowed_grads_;   // borrowed layer ranges with gradients
  size_t next_ = 0;                                // index of the next op of this rank
  // A forward-only step (Note [Forward-only steps] in builders.cpp): the index of the
  // rank's last F, at whose end the K/V it holds go, and those bytes on the device and
  // the host.
  size_t last_forward_ = 0;
  i64 kv_held_ = 0, kv_held_host_ = 0;
  LayerUses uses_;                                 // --weights host: the own layers' uses
  i64 layer_w_ = 0, layer_in_ = 0, layer_g_ = 0;   // their device bytes, bytes copied in, gradient's bytes
  // Events of the weights and gradients at the start (end) of F/B op `index`'s k-th layer.
  void layer_in(std::vector<MemEvent>* out, size_t index, int k, double at);
  void layer_out(std::vector<MemEvent>* out, size_t index, int k, double at);
  std::pair<int, int> own_;                        // owned layers [begin, end)
  i64 host_ = 0;
  i64 live_ = 0;
};

}  // namespace sppo::sched
