#include "model/gpt.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/check.h"
#include "core/layout.h"

namespace sppo {

ParamView param_view(const ModelConfig& c, float* base) { return param_view(c, base, 0, c.layers); }

ParamView param_view(const ModelConfig& c, float* base, int begin, int end) {
  return param_view(c, base, begin, end, TpShard{});
}

namespace {

// Calls put(slot, offset) for every parameter a stage (and TP member) holds, in
// parameter_specs order, offsets in elements; slot names the view's pointer. The one walk
// both views take, so they cannot disagree with the table.
enum class Slot {
  Embed, Ln1W, Ln1B, QkvW, QkvB, QNormW, KNormW, OutW, OutB, Ln2W, Ln2B, FcW, FcB, ProjW, ProjB, LnfW, LnfB, LmHead
};

template <typename Put>
void walk_parameters(const ModelConfig& c, int begin, int end, const TpShard& tp, Put put) {
  i64 off = 0;
  for (const TensorSpec& t : parameter_specs(c, begin, end, tp)) {
    const std::string& n = t.name;
    int layer = -1;
    std::string what = n;
    if (n.rfind("blocks.", 0) == 0) {
      const std::size_t after = n.find('.', 7);
      layer = std::stoi(n.substr(7, after - 7));
      what = n.substr(after + 1);
    }
    static const std::pair<const char*, Slot> kSlots[] = {
        {"embed.weight", Slot::Embed},      {"ln1.weight", Slot::Ln1W},        {"ln1.bias", Slot::Ln1B},
        {"attn.qkv.weight", Slot::QkvW},    {"attn.qkv.bias", Slot::QkvB},     {"attn.q_norm.weight", Slot::QNormW},
        {"attn.k_norm.weight", Slot::KNormW}, {"attn.out.weight", Slot::OutW},
        {"attn.out.bias", Slot::OutB},      {"ln2.weight", Slot::Ln2W},        {"ln2.bias", Slot::Ln2B},
        {"mlp.fc.weight", Slot::FcW},       {"mlp.fc.bias", Slot::FcB},        {"mlp.proj.weight", Slot::ProjW},
        {"mlp.proj.bias", Slot::ProjB},     {"ln_f.weight", Slot::LnfW},       {"ln_f.bias", Slot::LnfB},
        {"lm_head.weight", Slot::LmHead}};
    bool found = false;
    for (const auto& [name, slot] : kSlots)
      if (what == name) put(slot, layer, off), found = true;
    SPPO_ASSERT_MSG(found, "no view slot for parameter " << n);
    off += t.numel();
  }
}

}  // namespace

ParamView param_view(const ModelConfig& c, float* base, int begin, int end, const TpShard& tp) {
  ParamView v;
  v.blocks.resize(c.layers);
  walk_parameters(c, begin, end, tp, [&](Slot s, int l, i64 off) {
    float* p = base + off;
    BlockParams* b = l >= 0 ? &v.blocks[std::size_t(l)] : nullptr;
    switch (s) {
      case Slot::Embed: v.embed = p; break;
      case Slot::Ln1W: b->ln1_w = p; break;
      case Slot::Ln1B: b->ln1_b = p; break;
      case Slot::QkvW: b->qkv_w = p; break;
      case Slot::QkvB: b->qkv_b = p; break;
      case Slot::QNormW: b->q_norm_w = p; break;
      case Slot::KNormW: b->k_norm_w = p; break;
      case Slot::OutW: b->out_w = p; break;
      case Slot::OutB: b->out_b = p; break;
      case Slot::Ln2W: b->ln2_w = p; break;
      case Slot::Ln2B: b->ln2_b = p; break;
      case Slot::FcW: b->fc_w = p; break;
      case Slot::FcB: b->fc_b = p; break;
      case Slot::ProjW: b->proj_w = p; break;
      case Slot::ProjB: b->proj_b = p; break;
      case Slot::LnfW: v.lnf_w = p; break;
      case Slot::LnfB: v.lnf_b = p; break;
      case Slot::LmHead: v.head = p; break;
    }
  });
  if (c.tied_embeddings() && end == c.layers) v.head = v.embed;
  return v;
}

MatrixView matrix_view(const ModelConfig& c, const void* base, DType t, int begin, int end) {
  return matrix_view(c, base, t, begin, end, TpShard{});
}

MatrixView matrix_view(const ModelConfig& c, const void* base, DType t, int begin, int end, const TpShard& tp) {
  MatrixView m;
  m.blocks.resize(c.layers);
  walk_parameters(c, begin, end, tp, [&](Slot s, int l, i64 off) {
    const void* p = act_at(base, off, t);
    BlockMatrices* b = l >= 0 ? &m.blocks[std::size_t(l)] : nullptr;
    switch (s) {
      case Slot::Embed: m.embed = p; break;
      case Slot::QkvW: b->qkv_w = p; break;
      case Slot::QkvB: b->qkv_b = p; break;
      case Slot::OutW: b->out_w = p; break;
      case Slot::OutB: b->out_b = p; break;
      case Slot::FcW: b->fc_w = p; break;
      case Slot::FcB: b->fc_b = p; break;
      case Slot::ProjW: b->proj_w = p; break;
      case Slot::ProjB: b->proj_b = p; break;
      case Slot::LmHead: m.head = p; break;
      default: break;  // norms: fp32 masters only
    }
  });
  if (c.tied_embeddings() && end == c.layers) m.head = m.embed;
  return m;
}

BlockSaved block_saved_from(const std::vector<void*>& t) {
  SPPO_ASSERT(t.size() == kSavedQPre || t.size() == kBlockSavedTensors);
  auto f = [](void* p) { return static_cast<float*>(p); };
  BlockSaved s{t[0], f(t[1]), f(t[2]), t[3], t[4], t[5], t[6], t[7], f(t[8]), t[9], f(t[10]), f(t[11]), t[12], t[13],
               nullptr, nullptr, nullptr, nullptr};
  if (t.size() == kBlockSavedTensors) {  // Note [Query/key norms]
    s.q_pre = t[14];
    s.q_rstd = f(t[15]);
    s.k_pre = t[16];
    s.k_rstd = f(t[17]);
  }
  return s;
}

BlockWorkspace block_workspace_from(const std::vector<void*>& t, Workspace scratch, const MlpTiles& tiles) {
  const bool fc_tile = tiles.on() && tiles.fc_pre_recomputed;
  SPPO_ASSERT(t.size() == (fc_tile ? 5u : 4u) || (t.size() == 7 && !tiles.on()));
  BlockWorkspace w{t[0], t[1], t[2], static_cast<float*>(t[3]), scratch};
  w.mlp_rows = int(std::min<i64>(tiles.rows, std::numeric_limits<int>::max()));  // past T: one tile
  if (fc_tile) w.fc_tile = t[4];
  if (t.size() == 7) {
    w.tp_full = t[4];
    w.tp_pad = t[5];
    w.tp_rows = t[6];
  }
  return w;
}

HeadWorkspace head_workspace_from(const std::vector<void*>& t, int chunk, Workspace scratch, bool tp) {
  // fp32: five buffers, the gradient overwriting the logits; bf16: a sixth for dlogits;
  // tensor parallel: three more at the end.
  const std::size_t base = t.size() - (tp ? 3 : 0);
  SPPO_ASSERT(base == 5 || base == 6);
  auto f = [](void* p) { return static_cast<float*>(p); };
  HeadWorkspace w{t[0], f(t[1]), f(t[2]), f(t[3]), f(t[4]), base == 6 ? t[5] : t[3], chunk, scratch};
  if (tp) {
    w.tp_full = t[base];
    w.tp_pad = t[base + 1];
    w.lse_parts = f(t[base + 2]);
  }
  return w;
}

std::vector<PosSpan> Subseq::parts() const {
  std::vector<PosSpan> runs = spans.empty() ? std::vector<PosSpan>{{offset, T, 0}} : spans;
  if (!docs) return runs;
  std::vector<PosSpan> out;
  for (const PosSpan& r : runs) {
    PosSpan p = r;
    // Every document start inside the run cuts it.
    for (auto it = std::upper_bound(docs->begin(), docs->end(), r.pos0); it != docs->end() && *it < r.pos0 + r.rows;
         ++it) {
      const int head = int(*it - p.pos0);
      out.push_back({p.pos0, head, p.row0});
      p = {*it, p.rows - head, p.row0 + head};
    }
    out.push_back(p);
  }
  return out;
}

i64 Subseq::doc_start(i64 pos) const {
  if (!docs || docs->empty()) return 0;
  const auto it = std::upper_bound(docs->begin(), docs->end(), pos);
  return it == docs->begin() ? 0 : *(it - 1);
}

AttnShape span_shape(const ModelConfig& c, const PosSpan& p) {
  AttnShape d;
  d.Tq = p.rows;
  d.Z = c.heads;
  d.A = c.head_size();
  d.q_pos0 = c.causal ? p.pos0 : kAfterEveryKey;
  d.ldq = d.ldo = c.q_width();
  d.Zkv = c.kv_head_count();
  d.ldk = d.ldv = c.kv_width();
  return d;
}

std::vector<KVRef> attention_key_blocks(const KVBlocks& past, const void* k_self, const void* v_self, float* dk_self,
                                        float* dv_self, const Subseq& q, const PosSpan& queries, const ModelConfig& c,
                                        DType a) {
  std::vector<KVRef> blocks;
  blocks.reserve(past.k.size() + 2);
  const i64 H = c.kv_width();
  // Packed documents: keys before the queries' document are another document's; a block
  // that starts before it is cut to the rows from it.
  const i64 first = q.doc_start(queries.pos0);
  auto add = [&](const void* k, const void* v, float* dk, float* dv, i64 rows, i64 pos0) {
    const i64 skip = std::max<i64>(0, first - pos0);
    if (skip >= rows) return;
    const i64 at = skip * H;
    blocks.push_back({act_at(k, at, a), act_at(v, at, a), dk ? dk + at : nullptr, dv ? dv + at : nullptr,
                      int(rows - skip), pos0 + skip});
  };
  for (size_t j = 0; j < past.k.size(); ++j)
    if (past.offsets[j] <= last_seen(c, queries))  // (earlier subsequences' blocks always are)
      add(past.k[j], past.v[j], j < past.dk.size() ? past.dk[j] : nullptr, j < past.dv.size() ? past.dv[j] : nullptr,
          past.lengths[j], past.offsets[j]);
  for (const PosSpan& own : q.parts()) {
    if (own.pos0 > last_seen(c, queries)) continue;  // entirely after the queries
    const i64 at = i64(own.row0) * H;
    add(act_at(k_self, at, a), act_at(v_self, at, a), dk_self ? dk_self + at : nullptr,
        dv_self ? dv_self + at : nullptr, own.rows, own.pos0);
  }
  return blocks;
}

void LocalAttention::forward(Backend& be, BlockSaved& s, const ModelConfig& c, const Subseq& q,
                             const Workspace& scratch) {
  const DType a = be.act();
  const i64 QW = c.q_width();
  // Every earlier block and the diagonal one in one call per span: one online softmax, no merge.
  for (const PosSpan& part : q.parts()) {
    const i64 at = i64(part.row0) * QW;
    be.attention_forward(act_at(s.attn_out, at, a), s.lse + i64(c.heads) * part.row0, act_at(s.q, at, a),
                         attention_key_blocks(past_, s.k, s.v, nullptr, nullptr, q, part, c, a), span_shape(c, part), scratch);
  }
}

void LocalAttention::backward(Backend& be, void* dqkv, const void* dout, const float* delta, const BlockSaved& s,
                              float* dk_self, float* dv_self, const ModelConfig& c, const Subseq& q,
                              const Workspace& scratch) {
  const DType a = be.act();
  const int T = q.T, H = c.hidden;
  if (c.llama()) {  // dq dense [T, Z A] (block_backward's planar dqkv): q read in place
    const i64 QW = c.q_width();
    be.fill_zero(dqkv, std::size_t(i64(T) * QW * dtype_bytes(a)));
    for (const PosSpan& part : q.parts()) {
      const i64 at = i64(part.row0) * QW, z0 = i64(c.heads) * part.row0;
      be.attention_backward(act_at(dqkv, at, a), act_at(dout, at, a), act_at(s.q, at, a),
                            attention_key_blocks(past_, s.k, s.v, dk_self, dv_self, q, part, c, a), s.lse + z0, delta + z0,
                            span_shape(c, part), scratch);
    }
    return;
  }
  be.zero_cols(dqkv, T, H, 3 * H, 0);
  // Queries read from s.q (stride H); dq written with stride 3H: the kernel takes one ldq
  // for both, so run with q copied into the dq columns' layout.
  void* q3 = act_at(dqkv, H, a);  // columns H..2H-1 are free until dk is written
  be.put_cols(q3, s.q, false, T, H, 3 * H, 0);
  for (const PosSpan& part : q.parts()) {
    AttnShape d = span_shape(c, part);
    d.ldq = 3 * H;
    const i64 row3 = i64(part.row0) * 3 * H, z0 = i64(c.heads) * part.row0;
    be.attention_backward(act_at(dqkv, row3, a), act_at(dout, i64(part.row0) * H, a), act_at(q3, row3, a),
                          attention_key_blocks(past_, s.k, s.v, dk_self, dv_self, q, part, c, a), s.lse + z0, delta + z0, d,
                          scratch);
  }
}

void block_forward(Backend& be, void* x_out, BlockSaved& s, const BlockParams& p, const BlockMatrices& m,
                   const BlockWorkspace& w, const KVBlocks& past, const ModelConfig& c, const Subseq& q) {
  LocalAttention attn(past);
  block_forward(be, x_out, s, p, m, w, attn, c, q);
}

void norm_forward(Backend& be, const ModelConfig& c, void* out, float* mean, float* rstd, const void* x,
                  const float* w, const float* b, int T) {
  if (c.llama()) be.rmsnorm_forward(out, rstd, x, w, T, c.hidden, c.ln_eps);
  else be.layernorm_forward(out, mean, rstd, x, w, b, T, c.hidden, c.ln_eps);
}

void norm_backward(Backend& be, const ModelConfig& c, void* dx, float* dw, float* db, const void* dout,
                   const void* x, const float* w, const float* mean, const float* rstd, int T, const Workspace& ws) {
  if (c.llama()) be.rmsnorm_backward(dx, dw, dout, x, w, rstd, T, c.hidden, ws);
  else be.layernorm_backward(dx, dw, db, dout, x, w, mean, rstd, T, c.hidden, ws);
}

void mid_residual_norm(Backend& be, const ModelConfig& c, BlockSaved& s, const BlockParams& p, bool add, bool norm,
                       int T) {
  if (add && norm)
    be.add_norm_forward(s.x_mid, s.x, s.ln2_out, s.ln2_mean, s.ln2_rstd, p.ln2_w, p.ln2_b, T, c.hidden, c.ln_eps,
                        c.llama());
  else if (add)
    be.add_inplace(s.x_mid, s.x, i64(T) * c.hidden);
  else if (norm)
    norm_forward(be, c, s.ln2_out, s.ln2_mean, s.ln2_rstd, s.x_mid, p.ln2_w, p.ln2_b, T);
}

void mlp_act_forward(Backend& be, const ModelConfig& c, void* out, const void* fc_pre, int rows) {
  if (c.gated()) be.swiglu_forward(out, fc_pre, rows, c.ffn());
  else be.gelu_forward(out, fc_pre, i64(rows) * c.ffn());
}

namespace {

// The q/k/v projection's backward from a planar dqkv (w.qkv): dq dense [T, Z A] as the
// attention wrote it, then this subsequence's complete dK | dV [T, 2 G A] after it, so that
// grouped-query attention's narrower K/V need no [T, 2H] of room beside dq. d(LN1 output)
// lands in w.d_tmp.
void qkv_backward_planar(Backend& be, BlockParams& g, const float* dk_self, const float* dv_self,
                         const BlockSaved& s, const BlockMatrices& m, const BlockWorkspace& w, const ModelConfig& c,
                         const Subseq& q, const RopeTable& rope) {
  const DType a = be.act();
  const int T = q.T, H = c.hidden, KV = c.kv_width(), QW = c.q_width();
  void* dq = w.qkv;
  void* dkv = act_at(w.qkv, i64(T) * QW, a);
  be.put_cols(dkv, dk_self, true, T, KV, 2 * KV, 0);
  be.put_cols(dkv, dv_self, true, T, KV, 2 * KV, KV);
  for (const PosSpan& part : q.parts()) {
    be.rope_backward(act_at(dq, i64(part.row0) * QW, a), part.rows, c.heads, c.head_size(), q.rope_pos(part), rope,
                     QW);
    be.rope_backward(act_at(dkv, i64(part.row0) * 2 * KV, a), part.rows, c.kv_head_count(), c.head_size(),
                     q.rope_pos(part), rope, 2 * KV);
  }
  const i64 kv_rows = i64(QW) * H;  // where the k rows start in the weight, and the bias
  be.linear_backward(w.d_tmp, g.qkv_w, g.qkv_b, dq, s.ln1_out, m.qkv_w, T, H, QW, 0, 0, w.scratch);
  be.linear_backward(nullptr, g.qkv_w + kv_rows, g.qkv_b ? g.qkv_b + QW : nullptr, dkv, s.ln1_out,
                     act_at(m.qkv_w, kv_rows, a), T, H, 2 * KV, 0, 0, w.scratch);
  be.gemm(false, false, T, H, 2 * KV, 1.0f, dkv, 2 * KV, act_at(m.qkv_w, kv_rows, a), H, 1.0f, w.d_tmp, H, a, a);
}

// The forward steps of Note [Recomputed tensors] (core/layout.h) that make the tensors of
// `groups` and, when `kv`, this subsequence's own k and v, in forward order, each from
// what earlier steps wrote or what s keeps. block_forward runs every one of them.
void forward_steps(Backend& be, BlockSaved& s, SavedSet groups, bool kv, const BlockParams& p, const BlockMatrices& m,
                   const BlockWorkspace& w, BlockAttention* attn, const ModelConfig& c, const Subseq& q) {
  const int T = q.T, H = c.hidden, KV = c.kv_width(), Q = c.qkv_width(), W = c.fc_width(), QW = c.q_width();
  const DType a = be.act();
  const auto& g = recompute_groups();
  auto has = [&](int k) { return (groups & g[std::size_t(k)].tensors) != 0; };
  // Attention half: x_mid = x + out(attn(rope(qkv(LN1(x)))))
  if (has(0)) norm_forward(be, c, s.ln1_out, s.ln1_mean, s.ln1_rstd, s.x, p.ln1_w, p.ln1_b, T);
  const bool want_q = has(1);
  if (c.qk_norm) {
    qk_norm_forward(be, s, want_q, kv, p, m, w, s.ln1_out, H, c, q);
  } else {
    if (want_q && kv) {
      be.linear_forward(w.qkv, s.ln1_out, m.qkv_w, m.qkv_b, T, H, Q, 0, 0);
    } else if (want_q) {  // the q rows of the projection
      be.linear_forward(w.qkv, s.ln1_out, m.qkv_w, m.qkv_b, T, H, QW, Q, 0);
    } else if (kv) {      // the k and v rows
      be.linear_forward(act_at(w.qkv, QW, a), s.ln1_out, act_at(m.qkv_w, i64(QW) * H, a), bias_at(m.qkv_b, QW, a),
                        T, H, 2 * KV, Q, 0);
    }
    const RopeTable rope = rope_table(c);
    for (const PosSpan& part : q.parts()) {
      void* rows = act_at(w.qkv, i64(part.row0) * Q, a);
      if (want_q) be.rope_forward(rows, part.rows, c.heads, c.head_size(), q.rope_pos(part), rope, Q);
      if (kv)
        be.rope_forward(act_at(rows, QW, a), part.rows, c.kv_head_count(), c.head_size(), q.rope_pos(part), rope, Q);
    }
    if (want_q) be.copy_cols(s.q, w.qkv, T, QW, Q, 0);
    if (kv) {
      be.copy_cols(s.k, w.qkv, T, KV, Q, QW);
      be.copy_cols(s.v, w.qkv, T, KV, Q, QW + KV);
    }
  }
  if (has(2)) {
    SPPO_ASSERT(attn);
    attn->forward(be, s, c, q, w.scratch);
  }
  if (has(3)) be.linear_forward(s.x_mid, s.attn_out, m.out_w, m.out_b, T, QW, H, 0, 0);
  // The residual add, LN2, then the MLP half up to its pre-activation: fc_pre =
  // fc(LN2(x_mid)), unless the MLP's tiles make it (a null s.fc_pre)
  mid_residual_norm(be, c, s, p, has(3), has(4), T);
  if (has(5) && s.fc_pre) be.linear_forward(s.fc_pre, s.ln2_out, m.fc_w, m.fc_b, T, H, W, 0, 0);
}

// Note [MLP tiles] (core/layout.h): rows [t0, t0 + rows) of the MLP at a time. Without
// tiles, one tile of all T rows: the calls of an untiled block.
template <typename Body>
void for_mlp_tiles(const BlockWorkspace& w, int T, Body body) {
  const int R = w.mlp_rows > 0 && w.mlp_rows < T ? w.mlp_rows : T;
  for (int t0 = 0; t0 < T; t0 += R) body(t0, std::min(R, T - t0));
}

// The tile's rows of fc_pre: those of s.fc_pre, or made into w.fc_tile from ln2_out.
const void* fc_pre_rows(Backend& be, const BlockSaved& s, const BlockMatrices& m, const BlockWorkspace& w,
                        const ModelConfig& c, int t0, int rows) {
  const DType a = be.act();
  const int H = c.hidden, W = c.fc_width();
  if (s.fc_pre) return act_at(s.fc_pre, i64(t0) * W, a);
  SPPO_ASSERT(w.fc_tile);
  be.linear_forward(w.fc_tile, act_at(s.ln2_out, i64(t0) * H, a), m.fc_w, m.fc_b, rows, H, W, 0, 0);
  return w.fc_tile;
}

SavedSet every_group() {
  SavedSet all = 0;
  for (const RecomputeGroup& g : recompute_groups()) all |= g.tensors;
  return all;
}

}  // namespace

void block_forward(Backend& be, void* x_out, BlockSaved& s, const BlockParams& p, const BlockMatrices& m,
                   const BlockWorkspace& w, BlockAttention& attn, const ModelConfig& c, const Subseq& q) {
  forward_steps(be, s, every_group(), true, p, m, w, &attn, c, q);
  block_output(be, x_out, s, m, w, c, q.T);
}

void block_output(Backend& be, void* x_out, const BlockSaved& s, const BlockMatrices& m, const BlockWorkspace& w,
                  const ModelConfig& c, int T) {
  const int H = c.hidden, F = c.ffn();
  const DType a = be.act();
  // x_out = x_mid + proj(gelu(fc_pre)), or proj(swiglu(fc_pre))
  for_mlp_tiles(w, T, [&](int t0, int rows) {
    mlp_act_forward(be, c, w.mlp_act, fc_pre_rows(be, s, m, w, c, t0, rows), rows);
    be.linear_forward(act_at(x_out, i64(t0) * H, a), w.mlp_act, m.proj_w, m.proj_b, rows, F, H, 0, 0);
  });
  be.add_inplace(x_out, s.x_mid, i64(T) * H);
}

void qk_norm_forward(Backend& be, BlockSaved& s, bool want_q, bool kv, const BlockParams& p, const BlockMatrices& m,
                     const BlockWorkspace& w, const void* in, int H, const ModelConfig& ac, const Subseq& q) {
  const DType a = be.act();
  const int T = q.T, A = ac.head_size(), Z = ac.heads, G = ac.kv_head_count(), QW = ac.q_width(),
            KV = ac.kv_width();
  const RopeTable rope = rope_table(ac);
  // The norms run over a row a head (the backend's row counts are ints).
  SPPO_CHECK(i64(T) * Z <= INT_MAX, "model")
      << "a subsequence of " << T << " tokens has " << i64(T) * Z << " query heads' rows, over the kernels' 2^31 - 1; "
      << "use more --subseqs";
  if (want_q) {
    be.linear_forward(s.q_pre, in, m.qkv_w, m.qkv_b, T, H, QW, 0, 0);
    be.rmsnorm_forward(s.q, s.q_rstd, s.q_pre, p.q_norm_w, T * Z, A, ac.ln_eps);
    for (const PosSpan& part : q.parts())
      be.rope_forward(act_at(s.q, i64(part.row0) * QW, a), part.rows, Z, A, q.rope_pos(part), rope, QW);
  }
  if (want_q || kv) {
    // The keys before their norm and its statistics are q's group's; recomputing K/V alone
    // makes them in scratch (the saved ones are kept), and q's group alone discards k.
    void* k_pre = want_q ? s.k_pre : w.qkv;
    be.linear_forward(k_pre, in, act_at(m.qkv_w, i64(QW) * H, a), bias_at(m.qkv_b, QW, a), T, H, KV, 0, 0);
    be.rmsnorm_forward(kv ? s.k : w.qkv, want_q ? s.k_rstd : nullptr, k_pre, p.k_norm_w, T * G, A, ac.ln_eps);
  }
  if (!kv) return;
  for (const PosSpan& part : q.parts())
    be.rope_forward(act_at(s.k, i64(part.row0) * KV, a), part.rows, G, A, q.rope_pos(part), rope, KV);
  be.linear_forward(s.v, in, act_at(m.qkv_w, i64(QW + KV) * H, a), bias_at(m.qkv_b, QW + KV, a), T, H, KV, 0, 0);
}

void qk_norm_backward(Backend& be, BlockParams& g, const float* dk_self, const float* dv_self, const BlockSaved& s,
                      const BlockParams& p, const BlockMatrices& m, const BlockWorkspace& w, const void* in, int H,
                      const ModelConfig& ac, const Subseq& q) {
  const DType a = be.act();
  const int T = q.T, A = ac.head_size(), Z = ac.heads, G = ac.kv_head_count(), QW = ac.q_width(),
            KV = ac.kv_width();
  const std::size_t e = std::size_t(dtype_bytes(a));
  const RopeTable rope = rope_table(ac);
  // w.qkv becomes d q_pre [T, Z A], d k_pre [T, G A] and dv [T, G A], one after another.
  void* dq = w.qkv;
  void* dk = act_at(w.qkv, i64(T) * QW, a);
  void* dv = act_at(w.qkv, i64(T) * (QW + KV), a);
  // Queries: RoPE's backward in place, then the norm's (which accumulates) from zero in
  // d_tmp, back into dq.
  for (const PosSpan& part : q.parts())
    be.rope_backward(act_at(dq, i64(part.row0) * QW, a), part.rows, Z, A, q.rope_pos(part), rope, QW);
  be.fill_zero(w.d_tmp, std::size_t(T) * std::size_t(QW) * e);
  be.rmsnorm_backward(w.d_tmp, g.q_norm_w, dq, s.q_pre, p.q_norm_w, s.q_rstd, T * Z, A, w.scratch);
  be.copy_cols(dq, w.d_tmp, T, QW, QW, 0);
  // Keys: the complete dK through RoPE's backward in d_tmp, the norm's into dk.
  be.put_cols(w.d_tmp, dk_self, true, T, KV, KV, 0);
  for (const PosSpan& part : q.parts())
    be.rope_backward(act_at(w.d_tmp, i64(part.row0) * KV, a), part.rows, G, A, q.rope_pos(part), rope, KV);
  be.fill_zero(dk, std::size_t(T) * std::size_t(KV) * e);
  be.rmsnorm_backward(dk, g.k_norm_w, w.d_tmp, s.k_pre, p.k_norm_w, s.k_rstd, T * G, A, w.scratch);
  be.put_cols(dv, dv_self, true, T, KV, KV, 0);
  // The projection's q, k and v rows, each from its own dense gradient.
  be.linear_backward(w.d_tmp, g.qkv_w, g.qkv_b, dq, in, m.qkv_w, T, H, QW, 0, 0, w.scratch);
  for (int j = 0; j < 2; ++j) {
    const i64 row = QW + i64(j) * KV;
    const void* wj = act_at(m.qkv_w, row * H, a);
    void* dj = j == 0 ? dk : dv;
    be.linear_backward(nullptr, g.qkv_w + row * H, g.qkv_b ? g.qkv_b + row : nullptr, dj, in, wj, T, H, KV, 0, 0,
                       w.scratch);
    be.gemm(false, false, T, H, KV, 1.0f, dj, KV, wj, H, 1.0f, w.d_tmp, H, a, a);
  }
}

void block_recompute(Backend& be, BlockSaved& s, SavedSet groups, bool kv, const BlockParams& p,
                     const BlockMatrices& m, const BlockWorkspace& w, BlockAttention* attn, const ModelConfig& c,
                     const Subseq& q) {
  forward_steps(be, s, groups, kv, p, m, w, attn, c, q);
}

void kv_project(Backend& be, void* k, void* v, const void* ln1_out, const BlockParams& p, const BlockMatrices& m,
                const ModelConfig& c, i64 pos0, int rows, void* k_pre, float* k_rstd) {
  const DType a = be.act();
  const int H = c.hidden, KV = c.kv_width(), QW = c.q_width();
  const void* w_k = act_at(m.qkv_w, i64(QW) * H, a);
  if (c.qk_norm) {  // the keys before their norm: into k_pre, or into v until v is made
    void* pre = k_pre ? k_pre : v;
    be.linear_forward(pre, ln1_out, w_k, bias_at(m.qkv_b, QW, a), rows, H, KV, 0, 0);
    be.rmsnorm_forward(k, k_rstd, pre, p.k_norm_w, rows * c.kv_head_count(), c.head_size(), c.ln_eps);
  } else {
    be.linear_forward(k, ln1_out, w_k, bias_at(m.qkv_b, QW, a), rows, H, KV, 0, 0);
  }
  be.linear_forward(v, ln1_out, act_at(m.qkv_w, i64(QW + KV) * H, a), bias_at(m.qkv_b, QW + KV, a), rows, H, KV, 0,
                    0);
  be.rope_forward(k, rows, c.kv_head_count(), c.head_size(), pos0, rope_table(c), KV);
}

void block_backward(Backend& be, void* d, BlockParams& g, float* dk_self, float* dv_self, const BlockSaved& s,
                    const BlockParams& p, const BlockMatrices& m, const BlockWorkspace& w, const KVBlocks& past,
                    const ModelConfig& c, const Subseq& q) {
  LocalAttention attn(past);
  block_backward(be, d, g, dk_self, dv_self, s, p, m, w, attn, c, q);
}

void block_backward(Backend& be, void* d, BlockParams& g, float* dk_self, float* dv_self, const BlockSaved& s,
                    const BlockParams& p, const BlockMatrices& m, const BlockWorkspace& w, BlockAttention& attn,
                    const ModelConfig& c, const Subseq& q, const float* d_ln1_sums) {
  const int T = q.T, H = c.hidden, F = c.ffn(), W = c.fc_width();
  const DType a = be.act();
  // MLP half. d is the gradient w.r.t. x_out = x_mid + proj(act(fc_pre)).
  for_mlp_tiles(w, T, [&](int t0, int rows) {
    const void* fc_pre = fc_pre_rows(be, s, m, w, c, t0, rows);
    const void* dy = act_at(d, i64(t0) * H, a);
    mlp_act_forward(be, c, w.mlp_act, fc_pre, rows);  // recomputed: cheaper than saving it
    be.linear_backward(nullptr, g.proj_w, g.proj_b, dy, w.mlp_act, m.proj_w, rows, F, H, 0, 0, w.scratch);
    // d mlp_act, then d fc_pre [rows, W] in place (SwiGLU's d gate | d up from d act in
    // the gate columns)
    be.gemm(false, false, rows, F, H, 1.0f, dy, H, m.proj_w, F, 0.0f, w.mlp_act, W, a, a);
    if (c.gated()) be.swiglu_backward(w.mlp_act, fc_pre, rows, F);
    else be.gelu_backward(w.mlp_act, w.mlp_act, fc_pre, i64(rows) * F);
    be.linear_backward(act_at(w.d_tmp, i64(t0) * H, a), g.fc_w, g.fc_b, w.mlp_act, act_at(s.ln2_out, i64(t0) * H, a),
                       m.fc_w, rows, H, W, 0, 0, w.scratch);
  });
  norm_backward(be, c, d, g.ln2_w, g.ln2_b, w.d_tmp, s.x_mid, p.ln2_w, s.ln2_mean, s.ln2_rstd, T, w.scratch);
  // Attention half. d is now the gradient w.r.t. x_mid = x + out(attn_out).
  const int QW = c.q_width();
  be.linear_backward(w.d_tmp, g.out_w, g.out_b, d, s.attn_out, m.out_w, T, QW, H, 0, 0, w.scratch);
  for (const PosSpan& part : q.parts()) {
    const i64 at = i64(part.row0) * QW;
    be.attention_backward_delta(w.delta + i64(c.heads) * part.row0, act_at(w.d_tmp, at, a),
                                act_at(s.attn_out, at, a), span_shape(c, part));
  }
  void* dqkv = w.qkv;
  attn.backward(be, dqkv, w.d_tmp, w.delta, s, dk_self, dv_self, c, q, w.scratch);
  const RopeTable rope = rope_table(c);
  if (c.qk_norm) {
    qk_norm_backward(be, g, dk_self, dv_self, s, p, m, w, s.ln1_out, H, c, q);
  } else if (c.llama()) {
    qkv_backward_planar(be, g, dk_self, dv_self, s, m, w, c, q, rope);
  } else {
    // dK/dV of this subsequence are complete: every later subsequence has contributed.
    be.put_cols(dqkv, dk_self, true, T, H, 3 * H, H);
    be.put_cols(dqkv, dv_self, true, T, H, 3 * H, 2 * H);
    for (const PosSpan& part : q.parts()) {
      void* rows = act_at(dqkv, i64(part.row0) * 3 * H, a);
      be.rope_backward(rows, part.rows, c.heads, c.head_size(), q.rope_pos(part), rope, 3 * H);
      be.rope_backward(act_at(rows, H, a), part.rows, c.heads, c.head_size(), q.rope_pos(part), rope, 3 * H);
    }
    be.linear_backward(w.d_tmp, g.qkv_w, g.qkv_b, dqkv, s.ln1_out, m.qkv_w, T, H, 3 * H, 0, 0, w.scratch);
  }
  if (d_ln1_sums) {  // dqkv is spent: it carries the sums in the activation type
    be.put_cols(w.qkv, d_ln1_sums, true, T, H, H, 0);
    be.add_inplace(w.d_tmp, w.qkv, i64(T) * H);
  }
  norm_backward(be, c, d, g.ln1_w, g.ln1_b, w.d_tmp, s.x, p.ln1_w, s.ln1_mean, s.ln1_rstd, T, w.scratch);
}

void head_forward_backward(Backend& be, void* head_grad, double* loss_sum, const void* x, const std::int32_t* targets,
                           const ParamView& p, const MatrixView& m, ParamView& g, const HeadWorkspace& w,
                           const ModelConfig& c, int T, i64 total_tokens, std::uint8_t* hits) {
  const int H = c.hidden, V = c.vocab;
  const DType a = be.act();
  norm_forward(be, c, w.ln_f_out, w.ln_f_mean, w.ln_f_rstd, x, p.lnf_w, p.lnf_b, T);
  const float scale = float(1.0 / double(total_tokens));
  std::vector<float> row(hits ? std::size_t(V) : 0);
  // Row chunks bound the logits to [chunk, V]. Once a chunk's rows of ln_f_out have fed
  // dembed they are dead, so the chunk's gradient d ln_f_out overwrites them in place.
  for (int t0 = 0; t0 < T; t0 += w.chunk) {
    const int rows = std::min(w.chunk, T - t0);
    void* h = act_at(w.ln_f_out, i64(t0) * H, a);
    be.gemm(false, true, rows, V, H, 1.0f, h, H, m.head, H, 0.0f, w.logits, V, a, DType::F32);
    if (hits)  // the most likely token of each scored row, on the host: an evaluation's, not a kernel's
      for (int r = 0; r < rows; ++r) {
        hits[t0 + r] = 0;
        if (targets[t0 + r] == kNoTarget) continue;
        be.to_host(row.data(), w.logits + i64(r) * V, sizeof(float) * std::size_t(V));
        const i64 best = std::max_element(row.begin(), row.end()) - row.begin();
        hits[t0 + r] = std::uint8_t(targets[t0 + r] == best);
      }
    be.xent(w.dlogits, w.losses + t0, loss_sum, w.logits, targets + t0, rows, V, scale, w.scratch);
    if (!head_grad) continue;
    be.gemm(true, false, V, H, rows, 1.0f, w.dlogits, V, h, H, 1.0f, g.head, H, a, DType::F32);
    be.gemm(false, false, rows, H, V, 1.0f, w.dlogits, V, m.head, H, 0.0f, h, H, a, a);
  }
  if (!head_grad) return;
  be.fill_zero(head_grad, std::size_t(i64(T) * H * dtype_bytes(a)));
  norm_backward(be, c, head_grad, g.lnf_w, g.lnf_b, w.ln_f_out, x, p.lnf_w, w.ln_f_mean, w.ln_f_rstd, T, w.scratch);
}

}  // namespace sppo
