// Dimension letters, used everywhere in the engine (docs/design.md, Conventions 8):
//   S  full sequence length (tokens in one step)
//   T  subsequence length (tokens processed by one forward/backward call)
//   H  hidden size             Z  attention heads        A  head size: H / Z, or given
//                                                          (Note [Head size], core/config.h)
//   L  layers                  V  vocabulary size        F  ffn size = 4H
//   N  subsequences per step   P  pipeline stages        R  sequence-parallel ranks
// Offsets: o_i is the global position of the first token of subsequence i.
// Buffers are row-major; a "[T, H]" buffer has T rows of H contiguous floats.
#pragma once

#include <cstdint>

namespace sppo {

using i64 = std::int64_t;

}  // namespace sppo
