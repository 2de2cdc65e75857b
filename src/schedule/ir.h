// The schedule IR (docs/design.md 7, docs/design.md, Conventions 1): for every rank an
// ordered list of ops. Builders (schedule/builders.h) turn a plan into a Schedule; two
// executors interpret it: the runtime (runtime/executor.h) with real tensors and copies,
// and the simulator (sim/) with a cost model. Both switch over OpKind, so adding a kind
// breaks the build of every executor until it handles it.
#pragma once

#include <algorithm>
#include <array>
#include <initializer_list>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/dims.h"
#include "core/layout.h"
#include "core/parallel.h"
#include "core/placement.h"

namespace sppo::sched {

enum class OpKind {
  Forward,       // F: forward of layers [layer_begin, layer_end) on (subseq, piece)
  Backward,      // B: backward of the same
  Offload,       // O: start copying `fraction` of the offloadable unit of (subseq) to host;
                 //    its device memory is released when the copy completes
  Prefetch,      // P: start copying the host part of (subseq) back to the device; with a
                 //    layer range (layer_end > layer_begin; a layer-major backward) only
                 //    that of layers [layer_begin, layer_end), the last layer's with head_grad
  WaitOffload,   // wait until the offload of (subseq) has completed
  WaitPrefetch,  // wait until the prefetch of (subseq) (of its layer range) has completed
  Send,          // send `payload` of (subseq, piece) to rank `peer`
  Recv,          // receive `payload` of (subseq, piece) from rank `peer`
  RingStep,      // one ring-attention step `step` of (layer range, subseq, piece) with `peer`
  AllReduce,     // all-reduce across `group` of the weight gradients of layers [layer_begin,
                 //   layer_end) (payload WeightGrads: data-parallel and SP replicas), or of the
                 //   tied embedding's gradient (payload TiedGrads: first and last stage)
  ReduceScatter, // under ZeRO (ParallelDims::zero), in place of the WeightGrads AllReduce: the
                 //   gradients reduce-scattered across the layer group `group`, member k keeping
                 //   piece k of each bucket's sum. Each bucket of either starts as the last
                 //   backward that adds to it ends; the op waits for them all
  AllToAll,      // the all-to-alls of Ulysses members `group` that the next F (payload KV) or B
                 //   (payload KVGrad) of layers [layer_begin, layer_end) on (subseq, piece) runs
                 //   inside each layer (Note [Ulysses exchanges] in core/layout.h)
  AllGather,     // ZeRO-3: the all-gather over the layer group `group` of layer layer_begin's
                 //   weights (payload Weights) that the next F or B starts inside its layers, one
                 //   layer ahead of their use, as LayerUses' loads say (Note [ZeRO-3 gathers] in
                 //   schedule/weights.h); the ops before an F or B are its gathers, in order
};

// Tensor parallelism of a Llama-family block: each member's query heads read whole
// key/value heads of its own: tp divides G = kv_head_count(), or G divides tp and each K/V
// head's r = Z / G query heads split over its tp / G replicas (Note [Replicated key/value
// heads] in core/layout.h). The planner searches and train accepts only these tp for it.
inline bool llama_tp_runs(const ModelConfig& c, int tp) {
  const int G = c.kv_head_count();
  return tp >= 1 && (G % tp == 0 || (tp % G == 0 && tp / G <= c.heads / G));
}

// What a Send/Recv/RingStep moves.
// KV / KVGrad are an MSP piece's rows (Note [MSP pieces] in builders.cpp): its K and V,
// copied to its stage's owner after the forward, and the dK/dV the owner accumulated for
// those rows, returned to the piece's rank before its backward. Weights / WeightGrads are
// a stage's weights lent to an MSP helper and the gradients it returns (with, for the
// stage holding the LM head, the loss of its rows). TiedGrads is the embedding's
// gradient, held by the first stage (input embedding) and the last (LM head) and summed
// between them, as Megatron-LM does.
enum class Payload { None, Hidden, HiddenGrad, KV, KVGrad, Weights, WeightGrads, TiedGrads };

struct Op {
  OpKind kind = OpKind::Forward;
  int layer_begin = 0;   // stage layers [layer_begin, layer_end)
  int layer_end = 0;
  int subseq = 0;        // i
  int piece = 0;         // MSP / SP piece index within the subsequence
  int pieces = 1;        // number of pieces the subsequence is split into
  int peer = -1;         // Send/Recv partner rank; RingStep: the rank sent to
  int recv_peer = -1;    // RingStep: the rank received from
  int step = 0;          // RingStep index
  i64 tokens = 0;        // Send/Recv/RingStep: tokens whose payload moves (0: the whole piece)
  Payload payload = Payload::None;
  double fraction = 0;   // Offload/Prefetch: alpha_i, the fraction of the unit moved
  // Send/Recv of hidden states between pieces that split the subsequence differently
  // (MSP): the position, in the subsequence, of the first of the `tokens` contiguous rows
  // moved; -1: the whole piece.
  i64 first = -1;
  // AllReduce ranks; RingStep: the ring's ranks in ring order; F/B of an MSP piece: the
  // ranks of the task's pieces in piece order (empty otherwise).
  std::vector<int> group;

