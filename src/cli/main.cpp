// sppo: the command line. Each subcommand fills an options struct and calls the library;
// a bad option or input ends with one "[component] message" line and exit status 2.
#include <CLI/CLI.hpp>
#include <omp.h>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <optional>
#include <set>
#include <sstream>
#include <nlohmann/json.hpp>


#include "backends/cpu/blas_setup.h"
#include "bench/bench.h"
#include "bench/bench_attention.h"
#include "bench/bench_pipeline.h"
#include "bench/bench_sppo.h"
#include "train/profile_device.h"
#include "cli/cmd_plan.h"
#include "comm/comm.h"
#include "core/check.h"
#include "io/checkpoint.h"
#include "io/fileutil.h"
#include "io/hf.h"
#include "io/loss_plot.h"
#include "train/profile_machine.h"
#include "train/parallel.h"
#include "train/setup.h"
#include "train/trainer.h"

namespace {

using namespace sppo;

// Model, data and layout options shared by `train` and `grads`.
struct StepFlags {
  std::string model = "small";
  std::string attention = "causal";
  int vocab = 0, hidden = 0, layers = 0, heads = 0;
  double rope_theta = 0;     // 0: the model's
  std::string rope_scaling;  // "": the model's
  std::string seq_len = "1024";
  std::string device_memory;
  std::string host_memory;
  i64 mlp_tile_rows = 0;
  CLI::Option* model_option = nullptr;
  CLI::Option* seq_len_option = nullptr;
  CLI::Option* mlp_tile_rows_option = nullptr;
};

constexpr const char* kAttentionKernelsHelp =
    "Attention kernels: auto (cuDNN's fused attention on CUDA where it takes the shapes, else the backend's own), "
    "own, or cudnn";

// --attention: comma-separated words, one of each kind at most: the mask (causal,
// bidirectional) and the kernels (auto, own, cudnn).
void parse_attention(const std::string& text, StepOptions& o) {
  bool mask = false, kernels = false;
  o.model.causal = true;
  o.attention_kernels = "auto";
  std::stringstream in(text);
  for (std::string word; std::getline(in, word, ',');) {
    const bool is_mask = word == "causal" || word == "bidirectional";
    const bool is_kernels = word == "auto" || word == "own" || word == "cudnn";
    SPPO_CHECK(is_mask || is_kernels, "options")
        << "--attention '" << text << "'" << (word == text ? "" : ": '" + word + "'")
        << " is unknown; use causal or bidirectional (the mask) and auto, own or cudnn (the kernels), e.g. "
        << "--attention cudnn or --attention bidirectional,own";
    SPPO_CHECK(!(is_mask ? mask : kernels), "options")
        << "--attention '" << text << "' names " << (is_mask ? "the mask" : "the kernels") << " twice; give one "
        << (is_mask ? "of causal and bidirectional" : "of auto, own and cudnn");
    if (is_mask) {
      mask = true;
      o.model.causal = word == "causal";
    } else {
      kernels = true;
      o.attention_kernels = word;
    }
  }
}

void add_step_options(CLI::App* cmd, StepFlags& f, StepOptions& o) {
  std::string presets;
  for (const auto& p : preset_names()) presets += (presets.empty() ? "" : ", ") + p;
  f.model_option = cmd->add_option("--model", f.model, "Model preset: " + presets)->capture_default_str();
  cmd->add_option("--attention", f.attention,
                  "The mask, causal or bidirectional (every position sees every other; trains with --objective "
                  "mlm), and the kernels, auto (cuDNN's fused attention on CUDA where it takes the model's heads, "
                  "else the backend's own; a --hardware profile's measured choice per shape class), own, or cudnn; "
                  "one word of each, comma-separated, e.g. cudnn or bidirectional,own")
      ->capture_default_str();
  cmd->add_option("--objective", o.objective,
                  "lm (next token), or mlm (masked tokens: 15% of positions, 80/10/10 mask/random/keep, the last "
                  "vocabulary id as the mask; for --attention bidirectional)")
      ->capture_default_str();
  cmd->add_option("--vocab", f.vocab, "Vocabulary size V (overrides the preset)");
  cmd->add_option("--hidden", f.hidden, "Hidden size H (overrides the preset)");
  cmd->add_option("--layers", f.layers, "Number of blocks L (overrides the preset)");
  cmd->add_option("--heads", f.heads, "Attention heads Z; H/Z must be even (overrides the preset)");
  cmd->add_option("--rope-theta", f.rope_theta,
                  "RoPE base theta (overrides the model's; raising it is the usual first step of context extension)");
  cmd->add_option("--rope-scaling", f.rope_scaling,
                  "RoPE frequency scaling of a Llama-family model: none, TYPE:FACTOR with TYPE linear, dynamic, yarn "
                  "or llama3 (llama3 scales from the model's max_positions), or Hugging Face's JSON object, e.g. "
                  "'{\"rope_type\": \"llama3\", \"factor\": 8, \"original_max_position_embeddings\": 8192}'");
  f.seq_len_option = cmd->add_option("--seq-len", f.seq_len, "Tokens per step S; K and M suffixes allowed (64K, 1M)")
                         ->capture_default_str();
  cmd->add_option("--seed", o.seed, "Seed of the initial weights and the built-in task")->capture_default_str();
  cmd->add_option("--init", o.init,
                  "Start from these weights at step 0 with a fresh optimizer: an sppo checkpoint (train --save, sppo "
                  "import) or a Hugging Face model directory (config.json with \"architectures\"), imported on the "
                  "fly; its model is used unless --model is given");
  cmd->add_option("--data", o.data,
                  "Training data: empty for the built-in repeat task, a text file (bytes), raw "
                  "tokens (.u16/.u32), or a Megatron .bin/.idx prefix");
  cmd->add_option("--data-dtype", o.data_dtype, "Read --data as raw tokens of this type (u16, u32)");
  cmd->add_option("--labels", o.labels,
                  "The targets of --data, one per token as Hugging Face writes labels (the label of token i+1 is what "
                  "position i predicts), -100 where no loss is taken: a raw PATH.i32/.i64 file or a Megatron "
                  ".bin/.idx pair; the loss averages over the step's counted tokens");
  cmd->add_option("--doc-sep", o.doc_sep,
                  "The token id that ends each document of --data (e.g. the tokenizer's end-of-text id); with --pack");
  cmd->add_flag("--pack", o.pack,
                "Pack documents into each sequence with attention that stops at document boundaries and positions "
                "that restart at each document (no target crosses a boundary; a document longer than the sequence "
                "is cut); the documents are those --doc-sep ends, or a Megatron dataset's own (its document index)");
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
  cmd->add_option("--host-memory", f.host_memory,
                  "Host memory budget for offloaded activations, e.g. 2GiB (default: unlimited); adaptive "
                  "offload and --subseqs auto choose within it");
  cmd->add_flag("--recompute", o.recompute, "Baseline: full activation recomputation (checkpoint every block)");
  cmd->add_option("--kv-cache", o.kv_cache,
                  "Where finished subsequences' K/V and their dK/dV sums live: device, host (streamed back to "
                  "each later subsequence's attention, a chunk at a time), recompute (no K/V kept: recomputed "
                  "from each layer's input when needed; the sums on the host), or auto (the device unless that "
                  "does not fit the budgets, then the host on the fewest layers that fit, then recompute)")
      ->capture_default_str();
  cmd->add_option("--recompute-tensors", o.recompute_tensors,
                  "Saved tensors backward recomputes instead of keeping or offloading: a comma list of ln1_mean, "
                  "ln1_rstd, ln1_out, q, attn_out, lse, x_mid, ln2_mean, ln2_rstd, ln2_out, fc_pre, or of the "
                  "groups ln1, q, attention, x_mid, ln2, fc_pre (a tensor brings its group: one forward step "
                  "makes them); head_grad (the last stage runs the LM head in the last layer's backward, not "
                  "its forward, and keeps no loss gradient between them); none; all; or auto (none unless "
                  "nothing else fits the budgets)")
      ->capture_default_str();
  f.mlp_tile_rows_option =
      cmd->add_option("--mlp-tile-rows", f.mlp_tile_rows,
                      "Run each layer's MLP this many rows at a time, so its [T, 4H] intermediate (and a "
                      "recomputed fc_pre) is never whole; 0: off (default: the plan's, else off)");
  cmd->add_option("--hardware", o.hardware, "Hardware profile for adaptive choices (default: measured here)");
  cmd->add_option("--backend", o.backend, "cpu, cuda, or auto (cuda when a GPU is visible)")->capture_default_str();
  cmd->add_option("--precision", o.precision, "fp32 or bf16 (default: bf16 on CUDA, fp32 on the CPU)");
  cmd->add_option("--device", o.device,
                  "The GPU this process drives (default: its local rank among the launcher's ranks on this "
                  "machine, modulo the GPUs it sees)");
  cmd->add_option("--comm", o.comm,
                  "How several ranks talk: auto (on CUDA, NCCL where every rank has a GPU of its own, else MPI "
                  "through host memory; on the CPU, MPI), nccl, or mpi (device memory staged through pinned host "
                  "buffers; on the CPU the same staging, for testing it)")
      ->capture_default_str();
  cmd->add_option("--plan", o.plan_path, "Run this plan's layout, subsequence lengths and alpha (sppo plan --out)");
  cmd->add_option("--pp", o.pp, "Pipeline stages (ranks = pp x tp x cp x dp; start with mpirun -np)")->capture_default_str();
  cmd->add_option("--tp", o.tp,
                  "Tensor parallel with sequence-parallel regions (the SPPO paper's SP, Megatron-LM's): ranks that "
                  "split every layer's heads, MLP and vocabulary, and the LayerNorm regions' tokens")
      ->capture_default_str();
  cmd->add_option("--cp", o.cp, "Context parallel: ranks of a ring attention that split every subsequence")
      ->capture_default_str();
  cmd->add_option("--ring", o.ring,
                  "Ring attention with --cp: its layout, zigzag (balances causal work) or contiguous, and its "
                  "algorithm, flash (one pass, LSE merge) or rsa (two-pass Ring Self-Attention, bidirectional models); e.g. "
                  "'contiguous' or 'rsa,zigzag'")
      ->capture_default_str();
  cmd->add_option("--msp", o.msp,
                  "Multiplexed sequence partitioning with --pp: on runs each stage's bubble-adjacent subsequences "
                  "split over the stages that would idle (needs --subseqs >= --pp), off does not")
      ->capture_default_str();
  cmd->add_option("--msp-reach", o.msp_reach,
                  "With --msp on: how far a split subsequence reaches, over the stage's own group and those within "
                  "reach - 1 stages that idle in its slot (2 or more; 0: the paper's Table 3, every stage group "
                  "before or after its steady phase). A helper holds the weights and gradients of up to reach - 1 "
                  "other stages")
      ->capture_default_str();
  cmd->add_option("--dp", o.dp, "Data-parallel replicas, each training its own sequences")->capture_default_str();
  cmd->add_option("--zero", o.zero, "1: shard the AdamW state over the ranks that hold the same layers (ZeRO-1)")
      ->capture_default_str();
  cmd->add_option("--batch", o.batch, "Sequences per optimizer step, all replicas together (default: --dp)");
  cmd->add_option("--comm-timeout", o.comm_timeout_s,
                  "Seconds a rank waits for a message before ending the job")->capture_default_str();
}

// --rope-scaling: none, TYPE:FACTOR, or HF's JSON object.
RopeScaling parse_rope_scaling(const std::string& text, const ModelConfig& c) {
  SPPO_CHECK(c.llama() || text == "none", "options")
      << "--rope-scaling applies to Llama-family models (--model llama-tiny, llama-3-8b, ...); --model is GPT";
  if (text == "none") return {};
  if (text.front() == '{') {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const std::exception& e) {
      SPPO_CHECK(false, "options") << "--rope-scaling is not JSON: " << e.what();
    }
    return rope_scaling_from_json(j);
  }
  const std::size_t colon = text.find(':');
  SPPO_CHECK(colon != std::string::npos, "options")
      << "--rope-scaling '" << text << "': use none, TYPE:FACTOR (e.g. linear:4, yarn:8, llama3:8) or a JSON object";
  nlohmann::json j = {{"rope_type", text.substr(0, colon)}};
  try {
    j["factor"] = std::stod(text.substr(colon + 1));
  } catch (const std::exception&) {
    SPPO_CHECK(false, "options") << "--rope-scaling '" << text << "': the factor after ':' must be a number";
  }
  if (j["rope_type"] == "llama3") j["original_max_position_embeddings"] = c.max_positions;
  return rope_scaling_from_json(j);
}

