// Tensor-core attention kernels: bf16 in, fp32 accumulate, head size 64 or 128, on sm_80 and
// sm_90 (mma.sync.m16n8k16, ldmatrix, cp.async). Contract in backends/cuda/attention.h; the
// partition of the work in Note [Attention kernels] and Note [Deterministic backward] of
// attention.cu.
//
// Note [mma fragments]
// ~~~~~~~~~~~~~~~~~~~~
// mma.sync.m16n8k16.row.col: D[16, 8] += A[16, 16] B[16, 8], per warp. With g = lane / 4 and
// q = lane % 4 (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"):
//   A: 4 x 32-bit, each two bf16 (lower column in the low half):
//        a0 = A[g][2q, 2q+1], a1 = A[g+8][2q, 2q+1], a2 = A[g][2q+8, 2q+9], a3 = A[g+8][2q+8, 2q+9]
//   B: 2 x 32-bit: b0 = B[2q, 2q+1][g], b1 = B[2q+8, 2q+9][g]
//   C, D: 4 floats: c0, c1 = C[g][2q, 2q+1], c2, c3 = C[g+8][2q, 2q+1]
// Operands come from shared memory tiles with rows of D + 8 bf16 (the 16 bytes of padding put
// the 8 rows a warp reads at once in different banks):
//   load_a:        A stored row-major [m][k] (Q, dO, K, V rows): ldmatrix.x4, which hands lane
//                  l the pair (M[g][2q], M[g][2q + 1]) of each 8x8 matrix M whose row addresses
//                  lanes 8i .. 8i+7 give: the four 8x8 quarters of A are a0 .. a3.
//   load_b_nk_x2:  B = X^T with X stored [n][k] (K rows as the B of S = Q K^T): ldmatrix.x4,
//                  two n8 tiles per call.
//   load_b_kn_x2:  B = X stored [k][n] (V as the B of O = P V): ldmatrix.x4.trans, which hands
//                  lane l the pair (M[2q][g], M[2q + 1][g]); two n8 tiles per call.
// A product's C fragments become the next product's A operand without leaving registers: the C
// fragments of n8 tiles 2kc and 2kc + 1 hold exactly the A fragment of the k16 slice kc
// (c_to_a). That is how P (and dS) feed O += P V (and dQ += dS K) in FlashAttention-2.
//
// Shapes (4 warps, 128 threads, each warp 16 rows of each m16 tile it owns):
//   forward  query tile 128 rows (32 per warp), key tiles of 64 (A = 64) or 32 (A = 128) rows,
//            K/V tiles double-buffered with cp.async.
//   dq       query tile 64 rows (16 per warp), key tiles of 64 rows, double-buffered.
//   dkdv     key tile 64 rows (16 per warp) of one key/value head, query tiles of 64 (A = 64)
//            or 32 (A = 128) rows (Q, dO, lse, delta) of each query head that reads it,
//            double-buffered across heads.
// Every kernel runs at up to 255 registers per thread (ptxas -v: no spills, except 4 to 8 bytes
// in the A = 128 forward and dq on sm_90a); 2 blocks per SM by registers and shared memory.
#include <cstdint>

#include "backends/cuda/attention_impl.cuh"
#include "backends/cuda/ptx.cuh"

namespace sppo::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kTcThreads = kWarps * 32;

// ---- fragments (Note [mma fragments]) -------------------------------------------------------

// A = tile[r0 .. r0+15][c0 .. c0+15] of a row-major shared tile; p = &tile[r0][c0]. Lanes 0-7,
// 8-15, 16-23, 24-31 address the rows of the 8x8 matrices (rows 0-7, c0), (rows 8-15, c0),
// (rows 0-7, c0 + 8), (rows 8-15, c0 + 8): a0, a1, a2, a3.
__device__ __forceinline__ void load_a(std::uint32_t (&a)[4], const bf16* p, int ld, int lane) {
  ldsm_x4(a, p + (lane & 15) * ld + (lane >> 4) * 8);
}

