#include "core/layout.h"

#include <algorithm>
#include <map>

#include "core/check.h"

namespace sppo {

int dtype_bytes(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::I32: return 4;
  }
  SPPO_ASSERT(false);
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::I32: return "I32";
  }
  SPPO_ASSERT(false);
  return "";
}

i64 TensorSpec::numel() const {
  i64 n = 1;
  for (i64 d : shape) n *= d;
  return n;
}

i64 total_bytes(const std::vector<TensorSpec>& specs) {
  i64 b = 0;
  for (const auto& s : specs) b += s.bytes();
  return b;
}

std::pair<i64, i64> piece_range(i64 n, int piece, int pieces) {
  SPPO_ASSERT(pieces >= 1 && piece >= 0 && piece < pieces);
  const i64 base = n / pieces, rem = n % pieces;
  const i64 b = piece * base + std::min<i64>(piece, rem);
  return {b, b + base + (piece < rem ? 1 : 0)};
}

std::vector<TensorSpec> parameter_specs(const ModelConfig& c) { return parameter_specs(c, 0, c.layers); }

std::vector<TensorSpec> parameter_specs(const ModelConfig& c, int begin, int end) {
  return parameter_specs(c, begin, end, TpShard{});
}

std::vector<TensorSpec> parameter_specs(const ModelConfig& c, int begin, int end, const TpShard& tp) {
  SPPO_ASSERT(0 <= begin && begin < end && end <= c.layers);
  const i64 H = c.hidden, A = c.head_size();
  const i64 Hr = tp.local_hidden(c), Qr = tp.local_qkv_width(c), Wr = tp.local_fc_width(c);
  const auto [f0, f1] = tp.ffn(c);
  const auto [v0, v1] = tp.vocab(c);
  const i64 Fr = f1 - f0, Vr = v1 - v0;
  const bool bias = c.biases();
  std::vector<TensorSpec> p;
  auto add = [&](std::string name, std::vector<i64> shape) {
    p.push_back({std::move(name), std::move(shape), DType::F32, Role::Parameter});
  };
  if (begin == 0 || (end == c.layers && c.tied_embeddings())) add("embed.weight", {Vr, H});
  for (int l = begin; l < end; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".";
    add(b + "ln1.weight", {H});
    if (bias) add(b + "ln1.bias", {H});
    add(b + "attn.qkv.weight", {Qr, H});
    if (c.qkv_bias) add(b + "attn.qkv.bias", {Qr});
    if (c.qk_norm) {
      add(b + "attn.q_norm.weight", {A});
      add(b + "attn.k_norm.weight", {A});
    }
    add(b + "attn.out.weight", {H, Hr});
    if (bias) add(b + "attn.out.bias", {H});
    add(b + "ln2.weight", {H});
    if (bias) add(b + "ln2.bias", {H});
    add(b + "mlp.fc.weight", {Wr, H});
    if (bias) add(b + "mlp.fc.bias", {Wr});
    add(b + "mlp.proj.weight", {H, Fr});
    if (bias) add(b + "mlp.proj.bias", {H});
  }
  if (end == c.layers) {
    add("ln_f.weight", {H});
    if (bias) add("ln_f.bias", {H});
    if (!c.tied_embeddings()) add("lm_head.weight", {Vr, H});
  }
  return p;
}

ModelConfig attention_view(const ModelConfig& c, const TpShard& tp) {
  ModelConfig a = c;
  a.heads = tp.local_heads(c);
  a.head_dim = c.head_size();
  a.hidden = tp.local_hidden(c);
  const auto [g0, g1] = tp.kv_heads(c);
  a.kv_heads = int(g1 - g0);
  return a;
}

bool ulysses_runs(const ModelConfig& c, int U) {
  const int G = c.kv_head_count();
  return U >= 1 && U <= c.heads && (U <= G || (U % G == 0 && U / G <= c.heads / G));
}

