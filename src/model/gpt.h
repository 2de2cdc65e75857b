// The GPT model of docs/design.md 2, as forward and backward functions of ONE block (or the
// head) on ONE subsequence of T tokens at global offset o, written once against the
// backend interface (backend/backend.h). The model owns no memory: the runtime allocates
// every buffer named below from the layout tables (core/layout.h) and decides where each
// lives (device, host, offloaded). Dimension letters: core/dims.h.
//
// Types: activations are `void*` of the backend's activation type (be.act()); master
// weights and their gradients, LayerNorm statistics, the LSE and the dK/dV accumulators
// are fp32. The GEMMs read the weights' working copy in the activation type (MatrixView;
// in fp32 the masters themselves).
//
// Accumulation rule: parameter gradients ACCUMULATE (+=) across subsequences; the
// residual-stream gradient `d` is updated IN PLACE (on entry the gradient w.r.t. the
// block's output, on exit w.r.t. its input).
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "core/config.h"
#include "core/layout.h"

namespace sppo {

// Views into one flat fp32 buffer laid out by parameter_specs(); used for the weights and,
// with the same offsets, for their gradients and the AdamW moments.
struct BlockParams {
  float* ln1_w; float* ln1_b;    // [H], [H]
  float* qkv_w; float* qkv_b;    // [Q, H], [Q]: Q = Z A + 2 G A (3H without GQA)
  float* q_norm_w; float* k_norm_w;  // [A], [A]: Note [Query/key norms]
  float* out_w; float* out_b;    // [H, Z A], [H]
  float* ln2_w; float* ln2_b;    // [H], [H]
  float* fc_w; float* fc_b;      // [W, H], [W]: W = F, or 2F (gate | up) when gated
  float* proj_w; float* proj_b;  // [H, F], [H]
};

// Tensors a model does not have (a Llama's biases, RMSNorm's) stay null.
struct ParamView {
  float* embed = nullptr;        // [V, H]
  std::vector<BlockParams> blocks;
  float* lnf_w = nullptr;        // [H]
  float* lnf_b = nullptr;        // [H]
  float* head = nullptr;         // [V, H] the LM head: embed when tied, else lm_head.weight
};

// Carves views from `base`, which holds total_bytes(parameter_specs(c)) bytes.
ParamView param_view(const ModelConfig& c, float* base);
// The views of a stage that owns layers [begin, end): `base` holds
// parameter_specs(c, begin, end); blocks outside the range and the embedding or final
// LayerNorm the stage does not own stay null.
ParamView param_view(const ModelConfig& c, float* base, int begin, int end);
// A tensor-parallel member's views (parameter_specs(c, begin, end, tp)): its shards.
ParamView param_view(const ModelConfig& c, float* base, int begin, int end, const TpShard& tp);

// The linear layers' weights and biases the GEMMs read, in the activation type: a copy of
// the fp32 masters laid out like them (parameter_specs(c, begin, end), every tensor
// converted), or the masters.
struct BlockMatrices {
  const void* qkv_w; const void* qkv_b;    // [Q, H], [Q]: Q = Z A + 2 G A (3H without GQA)
  const void* out_w; const void* out_b;    // [H, Z A], [H]
  const void* fc_w; const void* fc_b;      // [W, H], [W]
  const void* proj_w; const void* proj_b;  // [H, F], [H]
};
struct MatrixView {
  const void* embed = nullptr;  // [V, H]
  std::vector<BlockMatrices> blocks;
  const void* head = nullptr;   // [V, H]: the LM head's GEMMs (embed when tied)
};
MatrixView matrix_view(const ModelConfig& c, const void* base, DType t, int begin, int end);
MatrixView matrix_view(const ModelConfig& c, const void* base, DType t, int begin, int end, const TpShard& tp);

// The element `elems` past an activation pointer of type t.
inline void* act_at(void* p, i64 elems, DType t) { return static_cast<char*>(p) + elems * dtype_bytes(t); }
inline const void* act_at(const void* p, i64 elems, DType t) {
  return static_cast<const char*>(p) + elems * dtype_bytes(t);
}
// The element `off` past a bias, or null for a layer without one.
inline const void* bias_at(const void* b, i64 off, DType t) { return b ? act_at(b, off, t) : nullptr; }

// What one block saves for backward on one subsequence (block_saved_specs order).
struct BlockSaved {
  void* x;          // [T, H] block input
  float* ln1_mean;  // [T]
  float* ln1_rstd;  // [T]
  void* ln1_out;    // [T, H]
  void* q;          // [T, Z A] after RoPE
  void* k;          // [T, G A] after RoPE (KV cache block of this subsequence)
  void* v;          // [T, G A]
  void* attn_out;   // [T, Z A]
  float* lse;       // [Z, T]
  void* x_mid;      // [T, H]
  float* ln2_mean;  // [T]
  float* ln2_rstd;  // [T]
  void* ln2_out;    // [T, H]
  void* fc_pre;     // [T, W]
  // Note [Query/key norms]: null without them.
  void* q_pre;      // [T, Z A] queries before their norm
  float* q_rstd;    // [T, Z] the norm's statistics, a row per head
  void* k_pre;      // [T, G A] keys before their norm
  float* k_rstd;    // [T, G]
};

// Builds a BlockSaved from pointers in block_saved_specs order (14 of them without
// query/key norms, 18 with).
BlockSaved block_saved_from(const std::vector<void*>& ptrs);

struct BlockWorkspace {
  void* qkv;           // [T, max(Q, H)]
  void* mlp_act;       // [Tm, W]: Tm = T, or min(T, mlp_rows) with MLP tiles
  void* d_tmp;         // [T, max(H, Z A)]
  float* delta;        // [Z, T]
  Workspace scratch;   // the kernels' (Backend::block_scratch); empty: their own
  // Note [MLP tiles] (core/layout.h): rows of a tile (0: no tiles), and the tile's rows
  // of fc_pre [Tm, F] where the saved fc_pre is recomputed (a null BlockSaved::fc_pre).
  int mlp_rows = 0;
  void* fc_tile = nullptr;
  // Tensor parallel only (block_workspace_specs with a TpShard): a gathered input or a
  // partial sum [T, H], the collectives' padded buffer, and this member's rows [Ts, H].
  void* tp_full = nullptr;
  void* tp_pad = nullptr;
  void* tp_rows = nullptr;
};
BlockWorkspace block_workspace_from(const std::vector<void*>& ptrs, Workspace scratch = {},
                                    const MlpTiles& tiles = {});

// Keys and values of the earlier subsequences j < i of this layer, and (in backward) their
// gradient accumulators. kv[j] covers positions offsets[j] .. offsets[j] + lengths[j] - 1.
struct KVBlocks {
  std::vector<const void*> k, v;  // [l_j, G A] activations
  std::vector<float*> dk, dv;     // [l_j, G A] fp32, accumulate (+=); backward only
  std::vector<i64> offsets, lengths;
};

// A run of consecutive positions: rows [row0, row0 + rows) of a block hold positions
// pos0 .. pos0 + rows - 1.
struct PosSpan {
  i64 pos0 = 0;
  int rows = 0;
  int row0 = 0;
};

// The tokens one block call works on: a subsequence (or a contiguous ring piece) of T
// tokens from position `offset`, or, when `spans` is set, several runs of positions (a
// zigzag ring piece: chunks r and 2R-1-r), their rows in span order. Per-token work runs
// over all T rows at once; RoPE and attention run per span. The LSE and delta of a block
// are laid out per span: span j's [Z, rows_j] starts at Z * row0_j.
// Packed documents (--pack): `docs` holds the starts of the step's documents (sorted
// global positions, the first 0). A block then attends only to keys of a query's own
// document and rotates every row by its position in its document; parts() splits the
// spans at document starts, so that each part lies in one document.
struct Subseq {
  Subseq() = default;
  Subseq(i64 o, int t) : offset(o), T(t) {}
  i64 offset = 0;  // o: position of row 0
  int T = 0;       // tokens in this subsequence (or piece)
  std::vector<PosSpan> spans;  // empty: one span {offset, T, 0}
  const std::vector<i64>* docs = nullptr;  // null: the sequence is one document
  std::vector<PosSpan> parts() const;
  // The first position of the document holding position `pos` (0 without documents).
  i64 doc_start(i64 pos) const;
  // RoPE's position of the first row of span p: its position in its document. (RoPE's
  // scores depend only on the distance between positions, so this changes no result beyond
  // rounding: angles stay those of the document's length, as a model trained on documents
  // alone saw them.)
  i64 rope_pos(const PosSpan& p) const { return p.pos0 - doc_start(p.pos0); }
};

// How a block's queries reach the keys they attend to. The block computes its own q, k, v
// and hands them to forward(); block_backward hands the gradient of attn_out to backward().
// LocalAttention is the one-process case (the earlier subsequences' KV blocks are on this
// device); ring attention (runtime/ring.h) reaches the keys of other ranks.
class BlockAttention {
 public:
  virtual ~BlockAttention() = default;
  // s.attn_out and s.lse of the queries s.q over every key they see (s.k, s.v: this block's own).
  virtual void forward(Backend& be, BlockSaved& s, const ModelConfig& c, const Subseq& q, const Workspace& scratch) = 0;
  // dq into columns [0, H) of dqkv [T, 3H] (overwritten; columns [H, 3H) are free scratch
  // until the caller writes dK, dV there); for a Llama-family model (grouped-query K/V
  // may leave less room beside dq) dense into its first T Z A elements. From dout [T, Z A]
  // = d attn_out and delta (laid out as the LSE). dk_self, dv_self [T, G A] and every
  // earlier block's accumulators accumulate; this block's are complete on return.
  virtual void backward(Backend& be, void* dqkv, const void* dout, const float* delta, const BlockSaved& s,
                        float* dk_self, float* dv_self, const ModelConfig& c, const Subseq& q,
                        const Workspace& scratch) = 0;
};

class LocalAttention final : public BlockAttention {
 public:
  explicit LocalAttention(const KVBlocks& past) : past_(past) {}
  void forward(Backend& be, BlockSaved& s, const ModelConfig& c, const Subseq& q, const Workspace& scratch) override;
  void backward(Backend& be, void* dqkv, const void* dout, const float* delta, const BlockSaved& s, float* dk_self,
                float* dv_self, const ModelConfig& c, const Subseq& q, const Workspace& scratch) override;