// B[k][n] = X[n0 + n][k0 + k] for X stored [n][k], for the n8 tiles at n0 (b[0], b[1]) and
// n0 + 8 (b[2], b[3]); p = &X[n0][k0]. Lanes 0-7, 8-15, 16-23, 24-31 address the rows of the
// 8x8 matrices (n0 .. n0+7, k0), (n0 .. n0+7, k0 + 8), (n0+8 .. n0+15, k0), (n0+8 .., k0 + 8).
__device__ __forceinline__ void load_b_nk_x2(std::uint32_t (&b)[4], const bf16* p, int ld,
                                             int lane) {
  ldsm_x4(b, p + ((lane & 7) + ((lane >> 4) << 3)) * ld + ((lane >> 3) & 1) * 8);
}

// B[k][n] = X[k0 + k][n0 + n] for X stored [k][n], for the n8 tiles at n0 (b[0], b[1]) and
// n0 + 8 (b[2], b[3]); p = &X[k0][n0]. Lanes 0-7, 8-15, 16-23, 24-31 address the rows of the
// 8x8 matrices (k 0-7, n0), (k 8-15, n0), (k 0-7, n0 + 8), (k 8-15, n0 + 8).
__device__ __forceinline__ void load_b_kn_x2(std::uint32_t (&b)[4], const bf16* p, int ld,
                                             int lane) {
  ldsm_x4_trans(b, p + (lane & 15) * ld + (lane >> 4) * 8);
}

// The A operand of k16 slice kc from the fp32 C fragments of n8 tiles 2kc (c0) and 2kc+1 (c1).
__device__ __forceinline__ void c_to_a(std::uint32_t (&a)[4], const float (&c0)[4],
                                       const float (&c1)[4]) {
  a[0] = pack_bf16(c0[0], c0[1]);
  a[1] = pack_bf16(c0[2], c0[3]);
  a[2] = pack_bf16(c1[0], c1[1]);
  a[3] = pack_bf16(c1[2], c1[3]);
}

// Rows [0, kRows) of a shared tile with rows of D + 8: row r <- src + r * ld (D bf16, in 16-byte
// pieces, asynchronously), zeros from row `valid` on. src must point at readable memory.
template <int D, int kRows>
__device__ __forceinline__ void load_tile(bf16* dst, const bf16* src, i64 ld, int valid) {
  constexpr int kChunks = D / 8, kLd = D + 8;
  static_assert((kRows * kChunks) % kTcThreads == 0, "whole rounds of 16-byte pieces");
#pragma unroll
  for (int it = 0; it < kRows * kChunks / kTcThreads; ++it) {
    const int i = it * kTcThreads + threadIdx.x;
    const int r = i / kChunks, c = i % kChunks;
    const bool ok = r < valid;
    cp_async16(dst + r * kLd + c * 8, ok ? src + r * ld + c * 8 : src, ok);
  }
}

// Moves (b, s0) to the first key tile at or after it that some query up to qp_last sees.
__device__ __forceinline__ void settle(const KVTable& kv, i64 qp_last, int& b, int& s0) {
  while (b < kv.n && s0 >= visible_keys(kv, b, qp_last)) {
    ++b;
    s0 = 0;
  }
}

// j - i <= d decides visibility of key column j to query row i within a tile pair; d clamped to
// [lo, hi] (beyond which the answer no longer changes) so that it fits an int.
__device__ __forceinline__ int clamp_diff(i64 d, int lo, int hi) {
  return static_cast<int>(d < lo ? lo : (d > hi ? hi : d));
}

// ---- forward ------------------------------------------------------------------------------

template <int D, int kMT, int kBk>
struct Fwd {
  static constexpr int kBq = kWarps * 16 * kMT;
  static constexpr int kLd = D + 8;
  static constexpr int kSmem = static_cast<int>(sizeof(bf16)) * (kBq + 4 * kBk) * kLd;
};

