#include "cli/step_options.h"

#include <CLI/CLI.hpp>
#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "core/check.h"
#include "core/config.h"
#include "planner/plan.h"
#include "train/setup.h"

namespace sppo::cli {

namespace {

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

}  // namespace

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
  cmd->add_option("--heads", f.heads, "Attention heads Z (overrides the preset); the head size A (H / Z, or the model's head_dim) must be even");
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
  cmd->add_option("--device-memory", f.device_memory,
                  "Device memory budget: bytes (e.g. 512MiB, 70GiB) or a share of the device's memory (e.g. 90%) "
                  "(default: on CUDA the GPU's memory less 2 GiB for the CUDA context and libraries, stated in the "
                  "run's header; on the CPU none)");
  cmd->add_option("--host-memory", f.host_memory,
                  "Host memory budget for offloaded activations, e.g. 2GiB (default: unlimited); adaptive "
                  "offload and --subseqs auto choose within it");
  cmd->add_flag("--recompute", o.recompute, "Baseline: full activation recomputation (checkpoint every block)");
  cmd->add_option("--kv-cache", f.kv_cache,
                  "Where finished subsequences' K/V and their dK/dV sums live: device, host (streamed back to "
                  "each later subsequence's attention, a chunk at a time), recompute (no K/V kept: recomputed "
                  "from each layer's input when needed; the sums on the host), or auto (the device unless that "
                  "does not fit the budgets, then the host on the fewest layers that fit, then recompute)")
      ->capture_default_str();
  cmd->add_option("--backward-order", f.backward_order,
                  "The backward's order: subseq (the paper's: the subsequences in reverse, each through every "
                  "layer), layer (the layers from the last, each over every subsequence, so that one layer's "
                  "dK/dV sums live at a time; each pipeline stage's layers, not with --msp on), or auto (the "
                  "plan's under --plan, else "
                  "layer where subseq does not fit the budgets)")
      ->capture_default_str();
  cmd->add_option("--weights", f.weights,
                  "Where the transformer layers' weights and gradients live: device, host (each layer's weights "
                  "come to the device one layer ahead of the forward or backward that runs it and go after, each "
                  "layer's gradient goes to the host after its last backward; the embedding, final norm and LM "
                  "head stay; needs the optimizer state on the host, and runs without --tp, --msp on, --zero 1 "
                  "and --recompute), or auto (the plan's under --plan, else device)")
      ->capture_default_str();
  cmd->add_option("--residual-grads", f.residual_grads,
                  "Where the layer-major backward keeps each subsequence's residual gradient between its layers: "
                  "device ([S, H] of the whole sequence there from the first layer's backward to the last's), or "
                  "host (sent after each layer's backward and brought back for the next: the device holds the "
                  "running subsequence's; with --backward-order layer, which auto becomes)")
      ->capture_default_str();
  cmd->add_option("--rebuild-inputs", f.rebuild_inputs,
                  "Layers whose input x the forward does not keep: none, odd (1, 3, 5, ...), a comma list of "
                  "layers, or auto (the plan's under --plan, else none). Each of their backward's ops first runs the layer below's forward again on its "
                  "subsequence (a layer's forward more per rebuilt layer; the gradients are the same bit for bit). "
                  "A rebuilt layer keeps its K/V (with --kv-cache recompute, on the host); the layer below keeps "
                  "its input and its K/V on the device or recomputed. Needs the layer-major backward "
                  "(--backward-order layer, which auto becomes); with --weights host the layer below's weights "
                  "come with the layer's; no --tp, --cp, --msp on or --recompute")
      ->capture_default_str();
  cmd->add_option("--recompute-tensors", f.recompute_tensors,
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
  cmd->add_option("--pp", o.par.pp, "Pipeline stages (ranks = pp x tp x ulysses x cp x dp; start with mpirun -np)")
      ->capture_default_str();
  cmd->add_option("--tp", o.par.tp,
                  "Tensor parallel with sequence-parallel regions (the SPPO paper's SP, Megatron-LM's): ranks that "
                  "split every layer's heads, MLP and vocabulary, and the LayerNorm regions' tokens")
      ->capture_default_str();
  cmd->add_option("--cp", o.par.cp, "Context parallel: ranks of a ring attention that split every subsequence")
      ->capture_default_str();
  cmd->add_option("--ulysses", o.par.ulysses,
                  "DeepSpeed-Ulysses sequence parallel: ranks that split every subsequence's tokens, an all-to-all "
                  "before each attention giving each rank every token of its share of the heads (and of the K/V "
                  "cache); with --cp, the ring runs across groups of --ulysses ranks (USP)")
      ->capture_default_str();
  cmd->add_option("--ring", f.ring,
                  "Ring attention with --cp: its layout, zigzag (balances causal work) or contiguous, and its "
                  "algorithm, flash (one pass, LSE merge) or rsa (two-pass Ring Self-Attention, bidirectional models); e.g. "
                  "'contiguous' or 'rsa,zigzag'")
      ->capture_default_str();
  cmd->add_option("--msp", f.msp,
                  "Multiplexed sequence partitioning with --pp: on runs each stage's bubble-adjacent subsequences "
                  "split over the stages that would idle (needs --subseqs >= --pp), off does not")
      ->capture_default_str();
  cmd->add_option("--msp-reach", o.par.msp.reach,
                  "With --msp on: how far a split subsequence reaches, over the stage's own group and those within "
                  "reach - 1 stages that idle in its slot (2 or more; 0: the paper's Table 3, every stage group "
                  "before or after its steady phase). A helper holds the weights and gradients of up to reach - 1 "
                  "other stages")
      ->capture_default_str();
  cmd->add_option("--dp", o.par.dp, "Data-parallel replicas, each training its own sequences")->capture_default_str();
  f.zero_option = cmd->add_option("--zero", f.zero, "1: shard the AdamW state over the ranks that hold the same layers (ZeRO-1); 2: the gradients too, each layer's reduce-scattered into its shard as its last backward ends (ZeRO-2); 3: the weights too, each layer's all-gathered one layer ahead of the ops that run it (ZeRO-3)")
      ->capture_default_str();
  cmd->add_option("--batch", o.batch, "Sequences per optimizer step, all replicas together (default: --dp)");
  cmd->add_option("--comm-timeout", o.comm_timeout_s,
                  "Seconds a rank waits for a message before ending the job")->capture_default_str();
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
  if (!f.device_memory.empty() && f.device_memory.back() == '%') {
    const std::string number = f.device_memory.substr(0, f.device_memory.size() - 1);
    char* end = nullptr;
    const double percent = std::strtod(number.c_str(), &end);
    SPPO_CHECK(!number.empty() && *end == 0 && percent > 0 && percent <= 100, "options")
        << "--device-memory " << f.device_memory << ": a share of the device's memory is a percentage above 0 "
        << "and at most 100 (e.g. 90%), or give bytes (e.g. 70GiB)";
    o.device_memory_fraction = percent / 100;
  } else if (!f.device_memory.empty()) {
    o.device_memory = parse_bytes(f.device_memory, "--device-memory");
  }
  if (!f.host_memory.empty()) o.host_memory = parse_bytes(f.host_memory, "--host-memory");
  SPPO_CHECK(f.mlp_tile_rows >= 0, "options")
      << "--mlp-tile-rows must be 0 (off) or a positive number of rows (got " << f.mlp_tile_rows << ")";
  o.mlp_tile_rows = from_plan && !f.mlp_tile_rows_option->count() ? from_plan->place.mlp_tile_rows : f.mlp_tile_rows;
  o.place.kv = parse_kv_cache(f.kv_cache);
  o.place.recompute = parse_recompute_option(f.recompute_tensors);
  o.place.backward = parse_backward_order_option(f.backward_order);
  o.place.optimizer_state = parse_tier_option(f.optimizer_state, "--optimizer-state");
  o.place.weights = parse_tier_option(f.weights, "--weights");
  SPPO_CHECK(f.residual_grads == "device" || f.residual_grads == "host", "options")
      << "--residual-grads '" << f.residual_grads << "' is unknown; use device or host";
  o.place.residual_grads = parse_tier(f.residual_grads, "--residual-grads");
  o.place.rebuild = parse_rebuild_inputs(f.rebuild_inputs);
  parse_ring(f.ring, o.par);
  SPPO_CHECK(f.msp == "on" || f.msp == "off", "options") << "--msp must be on or off (got '" << f.msp << "')";
  o.par.msp.on = f.msp == "on";
  o.par.zero = parse_zero_stage(f.zero, 3, "options", "--zero");
  // A plan's ZeRO stage, unless --zero says otherwise: the run's memory is the plan's.
  if (from_plan && !f.zero_option->count()) o.par.zero = from_plan->par.zero;
  o.model.validate();
}

}  // namespace sppo::cli
