// A deliberately naive float64 GPT (docs/design.md, Conventions 7): the model of
// docs/design.md 2 / issue 2 written from its specification with plain loops, no blocking,
// no fused kernels and nothing shared with the engine, so that tests can compare the
// engine's fp32 loss and gradients against it. Forward and an analytic backward; the
// backward itself is checked against central finite differences of the forward
// (tests/numerics/test_model_reference.cpp).
//
// Dimension letters as in core/dims.h: S tokens, H hidden, Z heads, A = H / Z head size,
// L layers, V vocab, F = 4H. Buffers are row-major; "[S, H]" is S rows of H doubles.
//
// Parameters: one flat buffer in the documented export order (PyTorch Linear, [out, in]):
//   embed.weight [V, H]
//   per block l: ln1.weight [H], ln1.bias [H], attn.qkv.weight [3H, H], attn.qkv.bias [3H],
//     attn.out.weight [H, H], attn.out.bias [H], ln2.weight [H], ln2.bias [H],
//     mlp.fc.weight [F, H], mlp.fc.bias [F], mlp.proj.weight [H, F], mlp.proj.bias [H]
//   ln_f.weight [H], ln_f.bias [H]
// The layout is written out here again on purpose: tests compare it with parameter_specs().
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

namespace sppo::ref64 {

using Vec = std::vector<double>;

struct Dims {
  i64 V, H, L, Z, A, F;
  double theta, eps;
  bool causal = true;  // false: every position attends to every other
  // The keys query s attends to: 0..s, or all S.
  i64 keys(i64 s, i64 S) const { return causal ? s + 1 : S; }
};

inline Dims dims_of(const ModelConfig& c) {
  return Dims{c.vocab, c.hidden, c.layers, c.heads, c.hidden / c.heads, i64(c.ffn_mult) * c.hidden,
              double(c.rope_theta), double(c.ln_eps), c.causal};
}

struct Tensor {
  std::string name;
  std::vector<i64> shape;
  i64 offset = 0;
  i64 numel = 0;
};

struct BlockOffsets {
  i64 ln1_w, ln1_b, qkv_w, qkv_b, out_w, out_b, ln2_w, ln2_b, fc_w, fc_b, proj_w, proj_b;
};

struct Layout {
  std::vector<Tensor> tensors;  // export order
  i64 embed = 0;
  std::vector<BlockOffsets> blocks;
  i64 lnf_w = 0, lnf_b = 0;
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
  const i64 H = d.H, F = d.F;
  lay.embed = add("embed.weight", {d.V, H});
  for (i64 l = 0; l < d.L; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".";
    BlockOffsets o{};
    o.ln1_w = add(b + "ln1.weight", {H});
    o.ln1_b = add(b + "ln1.bias", {H});
    o.qkv_w = add(b + "attn.qkv.weight", {3 * H, H});
    o.qkv_b = add(b + "attn.qkv.bias", {3 * H});
    o.out_w = add(b + "attn.out.weight", {H, H});
    o.out_b = add(b + "attn.out.bias", {H});
    o.ln2_w = add(b + "ln2.weight", {H});
    o.ln2_b = add(b + "ln2.bias", {H});
    o.fc_w = add(b + "mlp.fc.weight", {F, H});
    o.fc_b = add(b + "mlp.fc.bias", {F});
    o.proj_w = add(b + "mlp.proj.weight", {H, F});
    o.proj_b = add(b + "mlp.proj.bias", {H});
    lay.blocks.push_back(o);
  }
  lay.lnf_w = add("ln_f.weight", {H});
  lay.lnf_b = add("ln_f.bias", {H});
  return lay;
}

// ---- pieces, forward beside backward -------------------------------------------------

// y[S, O] = x[S, I] W[O, I]^T + b[O]
inline void linear(Vec& y, const Vec& x, const double* W, const double* b, i64 S, i64 I, i64 O) {
  y.assign(S * O, 0.0);
  for (i64 s = 0; s < S; ++s)
    for (i64 o = 0; o < O; ++o) {
      double acc = b[o];
      for (i64 i = 0; i < I; ++i) acc += W[o * I + i] * x[s * I + i];
      y[s * O + o] = acc;
    }
}

// dx[S, I] = dy W (overwritten); dW[O, I] += dy^T x; db[O] += sum_s dy.
inline void linear_back(Vec& dx, double* dW, double* db, const Vec& dy, const Vec& x, const double* W,
                        i64 S, i64 I, i64 O) {
  dx.assign(S * I, 0.0);
  for (i64 s = 0; s < S; ++s)
    for (i64 o = 0; o < O; ++o) {
      const double g = dy[s * O + o];
      db[o] += g;
      for (i64 i = 0; i < I; ++i) {
        dW[o * I + i] += g * x[s * I + i];
        dx[s * I + i] += g * W[o * I + i];
      }
    }
}

// y = (x - mean) / sqrt(var + eps) * w + b per row, biased variance. Saves xhat and rstd.
inline void layer_norm(Vec& y, Vec& xhat, Vec& rstd, const Vec& x, const double* w, const double* b,
                       i64 S, i64 H, double eps) {
  y.assign(S * H, 0.0);
  xhat.assign(S * H, 0.0);
  rstd.assign(S, 0.0);
  for (i64 s = 0; s < S; ++s) {
    double mean = 0.0;
    for (i64 h = 0; h < H; ++h) mean += x[s * H + h];
    mean /= double(H);
    double var = 0.0;
    for (i64 h = 0; h < H; ++h) var += (x[s * H + h] - mean) * (x[s * H + h] - mean);
    var /= double(H);
    rstd[s] = 1.0 / std::sqrt(var + eps);
    for (i64 h = 0; h < H; ++h) {
      xhat[s * H + h] = (x[s * H + h] - mean) * rstd[s];
      y[s * H + h] = xhat[s * H + h] * w[h] + b[h];
    }
  }
}

// dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy w (overwritten); dw, db +=.
inline void layer_norm_back(Vec& dx, double* dw, double* db, const Vec& dy, const Vec& xhat,
                            const Vec& rstd, const double* w, i64 S, i64 H) {
  dx.assign(S * H, 0.0);
  for (i64 s = 0; s < S; ++s) {
    double mg = 0.0, mgx = 0.0;
    for (i64 h = 0; h < H; ++h) {
      const double g = dy[s * H + h] * w[h];
      dw[h] += dy[s * H + h] * xhat[s * H + h];
      db[h] += dy[s * H + h];
      mg += g;
      mgx += g * xhat[s * H + h];
    }
    mg /= double(H);
    mgx /= double(H);
    for (i64 h = 0; h < H; ++h) {
      const double g = dy[s * H + h] * w[h];
      dx[s * H + h] = rstd[s] * (g - mg - xhat[s * H + h] * mgx);
    }
  }
}

constexpr double kGeluC = 0.044715;

inline double gelu(double x) {
  const double k = std::sqrt(2.0 / std::numbers::pi);
  return 0.5 * x * (1.0 + std::tanh(k * (x + kGeluC * x * x * x)));
}

inline double gelu_grad(double x) {
  const double k = std::sqrt(2.0 / std::numbers::pi);
  const double t = std::tanh(k * (x + kGeluC * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * kGeluC * x * x);
}

// Rotate-half RoPE on every head of x[S, H], in place: for j < A/2, angle = pos * theta^(-2j/A),
// (x_j, x_{j+A/2}) -> (x_j cos - x_{j+A/2} sin, x_{j+A/2} cos + x_j sin). `sign` = -1 applies
// the inverse (= transposed) rotation, which is the backward.
inline void rope(Vec& x, const std::vector<i64>& pos, i64 S, const Dims& d, double sign) {
  const i64 half = d.A / 2;
  for (i64 s = 0; s < S; ++s)
    for (i64 z = 0; z < d.Z; ++z)
      for (i64 j = 0; j < half; ++j) {
        const double angle = sign * double(pos[s]) * std::pow(d.theta, -2.0 * double(j) / double(d.A));
        const double c = std::cos(angle), sn = std::sin(angle);
        double& a = x[s * d.H + z * d.A + j];
        double& b = x[s * d.H + z * d.A + j + half];
        const double a0 = a, b0 = b;
        a = a0 * c - b0 * sn;
        b = b0 * c + a0 * sn;
      }
}

// ---- the model ----------------------------------------------------------------------

struct BlockCache {
  Vec x;                       // [S, H] block input
  Vec ln1_out, ln1_xhat, ln1_rstd;
  Vec q, k, v;                 // [S, H] q, k after RoPE
  Vec probs;                   // [Z, S, S] causal softmax (zero above the diagonal)
  Vec attn;                    // [S, H] attention output before projection
  Vec x_mid;                   // [S, H]
  Vec ln2_out, ln2_xhat, ln2_rstd;
  Vec fc_pre, act;             // [S, F]
};

struct Cache {
  std::vector<BlockCache> blocks;
  Vec x_final;                 // [S, H]
  Vec lnf_out, lnf_xhat, lnf_rstd;
  Vec probs;                   // [S, V] softmax of the logits
};

// Mean cross-entropy of tokens[1..S] given tokens[0..S), or, with `targets` (masked-token
// training), of targets[s] at every s where it is not -1. `pos` are the RoPE positions of the
// S inputs; empty means the global indices 0..S-1 (the model's definition; tests pass other
// positions only to show that a wrong choice is detectable). Fills `cache` when non-null.
inline double forward(const Dims& d, const double* p, const std::int32_t* tokens, i64 S,
                      Cache* cache = nullptr, std::vector<i64> pos = {}, const std::int32_t* targets = nullptr) {
  const Layout lay = layout_of(d);
  const i64 H = d.H, A = d.A, F = d.F, V = d.V;
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
    layer_norm(b.ln1_out, b.ln1_xhat, b.ln1_rstd, x, p + o.ln1_w, p + o.ln1_b, S, H, d.eps);
    Vec qkv;
    linear(qkv, b.ln1_out, p + o.qkv_w, p + o.qkv_b, S, H, 3 * H);
    b.q.assign(S * H, 0.0);
    b.k.assign(S * H, 0.0);
    b.v.assign(S * H, 0.0);
    for (i64 s = 0; s < S; ++s)
      for (i64 h = 0; h < H; ++h) {
        b.q[s * H + h] = qkv[s * 3 * H + h];
        b.k[s * H + h] = qkv[s * 3 * H + H + h];
        b.v[s * H + h] = qkv[s * 3 * H + 2 * H + h];
      }
    rope(b.q, pos, S, d, 1.0);
    rope(b.k, pos, S, d, 1.0);

    b.probs.assign(d.Z * S * S, 0.0);
    b.attn.assign(S * H, 0.0);
    for (i64 z = 0; z < d.Z; ++z)
      for (i64 s = 0; s < S; ++s) {
        double* pr = &b.probs[(z * S + s) * S];
        double mx = -std::numeric_limits<double>::infinity();
        for (i64 t = 0; t < d.keys(s, S); ++t) {
          double dot = 0.0;
          for (i64 a = 0; a < A; ++a) dot += b.q[s * H + z * A + a] * b.k[t * H + z * A + a];
          pr[t] = dot * scale;
          mx = std::max(mx, pr[t]);
        }
        double sum = 0.0;
        for (i64 t = 0; t < d.keys(s, S); ++t) sum += (pr[t] = std::exp(pr[t] - mx));
        for (i64 t = 0; t < d.keys(s, S); ++t) pr[t] /= sum;
        for (i64 a = 0; a < A; ++a) {
          double acc = 0.0;
          for (i64 t = 0; t < d.keys(s, S); ++t) acc += pr[t] * b.v[t * H + z * A + a];
          b.attn[s * H + z * A + a] = acc;
        }
      }
    Vec y;
    linear(y, b.attn, p + o.out_w, p + o.out_b, S, H, H);
    for (i64 i = 0; i < S * H; ++i) x[i] += y[i];

    b.x_mid = x;
    layer_norm(b.ln2_out, b.ln2_xhat, b.ln2_rstd, x, p + o.ln2_w, p + o.ln2_b, S, H, d.eps);
    linear(b.fc_pre, b.ln2_out, p + o.fc_w, p + o.fc_b, S, H, F);
    b.act.assign(S * F, 0.0);
    for (i64 i = 0; i < S * F; ++i) b.act[i] = gelu(b.fc_pre[i]);
    linear(y, b.act, p + o.proj_w, p + o.proj_b, S, F, H);
    for (i64 i = 0; i < S * H; ++i) x[i] += y[i];
  }

  c.x_final = x;
  layer_norm(c.lnf_out, c.lnf_xhat, c.lnf_rstd, x, p + lay.lnf_w, p + lay.lnf_b, S, H, d.eps);
  c.probs.assign(S * V, 0.0);
  double loss = 0.0;
  i64 counted = 0;
  for (i64 s = 0; s < S; ++s) {
    double* pr = &c.probs[s * V];
    double mx = -std::numeric_limits<double>::infinity();
    for (i64 v = 0; v < V; ++v) {
      double acc = 0.0;
      for (i64 h = 0; h < H; ++h) acc += c.lnf_out[s * H + h] * p[lay.embed + v * H + h];
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

// Gradient of forward()'s mean loss w.r.t. every parameter, from a filled cache. `grad`
// (lay.total doubles) is overwritten.
inline void backward(const Dims& d, const double* p, const std::int32_t* tokens, i64 S, const Cache& c,
                     double* grad, std::vector<i64> pos = {}, const std::int32_t* targets = nullptr) {
  const Layout lay = layout_of(d);
  const i64 H = d.H, A = d.A, F = d.F, V = d.V;
  if (pos.empty())
    for (i64 s = 0; s < S; ++s) pos.push_back(s);
  for (i64 i = 0; i < lay.total; ++i) grad[i] = 0.0;

  // LM head: dlogits = (softmax - onehot) / (positions predicted); logits = lnf_out embed^T.
  auto target = [&](i64 s) -> i64 { return targets ? targets[s] : tokens[s + 1]; };
  i64 counted = 0;
  for (i64 s = 0; s < S; ++s) counted += target(s) >= 0;
  Vec dlnf(S * H, 0.0);
  for (i64 s = 0; s < S; ++s)
    for (i64 v = 0; v < V; ++v) {
      if (target(s) < 0) break;
      const double g = (c.probs[s * V + v] - (v == target(s) ? 1.0 : 0.0)) / double(counted);
      for (i64 h = 0; h < H; ++h) {
        dlnf[s * H + h] += g * p[lay.embed + v * H + h];
        grad[lay.embed + v * H + h] += g * c.lnf_out[s * H + h];
      }
    }
  Vec dx;
  layer_norm_back(dx, grad + lay.lnf_w, grad + lay.lnf_b, dlnf, c.lnf_xhat, c.lnf_rstd, p + lay.lnf_w,
                  S, H);

  const double scale = 1.0 / std::sqrt(double(A));
  for (i64 l = d.L - 1; l >= 0; --l) {
    const BlockOffsets& o = lay.blocks[l];
    const BlockCache& b = c.blocks[l];
    // MLP: x_out = x_mid + proj(gelu(fc(LN2(x_mid)))).
    Vec dact, dfc(S * F), dln2, dmid;
    linear_back(dact, grad + o.proj_w, grad + o.proj_b, dx, b.act, p + o.proj_w, S, F, H);
    for (i64 i = 0; i < S * F; ++i) dfc[i] = dact[i] * gelu_grad(b.fc_pre[i]);
    linear_back(dln2, grad + o.fc_w, grad + o.fc_b, dfc, b.ln2_out, p + o.fc_w, S, H, F);
    layer_norm_back(dmid, grad + o.ln2_w, grad + o.ln2_b, dln2, b.ln2_xhat, b.ln2_rstd, p + o.ln2_w, S, H);
    for (i64 i = 0; i < S * H; ++i) dx[i] += dmid[i];

    // Attention: x_mid = x + out(attn(LN1(x))).
    Vec dattn;
    linear_back(dattn, grad + o.out_w, grad + o.out_b, dx, b.attn, p + o.out_w, S, H, H);
    Vec dq(S * H, 0.0), dk(S * H, 0.0), dv(S * H, 0.0);
    for (i64 z = 0; z < d.Z; ++z)
      for (i64 s = 0; s < S; ++s) {
        const double* pr = &b.probs[(z * S + s) * S];
        Vec dp(d.keys(s, S), 0.0);
        double pdp = 0.0;
        for (i64 t = 0; t < d.keys(s, S); ++t) {
          for (i64 a = 0; a < A; ++a) {
            dp[t] += dattn[s * H + z * A + a] * b.v[t * H + z * A + a];
            dv[t * H + z * A + a] += pr[t] * dattn[s * H + z * A + a];
          }
          pdp += pr[t] * dp[t];
        }
        for (i64 t = 0; t < d.keys(s, S); ++t) {
          const double ds = pr[t] * (dp[t] - pdp) * scale;
          for (i64 a = 0; a < A; ++a) {
            dq[s * H + z * A + a] += ds * b.k[t * H + z * A + a];
            dk[t * H + z * A + a] += ds * b.q[s * H + z * A + a];
          }
        }
      }
    rope(dq, pos, S, d, -1.0);
    rope(dk, pos, S, d, -1.0);
    Vec dqkv(S * 3 * H);
    for (i64 s = 0; s < S; ++s)
      for (i64 h = 0; h < H; ++h) {
        dqkv[s * 3 * H + h] = dq[s * H + h];
        dqkv[s * 3 * H + H + h] = dk[s * H + h];
        dqkv[s * 3 * H + 2 * H + h] = dv[s * H + h];
      }
    Vec dln1, din;
    linear_back(dln1, grad + o.qkv_w, grad + o.qkv_b, dqkv, b.ln1_out, p + o.qkv_w, S, H, 3 * H);
    layer_norm_back(din, grad + o.ln1_w, grad + o.ln1_b, dln1, b.ln1_xhat, b.ln1_rstd, p + o.ln1_w, S, H);
    for (i64 i = 0; i < S * H; ++i) dx[i] += din[i];
  }

  for (i64 s = 0; s < S; ++s)
    for (i64 h = 0; h < H; ++h) grad[lay.embed + tokens[s] * H + h] += dx[s * H + h];
}

}  // namespace sppo::ref64