template <int D, int kMT, int kBk>
__global__ void __launch_bounds__(kTcThreads) attn_fwd_tc(const AttnParams p, const KVTable kv) {
  using Cfg = Fwd<D, kMT, kBk>;
  constexpr int kBq = Cfg::kBq, kLd = Cfg::kLd, kNT = kBk / 8, kDT = D / 8;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* qs = reinterpret_cast<bf16*>(smem);  // [kBq][kLd]
  bf16* ks = qs + kBq * kLd;                 // [2][kBk][kLd]
  bf16* vs = ks + 2 * kBk * kLd;             // [2][kBk][kLd]

  const int n_tiles = (p.Tq + kBq - 1) / kBq;
  const int tile = n_tiles - 1 - static_cast<int>(blockIdx.x / p.Z);  // latest first
  const int z = static_cast<int>(blockIdx.x % p.Z);
  const int t0 = tile * kBq;
  const int qn = min(kBq, p.Tq - t0);
  const i64 qp_first = p.q_pos0 + t0;
  const i64 qp_last = qp_first + qn - 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, q4 = lane & 3;
  const int row0 = warp * 16 * kMT;  // the warp's first row in the tile
  const i64 zD = static_cast<i64>(z) * D;
  const i64 zkD = static_cast<i64>(z / p.share) * D;  // the key/value head's columns
  const float c = p.scale_log2;

  load_tile<D, kBq>(qs, static_cast<const bf16*>(p.q) + t0 * p.ldq + zD, p.ldq, qn);
  const auto load_kv = [&](int stage, int b, int s0) {
    const int valid = min(kBk, kv.len[b] - s0);
    load_tile<D, kBk>(ks + stage * kBk * kLd, static_cast<const bf16*>(kv.k[b]) + s0 * p.ldk + zkD,
                      p.ldk, valid);
    load_tile<D, kBk>(vs + stage * kBk * kLd, static_cast<const bf16*>(kv.v[b]) + s0 * p.ldv + zkD,
                      p.ldv, valid);
  };
  int b = 0, s0 = 0;
  settle(kv, qp_last, b, s0);
  if (b < kv.n) load_kv(0, b, s0);
  cp_async_commit();

  float o[kMT][kDT][4];
  float m[kMT][2], l[kMT][2];  // per row (g, g + 8) of each m16 tile: running max (raw score), sum
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.0f;
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.0f;
  }

  for (int stage = 0; b < kv.n; stage ^= 1) {
    int nb = b, ns0 = s0 + kBk;
    settle(kv, qp_last, nb, ns0);
    if (nb < kv.n) load_kv(stage ^ 1, nb, ns0);
    cp_async_commit();
    cp_async_wait<1>();  // this tile (and Q) have landed
    __syncthreads();
    const bf16* kst = ks + stage * kBk * kLd;
    const bf16* vst = vs + stage * kBk * kLd;

    // S = Q K^T (raw scores).
    float s[kMT][kNT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      std::uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
        load_a(a[mt], qs + (row0 + mt * 16) * kLd + kk * 16, kLd, lane);
#pragma unroll
      for (int nt = 0; nt < kNT; nt += 2) {
        std::uint32_t bb[4];
        load_b_nk_x2(bb, kst + nt * 8 * kLd + kk * 16, kLd, lane);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma_16816(s[mt][nt], a[mt], bb[0], bb[1]);
          mma_16816(s[mt][nt + 1], a[mt], bb[2], bb[3]);
        }
      }
    }

    // Mask keys past the block's end and keys after a row's position, unless the whole tile is
    // in the past of every row.
    const i64 kp_first = kv.pos[b] + s0;
    const int kvalid = min(kBk, kv.len[b] - s0);
    if (kvalid < kBk || kp_first + kBk - 1 > qp_first) {
      // Key j is visible to row i iff j - i <= dmax.
      const int dmax = clamp_diff(qp_first - kp_first, -kBq, kBk);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = row0 + mt * 16 + g + (e >> 1) * 8;
            const int j = nt * 8 + 2 * q4 + (e & 1);
            if (j >= kvalid || j - i > dmax) s[mt][nt][e] = -INFINITY;
          }
    }

    // Online softmax, base 2: p = 2^(c s - c m); rows with no key seen yet keep m = -inf.
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = m[mt][h];
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
          mx = fmaxf(mx, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
        const float base = mx == -INFINITY ? 0.0f : mx * c;
        const float alpha = exp2f(m[mt][h] * c - base);  // 0 while m = -inf
        m[mt][h] = mx;
        float rs = 0.0f;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 2 * h; e < 2 * h + 2; ++e) {
            const float pv = exp2f(fmaf(s[mt][nt][e], c, -base));
            s[mt][nt][e] = pv;
            rs += pv;
          }
        l[mt][h] = l[mt][h] * alpha + rs;  // this lane's share; the 4 lanes of a row add at the end
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
          o[mt][dt][2 * h] *= alpha;
          o[mt][dt][2 * h + 1] *= alpha;
        }
      }
    }

    // O += P V, P rounded to bf16.
