// sppo: the command line. Each subcommand fills an options struct and calls the library;
// a bad option or input ends with one "[component] message" line and exit status 2.
#include <CLI/CLI.hpp>
#include <omp.h>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>


#include "cli/cmd_plan.h"
#include "core/check.h"
#include "kernels/blas_setup.h"
#include "train/bench.h"
#include "train/bench_sppo.h"
#include "train/profile_machine.h"
#include "train/trainer.h"

namespace {

using namespace sppo;

// Model, data and layout options shared by `train` and `grads`.
struct StepFlags {
  std::string model = "small";
  int vocab = 0, hidden = 0, layers = 0, heads = 0;
  std::string seq_len = "1024";
  std::string device_memory;
};

void add_step_options(CLI::App* cmd, StepFlags& f, StepOptions& o) {
  std::string presets;
  for (const auto& p : preset_names()) presets += (presets.empty() ? "" : ", ") + p;
  cmd->add_option("--model", f.model, "Model preset: " + presets)->capture_default_str();
  cmd->add_option("--vocab", f.vocab, "Vocabulary size V (overrides the preset)");
  cmd->add_option("--hidden", f.hidden, "Hidden size H (overrides the preset)");
  cmd->add_option("--layers", f.layers, "Number of blocks L (overrides the preset)");
  cmd->add_option("--heads", f.heads, "Attention heads Z; H/Z must be even (overrides the preset)");
  cmd->add_option("--seq-len", f.seq_len, "Tokens per step S; K and M suffixes allowed (64K, 1M)")
      ->capture_default_str();
  cmd->add_option("--seed", o.seed, "Seed of the initial weights and the built-in task")->capture_default_str();
  cmd->add_option("--data", o.data,
                  "Training data: empty for the built-in repeat task, a text file (bytes), raw "
                  "tokens (.u16/.u32), or a Megatron .bin/.idx prefix");
  cmd->add_option("--data-dtype", o.data_dtype, "Read --data as raw tokens of this type (u16, u32)");
  cmd->add_option("--threads", o.threads, "Compute threads (0: all cores)")->capture_default_str();
  cmd->add_option("--subseqs", o.subseqs, "Subsequences N per sequence, or 'auto' (the fewest that fit --device-memory, else about 8K tokens each)")->capture_default_str();
  cmd->add_option("--partition", o.partition,
                  "How to cut the sequence: length (equal lengths), flops (equal FLOPs), adaptive")
      ->capture_default_str();
  cmd->add_option("--offload", o.offload,
                  "Activation offload: none, full, adaptive (sized to hide behind compute and "
                  "fit --device-memory), or a ratio in [0, 1]")
      ->capture_default_str();
  cmd->add_option("--device-memory", f.device_memory, "Device memory budget, e.g. 512MiB (default: unlimited)");
  cmd->add_flag("--recompute", o.recompute, "Baseline: full activation recomputation (checkpoint every block)");
  cmd->add_option("--hardware", o.hardware, "Hardware profile for adaptive choices (default: measured here)");
  cmd->add_option("--plan", o.plan_path, "Take the subsequence lengths and alpha from this plan (sppo plan --gpus 1 --json)");
}

void resolve_step_options(const StepFlags& f, StepOptions& o) {
  o.model = preset(f.model);
  o.model_name = f.model;
  const bool custom = f.vocab || f.hidden || f.layers || f.heads;
  auto positive = [](int v, const char* name) {
    SPPO_CHECK(v > 0, "options") << name << " must be a positive integer (got " << v << ")";
    return v;
  };
  // CLI11 leaves 0 when not given; an explicit 0 or negative is refused below.
  if (f.vocab) o.model.vocab = positive(f.vocab, "--vocab");
  if (f.hidden) o.model.hidden = positive(f.hidden, "--hidden");
  if (f.layers) o.model.layers = positive(f.layers, "--layers");
  if (f.heads) o.model.heads = positive(f.heads, "--heads");
  if (custom) o.model_name = f.model + " (custom)";
  o.seq_len = parse_count(f.seq_len, "--seq-len");
  if (!f.device_memory.empty()) o.device_memory = parse_bytes(f.device_memory, "--device-memory");
  o.model.validate();
}

void print_bench_layer(const nlohmann::json& j) {
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

}  // namespace

int main(int argc, char** argv) {
  cpu::select_blas_core(argv);  // first: OpenBLAS reads OPENBLAS_CORETYPE only when it loads
  CLI::App app{"sppo: long-sequence transformer training with sequence pipeline parallel offloading"};
  app.require_subcommand(1);

  // train
  TrainOptions train;
  StepFlags train_flags;
  auto* cmd_train = app.add_subcommand("train", "Train a GPT model on long sequences");
  add_step_options(cmd_train, train_flags, train.step);
  cmd_train->add_option("--steps", train.steps, "Optimizer steps")->capture_default_str();
  cmd_train->add_option("--lr", train.lr, "Peak learning rate (warm-up, then cosine decay)")->capture_default_str();
  cmd_train->add_option("--warmup", train.warmup, "Warm-up steps")->capture_default_str();
  cmd_train->add_option("--weight-decay", train.weight_decay, "AdamW weight decay of matrices")->capture_default_str();
  cmd_train->add_option("--clip", train.clip, "Gradient-norm clip (0: off)")->capture_default_str();
  cmd_train->add_option("--metrics", train.metrics_path, "Write one JSON object per step to this .jsonl file");
  cmd_train->add_option("--save", train.save_dir, "Checkpoint directory (written atomically)");
  cmd_train->add_option("--save-every", train.save_every, "Also checkpoint every K steps");
  cmd_train->add_option("--resume", train.resume_dir, "Continue from this checkpoint directory");
  cmd_train->add_option("--stop-after", train.stop_after,
                        "End after step K (checkpointed when --save is given); --resume continues");
  cmd_train->add_option("--trace", train.trace_path, "Chrome trace JSON of the last step (Perfetto)");
  cmd_train->add_option("--svg", train.svg_path, "SVG timeline of the last step (compute, copies, memory)");
  cmd_train->add_flag("--quiet", train.quiet, "No progress output");

  // grads
  StepOptions grads;
  StepFlags grads_flags;
  std::string grads_out, grads_init;
  auto* cmd_grads = app.add_subcommand("grads", "Run one forward/backward and export weights, gradients and loss");
  add_step_options(cmd_grads, grads_flags, grads);
  cmd_grads->add_option("--out", grads_out, "Output directory")->required();
  cmd_grads->add_option("--init", grads_init, "Take the weights from this checkpoint directory");

  // bench
  auto* cmd_bench = app.add_subcommand("bench", "Benchmarks that print a table, or JSON with --json");
  cmd_bench->require_subcommand(1);
  int bl_hidden = 1024, bl_heads = 16, bl_reps = 3, bl_threads = 0;
  std::string bl_seq = "8192";
  bool bl_json = false;
  auto* cmd_bench_layer = cmd_bench->add_subcommand("layer", "One block's forward+backward vs this machine's FMA peak and SGEMM rate");
  cmd_bench_layer->add_option("--hidden", bl_hidden, "Hidden size")->capture_default_str();
  cmd_bench_layer->add_option("--heads", bl_heads, "Heads")->capture_default_str();
  cmd_bench_layer->add_option("--seq-len", bl_seq, "Tokens")->capture_default_str();
  cmd_bench_layer->add_option("--reps", bl_reps, "Timed repetitions (median)")->capture_default_str();
  cmd_bench_layer->add_option("--threads", bl_threads, "Compute threads (0: all cores)");
  cmd_bench_layer->add_flag("--json", bl_json, "Print one JSON object");



  cli::add_plan_commands(app);

  // bench memory / bench offload
  std::string bm_model = "bench-memory", bm_budget = "", bo_model = "bench-memory", bo_seq = "8192",
              bo_budget = "", bm_hardware, bo_hardware;
  int bo_subseqs = 8, bm_reps = 1, bo_reps = 2;
  bool bm_json = false, bo_json = false;
  auto* cmd_bench_memory = cmd_bench->add_subcommand("memory", "Longest sequence per mode under a device budget");
  cmd_bench_memory->add_option("--model", bm_model, "Model preset")->capture_default_str();
  cmd_bench_memory->add_option("--device-memory", bm_budget, "Device budget (default 64MiB)");
  cmd_bench_memory->add_option("--reps", bm_reps, "Timed steps per point")->capture_default_str();
  cmd_bench_memory->add_option("--hardware", bm_hardware, "Profile for adaptive choices (default: measured now)");
  cmd_bench_memory->add_flag("--json", bm_json, "Print one JSON object");
  auto* cmd_bench_offload = cmd_bench->add_subcommand("offload", "Offload none / full / adaptive at one length");
  cmd_bench_offload->add_option("--model", bo_model, "Model preset")->capture_default_str();
  cmd_bench_offload->add_option("--seq-len", bo_seq, "Tokens")->capture_default_str();
  cmd_bench_offload->add_option("--subseqs", bo_subseqs, "Subsequences N")->capture_default_str();
  cmd_bench_offload->add_option("--device-memory", bo_budget, "Budget for adaptive (default: halfway between full and none)");
  cmd_bench_offload->add_option("--reps", bo_reps, "Timed steps per mode")->capture_default_str();
  cmd_bench_offload->add_option("--hardware", bo_hardware, "Profile for adaptive choices (default: measured now)");
  cmd_bench_offload->add_flag("--json", bo_json, "Print one JSON object");

  std::string bs_hardware;
  int bs_reps = 5;
  bool bs_json = false;
  auto* cmd_bench_sim = cmd_bench->add_subcommand("sim", "Simulated vs measured step time and peak for several configurations");
  cmd_bench_sim->add_option("--hardware", bs_hardware, "Profile to simulate with (default: measured now)");
  cmd_bench_sim->add_option("--reps", bs_reps, "Timed steps per configuration")->capture_default_str();
  cmd_bench_sim->add_flag("--json", bs_json, "Print one JSON object");

  // profile
  std::string profile_out = "profiles/cpu-local.json";
  bool profile_quick = false;
  auto* cmd_profile = app.add_subcommand("profile", "Measure this machine (GEMM, attention, copies) as a hardware profile");
  cmd_profile->add_option("--out", profile_out, "Where to write the profile JSON")->capture_default_str();
  cmd_profile->add_flag("--quick", profile_quick, "Smaller shapes, about a second");

  try {
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return app.exit(e) == 0 ? 0 : 2;
    }
    if (auto rc = cli::plan_command_result()) return *rc;
    if (*cmd_train) {
      resolve_step_options(train_flags, train.step);
      return run_train(train);
    }
    if (*cmd_grads) {
      resolve_step_options(grads_flags, grads);
      return run_grads(grads, grads_out, grads_init);
    }
    if (*cmd_bench_memory || *cmd_bench_offload) {
      const bool mem = bool(*cmd_bench_memory);
      BenchModelOptions b;
      b.model_name = mem ? bm_model : bo_model;
      b.model = preset(b.model_name);
      b.reps = mem ? bm_reps : bo_reps;
      b.hardware = mem ? bm_hardware : bo_hardware;
      const std::string budget = mem ? (bm_budget.empty() ? "64MiB" : bm_budget) : bo_budget;
      if (!budget.empty()) b.budget = parse_bytes(budget, "--device-memory");
      if (!mem) {
        b.seq_len = parse_count(bo_seq, "--seq-len");
        b.subseqs = bo_subseqs;
      }
      const auto j = mem ? bench_memory(b) : bench_offload(b);
      if (mem ? bm_json : bo_json) std::printf("%s\n", j.dump(2).c_str());
      else if (mem) print_bench_memory(j);
      else print_bench_offload(j);
      return 0;
    }
    if (*cmd_bench_sim) {
      const auto j = bench_sim(bs_hardware, bs_reps);
      if (bs_json) std::printf("%s\n", j.dump(2).c_str());
      else print_bench_sim(j);
      return 0;
    }
    if (*cmd_profile) {
      const auto p = measure_cpu_profile(profile_quick);
      plan::save_profile(p, profile_out);
      std::printf("%s\n", plan::to_json(p).dump(2).c_str());
      std::fprintf(stderr, "wrote %s; use it with --hardware %s\n", profile_out.c_str(), profile_out.c_str());
      return 0;
    }
    if (*cmd_bench_layer) {
      if (bl_threads > 0) omp_set_num_threads(bl_threads);
      const i64 S = parse_count(bl_seq, "--seq-len");
      SPPO_CHECK(S >= 2, "options") << "--seq-len must be at least 2";
      const auto j = bench_layer(bl_hidden, bl_heads, S, bl_reps);
      if (bl_json) std::printf("%s\n", j.dump(2).c_str());
      else print_bench_layer(j);
      return 0;
    }
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "sppo: %s\n", e.what());
    return 2;
  }
}
