// Causal flash attention on CUDA: the host side, the delta kernel and the SIMT kernels (contract
// in backends/cuda/attention.h; the tensor-core kernels are in attention_tc.cu).
//
// Note [Attention kernels]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Both implementations walk the same tiles. The forward gives a thread block a tile of query
// rows of one head and walks the key tiles of every block that some row of the tile sees,
// keeping one online softmax per row (running max m, running sum l, unnormalised output o):
// no merge pass between blocks. A key tile entirely in the past of every row of the query tile
// is used unmasked; any other is masked element-wise by position (and by the block's end).
// Query tiles are handed out latest first (they see the most keys), all heads of a tile
// together (their rows of K/V share cache lines; with grouped-query attention the query heads
// that read one key/value head run side by side, on the same K/V rows).
//   Simt: 4 query rows per block, one per warp; key tiles of 32 rows in shared memory, lane j
//   computes the score of key j with a sequential fp32 FMA dot product, then each lane
//   accumulates its 1/32 of the head's output columns. Exponentials are expf, as exact as the
//   CPU's; it exists for fp32 comparisons and for head sizes the tensor cores do not cover.
//   TensorCore: attention_tc.cu.
//
// Note [Deterministic backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// FlashAttention-2 runs one backward kernel over (key tile, head) and adds each (key tile,
// query tile) pair's dQ into an fp32 buffer with atomics, whose order, and so whose rounding,
// changes from run to run. Here the backward is two kernels instead:
//   dkdv: one block per (key tile, key/value head), over every query tile that sees the key
//         tile, of every query head that reads the key/value head (one after another: with
//         grouped-query attention Z / Zkv of them): S, P, dP, dS, and dK += dS^T Q,
//         dV += P^T dO in registers, added to the block's fp32 dk/dv once at the end. Each
//         element of dk/dv has one owner, however many query heads share it.
//   dq:   one block per (query tile, head), over every key tile (of every block) the queries
//         see, as the forward: S, P, dP, dS again, and dQ += dS K, added to dq once at the end.
// dq recomputes S and dP (two of the five matrix products of the fused backward), so the
// backward does 7 products instead of 5: about 1.4x the FLOPs of the atomic scheme, for results
// that are the same bits on every run and every GPU of a model, as the CPU backend's are.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "backends/cuda/attention_impl.cuh"

