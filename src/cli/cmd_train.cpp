// `sppo train` and `sppo grads`: a training run, and one step's gradients exported.
#include <CLI/CLI.hpp>
#include <charconv>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/config_file.h"
#include "cli/step_options.h"
#include "comm/comm.h"
#include "core/check.h"
#include "io/checkpoint.h"
#include "train/parallel.h"
#include "train/trainer.h"

namespace sppo::cli {

namespace {

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

// Ranks of one job must agree on every option before any work.
void check_ranks_agree(const Invocation& inv) {
  if (comm::launched_by_mpi()) check_same_options(comm::world(), options_of(inv.argc, inv.argv));
}

struct Train {
  TrainOptions options;
  StepFlags flags;
  std::string config;  // --config
  std::string lr_schedule = "cosine";  // --lr-schedule
  CLI::App* cmd = nullptr;
};

std::string float_text(float v) {
  char buf[32];
  return std::string(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
}

// The run's options as config.toml: those given, and the optimizer's as resolved (Note
// [Continuing a trained model]); a resumed run keeps its checkpoint's.
std::string run_config(const Train& t) {
  const TrainOptions& o = t.options;
  if (!o.resume_dir.empty()) return io::read_checkpoint_config(o.resume_dir);
  return config_toml(t.cmd, {"resume", "stop-after"},
                     {{"lr", float_text(o.lr)}, {"warmup", std::to_string(o.warmup)},
                      {"weight-decay", float_text(o.weight_decay)}},
                     "sppo train: the options of this run; `sppo train --config FILE` repeats it");
}

// --resume restores every option that changes the numbers and was not given again: the
// command line is parsed again with the checkpoint's values added. Returns the options the
// checkpoint recorded and fills `restored` with those it gave.
nlohmann::json restore_recorded_options(Train& t, const Invocation& inv, std::set<std::string>& restored) {
  TrainOptions& train = t.options;
  if (train.resume_dir.empty()) return nlohmann::json::object();
  std::string from;
  const nlohmann::json state = io::read_checkpoint_state(train.resume_dir, &from);  // types checked
  const nlohmann::json recorded = state.value("options", nlohmann::json::object());
  std::vector<std::string> args(inv.argv, inv.argv + inv.argc);
  // Without --steps the run continues to the end its schedule was laid out for.
  if (t.cmd->get_option("--steps")->count() == 0 && state.contains("schedule_steps"))
    args.push_back("--steps=" + std::to_string(state["schedule_steps"].get<int>()));
  const nlohmann::json numeric = numeric_options(train);
  for (auto it = recorded.begin(); it != recorded.end(); ++it) {
    // An edited state.json must not redirect outputs or inputs (--save, --resume).
    SPPO_CHECK(numeric.contains(it.key()), "checkpoint")
        << from << "/state.json records the option '" << it.key() << "', which resuming does not "
        << "restore (only the options that change the numbers); remove it from \"options\"";
    const CLI::Option* opt = t.cmd->get_option_no_throw(it.key());
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
    restored.insert(it.key());
  }
  std::vector<const char*> again;
  for (const auto& a : args) again.push_back(a.c_str());
  inv.app.clear();
  inv.app.parse(int(again.size()), again.data());
  apply_config_file(t.cmd, t.config);
  return recorded;
}

int run_train_command(Train& t, const Invocation& inv) {
  check_ranks_agree(inv);
  TrainOptions& train = t.options;
  SPPO_CHECK(train.resume_dir.empty() || train.step.init.empty(), "options")
      << "--init starts a new run at step 0 from a model's weights, --resume continues a run; give one of them";
  apply_config_file(t.cmd, t.config);
  std::set<std::string> restored;
  const nlohmann::json recorded = restore_recorded_options(t, inv, restored);
  resolve_step_options(t.flags, train.step);
  train.lr_shape = parse_lr_shape(t.lr_schedule);
  auto given = [&](const char* name) { return t.cmd->get_option(name)->count() > 0; };
  apply_finetune_defaults(train, given("--lr"), given("--warmup"), given("--weight-decay"));
  const std::string from_checkpoint = "from the checkpoint";
  if (restored.count("--lr")) train.lr_from = from_checkpoint;
  if (restored.count("--warmup")) train.warmup_from = from_checkpoint;
  if (restored.count("--weight-decay")) train.weight_decay_from = from_checkpoint;
  const std::string differs = first_difference(numeric_options(train), recorded);
  SPPO_CHECK(differs.empty(), "checkpoint")
      << differs << " in " << train.resume_dir << "; drop it to continue the run as it was saved, or start a "
      << "new run without --resume";
  train.config_toml = run_config(t);
  return run_train(train);
}

void add_train(CLI::App& app, Commands& out) {
  auto t = std::make_shared<Train>();
  TrainOptions& o = t->options;
  CLI::App* cmd = t->cmd = app.add_subcommand("train", "Train a model on long sequences");
  add_config_option(cmd, t->config);
  add_step_options(cmd, t->flags, o.step);
  cmd->add_option("--steps", o.steps, "Optimizer steps")->capture_default_str();
  cmd->add_option("--lr", o.lr,
                  "Peak learning rate (warm-up, then --lr-schedule; with --init the default is 2e-5)")
      ->capture_default_str();
  cmd->add_option("--warmup", o.warmup, "Warm-up steps (with --init the default is 3% of --steps)")
      ->capture_default_str();
  cmd->add_option("--lr-schedule", t->lr_schedule,
                  "After the warm-up: cosine (half a cosine down to --min-lr at the last step), linear (a straight "
                  "line down to it), constant, or wsd (stable, then a straight line down over the last "
                  "--decay-steps)")
      ->capture_default_str();
  cmd->add_option("--min-lr", o.min_lr, "The learning rate the schedule decays to (default: a tenth of --lr)")
      ->check([](const std::string& v) {
        char* end = nullptr;
        const double x = std::strtod(v.c_str(), &end);
        return end != v.c_str() && *end == '\0' && x >= 0 ? std::string()
                                                           : v + " is not a learning rate of 0 or more";
      });
  cmd->add_option("--decay-steps", o.decay_steps,
                  "With --lr-schedule wsd: the steps of its decay at the end (default: a tenth of --steps)");
  cmd->add_option("--weight-decay", o.weight_decay, "AdamW weight decay of matrices (with --init the default is 0)")
      ->capture_default_str();
  cmd->add_option("--clip", o.clip, "Gradient-norm clip (0: off)")->capture_default_str();
  cmd->add_option("--optimizer-state", t->flags.optimizer_state,
                  "Where the fp32 master weights and AdamW m, v live and update: device, host (the gradients go "
                  "to host memory each step, the CPU updates the state there, and the weights come back while "
                  "the next step starts), or auto (a --plan's choice when it has one, else device)")
      ->capture_default_str();
  cmd->add_flag("--dry-run", o.step.dry_run,
                "With --plan: check the plan as its run would before its first step (the options, the schedule, "
                "each rank's predicted peaks against the plan's budgets) on the plan's backend, precision, hardware "
                "profile and ranks whatever this machine is, allocating nothing; prints each rank's peaks and one "
                "JSON object, exit 0 when every rank fits, 3 when one does not");
  cmd->add_option("--eval-data", o.eval_data,
                  "Held-out data (the formats --data takes): its loss, through the step's forward alone, goes to "
                  "the metrics as eval_loss (with eval_loss_first_half, eval_loss_second_half) every --eval-every "
                  "steps and at the last");
  cmd->add_option("--eval-labels", o.eval_labels, "Labels of --eval-data, one per token (as --labels)");
  cmd->add_option("--eval-every", o.eval_every, "Steps between held-out losses (0: at the last step only)")
      ->capture_default_str();
  cmd->add_option("--eval-seqs", o.eval_seqs, "Held-out sequences each held-out loss averages over (the first ones)")
      ->capture_default_str();
  cmd->add_option("--metrics", o.metrics_path, "Write one JSON object per step to this .jsonl file");
  cmd->add_option("--tensorboard", o.tensorboard_dir,
                  "Also write each step's figures (loss, lr, grad_norm, tokens_per_s, peak_device_bytes, ...: the "
                  "--metrics names) as TensorBoard event files into this directory");
  cmd->add_option("--save", o.save_dir, "Checkpoint directory (written atomically)");
  cmd->add_option("--save-every", o.save_every, "Also checkpoint every K steps");
  cmd->add_option("--resume", o.resume_dir, "Continue from this checkpoint directory");
  cmd->add_option("--stop-after", o.stop_after, "End after step K (checkpointed when --save is given); --resume continues");
  cmd->add_option("--trace", o.trace_path, "Chrome trace JSON of the last step (Perfetto)");
  cmd->add_option("--svg", o.svg_path, "SVG timeline of the last step (compute, copies, memory)");
  cmd->add_flag("--quiet", o.quiet, "No progress output");
  cmd->add_option("--max-bad-steps", o.max_bad_steps,
                  "Skip a step whose loss or gradient is not finite; stop after this many in a row")
      ->capture_default_str();
  out.push_back({cmd, [t](const Invocation& inv) { return run_train_command(*t, inv); }});
}

void add_grads(CLI::App& app, Commands& out) {
  struct Grads {
    StepOptions options;
    StepFlags flags;
    std::string out, config;
  };
  auto g = std::make_shared<Grads>();
  CLI::App* cmd = app.add_subcommand("grads", "Run one forward/backward and export weights, gradients and loss");
  add_config_option(cmd, g->config);
  add_step_options(cmd, g->flags, g->options);
  cmd->add_option("--out", g->out, "Output directory (required)");
  out.push_back({cmd, [g, cmd](const Invocation& inv) {
                   check_ranks_agree(inv);
                   apply_config_file(cmd, g->config);
                   SPPO_CHECK(!g->out.empty(), "options") << "sppo grads needs --out DIR, where it writes the "
                                                             "weights, gradients and loss";
                   resolve_step_options(g->flags, g->options);
                   // One step takes no update: with the layers' weights on the host the
                   // optimizer's state (their master) is there too.
                   if (g->options.place.weights == Tier::Host) g->options.place.optimizer_state = Tier::Host;
                   return run_grads(g->options, g->out, "");
                 }});
}

}  // namespace

void add_train_commands(CLI::App& app, Commands& out) {
  add_train(app, out);
  add_grads(app, out);
}

}  // namespace sppo::cli
