// `sppo bench cores`: a training step on cores that another busy OpenMP program shares.
//
// A child `sppo train --model M --seq-len S --steps N` measures its step time (the median
// of its steps after the first) alone, beside a second busy sppo (a long train run of the
// same shape), and beside `sppo bench memory` (killed when the step is measured: its first
// seconds, which measure this machine's profile with every thread), each under three
// OpenMP wait settings given to both programs:
//   - libgomp's default, forced: GOMP_SPINCOUNT=300000, what an OpenMP program spins
//     when OMP_WAIT_POLICY is unset;
//   - OMP_WAIT_POLICY=passive: no spinning;
//   - sppo's default: neither variable set, so each child chooses its own (Note [OpenMP's
//     wait policy on shared cores] in backends/cpu/blas_setup.cpp).
// The settings take turns within each repetition, so that a neighbour outside the
// benchmark disturbs all of them alike; each time is the median over the repetitions,
// each ratio the median of the repetitions' own ratios.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace sppo {

struct BenchCoresOptions {
  std::string model = "llama-tiny";
  std::string seq_len = "2048";
  int steps = 10;  // per measured run (the first is not counted)
  int reps = 3;    // runs per setting and neighbour (median)
};

nlohmann::json bench_cores(const BenchCoresOptions& o);
void print_bench_cores(const nlohmann::json& j);

}  // namespace sppo