namespace sppo::cuda {

int fill_tile_starts(KVTable& kv, i64 qp_last, int tile) {
  kv.tile_start[0] = 0;
  for (int b = 0; b < kv.n; ++b) {
    const i64 vis = std::clamp<i64>(qp_last - kv.pos[b] + 1, 0, kv.len[b]);
    kv.tile_start[b + 1] = kv.tile_start[b] + static_cast<int>(ceil_div(vis, tile));
  }
  return kv.tile_start[kv.n];
}

namespace {

// ---- delta -------------------------------------------------------------------------------
constexpr int kDeltaWarps = 8;

template <typename T>
__global__ void __launch_bounds__(kDeltaWarps * 32)
    delta_kernel(float* delta, const T* dout, const T* out, int Tq, int Z, int A, i64 ldo) {
  const i64 pair = static_cast<i64>(blockIdx.x) * kDeltaWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (pair >= static_cast<i64>(Tq) * Z) return;
  const i64 t = pair / Z;
  const int z = static_cast<int>(pair % Z);
  const T* dr = dout + t * ldo + static_cast<i64>(z) * A;
  const T* orow = out + t * ldo + static_cast<i64>(z) * A;
  double sum = 0.0;
  for (int a = lane; a < A; a += 32) sum += static_cast<double>(load_f(dr + a)) * load_f(orow + a);
  sum = warp_sum(sum);
  if (lane == 0) delta[static_cast<i64>(z) * Tq + t] = static_cast<float>(sum);
}

// One warp per (query row, head): the two results' weights from their LSEs, then the
// row's A outputs.
// out, part_out: row strides ldo, ld_part; lse, part_lse: head strides ld_lse, ld_part_lse.
template <typename T>
__global__ void __launch_bounds__(kDeltaWarps * 32)
    merge_kernel(T* out, float* lse, const T* part_out, const float* part_lse, int Tq, int Z, int A, i64 ldo,
                 i64 ld_part, i64 ld_lse, i64 ld_part_lse) {
  const i64 pair = static_cast<i64>(blockIdx.x) * kDeltaWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (pair >= static_cast<i64>(Tq) * Z) return;
  const i64 t = pair / Z;
  const int z = static_cast<int>(pair % Z);
  const i64 li = static_cast<i64>(z) * ld_lse + t;
  const float a = lse[li], b = part_lse[static_cast<i64>(z) * ld_part_lse + t];
  const float m = fmaxf(a, b);
  if (m == -INFINITY) return;  // neither side sees a key: out stays 0
  const float wa = expf(a - m), wb = expf(b - m), sum = wa + wb;
  T* orow = out + t * ldo + static_cast<i64>(z) * A;
  const T* prow = part_out + t * ld_part + static_cast<i64>(z) * A;
  for (int k = lane; k < A; k += 32) store_f(orow + k, (wa * load_f(orow + k) + wb * load_f(prow + k)) / sum);
  __syncwarp();
  if (lane == 0) lse[li] = m + logf(sum);
}

// Rows of a query that sees no key: out 0, lse -inf.
template <typename T>
__global__ void unseen_kernel(T* out, float* lse, int Tq, int Z, int A, i64 ldo, i64 ld_lse) {
  const i64 width = static_cast<i64>(Z) * A, n = static_cast<i64>(Tq) * width;
  for (i64 i = blockIdx.x * i64{blockDim.x} + threadIdx.x; i < n; i += i64{gridDim.x} * blockDim.x) {
    const i64 t = i / width, c = i % width;
    store_f(out + t * ldo + c, 0.0f);
    if (c % A == 0) lse[(c / A) * ld_lse + t] = -INFINITY;
  }
}

// One warp per (query row, head): o = dout * delta / |dout|^2 (Note [The library's backward
// from delta] in library_attention.cpp).
template <typename T>
__global__ void __launch_bounds__(kDeltaWarps * 32)
    synthetic_out_kernel(T* o, const T* dout, const float* delta, int Tq, int Z, int A, i64 ld_dout, i64 ld_delta) {
  const i64 pair = static_cast<i64>(blockIdx.x) * kDeltaWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (pair >= static_cast<i64>(Tq) * Z) return;
  const i64 t = pair / Z;
  const int z = static_cast<int>(pair % Z);
  const T* dr = dout + t * ld_dout + static_cast<i64>(z) * A;
  double norm = 0.0;
  for (int a = lane; a < A; a += 32) norm += static_cast<double>(load_f(dr + a)) * load_f(dr + a);
  norm = warp_sum(norm);
  const float c = norm > 0.0 ? static_cast<float>(delta[static_cast<i64>(z) * ld_delta + t] / norm) : 0.0f;
  T* orow = o + t * static_cast<i64>(Z) * A + static_cast<i64>(z) * A;
  for (int a = lane; a < A; a += 32) store_f(orow + a, c * load_f(dr + a));
}

__global__ void set_lengths_kernel(int* p, int rows, int keys) {
  p[0] = rows;
  p[1] = keys;
}

// ---- SIMT kernels ----------------------------------------------------------------------
constexpr int kSimtWarps = 4;  // rows per block (queries, or keys in dkdv), one per warp
constexpr int kSimtThreads = kSimtWarps * 32;
constexpr int kSimtTile = 32;      // rows of a shared-memory tile: one per lane
constexpr int kSimtMaxChunks = 8;  // output columns per lane: A <= 8 * 32

std::size_t simt_fwd_smem(int A) {
  return sizeof(float) * (std::size_t(kSimtTile) * (A + 1) + std::size_t(kSimtTile) * A +
                          std::size_t(kSimtWarps) * A + kSimtWarps * kSimtTile);
}
std::size_t simt_dq_smem(int A) {
  return sizeof(float) * (2 * std::size_t(kSimtTile) * (A + 1) + 2 * std::size_t(kSimtWarps) * A +
                          kSimtWarps * kSimtTile);
}
std::size_t simt_dkdv_smem(int A) {
  return sizeof(float) * (2 * std::size_t(kSimtTile) * (A + 1) + 2 * kSimtTile +
                          2 * std::size_t(kSimtWarps) * A + 2 * kSimtWarps * kSimtTile);
}

// Loads rows [r0, r0 + 32) of head z of x (stride ld) into dst[32][ldd] as fp32, zeros past
// `rows`. Called by the whole block.
template <typename T>
__device__ void load_rows_f32(float* dst, int ldd, const T* x, i64 ld, int z, int A, int r0,
                              int rows) {
  for (int i = threadIdx.x; i < kSimtTile * A; i += blockDim.x) {
    const int r = i / A, a = i % A;
    float val = 0.0f;
    if (r0 + r < rows)
      val = load_f(x + static_cast<i64>(r0 + r) * ld + static_cast<i64>(z) * A + a);
    dst[r * ldd + a] = val;
  }
}

template <typename T>
__global__ void __launch_bounds__(kSimtThreads)
    attn_fwd_simt(const AttnParams p, const KVTable kv) {
  extern __shared__ float smem[];
  const int A = p.A, lda1 = A + 1;
  float* ks = smem;                   // [32][A + 1]
  float* vs = ks + kSimtTile * lda1;  // [32][A]
  float* qs = vs + kSimtTile * A;     // [warps][A]
  float* ps = qs + kSimtWarps * A;    // [warps][32]
  const int groups = (p.Tq + kSimtWarps - 1) / kSimtWarps;
  const int group = groups - 1 - static_cast<int>(blockIdx.x / p.Z);
  const int z = static_cast<int>(blockIdx.x % p.Z);
  const int zk = z / p.share;  // the key/value head
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = group * kSimtWarps + warp;
  const bool row_ok = t < p.Tq;
  const i64 qp = p.q_pos0 + t;
  const i64 qp_last = p.q_pos0 + min(group * kSimtWarps + kSimtWarps, p.Tq) - 1;
  const T* q = static_cast<const T*>(p.q);
  float* qw = qs + warp * A;
  float* pw = ps + warp * kSimtTile;
  for (int a = lane; a < A; a += 32)
    qw[a] = row_ok ? load_f(q + static_cast<i64>(t) * p.ldq + static_cast<i64>(z) * A + a) : 0.0f;
  float o[kSimtMaxChunks];
#pragma unroll
  for (int c = 0; c < kSimtMaxChunks; ++c) o[c] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  for (int b = 0; b < kv.n; ++b) {
    const T* k = static_cast<const T*>(kv.k[b]);
    const T* v = static_cast<const T*>(kv.v[b]);
    const i64 pos = kv.pos[b];
    const int nk = visible_keys(kv, b, qp_last);
    for (int s0 = 0; s0 < nk; s0 += kSimtTile) {
      const int kn = min(kSimtTile, nk - s0);
      __syncthreads();  // the previous tile is consumed (and qw written, on the first)
      load_rows_f32(ks, lda1, k, p.ldk, zk, A, s0, s0 + kn);
      load_rows_f32(vs, A, v, p.ldv, zk, A, s0, s0 + kn);
      __syncthreads();
      if (!row_ok) continue;
      float s = -INFINITY;
      if (lane < kn && pos + s0 + lane <= qp) {
        const float* kr = ks + lane * lda1;
        float dot = 0.0f;
        for (int a = 0; a < A; ++a) dot = fmaf(qw[a], kr[a], dot);
        s = dot;
      }
      const float m_new = fmaxf(m, warp_max(s));
      if (m_new == -INFINITY) continue;                 // no key seen yet (the whole warp agrees)
      const float alpha = expf((m - m_new) * p.scale);  // 0 while m = -inf
      const float pj = s == -INFINITY ? 0.0f : expf((s - m_new) * p.scale);
      l = l * alpha + warp_sum(pj);
      pw[lane] = pj;
      __syncwarp();
#pragma unroll
      for (int c = 0; c < kSimtMaxChunks; ++c) {
        const int a = lane + 32 * c;
        if (a < A) {
          float acc = o[c] * alpha;
          for (int j = 0; j < kn; ++j) acc = fmaf(pw[j], vs[j * A + a], acc);
          o[c] = acc;
        }
      }
      __syncwarp();
      m = m_new;
    }
  }
  if (!row_ok) return;
  T* out = static_cast<T*>(p.out) + static_cast<i64>(t) * p.ldo + static_cast<i64>(z) * A;
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
  for (int c = 0; c < kSimtMaxChunks; ++c) {
    const int a = lane + 32 * c;
    if (a < A) store_f(out + a, o[c] * inv);
  }
  if (lane == 0)
    p.lse[static_cast<i64>(z) * p.Tq + t] = l > 0.0f ? m * p.scale + logf(l) : -INFINITY;
}

template <typename T>
__global__ void __launch_bounds__(kSimtThreads) attn_dq_simt(const AttnParams p, const KVTable kv) {
  extern __shared__ float smem[];
  const int A = p.A, lda1 = A + 1;
  float* ks = smem;                   // [32][A + 1]
  float* vs = ks + kSimtTile * lda1;  // [32][A + 1]
  float* qs = vs + kSimtTile * lda1;  // [warps][A]
  float* dos = qs + kSimtWarps * A;   // [warps][A]
  float* dss = dos + kSimtWarps * A;  // [warps][32]
  const int groups = (p.Tq + kSimtWarps - 1) / kSimtWarps;
  const int group = groups - 1 - static_cast<int>(blockIdx.x / p.Z);
  const int z = static_cast<int>(blockIdx.x % p.Z);
  const int zk = z / p.share;  // the key/value head
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = group * kSimtWarps + warp;
  const bool row_ok = t < p.Tq;
  const i64 qp = p.q_pos0 + t;
  const i64 qp_last = p.q_pos0 + min(group * kSimtWarps + kSimtWarps, p.Tq) - 1;
  const T* q = static_cast<const T*>(p.q);
  const T* dout = static_cast<const T*>(p.dout);
  float* qw = qs + warp * A;
  float* dow = dos + warp * A;
  float* dsw = dss + warp * kSimtTile;
  for (int a = lane; a < A; a += 32) {
    qw[a] = row_ok ? load_f(q + static_cast<i64>(t) * p.ldq + static_cast<i64>(z) * A + a) : 0.0f;
    dow[a] =
        row_ok ? load_f(dout + static_cast<i64>(t) * p.ldo + static_cast<i64>(z) * A + a) : 0.0f;
  }
  const float lse_t = row_ok ? p.lse[static_cast<i64>(z) * p.Tq + t] : -INFINITY;
  const float delta_t = row_ok ? p.delta[static_cast<i64>(z) * p.Tq + t] : 0.0f;
  // A row that sees no key (lse = -inf) has no gradient.
  const bool active = row_ok && lse_t > -INFINITY;
  float acc[kSimtMaxChunks];
#pragma unroll
  for (int c = 0; c < kSimtMaxChunks; ++c) acc[c] = 0.0f;
  for (int b = 0; b < kv.n; ++b) {
    const T* k = static_cast<const T*>(kv.k[b]);
    const T* v = static_cast<const T*>(kv.v[b]);
    const i64 pos = kv.pos[b];
    const int nk = visible_keys(kv, b, qp_last);
    for (int s0 = 0; s0 < nk; s0 += kSimtTile) {
      const int kn = min(kSimtTile, nk - s0);
      __syncthreads();
      load_rows_f32(ks, lda1, k, p.ldk, zk, A, s0, s0 + kn);
      load_rows_f32(vs, lda1, v, p.ldv, zk, A, s0, s0 + kn);
      __syncthreads();
      if (!active) continue;
      float ds = 0.0f;
      if (lane < kn && pos + s0 + lane <= qp) {
        const float* kr = ks + lane * lda1;
        const float* vr = vs + lane * lda1;
        float s = 0.0f, dp = 0.0f;
        for (int a = 0; a < A; ++a) {
          s = fmaf(qw[a], kr[a], s);
          dp = fmaf(dow[a], vr[a], dp);
        }
        const float pj = expf(s * p.scale - lse_t);
        ds = (pj * p.scale) * (dp - delta_t);
      }
      dsw[lane] = ds;
      __syncwarp();
#pragma unroll
      for (int c = 0; c < kSimtMaxChunks; ++c) {
        const int a = lane + 32 * c;
        if (a < A) {
          float x = acc[c];
          for (int j = 0; j < kn; ++j) x = fmaf(dsw[j], ks[j * lda1 + a], x);
          acc[c] = x;
        }
      }
      __syncwarp();
    }
  }
  if (!row_ok) return;
  T* dq = static_cast<T*>(p.dq) + static_cast<i64>(t) * p.lddq + static_cast<i64>(z) * A;
#pragma unroll
  for (int c = 0; c < kSimtMaxChunks; ++c) {
    const int a = lane + 32 * c;
    if (a < A) store_f(dq + a, load_f(dq + a) + acc[c]);
  }
}

// One block per kSimtWarps key rows of one block of keys and one key/value head (kv.tile_start
// counts these groups), over the query heads that read it in head order; lane j handles query
// t0 + j of each query tile.
template <typename T>
__global__ void __launch_bounds__(kSimtThreads)
    attn_dkdv_simt(const AttnParams p, const KVTable kv) {
  extern __shared__ float smem[];
  const int A = p.A, lda1 = A + 1;
  float* qs = smem;                           // [32][A + 1]
  float* dos = qs + kSimtTile * lda1;         // [32][A + 1]
  float* lse_s = dos + kSimtTile * lda1;      // [32]
  float* delta_s = lse_s + kSimtTile;         // [32]
  float* kws = delta_s + kSimtTile;           // [warps][A]
  float* vws = kws + kSimtWarps * A;          // [warps][A]
  float* pss = vws + kSimtWarps * A;          // [warps][32]
  float* dss = pss + kSimtWarps * kSimtTile;  // [warps][32]
  const int x = static_cast<int>(blockIdx.x / p.Zkv);
  const int zk = static_cast<int>(blockIdx.x % p.Zkv);  // the key/value head
  int b = 0;
  while (kv.tile_start[b + 1] <= x) ++b;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int s0 = (x - kv.tile_start[b]) * kSimtWarps;
  const int s = s0 + warp;
  const bool key_ok = s < kv.len[b];
  const i64 kp = kv.pos[b] + s;
  const T* k = static_cast<const T*>(kv.k[b]);
  const T* v = static_cast<const T*>(kv.v[b]);
  const T* q = static_cast<const T*>(p.q);
  const T* dout = static_cast<const T*>(p.dout);
  float* kw = kws + warp * A;
  float* vw = vws + warp * A;
  float* pw = pss + warp * kSimtTile;
  float* dsw = dss + warp * kSimtTile;
  for (int a = lane; a < A; a += 32) {
    kw[a] = key_ok ? load_f(k + static_cast<i64>(s) * p.ldk + static_cast<i64>(zk) * A + a) : 0.0f;
    vw[a] = key_ok ? load_f(v + static_cast<i64>(s) * p.ldv + static_cast<i64>(zk) * A + a) : 0.0f;
  }
  float dk[kSimtMaxChunks], dv[kSimtMaxChunks];
#pragma unroll
  for (int c = 0; c < kSimtMaxChunks; ++c) dk[c] = dv[c] = 0.0f;
  // The first query that sees the block's first key.
  const i64 first = kv.pos[b] + s0 - p.q_pos0;
  const int t_begin = static_cast<int>(first < 0 ? 0 : first);
  // The query tiles of every query head that reads key/value head zk, head by head: their
  // terms add into the same registers.
  const int q_tiles = (p.Tq - t_begin + kSimtTile - 1) / kSimtTile;
  for (int it = 0; it < p.share * q_tiles; ++it) {
    const int z = zk * p.share + it / q_tiles;
    const int t0 = t_begin + it % q_tiles * kSimtTile;
    const int jn = min(kSimtTile, p.Tq - t0);
    __syncthreads();  // the previous tile is consumed (and kw, vw written, on the first)
    load_rows_f32(qs, lda1, q, p.ldq, z, A, t0, p.Tq);
    load_rows_f32(dos, lda1, dout, p.ldo, z, A, t0, p.Tq);
    if (threadIdx.x < kSimtTile) {
      const int t = t0 + threadIdx.x;
      lse_s[threadIdx.x] = t < p.Tq ? p.lse[static_cast<i64>(z) * p.Tq + t] : -INFINITY;
      delta_s[threadIdx.x] = t < p.Tq ? p.delta[static_cast<i64>(z) * p.Tq + t] : 0.0f;
    }
    __syncthreads();
    if (!key_ok) continue;
    float pj = 0.0f, ds = 0.0f;
    if (lane < jn && kp <= p.q_pos0 + t0 + lane && lse_s[lane] > -INFINITY) {
      const float* qr = qs + lane * lda1;
      const float* dr = dos + lane * lda1;
      float sc = 0.0f, dp = 0.0f;
      for (int a = 0; a < A; ++a) {
        sc = fmaf(qr[a], kw[a], sc);
        dp = fmaf(dr[a], vw[a], dp);
      }
      pj = expf(sc * p.scale - lse_s[lane]);
      ds = (pj * p.scale) * (dp - delta_s[lane]);
    }
    pw[lane] = pj;
    dsw[lane] = ds;
    __syncwarp();
#pragma unroll
    for (int c = 0; c < kSimtMaxChunks; ++c) {
      const int a = lane + 32 * c;
      if (a < A) {
        float xk = dk[c], xv = dv[c];
        for (int j = 0; j < jn; ++j) {
          xv = fmaf(pw[j], dos[j * lda1 + a], xv);
          xk = fmaf(dsw[j], qs[j * lda1 + a], xk);
        }
        dk[c] = xk;
        dv[c] = xv;
      }
    }
    __syncwarp();
  }
  if (!key_ok) return;
  float* dkr = kv.dk[b] + static_cast<i64>(s) * p.ldk + static_cast<i64>(zk) * A;
  float* dvr = kv.dv[b] + static_cast<i64>(s) * p.ldv + static_cast<i64>(zk) * A;
#pragma unroll
  for (int c = 0; c < kSimtMaxChunks; ++c) {
    const int a = lane + 32 * c;
    if (a < A) {
      dkr[a] += dk[c];
      dvr[a] += dv[c];
    }
  }
}

// ---- host side ---------------------------------------------------------------------------

AttnParams resolve(const AttnDims& d) {
  SPPO_CHECK(d.Tq >= 0, "attention") << "Tq must be >= 0, got " << d.Tq;
  SPPO_CHECK(d.Z > 0 && d.A > 0, "attention")
      << "Z and A must be positive, got " << d.Z << ", " << d.A;
  SPPO_CHECK(d.A % 2 == 0 && d.A <= 32 * kSimtMaxChunks, "attention")
      << "head size must be even and at most " << 32 * kSimtMaxChunks << ", got " << d.A;
  SPPO_CHECK(d.Zkv >= 0 && d.Zkv <= d.Z && (d.Zkv == 0 || d.Z % d.Zkv == 0), "attention")
      << "key/value heads Zkv must be 0 or divide Z = " << d.Z << ", got " << d.Zkv;
  AttnParams p;
  p.Tq = d.Tq;
  p.Z = d.Z;
  p.A = d.A;
  p.Zkv = d.Zkv ? d.Zkv : d.Z;
  p.share = p.Z / p.Zkv;
  p.q_pos0 = d.q_pos0;
  const i64 H = static_cast<i64>(d.Z) * d.A, Hkv = static_cast<i64>(p.Zkv) * d.A;
  p.ldq = d.ldq ? d.ldq : H;
  p.ldk = d.ldk ? d.ldk : Hkv;
  p.ldv = d.ldv ? d.ldv : Hkv;
  p.ldo = d.ldo ? d.ldo : H;
  p.lddq = d.lddq ? d.lddq : p.ldq;
  SPPO_CHECK(p.ldq >= H && p.ldo >= H && p.lddq >= H, "attention")
      << "row strides of q, out and dq must be 0 or >= Z*A = " << H << ", got ldq " << p.ldq
      << ", ldo " << p.ldo << ", lddq " << p.lddq;
  SPPO_CHECK(p.ldk >= Hkv && p.ldv >= Hkv, "attention")
      << "row strides of k and v must be 0 or >= Zkv*A = " << Hkv << ", got ldk " << p.ldk
      << ", ldv " << p.ldv;
  p.scale = 1.0f / std::sqrt(static_cast<float>(d.A));
  p.scale_log2 = p.scale * kLog2e;
  return p;
}

KVTable make_table(const std::vector<KVBlock>& blocks, bool backward) {
  SPPO_CHECK(blocks.size() <= static_cast<std::size_t>(kMaxKVBlocks), "attention")
      << blocks.size() << " key/value blocks in one call; at most " << kMaxKVBlocks
      << " are supported (split the backward into several calls, or keep the KV cache of a "
         "layer in fewer, larger blocks)";
  KVTable kv;
  kv.n = static_cast<int>(blocks.size());
  for (int b = 0; b < kv.n; ++b) {
    const KVBlock& kb = blocks[b];
    SPPO_CHECK(kb.Tk >= 0, "attention") << "block " << b << ": Tk must be >= 0, got " << kb.Tk;
    SPPO_CHECK(kb.Tk == 0 || (kb.k != nullptr && kb.v != nullptr), "attention")
        << "block " << b << ": k and v must be set";
    SPPO_CHECK(!backward || kb.Tk == 0 || (kb.dk != nullptr && kb.dv != nullptr), "attention")
        << "block " << b << ": dk and dv must be set for the backward";
    kv.k[b] = kb.k;
    kv.v[b] = kb.v;
    kv.dk[b] = kb.dk;
    kv.dv[b] = kb.dv;
    kv.pos[b] = kb.k_pos0;
    kv.len[b] = kb.Tk;
  }
  return kv;
}

bool aligned16(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; }

// Whether the tensor-core kernels take this call; with `why`, the reason they do not.
bool tc_applies(const AttnParams& p, const KVTable& kv, DType act, bool backward,
                std::string* why) {
  const auto no = [why](const std::string& reason) {
    if (why != nullptr) *why = reason;
    return false;
  };
  if (act != DType::BF16) return no("they need BF16 activations");
  if (!tc_head_size_supported(p.A)) return no("they need a head size of 64 or 128");
  for (const i64 ld : {p.ldq, p.ldk, p.ldv, p.ldo, p.lddq})
    if (ld % 8 != 0) return no("they need row strides that are multiples of 8");
  bool ok = aligned16(p.q) && (backward ? aligned16(p.dout) && aligned16(p.dq) : aligned16(p.out));
  for (int b = 0; b < kv.n; ++b)
    if (kv.len[b] > 0) ok = ok && aligned16(kv.k[b]) && aligned16(kv.v[b]);
  if (!ok) return no("they need 16-byte aligned q, k, v, out, dout and dq");
  return true;
}

bool use_tc(const AttnParams& p, const KVTable& kv, DType act, bool backward, AttnKernel kernel) {
  std::string why;
  const bool applies = tc_applies(p, kv, act, backward, &why);
  SPPO_CHECK(kernel != AttnKernel::TensorCore || applies, "attention")
      << "the tensor-core kernels do not apply: " << why;
  return kernel != AttnKernel::Simt && applies;
}

template <typename Kernel>
void set_smem(Kernel kernel, std::size_t bytes) {
  SPPO_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(bytes)));
}

}  // namespace

