// Benchmarks the CLI exposes (`sppo bench ...`). Each returns one JSON object; the CLI
// prints it with --json, else as a table.
#pragma once

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "core/config.h"

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

// One transformer block's forward + backward on S tokens (one subsequence) through the
// backend, median of `reps` after one warm-up. Its JSON reports model FLOP/s against rates
// measured in the same run: on the CPU the processor's FMA peak (fraction_of_peak, at most
// 1) and OpenBLAS's SGEMM rate (fraction_of_sgemm), with the OpenBLAS core that ran;
// elsewhere the backend's GEMM rate in the activation type (fraction_of_peak).
nlohmann::json bench_layer(Backend& be, int hidden, int heads, i64 seq_len, int reps);

}  // namespace sppo
