// GEMMs through cuBLASLt and the linear layer on top (contract in backends/cuda/ops.h).
//
// Note [Row-major GEMM on cuBLASLt]
// cuBLASLt is column-major. A row-major matrix X with row stride ld is, read column-major
// with the same ld, the matrix X^T. So the row-major C[M, N] = op(a) op(b) is the column-major
// C^T[N, M] = op(b)^T op(a)^T, one cuBLASLt matmul with m = N, n = M, k = K, its "A" the
// stored b (transposed iff trans_b) and its "B" the stored a (transposed iff trans_a):
//   Lt A = b: stored column-major as (trans_b ? K x N : N x K), ld = ldb
//   Lt B = a: stored column-major as (trans_a ? M x K : K x M), ld = lda
//   Lt C = D = c: N x M, ld = ldc
// The bias epilogue adds a vector of length m = N to every column of D: b[o] to every row of
// the row-major out, which is linear_forward's bias.
//
// Note [cuBLASLt plans]
// The heuristic's choice depends on the shape, strides, types, epilogue and on the alignment
// of every pointer (an algorithm may need 16-byte aligned rows); an algorithm chosen for
// aligned pointers may not run on less aligned ones. So plans are keyed by all of these, the
// alignment being the largest power of two (up to 256) that divides the address, and the
// heuristic is told those alignments. Descriptors are created once per key; the bias pointer
// is set on the cached descriptor under the lock, right before the matmul that reads it.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "backends/cuda/common.cuh"
#include "backends/cuda/ops.h"

namespace sppo::cuda {
namespace {

struct PlanKey {
  bool trans_a, trans_b, bias;
  int M, N, K, lda, ldb, ldc;
  DType ab, cd;
  std::uint32_t align_a, align_b, align_c, align_bias;
  bool operator==(const PlanKey& o) const {
    return trans_a == o.trans_a && trans_b == o.trans_b && bias == o.bias && M == o.M && N == o.N &&
           K == o.K && lda == o.lda && ldb == o.ldb && ldc == o.ldc && ab == o.ab && cd == o.cd &&
           align_a == o.align_a && align_b == o.align_b && align_c == o.align_c &&
           align_bias == o.align_bias;
  }
};

struct PlanKeyHash {
  std::size_t operator()(const PlanKey& k) const {
    std::size_t h = 0;
    const auto mix = [&h](std::uint64_t v) {
      h ^= std::hash<std::uint64_t>{}(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    };
    mix(std::uint64_t{k.trans_a} | std::uint64_t{k.trans_b} << 1 | std::uint64_t{k.bias} << 2 |
        std::uint64_t(k.ab) << 3 | std::uint64_t(k.cd) << 5);
    mix(std::uint64_t(std::uint32_t(k.M)) << 32 | std::uint32_t(k.N));
    mix(std::uint64_t(std::uint32_t(k.K)) << 32 | std::uint32_t(k.lda));
    mix(std::uint64_t(std::uint32_t(k.ldb)) << 32 | std::uint32_t(k.ldc));
    mix(std::uint64_t(k.align_a) << 48 | std::uint64_t(k.align_b) << 32 |
        std::uint64_t(k.align_c) << 16 | k.align_bias);
    return h;
  }
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // Lt's A, B, C (= D)
  cublasLtMatmulAlgo_t algo{};
  std::size_t workspace = 0;
  bool ok = false;  // false: the heuristic found no algorithm (only tolerated for the epilogue)
};

std::uint32_t alignment(const void* p) {
  const auto addr = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t a = 256;
  while (a > 1 && addr % a != 0) a /= 2;
  return a;
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::F32: return CUDA_R_32F;
    case DType::BF16: return CUDA_R_16BF;
    case DType::I32: break;
  }
  SPPO_CHECK(false, "gemm") << "GEMM operands are F32 or BF16, got " << dtype_name(t);
  return CUDA_R_32F;
}

}  // namespace

struct Blas::Impl {
  cublasLtHandle_t handle = nullptr;
  bool bias_epilogue = true;
  std::mutex mu;
  std::unordered_map<cudaStream_t, void*> workspaces;
  std::unordered_map<PlanKey, Plan, PlanKeyHash> plans;

  void* workspace(cudaStream_t stream) {
    auto it = workspaces.find(stream);
    if (it != workspaces.end()) return it->second;
    void* p = nullptr;
    SPPO_CUDA_CHECK(cudaMalloc(&p, kWorkspaceBytes));
    workspaces.emplace(stream, p);
    return p;
  }