#pragma unroll
    for (int kc = 0; kc < kBk / 16; ++kc) {
      std::uint32_t pa[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) c_to_a(pa[mt], s[mt][2 * kc], s[mt][2 * kc + 1]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        std::uint32_t bb[4];
        load_b_kn_x2(bb, vst + kc * 16 * kLd + dp * 16, kLd, lane);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma_16816(o[mt][2 * dp], pa[mt], bb[0], bb[1]);
          mma_16816(o[mt][2 * dp + 1], pa[mt], bb[2], bb[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with this stage before it is loaded again
    b = nb;
    s0 = ns0;
  }
  cp_async_wait<0>();

  bf16* out = static_cast<bf16*>(p.out);
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float lt = l[mt][h];
      lt += __shfl_xor_sync(kFullMask, lt, 1);
      lt += __shfl_xor_sync(kFullMask, lt, 2);
      const int i = row0 + mt * 16 + g + 8 * h;
      if (i < qn) {
        const i64 t = t0 + i;
        const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
        bf16* orow = out + t * p.ldo + zD + 2 * q4;
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt)
          *reinterpret_cast<__nv_bfloat162*>(orow + dt * 8) =
              __floats2bfloat162_rn(o[mt][dt][2 * h] * inv, o[mt][dt][2 * h + 1] * inv);
        if (q4 == 0)
          p.lse[static_cast<i64>(z) * p.Tq + t] =
              lt > 0.0f ? m[mt][h] * p.scale + logf(lt) : -INFINITY;
      }
    }
  }
}

// ---- backward: dq -------------------------------------------------------------------------

template <int D, int kBk>
struct Dq {
  static constexpr int kBq = kWarps * 16;
  static constexpr int kLd = D + 8;
  static constexpr int kSmem = static_cast<int>(sizeof(bf16)) * (2 * kBq + 4 * kBk) * kLd;
};

