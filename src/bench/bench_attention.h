// `sppo bench attention`: causal attention forward + backward through a backend, on the two
// shapes that matter to SPPO: a whole sequence, and one subsequence's queries after a long
// prefix of kept K/V (the pattern a masked call to a whole-sequence kernel handles badly).
#pragma once

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "core/layout.h"

namespace sppo {

struct BenchAttentionOptions {
  i64 seq_len = 32768;            // the whole sequence
  i64 queries = 16384;            // the subsequence ...
  i64 prefix = 114688;            // ... after this many earlier tokens
  i64 chunk = kKvChunkMinRows;    // ... streamed in chunks of this many rows (host K/V)
  int heads = 32, head_dim = 128;
  int reps = 3;
};

// The defaults above are the GPU's shapes; a CPU measures them 16 times shorter with 4 heads.
BenchAttentionOptions default_attention_shapes(const Backend& be);

// {"backend", "precision", "attention" (what ran it, Backend::prepare_attention), "heads",
// "head_dim", and one object per shape, keyed by name (whole_32k, prefix_16k_after_112k and
// prefix_16k_after_112k_chunked, the prefix in `chunk`-row calls merged as the runtime
// streams host K/V, for the defaults): {queries, prefix, chunk, fwd_bwd_s, sppo_tflops}};
// TFLOP/s count the causal half of the diagonal, forward + 2.5x backward.
nlohmann::json bench_attention(Backend& be, const BenchAttentionOptions& o);
void print_bench_attention(const nlohmann::json& j);

}  // namespace sppo
