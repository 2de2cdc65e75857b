// CPU fp32 causal flash attention; the contract is in kernels/attention.h.
//
// Note [Attention tiling]
// Every matrix product here is one register-blocked micro-kernel,
//   C[MR, 16*NV] (+)= X[MR, K] @ Y[K, 16*NV]        (6 x 4 vectors: 24 accumulators)
// that reads X by scalar broadcasts, so X may be stored in either orientation, and Y by rows
// of 16-lane vectors. A 16-lane vector is one AVX-512 register; without AVX-512 the same code
// runs on a plain 16-float struct. Operands are first packed into tile-local buffers with
// contiguous rows (see pack_rows for why), and the only operands that must be transposed are
// packed once per tile and reused by many products.
//
// Forward, one task per (head z, query tile of kFwdBq = 256 rows). The task packs its queries
// transposed once (qt[A, 256]), then walks the key tiles of kFwdBk = 64 rows its queries see
// (of key/value head z / (Z / Zkv): with grouped-query attention several tasks read them):
//   st[kn, 256] = K_tile @ qt             scores TRANSPOSED: a row per key, a column per query
//   online softmax down the columns       running max and sum are vertical vector ops, never
//                                         horizontal reductions
//   o[256, A] = diag(alpha) o + P @ V     P read from st by broadcasts; alpha applied as the
//                                         micro-kernel loads o
// Key tiles wholly in every query's past skip the mask; keys in every query's future are never
// visited; on a diagonal tile the column blocks of queries before the tile's first key are
// skipped. The wide query tile is what keeps the forward compute-bound: each K/V row fetched
// from memory serves 256 queries. Softmax works in base 2 (c = scale * log2(e)), so exp is one
// polynomial plus a scale by a power of two.
//
// Backward, one task per (key/value head, group of key tiles), see Note [Deterministic
// backward]. The task takes the query heads that read its key/value head (one, without
// grouped-query attention) one after another: it packs the head's q and dout rows once (every
// key tile reads them again), and per key tile of kBwdBk = 128 rows it packs K, and K and V
// transposed (kt, vt [A, 128]), then walks the query tiles of kBwdBq = 64 rows that see the
// tile, starting at the first query that sees its first key:
//   s = Q @ kt, dp = dO @ vt              [qn, 128], a row per query
//   P = exp(scale s - lse), dS = scale P (dp - delta)   in place of s and dp
//   dv_tile += P^T dO, dk_tile += dS^T Q  tile-local, added to dk/dv once per key tile and
//                                         query head
//   dq_acc += dS K                        the task's own [Tq, A] accumulator
//
// Note [Deterministic backward]
// dk/dv of a key tile of a key/value head belong to the task that owns the tile. With
// grouped-query attention Z / Zkv query heads add into the same dk/dv head, so that task runs
// them all itself, in head order: the tile's dk/dv get one addition per query head, in the same
// order on every run, with no atomics. dq rows are touched by every key tile, so dq goes through
// accumulators: with one task per key/value head (G = 1, enough heads for the threads), a task
// sums each of its query heads' dq in a per-thread accumulator and adds it to dq's columns of
// that head, which no other task touches. With too few key/value heads to keep the threads
// busy, a head's key tiles are dealt round-robin to G > 1 tasks, each with its own accumulator
// per query head, and these are added to dq in group order after all tasks. Which thread runs a
// task never changes the arithmetic, so results are bit-identical run to run; G depends on the
// thread count, so a different thread count may round differently.
#include "backends/cpu/attention.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "core/check.h"
#include "backends/cpu/scratch.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace sppo::cpu {
namespace {

constexpr int kLanes = 16;                  // floats per vector
constexpr int kMr = 6;                      // micro-kernel rows
constexpr int kNvMax = 4;                   // micro-kernel vectors per row: 6 x 4 = 24 accumulators
constexpr int kColBlock = kNvMax * kLanes;  // columns of one micro-kernel call
constexpr int kFwdBq = 256;                 // forward query tile (rows); a multiple of kColBlock
constexpr int kFwdBk = 64;                  // forward key tile (rows)
constexpr int kBwdBq = 64;                  // backward query tile (rows)
constexpr int kBwdBk = 128;                 // backward key tile (rows); a multiple of kLanes
constexpr float kLog2e = 1.44269504088896340736f;
constexpr double kLn2 = 0.693147180559945309417;
constexpr float kInf = std::numeric_limits<float>::infinity();

static_assert(kFwdBq % kColBlock == 0 && kBwdBk % kLanes == 0);

// ---- 16-lane vectors ------------------------------------------------------------------
// 2^f on [-0.5, 0.5]: 1 + f (c1 + f (c2 + f (c3 + f (c4 + f c5)))), relative error 1.7e-7 in
// fp32 evaluation (weighted least squares iterated to minimax on the relative error).
constexpr float kExp2C1 = 6.931470037e-01f;
constexpr float kExp2C2 = 2.402224243e-01f;
constexpr float kExp2C3 = 5.550733581e-02f;
constexpr float kExp2C4 = 9.671512991e-03f;
constexpr float kExp2C5 = 1.326472731e-03f;

#ifdef __AVX512F__
using Vec = __m512;
using Mask = __mmask16;

inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vbroadcast(float x) { return _mm512_set1_ps(x); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline void vstore(float* p, Vec v, Mask m) { _mm512_mask_storeu_ps(p, m, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
// The unmasked forms of max, roundscale and scalef pass _mm512_undefined_ps() as the unused
// merge source, which GCC 12 reports as uninitialised; an all-lanes mask gives the same
// instruction without it.
constexpr __mmask16 kAll16 = 0xFFFF;
inline Vec vmax(Vec a, Vec b) { return _mm512_mask_max_ps(a, kAll16, a, b); }
// Lanes in m: max(a, b); other lanes: a.
inline Vec vmax(Vec a, Vec b, Mask m) { return _mm512_mask_max_ps(a, m, a, b); }
// Lanes in m: a; other lanes: 0.
inline Vec vkeep(Vec a, Mask m) { return _mm512_maskz_mov_ps(m, a); }
// Lanes where a > -inf.
inline Mask vabove_neg_inf(Vec a) { return _mm512_cmp_ps_mask(a, vbroadcast(-kInf), _CMP_GT_OQ); }

// 2^x for finite x (x = -inf or +inf gives NaN: callers mask such lanes).
inline Vec vexp2(Vec x) {
  const Vec n =
      _mm512_mask_roundscale_ps(x, kAll16, x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const Vec f = _mm512_sub_ps(x, n);
  Vec p = vfma(vbroadcast(kExp2C5), f, vbroadcast(kExp2C4));
  p = vfma(p, f, vbroadcast(kExp2C3));
  p = vfma(p, f, vbroadcast(kExp2C2));
  p = vfma(p, f, vbroadcast(kExp2C1));
  p = vfma(p, f, vbroadcast(1.0f));
  return _mm512_mask_scalef_ps(p, kAll16, p, n);
}
#else
// Portable 16-lane vector: the compiler vectorises the lane loops for whatever it targets.
struct Vec {
  float v[kLanes];
};
using Mask = std::uint32_t;

inline Vec vzero() { return Vec{}; }
inline Vec vbroadcast(float x) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = x;
  return r;
}
inline Vec vload(const float* p) {
  Vec r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
}
inline Vec vload(const float* p, Mask m) {
  Vec r{};
  for (int i = 0; i < kLanes; ++i)
    if (m >> i & 1u) r.v[i] = p[i];
  return r;
}
inline void vstore(float* p, Vec a) { std::memcpy(p, a.v, sizeof a.v); }
inline void vstore(float* p, Vec a, Mask m) {
  for (int i = 0; i < kLanes; ++i)
    if (m >> i & 1u) p[i] = a.v[i];
}
#define SPPO_LANEWISE(name, expr)                   \
  inline Vec name(Vec a, Vec b) {                   \
    Vec r;                                          \
    for (int i = 0; i < kLanes; ++i) r.v[i] = expr; \
    return r;                                       \
  }
SPPO_LANEWISE(vadd, a.v[i] + b.v[i])
SPPO_LANEWISE(vsub, a.v[i] - b.v[i])
SPPO_LANEWISE(vmul, a.v[i] * b.v[i])
SPPO_LANEWISE(vmax, a.v[i] > b.v[i] ? a.v[i] : b.v[i])
#undef SPPO_LANEWISE
inline Vec vfma(Vec a, Vec b, Vec c) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return r;
}
inline Vec vmax(Vec a, Vec b, Mask m) {
  for (int i = 0; i < kLanes; ++i)
    if ((m >> i & 1u) && b.v[i] > a.v[i]) a.v[i] = b.v[i];
  return a;
}
inline Vec vkeep(Vec a, Mask m) {
  for (int i = 0; i < kLanes; ++i)
    if (!(m >> i & 1u)) a.v[i] = 0.0f;
  return a;
}
inline Mask vabove_neg_inf(Vec a) {
  Mask m = 0;
  for (int i = 0; i < kLanes; ++i)
    if (a.v[i] > -kInf) m |= Mask{1} << i;
  return m;
}
inline Vec vexp2(Vec x) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = std::exp2(x.v[i]);
  return r;
}
#endif

constexpr Mask kAllLanes = Mask((1u << kLanes) - 1);

// Lanes 0 .. n-1 (n clamped to [0, 16]).
inline Mask first_lanes(i64 n) {
  if (n <= 0) return Mask(0);
  if (n >= kLanes) return kAllLanes;
  return Mask((1u << n) - 1);
}

// ---- micro-kernel ---------------------------------------------------------------------
// C[MR, 16 NV] = (accumulate ? diag(c_scale) C : 0) + X[MR, K] @ Y[K, 16 NV]. X(r, k) is
// x[r * ldx + k], or x[k * ldx + r] when XT (X stored transposed). Y row k starts at
// y + k * ldy. c_scale (may be null: no scaling) holds one factor per row of C. With TAIL the
// last vector of each row of Y and C holds only the lanes in `tail`.
template <int MR, int NV, bool XT, bool TAIL>
void micro_kernel(float* __restrict c, i64 ldc, const float* __restrict c_scale,
                  const float* __restrict x, i64 ldx, const float* __restrict y, i64 ldy, int K,
                  Mask tail, bool accumulate) {
  Vec acc[MR][NV];
  if (accumulate) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v)
        acc[r][v] = (TAIL && v == NV - 1) ? vload(c + r * ldc + v * kLanes, tail)
                                          : vload(c + r * ldc + v * kLanes);
    if (c_scale != nullptr) {
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const Vec f = vbroadcast(c_scale[r]);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[r][v] = vmul(acc[r][v], f);
      }
    }
  } else {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = vzero();
  }
  const i64 x_step = XT ? ldx : 1;
  const i64 x_row = XT ? 1 : ldx;
  for (int kk = 0; kk < K; ++kk) {
    Vec yv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      yv[v] = (TAIL && v == NV - 1) ? vload(y + v * kLanes, tail) : vload(y + v * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const Vec b = vbroadcast(x[r * x_row]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = vfma(b, yv[v], acc[r][v]);
    }
    x += x_step;
    y += ldy;
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      if (TAIL && v == NV - 1)
        vstore(c + r * ldc + v * kLanes, acc[r][v], tail);
      else
        vstore(c + r * ldc + v * kLanes, acc[r][v]);
    }
}

