#include "model/tensor_parallel.h"

#include <algorithm>

#include "core/check.h"

namespace sppo {

namespace {

// RoPE on the q and k columns of qkv [T, 3Hr], at the subsequence's positions.
void rope_qk(Backend& be, void* qkv, bool backward, const ModelConfig& ac, const Subseq& q) {
  const DType a = be.act();
  const int Hr = ac.q_width();
  for (const PosSpan& part : q.parts()) {
    void* rows = act_at(qkv, i64(part.row0) * 3 * Hr, a);
    for (void* x : {rows, act_at(rows, Hr, a)}) {
      if (backward)
        be.rope_backward(x, part.rows, ac.heads, ac.head_size(), part.pos0, rope_table(ac), 3 * Hr);
      else
        be.rope_forward(x, part.rows, ac.heads, ac.head_size(), part.pos0, rope_table(ac), 3 * Hr);
    }
  }
}

// The MLP's activation of the member's Fr columns: gelu(fc_pre) [T, Fr], or
// swiglu(gate | up) from fc_pre [T, 2Fr] (its gate columns, then its up columns).
void mlp_act_tp(Backend& be, const ModelConfig& c, void* out, const void* fc_pre, int T, int Fr) {
  if (c.gated()) be.swiglu_forward(out, fc_pre, T, Fr);
  else be.gelu_forward(out, fc_pre, i64(T) * Fr);
}

}  // namespace

namespace {

// forward_steps of model/gpt.cpp as a member of the group: the steps that make the tensors
// of `groups` and, when `kv`, the member's own k and v.
void forward_steps_tp(Backend& be, BlockSaved& s, SavedSet groups, bool kv, const BlockParams& p,
                      const BlockMatrices& m, const BlockWorkspace& w, BlockAttention* attn, TpCollectives& tpc,
                      const ModelConfig& c, const Subseq& q) {
  const TpShard& tp = tpc.shard();
  const ModelConfig ac = attention_view(c, tp);
  // The member's q/k/v projection makes Qr = Hr + 2 KVr columns: the q of its heads, then
  // the k and v of its key/value heads (KVr = Hr without grouped-query attention).
  const int T = q.T, H = c.hidden, Hr = ac.q_width(), KVr = ac.kv_width(), Qr = ac.qkv_width();
  const int Wr = tp.local_fc_width(c), Ts = int(tp.row_count(T));
  const bool adds_bias = tp.index == 0;  // row-parallel biases enter the sum once
  const DType a = be.act();
  const auto& g = recompute_groups();
  auto has = [&](int k) { return (groups & g[std::size_t(k)].tensors) != 0; };
  SPPO_ASSERT(w.tp_full && w.tp_pad);
  // Attention half: x_mid = x + reduce_scatter(out(attn(rope(qkv(all_gather(LN1(x)))))))
  if (has(0)) norm_forward(be, c, s.ln1_out, s.ln1_mean, s.ln1_rstd, s.x, p.ln1_w, p.ln1_b, Ts);
  const bool want_q = has(1);
  if (want_q || kv) tpc.all_gather(be, w.tp_full, s.ln1_out, w.tp_pad, T, H);
  if (c.qk_norm) {  // Note [Query/key norms] (model/gpt.h), on the member's heads
    qk_norm_forward(be, s, want_q, kv, p, m, w, w.tp_full, H, ac, q);
  } else if (want_q || kv) {
    // Both, or one of the two: the q rows of the projection, or the k and v rows, into their columns.
    const i64 first = want_q ? 0 : Hr;
    const int outs = want_q && kv ? Qr : want_q ? Hr : 2 * KVr;
    be.linear_forward(act_at(w.qkv, first, a), w.tp_full, act_at(m.qkv_w, first * H, a), bias_at(m.qkv_b, first, a),
                      T, H, outs, Qr, 0);
    const RopeTable rope = rope_table(ac);
    for (const PosSpan& part : q.parts()) {
      void* rows = act_at(w.qkv, i64(part.row0) * Qr, a);
      if (want_q) be.rope_forward(rows, part.rows, ac.heads, ac.head_size(), part.pos0, rope, Qr);
      if (kv)
        be.rope_forward(act_at(rows, Hr, a), part.rows, ac.kv_head_count(), ac.head_size(), part.pos0, rope, Qr);
    }
    if (want_q) be.copy_cols(s.q, w.qkv, T, Hr, Qr, 0);
    if (kv) {
      be.copy_cols(s.k, w.qkv, T, KVr, Qr, Hr);
      be.copy_cols(s.v, w.qkv, T, KVr, Qr, Hr + KVr);
    }
  }
  if (has(2)) {
    SPPO_ASSERT(attn);
    attn->forward(be, s, ac, q, w.scratch);
  }
  if (has(3)) {
    be.linear_forward(w.tp_full, s.attn_out, m.out_w, adds_bias ? m.out_b : nullptr, T, Hr, H, 0, 0);
    tpc.reduce_scatter(be, s.x_mid, w.tp_full, w.tp_pad, T, H);
  }
  // The residual add and LN2 on this member's rows, then the MLP half up to its
  // pre-activation: fc_pre = fc(all_gather(LN2(x_mid)))
  mid_residual_norm(be, c, s, p, has(3), has(4), Ts);
  if (has(5)) {
    tpc.all_gather(be, w.tp_full, s.ln2_out, w.tp_pad, T, H);
    be.linear_forward(s.fc_pre, w.tp_full, m.fc_w, m.fc_b, T, H, Wr, 0, 0);
  }
}

}  // namespace

void block_forward_tp(Backend& be, void* x_out, BlockSaved& s, const BlockParams& p, const BlockMatrices& m,
                      const BlockWorkspace& w, BlockAttention& attn, TpCollectives& tpc, const ModelConfig& c,
                      const Subseq& q) {
  SavedSet all = 0;
  for (const RecomputeGroup& g : recompute_groups()) all |= g.tensors;
  forward_steps_tp(be, s, all, true, p, m, w, &attn, tpc, c, q);
  block_output_tp(be, x_out, s, m, w, tpc, c, q.T);
}

void block_output_tp(Backend& be, void* x_out, const BlockSaved& s, const BlockMatrices& m, const BlockWorkspace& w,
                     TpCollectives& tpc, const ModelConfig& c, int T) {
  const TpShard& tp = tpc.shard();
  const int H = c.hidden;
  const auto [f0, f1] = tp.ffn(c);
  const int Fr = int(f1 - f0), Ts = int(tp.row_count(T));
  // x_out = x_mid + reduce_scatter(proj(gelu(fc_pre))), or proj(swiglu(fc_pre))
  mlp_act_tp(be, c, w.mlp_act, s.fc_pre, T, Fr);
  be.linear_forward(w.tp_full, w.mlp_act, m.proj_w, tp.index == 0 ? m.proj_b : nullptr, T, Fr, H, 0, 0);
  tpc.reduce_scatter(be, x_out, w.tp_full, w.tp_pad, T, H);
  be.add_inplace(x_out, s.x_mid, i64(Ts) * H);
}

void block_recompute_tp(Backend& be, BlockSaved& s, SavedSet groups, bool kv, const BlockParams& p,
                        const BlockMatrices& m, const BlockWorkspace& w, BlockAttention* attn, TpCollectives& tpc,
                        const ModelConfig& c, const Subseq& q) {
  forward_steps_tp(be, s, groups, kv, p, m, w, attn, tpc, c, q);
}

void block_backward_tp(Backend& be, void* d, BlockParams& g, float* dk_self, float* dv_self, const BlockSaved& s,
                       const BlockParams& p, const BlockMatrices& m, const BlockWorkspace& w, BlockAttention& attn,
                       TpCollectives& tpc, const ModelConfig& c, const Subseq& q) {
  const TpShard& tp = tpc.shard();
  const ModelConfig ac = attention_view(c, tp);
  const int T = q.T, H = c.hidden, Hr = ac.q_width(), KVr = ac.kv_width();
  const auto [f0, f1] = tp.ffn(c);
  const int Fr = int(f1 - f0), Wr = tp.local_fc_width(c), Ts = int(tp.row_count(T));
  const DType a = be.act();
  SPPO_ASSERT(w.tp_full && w.tp_pad && w.tp_rows);
  // MLP half. d [Ts, H] is the gradient w.r.t. x_out; every row of it reaches proj.
  tpc.all_gather(be, w.tp_full, d, w.tp_pad, T, H);                // d x_out, all rows
  mlp_act_tp(be, c, w.mlp_act, s.fc_pre, T, Fr);                 // recomputed
  be.linear_backward(nullptr, g.proj_w, g.proj_b, w.tp_full, w.mlp_act, m.proj_w, T, Fr, H, 0, 0, w.scratch);
  // d mlp_act [T, Fr] (row stride Wr), then d fc_pre [T, Wr] in place (SwiGLU's d gate | d up
  // from d act in the gate columns)
  be.gemm(false, false, T, Fr, H, 1.0f, w.tp_full, H, m.proj_w, Fr, 0.0f, w.mlp_act, Wr, a, a);
  if (c.gated()) be.swiglu_backward(w.mlp_act, s.fc_pre, T, Fr);
  else be.gelu_backward(w.mlp_act, w.mlp_act, s.fc_pre, i64(T) * Fr);
  tpc.all_gather(be, w.tp_full, s.ln2_out, w.tp_pad, T, H);
  be.linear_backward(w.d_tmp, g.fc_w, g.fc_b, w.mlp_act, w.tp_full, m.fc_w, T, H, Wr, 0, 0, w.scratch);
  tpc.reduce_scatter(be, w.tp_rows, w.d_tmp, w.tp_pad, T, H);     // d ln2_out, this member's rows
  norm_backward(be, c, d, g.ln2_w, g.ln2_b, w.tp_rows, s.x_mid, p.ln2_w, s.ln2_mean, s.ln2_rstd, Ts, w.scratch);
  // Attention half. d is now the gradient w.r.t. x_mid.
  tpc.all_gather(be, w.tp_full, d, w.tp_pad, T, H);
  be.linear_backward(w.d_tmp, g.out_w, g.out_b, w.tp_full, s.attn_out, m.out_w, T, Hr, H, 0, 0, w.scratch);
  for (const PosSpan& part : q.parts()) {
    const i64 at = i64(part.row0) * Hr;
    be.attention_backward_delta(w.delta + i64(ac.heads) * part.row0, act_at(w.d_tmp, at, a),
                                act_at(s.attn_out, at, a), span_shape(ac, part));
  }
  void* dqkv = w.qkv;  // [T, Qr]
  attn.backward(be, dqkv, w.d_tmp, w.delta, s, dk_self, dv_self, ac, q, w.scratch);
  if (c.qk_norm) {
    tpc.all_gather(be, w.tp_full, s.ln1_out, w.tp_pad, T, H);
    qk_norm_backward(be, g, dk_self, dv_self, s, p, m, w, w.tp_full, H, ac, q);
  } else if (c.llama()) {
    // Planar, as model/gpt.cpp's qkv_backward_planar: the attention wrote dq dense [T, Hr];
    // this subsequence's complete dK | dV [T, 2 KVr] follow it.
    void* dq = dqkv;
    void* dkv = act_at(dqkv, i64(T) * Hr, a);
    be.put_cols(dkv, dk_self, true, T, KVr, 2 * KVr, 0);
    be.put_cols(dkv, dv_self, true, T, KVr, 2 * KVr, KVr);
    const RopeTable rope = rope_table(ac);
    for (const PosSpan& part : q.parts()) {
      be.rope_backward(act_at(dq, i64(part.row0) * Hr, a), part.rows, ac.heads, ac.head_size(), part.pos0, rope, Hr);
      be.rope_backward(act_at(dkv, i64(part.row0) * 2 * KVr, a), part.rows, ac.kv_head_count(), ac.head_size(),
                       part.pos0, rope, 2 * KVr);
    }
    tpc.all_gather(be, w.tp_full, s.ln1_out, w.tp_pad, T, H);
    const i64 kv_rows = i64(Hr) * H;  // where the k rows start in the member's weight
    be.linear_backward(w.d_tmp, g.qkv_w, g.qkv_b, dq, w.tp_full, m.qkv_w, T, H, Hr, 0, 0, w.scratch);
    be.linear_backward(nullptr, g.qkv_w + kv_rows, g.qkv_b ? g.qkv_b + Hr : nullptr, dkv, w.tp_full,
                       act_at(m.qkv_w, kv_rows, a), T, H, 2 * KVr, 0, 0, w.scratch);
    be.gemm(false, false, T, H, 2 * KVr, 1.0f, dkv, 2 * KVr, act_at(m.qkv_w, kv_rows, a), H, 1.0f, w.d_tmp, H, a, a);
  } else {
    be.put_cols(dqkv, dk_self, true, T, Hr, 3 * Hr, Hr);
    be.put_cols(dqkv, dv_self, true, T, Hr, 3 * Hr, 2 * Hr);
    rope_qk(be, dqkv, true, ac, q);
    tpc.all_gather(be, w.tp_full, s.ln1_out, w.tp_pad, T, H);
    be.linear_backward(w.d_tmp, g.qkv_w, g.qkv_b, dqkv, w.tp_full, m.qkv_w, T, H, 3 * Hr, 0, 0, w.scratch);
  }
  tpc.reduce_scatter(be, w.tp_rows, w.d_tmp, w.tp_pad, T, H);     // d ln1_out, this member's rows
  norm_backward(be, c, d, g.ln1_w, g.ln1_b, w.tp_rows, s.x, p.ln1_w, s.ln1_mean, s.ln1_rstd, Ts, w.scratch);
}

void embedding_forward_tp(Backend& be, void* x_rows, const std::int32_t* ids, const float* embed, void* full, void* pad,
                          TpCollectives& tpc, const ModelConfig& c, const Subseq& q) {
  const auto [v0, v1] = tpc.shard().vocab(c);
  const i64 H = c.hidden;
  for (const PosSpan& part : q.parts())
    be.embedding_shard_forward(act_at(full, part.row0 * H, be.act()), ids + part.pos0, embed, part.rows, int(H),
                               int(v0), int(v1 - v0));
  tpc.reduce_scatter(be, x_rows, full, pad, q.T, int(H));
}

void embedding_backward_tp(Backend& be, float* dembed, const void* d_rows, const std::int32_t* ids, void* full,
                           void* pad, TpCollectives& tpc, const ModelConfig& c, const Subseq& q) {
  const auto [v0, v1] = tpc.shard().vocab(c);
  const i64 H = c.hidden;
  tpc.all_gather(be, full, d_rows, pad, q.T, int(H));
  for (const PosSpan& part : q.parts())
    be.embedding_shard_backward(dembed, act_at(full, part.row0 * H, be.act()), ids + part.pos0, part.rows, int(H),
                                int(v0), int(v1 - v0));
}

namespace {

// The most likely token of each of a chunk's `rows` rows over the whole vocabulary: each
// member's of its part (its largest logit and that token's id), taken from the logits
// before xent_shard overwrites them, then gathered through the log-sum-exp's buffer once
// xent_shard has read it; the largest wins, the lowest id among equals (as an argmax over
// the whole row would), on every member alike. On the host: an evaluation's, not a kernel's.
struct MostLikely {
  std::vector<float> best, id;  // [rows] this member's
};
MostLikely most_likely_here(Backend& be, const float* logits, const std::int32_t* targets, int rows, int V,
                            i64 v0) {
  MostLikely m{std::vector<float>(std::size_t(rows)), std::vector<float>(std::size_t(rows), -1.0f)};
  std::vector<float> row(static_cast<std::size_t>(V));
  for (int r = 0; r < rows; ++r) {
    if (targets[r] == kNoTarget) continue;  // nothing to score
    be.to_host(row.data(), logits + i64(r) * V, sizeof(float) * std::size_t(V));
    const i64 k = std::max_element(row.begin(), row.end()) - row.begin();
    m.best[std::size_t(r)] = row[std::size_t(k)];
    m.id[std::size_t(r)] = float(v0 + k);  // exact: vocabularies are far below 2^24
  }
  return m;
}
void score_most_likely(Backend& be, std::uint8_t* hits, const MostLikely& mine, const HeadWorkspace& w,
                       TpCollectives& tpc, const std::int32_t* targets, int rows) {
  const TpShard& tp = tpc.shard();
  std::vector<float> all_best(std::size_t(tp.size) * rows), all_id(all_best.size());
  for (auto [part, all] : {std::pair{&mine.best, &all_best}, std::pair{&mine.id, &all_id}}) {
    be.to_device(w.lse_parts + i64(tp.index) * rows, part->data(), sizeof(float) * std::size_t(rows));
    tpc.all_gather_rows(w.lse_parts, rows);
    be.to_host(all->data(), w.lse_parts, sizeof(float) * all->size());
  }
  for (int r = 0; r < rows; ++r) {
    int win = 0;
    for (int t = 1; t < tp.size; ++t)
      if (all_best[std::size_t(t) * rows + r] > all_best[std::size_t(win) * rows + r]) win = t;
    hits[r] = std::uint8_t(targets[r] != kNoTarget && targets[r] == std::int32_t(all_id[std::size_t(win) * rows + r]));
  }
}

}  // namespace

void head_forward_backward_tp(Backend& be, void* head_grad, double* loss_sum, const void* x,
                              const std::int32_t* targets, const ParamView& p, const MatrixView& m, ParamView& g,
                              const HeadWorkspace& w, TpCollectives& tpc, const ModelConfig& c, const Subseq& q,
                              i64 total_tokens, std::uint8_t* hits) {
  const TpShard& tp = tpc.shard();
  const int T = q.T, H = c.hidden, Ts = int(tp.row_count(T));
  const auto [v0, v1] = tp.vocab(c);
  const int V = int(v1 - v0);
  const DType a = be.act();
  SPPO_ASSERT(w.tp_full && w.tp_pad && w.lse_parts);
  SPPO_ASSERT(m.head && g.head);
  norm_forward(be, c, w.ln_f_out, w.ln_f_mean, w.ln_f_rstd, x, p.lnf_w, p.lnf_b, Ts);
  tpc.all_gather(be, w.tp_full, w.ln_f_out, w.tp_pad, T, H);
  const float scale = float(1.0 / double(total_tokens));
  // Every row's logits over this member's vocabulary, chunk by chunk; the rows' log-sum-exp
  // over the whole vocabulary joins the members' own. The chunk's gradient d ln_f_out
  // (a partial sum over the vocabulary) overwrites its gathered rows.
  for (const PosSpan& part : q.parts())
    for (int c0 = 0; c0 < part.rows; c0 += w.chunk) {
      const int rows = std::min(w.chunk, part.rows - c0), t0 = part.row0 + c0;
      void* h = act_at(w.tp_full, i64(t0) * H, a);
      be.gemm(false, true, rows, V, H, 1.0f, h, H, m.head, H, 0.0f, w.logits, V, a, DType::F32);
      const MostLikely mine =
          hits ? most_likely_here(be, w.logits, targets + part.pos0 + c0, rows, V, v0) : MostLikely{};
      be.row_logsumexp(w.lse_parts + i64(tp.index) * rows, w.logits, rows, V);
      tpc.all_gather_rows(w.lse_parts, rows);
      be.xent_shard(w.dlogits, w.losses + t0, loss_sum, w.logits, w.lse_parts, tp.size, targets + part.pos0 + c0, rows,
                    V, int(v0), scale, w.scratch);
      if (hits) score_most_likely(be, hits + part.pos0 + c0, mine, w, tpc, targets + part.pos0 + c0, rows);
      if (!head_grad) continue;  // the forward alone (an evaluation)
      be.gemm(true, false, V, H, rows, 1.0f, w.dlogits, V, h, H, 1.0f, g.head, H, a, DType::F32);
      be.gemm(false, false, rows, H, V, 1.0f, w.dlogits, V, m.head, H, 0.0f, h, H, a, a);
    }
  if (!head_grad) return;
  tpc.reduce_scatter(be, w.ln_f_out, w.tp_full, w.tp_pad, T, H);  // d ln_f_out, this member's rows
  be.fill_zero(head_grad, std::size_t(i64(Ts) * H * dtype_bytes(a)));
  norm_backward(be, c, head_grad, g.lnf_w, g.lnf_b, w.ln_f_out, x, p.lnf_w, w.ln_f_mean, w.ln_f_rstd, Ts,
                w.scratch);
}

}  // namespace sppo