void attention_forward_blocks(void* out, float* lse, const void* q,
                              const std::vector<KVBlock>& blocks, const AttnDims& d, DType act,
                              cudaStream_t stream, AttnKernel kernel) {
  AttnParams p = resolve(d);
  p.q = q;
  p.out = out;
  p.lse = lse;
  const KVTable kv = make_table(blocks, false);
  if (p.Tq == 0) return;
  if (use_tc(p, kv, act, false, kernel)) {
    tc_forward(p, kv, stream);
    return;
  }
  dispatch_act(act, "attention_forward_blocks", [&](auto tag) {
    using E = decltype(tag);
    const std::size_t smem = simt_fwd_smem(p.A);
    set_smem(attn_fwd_simt<E>, smem);
    const i64 grid = ceil_div(p.Tq, kSimtWarps) * p.Z;
    attn_fwd_simt<E><<<grid_x(grid, "attention"), kSimtThreads, smem, stream>>>(p, kv);
    SPPO_CUDA_CHECK_LAUNCH();
  });
}

void attention_merge(void* out, float* lse, const void* part_out, const float* part_lse, const AttnDims& d,
                     DType act, cudaStream_t stream) {
  const AttnParams p = resolve(d);
  if (p.Tq == 0) return;
  dispatch_act(act, "attention_merge", [&](auto tag) {
    using E = decltype(tag);
    const i64 grid = ceil_div(static_cast<i64>(p.Tq) * p.Z, kDeltaWarps);
    merge_kernel<E><<<grid_x(grid, "attention"), kDeltaWarps * 32, 0, stream>>>(
        static_cast<E*>(out), lse, static_cast<const E*>(part_out), part_lse, p.Tq, p.Z, p.A, p.ldo, p.ldo, p.Tq,
        p.Tq);
    SPPO_CUDA_CHECK_LAUNCH();
  });
}

