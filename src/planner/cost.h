// The cost model: seconds of every op of the IR on a hardware profile.
//
// Compute (docs/design.md 3), per layer on T tokens of subsequence i at offset o:
//   GEMMs      24 T H^2 (generally 8 T H^2 + 4 T F H) FLOPs forward, 2x in backward
//   attention  4 H * sum over the T query positions q of (q + 1) FLOPs forward
//              (= 4 T H (o + (T + 1) / 2) for a whole subsequence), 2.5x in backward;
//              a bidirectional model's (ModelConfig::causal false) queries each see
//              the o keys before and all L of their subsequence: 4 T H (o + L);
//              the 4 T H o against keys before the subsequence at the prefix rate of
//              T query rows, per kernel call (a span of the subsequence's tokens)
//              (Note [Attention after a prefix], planner/profile.h)
//   elementwise  kElementwiseWordsPerToken * H words per token read or written
//              (LayerNorm, GeLU, residuals, RoPE, bias) over elementwise_bw, 2x in backward
//   overhead   layer_overhead per layer (kernel launches and synchronisation), and a
//              quarter of it for each MLP tile beyond the first (mlp_tiles_s)
// Ring Self-Attention (Schedule::ring_rsa, runtime/ring.h RsaAttention) instead of a ring
// piece's flash attention: its T queries against the subsequence's L keys in GEMMs of the
// head size (QK^T and PV: 4 T L H FLOPs forward; in backward QK^T again, dP, dK, dV and
// dQ: 10 T L H) at gemm_rate(head size), and the fp32 score rows [Z, T, L] that those
// GEMMs write and read and the softmax passes over, kRsaScoreWords a score forward and
// kRsaScoreWordsBackward backward, at elementwise_bw.
// The LM head runs its backward right after its forward (the loss gradient is known), so a
// forward that ends at the last layer also pays 6 T H V FLOPs of head GEMMs.
// A piece of a subsequence (an SP rank's part, an MSP piece) pays the attention of exactly
// the query positions it holds (Schedule::spans: contiguous, or zigzag for ring pieces of
// a zigzag plan; Note [Ring attention load balance] in schedule/ir.h), so a contiguous ring
// shows its causal imbalance.
// Tensor parallelism (Schedule::tp): compute divides by tp, and every layer adds the
// sequence-parallel regions' all-gathers and reduce-scatters of [T, H] (tp_collective_s),
// four in forward and six in backward, run between the kernels.
// Ulysses (Schedule::par.ulysses): the busiest member's rows of every per-token part and
// heads of the attention (Note [Ulysses, priced] in cost.cpp); its all-to-alls are AllToAll
// ops, latency and bytes over the group's link (alltoall_s).
// Recomputed tensors (Schedule::recompute, Note [Recomputed tensors] in core/layout.h): a
// backward first runs again, per layer, the forward steps of the recomputed groups (their
// GEMMs, elementwise traffic and, for the attention group, the attention), and under
// tensor parallelism the all-gather or reduce-scatter each step needs. A layer that
// recomputes K/V (KvPlace::Recompute) pays, in its forward and backward, the LayerNorm and
// the K and V GEMMs (4 H^2 FLOPs a token) of every earlier position, in its backward also
// their gradients' way into the layer input and the weights (8 H^2 more), and in its
// backward the K and V of its own tokens.
// Streamed K/V (Schedule::kv_streamed; runtime/kv_stream.h): a layer whose K/V live on the
// host, or are recomputed, brings the rank's rows of the earlier subsequences (all o of
// them; a ring member its own pieces, o/R; an MSP owner its own and its helpers') in chunks
// of C = kv_chunk_rows(T) rows, a chunk cut into one piece per span of an earlier block it
// holds rows of: chunks = ceil(rows / C), pieces = chunks + the spans that start inside a
// chunk (on a ring: every span). Every query span that meets the chunks (a ring's or an
// MSP task's: every member's) runs a kernel on each. Per layer, with in and out
// the stream's bytes over h2d_bw and d2h_bw and s = copy_compute_share (Note [Streamed
// chunks], planner/profile.h):
//   s (in + out) + (1 - s) max(0, max(in', out') - attention)    (in', out': at the duplex
//                                                                  rates in backward)
//   + copy_issue * pieces * copies a piece + attention_chunk * chunks * query spans
// A piece's copies: K and V in (a Recompute layer: x), and in backward their sums out and,
// in every backward but the first (the last subsequence's, which finds none), in. The
// subsequence's own K, V go out after its forward (2 copies) and come back before its
// backward with their sums (2 or 4; a Recompute layer: its sums only, 1 or 0), waited for
// whole: their bytes over the link plus copy_issue each.
// Copies: bytes over d2h_bw / h2d_bw, times duplex_factor while the other direction runs.
// The optimizer's update with its state on the host (host_update_s): the fp32 gradients of
// the rank's shard down, the update on the host's processor, the fp32 weights back up.
// Assumed: the host's processor moves the update's bytes at the profile's elementwise_bw
// (the device's elementwise rate; no profile measures the host's).
// Messages: latency + bytes / bandwidth, intra- or inter-node by the ranks' nodes
// (rank r is device r; devices_per_node consecutive devices form a node).
#pragma once