void resolve_step_options(const StepFlags& f, StepOptions& o) {
  o.model = preset(f.model);
  o.model_name = f.model;
  const bool custom = f.vocab || f.hidden || f.layers || f.heads || f.rope_theta != 0 || !f.rope_scaling.empty();
  // A plan names its model and sequence length: they are taken from it unless given.
  std::optional<plan::Plan> from_plan;
  if (!o.plan_path.empty()) from_plan = read_plan_file(o.plan_path);
  if (from_plan && !f.model_option->count() && !custom) {
    o.model = from_plan->model;
    o.model_name = from_plan->model_name;
  }
  // --init names its model: taken unless --model is given, and then it must be the same.
  if (!o.init.empty()) {
    const ModelConfig held = init_model(o.init);
    if (!f.model_option->count()) {
      // (A resumed run gives them again, as recorded: the same.)
      SPPO_CHECK((!f.vocab || f.vocab == held.vocab) && (!f.hidden || f.hidden == held.hidden) &&
                     (!f.layers || f.layers == held.layers) && (!f.heads || f.heads == held.heads),
                 "options")
          << "--init " << o.init << " holds a model of vocab " << held.vocab << ", hidden " << held.hidden << ", "
          << held.layers << " layers and " << held.heads << " heads; drop --vocab, --hidden, --layers and --heads";
      o.model = held;
      o.model_name = o.model_preset = "init";
    } else {
      ModelConfig asked = o.model;
      if (f.vocab) asked.vocab = f.vocab;
      if (f.hidden) asked.hidden = f.hidden;
      if (f.layers) asked.layers = f.layers;
      if (f.heads) asked.heads = f.heads;
      SPPO_CHECK(to_json(asked) == to_json(held), "options")
          << "--init " << o.init << " holds the model " << to_json(held).dump() << ", but --model " << f.model
          << " is " << to_json(asked).dump() << "; drop --model to train the model --init holds";
    }
  }
  auto positive = [](int v, const char* name) {
    SPPO_CHECK(v > 0, "options") << name << " must be a positive integer (got " << v << ")";
    return v;
  };
  // CLI11 leaves 0 when not given; an explicit 0 or negative is refused below.
  if (f.vocab) o.model.vocab = positive(f.vocab, "--vocab");
  if (f.hidden) o.model.hidden = positive(f.hidden, "--hidden");
  if (f.layers) o.model.layers = positive(f.layers, "--layers");
  if (f.heads) o.model.heads = positive(f.heads, "--heads");
  if (f.rope_theta != 0) {
    SPPO_CHECK(std::isfinite(f.rope_theta) && f.rope_theta > 0, "options")
        << "--rope-theta must be positive (got " << f.rope_theta << ")";
    o.model.rope_theta = float(f.rope_theta);
  }
  if (!f.rope_scaling.empty()) o.model.rope_scaling = parse_rope_scaling(f.rope_scaling, o.model);
  parse_attention(f.attention, o);
  SPPO_CHECK(o.objective == "lm" || o.objective == "mlm", "options")
      << "--objective '" << o.objective << "' is unknown; use lm (next token) or mlm (masked tokens)";
  SPPO_CHECK(o.model.causal == (o.objective == "lm"), "options")
      << (o.model.causal ? "--objective mlm trains a bidirectional model; add --attention bidirectional"
                         : "--attention bidirectional sees the next token, so it trains with --objective mlm");
  const bool from_init = !o.init.empty() && !f.model_option->count();
  if (!from_init) o.model_preset = f.model;
  if (custom && !from_init && to_json(o.model) != to_json(preset(f.model))) o.model_name = f.model + " (custom)";
  o.seq_len = from_plan && !f.seq_len_option->count() ? from_plan->seq_len : parse_count(f.seq_len, "--seq-len");
  if (!f.device_memory.empty()) o.device_memory = parse_bytes(f.device_memory, "--device-memory");
  if (!f.host_memory.empty()) o.host_memory = parse_bytes(f.host_memory, "--host-memory");
  SPPO_CHECK(f.mlp_tile_rows >= 0, "options")
      << "--mlp-tile-rows must be 0 (off) or a positive number of rows (got " << f.mlp_tile_rows << ")";
  o.mlp_tile_rows = from_plan && !f.mlp_tile_rows_option->count() ? from_plan->mlp_tile_rows : f.mlp_tile_rows;
  o.model.validate();
}

