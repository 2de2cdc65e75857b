// Everything that shapes a training run or one exported step, as the CLI fills it.
#pragma once

#include <cstdint>
#include <string>

#include "core/config.h"
#include "core/parallel.h"
#include "core/placement.h"
#include "train/lr_schedule.h"

namespace sppo {

struct StepOptions {
  ModelConfig model;
  std::string model_name = "small";   // preset, or "custom" when sizes were given
  std::string model_preset = "small"; // the preset the sizes started from
  i64 seq_len = 4096;                 // S
  std::uint64_t seed = 1234;
  // --init: the initial weights (and, unless --model says otherwise, the model) from an sppo
  // checkpoint or a Hugging Face model directory; step 0, a fresh optimizer.
  std::string init;
  std::string data;                   // "" = the built-in repeat task
  std::int64_t doc_sep = -1;          // --doc-sep: the token that ends each document (-1: none)
  bool pack = false;                  // --pack: documents packed, attention and positions kept apart
  std::string data_dtype;             // "u16" / "u32" for raw token files with other names
  std::string labels;                 // --labels: one label per token of --data (io::open_labels)
  int threads = 0;                    // 0 = OpenMP default
  // SPPO on one process
  std::string objective = "lm";       // lm (next token) | mlm (masked tokens; bidirectional models)
  std::string subseqs = "1";          // N, or "auto"
  std::string partition = "length";   // length | flops | adaptive
  std::string offload = "none";       // none | full | adaptive | <ratio in [0, 1]>
  // --device-memory: bytes, or a share of the device's memory (device_memory_fraction, from
  // "90%"); neither: the backend's capacity (CUDA: the GPU less its context's reserve), on the
  // CPU no budget (resolve_device_budget in train/setup.h).
  i64 device_memory = 0;
  double device_memory_fraction = 0;
  i64 host_memory = 0;                // bytes of the host tier (offloaded activations, host K/V, optimizer state); 0 = unlimited
  bool recompute = false;             // full activation recomputation baseline
  // Where the step places what it saves and holds (core/placement.h), as --kv-cache,
  // --recompute-tensors, --backward-order, --optimizer-state, --weights, --residual-grads
  // and --rebuild-inputs give them; auto: the plan's under --plan, else what fits the
  // budgets (K/V, recomputed tensors, the backward's order) or the device (the optimizer
  // state, the weights), as each option's help says.
  PlacementRequest place;
  i64 mlp_tile_rows = 0;              // rows of the MLP's tiles (Note [MLP tiles] in core/layout.h); 0: off
  std::string hardware;               // profile used by adaptive choices ("" = measured here)
  std::string backend = "auto";       // cpu | cuda | auto (cuda when a GPU is visible)
  std::string precision;              // fp32 | bf16 ("": the backend's default)
  std::string attention_kernels = "auto";  // --attention's kernels: auto | own | cudnn
  std::string plan_path;              // --plan PLAN.json: layout, lengths and alpha from a plan
  // Several processes (mpirun -np of par.ranks(); Note [Rank layout] in core/parallel.h): --tp,
  // --cp, --pp, --dp, --zero, --msp, --msp-reach and --ring; under --plan the plan's, where
  // these are left at their defaults.
  ParallelDims par;
  int batch = 0;                      // sequences per optimizer step, all replicas (0: dp)
  double comm_timeout_s = 20;         // a wait for a message longer than this ends the job
  std::string comm = "auto";          // --comm: auto | nccl | mpi (train/setup.cpp Note [Ranks and GPUs])
  int device = -1;                    // --device: the GPU this process drives (-1: by its local rank)
  // train --plan P --dry-run: every check a run makes before its first step, on the plan's
  // backend, precision, hardware profile and ranks whatever this build and machine are;
  // nothing is allocated and no step runs (make_setup leaves the backend and runtime null).
  bool dry_run = false;
  // `sppo eval`: forward-only steps (Note [Forward-only steps] in schedule/builders.cpp) on a
  // runtime that holds the weights alone; nothing is offloaded, nothing recomputed, and
  // under a budget --subseqs auto is the fewest subsequences whose step fits.
  bool forward_only = false;
};

// Note [Continuing a trained model]: `train --init` starts from weights a model was trained
// to, which the from-scratch defaults (a peak learning rate of 5e-3, weight decay 0.1) would
// wreck. Unless given, such a run takes a fine-tuning learning rate of 2e-5 (where the
// published long-context and instruction fine-tunes of Llama and Qwen models sit), warm-up
// over 3% of the steps (at least 1) and no weight decay; the cosine decay to a tenth stays.
// The run states each value and where it came from (apply_finetune_defaults).
inline constexpr float kFinetuneLr = 2e-5f;
inline constexpr double kFinetuneWarmupFraction = 0.03;
inline constexpr float kFinetuneWeightDecay = 0.0f;

struct TrainOptions {
  StepOptions step;
  int steps = 200;
  // The learning rate (Note [Learning-rate schedules] in train/lr_schedule.h): lr is the
  // peak; min_lr below 0 is a tenth of it; decay_steps 0 is a tenth of the steps (wsd).
  float lr = 5e-3f;
  int warmup = 20;
  LrShape lr_shape = LrShape::Cosine;
  float min_lr = -1;
  int decay_steps = 0;
  LrSchedule lr_schedule() const { return {lr_shape, lr, warmup, min_lr, decay_steps}; }
  float weight_decay = 0.1f;
  // Where lr, warmup and weight_decay came from, as the start-up line states it: the option
  // ("--lr"), or the default that set it.
  std::string lr_from = "default", warmup_from = "default", weight_decay_from = "default";
  float beta1 = 0.9f, beta2 = 0.95f, adam_eps = 1e-8f;
  float clip = 1.0f;                  // global gradient-norm clip; 0 = off
  std::string save_dir;
  int save_every = 0;
  std::string resume_dir;
  int stop_after = 0;                 // end this process after step K (0: run to --steps),
                                      // e.g. to fit a job's time slot; resume continues it
  // Held-out loss (train/eval.h): every eval_every steps (0: at the last step only) and at
  // the last, the mean loss over the first eval_seqs sequences of eval_data (with
  // eval_labels), through the step's forward alone; empty eval_data: none.
  std::string eval_data, eval_labels;
  int eval_every = 0;
  int eval_seqs = 2;
  std::string metrics_path;
  std::string tensorboard_dir;        // TensorBoard event files of the metrics (io/tensorboard.h)
  std::string trace_path;             // Chrome trace JSON of the last step
  std::string svg_path;               // SVG timeline of the last step
  // The run's options as TOML (cli/config_file.h), written as config.toml into each
  // checkpoint and beside the metrics; empty: none.
  std::string config_toml;
  bool quiet = false;
  int max_bad_steps = 3;              // stop after this many non-finite steps in a row
};

}  // namespace sppo