template <int D, int kBk>
__global__ void __launch_bounds__(kTcThreads) attn_dq_tc(const AttnParams p, const KVTable kv) {
  using Cfg = Dq<D, kBk>;
  constexpr int kBq = Cfg::kBq, kLd = Cfg::kLd, kNT = kBk / 8, kDT = D / 8;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* qs = reinterpret_cast<bf16*>(smem);  // [kBq][kLd]
  bf16* dos = qs + kBq * kLd;                // [kBq][kLd]
  bf16* ks = dos + kBq * kLd;                // [2][kBk][kLd]
  bf16* vs = ks + 2 * kBk * kLd;             // [2][kBk][kLd]

  const int n_tiles = (p.Tq + kBq - 1) / kBq;
  const int tile = n_tiles - 1 - static_cast<int>(blockIdx.x / p.Z);
  const int z = static_cast<int>(blockIdx.x % p.Z);
  const int t0 = tile * kBq;
  const int qn = min(kBq, p.Tq - t0);
  const i64 qp_first = p.q_pos0 + t0;
  const i64 qp_last = qp_first + qn - 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, q4 = lane & 3;
  const int row0 = warp * 16;
  const i64 zD = static_cast<i64>(z) * D;
  const i64 zkD = static_cast<i64>(z / p.share) * D;  // the key/value head's columns
  const float c = p.scale_log2;

  load_tile<D, kBq>(qs, static_cast<const bf16*>(p.q) + t0 * p.ldq + zD, p.ldq, qn);
  load_tile<D, kBq>(dos, static_cast<const bf16*>(p.dout) + t0 * p.ldo + zD, p.ldo, qn);
  const auto load_kv = [&](int stage, int b, int s0) {
    const int valid = min(kBk, kv.len[b] - s0);
    load_tile<D, kBk>(ks + stage * kBk * kLd, static_cast<const bf16*>(kv.k[b]) + s0 * p.ldk + zkD,
                      p.ldk, valid);
    load_tile<D, kBk>(vs + stage * kBk * kLd, static_cast<const bf16*>(kv.v[b]) + s0 * p.ldv + zkD,
                      p.ldv, valid);
  };
  int b = 0, s0 = 0;
  settle(kv, qp_last, b, s0);
  if (b < kv.n) load_kv(0, b, s0);
  cp_async_commit();

  // Rows g and g + 8 of the warp: lse in base 2 (+inf for rows past Tq and rows that see no key,
  // so that their P is 0) and delta.
  float lse2[2], dlt[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = row0 + g + 8 * h;
    lse2[h] = INFINITY;
    dlt[h] = 0.0f;
    if (i < qn) {
      const i64 at = static_cast<i64>(z) * p.Tq + t0 + i;
      const float L = p.lse[at];
      lse2[h] = L == -INFINITY ? INFINITY : L * kLog2e;
      dlt[h] = p.delta[at];
    }
  }
  float acc[kDT][4];
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[dt][e] = 0.0f;

  for (int stage = 0; b < kv.n; stage ^= 1) {
    int nb = b, ns0 = s0 + kBk;
    settle(kv, qp_last, nb, ns0);
    if (nb < kv.n) load_kv(stage ^ 1, nb, ns0);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const bf16* kst = ks + stage * kBk * kLd;
    const bf16* vst = vs + stage * kBk * kLd;

    // S = Q K^T and dP = dO V^T.
    float s[kNT][4], dp[kNT][4];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      std::uint32_t aq[4], ado[4];
      load_a(aq, qs + row0 * kLd + kk * 16, kLd, lane);
      load_a(ado, dos + row0 * kLd + kk * 16, kLd, lane);
#pragma unroll
      for (int nt = 0; nt < kNT; nt += 2) {
        std::uint32_t bb[4];
        load_b_nk_x2(bb, kst + nt * 8 * kLd + kk * 16, kLd, lane);
        mma_16816(s[nt], aq, bb[0], bb[1]);
        mma_16816(s[nt + 1], aq, bb[2], bb[3]);
        load_b_nk_x2(bb, vst + nt * 8 * kLd + kk * 16, kLd, lane);
        mma_16816(dp[nt], ado, bb[0], bb[1]);
        mma_16816(dp[nt + 1], ado, bb[2], bb[3]);
      }
    }

    // P = 2^(c s - lse2) where visible, else 0; dS = scale P (dP - delta), in place of s.
    const i64 kp_first = kv.pos[b] + s0;
    const int kvalid = min(kBk, kv.len[b] - s0);
    const bool need_mask = kvalid < kBk || kp_first + kBk - 1 > qp_first;
    const int dmax = clamp_diff(qp_first - kp_first, -kBq, kBk);
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1;
        const int i = row0 + g + 8 * h;
        const int j = nt * 8 + 2 * q4 + (e & 1);
        const bool vis = !need_mask || (j < kvalid && j - i <= dmax);
        const float pv = vis ? exp2f(fmaf(s[nt][e], c, -lse2[h])) : 0.0f;
        s[nt][e] = pv * p.scale * (dp[nt][e] - dlt[h]);
      }

      // dQ += dS K, dS rounded to bf16.
