// Layout tables (docs/design.md, Conventions 3): every parameter and every activation that
// backward needs is described once, here, as a TensorSpec list built from the config. The
// runtime carves its buffers from these lists and the planner sums the same lists, so a
// plan and a run cannot disagree on bytes.
//
// Saved activations of one block on one subsequence of T tokens (docs/design.md 4):
//   skeletal    k, v [T, G A] (after RoPE): kept on the device for the whole step (KV cache)
//   offloadable everything else below: the unit U(l, i) that offloading moves to the host
// The LM head's backward runs right after the forward of a subsequence (its loss gradient
// is known then), so only head_grad [T, H], the gradient reaching the last block's output,
// is saved: one more offloadable tensor per subsequence.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/config.h"
#include "core/dims.h"

namespace sppo {

enum class DType { F32, BF16, I32 };
enum class Tier { Device, Host };
enum class Role { Skeletal, Offloadable, Parameter, Workspace };

int dtype_bytes(DType t);
const char* dtype_name(DType t);  // safetensors names: "F32", "BF16", "I32"

struct TensorSpec {
  std::string name;
  std::vector<i64> shape;
  DType dtype = DType::F32;
  Role role = Role::Offloadable;

  i64 numel() const;
  i64 bytes() const { return numel() * dtype_bytes(dtype); }
};

i64 total_bytes(const std::vector<TensorSpec>& specs);

// Range [begin, end) of piece p of `pieces` of n items: the first n % pieces pieces get one
// more. How a subsequence splits into SP or MSP pieces, and a gradient bucket into ZeRO
// shards.
std::pair<i64, i64> piece_range(i64 n, int piece, int pieces);

// Tensor parallelism with sequence-parallel regions (Megatron-LM's; docs/design.md 6, --tp).
// Member `index` of a group of `size` ranks holds heads piece_range(Z, index, size) of the
// attention (their rows of the q, k and v projections, their columns of the output
// projection, their part of the K/V cache), columns piece_range(F, ...) of the MLP (rows of
// fc, columns of proj), rows piece_range(V, ...) of the embedding (vocabulary-parallel
// embedding and cross-entropy), and, in the LayerNorm / residual regions, rows
// piece_range(T, index, size) of every subsequence. LayerNorm weights, the query/key norms'
// weights and the biases of the two row-parallel projections are whole on every member.
//
// Note [Replicated key/value heads]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Grouped-query attention with more members than key/value heads (size = m G, m > 1):
// each K/V head lives on the m consecutive members index / m == g, which split its r = Z / G
// query heads piece_range(r, index % m, m) (so tp 8 runs qwen2.5-7b's 28 heads over 4 K/V
// heads as 4 + 3 per pair). Every replica projects and caches the whole K/V head; its
// attention backward gives the part of dK, dV that its own query heads read, so the K/V
// rows' weight gradients are summed over the m replicas (GradReduce::reduce_replicated),
// while dx needs nothing more: the reduce-scatter that ends the attention's backward
// already sums every member's part. Checkpoints and norms take the head from its first
// replica.
struct TpShard {
  int index = 0;
  int size = 1;
  bool on() const { return size > 1; }
  // Members holding each key/value head: 1, or m when size = m G (Note [Replicated key/value heads]).
  int kv_replicas(const ModelConfig& c) const {
    const int G = c.kv_head_count();
    return size > G ? size / G : 1;
  }
  // Its query heads: with no more members than key/value heads, the query groups of its
  // key/value heads (whole groups of Z / G, so that each query reads its own key/value head;
  // with as many members as groups or a divisor of them, piece_range(Z, index, size)).
  std::pair<i64, i64> heads(const ModelConfig& c) const {
    const int m = kv_replicas(c);
    if (m == 1) {
      const i64 r = c.heads / c.kv_head_count();
      const auto [gb, ge] = piece_range(c.kv_head_count(), index, size);
      return {gb * r, ge * r};
    }
    const i64 r = c.heads / c.kv_head_count(), g = index / m;
    const auto [b, e] = piece_range(r, index % m, m);
    return {g * r + b, g * r + e};
  }
  std::pair<i64, i64> ffn(const ModelConfig& c) const { return piece_range(c.ffn(), index, size); }
  std::pair<i64, i64> vocab(const ModelConfig& c) const { return piece_range(c.vocab, index, size); }
  std::pair<i64, i64> rows(i64 T) const { return piece_range(T, index, size); }
  i64 row_count(i64 T) const { const auto [b, e] = rows(T); return e - b; }
  // Rows of the padded buffer the collectives move: size slots of ceil(T / size) rows.
  i64 padded_rows(i64 T) const { return i64(size) * ((T + size - 1) / size); }
  // This member's share of the attention: its heads, and their width (heads x A).
  int local_heads(const ModelConfig& c) const { const auto [b, e] = heads(c); return int(e - b); }
  int local_hidden(const ModelConfig& c) const { return local_heads(c) * c.head_size(); }
  // Grouped-query attention: its key/value heads (those its query heads read: a whole
  // piece of them when size divides G, else one replicated head), and their width.
  std::pair<i64, i64> kv_heads(const ModelConfig& c) const {
    const int m = kv_replicas(c);
    if (m == 1) return piece_range(c.kv_head_count(), index, size);
    return {index / m, index / m + 1};
  }
  int local_kv_width(const ModelConfig& c) const { const auto [b, e] = kv_heads(c); return int(e - b) * c.head_size(); }
  // Outputs of its part of the q/k/v projection, and of the fc projection (gate and up
  // rows of its F columns for a gated MLP).
  int local_qkv_width(const ModelConfig& c) const { return local_hidden(c) + 2 * local_kv_width(c); }
  int local_fc_width(const ModelConfig& c) const {
    const auto [b, e] = ffn(c);
    return int(e - b) * (c.gated() ? 2 : 1);
  }
};

// The model as one tensor-parallel member's attention sees it: its heads only, so hidden
// is their width (the kernels' row strides and the K/V cache's width). A Ulysses member's
// attention sees its heads so (UlyssesShard::heads).
ModelConfig attention_view(const ModelConfig& c, const TpShard& tp);

// Ulysses sequence parallelism (--ulysses; Note [Ulysses] in runtime/ulysses.h). Member
// `index` of `size` ranks holds rows piece_range(T, index, size) of a piece of T tokens in
// every part of a block but the attention, with every head; its attention (after an
// all-to-all) runs every row of the piece for the heads of heads() (TpShard's split: whole
// query groups of its key/value heads, or with more members than key/value heads, a share of
// one head's queries, the head replicated). The K/V cache of its pieces is every row of its
// key/value heads.
struct UlyssesShard {
  int index = 0;
  int size = 1;
  bool on() const { return size > 1; }
  TpShard heads() const { return {index, size}; }
  std::pair<i64, i64> rows(i64 T) const { return piece_range(T, index, size); }
  i64 row_count(i64 T) const { const auto [b, e] = rows(T); return e - b; }
};
// Whether U members split the model's heads so that each member's queries read whole
// key/value heads of its own: U at most the heads, and at most the key/value heads or a
// multiple of them whose members share each head's queries (as llama_tp_runs).
bool ulysses_runs(const ModelConfig& c, int U);

// What one rank holds of each layer's tensors on a piece: a tensor-parallel member's shards,
// a Ulysses member's rows (at most one of the two on), or everything. The memory rules and
// the runtime take a rank's tables through it (the *_specs overloads below dispatch).
struct RankShard {
  TpShard tp;
  UlyssesShard ulysses;
  bool on() const { return tp.on() || ulysses.on(); }
  // Rows of a piece of T tokens in the LayerNorm / residual regions (and the hidden states
  // passed between stages).
  i64 rows(i64 T) const { return ulysses.on() ? ulysses.row_count(T) : tp.row_count(T); }
  // The heads its attention runs, as a TpShard gives them (all of them for neither).
  TpShard heads() const { return ulysses.on() ? ulysses.heads() : tp; }
};

// Parameters in checkpoint order, with the exact names of the export format:
// embed.weight, blocks.{l}.ln1.weight, ..., ln_f.weight, ln_f.bias. A Llama-family model
// has no biases but attn.qkv.bias with qkv_bias, its qkv rows are the Z query heads then
// G key and G value heads ([Z A + 2 G A, H]), attn.out is [H, Z A], attn.q_norm.weight and
// attn.k_norm.weight [A] follow the q/k/v projection where it has query/key norms,
// mlp.fc is [2F, H] (gate rows, then up rows), and an untied lm_head.weight [V, H] comes
// last.
std::vector<TensorSpec> parameter_specs(const ModelConfig& c);
// The parameters a pipeline stage holding layers [begin, end) owns, in the same order:
// the embedding with the first layer and, tied as the LM head, with the last (an untied
// LM head with the last only); the final norm with the last.
std::vector<TensorSpec> parameter_specs(const ModelConfig& c, int begin, int end);
// The same, as tensor-parallel member tp holds them: the same names, its shards' shapes.
std::vector<TensorSpec> parameter_specs(const ModelConfig& c, int begin, int end, const TpShard& tp);

// Where a member's parameters sit in the whole model's: run `count` elements from
// `local` in its flat array (parameter_specs(c, begin, end, tp) order) are elements
// `full` onwards of the whole model's (parameter_specs(c) order). `replicated`: the
// tensor is whole on every member (LayerNorm weights, row-parallel biases); `kv_replica`:
// the k or v rows of a key/value head that several members hold (Note [Replicated
// key/value heads]); `copy`: another member holds the same values and is the one that
// counts them (in gathers and gradient norms): members past the first for a replicated
// tensor, replicas past the first for a key/value head.
struct ParamSlice {
  i64 local = 0, full = 0, count = 0;
  bool replicated = false;
  bool kv_replica = false;
  bool copy = false;
};
std::vector<ParamSlice> param_slices(const ModelConfig& c, int begin, int end, const TpShard& tp);
// Whether a parameter (by name) is whole on every tensor-parallel member.
bool tp_replicated(const std::string& name);

// Scratch memory a kernel (or a block's sequence of kernels) needs for T rows, as an upper
// bound fixed + bytes_per_token * T that the runtime allocates from the device tier and the
// memory rules count (kernels/scratch.h). Zero: kernels allocate outside any budget.
struct KernelScratch {
  i64 fixed_bytes = 0;
  i64 bytes_per_token = 0;
  i64 bytes(i64 T) const { return fixed_bytes + bytes_per_token * T; }
};

// Precision of activations: fp32 on the CPU backend; bf16 on GPUs, where LayerNorm
// statistics and the attention LSE stay fp32.
enum class ActPrecision { F32, BF16 };

// Note [Ulysses exchanges]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A Ulysses layer's attention runs four all-to-alls over its group, each one packed message
// a member pair (every field of a block one after another, in the order below; a field is
// the member's rows of a tensor in row order, or [heads, rows] of an fp32 statistic). From
// member f to member t, on a piece of T tokens, Tl_j = rows of member j, Z_j its heads, Q_j =
// Z_j A their width, KV_j its key/value heads' width, e the activations' bytes:
//   Heads     (forward, before the attention): f's rows of t's heads' q, k, v after RoPE:
//             Tl_f (Q_t + 2 KV_t) e. Every replica of a key/value head takes its rows.
//   Rows      (forward, after it): t's rows of f's heads' output and LSE:
//             Tl_t (Q_f e + 4 Z_f).
//   GradHeads (backward, before it): f's rows of t's heads' q and output gradient, LSE and
//             delta: Tl_f (2 Q_t e + 8 Z_t).
//   GradRows  (backward, after it): t's rows of f's heads' dq and, from the first replica of
//             each key/value head (the replicas sum their parts first), of its complete dK,
//             dV in fp32: Tl_t (Q_f e + 8 KV_f).
// The runtime packs exactly these (runtime/ulysses.cpp) and counts the bytes it sends to the
// other members; the simulator prices the same (sched::alltoall_bytes).
enum class UlyssesExchange { Heads, Rows, GradHeads, GradRows };
// Bytes member `from` sends member `to` (either may be the other) in exchange x.
i64 ulysses_block_bytes(const ModelConfig& c, i64 T, ActPrecision p, int from, int to, int size, UlyssesExchange x);
// What member u sends the other members in x, and what it sends and receives in all (with
// its own block, which stays).
i64 ulysses_sent_bytes(const ModelConfig& c, i64 T, ActPrecision p, const UlyssesShard& u, UlyssesExchange x);
i64 ulysses_send_total(const ModelConfig& c, i64 T, ActPrecision p, const UlyssesShard& u, UlyssesExchange x);
i64 ulysses_recv_total(const ModelConfig& c, i64 T, ActPrecision p, const UlyssesShard& u, UlyssesExchange x);

// What one block saves for backward on T tokens (names without the "blocks.{l}." prefix).
std::vector<TensorSpec> block_saved_specs(const ModelConfig& c, i64 T, ActPrecision p);
// As tensor-parallel member tp holds them for a subsequence of T tokens: rows
// tp.rows(T) of the LayerNorm / residual tensors, every row of its heads' q, k, v,
// attention output and LSE and of its fc columns (the same names and order).
std::vector<TensorSpec> block_saved_specs(const ModelConfig& c, i64 T, ActPrecision p, const TpShard& tp);
// As Ulysses member u holds them for a piece of T tokens: every tensor of its rows
// u.rows(T) with every head, but k and v, the K/V cache, every row of its key/value heads.
std::vector<TensorSpec> block_saved_specs(const ModelConfig& c, i64 T, ActPrecision p, const UlyssesShard& u);
// What the LM head saves for a subsequence of T tokens (head_grad).
std::vector<TensorSpec> head_saved_specs(const ModelConfig& c, i64 T, ActPrecision p);
std::vector<TensorSpec> head_saved_specs(const ModelConfig& c, i64 T, ActPrecision p, const TpShard& tp);
std::vector<TensorSpec> head_saved_specs(const ModelConfig& c, i64 T, ActPrecision p, const UlyssesShard& u);
// As rank shard r holds them (the overload of its TpShard or UlyssesShard).
std::vector<TensorSpec> block_saved_specs(const ModelConfig& c, i64 T, ActPrecision p, const RankShard& r);
std::vector<TensorSpec> head_saved_specs(const ModelConfig& c, i64 T, ActPrecision p, const RankShard& r);
// Note [MLP tiles]: the MLP's intermediate is [T, F], F = 4H, the largest scratch of a
// layer on a long subsequence. With tiles of R rows, a block's forward runs gelu and the
// proj GEMM R rows at a time, and its backward the whole MLP half (gelu again, proj and
// fc backward; the weight gradients accumulate over the tiles), so the workspace's
// mlp_act is [min(T, R), F]. When backward recomputes fc_pre (Note [Recomputed tensors]),
// fc_pre is never whole either: forward and backward make each tile's rows of it from
// ln2_out into one more workspace buffer, fc_tile [min(T, R), F], and the recomputed
// tensors lose their [T, F] fc_pre. R = 0: no tiles, the whole subsequence at once. Row
// tiles change no result beyond fp32 rounding of the weight gradients' sums; they run
// without tensor parallelism.
struct MlpTiles {
  i64 rows = 0;                    // R; 0: off
  bool fc_pre_recomputed = false;  // fc_pre is made a tile at a time (fc_tile)
  bool on() const { return rows > 0; }
  i64 tile_rows(i64 T) const { return on() && rows < T ? rows : T; }
};

// Scratch one block needs while it runs forward or backward on T tokens (freed after).
std::vector<TensorSpec> block_workspace_specs(const ModelConfig& c, i64 T, ActPrecision p);
// qkv is [T, max(Z A + 2 G A, H)] and d_tmp [T, max(H, Z A)] (of this member's heads).
// Under tensor parallelism two more: "tp_full" [T, H], a gathered input or a partial sum
// before its reduce-scatter, and "tp_pad" [tp.padded_rows(T), H], the collectives' buffer.
// With MLP tiles, mlp_act has tiles.tile_rows(T) rows and, when fc_pre is recomputed,
// "fc_tile" of as many rows follows delta.
std::vector<TensorSpec> block_workspace_specs(const ModelConfig& c, i64 T, ActPrecision p, const TpShard& tp,
                                              const MlpTiles& tiles = {});
// Ulysses member u on a piece of T tokens: the block's workspace on its rows, and the
// all-to-alls' buffers (Note [Ulysses buffers] in core/layout.cpp): its rows' K, V before they
// go, their dK, dV back; the piece's rows of its heads' queries, outputs (their gradients in
// backward), LSE, delta and dq; and one send and one receive buffer the exchanges pack into.
std::vector<TensorSpec> block_workspace_specs(const ModelConfig& c, i64 T, ActPrecision p, const UlyssesShard& u,
                                              const MlpTiles& tiles = {});
// Scratch of the head: logits are computed in row chunks of at most `chunk` tokens.
std::vector<TensorSpec> head_workspace_specs(const ModelConfig& c, i64 T, i64 chunk, ActPrecision p);
// Under tensor parallelism: ln_f_out of this member's rows, logits of its vocabulary
// columns, and "tp_full" [T, H], "tp_pad" [tp.padded_rows(T), H], "lse_parts" [tp, chunk].
std::vector<TensorSpec> head_workspace_specs(const ModelConfig& c, i64 T, i64 chunk, ActPrecision p,
                                             const TpShard& tp);
// Ulysses member u: the head's workspace on its rows. And as rank shard r holds them.
std::vector<TensorSpec> head_workspace_specs(const ModelConfig& c, i64 T, i64 chunk, ActPrecision p,
                                             const UlyssesShard& u);
std::vector<TensorSpec> head_workspace_specs(const ModelConfig& c, i64 T, i64 chunk, ActPrecision p,
                                             const RankShard& r);
std::vector<TensorSpec> block_workspace_specs(const ModelConfig& c, i64 T, ActPrecision p, const RankShard& r,
                                              const MlpTiles& tiles = {});

// Which tensors an offload of `fraction` moves, from the ordered sizes of a subsequence's
// offloadable tensors (layers in order, each layer's in table order, head_grad last):
// walking the list, a tensor is taken while the bytes taken stay within half of it of
// fraction * total. The runtime and the simulator both call this, so a predicted offload
// moves exactly the bytes a real one does. Returns the bytes taken; `take` may be null.
i64 select_offload(const std::vector<i64>& sizes, double fraction, std::vector<bool>* take);

// A host-resident K/V cache (Schedule::kv_host, runtime/kv_stream.h) streams the earlier
// blocks' rows to the attention of T query rows in chunks of kv_chunk_rows(T) consecutive
// positions (the last one shorter).
//
// Note [Chunks of at least 1024 rows]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every chunk costs its kernel calls a fixed part besides its FLOPs (the profile's
// attention_chunk), and short subsequences at long offsets stream thousands of chunks.
// With 256 rows at least, the chunk cost alone moved the simulated step at `sppo bench
// memory`'s longest length (176-token subsequences at 90K) from 392 s to 478 s between the
// two states of a CPU whose two cores at times share a cache and at times do not (a chunk
// call on both 22 us over its FLOPs, or 82). 1024 rows call a quarter as often for a
// window of 1024 rows of K, V (and sums) a layer: the measured step there fell about 10%,
// and the two states simulate it within 11% of each other (chunk costs 13 and 118 us).
inline constexpr i64 kKvChunkMinRows = 1024;
inline i64 kv_chunk_rows(i64 T) { return T > kKvChunkMinRows ? T : kKvChunkMinRows; }
// Slots of a streamed layer's window for the gradient sums in backward: three, where the
// K/V rotate over two (Note [A third slot in backward] in runtime/kv_stream.cpp).
inline int kv_window_sum_slots(bool backward) { return backward ? 3 : 0; }
// Device bytes of its window for `chunks` chunks, the largest of `largest` rows: two slots
// (one for a single chunk) of K, V in the activation type and, in backward,
// kv_window_sum_slots (fewer for fewer chunks) of their dK, dV sums in fp32; in forward a
// partial output [T, width] and LSE [heads, T] fp32 too. A layer that recomputes K/V
// (`recompute_hidden` = H, the width of its input x) adds to each slot the chunk's rows of x
// and, in backward, fresh dK, dV, and its sums are the d(LayerNorm-1 output) [largest, H]
// fp32 instead (Note [dK/dV into the layer input] in runtime/kv_stream.h); once, the
// LayerNorm of a chunk: its output [largest, H] and its mean and rstd [largest] fp32. In
// backward, a layer that recomputes K/V with key norms (`k_norm_heads` = G, Note
// [Query/key norms] in model/gpt.h) adds to each slot the chunk's keys before their norm
// [largest, width] and the norm's statistics [largest, G] fp32. Zero without an earlier
// block.
i64 kv_window_bytes(i64 chunks, i64 largest, i64 T, i64 width, int heads, int act_bytes, bool backward,
                    i64 recompute_hidden = 0, int k_norm_heads = 0);

// Note [Recomputed tensors]: a block's saved tensors (block_saved_specs) are kept on the
// device, offloaded (a fraction alpha of the unit), or recomputed in backward. Recomputing
// runs again the forward step that produced a tensor, from tensors kept (or recomputed
// before it), at the start of the layer's backward; the step writes all its outputs, so
// they are recomputed together, as one group:
//   ln1        ln1_mean, ln1_rstd, ln1_out   LayerNorm of x                 elementwise
//   q          q                             x's queries: LN1 output x W_q, RoPE   2 T H Z A
//              (with query/key norms:        and the keys' W_k and norm          + 2 T H G A
//              q_pre, q_rstd, k_pre, k_rstd) (not RoPE: k is the K/V cache's)
//   attention  attn_out, lse                 the attention again           4 T Z A (o + T/2)
//   x_mid      x_mid                         x + attn_out W_out             2 T H Z A
//   ln2        ln2_mean, ln2_rstd, ln2_out   LayerNorm of x_mid             elementwise
//   fc_pre     fc_pre                        LN2 output x W_fc              2 T H F
//   head_grad  (the last stage's)            the last block's output again  2 T H F
//              d(final hidden): the loss     and the LM head (moved from the
//              gradient                      forward, not repeated)
// x, the block's input, is never recomputed (it is the previous block's output). k and v
// are the K/V cache, placed per layer by Schedule::kv_place (device, host, or recomputed
// from x when a later subsequence or the backward needs them). On a layer whose K/V stream
// (host or recomputed), the attention recomputed runs its forward through a window of its
// own before the backward's: the earlier blocks stream in twice (K/V recomputed: made twice).
// A set of a block's saved tensors: bit k is block_saved_specs()[k].
using SavedSet = std::uint32_t;
inline constexpr int kBlockSavedTensors = 18;  // the most a block saves
inline constexpr int kSavedX = 0, kSavedK = 5, kSavedV = 6, kSavedFcPre = 13;
// q_pre, q_rstd, k_pre, k_rstd, the last four: saved by a model with query/key norms alone
// (Note [Query/key norms] in model/gpt.h); the table of one without them ends before them.
inline constexpr int kSavedQPre = 14;
inline constexpr SavedSet kQkNormTensors = 1u << 14 | 1u << 15 | 1u << 16 | 1u << 17;
// The entries of block_saved_specs(c, ...).
inline int block_saved_count(const ModelConfig& c) { return c.qk_norm ? kBlockSavedTensors : kSavedQPre; }
// Note [The loss in backward]: head_grad, the loss's gradient at the last block's output,
// is saved by the stage that runs the LM head (head_saved_specs), from that subsequence's
// forward to its backward: H values a token. Recomputing it (bit kSavedHeadGrad of a set,
// beside the block's tensors) moves the head from the forward to the backward: the
// backward of the last block first makes that block's output again from x_mid and fc_pre
// (kept or recomputed: one GEMM, proj), then runs the head (the loss and its gradient, the
// head's weight gradients) as the forward would have. The same kernels on the same
// inputs, so the loss and every gradient are those of the head in the forward, bit for
// bit. A ring member runs it on its own rows, a tensor-parallel member with the group's
// collectives as the forward's head does; not for MSP's pieces, which run on borrowed
// weights.
inline constexpr int kSavedHeadGrad = kBlockSavedTensors;
// Two groups of recompute_groups() that some layouts cannot recompute, by name.
inline constexpr SavedSet kAttentionGroup = 1u << 7 | 1u << 8;     // attn_out, lse
inline constexpr SavedSet kHeadGradGroup = 1u << kSavedHeadGrad;  // Note [The loss in backward]
inline constexpr bool in_set(SavedSet s, int k) { return (s >> k) & 1u; }
struct RecomputeGroup {
  const char* name;
  SavedSet tensors;
};
// The groups above, in forward order.
const std::vector<RecomputeGroup>& recompute_groups();
// Every tensor of a group one of `s`'s tensors belongs to.
SavedSet recompute_closure(SavedSet s);
// A comma-separated list of tensor or group names ("fc_pre,ln1_out", "ln1,ln2"; "none" or
// "" for none; "all" for every group of the block, not head_grad) as a closed set. Throws
// sppo::Error naming the tensors that can be recomputed.
SavedSet parse_recompute_tensors(const std::string& list);
// The canonical text of a closed set: its groups' names in forward order, comma-separated
// ("none" when empty).
std::string recompute_tensors_text(SavedSet s);
// The nested sets the planner tries, cheapest seconds per byte saved first: none; the
// LayerNorm outputs (elementwise); with fc_pre (the largest, one GEMM); with q and x_mid;
// with head_grad (a GEMM of the last layer, H a token of the last stage); with the
// attention (everything but x, k, v).
const std::vector<SavedSet>& recompute_levels();

// Convenience sums.
i64 skeletal_bytes_per_token(const ModelConfig& c, ActPrecision p);     // per block
i64 offloadable_bytes_per_token(const ModelConfig& c, ActPrecision p);  // per block

}  // namespace sppo
