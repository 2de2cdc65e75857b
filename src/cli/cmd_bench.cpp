// `sppo bench`: benchmarks that print a table, or JSON with --json.
#include <CLI/CLI.hpp>
#include <omp.h>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "bench/bench.h"
#include "bench/bench_attention.h"
#include "bench/bench_cores.h"
#include "bench/bench_eval.h"
#include "bench/bench_pipeline.h"
#include "bench/bench_sppo.h"
#include "bench/bench_systems.h"
#include "cli/commands.h"
#include "cli/step_options.h"
#include "comm/comm.h"
#include "core/check.h"
#include "core/config.h"
#include "io/fileutil.h"
#include "train/setup.h"

namespace sppo::cli {

namespace {

// `bench layer --breakdown`: where the extra, kernel-by-kernel timed step's time went.
void print_layer_breakdown(const nlohmann::json& j) {
  if (!j.contains("breakdown")) return;
  const auto& b = j["breakdown"];
  const double s = b["step_s"].get<double>();
  auto part = [&](const char* key) { return 100.0 * b[key].get<double>() / s; };
  std::printf("timed step %.3f s: attention forward %.0f%%, attention backward %.0f%%, GEMMs %.0f%%, "
              "other kernels %.0f%%, between kernels %.0f%% (outside attention and GEMMs: %.0f%%)\n",
              s, part("attention_forward_s"), part("attention_backward_s"), part("gemm_s"), part("other_s"),
              part("between_s"), 100.0 * j["outside_attention_gemm_fraction"].get<double>());
}

void print_bench_layer(const nlohmann::json& j) {
  if (j["backend"] != "cpu") {
    std::printf("one block, forward + backward (%s, %s)\n", j["backend"].get<std::string>().c_str(),
                j["precision"].get<std::string>().c_str());
    std::printf("| H | heads | S | step s | tokens/s | model TFLOP/s | GEMM TFLOP/s | fraction of GEMM | peak memory |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|\n");
    std::printf("| %d | %d | %lld | %.3f | %.0f | %.1f | %.1f | %.3f | %s |\n", j["hidden"].get<int>(),
                j["heads"].get<int>(), (long long)j["seq_len"].get<i64>(), j["step_time_s"].get<double>(),
                j["tokens_per_s"].get<double>(), j["model_flops_per_s"].get<double>() / 1e12,
                j["gemm_peak_flops_per_s"].get<double>() / 1e12, j["fraction_of_peak"].get<double>(),
                format_bytes(j["peak_memory_bytes"].get<double>()).c_str());
    return;
  }
  std::printf("one block, forward + backward (fp32, %d threads, %s)\n", j["threads"].get<int>(),
              j["blas_core_description"].get<std::string>().c_str());
  std::printf("| H | heads | S | step s | tokens/s | model GFLOP/s | CPU peak GFLOP/s | SGEMM GFLOP/s | fraction of peak | of SGEMM | peak memory |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::printf("| %d | %d | %lld | %.3f | %.0f | %.1f | %.1f | %.1f | %.3f | %.3f | %s |\n", j["hidden"].get<int>(),
              j["heads"].get<int>(), (long long)j["seq_len"].get<i64>(), j["step_time_s"].get<double>(),
              j["tokens_per_s"].get<double>(), j["model_flops_per_s"].get<double>() / 1e9,
              j["cpu_peak_flops_per_s"].get<double>() / 1e9, j["sgemm_flops_per_s"].get<double>() / 1e9,
              j["fraction_of_peak"].get<double>(), j["fraction_of_sgemm"].get<double>(),
              format_bytes(j["peak_memory_bytes"].get<double>()).c_str());
}

// Prints j as JSON, or through `table`.
template <typename Print>
void report(const nlohmann::json& j, bool json, Print table) {
  if (json) std::printf("%s\n", j.dump(2).c_str());
  else table(j);
}

void add_bench_layer(CLI::App* bench, Commands& out) {
  struct Layer {
    int hidden = 1024, heads = 16, reps = 3, threads = 0;
    std::string seq = "8192", backend = "cpu", precision, attention = "auto";
    bool json = false, breakdown = false;
  };
  auto o = std::make_shared<Layer>();
  auto* cmd = bench->add_subcommand("layer", "One block's forward+backward vs this machine's FMA peak and SGEMM rate");
  cmd->add_option("--hidden", o->hidden, "Hidden size")->capture_default_str();
  cmd->add_option("--heads", o->heads, "Heads")->capture_default_str();
  cmd->add_option("--seq-len", o->seq, "Tokens")->capture_default_str();
  cmd->add_option("--reps", o->reps, "Timed repetitions (median)")->capture_default_str();
  cmd->add_option("--threads", o->threads, "Compute threads (0: all cores)");
  cmd->add_flag("--json", o->json, "Print one JSON object");
  cmd->add_flag("--breakdown", o->breakdown, "One more step with each kernel timed: attention forward/backward, GEMMs, other");
  cmd->add_option("--backend", o->backend, "cpu, cuda or auto")->capture_default_str();
  cmd->add_option("--precision", o->precision, "fp32 or bf16 (default: the backend's)");
  cmd->add_option("--attention", o->attention, kAttentionKernelsHelp)->capture_default_str();
  out.push_back({cmd, [o](const Invocation&) {
                   if (o->threads > 0) omp_set_num_threads(o->threads);
                   const i64 S = parse_count(o->seq, "--seq-len");
                   const auto j = bench_layer(*make_backend(o->backend, o->precision, o->attention), o->hidden,
                                              o->heads, S, o->reps, o->breakdown);
                   report(j, o->json, [](const nlohmann::json& j) {
                     print_bench_layer(j);
                     print_layer_breakdown(j);
                   });
                   return 0;
                 }});
}

// The GPU's shapes by default (a CPU's are 16 times shorter, 4 heads).
void add_bench_attention(CLI::App* bench, Commands& out) {
  struct Attention {
    std::string backend = "auto", precision, seq, queries, prefix, attention = "auto";
    int heads = 0, head_dim = 0, reps = 3;
    i64 chunk = kKvChunkMinRows;
    bool json = false;
  };
  auto o = std::make_shared<Attention>();
  auto* cmd = bench->add_subcommand(
      "attention", "Causal attention forward+backward: a whole sequence, and a subsequence after a prefix");
  cmd->add_option("--backend", o->backend, "cpu, cuda or auto")->capture_default_str();
  cmd->add_option("--precision", o->precision, "fp32 or bf16 (default: the backend's)");
  cmd->add_option("--seq-len", o->seq, "Whole-sequence length (default 32K; 2K on the CPU)");
  cmd->add_option("--queries", o->queries, "Subsequence queries (default 16K; 1K on the CPU)");
  cmd->add_option("--prefix", o->prefix, "Tokens before the subsequence (default 112K; 7K on the CPU)");
  cmd->add_option("--heads", o->heads, "Heads (default 32; 4 on the CPU)");
  cmd->add_option("--head-dim", o->head_dim, "Head size (default 128)");
  cmd->add_option("--chunk", o->chunk,
                  "Rows of each streamed K/V chunk of the prefix in the _chunked shape (the runtime's "
                  "smallest, for host K/V)")
      ->capture_default_str();
  cmd->add_option("--attention", o->attention, kAttentionKernelsHelp)->capture_default_str();
  cmd->add_option("--reps", o->reps, "Timed repetitions (median)")->capture_default_str();
  cmd->add_flag("--json", o->json, "Print one JSON object");
  out.push_back({cmd, [o](const Invocation&) {
                   const auto be = make_backend(o->backend, o->precision, o->attention);
                   BenchAttentionOptions b = default_attention_shapes(*be);
                   b.chunk = o->chunk;
                   if (!o->seq.empty()) b.seq_len = parse_count(o->seq, "--seq-len");
                   if (!o->queries.empty()) b.queries = parse_count(o->queries, "--queries");
                   if (!o->prefix.empty()) b.prefix = parse_count(o->prefix, "--prefix");
                   if (o->heads) b.heads = o->heads;
                   if (o->head_dim) b.head_dim = o->head_dim;
                   b.reps = o->reps;
                   report(bench_attention(*be, b), o->json, print_bench_attention);
                   return 0;
                 }});
}

// bench memory and bench offload: modes of one model under a device budget.
struct ModelBench {
  std::string model = "bench-memory", budget, host_budget, hardware, backend = "cpu", precision, at,
              attention = "auto", seq = "8192";
  int reps = 1, layers = 0, subseqs = 8;
  bool json = false;
};

void add_model_bench_options(CLI::App* cmd, ModelBench& o) {
  cmd->add_option("--model", o.model, "Model preset")->capture_default_str();
  cmd->add_option("--backend", o.backend, "cpu, cuda or auto")->capture_default_str();
  cmd->add_option("--precision", o.precision, "fp32 or bf16 (default: the backend's)");
  cmd->add_option("--attention", o.attention, kAttentionKernelsHelp)->capture_default_str();
  cmd->add_option("--hardware", o.hardware, "Profile for adaptive choices (default: measured now)");
  cmd->add_flag("--json", o.json, "Print one JSON object");
}

BenchModelOptions model_bench(const ModelBench& o) {
  BenchModelOptions b;
  b.model_name = o.model;
  b.model = preset(b.model_name);
  b.reps = o.reps;
  b.hardware = o.hardware;
  b.attention = o.attention;
  b.backend = make_backend(o.backend, o.precision, b.attention)->name();
  b.precision = o.precision;
  return b;
}

void add_bench_memory(CLI::App* bench, Commands& out) {
  auto o = std::make_shared<ModelBench>();
  auto* cmd = bench->add_subcommand("memory", "Longest sequence per mode under a device budget");
  add_model_bench_options(cmd, *o);
  cmd->add_option("--device-memory", o->budget, "Device budget (default 64MiB on the CPU; elsewhere the device less 4 GiB)");
  cmd->add_option("--host-memory", o->host_budget,
                  "Host budget of every mode (offloaded activations, host K/V; default 16x the device budget)");
  cmd->add_option("--layers", o->layers, "Layers (default: the preset's)");
  cmd->add_option("--at-seq-len", o->at, "SPPO alone: its longest sequence, and its step time here");
  cmd->add_option("--reps", o->reps, "Timed steps per point")->capture_default_str();
  out.push_back({cmd, [o](const Invocation&) {
                   BenchModelOptions b = model_bench(*o);
                   if (o->layers) {
                     SPPO_CHECK(o->layers > 0, "options") << "--layers must be a positive integer (got " << o->layers << ")";
                     b.model.layers = o->layers;
                   }
                   if (!o->at.empty()) b.at_seq_len = parse_count(o->at, "--at-seq-len");
                   const std::string budget = o->budget.empty() && b.backend == "cpu" ? "64MiB" : o->budget;
                   b.budget = !budget.empty() ? parse_bytes(budget, "--device-memory")
                                              : i64(make_backend(b.backend)->device_memory()) - (i64{4} << 30);
                   b.host_budget = o->host_budget.empty() ? 16 * b.budget : parse_bytes(o->host_budget, "--host-memory");
                   report(bench_memory(b), o->json, print_bench_memory);
                   return 0;
                 }});
}

void add_bench_offload(CLI::App* bench, Commands& out) {
  auto o = std::make_shared<ModelBench>();
  o->reps = 2;
  auto* cmd = bench->add_subcommand("offload", "Offload none / full / adaptive at one length");
  add_model_bench_options(cmd, *o);
  cmd->add_option("--seq-len", o->seq, "Tokens")->capture_default_str();
  cmd->add_option("--subseqs", o->subseqs, "Subsequences N")->capture_default_str();
  cmd->add_option("--device-memory", o->budget, "Budget for adaptive (default: halfway between full and none)");
  cmd->add_option("--reps", o->reps, "Timed steps per mode")->capture_default_str();
  out.push_back({cmd, [o](const Invocation&) {
                   BenchModelOptions b = model_bench(*o);
                   if (!o->budget.empty()) b.budget = parse_bytes(o->budget, "--device-memory");
                   b.seq_len = parse_count(o->seq, "--seq-len");
                   b.subseqs = o->subseqs;
                   report(bench_offload(b), o->json, print_bench_offload);
                   return 0;
                 }});
}

// bench pipeline and bench sp: two ranks (started under mpirun when they were not).
void add_bench_ranks(CLI::App* bench, Commands& out, bool sp) {
  struct Ranks {
    BenchPipelineOptions options;
    bool json = false;
  };
  auto o = std::make_shared<Ranks>();
  if (sp) o->options.seq_len = "1024";
  auto* cmd = sp ? bench->add_subcommand("sp", "Sequence parallelism on 2 ranks vs one (ring attention, TP with "
                                               "sequence-parallel regions, Ulysses) and MSP on vs off: step time, "
                                               "balance, memory, vs simulated")
                 : bench->add_subcommand("pipeline", "Sequence pipeline and data parallel on 2 ranks: bubble and step "
                                                     "time, measured vs simulated");
  cmd->add_option("--model", o->options.model, "Model preset")->capture_default_str();
  cmd->add_option("--seq-len", o->options.seq_len,
                  sp ? "Tokens per sequence (the last row runs twice as many)" : "Tokens per sequence")
      ->capture_default_str();
  cmd->add_option("--reps", o->options.reps, "Timed steps per configuration")->capture_default_str();
  cmd->add_option("--hardware", o->options.hardware, "Profile to simulate with (default: measured now)");
  cmd->add_flag("--json", o->json, "Print one JSON object");
  out.push_back({cmd, [o, sp](const Invocation& inv) {
                   if (!comm::launched_by_mpi()) relaunch_under_mpirun(2, inv.argc, inv.argv);
                   const auto j = sp ? bench_sp(o->options, comm::world()) : bench_pipeline(o->options, comm::world());
                   if (comm::world().rank() == 0) {
                     if (sp) report(j, o->json, print_bench_sp);
                     else report(j, o->json, print_bench_pipeline);
                   }
                   return 0;
                 }});
}

void add_bench_sim(CLI::App* bench, Commands& out) {
  struct Sim {
    BenchModelOptions options;
    bool json = false;
  };
  auto o = std::make_shared<Sim>();
  o->options.reps = 5;
  auto* cmd = bench->add_subcommand(
      "sim", "Simulated vs measured step time and peak for several configurations (on a GPU: three of gpt-7b's shape)");
  cmd->add_option("--hardware", o->options.hardware, "Profile to simulate with (default: measured now)");
  cmd->add_option("--reps", o->options.reps, "Timed steps per configuration")->capture_default_str();
  cmd->add_option("--backend", o->options.backend, "cpu, cuda or auto")->capture_default_str();
  cmd->add_option("--precision", o->options.precision, "fp32 or bf16 (default: the backend's)");
  cmd->add_option("--attention", o->options.attention, kAttentionKernelsHelp)->capture_default_str();
  cmd->add_flag("--json", o->json, "Print one JSON object");
  out.push_back({cmd, [o](const Invocation&) {
                   report(bench_sim(o->options), o->json, print_bench_sim);
                   return 0;
                 }});
}

void add_bench_cores(CLI::App* bench, Commands& out) {
  struct Cores {
    BenchCoresOptions options;
    bool json = false;
  };
  auto o = std::make_shared<Cores>();
  auto* cmd = bench->add_subcommand(
      "cores", "A step alone and beside another busy program on the same cores (a second sppo, bench memory), under "
               "libgomp's default OpenMP wait, passive waiting and sppo's default");
  cmd->add_option("--model", o->options.model, "Model preset")->capture_default_str();
  cmd->add_option("--seq-len", o->options.seq_len, "Tokens")->capture_default_str();
  cmd->add_option("--steps", o->options.steps, "Steps per measured run (the first is not timed)")->capture_default_str();
  cmd->add_option("--reps", o->options.reps, "Measured runs per setting and neighbour (median)")->capture_default_str();
  cmd->add_flag("--json", o->json, "Print one JSON object");
  out.push_back({cmd, [o](const Invocation&) {
                   parse_count(o->options.seq_len, "--seq-len");
                   preset(o->options.model);
                   report(bench_cores(o->options), o->json, print_bench_cores);
                   return 0;
                 }});
}

void add_bench_eval(CLI::App* bench, Commands& out) {
  struct Eval {
    BenchEvalOptions options;
    std::string budget = "96MiB", host_budget = "4GiB", cap = "4M", measure_cap = "64K";
    bool json = false;
  };
  auto o = std::make_shared<Eval>();
  auto* cmd = bench->add_subcommand(
      "eval", "The longest sequence sppo eval (the forward alone) fits beside the longest train fits, under one "
              "device budget, and one evaluation's peaks measured at its longest");
  cmd->add_option("--model", o->options.model, "Model preset")->capture_default_str();
  cmd->add_option("--device-memory", o->budget, "The device budget both run under")->capture_default_str();
  cmd->add_option("--host-memory", o->host_budget, "The host budget both run under")->capture_default_str();
  cmd->add_option("--cap", o->cap, "The longest length searched")->capture_default_str();
  cmd->add_option("--measure-cap", o->measure_cap,
                  "The longest evaluation run to measure its peaks (run at eval's longest where that is shorter)")
      ->capture_default_str();
  cmd->add_flag("--json", o->json, "Print one JSON object");
  out.push_back({cmd, [o](const Invocation&) {
                   preset(o->options.model);
                   o->options.budget = parse_bytes(o->budget, "--device-memory");
                   o->options.host_budget = parse_bytes(o->host_budget, "--host-memory");
                   o->options.cap = parse_count(o->cap, "--cap");
                   o->options.measure_cap = parse_count(o->measure_cap, "--measure-cap");
                   report(bench_eval(o->options), o->json, print_bench_eval);
                   return 0;
                 }});
}

// bench systems: four ranks (started under mpirun when they were not).
void add_bench_systems(CLI::App* bench, Commands& out) {
  struct Systems {
    BenchSystemsOptions options;
    std::string budget = "128MiB", cap = "64K", measure_cap = "16K", svg;
    bool json = false;
  };
  auto o = std::make_shared<Systems>();
  auto* cmd = bench->add_subcommand(
      "systems", "The SPPO paper's three systems on 4 CPU ranks under one device budget a rank: each one's longest "
                 "sequence, and at a length all three fit the step measured and simulated (DeepSpeed simulated only)");
  cmd->add_option("--model", o->options.model, "Model preset")->capture_default_str();
  cmd->add_option("--device-memory", o->budget, "The device budget of every rank")->capture_default_str();
  cmd->add_option("--cap", o->cap, "The longest length searched")->capture_default_str();
  cmd->add_option("--measure-cap", o->measure_cap, "The longest common length run on the ranks")
      ->capture_default_str();
  cmd->add_option("--reps", o->options.reps, "Timed steps a system, after one warm-up")->capture_default_str();
  cmd->add_option("--hardware", o->options.hardware, "Profile to plan and simulate with (default: measured now)");
  cmd->add_option("--svg", o->svg, "Also draw the three systems into this SVG file");
  cmd->add_flag("--json", o->json, "Print one JSON object");
  out.push_back({cmd, [o](const Invocation& inv) {
                   preset(o->options.model);
                   o->options.budget = parse_bytes(o->budget, "--device-memory");
                   o->options.cap = parse_count(o->cap, "--cap");
                   o->options.measure_cap = parse_count(o->measure_cap, "--measure-cap");
                   if (!comm::launched_by_mpi()) relaunch_under_mpirun(kBenchSystemsRanks, inv.argc, inv.argv);
                   const auto j = bench_systems(o->options, comm::world());
                   if (comm::world().rank() == 0) {
                     report(j, o->json, print_bench_systems);
                     if (!o->svg.empty()) io::write_file_atomic(o->svg, svg_bench_systems(j));
                   }
                   return 0;
                 }});
}

}  // namespace

void add_bench_commands(CLI::App& app, Commands& out) {
  auto* bench = app.add_subcommand("bench", "Benchmarks that print a table, or JSON with --json");
  bench->require_subcommand(1);
  add_bench_layer(bench, out);
  add_bench_attention(bench, out);
  add_bench_memory(bench, out);
  add_bench_offload(bench, out);
  add_bench_ranks(bench, out, false);
  add_bench_ranks(bench, out, true);
  add_bench_sim(bench, out);
  add_bench_cores(bench, out);
  add_bench_eval(bench, out);
  add_bench_systems(bench, out);
}

}  // namespace sppo::cli