#pragma unroll
    for (int kc = 0; kc < kBk / 16; ++kc) {
      std::uint32_t a[4];
      c_to_a(a, s[2 * kc], s[2 * kc + 1]);
#pragma unroll
      for (int dp2 = 0; dp2 < D / 16; ++dp2) {
        std::uint32_t bb[4];
        load_b_kn_x2(bb, kst + kc * 16 * kLd + dp2 * 16, kLd, lane);
        mma_16816(acc[2 * dp2], a, bb[0], bb[1]);
        mma_16816(acc[2 * dp2 + 1], a, bb[2], bb[3]);
      }
    }
    __syncthreads();
    b = nb;
    s0 = ns0;
  }
  cp_async_wait<0>();

  bf16* dq = static_cast<bf16*>(p.dq);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = row0 + g + 8 * h;
    if (i < qn) {
      bf16* row = dq + static_cast<i64>(t0 + i) * p.lddq + zD + 2 * q4;
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        __nv_bfloat162* ptr = reinterpret_cast<__nv_bfloat162*>(row + dt * 8);
        const float2 old = __bfloat1622float2(*ptr);
        *ptr = __floats2bfloat162_rn(old.x + acc[dt][2 * h], old.y + acc[dt][2 * h + 1]);
      }
    }
  }
}

// ---- backward: dk, dv ---------------------------------------------------------------------

template <int D, int kBq>
struct Dkv {
  static constexpr int kBk = kWarps * 16;
  static constexpr int kLd = D + 8;
  static constexpr int kSmem = static_cast<int>(sizeof(bf16)) * (2 * kBk + 4 * kBq) * kLd +
                               static_cast<int>(sizeof(float)) * 4 * kBq;
};