void attention_merge_rows(void* out, float* lse, const void* part_out, const float* part_lse, int Tq, int Z, int A,
                          i64 ldo, i64 ld_part, i64 ld_lse, i64 ld_part_lse, DType act, cudaStream_t stream) {
  if (Tq == 0) return;
  dispatch_act(act, "attention_merge_rows", [&](auto tag) {
    using E = decltype(tag);
    const i64 grid = ceil_div(static_cast<i64>(Tq) * Z, kDeltaWarps);
    merge_kernel<E><<<grid_x(grid, "attention"), kDeltaWarps * 32, 0, stream>>>(
        static_cast<E*>(out), lse, static_cast<const E*>(part_out), part_lse, Tq, Z, A, ldo, ld_part, ld_lse,
        ld_part_lse);
    SPPO_CUDA_CHECK_LAUNCH();
  });
}

void attention_unseen_rows(void* out, float* lse, int Tq, int Z, int A, i64 ldo, i64 ld_lse, DType act,
                           cudaStream_t stream) {
  if (Tq == 0) return;
  dispatch_act(act, "attention_unseen_rows", [&](auto tag) {
    using E = decltype(tag);
    unseen_kernel<E><<<grid_for(static_cast<i64>(Tq) * Z * A), kThreads, 0, stream>>>(static_cast<E*>(out), lse, Tq,
                                                                                       Z, A, ldo, ld_lse);
    SPPO_CUDA_CHECK_LAUNCH();
  });
}

