// A deliberately naive float64 Llama-family model (docs/design.md, Conventions 7), the companion of
// model_reference64.h: Llama 2/3, Mistral, Qwen2 and Qwen3 blocks written from their specification
// with plain loops and nothing shared with the engine (not even core/rope.h: the RoPE
// frequencies are computed here again from Hugging Face's formulas), so that tests can
// compare the engine's fp32 loss and gradients against it. Forward and an analytic
// backward; the backward is checked against central finite differences of the forward
// (tests/numerics/test_model_reference_llama.cpp).
//
// Dimension letters as in core/dims.h: S tokens, H hidden, Z query heads, G key/value heads
// (grouped-query attention: query head z reads key/value head z / (Z / G)), A head size
// (config.json's head_dim where given, else H / Z), L layers, V vocab, F the MLP's
// intermediate size. Buffers are row-major; "[S, H]" is S rows of H doubles.
//
// The model, per token row x (starting from embed.weight[token]):
//   per block:  h   = RMSNorm(x) * ln1.weight,   RMSNorm(x) = x / sqrt(mean(x^2) + eps)
//               qkv = h qkv.weight^T (+ qkv.bias)          q: Z heads, k and v: G heads
//               q, k <- RMSNorm of each head's A values * q_norm.weight, k_norm.weight
//                       (Qwen3 only; eps as the block's)
//               q, k <- RoPE at the token's position (rotate-half, see rope() below)
//               attn = causal softmax(q k^T / sqrt(A)) v    per query head, GQA
//               x   = x + attn out.weight^T
//               h2  = RMSNorm(x) * ln2.weight
//               [gate | up] = h2 fc.weight^T,   act = silu(gate) * up,  silu(g) = g / (1 + e^-g)
//               x   = x + act proj.weight^T
//   head:       logits = (RMSNorm(x) * ln_f.weight) lm_head.weight^T; mean cross-entropy.
// No biases anywhere but the optional q/k/v one (Qwen2); the LM head is its own matrix, or the
// embedding where the config ties them (c.tied_embeddings()).
//
// Parameters: one flat buffer in the export order (PyTorch Linear, [out, in]):
//   embed.weight [V, H]
//   per block l: ln1.weight [H], attn.qkv.weight [Z A + 2 G A, H] (rows: the Z query heads,
//     then G key heads, then G value heads, A consecutive rows each), attn.qkv.bias
//     [Z A + 2 G A] only with qkv_bias, attn.q_norm.weight [A] and attn.k_norm.weight [A]
//     only with query/key norms (Qwen3), attn.out.weight [H, Z A], ln2.weight [H],
//     mlp.fc.weight [2F, H] (rows [0, F) gate, [F, 2F) up), mlp.proj.weight [H, F]
//   ln_f.weight [H]
//   lm_head.weight [V, H] (none where tied)
// The layout is written out here again on purpose: tests compare it with parameter_specs().
//
// RoPE frequencies (transformers 4.46 modeling_rope_utils, in float64 here): see
// rope_frequencies() below.
//
// Accumulation rule: backward() overwrites the whole gradient buffer.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/dims.h"