template <int D, int kBq>
__global__ void __launch_bounds__(kTcThreads) attn_dkdv_tc(const AttnParams p, const KVTable kv) {
  using Cfg = Dkv<D, kBq>;
  constexpr int kBk = Cfg::kBk, kLd = Cfg::kLd, kNT = kBq / 8, kDT = D / 8;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* ks = reinterpret_cast<bf16*>(smem);                       // [kBk][kLd]
  bf16* vs = ks + kBk * kLd;                                      // [kBk][kLd]
  bf16* qs = vs + kBk * kLd;                                      // [2][kBq][kLd]
  bf16* dos = qs + 2 * kBq * kLd;                                 // [2][kBq][kLd]
  float* lse2_s = reinterpret_cast<float*>(dos + 2 * kBq * kLd);  // [2][kBq], base 2
  float* dlt_s = lse2_s + 2 * kBq;                                // [2][kBq]

  const int x = static_cast<int>(blockIdx.x / p.Zkv);
  const int zk = static_cast<int>(blockIdx.x % p.Zkv);  // the key/value head
  int b = 0;
  while (kv.tile_start[b + 1] <= x) ++b;
  const int s0 = (x - kv.tile_start[b]) * kBk;
  const int kvalid = min(kBk, kv.len[b] - s0);
  const i64 kp_first = kv.pos[b] + s0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, q4 = lane & 3;
  const int row0 = warp * 16;  // the warp's first key in the tile
  const i64 zkD = static_cast<i64>(zk) * D;
  const float c = p.scale_log2;

  load_tile<D, kBk>(ks, static_cast<const bf16*>(kv.k[b]) + s0 * p.ldk + zkD, p.ldk, kvalid);
  load_tile<D, kBk>(vs, static_cast<const bf16*>(kv.v[b]) + s0 * p.ldv + zkD, p.ldv, kvalid);
  // Query tile t0 of query head z.
  const auto load_q = [&](int stage, int z, int t0) {
    const i64 zD = static_cast<i64>(z) * D;
    const int qn = min(kBq, p.Tq - t0);
    load_tile<D, kBq>(qs + stage * kBq * kLd, static_cast<const bf16*>(p.q) + t0 * p.ldq + zD,
                      p.ldq, qn);
    load_tile<D, kBq>(dos + stage * kBq * kLd, static_cast<const bf16*>(p.dout) + t0 * p.ldo + zD,
                      p.ldo, qn);
    for (int r = threadIdx.x; r < kBq; r += kTcThreads) {
      float L2 = INFINITY, dl = 0.0f;
      if (r < qn) {
        const i64 at = static_cast<i64>(z) * p.Tq + t0 + r;
        const float L = p.lse[at];
        L2 = L == -INFINITY ? INFINITY : L * kLog2e;
        dl = p.delta[at];
      }
      lse2_s[stage * kBq + r] = L2;
      dlt_s[stage * kBq + r] = dl;
    }
  };
  // The first query tile with a query that sees the tile's first key.
  const i64 first = kp_first - p.q_pos0;
  const int t_begin = (first < 0 ? 0 : static_cast<int>(first)) / kBq * kBq;
  // The query heads that read key/value head zk, one after another: their terms add into the
  // same registers.
  const int z_end = (zk + 1) * p.share;
  load_q(0, zk * p.share, t_begin);
  cp_async_commit();

  float dk[kDT][4], dv[kDT][4];
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dt][e] = dv[dt][e] = 0.0f;

  for (int z = zk * p.share, t0 = t_begin, stage = 0; z < z_end && t0 < p.Tq; stage ^= 1) {
    // The next (query head, query tile): this head's next tile, else the next head's first.
    int nz = z, nt0 = t0 + kBq;
    if (nt0 >= p.Tq) {
      ++nz;
      nt0 = t_begin;
    }
    if (nz < z_end) load_q(stage ^ 1, nz, nt0);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const bf16* qst = qs + stage * kBq * kLd;
    const bf16* dost = dos + stage * kBq * kLd;
    const float* lse2 = lse2_s + stage * kBq;
    const float* dlt = dlt_s + stage * kBq;
    const int qn = min(kBq, p.Tq - t0);
    const i64 qp_first = p.q_pos0 + t0;

    // S^T = K Q^T and dP^T = V dO^T: rows are the warp's keys, columns the tile's queries.
    float st[kNT][4], dpt[kNT][4];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      std::uint32_t ak[4], av[4];
      load_a(ak, ks + row0 * kLd + kk * 16, kLd, lane);
      load_a(av, vs + row0 * kLd + kk * 16, kLd, lane);
#pragma unroll
      for (int nt = 0; nt < kNT; nt += 2) {
        std::uint32_t bb[4];
        load_b_nk_x2(bb, qst + nt * 8 * kLd + kk * 16, kLd, lane);
        mma_16816(st[nt], ak, bb[0], bb[1]);
        mma_16816(st[nt + 1], ak, bb[2], bb[3]);
        load_b_nk_x2(bb, dost + nt * 8 * kLd + kk * 16, kLd, lane);
        mma_16816(dpt[nt], av, bb[0], bb[1]);
        mma_16816(dpt[nt + 1], av, bb[2], bb[3]);
      }
    }

    // P^T and dS^T = scale P^T (dP^T - delta) in place; key i sees query j iff
    // kp_first + i <= qp_first + j, i.e. i - j <= qp_first - kp_first.
    const bool need_mask = qn < kBq || kvalid < kBk || kp_first + kBk - 1 > qp_first;
    const int dmax = clamp_diff(qp_first - kp_first, -kBq, kBk);
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = row0 + g + 8 * (e >> 1);
        const int j = nt * 8 + 2 * q4 + (e & 1);
        const bool vis = !need_mask || (j < qn && i < kvalid && i - j <= dmax);
        const float pv = vis ? exp2f(fmaf(st[nt][e], c, -lse2[j])) : 0.0f;
        st[nt][e] = pv;
        dpt[nt][e] = pv * p.scale * (dpt[nt][e] - dlt[j]);
      }

      // dV += P^T dO and dK += dS^T Q, P and dS rounded to bf16.