#include "core/config.h"
#include "core/layout.h"
#include "schedule/ir.h"
#include "schedule/memory.h"
#include "planner/profile.h"

namespace sppo::plan {

// Elementwise traffic per token per layer, in activation words (forward): LayerNorm in
// and out twice (4H), residual adds (4H), RoPE on q, k (4H), GeLU in and out (8F/4 = 8H
// for F = 4H), bias adds and softmax statistics (about 4H more).
inline constexpr double kElementwiseWordsPerToken = 24;

// fp32 words moved a score by RSA: forward, QK^T writes it, the softmax reads it twice and
// writes it, PV reads it; backward, QK^T and dO V^T write P and dP, the softmax rebuilds
// P (three), its backward reads P and dP and writes dS (three), dK, dV and dQ read them.
inline constexpr double kRsaScoreWords = 5;
inline constexpr double kRsaScoreWordsBackward = 11;

// Bytes the host's AdamW reads and writes a parameter: it reads the gradient, weight, m and
// v and writes the last three, fp32.
inline constexpr i64 kHostUpdateBytesPerParam = 28;

class CostModel {
 public:
  CostModel(const HardwareProfile& hw, const ModelConfig& model, ActPrecision precision);

  const HardwareProfile& hw() const { return hw_; }
  // GEMM rate of this model's layer shapes (HardwareProfile::gemm_rate of its hidden size).
  double gemm_rate() const { return gemm_rate_; }
  const ModelConfig& model() const { return model_; }
  ActPrecision precision() const { return precision_; }

  // FLOPs of one layer on the tokens [b, e) of a subsequence at offset o (forward). `keys`:
  // the subsequence's length L, whose positions every query of a bidirectional model sees
  // (0: the end of the spans, a whole subsequence's); a causal model's ignore it.
  double gemm_flops(i64 tokens) const;
  double attention_flops(i64 o, i64 b, i64 e, i64 keys = 0) const;
  double attention_flops(i64 o, const sched::Spans& spans, i64 keys = 0) const;
  double head_flops(i64 tokens) const;  // forward + backward of the LM head
  // Seconds of one layer's attention forward on the tokens `spans` of a subsequence at
  // offset o: the FLOPs against the o keys before it at the prefix rate of each span's
  // query rows, the rest causal.
  // `docs`: where a packed step's documents begin (Schedule::doc_starts; null or empty: one
  // document): each query then sees only its own document's keys, up to itself.
  double attention_s(i64 o, const sched::Spans& spans, i64 keys = 0, const std::vector<i64>* docs = nullptr) const;
  // Seconds of one layer's Ring Self-Attention forward (backward) of T query rows against
  // a subsequence of L positions, on one of tp tensor-parallel members.
  double rsa_attention_s(i64 T, i64 L, bool backward, int tp) const;