  bool operator==(const Op&) const = default;
};

// The reduction of a stage's weight gradients over its layer group: an AllReduce, or under
// ZeRO a ReduceScatter.
inline bool reduces_weight_grads(const Op& op) {
  return (op.kind == OpKind::AllReduce || op.kind == OpKind::ReduceScatter) && op.payload == Payload::WeightGrads;
}

// A hidden state (or its gradient) passed between stages: its payload, the layer at the
// boundary (the consumer's first layer for a hidden state, its last + 1 for a gradient) and
// the subsequence. The runtime keeps its buffers by it (runtime/stage_messages.h), and
// expand_tensor_parallel matches its makers to its takers by it.
using HiddenId = std::tuple<Payload, int, int>;
bool is_hidden_message(const Op& op);  // a Send or Recv of a hidden state or its gradient
HiddenId hidden_id(const Op& op);      // of such a message
// F/B op `op` starts from a hidden state but on the first stage's forward and the last's
// backward, and makes one for the next stage (the previous, in backward) but on the last
// stage's forward and the first's backward.
bool has_input(const Op& op, int layers);
bool has_output(const Op& op, int layers);
HiddenId input_id(const Op& op);
HiddenId output_id(const Op& op);

// How the R pieces of a ring (the cp ranks of one stage group) hold a subsequence's tokens
// (RingLayout, core/parallel.h).
// Note [Ring attention load balance]: under causal attention a query attends to every
// position before it, so a contiguous split gives piece r of R about (2r + 1) / R^2 of the
// subsequence's attention work: the last piece does 2R - 1 times the first's. Zigzag cuts
// the subsequence into 2R chunks and gives piece r chunks r and 2R - 1 - r, so every piece
// does the same work to within a chunk's diagonal. Pieces of a subsequence split over
// several stage groups by MSP are always contiguous.

// Token ranges [b, e) of a piece, ascending; one range (contiguous) or two (zigzag), held
// in place: the simulator and the memory rules ask for an op's spans for every op.
class Spans {
 public:
  using value_type = std::pair<i64, i64>;
  static constexpr int kMax = 2;

  Spans() = default;
  Spans(std::initializer_list<value_type> ranges) {
    for (const value_type& r : ranges) push_back(r);
  }
  void push_back(const value_type& r);  // throws past kMax ranges
  const value_type* begin() const { return r_.data(); }
  const value_type* end() const { return r_.data() + n_; }
  std::size_t size() const { return std::size_t(n_); }
  bool empty() const { return n_ == 0; }
  const value_type& front() const { return r_[0]; }
  const value_type& operator[](std::size_t k) const { return r_[k]; }
  bool operator==(const Spans& o) const { return std::equal(begin(), end(), o.begin(), o.end()); }