namespace sppo::ref64llama {

using Vec = std::vector<double>;

// ---- RoPE frequencies ---------------------------------------------------------------

// Rotation of dims j and j + A/2 of every head by the angle pos * inv_freq[j], j < A/2, with
// cos and sin both multiplied by `scale`.
struct Rope {
  Vec inv_freq;        // A / 2 values
  double scale = 1.0;  // yarn's attention factor; 1 otherwise
};

// From c.head_size(), c.rope_theta, c.rope_scaling, c.max_positions and c.rope_seq_len:
//   base     inv_freq[j] = theta^(-2j/A), scale 1
//   linear   inv_freq[j] /= factor
//   dynamic  when rope_seq_len > max_positions (M): theta' = theta (factor rope_seq_len / M
//            - (factor - 1))^(A / (A - 2)) and the base frequencies of theta'; else unscaled
//   yarn     corr_dim(n) = A ln(M / (2 pi n)) / (2 ln theta); low = max(floor(corr_dim(beta_fast)), 0),
//            high = min(ceil(corr_dim(beta_slow)), A - 1), high += 0.001 if low == high;
//            ramp_j = clamp((j - low) / (high - low), 0, 1);
//            inv_freq[j] = inv_freq[j] / factor * ramp_j + inv_freq[j] (1 - ramp_j);
//            scale = attention_factor if > 0, else 0.1 ln(factor) + 1 if factor > 1, else 1
//   llama3   orig = original_max_positions; wavelength wl_j = 2 pi / inv_freq[j];
//            wl_j > orig / low_freq_factor: inv_freq[j] / factor;
//            orig / high_freq_factor <= wl_j <= orig / low_freq_factor: with
//            s = (orig / wl_j - low_freq_factor) / (high_freq_factor - low_freq_factor),
//            (1 - s) inv_freq[j] / factor + s inv_freq[j]; shorter wavelengths unchanged.
inline i64 head_size_of(const ModelConfig& c) { return c.head_dim > 0 ? c.head_dim : c.hidden / c.heads; }

inline Rope rope_frequencies(const ModelConfig& c) {
  const i64 A = head_size_of(c), half = A / 2;
  const RopeScaling& rs = c.rope_scaling;
  using Type = RopeScaling::Type;
  const double pi = std::numbers::pi;
  double theta = double(c.rope_theta);
  if (rs.type == Type::Dynamic && c.rope_seq_len > c.max_positions) {
    const double M = double(c.max_positions), Sx = double(c.rope_seq_len);
    theta = theta * std::pow(rs.factor * Sx / M - (rs.factor - 1.0), double(A) / double(A - 2));
  }
  Rope r;
  r.inv_freq.assign(half, 0.0);
  for (i64 j = 0; j < half; ++j) r.inv_freq[j] = std::pow(theta, -2.0 * double(j) / double(A));

  if (rs.type == Type::Linear) {
    for (i64 j = 0; j < half; ++j) r.inv_freq[j] = r.inv_freq[j] / rs.factor;
  } else if (rs.type == Type::Yarn) {
    const double M = double(c.max_positions);
    auto corr_dim = [&](double n) { return double(A) * std::log(M / (n * 2.0 * pi)) / (2.0 * std::log(theta)); };
    const double low = std::max(std::floor(corr_dim(rs.beta_fast)), 0.0);
    double high = std::min(std::ceil(corr_dim(rs.beta_slow)), double(A - 1));
    if (low == high) high += 0.001;
    for (i64 j = 0; j < half; ++j) {
      const double ramp = std::min(std::max((double(j) - low) / (high - low), 0.0), 1.0);
      r.inv_freq[j] = (r.inv_freq[j] / rs.factor) * ramp + r.inv_freq[j] * (1.0 - ramp);
    }
    if (rs.attention_factor > 0)
      r.scale = rs.attention_factor;
    else
      r.scale = rs.factor > 1.0 ? 0.1 * std::log(rs.factor) + 1.0 : 1.0;
  } else if (rs.type == Type::Llama3) {
    const double orig = double(rs.original_max_positions);
    const double low_wl = orig / rs.low_freq_factor, high_wl = orig / rs.high_freq_factor;
    for (i64 j = 0; j < half; ++j) {
      const double f = r.inv_freq[j], wl = 2.0 * pi / f;
      if (wl > low_wl) {
        r.inv_freq[j] = f / rs.factor;
      } else if (wl >= high_wl) {
        const double s = (orig / wl - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor);
        r.inv_freq[j] = (1.0 - s) * f / rs.factor + s * f;
      }
    }
  }
  return r;
}

// ---- dimensions and layout ----------------------------------------------------------

struct Dims {
  i64 V, H, L, Z, G, A, F;
  double eps;
  bool qkv_bias;
  Rope rope;
  bool causal = true;  // a Llama is causal; false (every key visible) only for tests
  bool tied = false;   // the LM head is the embedding
  bool qk_norm = false;  // Qwen3's per-head norms of q and k
  i64 keys(i64 s, i64 S) const { return causal ? s + 1 : S; }
  i64 group() const { return Z / G; }  // query heads per key/value head
  i64 kv_width() const { return G * A; }
  i64 qkv_width() const { return Z * A + 2 * G * A; }
};

inline Dims dims_of(const ModelConfig& c) {
  const i64 Z = c.heads, G = c.kv_heads > 0 ? c.kv_heads : c.heads;
  const i64 F = c.ffn_size > 0 ? c.ffn_size : i64(c.ffn_mult) * c.hidden;
  return Dims{c.vocab,        c.hidden,           c.layers,   Z, G, head_size_of(c), F, double(c.ln_eps), c.qkv_bias,
              rope_frequencies(c), c.causal, c.tied_embeddings(), c.qk_norm};
}

struct Tensor {
  std::string name;
  std::vector<i64> shape;
  i64 offset = 0;
  i64 numel = 0;
};

struct BlockOffsets {
  i64 ln1_w, qkv_w, qkv_b, q_norm_w, k_norm_w, out_w, ln2_w, fc_w, proj_w;  // -1: the model has none
};

struct Layout {
  std::vector<Tensor> tensors;  // export order
  i64 embed = 0;
  std::vector<BlockOffsets> blocks;
  i64 lnf_w = 0, lm_head = 0;
  i64 total = 0;
};

inline Layout layout_of(const Dims& d) {
  Layout lay;
  auto add = [&](const std::string& name, std::vector<i64> shape) {
    i64 n = 1;
    for (i64 s : shape) n *= s;
    lay.tensors.push_back(Tensor{name, shape, lay.total, n});
    lay.total += n;
    return lay.tensors.back().offset;
  };
  const i64 H = d.H, F = d.F, Q = d.qkv_width(), ZA = d.Z * d.A;
  lay.embed = add("embed.weight", {d.V, H});
  for (i64 l = 0; l < d.L; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".";
    BlockOffsets o{};
    o.ln1_w = add(b + "ln1.weight", {H});
    o.qkv_w = add(b + "attn.qkv.weight", {Q, H});
    o.qkv_b = d.qkv_bias ? add(b + "attn.qkv.bias", {Q}) : -1;
    o.q_norm_w = d.qk_norm ? add(b + "attn.q_norm.weight", {d.A}) : -1;
    o.k_norm_w = d.qk_norm ? add(b + "attn.k_norm.weight", {d.A}) : -1;
    o.out_w = add(b + "attn.out.weight", {H, ZA});
    o.ln2_w = add(b + "ln2.weight", {H});
    o.fc_w = add(b + "mlp.fc.weight", {2 * F, H});
    o.proj_w = add(b + "mlp.proj.weight", {H, F});
    lay.blocks.push_back(o);
  }
  lay.lnf_w = add("ln_f.weight", {H});
  // A tied head is the embedding: its gradient adds into embed.weight's.
  lay.lm_head = d.tied ? lay.embed : add("lm_head.weight", {d.V, H});
  return lay;
}

// ---- pieces, forward beside backward -------------------------------------------------

// y[S, O] = x[S, I] W[O, I]^T (+ b[O] when b is non-null)
inline void linear(Vec& y, const Vec& x, const double* W, const double* b, i64 S, i64 I, i64 O) {
  y.assign(S * O, 0.0);
  for (i64 s = 0; s < S; ++s)
    for (i64 o = 0; o < O; ++o) {
      double acc = b ? b[o] : 0.0;
      for (i64 i = 0; i < I; ++i) acc += W[o * I + i] * x[s * I + i];
      y[s * O + o] = acc;
    }
}

// dx[S, I] = dy W (overwritten); dW[O, I] += dy^T x; db[O] += sum_s dy when db is non-null.
inline void linear_back(Vec& dx, double* dW, double* db, const Vec& dy, const Vec& x, const double* W,
                        i64 S, i64 I, i64 O) {
  dx.assign(S * I, 0.0);
  for (i64 s = 0; s < S; ++s)
    for (i64 o = 0; o < O; ++o) {
      const double g = dy[s * O + o];
      if (db) db[o] += g;
      for (i64 i = 0; i < I; ++i) {
        dW[o * I + i] += g * x[s * I + i];
        dx[s * I + i] += g * W[o * I + i];
      }
    }
}

// y = xhat * w per row, xhat = x * rstd, rstd = 1 / sqrt(mean(x^2) + eps). Saves xhat, rstd.
inline void rms_norm(Vec& y, Vec& xhat, Vec& rstd, const Vec& x, const double* w, i64 S, i64 H, double eps) {
  y.assign(S * H, 0.0);
  xhat.assign(S * H, 0.0);
  rstd.assign(S, 0.0);
  for (i64 s = 0; s < S; ++s) {
    double ms = 0.0;
    for (i64 h = 0; h < H; ++h) ms += x[s * H + h] * x[s * H + h];
    ms /= double(H);
    rstd[s] = 1.0 / std::sqrt(ms + eps);
    for (i64 h = 0; h < H; ++h) {
      xhat[s * H + h] = x[s * H + h] * rstd[s];
      y[s * H + h] = xhat[s * H + h] * w[h];
    }
  }
}

// dx = rstd (g - xhat mean(g xhat)) with g = dy w (overwritten); dw += dy xhat.
// (d rstd / d x_j = -rstd^3 x_j / H, so d/dx_j sum_i g_i x_i rstd = rstd g_j - xhat_j mean(g xhat) rstd.)
inline void rms_norm_back(Vec& dx, double* dw, const Vec& dy, const Vec& xhat, const Vec& rstd, const double* w,
                          i64 S, i64 H) {
  dx.assign(S * H, 0.0);
  for (i64 s = 0; s < S; ++s) {
    double mgx = 0.0;
    for (i64 h = 0; h < H; ++h) {
      const double g = dy[s * H + h] * w[h];
      dw[h] += dy[s * H + h] * xhat[s * H + h];
      mgx += g * xhat[s * H + h];
    }
    mgx /= double(H);
    for (i64 h = 0; h < H; ++h) {
      const double g = dy[s * H + h] * w[h];
      dx[s * H + h] = rstd[s] * (g - xhat[s * H + h] * mgx);
    }
  }
}

inline double sigmoid(double g) { return 1.0 / (1.0 + std::exp(-g)); }
inline double silu(double g) { return g * sigmoid(g); }
// d silu / dg = sigmoid(g) (1 + g (1 - sigmoid(g)))
inline double silu_grad(double g) {
  const double sg = sigmoid(g);
  return sg * (1.0 + g * (1.0 - sg));
}

// Rotate-half RoPE on every one of the `heads` heads of x[S, heads * A], in place: for
// j < A/2, angle = pos * inv_freq[j], (x_j, x_{j+A/2}) -> m (x_j cos - x_{j+A/2} sin,
// x_{j+A/2} cos + x_j sin) with m = rope.scale. `sign` = -1 applies the transpose m R(-angle),
// which is the backward (for m = 1 the inverse as well).
inline void rope(Vec& x, const std::vector<i64>& pos, i64 S, i64 heads, const Dims& d, double sign) {
  const i64 half = d.A / 2, W = heads * d.A;
  const double m = d.rope.scale;
  for (i64 s = 0; s < S; ++s)
    for (i64 z = 0; z < heads; ++z)
      for (i64 j = 0; j < half; ++j) {
        const double angle = sign * double(pos[s]) * d.rope.inv_freq[j];
        const double c = m * std::cos(angle), sn = m * std::sin(angle);
        double& a = x[s * W + z * d.A + j];
        double& b = x[s * W + z * d.A + j + half];
        const double a0 = a, b0 = b;
        a = a0 * c - b0 * sn;
        b = b0 * c + a0 * sn;
      }
}

// ---- the model ----------------------------------------------------------------------

struct BlockCache {
  Vec x;                       // [S, H] block input
  Vec ln1_out, ln1_xhat, ln1_rstd;
  Vec q_xhat, q_rstd, k_xhat, k_rstd;  // the query/key norms' (qk_norm): [S Z, A], [S Z], ...
  Vec q;                       // [S, Z A] after RoPE
  Vec k, v;                    // [S, G A], k after RoPE
  Vec probs;                   // [Z, S, S] softmax (zero above the diagonal when causal)
  Vec attn;                    // [S, Z A] attention output before projection
  Vec x_mid;                   // [S, H]
  Vec ln2_out, ln2_xhat, ln2_rstd;
  Vec gu;                      // [S, 2F] gate | up
  Vec act;                     // [S, F] silu(gate) * up
};

struct Cache {
  std::vector<BlockCache> blocks;
  Vec x_final;                 // [S, H]
  Vec lnf_out, lnf_xhat, lnf_rstd;
  Vec probs;                   // [S, V] softmax of the logits
};

// Mean cross-entropy of tokens[1..S] given tokens[0..S), or, with `targets`, of targets[s]
// at every s where it is not -1. `pos` are the RoPE positions of the S inputs; empty means
// 0..S-1. Fills `cache` when non-null. (The same conventions as ref64::forward.)
inline double forward(const Dims& d, const double* p, const std::int32_t* tokens, i64 S,
                      Cache* cache = nullptr, std::vector<i64> pos = {}, const std::int32_t* targets = nullptr) {
  const Layout lay = layout_of(d);
  const i64 H = d.H, A = d.A, F = d.F, V = d.V, Q = d.qkv_width(), KW = d.kv_width(), ZA = d.Z * d.A;
  if (pos.empty())
    for (i64 s = 0; s < S; ++s) pos.push_back(s);
  Cache local;
  Cache& c = cache ? *cache : local;
  c.blocks.assign(d.L, BlockCache{});

  Vec x(S * H);
  for (i64 s = 0; s < S; ++s)
    for (i64 h = 0; h < H; ++h) x[s * H + h] = p[lay.embed + tokens[s] * H + h];

  const double scale = 1.0 / std::sqrt(double(A));
  for (i64 l = 0; l < d.L; ++l) {
    const BlockOffsets& o = lay.blocks[l];
    BlockCache& b = c.blocks[l];
    b.x = x;
    rms_norm(b.ln1_out, b.ln1_xhat, b.ln1_rstd, x, p + o.ln1_w, S, H, d.eps);
    Vec qkv;
    linear(qkv, b.ln1_out, p + o.qkv_w, o.qkv_b >= 0 ? p + o.qkv_b : nullptr, S, H, Q);
    b.q.assign(S * ZA, 0.0);
    b.k.assign(S * KW, 0.0);
    b.v.assign(S * KW, 0.0);
    for (i64 s = 0; s < S; ++s) {
      for (i64 i = 0; i < ZA; ++i) b.q[s * ZA + i] = qkv[s * Q + i];
      for (i64 i = 0; i < KW; ++i) {
        b.k[s * KW + i] = qkv[s * Q + ZA + i];
        b.v[s * KW + i] = qkv[s * Q + ZA + KW + i];
      }
    }
    if (d.qk_norm) {  // each head's A values as one row: [S Z, A] and [S G, A]
      const Vec q_pre = b.q, k_pre = b.k;
      rms_norm(b.q, b.q_xhat, b.q_rstd, q_pre, p + o.q_norm_w, S * d.Z, A, d.eps);
      rms_norm(b.k, b.k_xhat, b.k_rstd, k_pre, p + o.k_norm_w, S * d.G, A, d.eps);
    }
    rope(b.q, pos, S, d.Z, d, 1.0);
    rope(b.k, pos, S, d.G, d, 1.0);

    b.probs.assign(d.Z * S * S, 0.0);
    b.attn.assign(S * ZA, 0.0);
    for (i64 z = 0; z < d.Z; ++z) {
      const i64 g = z / d.group();  // the key/value head of query head z
      for (i64 s = 0; s < S; ++s) {
        double* pr = &b.probs[(z * S + s) * S];
        double mx = -std::numeric_limits<double>::infinity();
        for (i64 t = 0; t < d.keys(s, S); ++t) {
          double dot = 0.0;
          for (i64 a = 0; a < A; ++a) dot += b.q[s * ZA + z * A + a] * b.k[t * KW + g * A + a];
          pr[t] = dot * scale;
          mx = std::max(mx, pr[t]);
        }
        double sum = 0.0;
        for (i64 t = 0; t < d.keys(s, S); ++t) sum += (pr[t] = std::exp(pr[t] - mx));
        for (i64 t = 0; t < d.keys(s, S); ++t) pr[t] /= sum;
        for (i64 a = 0; a < A; ++a) {
          double acc = 0.0;
          for (i64 t = 0; t < d.keys(s, S); ++t) acc += pr[t] * b.v[t * KW + g * A + a];
          b.attn[s * ZA + z * A + a] = acc;
        }
      }
    }
    Vec y;
    linear(y, b.attn, p + o.out_w, nullptr, S, ZA, H);
    for (i64 i = 0; i < S * H; ++i) x[i] += y[i];

    b.x_mid = x;
    rms_norm(b.ln2_out, b.ln2_xhat, b.ln2_rstd, x, p + o.ln2_w, S, H, d.eps);
    linear(b.gu, b.ln2_out, p + o.fc_w, nullptr, S, H, 2 * F);
    b.act.assign(S * F, 0.0);
    for (i64 s = 0; s < S; ++s)
      for (i64 f = 0; f < F; ++f) b.act[s * F + f] = silu(b.gu[s * 2 * F + f]) * b.gu[s * 2 * F + F + f];
    linear(y, b.act, p + o.proj_w, nullptr, S, F, H);
    for (i64 i = 0; i < S * H; ++i) x[i] += y[i];
  }

  c.x_final = x;
  rms_norm(c.lnf_out, c.lnf_xhat, c.lnf_rstd, x, p + lay.lnf_w, S, H, d.eps);
  c.probs.assign(S * V, 0.0);
  double loss = 0.0;
  i64 counted = 0;
  for (i64 s = 0; s < S; ++s) {
    double* pr = &c.probs[s * V];
    double mx = -std::numeric_limits<double>::infinity();
    for (i64 v = 0; v < V; ++v) {
      double acc = 0.0;
      for (i64 h = 0; h < H; ++h) acc += c.lnf_out[s * H + h] * p[lay.lm_head + v * H + h];
      pr[v] = acc;
      mx = std::max(mx, acc);
    }
    double sum = 0.0;
    for (i64 v = 0; v < V; ++v) sum += std::exp(pr[v] - mx);
    const i64 target = targets ? targets[s] : tokens[s + 1];
    if (target >= 0) {
      loss += mx + std::log(sum) - pr[target];
      ++counted;
    }
    for (i64 v = 0; v < V; ++v) pr[v] = std::exp(pr[v] - mx) / sum;
  }
  return loss / double(counted);
}

// Gradient of forward()'s mean loss w.r.t. every parameter, from a filled cache (the same
// tokens, positions and targets). `grad` (lay.total doubles) is overwritten.
inline void backward(const Dims& d, const double* p, const std::int32_t* tokens, i64 S, const Cache& c,
                     double* grad, std::vector<i64> pos = {}, const std::int32_t* targets = nullptr) {
  const Layout lay = layout_of(d);
  const i64 H = d.H, A = d.A, F = d.F, V = d.V, Q = d.qkv_width(), KW = d.kv_width(), ZA = d.Z * d.A;
  if (pos.empty())
    for (i64 s = 0; s < S; ++s) pos.push_back(s);
  for (i64 i = 0; i < lay.total; ++i) grad[i] = 0.0;

  // LM head: dlogits = (softmax - onehot) / (positions predicted); logits = lnf_out lm_head^T.
  auto target = [&](i64 s) -> i64 { return targets ? targets[s] : tokens[s + 1]; };
  i64 counted = 0;
  for (i64 s = 0; s < S; ++s) counted += target(s) >= 0;
  Vec dlnf(S * H, 0.0);
  for (i64 s = 0; s < S; ++s) {
    if (target(s) < 0) continue;
    for (i64 v = 0; v < V; ++v) {
      const double g = (c.probs[s * V + v] - (v == target(s) ? 1.0 : 0.0)) / double(counted);
      for (i64 h = 0; h < H; ++h) {
        dlnf[s * H + h] += g * p[lay.lm_head + v * H + h];
        grad[lay.lm_head + v * H + h] += g * c.lnf_out[s * H + h];
      }
    }
  }
  Vec dx;
  rms_norm_back(dx, grad + lay.lnf_w, dlnf, c.lnf_xhat, c.lnf_rstd, p + lay.lnf_w, S, H);

  const double scale = 1.0 / std::sqrt(double(A));
  for (i64 l = d.L - 1; l >= 0; --l) {
    const BlockOffsets& o = lay.blocks[l];
    const BlockCache& b = c.blocks[l];
    // MLP: x_out = x_mid + proj(silu(gate) * up), [gate | up] = fc(RMSNorm2(x_mid)).
    Vec dact, dgu(S * 2 * F), dln2, dmid;
    linear_back(dact, grad + o.proj_w, nullptr, dx, b.act, p + o.proj_w, S, F, H);
    for (i64 s = 0; s < S; ++s)
      for (i64 f = 0; f < F; ++f) {
        const double gate = b.gu[s * 2 * F + f], up = b.gu[s * 2 * F + F + f], da = dact[s * F + f];
        dgu[s * 2 * F + f] = da * up * silu_grad(gate);
        dgu[s * 2 * F + F + f] = da * silu(gate);
      }
    linear_back(dln2, grad + o.fc_w, nullptr, dgu, b.ln2_out, p + o.fc_w, S, H, 2 * F);
    rms_norm_back(dmid, grad + o.ln2_w, dln2, b.ln2_xhat, b.ln2_rstd, p + o.ln2_w, S, H);
    for (i64 i = 0; i < S * H; ++i) dx[i] += dmid[i];

    // Attention: x_mid = x + out(attn(RMSNorm1(x))). Key/value head g collects the
    // gradients of all Z / G query heads that read it.
    Vec dattn;
    linear_back(dattn, grad + o.out_w, nullptr, dx, b.attn, p + o.out_w, S, ZA, H);
    Vec dq(S * ZA, 0.0), dk(S * KW, 0.0), dv(S * KW, 0.0);
    for (i64 z = 0; z < d.Z; ++z) {
      const i64 g = z / d.group();
      for (i64 s = 0; s < S; ++s) {
        const double* pr = &b.probs[(z * S + s) * S];
        Vec dp(d.keys(s, S), 0.0);
        double pdp = 0.0;
        for (i64 t = 0; t < d.keys(s, S); ++t) {
          for (i64 a = 0; a < A; ++a) {
            dp[t] += dattn[s * ZA + z * A + a] * b.v[t * KW + g * A + a];
            dv[t * KW + g * A + a] += pr[t] * dattn[s * ZA + z * A + a];
          }
          pdp += pr[t] * dp[t];
        }
        for (i64 t = 0; t < d.keys(s, S); ++t) {
          const double ds = pr[t] * (dp[t] - pdp) * scale;
          for (i64 a = 0; a < A; ++a) {
            dq[s * ZA + z * A + a] += ds * b.k[t * KW + g * A + a];
            dk[t * KW + g * A + a] += ds * b.q[s * ZA + z * A + a];
          }
        }
      }
    }
    rope(dq, pos, S, d.Z, d, -1.0);
    rope(dk, pos, S, d.G, d, -1.0);
    if (d.qk_norm) {
      Vec dq_pre, dk_pre;
      rms_norm_back(dq_pre, grad + o.q_norm_w, dq, b.q_xhat, b.q_rstd, p + o.q_norm_w, S * d.Z, A);
      rms_norm_back(dk_pre, grad + o.k_norm_w, dk, b.k_xhat, b.k_rstd, p + o.k_norm_w, S * d.G, A);
      dq = dq_pre;
      dk = dk_pre;
    }
    Vec dqkv(S * Q);
    for (i64 s = 0; s < S; ++s) {
      for (i64 i = 0; i < ZA; ++i) dqkv[s * Q + i] = dq[s * ZA + i];
      for (i64 i = 0; i < KW; ++i) {
        dqkv[s * Q + ZA + i] = dk[s * KW + i];
        dqkv[s * Q + ZA + KW + i] = dv[s * KW + i];
      }
    }
    Vec dln1, din;
    linear_back(dln1, grad + o.qkv_w, o.qkv_b >= 0 ? grad + o.qkv_b : nullptr, dqkv, b.ln1_out, p + o.qkv_w, S,
                H, Q);
    rms_norm_back(din, grad + o.ln1_w, dln1, b.ln1_xhat, b.ln1_rstd, p + o.ln1_w, S, H);
    for (i64 i = 0; i < S * H; ++i) dx[i] += din[i];
  }

  for (i64 s = 0; s < S; ++s)
    for (i64 h = 0; h < H; ++h) grad[lay.embed + tokens[s] * H + h] += dx[s * H + h];
}

}  // namespace sppo::ref64llama
