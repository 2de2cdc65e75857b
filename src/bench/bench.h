// Benchmarks the CLI exposes (`sppo bench ...`). Each returns one JSON object; the CLI
// prints it with --json, else as a table.
#pragma once

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "core/config.h"

namespace sppo {

// One transformer block's forward + backward on S tokens (one subsequence) through the
// backend, median of `reps` after one warm-up. Its JSON reports model FLOP/s against rates
// measured in the same run: on the CPU the processor's FMA peak (fraction_of_peak, at most
// 1) and OpenBLAS's SGEMM rate (fraction_of_sgemm), with the OpenBLAS core that ran;
// elsewhere the backend's GEMM rate in the activation type (fraction_of_peak).
// breakdown: one more step with every kernel timed on its own, its seconds by part in
// "breakdown" (attention forward, attention backward, GEMMs, other kernels, between them).
nlohmann::json bench_layer(Backend& be, int hidden, int heads, i64 seq_len, int reps, bool breakdown = false);

}  // namespace sppo
