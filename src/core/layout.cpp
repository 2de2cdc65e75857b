#include "core/layout.h"

#include <algorithm>

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
  SPPO_ASSERT(0 <= begin && begin < end && end <= c.layers);
  const i64 H = c.hidden, F = c.ffn(), V = c.vocab;
  std::vector<TensorSpec> p;
  auto add = [&](std::string name, std::vector<i64> shape) {
    p.push_back({std::move(name), std::move(shape), DType::F32, Role::Parameter});
  };
  if (begin == 0 || end == c.layers) add("embed.weight", {V, H});
  for (int l = begin; l < end; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".";
    add(b + "ln1.weight", {H});
    add(b + "ln1.bias", {H});
    add(b + "attn.qkv.weight", {3 * H, H});
    add(b + "attn.qkv.bias", {3 * H});
    add(b + "attn.out.weight", {H, H});
    add(b + "attn.out.bias", {H});
    add(b + "ln2.weight", {H});
    add(b + "ln2.bias", {H});
    add(b + "mlp.fc.weight", {F, H});
    add(b + "mlp.fc.bias", {F});
    add(b + "mlp.proj.weight", {H, F});
    add(b + "mlp.proj.bias", {H});
  }
  if (end == c.layers) {
    add("ln_f.weight", {H});
    add("ln_f.bias", {H});
  }
  return p;
}

namespace {
DType act_dtype(ActPrecision p) { return p == ActPrecision::F32 ? DType::F32 : DType::BF16; }
}  // namespace

std::vector<TensorSpec> block_saved_specs(const ModelConfig& c, i64 T, ActPrecision p) {
  const i64 H = c.hidden, F = c.ffn(), Z = c.heads;
  const DType a = act_dtype(p);
  using R = Role;
  return {
      {"x", {T, H}, a, R::Offloadable},            // block input = LN1 input
      {"ln1_mean", {T}, DType::F32, R::Offloadable},
      {"ln1_rstd", {T}, DType::F32, R::Offloadable},
      {"ln1_out", {T, H}, a, R::Offloadable},      // input of the qkv projection
      {"q", {T, H}, a, R::Offloadable},            // queries after RoPE
      {"k", {T, H}, a, R::Skeletal},               // keys after RoPE (KV cache)
      {"v", {T, H}, a, R::Skeletal},               // values (KV cache)
      {"attn_out", {T, H}, a, R::Offloadable},     // attention output before projection
      {"lse", {Z, T}, DType::F32, R::Offloadable}, // per-row log-sum-exp of the scores
      {"x_mid", {T, H}, a, R::Offloadable},        // residual after attention = LN2 input
      {"ln2_mean", {T}, DType::F32, R::Offloadable},
      {"ln2_rstd", {T}, DType::F32, R::Offloadable},
      {"ln2_out", {T, H}, a, R::Offloadable},      // input of the fc projection
      {"fc_pre", {T, F}, a, R::Offloadable},       // fc output before GeLU
  };
}

std::vector<TensorSpec> head_saved_specs(const ModelConfig& c, i64 T, ActPrecision p) {
  return {{"head_grad", {T, i64(c.hidden)}, act_dtype(p), Role::Offloadable}};
}

std::vector<TensorSpec> block_workspace_specs(const ModelConfig& c, i64 T, ActPrecision p) {
  const i64 H = c.hidden, F = c.ffn(), Z = c.heads;
  const DType a = act_dtype(p);
  using R = Role;
  // Forward needs qkv and the MLP activation; backward reuses them for their gradients
  // (the residual gradient runs in place in head_grad) plus one [T, H] gradient and delta.
  return {
      {"qkv", {T, 3 * H}, a, R::Workspace},
      {"mlp_act", {T, F}, a, R::Workspace},
      {"d_tmp", {T, H}, a, R::Workspace},
      {"delta", {Z, T}, DType::F32, R::Workspace},
  };
}

std::vector<TensorSpec> head_workspace_specs(const ModelConfig& c, i64 T, i64 chunk, ActPrecision p) {
  const i64 H = c.hidden, V = c.vocab;
  const i64 rows = std::min(T, chunk);
  std::vector<TensorSpec> s = {
      {"ln_f_out", {T, H}, act_dtype(p), Role::Workspace},
      {"ln_f_mean", {T}, DType::F32, Role::Workspace},
      {"ln_f_rstd", {T}, DType::F32, Role::Workspace},
      {"logits", {rows, V}, DType::F32, Role::Workspace},
      {"losses", {T}, DType::F32, Role::Workspace},
  };
  // In bf16 the loss gradient feeds the bf16 GEMMs from a buffer of its own; in fp32 it
  // overwrites the logits.
  if (p == ActPrecision::BF16) s.push_back({"dlogits", {rows, V}, DType::BF16, Role::Workspace});
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