i64 ulysses_block_bytes(const ModelConfig& c, i64 T, ActPrecision p, int from, int to, int size, UlyssesExchange x) {
  const i64 e = p == ActPrecision::F32 ? 4 : 2;
  const TpShard hf{from, size}, ht{to, size};
  const UlyssesShard rf{from, size}, rt{to, size};
  switch (x) {
    case UlyssesExchange::Heads:
      return rf.row_count(T) * (ht.local_hidden(c) + 2 * i64(ht.local_kv_width(c))) * e;
    case UlyssesExchange::Rows:
      return rt.row_count(T) * (hf.local_hidden(c) * e + 4 * i64(hf.local_heads(c)));
    case UlyssesExchange::GradHeads:
      return rf.row_count(T) * (2 * ht.local_hidden(c) * e + 8 * i64(ht.local_heads(c)));
    case UlyssesExchange::GradRows: {
      const bool first_replica = from % hf.kv_replicas(c) == 0;
      return rt.row_count(T) * (hf.local_hidden(c) * e + (first_replica ? 8 * i64(hf.local_kv_width(c)) : 0));
    }
  }
  SPPO_ASSERT(false);
  return 0;
}

i64 ulysses_sent_bytes(const ModelConfig& c, i64 T, ActPrecision p, const UlyssesShard& u, UlyssesExchange x) {
  i64 b = 0;
  for (int j = 0; j < u.size; ++j)
    if (j != u.index) b += ulysses_block_bytes(c, T, p, u.index, j, u.size, x);
  return b;
}

i64 ulysses_send_total(const ModelConfig& c, i64 T, ActPrecision p, const UlyssesShard& u, UlyssesExchange x) {
  return ulysses_sent_bytes(c, T, p, u, x) + ulysses_block_bytes(c, T, p, u.index, u.index, u.size, x);
}

i64 ulysses_recv_total(const ModelConfig& c, i64 T, ActPrecision p, const UlyssesShard& u, UlyssesExchange x) {
  i64 b = 0;
  for (int j = 0; j < u.size; ++j) b += ulysses_block_bytes(c, T, p, j, u.index, u.size, x);
  return b;
}