 private:
  std::array<value_type, kMax> r_{};
  int n_ = 0;
};
i64 span_tokens(const Spans& s);
// Tokens two pieces share.
i64 overlap(const Spans& a, const Spans& b);
// The token ranges [b, e) two pieces share, ascending.
std::vector<std::pair<i64, i64>> overlaps(const Spans& a, const Spans& b);
// Piece `piece` of `pieces` of a subsequence of l tokens laid out by `layout`.
Spans piece_spans(i64 l, int piece, int pieces, RingLayout layout);
// What tensor-parallel member t of tp holds of a piece between the sequence-parallel
// regions: its rows piece_range(T, t, tp), T the piece's tokens in position order. A
// Ulysses member's rows are the same split (t of ulysses).
Spans member_spans(const Spans& piece, int t, int tp);

struct Schedule {
  // The step's parallelism (core/parallel.h): ranks par.ranks(), numbered as Note [Rank
  // layout] says; ops with pieces == par.cp > 1 are ring pieces, held as par.ring_layout
  // says and attended by par.ring_algorithm. Built one replica at a time (the planner's
  // search), par.dp is 1. Tensor parallelism (expand_tensor_parallel): the par.tp
  // consecutive ranks of a group run the same ops, each on its shards.
  ParallelDims par;
  int ranks() const { return par.ranks(); }
  // The tensor-parallel shards rank `rank` holds (its member index in its group).
  TpShard tp_shard(int rank) const { return {par.coord_of(rank).member, par.tp}; }
  // Its Ulysses member index and group size, and both as its share of each layer.
  UlyssesShard ulysses_shard(int rank) const { return {par.coord_of(rank).ulysses, par.ulysses}; }
  RankShard shard(int rank) const { return {tp_shard(rank), ulysses_shard(rank)}; }
  int layers = 0;
  std::vector<i64> lengths;             // l_i of every subsequence
  // Ring pieces attend by the two-pass Ring Self-Attention (runtime/ring.h RsaAttention,
  // --ring rsa: bidirectional, fp32), which materialises each piece's score rows against
  // the whole subsequence, rather than by the one-pass flash ring.
  bool rsa_piece(const Op& op) const { return par.rsa() && op.pieces == par.cp; }
  std::vector<std::vector<Op>> ops;     // ops[rank] in program order
  // Layers whose weights, gradients and optimizer state each rank owns, [begin, end);
  // empty means every rank owns all layers. The embedding lives with layer 0 and, tied,
  // again with layer L-1 when that is another rank.
  std::vector<std::pair<int, int>> owned;
  // Where the step keeps what it saves and holds (core/placement.h):
  //  - place.kv: where each layer keeps the K/V cache of finished subsequences. A Host layer
  //    copies each subsequence's K, V to the host after its forward and streams them back,
  //    a chunk at a time, to the attention of later subsequences and to the backward, with
  //    their fp32 dK/dV accumulators, which live on the host too (runtime/kv_stream.h). A
  //    Recompute layer keeps no K, V at all: each chunk is recomputed from the layer input
  //    x of its subsequence (wherever the unit holds it) when a later subsequence or the
  //    backward needs it, and its dK/dV sums live on the host as a Host layer's. A Host
  //    layer runs on a ring too (each member streams its own pieces of the earlier
  //    subsequences) and under MSP (a stage's owner streams its helpers' pieces with its
  //    own; a helper keeps its pieces of the owner's layers on the device); a Recompute
  //    layer runs ops of one piece only, without tensor parallelism (its rows of x are split
  //    over the group).
  //  - place.backward: the order of each stage's backward; Layer: its B ops and their
  //    prefetches, ring steps and waits are of one layer each (to_layer_major).
  //  - place.residual_grads: in a layer-major backward, where each subsequence's residual
  //    gradient waits between its layers (Note [Residual gradients on the host] in
  //    builders.cpp; residual_move says which B op moves it).
  //  - place.weights: where the transformer layers' weights live between their uses (Note
  //    [Weights on the host] in schedule/weights.h): on the host, each layer's working copy
  //    brought to the device one layer ahead of the F/B op that uses it and each layer's
  //    fp32 gradient on the device from its first backward to its last. The embedding,
  //    final norm and LM head stay on the device either way.
  //  - place.inputs_rebuilt: layers whose input x the forward does not keep (Note [Rebuilt
  //    layer inputs] in builders.cpp): each B op of such a layer l first runs layer l-1's
  //    forward again on its subsequence, from x of layer l-1 (kept), to make x of layer l.
  //    Only in a layer-major backward, within a stage, on a layer whose K/V are not
  //    recomputed (they would need every earlier subsequence's x) above one whose K/V are
  //    not on the host.
  //  - place.recompute, place.mlp_tile_rows: the saved tensors every layer's backward
  //    recomputes, and the rows of its MLP tiles.
  Placements place;
  // An evaluation step (to_forward_only, Note [Forward-only steps] in builders.cpp): F ops
  // and what they exchange alone. Each layer's saved tensors are freed as the layer ends,
  // the head computes the loss without a gradient, and the K/V of finished subsequences (on
  // the device or the host, as place.kv says) are held until the rank's last F ends.
  bool forward_only = false;
  // Packed documents (--pack): a causal model's targets come beside its token ids
  // (step_input_bytes), since a document's last position predicts nothing.
  bool packed = false;
  // Labels (--labels): a causal model's targets come beside its token ids too, kNoTarget
  // where the data takes no loss.
  bool labeled = false;
  bool targets_given() const { return packed || labeled; }
  // Where a packed step's documents begin (ascending, from 0): the simulator prices each
  // query's attention against its own document's keys. Empty: one document, the most a
  // packed step can cost (a plan's and the setup's prediction); the trainer prices each
  // step with its own.
  std::vector<i64> doc_starts;

