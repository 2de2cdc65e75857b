// `sppo bench pipeline`: the sequence pipeline and data parallelism measured on two ranks
// with one thread each, beside the simulator's prediction of the same schedules on a
// profile measured in the same run (or `hardware`).
//  - bubble: pipeline of 2 stages, N in {2, 4, 8, 16} FLOPs-balanced subsequences; the
//    measured bubble (idle over busy compute time, mean over ranks) beside the
//    simulator's and the paper's (P - 1) / N;
//  - step time: pipeline 2, data parallel 2, and pipeline 2 with adaptive offload under a
//    budget that makes it offload: measured (median) vs simulated.
// Started without a launcher, it starts itself under `mpirun -np 2`.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "comm/comm.h"

namespace sppo {

struct BenchPipelineOptions {
  std::string model = "medium";
  std::string seq_len = "2048";
  int reps = 3;          // timed steps per configuration (median), after one warm-up
  std::string hardware;  // profile to simulate with ("" = measured now, one thread a rank)
};

// Every rank calls it; the result is meaningful on rank 0.
nlohmann::json bench_pipeline(const BenchPipelineOptions& o, comm::Comm& world);
void print_bench_pipeline(const nlohmann::json& j);

// `sppo bench sp`: ring attention (context parallelism) on two ranks with one thread each:
// one rank at S (each rank running alone, at once), cp 2 contiguous and zigzag at S, and
// cp 2 zigzag at 2S (the same tokens a rank as one rank at S); measured step time (median)
// beside the simulator's, each rank's compute time (the causal imbalance a contiguous
// split leaves), and peak memory a rank measured and predicted; and, for a bidirectional
// model (masked tokens), the two-pass RSA ring beside the one-pass ring at cp 2; and the
// SPPO paper's SP, tensor parallelism with sequence-parallel regions, tp 2 at S and at 2S
// (JSON "tensor"), with every rank's peak memory beside one rank's.
nlohmann::json bench_sp(const BenchPipelineOptions& o, comm::Comm& world);
void print_bench_sp(const nlohmann::json& j);

// Replaces this process with `mpirun -np <ranks> <this program> <args...>` (the consent
// variables set when running as root); returns only if that cannot start.
void relaunch_under_mpirun(int ranks, int argc, char** argv);

}  // namespace sppo