 private:
  const KVBlocks& past_;
};

// The attention kernels mask by position (a key is seen by queries at or after it). A
// bidirectional model's queries are placed after every key for the kernels, so that every
// key is seen; RoPE still uses the true positions.
inline constexpr i64 kAfterEveryKey = i64{1} << 40;
// The last key position that the queries of span p see.
inline i64 last_seen(const ModelConfig& c, const PosSpan& p) {
  return c.causal ? p.pos0 + p.rows - 1 : kAfterEveryKey;
}

// The block's norms: LayerNorm (GPT; mean and rstd saved) or RMSNorm (Llama family; rstd
// only, mean unused) of x [T, H], and their backward (dx, dw, db accumulate).
void norm_forward(Backend& be, const ModelConfig& c, void* out, float* mean, float* rstd, const void* x,
                  const float* w, const float* b, int T);
void norm_backward(Backend& be, const ModelConfig& c, void* dx, float* dw, float* db, const void* dout,
                   const void* x, const float* w, const float* mean, const float* rstd, int T, const Workspace& ws);
// A block's middle, over its rows [T, H]: with `add`, x_mid += x (the attention's residual);
// with `norm`, ln2 = LN2(x_mid); both in one backend call where both run.
void mid_residual_norm(Backend& be, const ModelConfig& c, BlockSaved& s, const BlockParams& p, bool add, bool norm,
                       int T);
// The MLP's activation of `rows` rows: gelu(fc_pre) [rows, F], or swiglu(gate | up).
void mlp_act_forward(Backend& be, const ModelConfig& c, void* out, const void* fc_pre, int rows);

// The AttnShape of one span of a block's queries (q, out strides Z A; k, v strides G A).
AttnShape span_shape(const ModelConfig& c, const PosSpan& p);

// The KV blocks the span `queries` of subsequence q attends to, in position order: the
// earlier subsequences' blocks of `past`, then q's own keys (k_self/v_self, gradients
// dk_self/dv_self), one block per own span that starts at or before the queries' last
// position. Packed documents: keys before the queries' document are cut away.
std::vector<KVRef> attention_key_blocks(const KVBlocks& past, const void* k_self, const void* v_self, float* dk_self,
                                        float* dv_self, const Subseq& q, const PosSpan& queries, const ModelConfig& c,
                                        DType a);

// x_out[T, H] = block(s.x). Fills every tensor of `s` (x must already hold the input) but a
// null s.fc_pre, which w.fc_tile holds a tile at a time (Note [MLP tiles]).
// `attn` reaches the keys; the KVBlocks form attends to `past` (the KV blocks of j < i) and
// this subsequence's own k/v (s.k, s.v) on this device.
void block_forward(Backend& be, void* x_out, BlockSaved& s, const BlockParams& p, const BlockMatrices& m,
                   const BlockWorkspace& w, BlockAttention& attn, const ModelConfig& c, const Subseq& q);
void block_forward(Backend& be, void* x_out, BlockSaved& s, const BlockParams& p, const BlockMatrices& m,
                   const BlockWorkspace& w, const KVBlocks& past, const ModelConfig& c, const Subseq& q);

// x_out[T, H] = s.x_mid + proj(act(fc_pre)): the block's output from its saved (or
// recomputed) x_mid and fc_pre (under MLP tiles, ln2_out: fc_pre a tile at a time in
// w.fc_tile). The last step of block_forward; Note [The loss in backward] runs it again.
// w.mlp_act is scratch.
void block_output(Backend& be, void* x_out, const BlockSaved& s, const BlockMatrices& m, const BlockWorkspace& w,
                  const ModelConfig& c, int T);

// Before the backward of one block: recomputes the saved tensors of `groups` (a closed set,
// Note [Recomputed tensors] in core/layout.h) into s and, when `kv`, this subsequence's own
// s.k, s.v, by running again the forward steps that make them, from what s keeps (x always;
// the rest unless recomputed too). The attention group attends through `attn` (its
// forward; may be null otherwise). w.qkv is scratch.
void block_recompute(Backend& be, BlockSaved& s, SavedSet groups, bool kv, const BlockParams& p,
                     const BlockMatrices& m, const BlockWorkspace& w, BlockAttention* attn, const ModelConfig& c,
                     const Subseq& q);

// k, v [rows, G A] of the positions pos0 .. pos0 + rows - 1 from their LayerNorm-1 output
// ln1_out [rows, H]: the k and v rows of the qkv projection, the key norm (Note
// [Query/key norms]; its weight p.k_norm_w) and RoPE on k (as block_forward computes them,
// to fp32 rounding). k_pre [rows, G A] and k_rstd [rows, G] (may be null, then not kept)
// receive the keys before their norm and its statistics. A layer that recomputes its K/V
// (KvPlace::Recompute) makes the earlier blocks' this way, a chunk at a time.
void kv_project(Backend& be, void* k, void* v, const void* ln1_out, const BlockParams& p, const BlockMatrices& m,
                const ModelConfig& c, i64 pos0, int rows, void* k_pre = nullptr, float* k_rstd = nullptr);

// Note [Query/key norms]
// ~~~~~~~~~~~~~~~~~~~~~~
// Qwen3 normalises each query and key head before RoPE: q = RoPE(rmsnorm(q_pre) * w_q)
// with q_pre the q rows of the projection, the RMS over each head's A values, and one
// weight w_q [A] shared by the heads (k likewise, w_k). As [T Z, A] rows, that is the
// block's RMSNorm kernel on T Z rows of width A (T G for the keys), so it adds no kernel.
// The block saves q_pre and k_pre and the norms' rstd [T, Z], [T, G] (the last four of
// block_saved_specs, which a model without norms does not have), and the saved q and k stay
// the attention's inputs, after norm and RoPE. Backward takes d q through RoPE's backward, then the norm's (from q_pre and its
// rstd; d w_q accumulates over every row of every head), and only then the projection's;
// the keys' complete dK of this subsequence (every later one has added its part) likewise
// from k_pre. The group "q" of Note [Recomputed tensors] (core/layout.h) makes q, q_pre,
// q_rstd, k_pre and k_rstd again (the k rows of the projection and their norm; k itself
// is the K/V cache's). A layer that recomputes its K/V makes them from the LayerNorm-1
// output through the norm too (kv_project); under Note [dK/dV into the layer input] each
// later subsequence's part of an earlier block's dK goes through the norm's backward
// before the projection: the norm's backward is linear in its output gradient, so the
// parts sum to the whole. Under tensor parallelism the norms' weights are whole on every
// member, each member's d w is its own heads' part (a replicated key/value head's: its
// own query heads' part of dK), and the runtime sums them over the group as it does the
// LayerNorm weights'.
// The forward steps of those norms as the block and a tensor-parallel member run them:
// from the LayerNorm-1 output `in` [T, H] (a member's gathered rows) and the projection's
// rows of the model `ac` (attention_view for a member), q (with q_pre, q_rstd, k_pre,
// k_rstd) when `want_q`, and k (RoPE too) and v when `kv`. w.qkv is scratch.
void qk_norm_forward(Backend& be, BlockSaved& s, bool want_q, bool kv, const BlockParams& p, const BlockMatrices& m,
                     const BlockWorkspace& w, const void* in, int H, const ModelConfig& ac, const Subseq& q);
// Their backward with the projection's, after the attention's: from dq [T, Z A] dense in
// w.qkv (RoPE's output gradient) and this subsequence's complete dK, dV (dk_self, dv_self
// [T, G A]), through RoPE, the norms and the projection: w.d_tmp [T, H] = d in, and
// g.qkv_w (g.qkv_b), g.q_norm_w and g.k_norm_w accumulate. w.qkv is scratch.
void qk_norm_backward(Backend& be, BlockParams& g, const float* dk_self, const float* dv_self, const BlockSaved& s,
                      const BlockParams& p, const BlockMatrices& m, const BlockWorkspace& w, const void* in, int H,
                      const ModelConfig& ac, const Subseq& q);

// d[T, H]: in the gradient w.r.t. the block output, out w.r.t. its input. A null s.fc_pre
// is made again a tile at a time into w.fc_tile (Note [MLP tiles]). dk_self/dv_self
// [T, H] are this subsequence's dK/dV accumulators: on entry they hold the contributions of
// later subsequences (or zeros); on exit they are complete. past.dk/dv accumulate.
// d_ln1_sums [T, H] fp32 (may be null): gradient of the LayerNorm-1 output that later
// subsequences' backward already took through the K/V projection (Note [dK/dV into the
// layer input], runtime/kv_stream.h), added before that LayerNorm's backward.
void block_backward(Backend& be, void* d, BlockParams& grads, float* dk_self, float* dv_self, const BlockSaved& s,
                    const BlockParams& p, const BlockMatrices& m, const BlockWorkspace& w, BlockAttention& attn,
                    const ModelConfig& c, const Subseq& q, const float* d_ln1_sums = nullptr);
void block_backward(Backend& be, void* d, BlockParams& grads, float* dk_self, float* dv_self, const BlockSaved& s,
                    const BlockParams& p, const BlockMatrices& m, const BlockWorkspace& w, const KVBlocks& past,
                    const ModelConfig& c, const Subseq& q);

// Head forward and backward at once (the loss gradient is known in forward): given x[T, H]
// (last block output) and targets[T], adds this subsequence's summed loss to *loss_sum (a
// device double), and writes head_grad[T, H] = d loss_mean / d x where loss_mean divides by
// `total_tokens` (S). dembed/dlnf accumulate. Workspace from head_workspace_specs;
// afterwards w.losses[T] holds each position's loss.
struct HeadWorkspace {
  void* ln_f_out;    // [T, H]
  float* ln_f_mean;  // [T]
  float* ln_f_rstd;  // [T]
  float* logits;     // [chunk, V]
  float* losses;     // [T]
  void* dlogits;     // [chunk, V] activations (bf16), or the logits themselves (fp32)
  int chunk;
  Workspace scratch;  // the kernels' (Backend::head_scratch)
  // Tensor parallel only: [T, H] gathered ln_f_out, the padded buffer, lse_parts [tp, chunk].
  void* tp_full = nullptr;
  void* tp_pad = nullptr;
  float* lse_parts = nullptr;
};
HeadWorkspace head_workspace_from(const std::vector<void*>& ptrs, int chunk, Workspace scratch = {}, bool tp = false);
// A null head_grad: the forward alone (an evaluation), the loss and w.losses, no gradient;
// with `hits` (host, [T]) too, 1 where the row's most likely token is its target, else 0
// (0 where it has none, kNoTarget).
void head_forward_backward(Backend& be, void* head_grad, double* loss_sum, const void* x, const std::int32_t* targets,
                           const ParamView& p, const MatrixView& m, ParamView& g, const HeadWorkspace& w,
                           const ModelConfig& c, int T, i64 total_tokens, std::uint8_t* hits = nullptr);

}  // namespace sppo
