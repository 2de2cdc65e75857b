// DeepSpeed-Ulysses sequence parallelism (--ulysses U; Jacobs et al. 2023): the U ranks of a
// Ulysses group (Note [Rank layout] in core/parallel.h) split every piece of a subsequence
// by rows, member u holding rows piece_range(T, u, U) (core/layout.h UlyssesShard) through
// every part of a block but the attention, with all of the model's weights. Around the
// attention, all-to-alls turn the rows into heads and back.
//
// Note [Ulysses]
// ~~~~~~~~~~~~~~
// Per layer, forward: the block projects q, k, v of its rows (every head) and applies RoPE;
// the Heads exchange gives each member every row of the piece for its heads (TpShard's split
// of the heads over U: whole query groups of its key/value heads, or with more members than
// key/value heads a share of one head's queries, that head on each of its replicas); the
// member's K, V of the piece are its K/V cache, so a rank keeps 1/U of the cache that one rank
// alone would (U <= the key/value heads), and nothing of the prefix ever moves between ranks.
// The inner attention (on this rank: LocalAttention, streamed from the host, or, under USP
// --ulysses U --cp R, round the ring of the u-th members of the ring's ranks) then runs the
// piece's queries of its heads against every key they see, on the model as its heads see it
// (attention_view); the Rows exchange brings the output and LSE back to the rows' members.
// Backward mirrors it: GradHeads sends q, the output gradient, LSE and delta to the heads'
// members; the inner backward adds the piece's dK, dV of its heads to the cache's
// accumulators (and every earlier block's); the replicas of a key/value head sum theirs; and
// GradRows returns dq and the complete dK, dV of each member's rows, which the block takes
// through RoPE and the projection as it would its own. Every exchange is one all-to-all of
// packed blocks (Note [Ulysses exchanges] in core/layout.h); its buffers are the layer's
// workspace (Note [Ulysses buffers] in core/layout.cpp).
//
// Exact: the attention of a head over all the piece's rows is the same computation whichever
// rank runs it, and each row's q, k, v, output and gradients are those of one rank alone,
// moved; the loss over the members' rows is each member's share of the step's mean, as a
// ring member's is. What does not compose: MSP's pieces, tensor parallelism in the same
// layout, a recomputed attention or recomputed K/V (setup refuses them, naming what runs).
#pragma once

#include <vector>

#include "backend/backend.h"
#include "comm/comm.h"
#include "core/config.h"
#include "core/layout.h"
#include "model/gpt.h"

namespace sppo {

// The layer's Ulysses buffers, in block_workspace_specs order after the block's own.
struct UlyssesBuffers {
  void* k = nullptr;        // [Tl, G A] this member's rows' K, V (the block writes them there)
  void* v = nullptr;
  float* dk = nullptr;      // [Tl, G A] fp32: their complete dK, dV, back from the heads' members
  float* dv = nullptr;
  void* q = nullptr;        // [T, Zu A] the piece's queries of this member's heads
  void* o = nullptr;        // [T, Zu A] their output, or in backward its gradient
  float* lse = nullptr;     // [Zu, T] laid out as the piece's parts
  float* delta = nullptr;   // [Zu, T]
  void* dq = nullptr;       // [T, max(Qu, Zu A)] the inner attention's dqkv
  void* send = nullptr;     // the exchanges' packed blocks
  void* recv = nullptr;
};
inline constexpr int kUlyssesBuffers = 11;
// From the last kUlyssesBuffers pointers of a Ulysses layer's workspace.
UlyssesBuffers ulysses_buffers_from(const std::vector<void*>& ptrs);

struct UlyssesContext {
  comm::Comm* comm = nullptr;
  comm::Group members;    // world ranks of the group, in member order
  int me = 0;             // this rank's index in members
  comm::Group replicas;   // the members that hold this member's key/value head (itself alone: none)
  ModelConfig model;      // the whole model
  Subseq piece;           // every row of the piece the op runs, as the attention sees it (with documents)
  std::vector<Subseq> rows;  // [member] its rows of the piece (with documents)
  UlyssesBuffers buf;
  void* k_cache = nullptr;   // [T, KVu] the piece's K, V of this member's key/value heads
  void* v_cache = nullptr;
  float* dk_cache = nullptr;  // [T, KVu] fp32 their dK/dV accumulators (backward)
  float* dv_cache = nullptr;
  double* waited_s = nullptr;  // adds the seconds spent waiting for the exchanges
};

// A block's attention through Ulysses' exchanges: the block sees its rows (s: its rows' q,
// k, v with every head; dk_self, dv_self: buf.dk, buf.dv), the inner attention the piece's
// rows of this member's heads.
class UlyssesAttention final : public BlockAttention {
 public:
  UlyssesAttention(const UlyssesContext& ctx, BlockAttention& inner);
  void forward(Backend& be, BlockSaved& s, const ModelConfig& c, const Subseq& q, const Workspace& scratch) override;
  void backward(Backend& be, void* dqkv, const void* dout, const float* delta, const BlockSaved& s, float* dk_self,
                float* dv_self, const ModelConfig& c, const Subseq& q, const Workspace& scratch) override;

 private:
  int size() const { return int(ctx_.members.size()); }
  // One exchange: pack(j, at) writes this member's block for member j at `at` (returning its
  // bytes), then the all-to-all, then unpack(w, at) reads member w's block for this one.
  template <typename Pack, typename Unpack>
  void exchange(Backend& be, UlyssesExchange x, Pack pack, Unpack unpack);

  UlyssesContext ctx_;
  BlockAttention& inner_;
  ModelConfig view_;  // the model as this member's heads see it (attention_view)
  DType act_;
  std::vector<std::pair<i64, i64>> rows_;      // [member] its rows [b, e) of the piece
  std::vector<TpShard> heads_;                 // [member] its heads
};

}  // namespace sppo