bool tp_replicated(const std::string& name) {
  auto ends = [&](const char* suffix) {
    const std::string s(suffix);
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  return name.rfind("ln_f.", 0) == 0 || ends(".ln1.weight") || ends(".ln1.bias") || ends(".ln2.weight") ||
         ends(".ln2.bias") || ends(".q_norm.weight") || ends(".k_norm.weight") || ends("attn.out.bias") ||
         ends("mlp.proj.bias");
}

std::vector<ParamSlice> param_slices(const ModelConfig& c, int begin, int end, const TpShard& tp) {
  std::map<std::string, i64> full_offset;
  {
    i64 off = 0;
    for (const auto& s : parameter_specs(c)) full_offset[s.name] = off, off += s.numel();
  }
  const i64 H = c.hidden, F = c.ffn(), A = c.head_size(), KV = c.kv_width(), QW = c.q_width();
  const auto [z0, z1] = tp.heads(c);
  const auto [g0, g1] = tp.kv_heads(c);
  const auto [f0, f1] = tp.ffn(c);
  const auto [v0, v1] = tp.vocab(c);
  const i64 c0 = z0 * A, Hr = (z1 - z0) * A, k0 = g0 * A, KVr = (g1 - g0) * A;
  const int m = tp.kv_replicas(c);
  // Where the q, k and v rows of this member's heads start in the whole projection, and how many.
  const i64 qkv_from[3] = {c0, QW + k0, QW + KV + k0}, qkv_rows[3] = {Hr, KVr, KVr};
  std::vector<ParamSlice> out;
  i64 local = 0;
  for (const auto& s : parameter_specs(c, begin, end, tp)) {
    const i64 full = full_offset.at(s.name);
    auto take = [&](i64 from, i64 count, bool replicated = false, bool kv_replica = false) {
      const bool copy = (replicated && tp.index > 0) || (kv_replica && tp.index % m > 0);
      out.push_back({local, full + from, count, replicated, kv_replica, copy});
      local += count;
    };
    auto ends = [&](const char* suffix) {
      const std::string x(suffix);
      return s.name.size() >= x.size() && s.name.compare(s.name.size() - x.size(), x.size(), x) == 0;
    };
    // A gated fc holds the gate rows of its F columns, then their up rows.
    const int fc_parts = c.gated() ? 2 : 1;
    if (tp_replicated(s.name)) {
      take(0, s.numel(), true);
    } else if (s.name == "embed.weight" || s.name == "lm_head.weight") {
      take(v0 * H, (v1 - v0) * H);
    } else if (ends("attn.qkv.weight")) {
      for (int j = 0; j < 3; ++j) take(qkv_from[j] * H, qkv_rows[j] * H, false, j > 0 && m > 1);  // q, k, v rows
    } else if (ends("attn.qkv.bias")) {
      for (int j = 0; j < 3; ++j) take(qkv_from[j], qkv_rows[j], false, j > 0 && m > 1);
    } else if (ends("attn.out.weight")) {
      for (i64 r = 0; r < H; ++r) take(r * QW + c0, Hr);  // its heads' columns of every row
    } else if (ends("mlp.fc.weight")) {
      for (int j = 0; j < fc_parts; ++j) take((j * F + f0) * H, (f1 - f0) * H);
    } else if (ends("mlp.fc.bias")) {
      for (int j = 0; j < fc_parts; ++j) take(j * F + f0, f1 - f0);
    } else if (ends("mlp.proj.weight")) {
      for (i64 r = 0; r < H; ++r) take(r * F + f0, f1 - f0);
    } else {
      SPPO_ASSERT_MSG(false, "no tensor-parallel split for parameter " << s.name);
    }
  }
  SPPO_ASSERT(local == total_bytes(parameter_specs(c, begin, end, tp)) / i64(sizeof(float)));
  return out;
}

namespace {
DType act_dtype(ActPrecision p) { return p == ActPrecision::F32 ? DType::F32 : DType::BF16; }
}  // namespace

std::vector<TensorSpec> block_saved_specs(const ModelConfig& c, i64 T, ActPrecision p) {
  return block_saved_specs(c, T, p, TpShard{});
}

std::vector<TensorSpec> block_saved_specs(const ModelConfig& c, i64 T, ActPrecision p, const TpShard& tp) {
  const i64 H = c.hidden, Hr = tp.local_hidden(c), Zr = tp.local_heads(c), KVr = tp.local_kv_width(c);
  const i64 Fr = tp.local_fc_width(c);
  const i64 Ts = tp.row_count(T);  // this member's rows of the LayerNorm / residual regions
  const i64 Tm = c.llama() ? 0 : Ts;  // RMSNorm keeps no mean: its rows are empty
  const DType a = act_dtype(p);
  using R = Role;
  std::vector<TensorSpec> s = {
      {"x", {Ts, H}, a, R::Offloadable},            // block input = LN1 input
      {"ln1_mean", {Tm}, DType::F32, R::Offloadable},
      {"ln1_rstd", {Ts}, DType::F32, R::Offloadable},
      {"ln1_out", {Ts, H}, a, R::Offloadable},      // input of the qkv projection (gathered again in backward)
      {"q", {T, Hr}, a, R::Offloadable},            // queries after RoPE
      {"k", {T, KVr}, a, R::Skeletal},              // keys after RoPE (KV cache; G heads)
      {"v", {T, KVr}, a, R::Skeletal},              // values (KV cache)
      {"attn_out", {T, Hr}, a, R::Offloadable},     // attention output before projection
      {"lse", {Zr, T}, DType::F32, R::Offloadable}, // per-row log-sum-exp of the scores
      {"x_mid", {Ts, H}, a, R::Offloadable},        // residual after attention = LN2 input
      {"ln2_mean", {Tm}, DType::F32, R::Offloadable},
      {"ln2_rstd", {Ts}, DType::F32, R::Offloadable},
      {"ln2_out", {Ts, H}, a, R::Offloadable},      // input of the fc projection
      {"fc_pre", {T, Fr}, a, R::Offloadable},       // fc output before GeLU (SwiGLU: gate | up)
  };
  if (c.qk_norm) {  // Note [Query/key norms] (model/gpt.h): their inputs and statistics
    const i64 Gr = KVr / c.head_size();
    s.push_back({"q_pre", {T, Hr}, a, R::Offloadable});          // queries before their norm
    s.push_back({"q_rstd", {T, Zr}, DType::F32, R::Offloadable});  // the norm's statistics, a row per head
    s.push_back({"k_pre", {T, KVr}, a, R::Offloadable});         // keys before their norm
    s.push_back({"k_rstd", {T, Gr}, DType::F32, R::Offloadable});
  }
  SPPO_ASSERT(int(s.size()) == block_saved_count(c));
  return s;
}

std::vector<TensorSpec> block_saved_specs(const ModelConfig& c, i64 T, ActPrecision p, const UlyssesShard& u) {
  std::vector<TensorSpec> s = block_saved_specs(c, u.row_count(T), p, TpShard{});
  const i64 KVu = u.heads().local_kv_width(c);
  for (int k : {kSavedK, kSavedV}) s[std::size_t(k)].shape = {T, KVu};
  return s;
}

std::vector<TensorSpec> head_saved_specs(const ModelConfig& c, i64 T, ActPrecision p, const UlyssesShard& u) {
  return head_saved_specs(c, u.row_count(T), p, TpShard{});
}

std::vector<TensorSpec> head_saved_specs(const ModelConfig& c, i64 T, ActPrecision p) {
  return head_saved_specs(c, T, p, TpShard{});
}

std::vector<TensorSpec> head_saved_specs(const ModelConfig& c, i64 T, ActPrecision p, const TpShard& tp) {
  return {{"head_grad", {tp.row_count(T), i64(c.hidden)}, act_dtype(p), Role::Offloadable}};
}

std::vector<TensorSpec> block_workspace_specs(const ModelConfig& c, i64 T, ActPrecision p) {
  return block_workspace_specs(c, T, p, TpShard{});
}

std::vector<TensorSpec> block_workspace_specs(const ModelConfig& c, i64 T, ActPrecision p, const TpShard& tp,
                                              const MlpTiles& tiles) {
  SPPO_ASSERT(!(tp.on() && tiles.on()));
  const i64 H = c.hidden, Hr = tp.local_hidden(c), Zr = tp.local_heads(c), Wr = tp.local_fc_width(c);
  const DType a = act_dtype(p);
  using R = Role;
  // Forward needs qkv and the MLP activation; backward reuses them for their gradients
  // (the residual gradient runs in place in head_grad) plus one gradient row of both the
  // residual stream's width and the attention's (d attn_out), and delta. A gated MLP's
  // activation is [T, F], but its backward makes d gate | d up in place there. qkv also
  // carries the K/V's sums into the layer input, [T, H] (Note [dK/dV into the layer input]).
  std::vector<TensorSpec> s = {
      {"qkv", {T, std::max<i64>(tp.local_qkv_width(c), H)}, a, R::Workspace},
      {"mlp_act", {tiles.tile_rows(T), Wr}, a, R::Workspace},
      {"d_tmp", {T, std::max(H, Hr)}, a, R::Workspace},
      {"delta", {Zr, T}, DType::F32, R::Workspace},
  };
  if (tiles.on() && tiles.fc_pre_recomputed) s.push_back({"fc_tile", {tiles.tile_rows(T), Wr}, a, R::Workspace});
  if (tp.on()) {
    s.push_back({"tp_full", {T, H}, a, R::Workspace});
    // fp32 whatever the activations: a reduce-scatter sums bf16 rows in fp32 (runtime/tensor_parallel.cpp).
    s.push_back({"tp_pad", {tp.padded_rows(T), H}, DType::F32, R::Workspace});
    s.push_back({"tp_rows", {tp.row_count(T), H}, a, R::Workspace});
  }
  return s;
}

// Note [Ulysses buffers]: what Ulysses member u's block and its all-to-alls (runtime/ulysses.h)
// hold while a layer runs on a piece of T tokens, Tl = u.row_count(T) of them its rows, beside
// the block's own workspace on Tl rows: its rows' K, V [Tl, G A] (the projection's, before they
// go to the members of their heads) and, in backward, their complete dK, dV [Tl, G A] fp32 back;
// the piece's rows of its Zu heads: queries [T, Zu A], outputs (in backward their gradients)
// [T, Zu A], LSE and delta [Zu, T] fp32, and dq [T, max(Qu, Zu A)] (the attention's dqkv of its
// heads, Qu their q/k/v width); and one send and one receive buffer, each the largest that an
// exchange of Note [Ulysses exchanges] packs.
std::vector<TensorSpec> block_workspace_specs(const ModelConfig& c, i64 T, ActPrecision p, const UlyssesShard& u,
                                              const MlpTiles& tiles) {
  const i64 Tl = u.row_count(T);
  std::vector<TensorSpec> s = block_workspace_specs(c, Tl, p, TpShard{}, tiles);
  const DType a = act_dtype(p);
  const i64 KV = c.kv_width();
  const TpShard h = u.heads();
  const i64 Zu = h.local_heads(c), Hu = h.local_hidden(c), Qu = h.local_qkv_width(c);
  i64 send = 0, recv = 0;
  for (UlyssesExchange x : {UlyssesExchange::Heads, UlyssesExchange::Rows, UlyssesExchange::GradHeads,
                            UlyssesExchange::GradRows}) {
    send = std::max(send, ulysses_send_total(c, T, p, u, x));
    recv = std::max(recv, ulysses_recv_total(c, T, p, u, x));
  }
  using R = Role;
  s.push_back({"uly_k", {Tl, KV}, a, R::Workspace});
  s.push_back({"uly_v", {Tl, KV}, a, R::Workspace});
  s.push_back({"uly_dk", {Tl, KV}, DType::F32, R::Workspace});
  s.push_back({"uly_dv", {Tl, KV}, DType::F32, R::Workspace});
  s.push_back({"uly_q", {T, Hu}, a, R::Workspace});
  s.push_back({"uly_o", {T, Hu}, a, R::Workspace});
  s.push_back({"uly_lse", {Zu, T}, DType::F32, R::Workspace});
  s.push_back({"uly_delta", {Zu, T}, DType::F32, R::Workspace});
  s.push_back({"uly_dq", {T, std::max(Qu, Hu)}, a, R::Workspace});
  // Bytes, as 2-byte elements (a tensor's type is an element's).
  s.push_back({"uly_send", {(send + 1) / 2}, DType::BF16, R::Workspace});
  s.push_back({"uly_recv", {(recv + 1) / 2}, DType::BF16, R::Workspace});
  return s;
}

std::vector<TensorSpec> block_saved_specs(const ModelConfig& c, i64 T, ActPrecision p, const RankShard& r) {
  return r.ulysses.on() ? block_saved_specs(c, T, p, r.ulysses) : block_saved_specs(c, T, p, r.tp);
}

std::vector<TensorSpec> head_saved_specs(const ModelConfig& c, i64 T, ActPrecision p, const RankShard& r) {
  return r.ulysses.on() ? head_saved_specs(c, T, p, r.ulysses) : head_saved_specs(c, T, p, r.tp);
}

std::vector<TensorSpec> block_workspace_specs(const ModelConfig& c, i64 T, ActPrecision p, const RankShard& r,
                                              const MlpTiles& tiles) {
  return r.ulysses.on() ? block_workspace_specs(c, T, p, r.ulysses, tiles) : block_workspace_specs(c, T, p, r.tp, tiles);
}

std::vector<TensorSpec> head_workspace_specs(const ModelConfig& c, i64 T, i64 chunk, ActPrecision p,
                                             const UlyssesShard& u) {
  return head_workspace_specs(c, u.row_count(T), chunk, p, TpShard{});
}

std::vector<TensorSpec> head_workspace_specs(const ModelConfig& c, i64 T, i64 chunk, ActPrecision p,
                                             const RankShard& r) {
  return r.ulysses.on() ? head_workspace_specs(c, T, chunk, p, r.ulysses) : head_workspace_specs(c, T, chunk, p, r.tp);
}

std::vector<TensorSpec> head_workspace_specs(const ModelConfig& c, i64 T, i64 chunk, ActPrecision p) {
  return head_workspace_specs(c, T, chunk, p, TpShard{});
}

std::vector<TensorSpec> head_workspace_specs(const ModelConfig& c, i64 T, i64 chunk, ActPrecision p,
                                             const TpShard& tp) {
  const i64 H = c.hidden;
  const auto [v0, v1] = tp.vocab(c);
  const i64 V = v1 - v0;
  const i64 rows = std::min(T, chunk);
  const i64 Ts = tp.row_count(T);
  std::vector<TensorSpec> s = {
      {"ln_f_out", {Ts, H}, act_dtype(p), Role::Workspace},
      {"ln_f_mean", {c.llama() ? 0 : Ts}, DType::F32, Role::Workspace},
      {"ln_f_rstd", {Ts}, DType::F32, Role::Workspace},
      {"logits", {rows, V}, DType::F32, Role::Workspace},
      {"losses", {T}, DType::F32, Role::Workspace},
  };
  // In bf16 the loss gradient feeds the bf16 GEMMs from a buffer of its own; in fp32 it
  // overwrites the logits.
  if (p == ActPrecision::BF16) s.push_back({"dlogits", {rows, V}, DType::BF16, Role::Workspace});
  if (tp.on()) {
    s.push_back({"tp_full", {T, H}, act_dtype(p), Role::Workspace});
    s.push_back({"tp_pad", {tp.padded_rows(T), H}, DType::F32, Role::Workspace});  // as the block's
    s.push_back({"lse_parts", {i64(tp.size), rows}, DType::F32, Role::Workspace});
  }
  return s;
}

i64 select_offload(const std::vector<i64>& sizes, double fraction, std::vector<bool>* take) {
  i64 total = 0;
  for (i64 b : sizes) total += b;
  const double target = fraction * double(total);
  i64 taken = 0;
  if (take) take->assign(sizes.size(), false);
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    if (double(taken) + 0.5 * double(sizes[k]) > target) continue;
    taken += sizes[k];
    if (take) (*take)[k] = true;
  }
  return taken;
}