  // Seconds of a Forward / Backward op of schedule `s`; `o` is the offset of its subsequence.
  double forward_s(const sched::Op& op, const sched::Schedule& s, i64 o) const;
  double backward_s(const sched::Op& op, const sched::Schedule& s, i64 o) const;
  double forward_s(const sched::Op& op, const sched::Schedule& s) const { return forward_s(op, s, s.offset(op.subseq)); }
  double backward_s(const sched::Op& op, const sched::Schedule& s) const { return backward_s(op, s, s.offset(op.subseq)); }
  // Seconds of one layer's forward (backward) on the tokens `spans` of a subsequence at
  // offset o; the second form on a whole subsequence of T tokens.
  double layer_forward_s(i64 o, const sched::Spans& spans, i64 keys = 0, const std::vector<i64>* docs = nullptr) const;
  double layer_backward_s(i64 o, const sched::Spans& spans, i64 keys = 0, const std::vector<i64>* docs = nullptr) const;
  double layer_forward_s(i64 o, i64 T) const { return layer_forward_s(o, sched::Spans{{0, T}}); }
  double layer_backward_s(i64 o, i64 T) const { return layer_backward_s(o, sched::Spans{{0, T}}); }

  // Seconds the copies of layers whose K/V stream (Schedule::kv_streamed) add to a
  // Forward (Backward) op: the earlier blocks stream in (K, V on a Host layer; the layer
  // input x on a Recompute layer, priced as if every x were on the host) and, in backward,
  // their dK/dV sums in and out, while the attention runs, two chunks ahead, so only what
  // the attention does not cover shows, besides the share of the copies and the fixed
  // costs of each copy and chunk that the compute stream pays (Note [Streamed chunks] in
  // planner/profile.h); the subsequence's own K, V going out after the forward (coming
  // back, or on a Recompute layer only its sums, before the backward) wait whole. Priced
  // with the copy streams free; the simulator queues the chunks behind the copies already
  // on them (Note [Streams on the copy streams] in sim/simulator.cpp). `again`: the forward
  // pass that a backward recomputing the attention runs first (its blocks in, nothing of
  // its own out).
  double kv_stream_s(const sched::Op& op, const sched::Schedule& s, i64 o, bool backward, bool again = false) const;
  // What of kv_stream_s the streamed chunks decide, summed over the op's streamed layers:
  // the chunks' bytes in (K, V or x, with sums) and out (sums), their seconds alone on the
  // link, the attention they hide behind, and the seconds of them it does not hide, which
  // kv_stream_s charges: (1 - copy_compute_share) max(0, max(in, out) - cover).
  struct StreamCopies {
    i64 in_bytes = 0, out_bytes = 0;
    double in_s = 0, out_s = 0, cover_s = 0, exposed_s = 0;
  };
  StreamCopies kv_stream_copies(const sched::Op& op, const sched::Schedule& s, i64 o, bool backward,
                                bool again = false) const;
  // The chunks of one streamed layer: `rows` earlier rows bring `block` bytes each in (and,
  // with sums_back, their `summed` bytes of sums), and in backward send the sums out; the
  // seconds kv_stream_s charges for them beside `attention` seconds of attention.
  double stream_chunks_s(double rows, double block, double summed, double attention, bool backward, bool sums_back,
                         StreamCopies* copies) const;
  // The same for one layer of a subsequence at offset o, length l, on the tokens `spans` of
  // one of sp ring members (its share of the earlier rows) and tp tensor-parallel ones, its
  // K/V streamed or (recompute_kv) recomputed from x: the chunks alone, none of the copies
  // of the subsequence's own block or their fixed costs (a lower bound on kv_stream_s).
  struct StreamedLayer {
    bool recompute_kv = false;
    bool backward = false;
    bool sums_back = false;  // as stream_chunks_s takes it
  };
  double layer_stream_s(i64 o, const sched::Spans& spans, i64 l, int sp, int tp, const StreamedLayer& layer) const;
  // Seconds a Forward (Backward) op spends recomputing: K, V of the earlier positions on
  // Recompute layers and, in backward, the recomputed groups and the own K, V.
  double recompute_s(const sched::Op& op, const sched::Schedule& s, i64 o, bool backward) const;
  // The same for one layer on the tokens `spans` of a subsequence at offset o, recomputing
  // `groups` (in backward) and K/V (`layer.kv`), on one of tp tensor-parallel members.
  struct RecomputedLayer {
    bool kv = false;
    bool backward = false;
  };
  double layer_recompute_s(i64 o, const sched::Spans& spans, SavedSet groups, const RecomputedLayer& layer, int tp,
                           i64 keys = 0, const std::vector<i64>* docs = nullptr) const;

