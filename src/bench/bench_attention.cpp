#include "bench/bench_attention.h"

#include <cstdio>
#include <string>

#include "core/check.h"
#include "core/config.h"
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
  SPPO_CHECK(o.chunk > 0, "bench attention") << "--chunk must be positive (got " << o.chunk << ")";
  ModelConfig c;
  c.heads = o.heads;
  c.hidden = o.heads * o.head_dim;
  const AttentionServed attention = be.prepare_attention(c);
  nlohmann::json j = {{"backend", be.name()},
                      {"precision", be.act() == DType::F32 ? "fp32" : "bf16"},
                      {"attention", attention.description},
                      {"heads", o.heads},
                      {"head_dim", o.head_dim},
                      {"reps", o.reps}};
  const std::string prefix = "prefix_" + short_length(o.queries) + "_after_" + short_length(o.prefix);
  const struct {
    std::string name;
    i64 queries, prefix, chunk;
  } shapes[] = {{"whole_" + short_length(o.seq_len), o.seq_len, 0, 0},
                {prefix, o.queries, o.prefix, 0},
                {prefix + "_chunked", o.queries, o.prefix, o.chunk}};
  for (const auto& s : shapes) {
    const AttentionTiming t{s.queries, s.prefix, o.heads, o.head_dim, true, s.chunk};
    const double secs = time_attention(be, t, o.reps);
    const double flops = 3.5 * attention_forward_flops(t);
    j[s.name] = {{"queries", s.queries}, {"prefix", s.prefix},        {"chunk", s.chunk},
                 {"fwd_bwd_s", secs},    {"sppo_tflops", flops / secs / 1e12}};
  }
  const AttentionBuildStats graphs = be.attention_build_stats();
  if (graphs.graphs > 0)
    j["attention_graphs"] = {{"built", graphs.graphs}, {"build_s", graphs.seconds}, {"first_build_s", graphs.first_seconds}};
  return j;
}

void print_bench_attention(const nlohmann::json& j) {
  std::printf("causal attention forward + backward, %s %s, %d heads of %d, %s\n",
              j["backend"].get<std::string>().c_str(), j["precision"].get<std::string>().c_str(),
              j["heads"].get<int>(), j["head_dim"].get<int>(), j["attention"].get<std::string>().c_str());
  std::printf("%-34s %10s %10s %8s %12s %10s\n", "shape", "queries", "prefix", "chunk", "fwd+bwd s", "TFLOP/s");
  for (const auto& [name, v] : j.items()) {
    if (!v.is_object() || !v.contains("queries")) continue;
    std::printf("%-34s %10lld %10lld %8lld %12.4f %10.3f\n", name.c_str(), v["queries"].get<long long>(),
                v["prefix"].get<long long>(), v["chunk"].get<long long>(), v["fwd_bwd_s"].get<double>(),
                v["sppo_tflops"].get<double>());
  }
  if (j.contains("attention_graphs"))
    std::printf("attention graphs: %d built in %.2f s (the first %.2f s)\n", j["attention_graphs"]["built"].get<int>(),
                j["attention_graphs"]["build_s"].get<double>(), j["attention_graphs"]["first_build_s"].get<double>());
}

}  // namespace sppo