using MicroKernel = void (*)(float*, i64, const float*, const float*, i64, const float*, i64, int,
                             Mask, bool);

template <bool XT, bool TAIL, int... I>
constexpr std::array<MicroKernel, sizeof...(I)> micro_kernels(std::integer_sequence<int, I...>) {
  return {&micro_kernel<I / kNvMax + 1, I % kNvMax + 1, XT, TAIL>...};
}

// Indexed by (rows - 1) * kNvMax + (vectors - 1).
template <bool XT, bool TAIL>
constexpr auto kMicroKernels =
    micro_kernels<XT, TAIL>(std::make_integer_sequence<int, kMr * kNvMax>{});

// Note [Prefetching the next tile]
// The rows of one head in a caller's buffer are H floats apart: a stride the hardware
// prefetchers do not follow across pages, so every row of a freshly packed tile is a cold miss.
// The tile loops name the rows they will pack next, and every micro-kernel call of the current
// tile requests one or two of them, spread out so that the requests do not queue for miss
// buffers the way one burst per tile would.
class RowPrefetcher {
 public:
  // `rows` rows of `width` floats at a and, if b is not null, at b (row strides lda, ldb);
  // `per_step` rows per step(); `write` when the rows are about to be written.
  void reset(const float* a, i64 lda, const float* b, i64 ldb, int rows, int width, int per_step,
             bool write) {
    a_ = a, b_ = b, lda_ = lda, ldb_ = ldb;
    rows_ = rows, width_ = width, per_step_ = per_step, next_ = 0, write_ = write;
  }
  // Requests the next rows.
  void step() {
    for (const int end = std::min(rows_, next_ + per_step_); next_ < end; ++next_) {
      row(a_ + next_ * lda_);
      if (b_ != nullptr) row(b_ + next_ * ldb_);
    }
  }

