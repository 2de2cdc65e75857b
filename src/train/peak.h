// This processor's peak rates, measured now: OpenBLAS's SGEMM on a large square product
// and the FMA units' rate. `sppo profile` prices the CPU from them and `bench layer`
// measures a block against them.
#pragma once

#include <string>

#include "core/dims.h"

namespace sppo {

// The SGEMM rate of this machine, measured now on square n x n x n products (median of
// `reps`), in FLOP/s, and the kernel OpenBLAS chose.
struct GemmPeak {
  double flops_per_s = 0;
  std::string blas_core;
};
GemmPeak measure_gemm_peak(int n = 2048, int reps = 5);

// The processor's peak FP32 rate: cores x clock x FMA width x FMA units, measured (not
// looked up) by a loop of fused multiply-adds that never touches memory, on every OpenMP
// thread at once, with enough independent accumulator chains to cover the FMA latency
// times its throughput. Uses the widest vectors the processor runs (AVX-512, AVX2 + FMA,
// else SSE multiply and add). Best of a few runs of about `seconds` each.
struct FmaPeak {
  double flops_per_s = 0;
  std::string isa;  // "avx512", "avx2+fma" or "sse"
  int threads = 0;
};
FmaPeak measure_fma_peak(double seconds = 0.1);

}  // namespace sppo
