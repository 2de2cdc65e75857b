// Cutting a sequence of S tokens into N subsequences (docs/design.md 3).
#pragma once

#include <vector>

#include "core/config.h"
#include "core/dims.h"

namespace sppo::plan {

// Equal lengths; the first S % N subsequences get one token more.
std::vector<i64> partition_length(i64 S, int N);

// Equal forward FLOPs per subsequence with the per-layer formulas of docs/design.md 3
// (GEMMs 24 l H^2, attention 4 l H (o + (l + 1) / 2)): later subsequences are shorter.
// Boundaries solve the quadratic prefix cost exactly, then round; every length >= 1.
// With quantum > 1 (and S / N >= 4 quantum) boundaries fall on multiples of quantum, the
// attention kernel's tile, at a small cost in balance.
std::vector<i64> partition_flops(const ModelConfig& c, i64 S, int N, i64 quantum = 1);

// Forward FLOPs of one layer on subsequence [o, o + l).
double subseq_flops(const ModelConfig& c, i64 o, i64 l);

// Layers per pipeline stage for L layers over P stages when the last stage also runs the
// LM head, which costs `head_layers` layers' worth of compute: the split that minimises
// the busiest stage (max of the last stage's layers + head_layers and the others' most),
// the remainder on the first stages, preferring more layers on the last stage on ties.
std::vector<int> balanced_stage_layers(int L, int P, double head_layers);

// The divisors of n, ascending: the degrees a layout may split n devices (or heads) by.
std::vector<int> divisors(int n);

}  // namespace sppo::plan