 private:
  void row(const float* p) const {
    // The last element too: a row may straddle one more line than width / 16.
    if (write_) {
      for (int x = 0; x < width_; x += kLanes) __builtin_prefetch(p + x, 1, 2);
      __builtin_prefetch(p + width_ - 1, 1, 2);
    } else {
      for (int x = 0; x < width_; x += kLanes) __builtin_prefetch(p + x, 0, 2);
      __builtin_prefetch(p + width_ - 1, 0, 2);
    }
  }
  const float* a_ = nullptr;
  const float* b_ = nullptr;
  i64 lda_ = 0, ldb_ = 0;
  int rows_ = 0, width_ = 0, per_step_ = 0, next_ = 0;
  bool write_ = false;
};

// C[M, N] = (accumulate ? diag(c_scale) C : 0) + X[M, K] @ Y[K, N], with X(r, k) =
// x[r * ldx + k], or x[k * ldx + r] when XT; c_scale[M] may be null. Rows of Y and C are
// contiguous in N; columns past N are untouched. Each micro-kernel call steps `prefetch`.
template <bool XT>
void gemm_tile(float* c, i64 ldc, const float* c_scale, const float* x, i64 ldx, const float* y,
               i64 ldy, int M, int N, int K, bool accumulate, RowPrefetcher& prefetch) {
  for (int n0 = 0; n0 < N; n0 += kNvMax * kLanes) {
    const int cols = std::min(N - n0, kNvMax * kLanes);
    const int nv = (cols + kLanes - 1) / kLanes;
    const int tail_lanes = cols - (nv - 1) * kLanes;
    const bool tail = tail_lanes != kLanes;
    const Mask tail_mask = first_lanes(tail_lanes);
    for (int m0 = 0; m0 < M; m0 += kMr) {
      const int mr = std::min(M - m0, kMr);
      const MicroKernel mk = tail ? kMicroKernels<XT, true>[(mr - 1) * kNvMax + nv - 1]
                                  : kMicroKernels<XT, false>[(mr - 1) * kNvMax + nv - 1];
      mk(c + m0 * ldc + n0, ldc, c_scale != nullptr ? c_scale + m0 : nullptr,
         x + (XT ? m0 : m0 * ldx), ldx, y + n0, ldy, K, tail_mask, accumulate);
      prefetch.step();
    }
  }
}

// ---- buffers and geometry ---------------------------------------------------------------
struct FreeDeleter {
  bool owned = true;  // false: the caller's scratch, released with it
  void operator()(float* p) const {
    if (owned) std::free(p);
  }
};
using Buffer = std::unique_ptr<float[], FreeDeleter>;

// 64-byte aligned, uninitialised: from the caller's scratch when there is one.
Buffer alloc_floats(std::size_t n, Scratch* scratch) {
  if (scratch) return Buffer(scratch->floats(n), FreeDeleter{false});
  const std::size_t bytes = Scratch::cost(n * sizeof(float));
  auto* p = static_cast<float*>(std::aligned_alloc(64, std::max<std::size_t>(bytes, 64)));
  SPPO_ASSERT(p != nullptr);
  return Buffer(p);
}

inline int round_up(int n, int m) { return (n + m - 1) / m * m; }

// AttnDims with the strides resolved and the derived constants.
struct Geometry {
  int Tq, Tk, Z, A;
  int Zkv;    // key/value heads
  int share;  // query heads per key/value head: Z / Zkv
  int Ap;  // A rounded up to whole vectors: the row stride of tile-local [., A] buffers
  i64 q_pos0, k_pos0;
  i64 ldq, ldk, ldv, ldo;
  float scale;  // 1 / sqrt(A)
  float c;      // scale * log2(e): scores to base-2 exponents
  // The key/value head query head z reads.
  int kv_head(int z) const { return z / share; }
};

Geometry resolve(const AttnDims& d) {
  SPPO_CHECK(d.Tq >= 0 && d.Tk >= 0, "attention")
      << "Tq and Tk must be >= 0, got " << d.Tq << ", " << d.Tk;
  SPPO_CHECK(d.Z > 0 && d.A > 0, "attention")
      << "Z and A must be positive, got " << d.Z << ", " << d.A;
  SPPO_CHECK(d.Zkv >= 0 && d.Zkv <= d.Z && (d.Zkv == 0 || d.Z % d.Zkv == 0), "attention")
      << "key/value heads Zkv must be 0 or divide Z = " << d.Z << ", got " << d.Zkv;
  Geometry g{};
  g.Tq = d.Tq;
  g.Tk = d.Tk;
  g.Z = d.Z;
  g.A = d.A;
  g.Zkv = d.Zkv ? d.Zkv : d.Z;
  g.share = g.Z / g.Zkv;
  g.Ap = round_up(d.A, kLanes);
  g.q_pos0 = d.q_pos0;
  g.k_pos0 = d.k_pos0;
  const i64 H = i64(d.Z) * d.A, Hkv = i64(g.Zkv) * d.A;
  g.ldq = d.ldq ? d.ldq : H;
  g.ldk = d.ldk ? d.ldk : Hkv;
  g.ldv = d.ldv ? d.ldv : Hkv;
  g.ldo = d.ldo ? d.ldo : H;
  SPPO_CHECK(g.ldq >= H && g.ldo >= H, "attention")
      << "row strides of q and out must be 0 or >= Z*A = " << H << ", got ldq " << g.ldq
      << ", ldo " << g.ldo;
  SPPO_CHECK(g.ldk >= Hkv && g.ldv >= Hkv, "attention")
      << "row strides of k and v must be 0 or >= Zkv*A = " << Hkv << ", got ldk " << g.ldk
      << ", ldv " << g.ldv;
  g.scale = 1.0f / std::sqrt(float(d.A));
  g.c = g.scale * kLog2e;
  return g;
}

// True when no key of the block is visible to any query of the block.
bool nothing_visible(const Geometry& g) {
  return g.Tq == 0 || g.Tk == 0 || g.k_pos0 > g.q_pos0 + g.Tq - 1;
}

