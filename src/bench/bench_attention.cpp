#include "bench/bench_attention.h"

#include <cstdio>
#include <string>

#include "core/check.h"
#include "train/device_bench.h"

namespace sppo {

namespace {

// 32768 -> "32k"; lengths that are not whole multiples of 1024 stay as they are.
std::string short_length(i64 n) { return n % 1024 == 0 ? std::to_string(n / 1024) + "k" : std::to_string(n); }

}  // namespace

BenchAttentionOptions default_attention_shapes(const Backend& be) {
  BenchAttentionOptions o;
  if (std::string(be.name()) == "cpu") {
    o.seq_len /= 16, o.queries /= 16, o.prefix /= 16;
    o.heads = 4;
  }
  return o;
}

nlohmann::json bench_attention(Backend& be, const BenchAttentionOptions& o) {
  SPPO_CHECK(o.seq_len > 0 && o.queries > 0 && o.prefix >= 0, "bench attention")
      << "lengths must be positive (seq-len " << o.seq_len << ", queries " << o.queries << ", prefix " << o.prefix
      << ")";
  SPPO_CHECK(o.heads > 0 && o.head_dim > 0 && o.head_dim <= 256, "bench attention")
      << "--heads must be positive and --head-dim in 1..256 (got " << o.heads << ", " << o.head_dim << ")";
  SPPO_CHECK(o.reps >= 1, "bench attention") << "--reps must be at least 1";
  nlohmann::json j = {{"backend", be.name()},
                      {"precision", be.act() == DType::F32 ? "fp32" : "bf16"},
                      {"heads", o.heads},
                      {"head_dim", o.head_dim},
                      {"reps", o.reps}};
  const struct {
    std::string name;
    i64 queries, prefix;
  } shapes[] = {{"whole_" + short_length(o.seq_len), o.seq_len, 0},
                {"prefix_" + short_length(o.queries) + "_after_" + short_length(o.prefix), o.queries, o.prefix}};
  for (const auto& s : shapes) {
    const double t = time_attention(be, s.queries, s.prefix, o.heads, o.head_dim, o.reps);
    const double flops = 3.5 * attention_forward_flops(s.queries, s.prefix, o.heads, o.head_dim);
    j[s.name] = {{"queries", s.queries}, {"prefix", s.prefix}, {"fwd_bwd_s", t}, {"sppo_tflops", flops / t / 1e12}};
  }
  return j;
}

void print_bench_attention(const nlohmann::json& j) {
  std::printf("causal attention forward + backward, %s %s, %d heads of %d\n",
              j["backend"].get<std::string>().c_str(), j["precision"].get<std::string>().c_str(),
              j["heads"].get<int>(), j["head_dim"].get<int>());
  std::printf("%-26s %10s %10s %12s %10s\n", "shape", "queries", "prefix", "fwd+bwd s", "TFLOP/s");
  for (const auto& [name, v] : j.items()) {
    if (!v.is_object()) continue;
    std::printf("%-26s %10lld %10lld %12.4f %10.3f\n", name.c_str(), v["queries"].get<long long>(),
                v["prefix"].get<long long>(), v["fwd_bwd_s"].get<double>(), v["sppo_tflops"].get<double>());
  }
}

}  // namespace sppo
