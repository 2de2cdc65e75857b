// Tensor parallelism with sequence-parallel regions (Megatron-LM's; the SPPO paper's SP,
// docs/design.md 6, `--tp`): one block's and the head's forward and backward as one member of a
// tensor-parallel group computes them, written against the backend and against
// TpCollectives, the group's collectives (runtime/tensor_parallel.h implements them).
// Shards and shapes: core/layout.h TpShard; dimension letters: core/dims.h, plus
// Ts = rows of this member in the sequence-parallel regions, Hr = Zr * A its heads' width,
// KVr its key/value heads' width (Hr without grouped-query attention), Fr its MLP columns,
// Vr its vocabulary rows.
//
// A Llama-family block runs the same regions with its own pieces: RMSNorm for LayerNorm
// (norm_forward / norm_backward), a q/k/v projection of Hr + 2 KVr outputs (the q of the
// member's query heads, then the k and v of its key/value heads: the group size divides
// G, so its queries read exactly those), the query/key norms of its heads (Note
// [Query/key norms] in model/gpt.h: their weights whole on every member, their gradients
// summed over the group), a SwiGLU over fc_pre [T, 2Fr] (the gate, then the up rows of its
// Fr columns), no row-parallel biases, and the untied LM head (p.head, vocabulary-parallel
// like the embedding). Hr = Zr A may exceed H (Note [Head size] in core/config.h).
//
// Note [Sequence-parallel regions]: between the tensor-parallel regions each member holds
// rows tp.rows(T) of the residual stream, and LayerNorm and the residual adds run on those
// rows alone. Before a column-parallel projection (qkv, fc) the LayerNorm output is
// all-gathered to [T, H]; a row-parallel projection (out, proj) makes a partial sum
// [T, H] that is reduce-scattered back to rows. Backward mirrors it (the gradient of an
// all-gather is a reduce-scatter and the other way round), and gathers the LayerNorm
// outputs again rather than keeping [T, H] copies. So every saved tensor is divided by the
// group size: the residual-region ones by rows, the rest by heads or MLP columns. A
// row-parallel bias is added by member 0 before the reduce-scatter (once in the sum); its
// gradient, from the gathered output gradient, is whole on every member. The gradients of
// the LayerNorm weights come from this member's rows only: the runtime sums them over the
// group.
//
// Accumulation rules are those of model/gpt.h: parameter gradients +=, the residual
// gradient `d` [Ts, H] updated in place.
#pragma once

#include <cstdint>

#include "backend/backend.h"
#include "core/layout.h"
#include "model/gpt.h"

namespace sppo {

class TpCollectives {
 public:
  virtual ~TpCollectives() = default;
  virtual const TpShard& shard() const = 0;
  // full [T, H] = every member's rows (mine [Ts, H]: this member's), in member order.
  // pad: [shard().padded_rows(T), H] scratch. Blocking.
  virtual void all_gather(Backend& be, void* full, const void* mine, void* pad, int T, int H) = 0;
  // mine [Ts, H] = this member's rows of the sum over the members of full [T, H]; full is
  // left unspecified. Blocking.
  virtual void reduce_scatter(Backend& be, void* mine, void* full, void* pad, int T, int H) = 0;
  // parts [size, rows] fp32: member k fills slot k (rows values); afterwards every member
  // holds every slot. Blocking.
  virtual void all_gather_rows(float* parts, int rows) = 0;
};

// x_out [Ts, H] = block(s.x [Ts, H]) with this member's shards. Fills every tensor of `s`
// (block_saved_specs(c, T, p, tp) shapes); `attn` sees the model as attention_view(c, tp).
void block_forward_tp(Backend& be, void* x_out, BlockSaved& s, const BlockParams& p, const BlockMatrices& m,
                      const BlockWorkspace& w, BlockAttention& attn, TpCollectives& tpc, const ModelConfig& c,
                      const Subseq& q);
// block_output as a member of the group: x_out [Ts, H] = s.x_mid + reduce_scatter(proj of
// this member's fc columns), block_forward_tp's last step.
void block_output_tp(Backend& be, void* x_out, const BlockSaved& s, const BlockMatrices& m, const BlockWorkspace& w,
                     TpCollectives& tpc, const ModelConfig& c, int T);
// block_recompute as a member of the group: the same steps, with their collectives (every
// member recomputes the same groups).
void block_recompute_tp(Backend& be, BlockSaved& s, SavedSet groups, bool kv, const BlockParams& p,
                        const BlockMatrices& m, const BlockWorkspace& w, BlockAttention* attn, TpCollectives& tpc,
                        const ModelConfig& c, const Subseq& q);
// d [Ts, H]: in, the gradient w.r.t. the block output; out, w.r.t. its input. dk_self and
// dv_self [T, KVr] as in block_backward.
void block_backward_tp(Backend& be, void* d, BlockParams& g, float* dk_self, float* dv_self, const BlockSaved& s,
                       const BlockParams& p, const BlockMatrices& m, const BlockWorkspace& w, BlockAttention& attn,
                       TpCollectives& tpc, const ModelConfig& c, const Subseq& q);

// Vocabulary-parallel embedding of the tokens of q (ids: the whole step's, on the device,
// indexed by position): x_rows [Ts, H] = this member's rows of the lookup, each member
// adding the rows of its vocabulary. full [q.T, H] and pad as in TpCollectives are scratch.
void embedding_forward_tp(Backend& be, void* x_rows, const std::int32_t* ids, const float* embed, void* full, void* pad,
                          TpCollectives& tpc, const ModelConfig& c, const Subseq& q);
// dembed [Vr, H] += the rows of the gathered d_rows [Ts, H] whose ids are this member's.
void embedding_backward_tp(Backend& be, float* dembed, const void* d_rows, const std::int32_t* ids, void* full,
                           void* pad, TpCollectives& tpc, const ModelConfig& c, const Subseq& q);

// head_forward_backward with a vocabulary-parallel LM head and cross-entropy on the tokens
// of q: x [Ts, H] (this member's rows of the last block's output), targets the whole
// step's (indexed by position); head_grad [Ts, H]. w.losses[q.T] holds, in q's row order,
// this member's part of each row's loss (the row's loss where the target is in its
// vocabulary, else 0) and *loss_sum its sum: both add up over the group to
// head_forward_backward's. A null head_grad: the forward alone; with `hits` (host, the whole
// step's, indexed by position as targets are), 1 where the row's most likely token over the
// whole vocabulary is its target, else 0, the same on every member.
void head_forward_backward_tp(Backend& be, void* head_grad, double* loss_sum, const void* x,
                              const std::int32_t* targets, const ParamView& p, const MatrixView& m, ParamView& g,
                              const HeadWorkspace& w, TpCollectives& tpc, const ModelConfig& c, const Subseq& q,
                              i64 total_tokens, std::uint8_t* hits = nullptr);

}  // namespace sppo