#pragma unroll
    for (int qc = 0; qc < kBq / 16; ++qc) {
      std::uint32_t ap[4], ads[4];
      c_to_a(ap, st[2 * qc], st[2 * qc + 1]);
      c_to_a(ads, dpt[2 * qc], dpt[2 * qc + 1]);
#pragma unroll
      for (int dp2 = 0; dp2 < D / 16; ++dp2) {
        std::uint32_t bb[4];
        load_b_kn_x2(bb, dost + qc * 16 * kLd + dp2 * 16, kLd, lane);
        mma_16816(dv[2 * dp2], ap, bb[0], bb[1]);
        mma_16816(dv[2 * dp2 + 1], ap, bb[2], bb[3]);
        load_b_kn_x2(bb, qst + qc * 16 * kLd + dp2 * 16, kLd, lane);
        mma_16816(dk[2 * dp2], ads, bb[0], bb[1]);
        mma_16816(dk[2 * dp2 + 1], ads, bb[2], bb[3]);
      }
    }
    __syncthreads();
    z = nz;
    t0 = nt0;
  }
  cp_async_wait<0>();

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = row0 + g + 8 * h;
    if (i < kvalid) {
      float* dkr = kv.dk[b] + static_cast<i64>(s0 + i) * p.ldk + zkD + 2 * q4;
      float* dvr = kv.dv[b] + static_cast<i64>(s0 + i) * p.ldv + zkD + 2 * q4;
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        dkr[dt * 8] += dk[dt][2 * h];
        dkr[dt * 8 + 1] += dk[dt][2 * h + 1];
        dvr[dt * 8] += dv[dt][2 * h];
        dvr[dt * 8 + 1] += dv[dt][2 * h + 1];
      }
    }
  }
}

// ---- launchers ----------------------------------------------------------------------------

// Tile shapes per head size (register budgets: see the comment at the top of the file).
template <int D>
struct Shapes {
  static constexpr int kFwdMT = 2;                  // 32 query rows per warp
  static constexpr int kFwdBk = D == 64 ? 64 : 32;  // key rows per tile
  static constexpr int kDqBk = 64;
  static constexpr int kDkvBq = D == 64 ? 64 : 32;  // 64 spills registers at A = 128
};

template <typename Kernel>
void launch(Kernel kernel, i64 blocks, int smem, const AttnParams& p, const KVTable& kv,
            cudaStream_t stream) {
  if (blocks == 0) return;
  SPPO_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid_x(blocks, "attention"), kTcThreads, smem, stream>>>(p, kv);
  SPPO_CUDA_CHECK_LAUNCH();
}

template <int D>
void forward_d(const AttnParams& p, const KVTable& kv, cudaStream_t stream) {
  using S = Shapes<D>;
  using F = Fwd<D, S::kFwdMT, S::kFwdBk>;
  launch(attn_fwd_tc<D, S::kFwdMT, S::kFwdBk>, ceil_div(p.Tq, F::kBq) * p.Z, F::kSmem, p, kv,
         stream);
}

template <int D>
void backward_d(const AttnParams& p, KVTable& kv, cudaStream_t stream) {
  using S = Shapes<D>;
  using Q = Dq<D, S::kDqBk>;
  using K = Dkv<D, S::kDkvBq>;
  launch(attn_dq_tc<D, S::kDqBk>, ceil_div(p.Tq, Q::kBq) * p.Z, Q::kSmem, p, kv, stream);
  const int tiles = fill_tile_starts(kv, p.q_pos0 + p.Tq - 1, K::kBk);
  launch(attn_dkdv_tc<D, S::kDkvBq>, static_cast<i64>(tiles) * p.Zkv, K::kSmem, p, kv, stream);
}

}  // namespace

bool tc_head_size_supported(int A) { return A == 64 || A == 128; }

void tc_forward(const AttnParams& p, const KVTable& kv, cudaStream_t stream) {
  if (p.A == 64)
    forward_d<64>(p, kv, stream);
  else
    forward_d<128>(p, kv, stream);
}

void tc_backward(const AttnParams& p, KVTable& kv, cudaStream_t stream) {
  if (p.A == 64)
    backward_d<64>(p, kv, stream);
  else
    backward_d<128>(p, kv, stream);
}

}  // namespace sppo::cuda
