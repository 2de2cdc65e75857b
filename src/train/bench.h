// Benchmarks the CLI exposes (`sppo bench ...`). Each returns one JSON object; the CLI
// prints it with --json, else as a table.
#pragma once

#include <nlohmann/json.hpp>

#include "core/config.h"

namespace sppo {

// The SGEMM rate of this machine, measured now on square n x n x n products (median of
// `reps`), in FLOP/s, and the kernel OpenBLAS chose.
struct GemmPeak {
  double flops_per_s = 0;
  std::string blas_core;
};
GemmPeak measure_gemm_peak(int n = 2048, int reps = 5);

// One transformer block's forward + backward on S tokens (one subsequence), median of
// `reps` after one warm-up, against the GEMM peak measured in the same run.
nlohmann::json bench_layer(int hidden, int heads, i64 seq_len, int reps);

}  // namespace sppo