void attention_synthetic_out(void* o, const void* dout, const float* delta, int Tq, int Z, int A, i64 ld_dout,
                             i64 ld_delta, DType act, cudaStream_t stream) {
  if (Tq == 0) return;
  dispatch_act(act, "attention_synthetic_out", [&](auto tag) {
    using E = decltype(tag);
    const i64 grid = ceil_div(static_cast<i64>(Tq) * Z, kDeltaWarps);
    synthetic_out_kernel<E><<<grid_x(grid, "attention"), kDeltaWarps * 32, 0, stream>>>(
        static_cast<E*>(o), static_cast<const E*>(dout), delta, Tq, Z, A, ld_dout, ld_delta);
    SPPO_CUDA_CHECK_LAUNCH();
  });
}

void attention_set_lengths(int* p, int rows, int keys, cudaStream_t stream) {
  set_lengths_kernel<<<1, 1, 0, stream>>>(p, rows, keys);
  SPPO_CUDA_CHECK_LAUNCH();
}

void attention_backward_delta(float* delta, const void* dout, const void* out, const AttnDims& d,
                              DType act, cudaStream_t stream) {
  const AttnParams p = resolve(d);
  if (p.Tq == 0) return;
  dispatch_act(act, "attention_backward_delta", [&](auto tag) {
    using E = decltype(tag);
    const i64 grid = ceil_div(static_cast<i64>(p.Tq) * p.Z, kDeltaWarps);
    delta_kernel<E><<<grid_x(grid, "attention"), kDeltaWarps * 32, 0, stream>>>(
        delta, static_cast<const E*>(dout), static_cast<const E*>(out), p.Tq, p.Z, p.A, p.ldo);
    SPPO_CUDA_CHECK_LAUNCH();
  });
}