// rows x A block at src (row stride ld) -> dst (row stride Ap). Operands are packed even where
// they could be read in place: the rows of one head in a caller's buffer are H floats apart,
// often a power of two bytes (H = 1024: 4 KiB), which maps every row of a tile to the same few
// L1 sets, so a tile read in place is re-fetched from L2 by every micro-kernel call.
void pack_rows(float* __restrict dst, int Ap, const float* __restrict src, i64 ld, int rows,
               int A) {
  const int full = A / kLanes * kLanes;
  const Mask tail = first_lanes(A - full);
  for (int r = 0; r < rows; ++r) {
    const float* s = src + r * ld;
    float* d = dst + i64(r) * Ap;
    for (int a = 0; a < full; a += kLanes) vstore(d + a, vload(s + a));
    if (full < A) vstore(d + full, vload(s + full, tail), tail);
  }
}

// pack_rows for long runs of rows: requests each source row kAhead rows before copying it.
void pack_rows_ahead(float* __restrict dst, int Ap, const float* __restrict src, i64 ld, int rows,
                     int A) {
  constexpr int kAhead = 16;
  RowPrefetcher prefetch;
  prefetch.reset(src, ld, nullptr, 0, rows, A, 1, false);
  for (int r = 0; r < std::min(kAhead, rows); ++r) prefetch.step();
  for (int r = 0; r < rows; ++r) {
    prefetch.step();
    pack_rows(dst + i64(r) * Ap, Ap, src + r * ld, ld, 1, A);
  }
}

// dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols, in 16 x 16 blocks: a block's
// 16 source rows and 16 destination rows stay in L1, where a row-by-row transpose would
// scatter each source row over 64 destination lines in the same few L1 sets.
void transpose(float* __restrict dst, i64 ldd, const float* __restrict src, i64 lds, int rows,
               int cols) {
  for (int r0 = 0; r0 < rows; r0 += kLanes) {
    const int rn = std::min(kLanes, rows - r0);
    for (int c0 = 0; c0 < cols; c0 += kLanes) {
      const int cn = std::min(kLanes, cols - c0);
      for (int c = 0; c < cn; ++c)
        for (int r = 0; r < rn; ++r) dst[(c0 + c) * ldd + r0 + r] = src[(r0 + r) * lds + c0 + c];
    }
  }
}

// ---- forward ----------------------------------------------------------------------------
struct ForwardScratch {
  ForwardScratch(const Geometry& g, Scratch* s)
      : qt(alloc_floats(std::size_t(g.A) * kFwdBq, s)),
        k(alloc_floats(std::size_t(kFwdBk) * g.Ap, s)),
        v(alloc_floats(std::size_t(kFwdBk) * g.Ap, s)),
        st(alloc_floats(std::size_t(kFwdBk) * kFwdBq, s)),
        o(alloc_floats(std::size_t(kFwdBq) * g.Ap, s)),
        m(alloc_floats(kFwdBq, s)),
        l(alloc_floats(kFwdBq, s)),
        alpha(alloc_floats(kFwdBq, s)) {}
  // Bytes one thread takes (the size function's count of the allocations above).
  static std::size_t bytes(int A, int Ap) {
    const auto f = [](std::size_t n) { return Scratch::cost(n * sizeof(float)); };
    return f(std::size_t(A) * kFwdBq) + 2 * f(std::size_t(kFwdBk) * Ap) + f(std::size_t(kFwdBk) * kFwdBq) +
           f(std::size_t(kFwdBq) * Ap) + 3 * f(kFwdBq);
  }
  Buffer qt;     // [A, kFwdBq] the task's queries, transposed, zero past the last row
  Buffer k;      // [kFwdBk, Ap] keys of the key tile
  Buffer v;      // [kFwdBk, Ap] values of the key tile
  Buffer st;     // [kFwdBk, kFwdBq] scores, then probabilities, of one key tile, transposed
  Buffer o;      // [kFwdBq, Ap] unnormalised output
  Buffer m;      // [kFwdBq] running max of the raw scores q.k
  Buffer l;      // [kFwdBq] running sum of 2^(c (q.k - m))
  Buffer alpha;  // [kFwdBq] rescale of o for the current key tile
};

// One key tile's online-softmax step on st[kn, kFwdBq] (a column per query), for the query
// columns from block b_lo to block b_hi (blocks of kColBlock columns). With DIAG, key j is
// visible to query i iff d0 + j <= i; without, every key is visible to every query.
template <bool DIAG>
void online_softmax(float* st, int kn, int b_lo, int b_hi, float* m, float* l, float* alpha,
                    float c, i64 d0) {
  constexpr int NG = kColBlock / kLanes;  // vectors of a block: 3 x NG of state in registers
  const Vec vc = vbroadcast(c);
  for (int b = b_lo; b < b_hi; ++b) {
    const int col = b * kColBlock;
    const auto visible = [d0, col](int j, int g) {
      return Mask(~first_lanes(d0 + j - col - g * kLanes) & kAllLanes);
    };
    Vec m_new[NG];
    for (int g = 0; g < NG; ++g) m_new[g] = vload(m + col + g * kLanes);
    for (int j = 0; j < kn; ++j) {
      const float* row = st + i64(j) * kFwdBq + col;
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g) {
        if constexpr (DIAG)
          m_new[g] = vmax(m_new[g], vload(row + g * kLanes), visible(j, g));
        else
          m_new[g] = vmax(m_new[g], vload(row + g * kLanes));
      }
    }
    Vec neg_cm[NG], sum[NG];
    for (int g = 0; g < NG; ++g) {
      // Exponents subtract exactly the float c*m that alpha and the final lse use.
      const Vec m_old = vload(m + col + g * kLanes);
      const Vec cm_new = vmul(m_new[g], vc);
      neg_cm[g] = vsub(vzero(), cm_new);
      // Queries that saw no key before have o = 0 and l = 0; alpha only has to be finite.
      const Vec a = vkeep(vexp2(vsub(vmul(m_old, vc), cm_new)), vabove_neg_inf(m_old));
      vstore(alpha + col + g * kLanes, a);
      vstore(m + col + g * kLanes, m_new[g]);
      sum[g] = vmul(vload(l + col + g * kLanes), a);
    }
    for (int j = 0; j < kn; ++j) {
      float* row = st + i64(j) * kFwdBq + col;
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g) {
        Vec p = vexp2(vfma(vload(row + g * kLanes), vc, neg_cm[g]));
        if constexpr (DIAG) p = vkeep(p, visible(j, g));
        vstore(row + g * kLanes, p);
        sum[g] = vadd(sum[g], p);
      }
    }
    for (int g = 0; g < NG; ++g) vstore(l + col + g * kLanes, sum[g]);
  }
}

