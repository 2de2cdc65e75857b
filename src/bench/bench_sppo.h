// `sppo bench memory` and `sppo bench offload` (the SPPO single-process benchmarks):
// real steps under a real device budget, measured by the arena's high-water mark, beside
// the simulator's prediction of the same schedule.
#pragma once

#include <nlohmann/json.hpp>

#include "train/options.h"

namespace sppo {

struct BenchModelOptions {
  ModelConfig model;
  std::string model_name;
  i64 budget = 0;        // bench memory: the device budget every mode must fit
  i64 host_budget = 0;   // and the host's (--host-memory; default 16x the device budget)
  i64 seq_len = 0;       // bench offload: the length
  int subseqs = 0;       // bench offload: N
  int reps = 2;          // timed steps per point (median), after one warm-up
  std::string hardware;  // profile for adaptive choices ("" = measured now)
  std::string backend = "cpu", precision;  // as train's --backend / --precision
  std::string attention = "auto";          // as train's --attention kernels
  i64 at_seq_len = 0;    // bench memory: SPPO alone, its longest sequence and its step time here
};

// The longest sequence each mode trains under the budget (reference, recompute, sppo_none,
// sppo_adaptive), its step time, and every mode's step time at recompute's longest length.
// With at_seq_len: SPPO adaptive only, `longest_seq` and `step_time_at_seq_s` (the
// comparison with another system's longest length). Lengths are probed by real steps on
// the CPU; elsewhere by the predicted peak (equal to the allocator's to the byte), since a
// real step at a GPU's longest length takes minutes.
nlohmann::json bench_memory(const BenchModelOptions& o);

// At one S and N: offload none / full / paper / adaptive, step time, measured and predicted peak,
// exposed copy time.
nlohmann::json bench_offload(const BenchModelOptions& o);

// The simulator against the runtime on this machine: for several single-process
// configurations (N, alpha, model sizes; on a GPU, three of gpt-7b's layer shape), measured
// step time and peak beside the simulated ones on a profile measured in the same run (or
// o.hardware). Uses o.backend, o.precision, o.hardware and o.reps.
nlohmann::json bench_sim(const BenchModelOptions& o);

void print_bench_memory(const nlohmann::json& j);
void print_bench_sim(const nlohmann::json& j);
void print_bench_offload(const nlohmann::json& j);

}  // namespace sppo