  const Plan& plan(const PlanKey& k, const void* bias) {
    auto it = plans.find(k);
    if (it != plans.end()) return it->second;
    Plan p;
    // Note [Row-major GEMM on cuBLASLt].
    const cublasOperation_t op_a = k.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_b = k.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    // CUBLAS_COMPUTE_32F: fp32 accumulation; with F32 operands no TF32 (that needs
    // CUBLAS_COMPUTE_32F_FAST_TF32), with BF16 operands bf16 tensor cores.
    SPPO_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    SPPO_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a));
    SPPO_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b));
    if (k.bias) {
      const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
      SPPO_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
      // The bias has D's type (the default of CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE).
      SPPO_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                       &bias, sizeof bias));
    }
    const cudaDataType_t tab = cuda_type(k.ab), tcd = cuda_type(k.cd);
    SPPO_CUBLAS_CHECK(
        cublasLtMatrixLayoutCreate(&p.a, tab, k.trans_b ? k.K : k.N, k.trans_b ? k.N : k.K, k.ldb));
    SPPO_CUBLAS_CHECK(
        cublasLtMatrixLayoutCreate(&p.b, tab, k.trans_a ? k.M : k.K, k.trans_a ? k.K : k.M, k.lda));
    SPPO_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, tcd, k.N, k.M, k.ldc));

    cublasLtMatmulPreference_t pref = nullptr;
    SPPO_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const std::uint64_t ws = kWorkspaceBytes;
    SPPO_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    // Lt's A is our b, Lt's B our a (Note [Row-major GEMM on cuBLASLt]).
    SPPO_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &k.align_b, sizeof k.align_b));
    SPPO_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &k.align_a, sizeof k.align_a));
    SPPO_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &k.align_c, sizeof k.align_c));
    SPPO_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &k.align_c, sizeof k.align_c));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.a, p.b, p.c, p.c,
                                                             pref, 1, &result, &found);
    SPPO_CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    if (st == CUBLAS_STATUS_SUCCESS && found > 0) {
      p.algo = result.algo;
      p.workspace = result.workspaceSize;
      p.ok = true;
    } else {
      // Without the epilogue there is no other way: say what was asked.
      SPPO_CHECK(k.bias, "gemm") << "cuBLASLt has no algorithm for M=" << k.M << " N=" << k.N
                                 << " K=" << k.K << " trans_a=" << k.trans_a
                                 << " trans_b=" << k.trans_b << " lda=" << k.lda << " ldb=" << k.ldb
                                 << " ldc=" << k.ldc << " types " << dtype_name(k.ab) << "/"
                                 << dtype_name(k.cd) << " (status " << cublasLtGetStatusName(st)
                                 << ")";
    }
    return plans.emplace(k, p).first->second;
  }
};

Blas::Blas(bool bias_epilogue) : impl_(std::make_unique<Impl>()) {
  impl_->bias_epilogue = bias_epilogue;
  SPPO_CUBLAS_CHECK(cublasLtCreate(&impl_->handle));
}

Blas::~Blas() {
  for (auto& [key, p] : impl_->plans) {
    SPPO_CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p.a));
    SPPO_CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p.b));
    SPPO_CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p.c));
    SPPO_CUBLAS_CHECK(cublasLtMatmulDescDestroy(p.desc));
  }
  for (auto& [stream, ws] : impl_->workspaces) SPPO_CUDA_CHECK(cudaFree(ws));
  SPPO_CUBLAS_CHECK(cublasLtDestroy(impl_->handle));
}

namespace {

// out[t, o] = b[o] for t < T, o < O (row stride ld).
template <typename T>
__global__ void fill_rows_kernel(T* out, const T* b, int rows, int O, i64 ld) {
  const i64 n = static_cast<i64>(rows) * O;
  for (i64 i = blockIdx.x * i64{blockDim.x} + threadIdx.x; i < n;
       i += i64{gridDim.x} * blockDim.x) {
    const i64 t = i / O, o = i % O;
    out[t * ld + o] = b[o];
  }
}

// partials[blk, c] = sum over the rows of row block blk of x[t * ld + c], in double, in order.
// Grid: (row block, column chunk), Note [Row blocks on the grid's x] in common.cuh.
template <typename T>
__global__ void column_partials_kernel(double* partials, const T* x, int rows, int C, i64 ld) {
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  const int blk = blockIdx.x;
  if (c >= C) return;
  const int t_end = min(rows, (blk + 1) * kRowBlock);
  double s = 0.0;
  for (int t = blk * kRowBlock; t < t_end; ++t) s += load_f(x + static_cast<i64>(t) * ld + c);
  partials[static_cast<i64>(blk) * C + c] = s;
}

// One cuBLASLt matmul (bias may be null); returns false when a bias epilogue has no algorithm.
bool run_gemm(Blas& blas, bool trans_a, bool trans_b, int M, int N, int K, float alpha,
              const void* a, int lda, const void* b, int ldb, float beta, void* c, int ldc,
              DType ab, DType cd, const void* bias, cudaStream_t stream) {
  SPPO_ASSERT_MSG(M >= 0 && N >= 0 && K > 0, "gemm: M=" << M << " N=" << N << " K=" << K);
  SPPO_ASSERT_MSG(lda >= std::max(1, trans_a ? M : K) && ldb >= std::max(1, trans_b ? K : N) &&
                      ldc >= std::max(1, N),
                  "gemm: strides lda=" << lda << " ldb=" << ldb << " ldc=" << ldc << " for M=" << M
                                       << " N=" << N << " K=" << K);
  SPPO_CHECK((ab == DType::F32 && cd == DType::F32) || (ab == DType::BF16 && cd == DType::BF16) ||
                 (ab == DType::BF16 && cd == DType::F32),
             "gemm")
      << "supported operand/result types are F32/F32, BF16/BF16 and BF16/F32, got "
      << dtype_name(ab) << "/" << dtype_name(cd);
  if (M == 0 || N == 0) return true;
  Blas::Impl& im = blas.impl();
  PlanKey key{};
  key.trans_a = trans_a, key.trans_b = trans_b, key.bias = bias != nullptr;
  key.M = M, key.N = N, key.K = K, key.lda = lda, key.ldb = ldb, key.ldc = ldc;
  key.ab = ab, key.cd = cd;
  key.align_a = alignment(a), key.align_b = alignment(b), key.align_c = alignment(c);
  key.align_bias = bias != nullptr ? alignment(bias) : 0u;
  std::lock_guard<std::mutex> lock(im.mu);
  const Plan& p = im.plan(key, bias);
  if (!p.ok) return false;
  if (bias != nullptr)
    SPPO_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                     &bias, sizeof bias));
  void* ws = im.workspace(stream);
  // Note [Row-major GEMM on cuBLASLt]: Lt's A is b, Lt's B is a.
  SPPO_CUBLAS_CHECK(cublasLtMatmul(im.handle, p.desc, &alpha, b, p.a, a, p.b, &beta, c, p.c, c, p.c,
                                   &p.algo, ws, p.workspace, stream));
  return true;
}

}  // namespace