// One key block as the tile loops see it: g is the call's geometry with this block's Tk and
// k_pos0; dk, dv (backward only) accumulate the block's gradients.
struct KeySource {
  const float* k;
  const float* v;
  float* dk;
  float* dv;
  Geometry g;
};

// The call's geometry with each block's Tk and k_pos0, blocks checked.
std::vector<KeySource> key_sources(const std::vector<KVBlock>& blocks, const Geometry& g,
                                   bool backward) {
  std::vector<KeySource> src;
  src.reserve(blocks.size());
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    const KVBlock& kb = blocks[b];
    SPPO_CHECK(kb.Tk >= 0, "attention") << "block " << b << ": Tk must be >= 0, got " << kb.Tk;
    SPPO_CHECK(kb.Tk == 0 || (kb.k != nullptr && kb.v != nullptr), "attention")
        << "block " << b << ": k and v must be set";
    SPPO_CHECK(!backward || kb.Tk == 0 || (kb.dk != nullptr && kb.dv != nullptr), "attention")
        << "block " << b << ": dk and dv must be set for the backward";
    KeySource s{kb.k, kb.v, kb.dk, kb.dv, g};
    s.g.Tk = kb.Tk;
    s.g.k_pos0 = kb.k_pos0;
    src.push_back(s);
  }
  return src;
}

// Queries t0 .. t0+kFwdBq-1 of head z against every key they can see in blocks[0 .. n), one
// online softmax over all of them.
void forward_tile(float* out, float* lse, const float* q, const KeySource* blocks, int n,
                  const Geometry& g, bool merge, int z, int t0, ForwardScratch& w) {
  const int A = g.A, Ap = g.Ap;
  const i64 zkA = i64(g.kv_head(z)) * A;  // the key/value head's columns
  const int qn = std::min(kFwdBq, g.Tq - t0);
  const i64 qp_first = g.q_pos0 + t0;
  const i64 qp_last = qp_first + qn - 1;
  // Keys are in position order within a block, so the keys of block b visible to some query of
  // the tile are a prefix of it.
  std::vector<i64> keys(n);
  i64 total = 0;
  for (int b = 0; b < n; ++b) {
    keys[b] = std::clamp<i64>(qp_last - blocks[b].g.k_pos0 + 1, 0, blocks[b].g.Tk);
    total += keys[b];
  }
  float* m = w.m.get();
  float* l = w.l.get();
  float* o = w.o.get();
  for (int i = 0; i < kFwdBq; ++i) {
    m[i] = -kInf;
    l[i] = 0.0f;
  }
  if (total > 0) {
    std::memset(o, 0, sizeof(float) * std::size_t(kFwdBq) * Ap);
    // Query columns in blocks of kColBlock; blocks past the last query are never computed.
    const int b_end = (qn + kColBlock - 1) / kColBlock;
    float* qt = w.qt.get();
    transpose(qt, kFwdBq, q + t0 * g.ldq + i64(z) * A, g.ldq, qn, A);
    for (int a = 0; a < A; ++a)
      for (int i = qn; i < b_end * kColBlock; ++i) qt[a * kFwdBq + i] = 0.0f;

    float* st = w.st.get();
    RowPrefetcher prefetch;
    for (int b = 0; b < n; ++b) {
      const float* k = blocks[b].k;
      const float* v = blocks[b].v;
      const Geometry& gb = blocks[b].g;
      for (i64 s0 = 0; s0 < keys[b]; s0 += kFwdBk) {
        const int kn = int(std::min<i64>(kFwdBk, keys[b] - s0));
        const i64 kp_first = gb.k_pos0 + s0;
        // See Note [Prefetching the next tile]: the next key tile's rows (in this block or the
        // next one with visible keys), or during the last key tile the output rows (the tile
        // makes ~90 micro-kernel calls).
        const float* nk = nullptr;
        const float* nv = nullptr;
        i64 n_rows = 0;
        if (s0 + kFwdBk < keys[b]) {
          const i64 s1 = s0 + kFwdBk;
          nk = k + s1 * gb.ldk, nv = v + s1 * gb.ldv, n_rows = std::min<i64>(kFwdBk, keys[b] - s1);
        } else {
          for (int c = b + 1; c < n && nk == nullptr; ++c)
            if (keys[c] > 0)
              nk = blocks[c].k, nv = blocks[c].v, n_rows = std::min<i64>(kFwdBk, keys[c]);
        }
        if (nk != nullptr)
          prefetch.reset(nk + zkA, gb.ldk, nv + zkA, gb.ldv, int(n_rows), A, 1, false);
        else
          prefetch.reset(out + t0 * g.ldo + i64(z) * A, g.ldo, nullptr, 0, qn, A, 3, true);
        pack_rows(w.k.get(), Ap, k + s0 * gb.ldk + zkA, gb.ldk, kn, A);
        pack_rows(w.v.get(), Ap, v + s0 * gb.ldv + zkA, gb.ldv, kn, A);
        const bool diag = kp_first + kn - 1 > qp_first;
        // On a diagonal tile the queries before the first key see none of the tile: skip their
        // column blocks.
        const int b_lo = diag ? int(std::max<i64>(0, kp_first - qp_first) / kColBlock) : 0;
        const int col = b_lo * kColBlock, cols = b_end * kColBlock - col;
        gemm_tile<false>(st + col, kFwdBq, nullptr, w.k.get(), Ap, qt + col, kFwdBq, kn, cols, A,
                         false, prefetch);
        if (diag)
          online_softmax<true>(st, kn, b_lo, b_end, m, l, w.alpha.get(), g.c, kp_first - qp_first);
        else
          online_softmax<false>(st, kn, b_lo, b_end, m, l, w.alpha.get(), g.c, 0);
        // o = o * alpha + P @ V, alpha applied as the micro-kernels load o.
        gemm_tile<true>(o + i64(col) * Ap, Ap, w.alpha.get() + col, st + col, kFwdBq, w.v.get(),
                        Ap, qn - col, A, kn, true, prefetch);
      }
    }
  }

  for (int i = 0; i < qn; ++i) {
    const i64 t = t0 + i;
    float* orow = out + t * g.ldo + i64(z) * A;
    float* lrow = lse + i64(z) * g.Tq + t;
    const float* oi = o + i64(i) * Ap;
    if (l[i] == 0.0f) {  // no visible key in these blocks (the max alone contributes 1)
      if (!merge) {
        std::fill(orow, orow + A, 0.0f);
        *lrow = -kInf;
      }
      continue;
    }
    const float cm = g.c * m[i];
    const double lse_new = double(cm) * kLn2 + std::log(double(l[i]));
    if (!merge || !(*lrow > -kInf)) {
      const float inv = 1.0f / l[i];
      for (int a = 0; a < A; ++a) orow[a] = oi[a] * inv;
      *lrow = float(lse_new);
    } else {
      const double lse_old = *lrow;
      const double mx = std::max(lse_old, lse_new);
      const double w_old = std::exp(lse_old - mx), w_new = std::exp(lse_new - mx);
      const double total_w = w_old + w_new;
      const float f_old = float(w_old / total_w);
      const float f_new = float(w_new / total_w / l[i]);
      for (int a = 0; a < A; ++a) orow[a] = orow[a] * f_old + oi[a] * f_new;
      *lrow = float(mx + std::log(total_w));
    }
  }
}

