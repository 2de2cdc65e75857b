// What the benchmarks that run through the backend interface share (`sppo profile
// --backend`, `sppo bench attention`): device buffers freed on scope exit, random inputs
// made on the host and copied over, and timing with the backend synchronised around.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "core/timing.h"

namespace sppo {

class DeviceBuffer {
 public:
  DeviceBuffer(Backend& be, std::size_t bytes);  // refuses (SPPO_CHECK) when the device is full
  ~DeviceBuffer() { be_.device_free(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return p_; }
  float* f32() const { return static_cast<float*>(p_); }

 private:
  Backend& be_;
  void* p_;
};

// n standard-normal values on the device, in the activation type (act) or fp32.
std::unique_ptr<DeviceBuffer> random_device(Backend& be, i64 n, bool act, unsigned seed);

// The median of `reps` timed runs of f after one warm-up, the backend synchronised around each.
template <typename F>
double median_seconds(Backend& be, int reps, F&& f) {
  f();
  be.synchronize();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    be.synchronize();
    t.push_back(seconds_since(t0));
  }
  return median(std::move(t));
}

// Causal attention forward FLOPs of `queries` queries that follow `prefix` earlier tokens
// (4 Z A per query-key pair, the diagonal block half), the count PyTorch's figures use;
// forward + backward is 3.5 times it.
inline double attention_forward_flops(i64 queries, i64 prefix, int heads, int head_dim) {
  const double q = double(queries);
  return 4.0 * heads * head_dim * (q * double(prefix) + q * q / 2);
}

// The GEMM rate (FLOP/s) through the backend on an n x n x n product in the activation type.
double time_gemm_flops(Backend& be, int n, int reps);

// One causal attention forward + backward through the backend: `queries` queries after
// `prefix` keys, `heads` heads of `head_dim`; median seconds of `reps`.
double time_attention(Backend& be, i64 queries, i64 prefix, int heads, int head_dim, int reps);

// How the keys of a timed attention forward + backward lie:
//   own_block, chunk 0   one buffer of prefix + queries rows, one call (the queries' own
//                        keys causal at its end);
//   own_block, chunk > 0 the queries' own block in one call, then the prefix in blocks of
//                        `chunk` rows, each its own call merged by log-sum-exp, and each
//                        its own backward from the final lse, as the runtime streams K/V
//                        from the host (runtime/kv_stream.h);
//   !own_block           the queries against `prefix` keys all before them, one call.
struct AttentionTiming {
  i64 queries = 0, prefix = 0;
  int heads = 0, head_dim = 0;
  bool own_block = true;
  i64 chunk = 0;
};
double time_attention(Backend& be, const AttentionTiming& t, int reps);
// The forward FLOPs of such a call (the causal half of the queries' own block).
double attention_forward_flops(const AttentionTiming& t);

}  // namespace sppo
