#include "train/trainer.h"

#include <omp.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <unistd.h>

#include "comm/launcher.h"
#include "core/check.h"
#include "core/timing.h"
#include "io/checkpoint.h"
#include "io/metrics.h"
#include "io/tensorboard.h"
#include "io/safetensors.h"
#include "runtime/fault.h"
#include "schedule/builders.h"
#include "sim/simulator.h"
#include "train/parallel.h"
#include "train/eval.h"
#include "train/setup.h"

namespace sppo {

// Threads per rank: as asked, else the cores shared by the ranks on this machine.
void apply_threads(int threads, const comm::Comm& world) {
  if (threads > 0) {
    omp_set_num_threads(threads);
  } else if (world.size() > 1) {
    const int local = comm::launcher_local_size();
    const int ranks_here = local > 0 ? local : world.size();
    omp_set_num_threads(std::max(1, int(std::thread::hardware_concurrency()) / ranks_here));
  }
}

void write_json_file(const std::string& path, const nlohmann::json& j) {
  std::ofstream f(path);
  SPPO_CHECK(f.good(), "io") << "cannot write " << path;
  f << j.dump(2) << "\n";
  SPPO_CHECK(f.good(), "io") << "error writing " << path;
}

// A directory the run writes: a checkpoint (replaced atomically) or an export.
void check_output_dir(const std::string& path, const char* option, bool checkpoint) {
  namespace fs = std::filesystem;
  if (path.empty()) return;
  std::error_code ec;
  const fs::path p(path);
  if (fs::exists(p, ec)) {
    SPPO_CHECK(fs::is_directory(p, ec), "options") << option << " " << path << " is a file, not a directory";
    SPPO_CHECK(!checkpoint || fs::is_empty(p, ec) || io::checkpoint_exists(path), "options")
        << option << " " << path << " holds files that are not a checkpoint; saving would not replace them: "
        << "give a new directory";
  }
  // A checkpoint is written beside its directory and renamed into place, so its parent
  // must exist; an export's missing parents are made, under the nearest that exists.
  fs::path parent = p.has_parent_path() ? p.parent_path() : fs::path(".");
  if (!checkpoint)
    while (!fs::exists(parent, ec) && parent.has_parent_path() && parent != parent.parent_path())
      parent = parent.parent_path();
  SPPO_CHECK(fs::is_directory(parent, ec), "options")
      << option << " " << path << ": the directory " << parent.string() << " does not exist; create it first";
  SPPO_CHECK(::access(parent.c_str(), W_OK) == 0, "options") << option << " " << path << ": "
                                                              << parent.string() << " is not writable";
}

namespace {

std::string fmt_duration(double s) {
  char buf[32];
  const long t = long(s + 0.5);
  if (t >= 3600) std::snprintf(buf, sizeof buf, "%ldh%02ldm", t / 3600, (t / 60) % 60);
  else if (t >= 60) std::snprintf(buf, sizeof buf, "%ldm%02lds", t / 60, t % 60);
  else std::snprintf(buf, sizeof buf, "%.1fs", s);
  return buf;
}

std::string fmt_rate(double r) {
  char buf[32];
  if (r >= 1e6) std::snprintf(buf, sizeof buf, "%.2fM", r / 1e6);
  else if (r >= 1e3) std::snprintf(buf, sizeof buf, "%.1fk", r / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f", r);
  return buf;
}

void check_train_options(const TrainOptions& o) {
  SPPO_CHECK(o.steps >= 1, "options") << "--steps must be at least 1 (got " << o.steps << ")";
  SPPO_CHECK(o.lr > 0 && std::isfinite(o.lr), "options") << "--lr must be positive (got " << o.lr << ")";
  SPPO_CHECK(o.warmup >= 0, "options") << "--warmup must be 0 or more steps (got " << o.warmup << ")";
  check_lr_schedule(o.lr_schedule(), o.steps);
  SPPO_CHECK(o.weight_decay >= 0, "options") << "--weight-decay must be 0 or more (got " << o.weight_decay << ")";
  SPPO_CHECK(o.clip >= 0, "options") << "--clip must be 0 (off) or positive (got " << o.clip << ")";
  SPPO_CHECK(o.save_every >= 0, "options") << "--save-every must be 0 (off) or positive (got " << o.save_every << ")";
  SPPO_CHECK(o.stop_after >= 0, "options") << "--stop-after must be 0 (off) or positive (got " << o.stop_after << ")";
  SPPO_CHECK(o.max_bad_steps >= 1, "options") << "--max-bad-steps must be at least 1 (got " << o.max_bad_steps << ")";
  SPPO_CHECK(o.step.threads >= 0, "options") << "--threads must be 0 (all cores) or positive (got " << o.step.threads
                                             << ")";
  SPPO_CHECK(o.step.comm_timeout_s > 0, "options") << "--comm-timeout must be positive";
  SPPO_CHECK(o.save_every == 0 || !o.save_dir.empty(), "options") << "--save-every needs --save DIR";
  SPPO_CHECK(o.resume_dir.empty() || o.step.init.empty() || o.step.init == o.resume_dir, "options")
      << "--init starts a new run at step 0 from a model's weights, --resume continues a run; give one of them";
  check_output_dir(o.save_dir, "--save", true);
  io::check_output_file(o.metrics_path, "--metrics");
  io::check_output_file(o.trace_path, "--trace");
  io::check_output_file(o.svg_path, "--svg");
}


// The targets of one sequence (tokens: S + 1 ids; labels: S + 1 or empty), when they are not
// the next tokens: a masked-token model's (masking `tokens`), or a causal model's under packed
// documents or labels, which combine (a position predicts the label of the token after it,
// none where its document ends).
struct SequenceTargets {
  std::vector<std::int32_t> targets;
  PackedDocs docs;
  i64 predicted(i64 S) const {
    return targets.empty() ? S : std::count_if(targets.begin(), targets.end(), [](std::int32_t t) { return t != kNoTarget; });
  }
};

SequenceTargets sequence_targets(StepSetup& s, std::vector<std::int32_t>& tokens,
                                 const std::vector<std::int32_t>& labels) {
  const i64 S = s.schedule.seq_len();
  SequenceTargets t;
  if (!s.config.causal) t.targets = mask_tokens(tokens.data(), S, s.config.vocab, s.seed);
  if (s.schedule.packed) {
    // A separator when one is given, else the source's document index.
    t.docs = s.doc_sep >= 0 ? pack_documents(tokens.data(), S, std::int32_t(s.doc_sep))
                            : pack_at_starts(tokens.data(), S, s.data->last_document_starts());
    t.targets = t.docs.targets;
  }
  if (!labels.empty()) {
    if (t.targets.empty()) t.targets.assign(std::size_t(S), 0);
    for (i64 i = 0; i < S; ++i) {
      const std::int32_t label = labels[std::size_t(i + 1)];
      auto& target = t.targets[std::size_t(i)];
      target = target == kNoTarget || label == io::kIgnoreLabel ? kNoTarget : label;
    }
  }
  return t;
}

// Reads the next sequence (and its labels) from the step's sources.
void read_sequence(StepSetup& s, std::vector<std::int32_t>& tokens, std::vector<std::int32_t>& labels) {
  const i64 S = s.schedule.seq_len();
  s.data->next(tokens.data(), S + 1);
  if (s.labels) {
    labels.resize(std::size_t(S + 1));
    s.labels->next(labels.data(), S + 1);
  }
}

// The positions the loss of one optimizer step averages over: those predicted in all its
// sequences. Where targets differ from sequence to sequence (packed documents, labels), the
// step's sequences are read once to count them and the sources put back where they were.
i64 step_loss_tokens(StepSetup& s, std::vector<std::int32_t>& tokens) {
  const i64 S = s.schedule.seq_len();
  const int batch = s.layout.batch;
  if (s.config.causal && !s.schedule.targets_given()) return S * batch;
  const nlohmann::json data_at = s.data->position();
  const nlohmann::json labels_at = s.labels ? s.labels->position() : nlohmann::json();
  std::vector<std::int32_t> labels;
  i64 n = 0;
  for (int k = 0; k < batch; ++k) {
    read_sequence(s, tokens, labels);
    n += sequence_targets(s, tokens, labels).predicted(S);
  }
  s.data->seek(data_at);
  if (s.labels) s.labels->seek(labels_at);
  SPPO_CHECK(n > 0, "data") << "the " << batch << " sequence(s) of this step predict no token: every label is "
                            << io::kIgnoreLabel << " (or ends a document); check the labels against the data";
  return n;
}

// One optimizer step's sequences: every rank reads all `batch` of them from the stream
// (so the stream's position stays the same everywhere) and runs the schedule on its
// replica's share, accumulating gradients; the last one reduces them. The loss and the
// gradients are the mean over the step's predicted positions (step_loss_tokens).
struct Sequences {
  double loss_sum = 0, first_sum = 0, second_sum = 0;  // over this rank's sequences (last stage)
  double step_s = 0, compute_s = 0, comm_wait_s = 0, exposed_s = 0;
  i64 peak = 0, offloaded = 0;
  i64 host_peak = 0;  // offloaded bytes held on the host at once
  i64 sent = 0;  // point-to-point bytes of one sequence's step (each sends the same)
  i64 collective = 0;  // the weight collectives' buffers of one that reduces (StepResult::collective_bytes)
  double simulated_s = 0;  // --pack, on rank 0: the simulator's time for these sequences' documents
  i64 loss_tokens = 0;     // the positions the step's loss averages over
  StepResult last;
};

Sequences run_sequences(StepSetup& s, std::vector<std::int32_t>& tokens, std::vector<std::int32_t>* all_tokens) {
  const ParallelLayout& lay = s.layout;
  const i64 S = s.schedule.seq_len(), half = io::repeat_start(S);
  Sequences q;
  q.loss_tokens = step_loss_tokens(s, tokens);
  std::vector<std::int32_t> labels;
  for (int k = 0; k < lay.batch; ++k) {
    read_sequence(s, tokens, labels);
    if (all_tokens) all_tokens->insert(all_tokens->end(), tokens.begin(), tokens.end());
    const int j = k - lay.replica() * lay.per_replica();
    if (j < 0 || j >= lay.per_replica()) continue;  // another replica's sequence
    const SequenceTargets st = sequence_targets(s, tokens, labels);
    const std::vector<std::int32_t>& targets = st.targets;
    if (s.schedule.packed && s.simulate_packed && lay.rank == 0) q.simulated_s += s.simulate_packed(st.docs.starts);
    // Under ZeRO-2 and 3 every sequence reduces into the shards, which sum the step's.
    StepControl control{j > 0, j + 1 == lay.per_replica() || shards_gradients(lay.par.zero),
                        targets.empty() ? nullptr : targets.data(),
                        s.schedule.packed ? &st.docs.starts : nullptr, q.loss_tokens};
    StepResult r = s.runtime->step(s.schedule, tokens.data(), control);
    if (r.has_loss && lay.tp_index() == 0) {  // tensor-parallel members hold the same loss
      q.loss_sum += r.loss;
      q.first_sum += targets.empty() ? mean_loss(r.losses, 0, half) : mean_loss(r.losses, targets, 0, half);
      q.second_sum += targets.empty() ? mean_loss(r.losses, half, S) : mean_loss(r.losses, targets, half, S);
    }
    q.step_s += r.step_s;
    q.compute_s += r.compute_s;
    q.comm_wait_s += r.comm_wait_s;
    q.exposed_s += r.exposed_copy_s;
    q.peak = std::max(q.peak, r.device.peak);
    q.host_peak = std::max(q.host_peak, r.host.peak);
    q.offloaded += r.offloaded_bytes;
    q.sent = std::max(q.sent, r.sent_bytes);
    q.collective = std::max(q.collective, r.collective_bytes);
    q.last = std::move(r);
  }
  return q;
}

// Figures of every rank for one step, on every rank.
struct RankFigures {
  int rank = 0;
  double step_s = 0, compute_s = 0, comm_wait_s = 0, exposed_s = 0;
  i64 peak = 0, offloaded = 0, sent = 0, host_peak = 0, collective = 0;
  double bubble() const { return compute_s > 0 ? (step_s - compute_s) / compute_s : 0; }
};

std::vector<RankFigures> all_figures(comm::Comm& world, const Sequences& q) {
  constexpr int kFields = 9;
  std::vector<double> v(std::size_t(world.size()) * kFields, 0.0);
  double* mine = v.data() + std::size_t(world.rank()) * kFields;
  mine[0] = q.step_s, mine[1] = q.compute_s, mine[2] = q.comm_wait_s, mine[3] = q.exposed_s;
  mine[4] = double(q.peak), mine[5] = double(q.offloaded), mine[6] = double(q.sent), mine[7] = double(q.host_peak);
  mine[8] = double(q.collective);
  comm::allreduce_sum(world, v, comm::world_group(world), "every rank's step figures");
  std::vector<RankFigures> f(std::size_t(world.size()));
  for (int r = 0; r < world.size(); ++r) {
    const double* x = v.data() + std::size_t(r) * kFields;
    f[std::size_t(r)] = {r, x[0], x[1], x[2], x[3], i64(x[4]), i64(x[5]), i64(x[6]), i64(x[7]), i64(x[8])};
  }
  return f;
}

// The measured step of every rank as one timeline in the simulator's result form, so
// that the runtime and the simulator write the same Chrome trace and SVG.
sim::SimResult measured_timeline(comm::Comm& world, const StepResult& mine, const ParallelLayout& lay, i64 tokens) {
  nlohmann::json j = {{"start", mine.start_s}, {"step", mine.step_s}, {"peak", mine.device.peak},
                      {"compute", mine.compute_s}, {"exposed", mine.exposed_copy_s}};
  nlohmann::json spans = nlohmann::json::array(), memory = nlohmann::json::array();
  for (const TraceSpan& t : mine.trace) spans.push_back({t.name, int(t.kind), int(t.lane), t.start_s, t.dur_s});
  for (const auto& [t, b] : mine.memory) memory.push_back({t, b});
  j["spans"] = std::move(spans);
  j["memory"] = std::move(memory);
  const auto all = comm::allgather_strings(world, j.dump(), "every rank's trace");
  std::vector<nlohmann::json> ranks;
  double t0 = 1e300, t1 = 0;
  for (const auto& text : all) {
    ranks.push_back(nlohmann::json::parse(text));
    t0 = std::min(t0, ranks.back()["start"].get<double>());
  }
  sim::SimResult m;
  double busy = 0, bubble_sum = 0;
  for (int r = 0; r < int(ranks.size()); ++r) {
    const auto& x = ranks[std::size_t(r)];
    const double shift = x["start"].get<double>() - t0;
    t1 = std::max(t1, shift + x["step"].get<double>());
    m.peak_bytes.push_back(x["peak"].get<i64>());
    m.peak_device_bytes = std::max(m.peak_device_bytes, m.peak_bytes.back());
    m.exposed_copy_s = std::max(m.exposed_copy_s, x["exposed"].get<double>());
    const double compute = x["compute"].get<double>();
    busy = std::max(busy, compute);
    if (compute > 0) bubble_sum += (x["step"].get<double>() - compute) / compute;
    for (const auto& sp : x["spans"])
      m.events.push_back({r, sim::Lane(sp[2].get<int>()), sched::OpKind(sp[1].get<int>()), sp[0].get<std::string>(),
                          shift + sp[3].get<double>(), sp[4].get<double>()});
    std::vector<std::pair<double, i64>> mem;
    for (const auto& p : x["memory"]) mem.push_back({shift + p[0].get<double>(), p[1].get<i64>()});
    m.memory.push_back(std::move(mem));
    m.names.push_back(lay.ranks() > 1 ? "rank " + std::to_string(r) + " (stage " + std::to_string(lay.stage_of(r)) + ")"
                                      : "device 0");
  }
  m.step_time_s = t1;
  m.tokens_per_device_per_s = double(tokens) / (t1 * double(ranks.size()));
  m.compute_s = busy;
  m.bubble_ratio = bubble_sum / double(ranks.size());
  return m;
}

std::string layout_text(const ParallelLayout& lay) {
  if (lay.ranks() == 1) return "";
  std::string t = " | " + sppo::layout_text(lay.par);
  if (lay.par.zero != ZeroStage::None) t += " zero " + std::to_string(stage_number(lay.par.zero));
  return t + " (" + std::to_string(lay.ranks()) + " ranks)";
}

// config.toml beside the metrics file: the run's options, so that `--config` repeats it.
// A config.toml there that sppo did not write (the user's own) is left alone.
void write_config_beside(const std::string& metrics_path, const std::string& config) {
  if (config.empty()) return;
  const std::filesystem::path path = std::filesystem::path(metrics_path).parent_path() / io::kCheckpointConfigFile;
  std::error_code ec;
  if (std::filesystem::exists(path, ec) && io::read_file(path.string()).rfind(config.substr(0, config.find('\n')), 0) != 0) {
    std::fprintf(stderr, "sppo: %s is not one sppo wrote; left alone (the checkpoints keep the run's options)\n",
                 path.string().c_str());
    return;
  }
  io::write_file_atomic(path.string(), config);
}

}  // namespace

void apply_finetune_defaults(TrainOptions& o, bool lr_given, bool warmup_given, bool weight_decay_given) {
  if (lr_given) o.lr_from = "--lr";
  if (warmup_given) o.warmup_from = "--warmup";
  if (weight_decay_given) o.weight_decay_from = "--weight-decay";
  if (o.step.init.empty()) return;
  constexpr const char* kWhy = "fine-tuning default for --init";
  if (!lr_given) o.lr = kFinetuneLr, o.lr_from = kWhy;
  if (!warmup_given) {
    o.warmup = std::max(1, int(std::lround(kFinetuneWarmupFraction * o.steps)));
    o.warmup_from = std::string("3% of --steps, ") + kWhy;
  }
  if (!weight_decay_given) o.weight_decay = kFinetuneWeightDecay, o.weight_decay_from = kWhy;
}

namespace {

// A training run between its steps: the setup, where the run stands, and what each step
// measured, for the summary.
struct Run {
  Run(const TrainOptions& options, comm::Comm& w) : o(options), world(w), root(w.rank() == 0) {}
  const TrainOptions& o;
  comm::Comm& world;
  const bool root;
  const bool tty = isatty(STDERR_FILENO);
  StepSetup s;
  comm::Comm* cm = nullptr;  // the ranks' communicator once set up (StepSetup::comm)
  int start_step = 0;
  int planned = 0;           // the steps the learning-rate schedule is laid out for
  int updates = 0;           // optimizer updates so far (AdamW's bias correction counts them)
  int bad_in_a_row = 0;      // steps skipped for a non-finite loss or gradient
  std::unique_ptr<io::JsonlWriter> metrics;
  std::unique_ptr<io::TensorboardWriter> tensorboard;
  AttentionBuildStats graphs;  // the attention library's graphs built before this step
  std::chrono::steady_clock::time_point started;
  std::vector<double> step_times;
  std::vector<double> simulated_times;  // --pack: each step priced with its own documents
  std::vector<i64> peaks, host_peaks, sent, collective;  // per rank
  // --eval-data: the held-out sequences and the step's forward alone that scores them.
  HeldOut held_out;
  sched::Schedule eval_schedule;
};

// --eval-data: the held-out loss runs the training step's own forward (its layout, lengths
// and K/V placement) with nothing saved for a backward, so it fits wherever the step does.
void prepare_held_out(Run& r) {
  const TrainOptions& o = r.o;
  if (o.eval_data.empty()) return;
  SPPO_CHECK(o.eval_every >= 0 && o.eval_seqs >= 1, "options")
      << "--eval-every must be 0 (the last step only) or more, and --eval-seqs 1 or more (got " << o.eval_every
      << " and " << o.eval_seqs << ")";
  r.held_out = open_held_out(o.eval_data, o.eval_labels, r.s.config, o.step.seq_len, o.step.seed, o.step.data_dtype);
  r.eval_schedule = sched::to_forward_only(r.s.schedule);
  // The forward alone keeps no layer inputs to recompute K/V from: where the step recomputes
  // them, its evaluation streams them from the host instead (the same ops).
  for (KvPlace& kv : r.eval_schedule.place.kv)
    if (kv == KvPlace::Recompute) kv = KvPlace::Host;
  // Its targets are the held-out data's: its labels, or its next tokens, in whole windows.
  r.eval_schedule.labeled = !o.eval_labels.empty();
  r.eval_schedule.packed = false;
  r.eval_schedule.doc_starts.clear();
}

// The held-out loss after step `done`, when it is due: the same sequences every time.
std::optional<EvalSums> held_out_loss(Run& r, int done) {
  const TrainOptions& o = r.o;
  if (o.eval_data.empty() || !(done == o.steps || (o.eval_every > 0 && done % o.eval_every == 0))) return std::nullopt;
  HeldOut& h = r.held_out;
  h.data->seek(h.start);
  if (h.labels) h.labels->seek(h.labels_start);
  std::optional<EvalSums> e;
  on_this_rank(*r.cm, [&] {
    e = evaluate(*r.s.runtime, r.eval_schedule, r.s.layout, *r.cm, *h.data, h.labels.get(), o.eval_seqs);
  });
  return e;
}

// The setup, the weights (a checkpoint to resume, --init's, or fresh ones) and the metrics
// file, on every rank.
void start_run(Run& r) {
  const TrainOptions& o = r.o;
  r.planned = o.steps;
  on_every_rank(r.world, [&] {
    check_train_options(o);
    apply_threads(o.step.threads, r.world);
    r.s = make_setup(o.step, &r.world);
    StepSetup& s = r.s;
    const ModelConfig& c = s.config;
    if (!o.resume_dir.empty()) {
      std::string from;
      // Checked on loading; sizes left out of the config are the defaults.
      const io::CheckpointState state = io::parse_checkpoint_state(load_owned(*s.runtime, o.resume_dir, &from),
                                                                   from + "/" + io::kCheckpointStateFile);
      SPPO_CHECK(to_json(state.config) == to_json(c), "checkpoint")
          << "checkpoint " << from << " holds a model " << to_json(state.config).dump() << ", not the requested "
          << to_json(c).dump() << "; pass the same model options";
      r.start_step = state.step;
      r.planned = state.json.value("schedule_steps", o.steps);
      r.updates = state.json.value("optimizer_steps", r.start_step);
      s.data->seek(state.data_position);
      if (s.labels) {
        SPPO_CHECK(state.json.contains("labels_position"), "checkpoint")
            << "checkpoint " << from << " was saved by a run without --labels; resume it without --labels, or "
               "start a new run from its weights with --init";
        s.labels->seek(state.json["labels_position"]);
      }
      SPPO_CHECK(r.start_step <= o.steps, "checkpoint")
          << "checkpoint is at step " << r.start_step << " but --steps is " << o.steps
          << "; raise --steps to continue training";
    } else if (!o.step.init.empty()) {
      init_from(*s.runtime, o.step.init);
    } else {
      init_owned(*s.runtime, o.step.seed);
    }
    prepare_held_out(r);
    if (r.root && !o.metrics_path.empty()) {
      r.metrics = std::make_unique<io::JsonlWriter>(
          o.metrics_path, r.start_step > 0 ? io::JsonlWriter::Mode::Append : io::JsonlWriter::Mode::Truncate);
      write_config_beside(o.metrics_path, o.config_toml);
    }
    if (r.root && !o.tensorboard_dir.empty()) r.tensorboard = std::make_unique<io::TensorboardWriter>(o.tensorboard_dir);
  });
  // From here the ranks' messages, device memory's too, go through the setup's communicator.
  r.cm = &r.s.comm(r.world);
  prepare_groups(*r.cm, r.s.schedule, r.s.config);
  r.s.runtime->record_memory(!o.trace_path.empty() || !o.svg_path.empty());
  const int ranks = r.s.layout.ranks();
  r.peaks.assign(std::size_t(ranks), 0);
  r.host_peaks.assign(std::size_t(ranks), 0);
  r.sent.assign(std::size_t(ranks), 0);
  r.collective.assign(std::size_t(ranks), 0);
  // A fused attention library builds its graphs as a step first meets their shapes: the
  // first steps pay for it, the steady state does not (reported per step).
  r.graphs = r.s.backend->attention_build_stats();
  r.started = std::chrono::steady_clock::now();
}

// What runs, on what, with which optimizer settings and where they came from.
void print_start(const Run& r) {
  const TrainOptions& o = r.o;
  const StepSetup& s = r.s;
  const ModelConfig& c = s.config;
  const ParallelLayout& lay = s.layout;
  std::fprintf(stderr, "sppo train: %s (%.2fM params, H %d, L %d, Z %d, V %d) | S %lld in %zu subseqs | offload %s%s%s | data %s | %d threads%s\n",
               o.step.model_name.c_str(), double(c.num_params()) / 1e6, c.hidden, c.layers, c.heads, c.vocab,
               (long long)o.step.seq_len, s.lengths.size(), o.step.plan_path.empty() ? o.step.offload.c_str() : "as planned",
               s.schedule.place.layer_major() ? " | backward a layer at a time" : "",
               s.runtime->weights_on_host()  ? " | weights and optimizer state on the host"
               : s.runtime->state_on_host() ? " | optimizer state on the host"
                                            : "",
               s.data->describe().c_str(),
               omp_get_max_threads(), layout_text(lay).c_str());
  std::fprintf(stderr,
               "optimizer: AdamW, lr %g (%s), warm-up %d steps (%s), %s, weight decay %g (%s), clip %g\n",
               o.lr, o.lr_from.c_str(), o.warmup, o.warmup_from.c_str(), o.lr_schedule().describe(r.planned).c_str(),
               o.weight_decay, o.weight_decay_from.c_str(), o.clip);
  if (s.device_budget.bytes > 0)
    std::fprintf(stderr, "device memory: a budget of %s (%s)\n", format_bytes(double(s.device_budget.bytes)).c_str(),
                 s.device_budget.from.c_str());
  if (s.labels) std::fprintf(stderr, "labels: %s (the loss counts the tokens whose label is not -100)\n",
                             s.labels->describe().c_str());
  if (std::string(s.backend->name()) != "cpu")
    std::fprintf(stderr, "attention: %s\n", s.attention.description.c_str());
  if (lay.ranks() > 1) std::fprintf(stderr, "ranks: %d, talking over %s\n", lay.ranks(), s.comm_name.c_str());
}

void save_run(Run& r, int step_done) {
  const TrainOptions& o = r.o;
  const StepSetup& s = r.s;
  nlohmann::json state = {{"step", step_done},
                          {"data_position", s.data->position()},
                          {"config", to_json(s.config)},
                          {"seed", o.step.seed},
                          {"seq_len", o.step.seq_len},
                          {"batch", s.layout.batch},
                          {"schedule_steps", r.planned},
                          {"optimizer_steps", r.updates},
                          {"options", numeric_options(o)}};
  // The sequences a step as run: under --plan its dp, which the options do not hold.
  state["options"]["--batch"] = std::to_string(s.layout.batch);
  if (s.labels) state["labels_position"] = s.labels->position();
  save_consolidated(*s.runtime, s.layout, *r.cm, o.save_dir, state, o.config_toml);
  // Note [Waiting for a checkpoint]: rank 0 writes the checkpoint while the others would wait
  // for its messages in the next step under --comm-timeout (20 s), which a large model's
  // checkpoint outlasts (12 B a parameter: 96 GB for 8B): every rank waits for the write
  // here instead, under a deadline of its own, 10 minutes plus the bytes at 50 MB/s.
  if (r.cm->size() > 1) {
    const double before = r.cm->timeout_s();
    const double bytes = 12.0 * double(s.config.num_params());
    r.cm->set_timeout_s(std::max(before, 600.0 + bytes / 50e6));
    comm::barrier(*r.cm, "rank 0's writing of the checkpoint to " + o.save_dir);
    r.cm->set_timeout_s(before);
  }
}

// A step whose loss or gradient is not finite changes nothing (optimizer_step leaves the
// weights alone); too many in a row end the run, keeping the last checkpoint.
void skip_step(Run& r, int step, bool loss_finite) {
  const TrainOptions& o = r.o;
  ++r.bad_in_a_row;
  if (r.root && !o.quiet)
    std::fprintf(stderr, "%sstep %d: the %s is not finite; step skipped (%d in a row, at most --max-bad-steps %d)\n",
                 r.tty ? "\r\033[K" : "", step + 1, loss_finite ? "gradient" : "loss", r.bad_in_a_row,
                 o.max_bad_steps);
  if (r.root && r.metrics) r.metrics->write({{"step", step + 1}, {"skipped", true}});
  SPPO_CHECK(r.bad_in_a_row < o.max_bad_steps, "train")
      << "--max-bad-steps " << o.max_bad_steps << " reached: step " << step + 1
      << " is the last of that many in a row with a non-finite loss or gradient; stopped"
      << (o.save_dir.empty() ? "" : ", keeping the last checkpoint in " + o.save_dir) << "; lower --lr or --clip and resume";
}

// What one step trained: its loss (and the built-in task's halves), its learning rate and
// gradient norm.
struct StepOutcome {
  int done = 0;
  double loss = 0, first = 0, second = 0, norm = 0;
  float lr = 0;
};

// One step's figures over every rank, into the run's records; on rank 0, its metrics line
// and progress.
void report_step(Run& r, const Sequences& q, const StepOutcome& t, const std::optional<EvalSums>& eval) {
  const TrainOptions& o = r.o;
  const StepSetup& s = r.s;
  const ParallelLayout& lay = s.layout;
  const std::vector<RankFigures> ranks = all_figures(*r.cm, q);
  double step_s = 0, exposed = 0;
  i64 peak = 0, offloaded = 0, host_peak = 0;
  for (const RankFigures& f : ranks) {
    step_s = std::max(step_s, f.step_s);
    exposed = std::max(exposed, f.exposed_s);
    peak = std::max(peak, f.peak);
    host_peak = std::max(host_peak, f.host_peak);
    offloaded += f.offloaded;
    r.peaks[std::size_t(f.rank)] = std::max(r.peaks[std::size_t(f.rank)], f.peak);
    r.host_peaks[std::size_t(f.rank)] = std::max(r.host_peaks[std::size_t(f.rank)], f.host_peak);
    r.sent[std::size_t(f.rank)] = f.sent;
    r.collective[std::size_t(f.rank)] = std::max(r.collective[std::size_t(f.rank)], f.collective);
  }
  r.step_times.push_back(step_s);
  if (s.simulate_packed) r.simulated_times.push_back(q.simulated_s);
  if (!r.root) return;
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - r.started).count();
  const double eta = elapsed / double(t.done - r.start_step) * double(o.steps - t.done);
  const double tps = double(o.step.seq_len) * lay.batch / step_s;
  nlohmann::json m = {{"step", t.done},
                      {"loss", t.loss},
                      {"lr", t.lr},
                      {"grad_norm", t.norm},
                      {"step_time_s", step_s},
                      {"tokens_per_s", tps},
                      {"peak_device_bytes", peak},
                      {"peak_host_bytes", host_peak},
                      {"offloaded_bytes", offloaded},
                      {"exposed_copy_s", exposed}};
  if (s.runtime->state_on_host()) m["optimizer_copied_bytes"] = s.runtime->host_update_bytes();
  const AttentionBuildStats now = s.backend->attention_build_stats();
  if (now.graphs > r.graphs.graphs) {
    m["attention_graphs_built"] = now.graphs - r.graphs.graphs;
    m["attention_graph_build_s"] = now.seconds - r.graphs.seconds;
  }
  r.graphs = now;
  if (s.simulate_packed) m["simulated_step_time_s"] = q.simulated_s;
  if (s.schedule.targets_given()) m["loss_tokens"] = q.loss_tokens;  // what the loss averaged over
  std::string halves;
  if (s.repeat_task) {
    m["loss_first_half"] = t.first;
    m["loss_second_half"] = t.second;
    char buf[64];
    std::snprintf(buf, sizeof buf, " (1st half %.3f, 2nd %.3f)", t.first, t.second);
    halves = buf;
  }
  std::string held_out;
  if (eval) {  // the held-out loss, near and far positions as the training loss's halves
    const i64 S = o.step.seq_len, half = s.repeat_task ? io::repeat_start(S) : S / 2;
    m["eval_loss"] = eval->mean_loss(0, S);
    m["eval_loss_first_half"] = eval->mean_loss(0, half);
    m["eval_loss_second_half"] = eval->mean_loss(half, S);
    if (!o.eval_labels.empty()) m["eval_accuracy"] = eval->accuracy();  // of the labels' positions
    char buf[64];
    std::snprintf(buf, sizeof buf, " | held-out %.4f", eval->mean_loss(0, S));
    held_out = buf;
  }
  if (lay.ranks() > 1) {
    nlohmann::json per = nlohmann::json::array();
    for (const RankFigures& f : ranks)
      per.push_back({{"rank", f.rank},
                     {"stage", lay.stage_of(f.rank)},
                     {"replica", lay.replica_of(f.rank)},
                     {"step_time_s", f.step_s},
                     {"compute_s", f.compute_s},
                     {"bubble", f.bubble()},
                     {"comm_wait_s", f.comm_wait_s},
                     {"peak_device_bytes", f.peak},
                     {"peak_host_bytes", f.host_peak}});
    m["ranks"] = std::move(per);
  }
  if (r.metrics) r.metrics->write(m);
  if (r.tensorboard) {  // the step's figures, each under its metrics name
    std::vector<std::pair<std::string, double>> scalars;
    for (const auto& [name, v] : m.items())
      if (v.is_number() && name != "step") scalars.push_back({name, v.get<double>()});
    r.tensorboard->scalars(t.done, scalars);
  }
  if (!o.quiet)
    std::fprintf(stderr, "%sstep %d/%d | loss %.4f%s%s | %s tok/s | peak %s | offloaded %s | ETA %s%s",
                 r.tty ? "\r\033[K" : "", t.done, o.steps, t.loss, halves.c_str(), held_out.c_str(),
                 fmt_rate(tps).c_str(),
                 format_bytes(double(peak)).c_str(), format_bytes(double(offloaded)).c_str(),
                 fmt_duration(eta).c_str(), r.tty && t.done < o.steps ? "" : "\n");
}

// One optimizer step: the step's sequences, the reduced loss, the update, the figures, and
// at the end of the run (or of this process's share, --stop-after) the timelines and the
// checkpoint. Returns false when the run stops here.
bool train_step(Run& r, int step, std::vector<std::int32_t>& tokens) {
  const TrainOptions& o = r.o;
  StepSetup& s = r.s;
  Runtime& rt = *s.runtime;
  const ParallelLayout& lay = s.layout;
  comm::Comm& cm = *r.cm;
  const FaultPlan& fault = fault_plan();
  if (fault.kind == FaultPlan::Kind::Die && fault.rank == r.world.rank() && fault.count == step + 1) raise(SIGKILL);
  Sequences q;
  on_this_rank(cm, [&] { q = run_sequences(s, tokens, nullptr); });
  if (fault.kind == FaultPlan::Kind::Nan && fault.rank == r.world.rank() && step + 1 == fault.count) {
    const float nan = std::nanf("");  // a poisoned gradient
    rt.write_device(rt.grads(), &nan, 1);
  }
  std::vector<double> losses{q.loss_sum, q.first_sum, q.second_sum};
  comm::allreduce_sum(cm, losses, comm::world_group(r.world), "the step's loss");
  StepOutcome t;
  t.done = step + 1;
  t.loss = losses[0];
  t.first = losses[1] / lay.batch, t.second = losses[2] / lay.batch;
  t.lr = float(o.lr_schedule().at(step, r.planned));
  const AdamWSettings hp{t.lr, o.beta1, o.beta2, o.adam_eps, o.weight_decay, o.clip};
  t.norm = std::isfinite(t.loss) ? optimizer_step(rt, lay, cm, hp, r.updates + 1) : t.loss;
  if (!std::isfinite(t.norm)) {
    skip_step(r, step, std::isfinite(t.loss));
    return true;
  }
  r.bad_in_a_row = 0;
  ++r.updates;
  report_step(r, q, t, held_out_loss(r, t.done));
  const bool stopping = o.stop_after > 0 && t.done == o.stop_after && t.done < o.steps;
  if ((t.done == o.steps || stopping) && (!o.trace_path.empty() || !o.svg_path.empty())) {
    const i64 S = o.step.seq_len;
    const sim::SimResult m = measured_timeline(cm, q.last, lay, S * lay.batch);
    if (r.root)
      sim::write_timelines(m, o.trace_path, o.svg_path,
                           "measured step: S " + std::to_string(S) + ", " + o.step.model_name + layout_text(lay));
  }
  if (!o.save_dir.empty() && ((o.save_every > 0 && t.done % o.save_every == 0) || t.done == o.steps || stopping))
    on_this_rank(cm, [&] { save_run(r, t.done); });
  return !stopping;
}

// The median of the values past the first `skip`, or `otherwise` when there are none.
double median_after(std::vector<double> v, std::size_t skip, double otherwise) {
  if (v.size() <= skip) return otherwise;
  v.erase(v.begin(), v.begin() + std::ptrdiff_t(skip));
  return median(std::move(v));
}

// Summary: the measured step time (median, the first step excluded as warm-up) beside the
// simulator's prediction of the same schedule on this machine's profile, and the peaks
// beside the memory model's.
void finish_run(const Run& r) {
  const TrainOptions& o = r.o;
  const StepSetup& s = r.s;
  const ParallelLayout& lay = s.layout;
  const std::size_t warmup = r.step_times.size() > 1 ? 1 : 0;
  const double measured = median_after(r.step_times, warmup, 0);
  // Packed steps differ in their documents: the median of each step's own prediction.
  const double simulated = median_after(r.simulated_times, warmup, s.predicted_step_s);
  const i64 measured_peak = *std::max_element(r.peaks.begin(), r.peaks.end());
  const i64 measured_host_peak = *std::max_element(r.host_peaks.begin(), r.host_peaks.end());
  if (!r.root) return;
  nlohmann::json summary = {{"summary", true},
                            {"step", r.start_step + int(r.step_times.size())},
                            {"measured_step_time_s", measured},
                            {"predicted_peak_device_bytes", s.predicted_peak_bytes},
                            {"measured_peak_device_bytes", measured_peak},
                            {"predicted_peak_host_bytes", s.predicted_host_bytes},
                            {"measured_peak_host_bytes", measured_host_peak}};
  if (lay.ranks() > 1) {
    summary["measured_peak_device_bytes_per_rank"] = r.peaks;
    summary["predicted_peak_device_bytes_per_rank"] = s.predicted_peak_per_rank;
    summary["measured_sent_bytes_per_rank"] = r.sent;
    summary["predicted_sent_bytes_per_rank"] = s.predicted_sent_per_rank;
    summary["measured_collective_bytes_per_rank"] = r.collective;
    summary["predicted_collective_bytes_per_rank"] = s.predicted_collective_per_rank;
    summary["simulated_bubble"] = s.predicted_bubble;
  }
  if (s.profile_measured) {
    summary["simulated_step_time_s"] = simulated;
    summary["profile"] = s.profile.name;
  }
  const AttentionBuildStats built = s.backend->attention_build_stats();
  if (built.graphs > 0) {
    summary["attention"] = s.attention.description;
    summary["attention_graphs"] = {{"built", built.graphs}, {"build_s", built.seconds},
                                   {"first_build_s", built.first_seconds}};
  }
  if (r.metrics) r.metrics->write(summary);
  if (o.quiet) return;
  if (built.graphs > 0)
    std::fprintf(stderr, "attention graphs: %d built in %.2f s (the first %.2f s)\n", built.graphs, built.seconds,
                 built.first_seconds);
  std::fprintf(stderr, "done: %d steps, step time %.3f s measured (median)", int(r.step_times.size()), measured);
  if (s.profile_measured) std::fprintf(stderr, ", %.3f s simulated on profile %s", simulated, s.profile.name.c_str());
  std::fprintf(stderr, "; peak device memory %s measured", format_bytes(double(measured_peak)).c_str());
  if (s.predicted_peak_bytes > 0)
    std::fprintf(stderr, ", %s predicted", format_bytes(double(s.predicted_peak_bytes)).c_str());
  if (measured_host_peak > 0 || s.predicted_host_bytes > 0)
    std::fprintf(stderr, "; host memory (%s%s) %s measured, %s predicted",
                 s.schedule.place.any_kv_streamed() ? "offloaded, K/V and their sums" : "offloaded",
                 s.runtime->weights_on_host() ? ", weights, gradients, optimizer state"
                 : s.runtime->state_on_host() ? ", optimizer state"
                                              : "",
                 format_bytes(double(measured_host_peak)).c_str(), format_bytes(double(s.predicted_host_bytes)).c_str());
  if (lay.ranks() > 1) std::fprintf(stderr, " (fullest rank)");
  std::fprintf(stderr, "\n");
  // A CPU profile prices one device at the threads it was measured with.
  const int threads = omp_get_max_threads();
  if (s.profile_measured && s.profile.threads > 0 && s.profile.threads != threads)
    std::fprintf(stderr,
                 "note: profile %s was measured at %d threads a device and this rank ran %d, so the simulated "
                 "time prices other cores; measure one with `sppo profile --threads %d`\n",
                 s.profile.name.c_str(), s.profile.threads, threads, threads);
}

}  // namespace

namespace {

// train --plan P --dry-run: the plan's step set up on its own machine's terms (no backend, no
// allocation), each rank's predicted peaks against its budgets. A table on stderr and one
// JSON object on stdout; exit 3 (DoesNotFit, from the setup) where a rank is over a budget.
int run_dry_run(const TrainOptions& o) {
  const StepSetup s = make_setup(o.step);
  const plan::Plan& p = *s.plan;
  const ParallelLayout& lay = s.layout;
  const int R = lay.ranks();
  nlohmann::json ranks = nlohmann::json::array();
  for (int r = 0; r < R; ++r)
    ranks.push_back({{"rank", r},
                     {"stage", lay.stage_of(r)},
                     {"peak_device_bytes", s.predicted_peak_per_rank.at(std::size_t(r))},
                     {"peak_host_bytes", s.predicted_host_per_rank.at(std::size_t(r))}});
  const nlohmann::json j = {{"plan", o.step.plan_path},
                            {"model", p.model_name},
                            {"seq_len", o.step.seq_len},
                            {"layout", plan::layout_text(p)},
                            {"precision", p.precision == ActPrecision::BF16 ? "bf16" : "fp32"},
                            {"hardware", s.profile.name},
                            {"ranks", R},
                            {"device_budget_bytes", s.device_budget.bytes},
                            {"host_budget_bytes", s.host_budget},
                            {"peak_device_bytes", s.predicted_peak_bytes},
                            {"peak_host_bytes", s.predicted_host_bytes},
                            {"plan_peak_device_bytes", p.predicted.peak_device_bytes},
                            {"plan_peak_host_bytes", p.predicted.peak_host_bytes},
                            {"step_time_s", s.predicted_step_s},
                            {"per_rank", ranks},
                            {"fits", true}};
  if (!o.quiet) {
    std::fprintf(stderr, "sppo train --dry-run: %s, %s tokens of %s on %d %s ranks (%s, %s activations)\n",
                 o.step.plan_path.c_str(), std::to_string(o.step.seq_len).c_str(), p.model_name.c_str(), R,
                 s.profile.name.c_str(), plan::layout_text(p).c_str(), j["precision"].get<std::string>().c_str());
    std::fprintf(stderr, "device budget %s (%s), host budget %s\n", format_bytes(double(s.device_budget.bytes)).c_str(),
                 s.device_budget.from.c_str(), s.host_budget > 0 ? format_bytes(double(s.host_budget)).c_str() : "none");
    // Every rank where there are few; else each stage's fullest.
    std::fprintf(stderr, "%6s %6s %14s %14s\n", "rank", "stage", "device peak", "host peak");
    for (int r = 0; r < R; ++r) {
      const int st = lay.stage_of(r);
      bool fullest = true;
      for (int q = 0; q < R && R > 16; ++q)
        if (lay.stage_of(q) == st && (s.predicted_peak_per_rank[std::size_t(q)] > s.predicted_peak_per_rank[std::size_t(r)] ||
                                      (s.predicted_peak_per_rank[std::size_t(q)] == s.predicted_peak_per_rank[std::size_t(r)] && q < r)))
          fullest = false;
      if (!fullest) continue;
      std::fprintf(stderr, "%6d %6d %14s %14s\n", r, st, format_bytes(double(s.predicted_peak_per_rank[std::size_t(r)])).c_str(),
                   format_bytes(double(s.predicted_host_per_rank[std::size_t(r)])).c_str());
    }
    std::fprintf(stderr, "fits: every rank under its budgets; a step of %.4g s predicted (the plan: %.4g s, peak %s)\n",
                 s.predicted_step_s, p.predicted.step_time_s, format_bytes(double(p.predicted.peak_device_bytes)).c_str());
  }
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace

int run_train(const TrainOptions& o) {
  if (o.step.dry_run) return run_dry_run(o);
  comm::Comm& world = comm::world();
  world.set_timeout_s(o.step.comm_timeout_s);
  Run r(o, world);
  start_run(r);
  if (!o.quiet && r.root) print_start(r);
  std::vector<std::int32_t> tokens(std::size_t(o.step.seq_len + 1));
  for (int step = r.start_step; step < o.steps; ++step)
    if (!train_step(r, step, tokens)) break;
  finish_run(r);
  return 0;
}

nlohmann::json numeric_options(const TrainOptions& o) {
  const StepOptions& st = o.step;
  auto num = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.9g", v);
    return std::string(buf);
  };
  return {{"--model", st.model_preset},
          {"--vocab", std::to_string(st.model.vocab)},
          {"--hidden", std::to_string(st.model.hidden)},
          {"--layers", std::to_string(st.model.layers)},
          {"--heads", std::to_string(st.model.heads)},
          {"--seq-len", std::to_string(st.seq_len)},
          {"--seed", std::to_string(st.seed)},
          {"--data", st.data},
          {"--data-dtype", st.data_dtype},
          {"--labels", st.labels},
          {"--doc-sep", std::to_string(st.doc_sep)},
          {"--pack", st.pack},
          {"--subseqs", st.subseqs},
          {"--partition", st.partition},
          {"--recompute", st.recompute},
          {"--mlp-tile-rows", std::to_string(st.mlp_tile_rows)},
          {"--batch", std::to_string(st.batch == 0 ? st.par.dp : st.batch)},
          {"--lr", num(o.lr)},
          {"--warmup", std::to_string(o.warmup)},
          {"--lr-schedule", to_string(o.lr_shape)},
          {"--min-lr", o.min_lr >= 0 ? num(o.min_lr) : ""},  // "": a tenth of --lr
          {"--decay-steps", std::to_string(o.decay_steps)},
          {"--weight-decay", num(o.weight_decay)},
          {"--clip", num(o.clip)}};
}

std::string first_difference(const nlohmann::json& given, const nlohmann::json& recorded) {
  for (auto it = recorded.begin(); it != recorded.end(); ++it)
    if (given.contains(it.key()) && given[it.key()] != it.value())
      return it.key() + " " + given[it.key()].dump() + " differs from the checkpoint's " + it.value().dump();
  return "";
}

int run_grads(const StepOptions& o, const std::string& out_dir, const std::string& weights_from) {
  comm::Comm& world = comm::world();
  world.set_timeout_s(o.comm_timeout_s);
  const bool root = world.rank() == 0;
  StepSetup s;
  on_every_rank(world, [&] {
    SPPO_CHECK(!out_dir.empty(), "options") << "sppo grads needs --out DIR";
    SPPO_CHECK(o.threads >= 0, "options") << "--threads must be 0 (all cores) or positive (got " << o.threads << ")";
    check_output_dir(out_dir, "--out", false);
    apply_threads(o.threads, world);
    s = make_setup(o, &world);
    if (!weights_from.empty()) {
      init_from(*s.runtime, weights_from);
    } else if (!o.init.empty()) {
      init_from(*s.runtime, o.init);
    } else {
      init_owned(*s.runtime, o.seed);
    }
  });
  Runtime& rt = *s.runtime;
  const ModelConfig& c = s.config;
  const ParallelLayout& lay = s.layout;
  const i64 S = o.seq_len;
  comm::Comm& cm = s.comm(world);
  prepare_groups(cm, s.schedule, s.config);
  std::vector<std::int32_t> tokens(std::size_t(S + 1)), all_tokens;
  Sequences q;
  on_this_rank(cm, [&] { q = run_sequences(s, tokens, &all_tokens); });
  std::vector<double> losses{q.loss_sum};
  comm::allreduce_sum(cm, losses, comm::world_group(world), "the step's loss");
  const FullState full = gather_full(rt, lay, cm, true, false);
  const std::vector<RankFigures> ranks = all_figures(cm, q);
  if (!root) return 0;
  i64 peak = 0, offloaded = 0, host_peak = 0;
  double step_s = 0;
  for (const RankFigures& f : ranks) {
    peak = std::max(peak, f.peak);
    host_peak = std::max(host_peak, f.host_peak);
    offloaded += f.offloaded;
    step_s = std::max(step_s, f.step_s);
  }
  std::filesystem::create_directories(out_dir);
  write_json_file(out_dir + "/config.json", to_json(c));
  {
    std::vector<std::uint32_t> u(all_tokens.begin(), all_tokens.end());
    std::ofstream f(out_dir + "/tokens.u32", std::ios::binary);
    f.write(reinterpret_cast<const char*>(u.data()), std::streamsize(u.size() * 4));
    SPPO_CHECK(f.good(), "io") << "error writing " << out_dir << "/tokens.u32";
  }
  auto views = [&](const std::vector<float>& base) {
    std::vector<io::TensorView> v;
    for (const auto& t : full_tensors(c, const_cast<float*>(base.data()), ""))
      v.push_back({t.name, io::DType::F32, t.shape, t.data});
    return v;
  };
  io::write_safetensors(out_dir + "/weights.safetensors", views(full.params));
  io::write_safetensors(out_dir + "/grads.safetensors", views(full.grads));
  const double loss = losses[0];
  nlohmann::json result = {{"loss", loss},
                           {"seq_len", S},
                           {"batch", lay.batch},
                           {"subseqs", s.lengths.size()},
                           {"lengths", s.lengths},
                           {"alpha", s.alpha},
                           {"recompute", o.recompute},
                           {"mlp_tile_rows", o.mlp_tile_rows},
                           {"pp", lay.par.pp},
                           {"dp", lay.par.dp},
                           {"cp", lay.par.cp},
                           {"tp", lay.par.tp},
                           {"zero", stage_number(lay.par.zero)},
                           {"peak_device_bytes", peak},
                           {"predicted_peak_device_bytes", s.predicted_peak_bytes},
                           {"peak_host_bytes", host_peak},
                           {"predicted_peak_host_bytes", s.predicted_host_bytes},
                           {"offloaded_bytes", offloaded},
                           {"step_time_s", step_s}};
  if (lay.ranks() > 1) {
    std::vector<i64> sent, collective;
    for (const RankFigures& f : ranks) sent.push_back(f.sent), collective.push_back(f.collective);
    result["measured_sent_bytes_per_rank"] = sent;
    result["predicted_sent_bytes_per_rank"] = s.predicted_sent_per_rank;
    result["measured_collective_bytes_per_rank"] = collective;
    result["predicted_collective_bytes_per_rank"] = s.predicted_collective_per_rank;
  }
  write_json_file(out_dir + "/result.json", result);
  std::printf("loss %.6f -> %s\n", loss, out_dir.c_str());
  return 0;
}

}  // namespace sppo