// ---- backward ---------------------------------------------------------------------------
struct BackwardScratch {
  BackwardScratch(const Geometry& g, Scratch* sc)
      : q(alloc_floats(std::size_t(g.Tq) * g.Ap, sc)),
        dout(alloc_floats(std::size_t(g.Tq) * g.Ap, sc)),
        kt(alloc_floats(std::size_t(g.A) * kBwdBk, sc)),
        vt(alloc_floats(std::size_t(g.A) * kBwdBk, sc)),
        k(alloc_floats(std::size_t(kBwdBk) * g.Ap, sc)),
        s(alloc_floats(std::size_t(kBwdBq) * kBwdBk, sc)),
        dp(alloc_floats(std::size_t(kBwdBq) * kBwdBk, sc)),
        dk(alloc_floats(std::size_t(kBwdBk) * g.Ap, sc)),
        dv(alloc_floats(std::size_t(kBwdBk) * g.Ap, sc)) {}
  // Bytes one thread takes besides q and dout (which grow with Tq).
  static std::size_t tile_bytes(int A, int Ap) {
    const auto f = [](std::size_t n) { return Scratch::cost(n * sizeof(float)); };
    return 2 * f(std::size_t(A) * kBwdBk) + 3 * f(std::size_t(kBwdBk) * Ap) + 2 * f(std::size_t(kBwdBq) * kBwdBk);
  }
  // The task's head, packed once per task: every key tile reads these rows again.
  Buffer q;     // [Tq, Ap] queries of head z
  Buffer dout;  // [Tq, Ap] dout of head z
  Buffer kt;    // [A, kBwdBk] keys of the tile, transposed, zero past the last key
  Buffer vt;    // [A, kBwdBk] values of the tile, transposed, zero past the last key
  Buffer k;     // [kBwdBk, Ap] keys of the tile
  Buffer s;     // [kBwdBq, kBwdBk] scores, then P
  Buffer dp;    // [kBwdBq, kBwdBk] dP, then dS (scaled)
  Buffer dk;    // [kBwdBk, Ap] the tile's dk
  Buffer dv;    // [kBwdBk, Ap] the tile's dv
};

// P and dS of one (query tile, key tile) pair in place of s and dp. With DIAG key j is visible
// to query i iff j <= e0 + i; without, every key is visible to every query.
template <bool DIAG>
void backward_probs(float* s, float* dp, int qn, int kn, const float* lse, const float* delta,
                    float c, float scale, i64 e0) {
  const int nv = (kn + kLanes - 1) / kLanes;
  const Vec vc = vbroadcast(c), vscale = vbroadcast(scale);
  for (int i = 0; i < qn; ++i) {
    const Vec neg_lse2 = vbroadcast(-lse[i] * kLog2e);
    const Vec di = vbroadcast(delta[i]);
    float* srow = s + i64(i) * kBwdBk;
    float* dprow = dp + i64(i) * kBwdBk;
    for (int h = 0; h < nv; ++h) {
      Vec p = vexp2(vfma(vload(srow + h * kLanes), vc, neg_lse2));
      if constexpr (DIAG) p = vkeep(p, first_lanes(e0 + i - h * kLanes + 1));
      const Vec ds = vmul(vmul(p, vscale), vsub(vload(dprow + h * kLanes), di));
      vstore(srow + h * kLanes, p);
      vstore(dprow + h * kLanes, ds);
    }
  }
}