i64 kv_window_bytes(i64 chunks, i64 largest, i64 T, i64 width, int heads, int act_bytes, bool backward,
                    i64 recompute_hidden, int k_norm_heads) {
  if (chunks == 0) return 0;
  const i64 f32 = 4;
  const bool recompute = recompute_hidden > 0;
  // A recomputed chunk's keys before their norm and its statistics, for the norm's backward.
  const i64 k_norm = backward && recompute && k_norm_heads > 0 ? width * act_bytes + k_norm_heads * f32 : 0;
  const i64 slot = largest * (width * (2 * act_bytes + (backward && recompute ? 2 * f32 : 0)) +
                              recompute_hidden * act_bytes + k_norm);
  const i64 sums = backward ? largest * (recompute ? recompute_hidden * f32 : width * 2 * f32) : 0;
  const i64 partial = backward ? 0 : T * width * act_bytes + i64(heads) * T * f32;
  const i64 norm = recompute ? largest * (recompute_hidden * act_bytes + 2 * f32) : 0;
  return std::min<i64>(2, chunks) * slot + std::min<i64>(kv_window_sum_slots(backward), chunks) * sums + partial +
         norm;
}

const std::vector<RecomputeGroup>& recompute_groups() {
  static const std::vector<RecomputeGroup> groups = {
      {"ln1", 1u << 1 | 1u << 2 | 1u << 3},
      {"q", 1u << 4 | kQkNormTensors},
      {"attention", kAttentionGroup},
      {"x_mid", 1u << 9},
      {"ln2", 1u << 10 | 1u << 11 | 1u << 12},
      {"fc_pre", 1u << 13},
      {"head_grad", kHeadGradGroup},
  };
  return groups;
}