  i64 offset(int i) const;              // o_i = l_0 + ... + l_{i-1}
  i64 seq_len() const;                  // S
  // The tokens of subsequence `op.subseq` that F/B/RingStep op `op` works on: its piece
  // under ring_layout when it is a ring piece (pieces == ring), else contiguous.
  Spans spans(const Op& op) const;
  // The same for member `piece` of the op's task, and for subsequence `subseq` in its place.
  Spans spans(const Op& op, int piece) const { return spans(op.subseq, piece, op.pieces); }
  Spans spans(int subseq, int piece, int pieces) const;
};

// The layers [begin, end) rank `rank` owns (Schedule::owned; every layer when it is empty).
std::pair<int, int> owned_layers(const Schedule& s, int rank);

// Note [Residual gradients on the host] (builders.cpp), the rule the runtime, the memory
// rules and the simulator all read: with place.residual_grads on the host, a B op of a
// rank's own layers brings its subsequence's residual gradient back from the host before it
// runs when a layer above it on the rank ran before it (`in`), and sends it to the host
// after when a layer below it on the rank runs later (`out`).
struct ResidualMove {
  bool in = false, out = false;
};
ResidualMove residual_move(const Schedule& s, int rank, const Op& op);

// Ring attention over the pieces of a task (runtime/ring.h: queries travel, keys stay).
// The first position whose key member `piece` of F/B/RingStep op `op`'s ring holds: a
// context-parallel member holds its piece of every subsequence so far; in an MSP task
// (`group` set) the stage's owner holds every earlier key, and each helper its own piece's.
i64 ring_first_key(const Schedule& s, const Op& op, int piece);
// Bytes member op.piece sends at ring step op.step of one layer of the task: the query
// piece it passes on, and the partial results it returns for the piece it received (those
// of its spans that see a key it holds). Forward: queries (e bytes a value), then partial
// outputs and fp32 LSE; backward: queries, output gradients, fp32 LSE and delta, then
// partial dq. H and Z are the member's width and heads.
i64 ring_step_bytes(const Schedule& s, const Op& op, i64 H, int Z, int act_bytes, bool causal);
// The same for a Ring Self-Attention ring (Schedule::ring_rsa): forward, the keys and then
// the values of the block it passes on; backward, that block's keys and values, its keys
// again (the last pass), and the dK, dV of the member whose block it received, sent to it.
i64 rsa_step_bytes(const Schedule& s, const Op& op, i64 H, int act_bytes);

// Bytes rank `rank` sends the other members of its Ulysses group in AllToAll op `op`: the
// exchanges of every layer of the op (Note [Ulysses exchanges] in core/layout.h), with, in
// a backward, those of the forward a rebuilt layer input runs again (Note [Rebuilt layer
// inputs] in builders.cpp).
i64 alltoall_bytes(const Schedule& s, const Op& op, int rank, const ModelConfig& c, ActPrecision p);

// The identity a receive matches a send by (an MPI tag): payload, subsequence, piece,
// layers and tokens; ring steps match by step and ring (every piece sends its own block).
// Messages with equal keys between two ranks are received in the order sent.
struct MessageKey {
  Payload payload = Payload::None;
  int subseq = 0, piece = 0, pieces = 1, layer_begin = 0, layer_end = 0, step = 0;
  i64 tokens = 0;
  bool operator==(const MessageKey&) const = default;
};
MessageKey message_key(const Op& op);
// The MPI tag of a message: payload, subsequence, piece (ring step) and first layer packed
// into 30 bits. Keys that differ only in fields it drops (tokens, pieces, last layer) are
// never in flight between the same two ranks at once in the schedules the builders make.
int message_tag(const Op& op);

// Canonical one-line text form of an op, e.g. "F L0-3 s2", "O s1 0.5", "send hidden s2 -> r1".
// Layer ranges print inclusive ("L0-3" is [0, 4)); pieces print as "p1/4" when pieces > 1.
std::string to_string(const Op& op);
// Canonical text of a whole schedule: one "rank R:" header per rank, then one op per line.
std::string to_string(const Schedule& s);
const char* to_string(OpKind k);
const char* to_string(Payload p);

}  // namespace sppo::sched