// Key tile starting at row s0 of the key/value head that query head z reads, against every
// query of head z that sees it: adds head z's share of the tile's rows of dk and dv, and
// accumulates into dq_z[Tq, Ap] (head z's dq, or a part of it). The head's q and dout rows the
// tile needs are already packed in w.q and w.dout.
void backward_tile(float* dq_z, float* dk, float* dv, const float* k, const float* v,
                   const float* lse, const float* delta, const Geometry& g, int z, int s0,
                   BackwardScratch& w) {
  const int A = g.A, Ap = g.Ap;
  const int kn = std::min(kBwdBk, g.Tk - s0);
  const i64 kp_first = g.k_pos0 + s0;
  const i64 kp_last = kp_first + kn - 1;
  const i64 t_begin = std::max<i64>(0, kp_first - g.q_pos0);  // first query that sees key s0
  if (t_begin >= g.Tq) return;
  const i64 zA = i64(g.kv_head(z)) * A;  // columns of the key/value head in k, v, dk, dv

  float* kt = w.kt.get();
  float* vt = w.vt.get();
  pack_rows(w.k.get(), Ap, k + s0 * g.ldk + zA, g.ldk, kn, A);
  transpose(kt, kBwdBk, w.k.get(), Ap, kn, A);
  transpose(vt, kBwdBk, v + s0 * g.ldv + zA, g.ldv, kn, A);
  for (int a = 0; a < A; ++a)
    for (int j = kn; j < kBwdBk; ++j) kt[a * kBwdBk + j] = vt[a * kBwdBk + j] = 0.0f;
  std::memset(w.dk.get(), 0, sizeof(float) * std::size_t(kBwdBk) * Ap);
  std::memset(w.dv.get(), 0, sizeof(float) * std::size_t(kBwdBk) * Ap);

  const int kn_cols = round_up(kn, kLanes);
  RowPrefetcher prefetch;
  for (i64 t0 = t_begin; t0 < g.Tq; t0 += kBwdBq) {
    const int qn = int(std::min<i64>(kBwdBq, g.Tq - t0));
    const i64 qp_first = g.q_pos0 + t0;
    // See Note [Prefetching the next tile]: during the last query tile, the dk and dv rows
    // written after it (the pair makes ~75 micro-kernel calls).
    if (t0 + kBwdBq >= g.Tq)
      prefetch.reset(dk + s0 * g.ldk + zA, g.ldk, dv + s0 * g.ldv + zA, g.ldv, kn, A, 2, true);
    const float* q_tile = w.q.get() + t0 * Ap;
    const float* do_tile = w.dout.get() + t0 * Ap;
    gemm_tile<false>(w.s.get(), kBwdBk, nullptr, q_tile, Ap, kt, kBwdBk, qn, kn_cols, A, false,
                     prefetch);
    gemm_tile<false>(w.dp.get(), kBwdBk, nullptr, do_tile, Ap, vt, kBwdBk, qn, kn_cols, A, false,
                     prefetch);
    const float* lse_tile = lse + i64(z) * g.Tq + t0;
    const float* delta_tile = delta + i64(z) * g.Tq + t0;
    if (kp_last > qp_first)
      backward_probs<true>(w.s.get(), w.dp.get(), qn, kn, lse_tile, delta_tile, g.c, g.scale,
                           qp_first - kp_first);
    else
      backward_probs<false>(w.s.get(), w.dp.get(), qn, kn, lse_tile, delta_tile, g.c, g.scale, 0);
    gemm_tile<true>(w.dv.get(), Ap, nullptr, w.s.get(), kBwdBk, do_tile, Ap, kn, A, qn, true,
                    prefetch);
    gemm_tile<true>(w.dk.get(), Ap, nullptr, w.dp.get(), kBwdBk, q_tile, Ap, kn, A, qn, true,
                    prefetch);
    gemm_tile<false>(dq_z + t0 * Ap, Ap, nullptr, w.dp.get(), kBwdBk, w.k.get(), Ap, qn, A, kn,
                     true, prefetch);
  }

  for (int j = 0; j < kn; ++j) {
    float* dkrow = dk + (s0 + j) * g.ldk + zA;
    float* dvrow = dv + (s0 + j) * g.ldv + zA;
    const float* dkt = w.dk.get() + i64(j) * Ap;
    const float* dvt = w.dv.get() + i64(j) * Ap;
#pragma omp simd
    for (int a = 0; a < A; ++a) {
      dkrow[a] += dkt[a];
      dvrow[a] += dvt[a];
    }
  }
}


// The forward over blocks[0 .. n): one task per (head, query tile), each over every block.
void forward_impl(float* out, float* lse, const float* q, const KeySource* blocks, int n,
                  const Geometry& g, bool merge, Scratch* scratch) {
  const int tiles = (g.Tq + kFwdBq - 1) / kFwdBq;
  const int tasks = tiles * g.Z;
  if (tasks == 0) return;
#pragma omp parallel num_threads(std::min(tasks, omp_get_max_threads()))
  {
    ForwardScratch w(g, scratch);
    // Later query tiles see more keys: hand them out first.
#pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < tasks; ++task) {
      const int tile = tiles - 1 - task / g.Z;
      forward_tile(out, lse, q, blocks, n, g, merge, task % g.Z, tile * kFwdBq, w);
    }
  }
}

// Tasks per key/value head of the backward (Note [Deterministic backward]): key-tile groups.
int backward_groups(int Zkv, int threads, int n_tiles) {
  if (Zkv % threads == 0 || Zkv >= 4 * threads) return 1;
  return std::min(n_tiles, (4 * threads + Zkv - 1) / Zkv);
}

// The backward over blocks[0 .. n): one task per (key/value head, group of key tiles of any
// block), see Note [Deterministic backward]. Key tiles no query sees are left out.
void backward_impl(float* dq, const float* dout, const float* q, const KeySource* blocks, int n,
                   const float* lse, const float* delta, const Geometry& g, Scratch* scratch) {
  struct KeyTile {
    int block, s0;
  };
  std::vector<KeyTile> key_tiles;
  const i64 qp_last = g.q_pos0 + g.Tq - 1;
  for (int b = 0; b < n; ++b)
    for (int s0 = 0; s0 < blocks[b].g.Tk && blocks[b].g.k_pos0 + s0 <= qp_last; s0 += kBwdBk)
      key_tiles.push_back({b, s0});
  if (g.Tq == 0 || key_tiles.empty()) return;
  const int n_tiles = int(key_tiles.size());
  const int threads = omp_get_max_threads();
  // Note [Deterministic backward]: G key-tile groups per key/value head.
  const int groups = backward_groups(g.Zkv, threads, n_tiles);
  const int tasks = g.Zkv * groups;
  const std::size_t part = std::size_t(g.Tq) * g.Ap;  // floats of one [Tq, Ap] dq accumulator
  // groups == 1: one accumulator per thread, added to dq after each query head of a task;
  // otherwise one per (query head, group), added to dq in group order after all tasks.
  Buffer partial = groups > 1 ? alloc_floats(part * g.Z * groups, scratch) : Buffer();
  // dq[t, head z] += acc[t] for t >= t_from.
  const auto add_to_dq = [&](int z, const float* acc, int t_from) {
    for (int t = t_from; t < g.Tq; ++t) {
      float* row = dq + t * g.ldq + i64(z) * g.A;
      const float* arow = acc + i64(t) * g.Ap;
#pragma omp simd
      for (int a = 0; a < g.A; ++a) row[a] += arow[a];
    }
  };
#pragma omp parallel num_threads(std::min(tasks, threads))
  {
    BackwardScratch w(g, scratch);
    Buffer own = groups == 1 ? alloc_floats(part, scratch) : Buffer();
#pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < tasks; ++task) {
      const int zk = task / groups, group = task % groups;
      // Queries before the first key of the task's tiles see none of its keys.
      i64 first_key = std::numeric_limits<i64>::max();
      for (int i = group; i < n_tiles; i += groups)
        first_key = std::min(first_key, blocks[key_tiles[i].block].g.k_pos0 + key_tiles[i].s0);
      const int t_lo = int(std::clamp<i64>(first_key - g.q_pos0, 0, g.Tq));
      // The query heads that read key/value head zk, in head order: each adds its share to the
      // task's dk/dv tiles (Note [Deterministic backward]).
      for (int z = zk * g.share; z < (zk + 1) * g.share; ++z) {
        float* dq_z = groups == 1 ? own.get()
                                  : partial.get() + (std::size_t(z) * groups + group) * part;
        const int zero_from = groups == 1 ? t_lo : 0;  // partials are summed over all rows
        std::memset(dq_z + std::size_t(zero_from) * g.Ap, 0,
                    (part - std::size_t(zero_from) * g.Ap) * sizeof(float));
        const i64 zA = i64(z) * g.A;
        pack_rows_ahead(w.q.get() + i64(t_lo) * g.Ap, g.Ap, q + t_lo * g.ldq + zA, g.ldq,
                        g.Tq - t_lo, g.A);
        pack_rows_ahead(w.dout.get() + i64(t_lo) * g.Ap, g.Ap, dout + t_lo * g.ldo + zA, g.ldo,
                        g.Tq - t_lo, g.A);
        for (int i = group; i < n_tiles; i += groups) {
          const KeySource& kb = blocks[key_tiles[i].block];
          backward_tile(dq_z, kb.dk, kb.dv, kb.k, kb.v, lse, delta, kb.g, z, key_tiles[i].s0, w);
        }
        if (groups == 1) add_to_dq(z, dq_z, t_lo);
      }
    }
  }
  if (groups > 1) {
#pragma omp parallel for schedule(static)
    for (int z = 0; z < g.Z; ++z)
      for (int group = 0; group < groups; ++group)
        add_to_dq(z, partial.get() + (std::size_t(z) * groups + group) * part, 0);
  }
}

}  // namespace