// `bench layer --breakdown`: where the extra, kernel-by-kernel timed step's time went.
void print_layer_breakdown(const nlohmann::json& j) {
  if (!j.contains("breakdown")) return;
  const auto& b = j["breakdown"];
  const double s = b["step_s"].get<double>();
  auto part = [&](const char* key) { return 100.0 * b[key].get<double>() / s; };
  std::printf("timed step %.3f s: attention forward %.0f%%, attention backward %.0f%%, GEMMs %.0f%%, "
              "other kernels %.0f%%, between kernels %.0f%%\n",
              s, part("attention_forward_s"), part("attention_backward_s"), part("gemm_s"), part("other_s"),
              part("between_s"));
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

// The command line as {"--option": "value"} (flags: true; positionals by index), for the
// check that every rank of a job was started with the same options.
nlohmann::json options_of(int argc, char** argv) {
  nlohmann::json j = nlohmann::json::object();
  for (int k = 1; k < argc; ++k) {
    const std::string a = argv[k];
    if (a.rfind("--", 0) == 0) {
      const auto eq = a.find('=');
      if (eq != std::string::npos) j[a.substr(0, eq)] = a.substr(eq + 1);
      else if (k + 1 < argc && std::string(argv[k + 1]).rfind("--", 0) != 0) j[a] = argv[++k];
      else j[a] = true;
    } else {
      j["argument " + std::to_string(k)] = a;
    }
  }
  return j;
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
  cmd_train->add_option("--optimizer-state", train.step.optimizer_state,
                        "Where the fp32 master weights and AdamW m, v live and update: device (default; a --plan's "
                        "choice when it has one), or host (the gradients go to host memory each step, the CPU "
                        "updates the state there, and the weights come back while the next step starts)");
  cmd_train->add_option("--metrics", train.metrics_path, "Write one JSON object per step to this .jsonl file");
  cmd_train->add_option("--save", train.save_dir, "Checkpoint directory (written atomically)");
  cmd_train->add_option("--save-every", train.save_every, "Also checkpoint every K steps");
  cmd_train->add_option("--resume", train.resume_dir, "Continue from this checkpoint directory");
  cmd_train->add_option("--stop-after", train.stop_after,
                        "End after step K (checkpointed when --save is given); --resume continues");
  cmd_train->add_option("--trace", train.trace_path, "Chrome trace JSON of the last step (Perfetto)");
  cmd_train->add_option("--svg", train.svg_path, "SVG timeline of the last step (compute, copies, memory)");
  cmd_train->add_flag("--quiet", train.quiet, "No progress output");
  cmd_train->add_option("--max-bad-steps", train.max_bad_steps,
                        "Skip a step whose loss or gradient is not finite; stop after this many in a row")
      ->capture_default_str();

  // grads
  StepOptions grads;
  StepFlags grads_flags;
  std::string grads_out;
  auto* cmd_grads = app.add_subcommand("grads", "Run one forward/backward and export weights, gradients and loss");
  add_step_options(cmd_grads, grads_flags, grads);
  cmd_grads->add_option("--out", grads_out, "Output directory")->required();

  // bench
  auto* cmd_bench = app.add_subcommand("bench", "Benchmarks that print a table, or JSON with --json");
  cmd_bench->require_subcommand(1);
  int bl_hidden = 1024, bl_heads = 16, bl_reps = 3, bl_threads = 0;
  std::string bl_seq = "8192";
  bool bl_json = false, bl_breakdown = false;
  auto* cmd_bench_layer = cmd_bench->add_subcommand("layer", "One block's forward+backward vs this machine's FMA peak and SGEMM rate");
  cmd_bench_layer->add_option("--hidden", bl_hidden, "Hidden size")->capture_default_str();
  cmd_bench_layer->add_option("--heads", bl_heads, "Heads")->capture_default_str();
  cmd_bench_layer->add_option("--seq-len", bl_seq, "Tokens")->capture_default_str();
  cmd_bench_layer->add_option("--reps", bl_reps, "Timed repetitions (median)")->capture_default_str();
  cmd_bench_layer->add_option("--threads", bl_threads, "Compute threads (0: all cores)");
  cmd_bench_layer->add_flag("--json", bl_json, "Print one JSON object");
  cmd_bench_layer->add_flag("--breakdown", bl_breakdown,
                            "One more step with each kernel timed: attention forward/backward, GEMMs, other");
  std::string bl_backend = "cpu", bl_precision, bl_attention = "auto";
  cmd_bench_layer->add_option("--backend", bl_backend, "cpu, cuda or auto")->capture_default_str();
  cmd_bench_layer->add_option("--precision", bl_precision, "fp32 or bf16 (default: the backend's)");
  cmd_bench_layer->add_option("--attention", bl_attention, kAttentionKernelsHelp)->capture_default_str();

  // bench attention: the GPU's shapes by default (a CPU's are 16 times shorter, 4 heads).
  std::string ba_backend = "auto", ba_precision, ba_seq, ba_queries, ba_prefix, ba_attention = "auto";
  int ba_heads = 0, ba_head_dim = 0, ba_reps = 3;
  i64 ba_chunk = kKvChunkMinRows;
  bool ba_json = false;
  auto* cmd_bench_attention = cmd_bench->add_subcommand(
      "attention", "Causal attention forward+backward: a whole sequence, and a subsequence after a prefix");
  cmd_bench_attention->add_option("--backend", ba_backend, "cpu, cuda or auto")->capture_default_str();
  cmd_bench_attention->add_option("--precision", ba_precision, "fp32 or bf16 (default: the backend's)");
  cmd_bench_attention->add_option("--seq-len", ba_seq, "Whole-sequence length (default 32K; 2K on the CPU)");
  cmd_bench_attention->add_option("--queries", ba_queries, "Subsequence queries (default 16K; 1K on the CPU)");
  cmd_bench_attention->add_option("--prefix", ba_prefix, "Tokens before the subsequence (default 112K; 7K on the CPU)");
  cmd_bench_attention->add_option("--heads", ba_heads, "Heads (default 32; 4 on the CPU)");
  cmd_bench_attention->add_option("--head-dim", ba_head_dim, "Head size (default 128)");
  cmd_bench_attention->add_option("--chunk", ba_chunk,
                                  "Rows of each streamed K/V chunk of the prefix in the _chunked shape (the runtime's "
                                  "smallest, for host K/V)")
      ->capture_default_str();
  cmd_bench_attention->add_option("--attention", ba_attention, kAttentionKernelsHelp)->capture_default_str();
  cmd_bench_attention->add_option("--reps", ba_reps, "Timed repetitions (median)")->capture_default_str();
  cmd_bench_attention->add_flag("--json", ba_json, "Print one JSON object");



  cli::add_plan_commands(app);

  // bench memory / bench offload
  std::string bm_model = "bench-memory", bm_budget = "", bo_model = "bench-memory", bo_seq = "8192",
              bo_budget = "", bm_hardware, bo_hardware;
  int bo_subseqs = 8, bm_reps = 1, bo_reps = 2, bm_layers = 0;
  std::string bm_host_budget;
  bool bm_json = false, bo_json = false;
  std::string bm_backend = "cpu", bo_backend = "cpu", bm_precision, bo_precision, bm_at, bm_attention = "auto",
              bo_attention = "auto";
  auto* cmd_bench_memory = cmd_bench->add_subcommand("memory", "Longest sequence per mode under a device budget");
  cmd_bench_memory->add_option("--model", bm_model, "Model preset")->capture_default_str();
  cmd_bench_memory->add_option("--device-memory", bm_budget,
                               "Device budget (default 64MiB on the CPU; elsewhere the device less 4 GiB)");
  cmd_bench_memory->add_option("--host-memory", bm_host_budget,
                               "Host budget of every mode (offloaded activations, host K/V; default 16x the "
                               "device budget)");
  cmd_bench_memory->add_option("--layers", bm_layers, "Layers (default: the preset's)");
  cmd_bench_memory->add_option("--at-seq-len", bm_at, "SPPO alone: its longest sequence, and its step time here");
  cmd_bench_memory->add_option("--backend", bm_backend, "cpu, cuda or auto")->capture_default_str();
  cmd_bench_memory->add_option("--precision", bm_precision, "fp32 or bf16 (default: the backend's)");
  cmd_bench_memory->add_option("--attention", bm_attention, kAttentionKernelsHelp)->capture_default_str();
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
  cmd_bench_offload->add_option("--backend", bo_backend, "cpu, cuda or auto")->capture_default_str();
  cmd_bench_offload->add_option("--precision", bo_precision, "fp32 or bf16 (default: the backend's)");
  cmd_bench_offload->add_option("--attention", bo_attention, kAttentionKernelsHelp)->capture_default_str();
  cmd_bench_offload->add_flag("--json", bo_json, "Print one JSON object");

  BenchPipelineOptions bp;
  bool bp_json = false;
  auto* cmd_bench_pipeline = cmd_bench->add_subcommand(
      "pipeline", "Sequence pipeline and data parallel on 2 ranks: bubble and step time, measured vs simulated");
  cmd_bench_pipeline->add_option("--model", bp.model, "Model preset")->capture_default_str();
  cmd_bench_pipeline->add_option("--seq-len", bp.seq_len, "Tokens per sequence")->capture_default_str();
  cmd_bench_pipeline->add_option("--reps", bp.reps, "Timed steps per configuration")->capture_default_str();
  cmd_bench_pipeline->add_option("--hardware", bp.hardware, "Profile to simulate with (default: measured now)");
  cmd_bench_pipeline->add_flag("--json", bp_json, "Print one JSON object");

  BenchPipelineOptions bsp;
  bsp.seq_len = "1024";
  bool bsp_json = false;
  auto* cmd_bench_sp = cmd_bench->add_subcommand(
      "sp", "Sequence parallelism on 2 ranks vs one (ring attention, TP with sequence-parallel regions) and MSP on vs off: step time, balance, memory, vs simulated");
  cmd_bench_sp->add_option("--model", bsp.model, "Model preset")->capture_default_str();
  cmd_bench_sp->add_option("--seq-len", bsp.seq_len, "Tokens per sequence (the last row runs twice as many)")
      ->capture_default_str();
  cmd_bench_sp->add_option("--reps", bsp.reps, "Timed steps per configuration")->capture_default_str();
  cmd_bench_sp->add_option("--hardware", bsp.hardware, "Profile to simulate with (default: measured now)");
  cmd_bench_sp->add_flag("--json", bsp_json, "Print one JSON object");

  BenchModelOptions bs;
  bs.reps = 5;
  bool bs_json = false;
  auto* cmd_bench_sim = cmd_bench->add_subcommand(
      "sim", "Simulated vs measured step time and peak for several configurations (on a GPU: three of gpt-7b's shape)");
  cmd_bench_sim->add_option("--hardware", bs.hardware, "Profile to simulate with (default: measured now)");
  cmd_bench_sim->add_option("--reps", bs.reps, "Timed steps per configuration")->capture_default_str();
  cmd_bench_sim->add_option("--backend", bs.backend, "cpu, cuda or auto")->capture_default_str();
  cmd_bench_sim->add_option("--precision", bs.precision, "fp32 or bf16 (default: the backend's)");
  cmd_bench_sim->add_option("--attention", bs.attention, kAttentionKernelsHelp)->capture_default_str();
  cmd_bench_sim->add_flag("--json", bs_json, "Print one JSON object");

  // profile
  std::string profile_out = "profiles/cpu-local.json";
  bool profile_quick = false;
  auto* cmd_profile = app.add_subcommand("profile", "Measure this machine (GEMM, attention, copies) as a hardware profile");
  cmd_profile->add_option("--out", profile_out, "Where to write the profile JSON")->capture_default_str();
  cmd_profile->add_flag("--quick", profile_quick, "Smaller shapes, about a second");
  std::string profile_backend = "cpu", profile_precision;
  cmd_profile->add_option("--backend", profile_backend, "cpu, cuda or auto: the device to measure")->capture_default_str();
  cmd_profile->add_option("--precision", profile_precision, "fp32 or bf16 (default: the backend's)");
  int profile_threads = 0;
  cmd_profile->add_option("--threads", profile_threads,
                          "CPU: compute threads of one device (0: all cores); measure with what each rank of "
                          "`mpirun -np R sppo train --threads T` runs, T")
      ->capture_default_str();

  // plot
  std::string plot_metrics, plot_out, plot_title;
  auto* cmd_plot = app.add_subcommand(
      "plot", "Draw a run's loss curve (whole sequence, near and far positions) from its --metrics file as SVG");
  cmd_plot->add_option("metrics", plot_metrics, "The run's metrics file (train --metrics FILE.jsonl)")->required();
  cmd_plot->add_option("--out", plot_out, "Where to write the SVG")->required();
  cmd_plot->add_option("--title", plot_title, "Heading of the plot (default: the metrics file's name)");

  // import, export: Hugging Face checkpoints in and out (io/hf.h)
  std::string import_dir, import_out;
  auto* cmd_import = app.add_subcommand(
      "import", "Write an sppo checkpoint (the model, no optimizer state) from a Hugging Face model directory");
  cmd_import->add_option("hf_dir", import_dir, "Directory with config.json and model*.safetensors")->required();
  cmd_import->add_option("--out", import_out, "The checkpoint directory to write (train --init reads it)")->required();
  std::string export_ckpt, export_out, export_format = "hf", export_dtype = "checkpoint", export_positions,
                                       export_shard = "5GB";
  auto* cmd_export = app.add_subcommand("export", "Write a checkpoint's model in another format");
  cmd_export->add_option("checkpoint", export_ckpt, "An sppo checkpoint directory (train --save)")->required();
  cmd_export->add_option("--format", export_format, "hf: Hugging Face's config.json and safetensors")
      ->capture_default_str();
  cmd_export->add_option("--out", export_out, "Directory to write")->required();
  cmd_export->add_option("--dtype", export_dtype,
                         "Weights' type: checkpoint (fp32, as the checkpoint holds them), fp32, or bf16")
      ->capture_default_str();
  cmd_export->add_option("--max-positions", export_positions,
                         "max_position_embeddings to write (default: the longest --seq-len the checkpoint was "
                         "trained at, if longer than the model's; kept for dynamic and yarn scaling, which scale "
                         "from it)");
  cmd_export->add_option("--shard-size", export_shard, "Largest safetensors shard, e.g. 5GB")->capture_default_str();

  try {
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return app.exit(e) == 0 ? 0 : 2;
    }
    if (auto rc = cli::plan_command_result()) return *rc;
    if (comm::launched_by_mpi() && (*cmd_train || *cmd_grads)) check_same_options(comm::world(), options_of(argc, argv));
    if (*cmd_train) {
      SPPO_CHECK(train.resume_dir.empty() || train.step.init.empty(), "options")
          << "--init starts a new run at step 0 from a model's weights, --resume continues a run; give one of them";
      // --resume restores every option that changes the numbers and was not given again.
      nlohmann::json recorded;
      std::set<std::string> restored_keys;  // options the checkpoint gave
      if (!train.resume_dir.empty()) {
        std::string from;
        const nlohmann::json state = io::read_checkpoint_state(train.resume_dir, &from);  // types checked
        recorded = state.value("options", nlohmann::json::object());
        std::vector<std::string> args(argv, argv + argc);
        // Without --steps the run continues to the end its schedule was laid out for.
        if (cmd_train->get_option("--steps")->count() == 0 && state.contains("schedule_steps"))
          args.push_back("--steps=" + std::to_string(state["schedule_steps"].get<int>()));
        const nlohmann::json numeric = numeric_options(train);
        for (auto it = recorded.begin(); it != recorded.end(); ++it) {
          // An edited state.json must not redirect outputs or inputs (--save, --resume).
          SPPO_CHECK(numeric.contains(it.key()), "checkpoint")
              << from << "/state.json records the option '" << it.key() << "', which resuming does not "
              << "restore (only the options that change the numbers); remove it from \"options\"";
          const CLI::Option* opt = cmd_train->get_option_no_throw(it.key());
          if (!opt || opt->count() > 0) continue;
          // A run started from --init trains the model its checkpoints hold.
          if (it.key() == "--model" && it.value() == "init") {
            args.push_back("--init=" + train.resume_dir);
            continue;
          }
          if (it.value().is_boolean()) {
            if (it.value().get<bool>()) args.push_back(it.key());
          } else if (!it.value().get<std::string>().empty()) {
            args.push_back(it.key() + "=" + it.value().get<std::string>());
          }
          restored_keys.insert(it.key());
        }
        std::vector<const char*> restored;
        for (const auto& a : args) restored.push_back(a.c_str());
        app.clear();
        app.parse(int(restored.size()), restored.data());
      }
      resolve_step_options(train_flags, train.step);
      apply_finetune_defaults(train, cmd_train->get_option("--lr")->count() > 0,
                              cmd_train->get_option("--warmup")->count() > 0,
                              cmd_train->get_option("--weight-decay")->count() > 0);
      const std::string from_checkpoint = "from the checkpoint";
      if (restored_keys.count("--lr")) train.lr_from = from_checkpoint;
      if (restored_keys.count("--warmup")) train.warmup_from = from_checkpoint;
      if (restored_keys.count("--weight-decay")) train.weight_decay_from = from_checkpoint;
      const std::string differs = first_difference(numeric_options(train), recorded);
      SPPO_CHECK(differs.empty(), "checkpoint")
          << differs << " in " << train.resume_dir << "; drop it to continue the run as it was saved, or start a "
          << "new run without --resume";
      return run_train(train);
    }
    if (*cmd_grads) {
      resolve_step_options(grads_flags, grads);
      return run_grads(grads, grads_out, "");
    }
    if (*cmd_bench_memory || *cmd_bench_offload) {
      const bool mem = bool(*cmd_bench_memory);
      BenchModelOptions b;
      b.model_name = mem ? bm_model : bo_model;
      b.model = preset(b.model_name);
      b.reps = mem ? bm_reps : bo_reps;
      b.hardware = mem ? bm_hardware : bo_hardware;
      b.attention = mem ? bm_attention : bo_attention;
      b.backend = make_backend(mem ? bm_backend : bo_backend, mem ? bm_precision : bo_precision, b.attention)->name();
      b.precision = mem ? bm_precision : bo_precision;
      if (mem && bm_layers) {
        SPPO_CHECK(bm_layers > 0, "options") << "--layers must be a positive integer (got " << bm_layers << ")";
        b.model.layers = bm_layers;
      }
      if (mem && !bm_at.empty()) b.at_seq_len = parse_count(bm_at, "--at-seq-len");
      std::string budget = mem ? (bm_budget.empty() && b.backend == "cpu" ? "64MiB" : bm_budget) : bo_budget;
      if (!budget.empty()) b.budget = parse_bytes(budget, "--device-memory");
      else if (mem) b.budget = i64(make_backend(b.backend)->device_memory()) - (i64{4} << 30);
      if (mem) b.host_budget = bm_host_budget.empty() ? 16 * b.budget : parse_bytes(bm_host_budget, "--host-memory");
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
    if (*cmd_bench_pipeline) {
      if (!comm::launched_by_mpi()) relaunch_under_mpirun(2, argc, argv);
      const auto j = bench_pipeline(bp, comm::world());
      if (comm::world().rank() == 0) {
        if (bp_json) std::printf("%s\n", j.dump(2).c_str());
        else print_bench_pipeline(j);
      }
      return 0;
    }
    if (*cmd_bench_sp) {
      if (!comm::launched_by_mpi()) relaunch_under_mpirun(2, argc, argv);
      const auto j = bench_sp(bsp, comm::world());
      if (comm::world().rank() == 0) {
        if (bsp_json) std::printf("%s\n", j.dump(2).c_str());
        else print_bench_sp(j);
      }
      return 0;
    }
    if (*cmd_bench_sim) {
      const auto j = bench_sim(bs);
      if (bs_json) std::printf("%s\n", j.dump(2).c_str());
      else print_bench_sim(j);
      return 0;
    }
    if (*cmd_profile) {
      // The CPU is measured with its own kernels; other devices through the backend.
      const auto be = make_backend(profile_backend, profile_precision);
      SPPO_CHECK(profile_threads >= 0, "options") << "--threads " << profile_threads << " is negative; use 0 (all cores) or a count";
      SPPO_CHECK(profile_threads == 0 || std::string(be->name()) == "cpu", "options")
          << "--threads is for the cpu backend; the " << be->name() << " backend's device has its own";
      if (profile_threads > 0) omp_set_num_threads(profile_threads);
      nlohmann::json details;
      const auto p = std::string(be->name()) == "cpu" ? measure_cpu_profile(profile_quick)
                                                      : measure_backend_profile(*be, profile_quick, &details);
      if (!details.empty()) std::fprintf(stderr, "also measured: %s\n", details.dump().c_str());
      plan::save_profile(p, profile_out);
      std::printf("%s\n", plan::to_json(p).dump(2).c_str());
      std::fprintf(stderr, "wrote %s; use it with --hardware %s\n", profile_out.c_str(), profile_out.c_str());
      return 0;
    }
    if (*cmd_import) {
      SPPO_CHECK(io::is_hf_dir(import_dir), "hf")
          << import_dir << " is not a Hugging Face model directory (a config.json with \"architectures\")";
      const ModelConfig c = io::hf_read_config(import_dir);
      std::vector<float> params(std::size_t(c.num_params()));
      io::hf_read_weights(import_dir, c, params.data());  // every tensor checked before anything is written
      std::vector<io::CheckpointTensor> weights;
      float* at = params.data();
      for (const TensorSpec& t : parameter_specs(c)) {
        weights.push_back({t.name, t.shape, at});
        at += t.numel();
      }
      const nlohmann::json state = {{"step", 0},
                                    {"config", to_json(c)},
                                    {"data_position", nlohmann::json::object()},
                                    {"imported_from", std::filesystem::absolute(import_dir).string()}};
      io::save_checkpoint(import_out, weights, {}, state);
      std::printf("imported %s: %s, %.3g parameters -> %s\n", import_dir.c_str(), to_json(c).dump().c_str(),
                  double(c.num_params()), import_out.c_str());
      return 0;
    }
    if (*cmd_export) {
      SPPO_CHECK(export_format == "hf", "options") << "--format '" << export_format << "': the formats are: hf";
      SPPO_CHECK(export_dtype == "checkpoint" || export_dtype == "fp32" || export_dtype == "bf16", "options")
          << "--dtype '" << export_dtype << "': use checkpoint, fp32 or bf16";
      std::string from;
      const io::CheckpointState st =
          io::parse_checkpoint_state(io::read_checkpoint_state(export_ckpt, &from), export_ckpt + "/state.json");
      const ModelConfig& c = st.config;
      SPPO_CHECK(c.llama(), "options") << export_ckpt << " holds a GPT model; --format hf writes Llama-family models";
      std::vector<float> params(std::size_t(c.num_params()));
      std::vector<io::CheckpointTensor> weights;
      float* at = params.data();
      for (const TensorSpec& t : parameter_specs(c)) {
        weights.push_back({t.name, t.shape, at});
        at += t.numel();
      }
      io::load_checkpoint_weights(export_ckpt, weights);
      i64 positions = export_positions.empty() ? 0 : parse_count(export_positions, "--max-positions");
      if (export_positions.empty() && st.json.contains("options") && st.json["options"].contains("--seq-len"))
        positions = parse_count(st.json["options"]["--seq-len"].get<std::string>(), "--seq-len");
      io::hf_write(export_out, c, params.data(), export_dtype == "bf16" ? "bfloat16" : "float32", positions,
                   parse_bytes(export_shard, "--shard-size"));
      std::printf("exported %s (step %d) to %s\n", from.c_str(), st.step, export_out.c_str());
      return 0;
    }
    if (*cmd_plot) {
      SPPO_CHECK(std::filesystem::path(plot_out).extension() == ".svg", "plot")
          << "--out " << plot_out << " should name an .svg file; the metrics file is never overwritten";
      const auto curve = io::read_loss_curve(plot_metrics);
      io::write_file_atomic(plot_out, io::svg_loss_curve(curve, plot_title.empty() ? plot_metrics : plot_title));
      std::printf("wrote %s: %zu steps, loss %.4f -> %.4f\n", plot_out.c_str(), curve.size(), curve.front().loss,
                  curve.back().loss);
      return 0;
    }
    if (*cmd_bench_attention) {
      const auto be = make_backend(ba_backend, ba_precision, ba_attention);
      BenchAttentionOptions o = default_attention_shapes(*be);
      o.chunk = ba_chunk;
      if (!ba_seq.empty()) o.seq_len = parse_count(ba_seq, "--seq-len");
      if (!ba_queries.empty()) o.queries = parse_count(ba_queries, "--queries");
      if (!ba_prefix.empty()) o.prefix = parse_count(ba_prefix, "--prefix");
      if (ba_heads) o.heads = ba_heads;
      if (ba_head_dim) o.head_dim = ba_head_dim;
      o.reps = ba_reps;
      const auto j = bench_attention(*be, o);
      if (ba_json) std::printf("%s\n", j.dump(2).c_str());
      else print_bench_attention(j);
      return 0;
    }
    if (*cmd_bench_layer) {
      if (bl_threads > 0) omp_set_num_threads(bl_threads);
      const i64 S = parse_count(bl_seq, "--seq-len");
      const auto j = bench_layer(*make_backend(bl_backend, bl_precision, bl_attention), bl_hidden, bl_heads, S,
                                 bl_reps, bl_breakdown);
      if (bl_json) {
        std::printf("%s\n", j.dump(2).c_str());
      } else {
        print_bench_layer(j);
        print_layer_breakdown(j);
      }
      return 0;
    }
    return 0;
  } catch (const Error& e) {
    // Errors that reach here are the same on every rank (train and grads agree on them
    // first), so one rank reports them. 3: the run does not fit; 2: bad input.
    if (!comm::launched_by_mpi() || comm::world().rank() == 0) std::fprintf(stderr, "sppo: %s\n", e.what());
    return dynamic_cast<const DoesNotFit*>(&e) ? 3 : 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "sppo: [memory] this machine ran out of memory; shorten --seq-len or use a smaller model\n");
    return 3;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sppo: %s\n", e.what());
    return 2;
  }
}