SavedSet recompute_closure(SavedSet s) {
  SavedSet out = 0;
  for (const RecomputeGroup& g : recompute_groups())
    if (s & g.tensors) out |= g.tensors;
  return out;
}

SavedSet parse_recompute_tensors(const std::string& list) {
  // Tensor names from the activation table (block_saved_specs, T and H do not matter), of a
  // model that saves every one.
  ModelConfig c;
  c.hidden = c.heads = 1;
  c.family = Family::Llama;
  c.qk_norm = true;
  const std::vector<TensorSpec> table = block_saved_specs(c, 1, ActPrecision::F32);
  SPPO_ASSERT(int(table.size()) == kBlockSavedTensors);
  auto choices = [&] {
    std::string names;
    for (const RecomputeGroup& g : recompute_groups())
      for (int k = 0; k < kBlockSavedTensors; ++k)
        if (in_set(g.tensors, k)) names += (names.empty() ? "" : ", ") + table[std::size_t(k)].name;
    return names + ", head_grad";
  };
  SavedSet s = 0;
  std::size_t at = 0;
  while (at <= list.size()) {
    std::size_t end = list.find(',', at);
    if (end == std::string::npos) end = list.size();
    const std::string name = list.substr(at, end - at);
    at = end + 1;
    if (name.empty() || name == "none") continue;
    if (name == "all") {  // the block's tensors (head_grad is the last stage's, named alone)
      for (const RecomputeGroup& g : recompute_groups())
        if (!in_set(g.tensors, kSavedHeadGrad)) s |= g.tensors;
      continue;
    }
    SPPO_CHECK(name != "k" && name != "v", "options")
        << "--recompute-tensors: k and v are the K/V cache; --kv-cache recompute recomputes them from the layer "
           "input";
    SPPO_CHECK(name != "x", "options")
        << "--recompute-tensors: x, a block's input, is the previous block's output and is always kept (or "
           "offloaded); --recompute recomputes whole blocks from it";
    bool found = false;
    for (const RecomputeGroup& g : recompute_groups())
      if (name == g.name) s |= g.tensors, found = true;
    for (int k = 0; k < kBlockSavedTensors && !found; ++k)
      if (name == table[std::size_t(k)].name) s |= 1u << k, found = true;
    SPPO_CHECK(found, "options") << "--recompute-tensors: no saved tensor '" << name
                                 << "'; the tensors backward can recompute are " << choices()
                                 << " (or the groups ln1, q, attention, x_mid, ln2, fc_pre, head_grad; all; none)";
  }
  return recompute_closure(s);
}