void gemm(Blas& blas, bool trans_a, bool trans_b, int M, int N, int K, float alpha, const void* a,
          int lda, const void* b, int ldb, float beta, void* c, int ldc, DType ab, DType cd,
          cudaStream_t stream) {
  run_gemm(blas, trans_a, trans_b, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc, ab, cd, nullptr,
           stream);
}

void linear_forward(Blas& blas, void* out, const void* in, const void* w, const void* b, int T,
                    int I, int O, DType act, cudaStream_t stream, int ld_out, int ld_in) {
  if (ld_out == 0) ld_out = O;
  if (ld_in == 0) ld_in = I;
  if (T == 0) return;
  if (b != nullptr && blas.impl().bias_epilogue &&
      run_gemm(blas, false, true, T, O, I, 1.0f, in, ld_in, w, I, 0.0f, out, ld_out, act, act, b,
               stream))
    return;
  float beta = 0.0f;
  if (b != nullptr) {
    // As the CPU kernel: out pre-filled with the bias, the GEMM adds to it (beta = 1). In bf16
    // this rounds twice where the epilogue rounds once: cuBLASLt rounds the product to bf16
    // before adding beta C (measured on an H200), so it is only the fallback.
    dispatch_act(act, "linear_forward", [&](auto tag) {
      using E = decltype(tag);
      fill_rows_kernel<E><<<grid_for(i64{T} * O), kThreads, 0, stream>>>(
          static_cast<E*>(out), static_cast<const E*>(b), T, O, ld_out);
      SPPO_CUDA_CHECK_LAUNCH();
    });
    beta = 1.0f;
  }
  run_gemm(blas, false, true, T, O, I, 1.0f, in, ld_in, w, I, beta, out, ld_out, act, act, nullptr,
           stream);
}

void linear_backward(Blas& blas, void* din, float* dw, float* db, const void* dout, const void* in,
                     const void* w, int T, int I, int O, DType act, cudaStream_t stream,
                     int ld_dout, int ld_in) {
  if (ld_dout == 0) ld_dout = O;
  if (ld_in == 0) ld_in = I;
  if (T == 0) return;
  if (din != nullptr)
    gemm(blas, false, false, T, I, O, 1.0f, dout, ld_dout, w, I, 0.0f, din, I, act, act, stream);
  gemm(blas, true, false, O, I, T, 1.0f, dout, ld_dout, in, ld_in, 1.0f, dw, I, act, DType::F32,
       stream);
  if (db != nullptr) {
    const int num_blocks = static_cast<int>(ceil_div(T, kRowBlock));
    Scratch partials(sizeof(double) * static_cast<std::size_t>(num_blocks) * O, stream);
    dispatch_act(act, "linear_backward", [&](auto tag) {
      using E = decltype(tag);
      const dim3 grid = row_block_grid(num_blocks, O);
      column_partials_kernel<E><<<grid, kThreads, 0, stream>>>(
          partials.as<double>(), static_cast<const E*>(dout), T, O, ld_dout);
      SPPO_CUDA_CHECK_LAUNCH();
    });
    add_block_partials(db, partials.as<double>(), num_blocks, O, stream);
  }
}

}  // namespace sppo::cuda