  // Note [MLP tiles] (core/layout.h): tiles of `rows` rows (0: none) run the same FLOPs
  // as a whole MLP, but launch the MLP half's kernels again for each tile beyond the
  // first: a quarter of a layer's launches, priced as that share of layer_overhead, in a
  // layer's forward and again in its backward, on T tokens.
  static constexpr double kMlpTileOverheadShare = 0.25;
  double mlp_tiles_s(i64 T, i64 rows) const;

  // One all-gather (or reduce-scatter) of [T, H] activations over a tensor-parallel group
  // of tp consecutive devices.
  double tp_collective_s(i64 T, int tp) const;

  double d2h_s(i64 bytes, bool duplex) const;
  double h2d_s(i64 bytes, bool duplex) const;
  // Seconds of the optimizer's update of `params` parameters whose state is on the host:
  // the gradients of `moved` of them down (-1: all), the host's AdamW over all, those
  // weights up, one after another. With the layers' weights on the host (Note [Weights on
  // the host] in schedule/weights.h) only the embedding's, final norm's and head's move:
  // the layers' gradients reached the host during the step.
  double host_update_s(i64 params, i64 moved = -1) const;
  double message_s(i64 bytes, int src, int dst) const;
  bool same_node(int a, int b) const { return a / hw_.devices_per_node == b / hw_.devices_per_node; }
  // Ring all-reduce over `group` of `bytes` per rank. `across_replicas`: the group's
  // ranks in every replica priced (price_replicas), as a weight-gradient all-reduce spans
  // them in the whole plan.
  double allreduce_s(i64 bytes, const std::vector<int>& group, bool across_replicas = false) const;
  // The schedule priced is one of `replicas` identical data-parallel replicas, each of
  // `ranks` ranks numbered one replica after another (the planner's search simulates one):
  // see allreduce_s.
  void price_replicas(int replicas, int ranks) {
    replicas_ = replicas;
    replica_ranks_ = ranks;
  }
  int replicas() const { return replicas_; }

  // Seconds of AllToAll op `op`: its exchanges (two a layer; four on a layer whose input a
  // backward rebuilds), each U - 1 messages a member, and the bytes the busiest member sends
  // (sched::alltoall_bytes), over the link between the group's ranks.
  double alltoall_s(const sched::Op& op, const sched::Schedule& s) const;

  // Bytes a Send/Recv/RingStep of `rank` moves (its tensor-parallel shards: members may
  // hold different numbers of heads).
  i64 message_bytes(const sched::Op& op, const sched::Schedule& s, int rank = 0) const;

 private:
  // Note [Ulysses, priced] (cost.cpp): the busiest Ulysses member's share of a piece of T
  // tokens' rows and of the heads (1, 1 without Ulysses).
  struct UlyssesShare {
    double rows = 1, heads = 1;
  };
  UlyssesShare ulysses_share(const sched::Schedule& s, i64 T) const;
  double ulysses_forward_s(const sched::Op& op, const sched::Schedule& s, i64 o) const;
  double ulysses_backward_s(const sched::Op& op, const sched::Schedule& s, i64 o) const;
  double kv_stream(const sched::Op& op, const sched::Schedule& s, i64 o, bool backward, bool again,
                   StreamCopies* copies) const;
  HardwareProfile hw_;
  ModelConfig model_;
  ActPrecision precision_;
  int act_bytes_;
  i64 kv_per_token_;
  double gemm_rate_;
  double attention_rate_;
  int replicas_ = 1, replica_ranks_ = 0;
};

}  // namespace sppo::plan