void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       const AttnDims& d, bool merge, Scratch* scratch) {
  const Geometry g = resolve(d);
  if (nothing_visible(g)) {
    if (merge) return;
    for (int t = 0; t < g.Tq; ++t)
      std::fill(out + t * g.ldo, out + t * g.ldo + i64(g.Z) * g.A, 0.0f);
    std::fill(lse, lse + i64(g.Z) * g.Tq, -kInf);
    return;
  }
  const KeySource block{k, v, nullptr, nullptr, g};
  forward_impl(out, lse, q, &block, 1, g, merge, scratch);
}

void attention_forward_blocks(float* out, float* lse, const float* q,
                              const std::vector<KVBlock>& blocks, const AttnDims& d, Scratch* scratch) {
  AttnDims dq = d;
  dq.Tk = 0;
  dq.k_pos0 = 0;
  const Geometry g = resolve(dq);
  const std::vector<KeySource> src = key_sources(blocks, g, false);
  forward_impl(out, lse, q, src.data(), int(src.size()), g, false, scratch);
}

void attention_merge(float* out, float* lse, const float* part_out, const float* part_lse, const AttnDims& d) {
  const Geometry g = resolve(d);
#pragma omp parallel for schedule(static)
  for (int t = 0; t < g.Tq; ++t) {
    for (int z = 0; z < g.Z; ++z) {
      float& l = lse[i64(z) * g.Tq + t];
      const float a = l, b = part_lse[i64(z) * g.Tq + t];
      const float m = std::max(a, b);
      if (!(m > -kInf)) continue;  // neither side sees a key: out stays 0
      const float wa = std::exp(a - m), wb = std::exp(b - m), sum = wa + wb;
      float* orow = out + t * g.ldo + i64(z) * g.A;
      const float* prow = part_out + t * g.ldo + i64(z) * g.A;
      for (int k = 0; k < g.A; ++k) orow[k] = (wa * orow[k] + wb * prow[k]) / sum;
      l = m + std::log(sum);
    }
  }
}

void attention_backward_delta(float* delta, const float* dout, const float* out,
                              const AttnDims& d) {
  const Geometry g = resolve(d);
#pragma omp parallel for schedule(static)
  for (int t = 0; t < g.Tq; ++t) {
    for (int z = 0; z < g.Z; ++z) {
      const float* dorow = dout + t * g.ldo + i64(z) * g.A;
      const float* orow = out + t * g.ldo + i64(z) * g.A;
      double sum = 0.0;
      for (int a = 0; a < g.A; ++a) sum += double(dorow[a]) * orow[a];
      delta[i64(z) * g.Tq + t] = float(sum);
    }
  }
}

void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                        const float* k, const float* v, const float* lse, const float* delta,
                        const AttnDims& d, Scratch* scratch) {
  const Geometry g = resolve(d);
  if (nothing_visible(g)) return;
  const KeySource block{k, v, dk, dv, g};
  backward_impl(dq, dout, q, &block, 1, lse, delta, g, scratch);
}

void attention_backward_blocks(float* dq, const float* dout, const float* q,
                               const std::vector<KVBlock>& blocks, const float* lse,
                               const float* delta, const AttnDims& d, Scratch* scratch) {
  AttnDims dq_dims = d;
  dq_dims.Tk = 0;
  dq_dims.k_pos0 = 0;
  const Geometry g = resolve(dq_dims);
  const std::vector<KeySource> src = key_sources(blocks, g, true);
  backward_impl(dq, dout, q, src.data(), int(src.size()), lse, delta, g, scratch);
}

KernelScratch attention_forward_scratch(int A, int threads) {
  const int Ap = round_up(A, kLanes);
  return {i64(threads) * i64(ForwardScratch::bytes(A, Ap)), 0};
}

KernelScratch attention_backward_scratch(int Z, int A, int threads, int Zkv) {
  const i64 Ap = round_up(A, kLanes), row = Ap * i64(sizeof(float));
  // Per thread: q, dout and its own dq accumulator of [Tq, Ap], and the tiles; with key-tile
  // groups, [Tq, Ap] partials for every (query head, group) instead (counted as well: an upper
  // bound). The groups are per key/value head.
  const int gmax = backward_groups(Zkv > 0 ? Zkv : Z, threads, std::numeric_limits<int>::max());
  const i64 align = i64(Scratch::kAlign);
  KernelScratch s{i64(threads) * (i64(BackwardScratch::tile_bytes(A, int(Ap))) + 3 * align), i64(threads) * 3 * row};
  if (gmax > 1) {
    s.fixed_bytes += align;
    s.bytes_per_token += i64(Z) * gmax * row;
  }
  return s;
}

}  // namespace sppo::cpu
