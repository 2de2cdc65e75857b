#include "train/eval.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "train/setup.h"
#include "train/trainer.h"

namespace sppo {

double EvalSums::mean_loss(i64 begin, i64 end) const {
  double l = 0, n = 0;
  for (i64 p = begin; p < end; ++p) l += loss[std::size_t(p)], n += tokens[std::size_t(p)];
  return n > 0 ? l / n : std::nan("");
}

double EvalSums::total_tokens() const {
  double n = 0;
  for (double t : tokens) n += t;
  return n;
}

double EvalSums::accuracy() const {
  double h = 0;
  for (double x : hits) h += x;
  const double n = total_tokens();
  return n > 0 ? h / n : std::nan("");
}

EvalSums evaluate(Runtime& rt, const sched::Schedule& fwd, const ParallelLayout& lay, comm::Comm& comm,
                  io::TokenSource& data, io::TokenSource* labels, i64 sequences, const EvalProgress& progress) {
  SPPO_ASSERT(fwd.forward_only);
  const i64 S = fwd.seq_len();
  EvalSums e;
  e.loss.assign(std::size_t(S), 0.0);
  e.tokens.assign(std::size_t(S), 0.0);
  e.hits.assign(std::size_t(S), 0.0);
  std::vector<std::int32_t> tokens(std::size_t(S + 1)), label(labels ? std::size_t(S + 1) : 0), targets;
  double seconds = 0;
  i64 peak = 0, host_peak = 0, ran = 0;
  const i64 mine = (sequences - lay.replica() + lay.par.dp - 1) / lay.par.dp;  // this replica's sequences
  for (i64 k = 0; k < sequences; ++k) {
    data.next(tokens.data(), S + 1);
    if (labels) labels->next(label.data(), S + 1);
    // A position predicts the next token, or the label of the token after it; none where
    // the label is the ignore index.
    targets.clear();
    if (labels)
      for (i64 p = 0; p < S; ++p) {
        const std::int32_t l = label[std::size_t(p + 1)];
        targets.push_back(l == io::kIgnoreLabel ? kNoTarget : l);
      }
    i64 counted = 0;
    for (i64 p = 0; p < S; ++p)
      if (!labels || targets[std::size_t(p)] != kNoTarget) e.tokens[std::size_t(p)] += 1, ++counted;
    if (k % lay.par.dp != lay.replica() || counted == 0) continue;  // another replica's, or nothing to score
    StepControl control{false, false, labels ? targets.data() : nullptr, nullptr, counted};
    const StepResult r = rt.step(fwd, tokens.data(), control);
    // The last stage's ranks hold the losses of their rows (a ring member its piece's, a
    // Ulysses member its rows'), zero elsewhere; tensor-parallel members the same whole ones.
    if (r.has_loss && lay.tp_index() == 0)
      for (i64 p = 0; p < S; ++p) {
        e.loss[std::size_t(p)] += r.losses[std::size_t(p)];
        e.hits[std::size_t(p)] += r.hits[std::size_t(p)];
      }
    seconds += r.step_s;
    peak = std::max(peak, r.device.peak);
    host_peak = std::max(host_peak, r.host.peak);
    if (progress) progress(++ran, mine, seconds);
  }
  e.sequences = sequences;
  if (comm.size() > 1) {
    comm::allreduce_sum(comm, e.loss, comm::world_group(comm), "the evaluation's losses");
    comm::allreduce_sum(comm, e.hits, comm::world_group(comm), "the evaluation's hits");
    std::vector<double> most(std::size_t(3 * comm.size()), 0.0);
    most[std::size_t(3 * comm.rank())] = double(peak);
    most[std::size_t(3 * comm.rank() + 1)] = double(host_peak);
    most[std::size_t(3 * comm.rank() + 2)] = seconds;
    comm::allreduce_sum(comm, most, comm::world_group(comm), "the evaluation's peaks");
    for (int r = 0; r < comm.size(); ++r) {
      e.peak_device_per_rank.push_back(i64(most[std::size_t(3 * r)]));
      e.peak_host_per_rank.push_back(i64(most[std::size_t(3 * r + 1)]));
    }
    for (int r = 0; r < comm.size(); ++r) {
      peak = std::max(peak, i64(most[std::size_t(3 * r)]));
      host_peak = std::max(host_peak, i64(most[std::size_t(3 * r + 1)]));
      seconds = std::max(seconds, most[std::size_t(3 * r + 2)]);
    }
  }
  e.peak_device_bytes = peak;
  e.peak_host_bytes = host_peak;
  e.seconds = seconds;
  return e;
}

std::vector<io::PositionBin> position_bins(const EvalSums& sums) {
  const i64 S = i64(sums.loss.size());
  std::vector<io::PositionBin> bins;
  for (i64 b = 0, e = std::min<i64>(S, 16); b < S; b = e, e = std::min(S, 2 * e)) {
    double n = 0;
    for (i64 p = b; p < e; ++p) n += sums.tokens[std::size_t(p)];
    bins.push_back({b, e, sums.mean_loss(b, e), i64(n)});
  }
  return bins;
}

HeldOut open_held_out(const std::string& data, const std::string& labels, const ModelConfig& c, i64 S,
                      std::uint64_t seed, const std::string& data_dtype) {
  HeldOut h;
  SPPO_CHECK(c.causal, "options")
      << "--eval-data scores next-token prediction; a bidirectional model (--attention bidirectional) has none";
  h.data = io::open_data(data, c.vocab, seed, io::DataOptions{0, data_dtype});
  h.data->check_vocab(c.vocab);
  SPPO_CHECK(h.data->size() < 0 || h.data->size() >= S + 1, "options")
      << "--eval-data " << data << " holds " << h.data->size() << " tokens, fewer than one sequence of --seq-len " << S
      << " needs (" << S + 1 << "); give a longer file or a shorter --seq-len";
  h.start = h.data->position();
  if (labels.empty()) return h;
  SPPO_CHECK(h.data->size() >= 0, "options")
      << "--eval-labels gives the targets of the tokens of --eval-data (a token file); the built-in task has its own";
  h.labels = io::open_labels(labels, c.vocab);
  SPPO_CHECK(h.labels->size() == h.data->size(), "options")
      << "--eval-labels " << labels << " holds " << h.labels->size() << " labels, but --eval-data " << data
      << " holds " << h.data->size() << " tokens; give one label per token";
  h.labels->check_vocab(c.vocab);
  h.labels_start = h.labels->position();
  return h;
}

namespace {

// The sequences to evaluate: --seqs, else every whole one the data holds (windows of S + 1
// tokens that share their last token with the next one's first), the built-in task's one.
i64 sequences_of(const EvalOptions& o, const io::TokenSource& data) {
  if (o.seqs > 0) return o.seqs;
  const i64 size = data.size();
  return size < 0 ? 1 : std::max<i64>(1, (size - 1) / o.step.seq_len);
}

nlohmann::json eval_json(const EvalSums& e, const StepSetup& s, bool labeled) {
  nlohmann::json bins = nlohmann::json::array();
  for (const io::PositionBin& b : position_bins(e))
    bins.push_back({{"begin", b.begin},
                    {"end", b.end},
                    {"loss", std::isnan(b.loss) ? nlohmann::json() : nlohmann::json(b.loss)},
                    {"tokens", b.tokens}});
  nlohmann::json j = {{"loss", e.mean_loss(0, i64(e.loss.size()))},
                      {"tokens", i64(e.total_tokens())},
                      {"per_position", bins},
                      {"peak_device_bytes", e.peak_device_bytes},
                      {"peak_host_bytes", e.peak_host_bytes},
                      {"predicted_peak_device_bytes", s.predicted_peak_bytes},
                      {"predicted_peak_host_bytes", s.predicted_host_bytes},
                      {"seq_len", s.schedule.seq_len()},
                      {"sequences", e.sequences},
                      {"subseqs", s.lengths.size()},
                      {"lengths", s.lengths},
                      {"kv_cache_host_layers", s.schedule.place.kv_layers(KvPlace::Host).size()},
                      {"pp", s.layout.par.pp},
                      {"cp", s.layout.par.cp},
                      {"tp", s.layout.par.tp},
                      {"ulysses", s.layout.par.ulysses},
                      {"dp", s.layout.par.dp},
                      {"seconds", e.seconds}};
  if (labeled) j["accuracy"] = e.accuracy();
  if (s.layout.ranks() > 1) {
    j["peak_device_bytes_per_rank"] = e.peak_device_per_rank;
    j["predicted_peak_device_bytes_per_rank"] = s.predicted_peak_per_rank;
    j["peak_host_bytes_per_rank"] = e.peak_host_per_rank;
    j["predicted_peak_host_bytes_per_rank"] = s.predicted_host_per_rank;
  }
  return j;
}

void print_eval(const EvalSums& e, const StepSetup& s, bool labeled) {
  const i64 S = s.schedule.seq_len();
  const double loss = e.mean_loss(0, S);
  std::printf("%.0f tokens counted in %lld sequence(s)\n", e.total_tokens(), (long long)e.sequences);
  std::printf("loss %.6f (perplexity %.4g)", loss, std::exp(loss));
  if (labeled) std::printf(", accuracy %.4f", e.accuracy());
  std::printf("\n%-22s %10s %10s\n", "positions", "loss", "tokens");
  for (const io::PositionBin& b : position_bins(e)) {
    char range[64];
    std::snprintf(range, sizeof range, "[%lld, %lld)", (long long)b.begin, (long long)b.end);
    std::printf("%-22s %10.4f %10lld\n", range, b.loss, (long long)b.tokens);
  }
  std::printf("peak device %s (predicted %s), host %s (predicted %s), %.2f s\n",
              format_bytes(double(e.peak_device_bytes)).c_str(), format_bytes(double(s.predicted_peak_bytes)).c_str(),
              format_bytes(double(e.peak_host_bytes)).c_str(), format_bytes(double(s.predicted_host_bytes)).c_str(),
              e.seconds);
}

}  // namespace

int run_eval(const EvalOptions& o) {
  comm::Comm& world = comm::world();
  world.set_timeout_s(o.step.comm_timeout_s);
  StepSetup s;
  on_every_rank(world, [&] {
    SPPO_CHECK(o.step.forward_only, "options") << "sppo eval runs forward-only steps";
    SPPO_CHECK(!o.step.init.empty(), "options")
        << "sppo eval needs --init CKPT: the weights to evaluate (an sppo checkpoint or a Hugging Face model "
           "directory)";
    SPPO_CHECK(o.step.model.causal, "options")
        << "sppo eval scores next-token prediction; a bidirectional model (--attention bidirectional) has none";
    SPPO_CHECK(!o.step.pack, "options") << "sppo eval scores whole windows of the data; drop --pack";
    SPPO_CHECK(o.seqs >= 0, "options") << "--seqs must be 0 (every whole sequence of the data) or more";
    SPPO_CHECK(o.step.threads >= 0, "options") << "--threads must be 0 (all cores) or positive";
    check_output_dir(o.out, "--out", false);
    apply_threads(o.step.threads, world);
    s = make_setup(o.step, &world);
    SPPO_CHECK(s.data->size() < 0 || s.data->size() >= o.step.seq_len + 1, "options")
        << "--data " << o.step.data << " holds " << s.data->size() << " tokens, fewer than one sequence of --seq-len "
        << o.step.seq_len << " needs (" << o.step.seq_len + 1 << "); give a longer file or a shorter --seq-len";
    init_from(*s.runtime, o.step.init);
  });
  comm::Comm& cm = s.comm(world);
  prepare_groups(cm, s.schedule, s.config);
  const i64 M = sequences_of(o, *s.data);
  // Where the run will stand before it starts, and (for more than one sequence) how it goes:
  // a sequence of a million tokens takes minutes, and a grid of them hours.
  EvalProgress progress;
  if (world.rank() == 0) {
    const std::size_t host = s.schedule.place.kv_layers(KvPlace::Host).size();
    const std::string kv = host == 0 ? "on the device"
                                     : "of " + std::to_string(host) + " of " + std::to_string(s.config.layers) +
                                           " layers on the host";
    std::printf("eval: %lld sequence(s) of %lld tokens, %lld subsequence(s), K/V %s; predicted peaks: device %s, "
                "host %s\n",
                (long long)M, (long long)o.step.seq_len, (long long)s.lengths.size(), kv.c_str(),
                format_bytes(double(s.predicted_peak_bytes)).c_str(),
                format_bytes(double(s.predicted_host_bytes)).c_str());
    std::fflush(stdout);
    // A line every 10 s or so while sequences remain.
    progress = [shown = 0.0](i64 done, i64 of, double seconds) mutable {
      if (done == of || seconds - shown < 10) return;
      shown = seconds;
      std::printf("  sequence %lld of %lld: %.0f s so far, about %.0f s to go\n", (long long)done, (long long)of,
                  seconds, seconds / double(done) * double(of - done));
      std::fflush(stdout);
    };
  }
  EvalSums e;
  on_this_rank(cm, [&] {
    e = evaluate(*s.runtime, s.schedule, s.layout, cm, *s.data, s.labels.get(), M, progress);
  });
  if (world.rank() != 0) return 0;
  const bool labeled = s.labels != nullptr;
  print_eval(e, s, labeled);
  if (!o.out.empty()) {
    std::filesystem::create_directories(o.out);
    write_json_file(o.out + "/eval.json", eval_json(e, s, labeled));
    std::ofstream svg(o.out + "/loss_by_position.svg");
    svg << io::svg_loss_by_position(position_bins(e), "Loss by position: " + std::to_string(s.schedule.seq_len()) +
                                                          " tokens, " + std::to_string(e.sequences) + " sequence(s)");
    SPPO_CHECK(svg.good(), "io") << "error writing " << o.out << "/loss_by_position.svg";
    std::printf("-> %s/eval.json, %s/loss_by_position.svg\n", o.out.c_str(), o.out.c_str());
  }
  return 0;
}

}  // namespace sppo