void attention_backward_blocks(void* dq, const void* dout, const void* q,
                               const std::vector<KVBlock>& blocks, const float* lse,
                               const float* delta, const AttnDims& d, DType act,
                               cudaStream_t stream, AttnKernel kernel) {
  AttnParams p = resolve(d);
  p.q = q;
  p.dout = dout;
  p.dq = dq;
  p.lse = const_cast<float*>(lse);  // read only in the backward
  p.delta = delta;
  KVTable kv = make_table(blocks, true);
  if (p.Tq == 0) return;
  if (use_tc(p, kv, act, true, kernel)) {
    tc_backward(p, kv, stream);
    return;
  }
  dispatch_act(act, "attention_backward_blocks", [&](auto tag) {
    using E = decltype(tag);
    const std::size_t dq_smem = simt_dq_smem(p.A);
    set_smem(attn_dq_simt<E>, dq_smem);
    const i64 dq_grid = ceil_div(p.Tq, kSimtWarps) * p.Z;
    attn_dq_simt<E><<<grid_x(dq_grid, "attention"), kSimtThreads, dq_smem, stream>>>(p, kv);
    SPPO_CUDA_CHECK_LAUNCH();
    const int groups = fill_tile_starts(kv, p.q_pos0 + p.Tq - 1, kSimtWarps);
    if (groups == 0) return;
    const std::size_t kv_smem = simt_dkdv_smem(p.A);
    set_smem(attn_dkdv_simt<E>, kv_smem);
    const i64 kv_grid = static_cast<i64>(groups) * p.Zkv;
    attn_dkdv_simt<E><<<grid_x(kv_grid, "attention"), kSimtThreads, kv_smem, stream>>>(p, kv);
    SPPO_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace sppo::cuda