std::string recompute_tensors_text(SavedSet s) {
  std::string out;
  for (const RecomputeGroup& g : recompute_groups())
    if (s & g.tensors) out += (out.empty() ? "" : ",") + std::string(g.name);
  return out.empty() ? "none" : out;
}

const std::vector<SavedSet>& recompute_levels() {
  static const std::vector<SavedSet> levels = [] {
    const auto& g = recompute_groups();
    const SavedSet norms = g[0].tensors | g[4].tensors;
    const SavedSet mlp = norms | g[5].tensors;
    const SavedSet projections = mlp | g[1].tensors | g[3].tensors;
    const SavedSet loss = projections | g[6].tensors;
    return std::vector<SavedSet>{0, norms, mlp, projections, loss, loss | g[2].tensors};
  }();
  return levels;
}

i64 skeletal_bytes_per_token(const ModelConfig& c, ActPrecision p) {
  i64 b = 0;
  for (const auto& s : block_saved_specs(c, 1, p))
    if (s.role == Role::Skeletal) b += s.bytes();
  return b;
}

i64 offloadable_bytes_per_token(const ModelConfig& c, ActPrecision p) {
  i64 b = 0;
  for (const auto& s : block_saved_specs(c, 1, p))
    if (s.role == Role::Offloadable) b += s.bytes();
  return b;
}

}  // namespace sppo
