#include "train/trainer.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "io/checkpoint.h"
#include "io/metrics.h"
#include "io/safetensors.h"
#include "kernels/ops.h"
#include "sim/simulator.h"
#include "train/setup.h"

namespace sppo {

namespace {

float lr_at(const TrainOptions& o, int step) {  // step counts from 0
  if (o.warmup > 0 && step < o.warmup) return o.lr * float(step + 1) / float(o.warmup);
  const int decay = std::max(1, o.steps - o.warmup);
  const double progress = std::min(1.0, double(step - o.warmup) / double(decay));
  const double cosine = 0.5 * (1.0 + std::cos(M_PI * progress));
  return float(o.lr * (o.min_lr_ratio + (1.0 - o.min_lr_ratio) * cosine));
}

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

std::vector<io::CheckpointTensor> tensors_of(const ModelConfig& c, float* base, const char* suffix) {
  std::vector<io::CheckpointTensor> t;
  float* p = base;
  for (const auto& s : parameter_specs(c)) {
    t.push_back({s.name + suffix, s.shape, p});
    p += s.numel();
  }
  return t;
}

void apply_threads(int threads) {
  if (threads > 0) omp_set_num_threads(threads);
}

void write_json_file(const std::string& path, const nlohmann::json& j) {
  std::ofstream f(path);
  SPPO_CHECK(f.good(), "io") << "cannot write " << path;
  f << j.dump(2) << "\n";
  SPPO_CHECK(f.good(), "io") << "error writing " << path;
}

// The measured step in the simulator's result form, so that the runtime and the simulator
// write the same Chrome trace and SVG timeline.
sim::SimResult measured_as_sim(const StepResult& r, i64 tokens) {
  sim::SimResult m;
  m.step_time_s = r.step_s;
  m.tokens_per_device_per_s = double(tokens) / r.step_s;
  m.exposed_copy_s = r.exposed_copy_s;
  m.peak_bytes = {r.device.peak};
  m.peak_device_bytes = r.device.peak;
  double busy = 0;
  for (const TraceSpan& t : r.trace) {
    const sim::Lane lane = t.lane == Lane::Compute ? sim::Lane::Compute
                           : t.lane == Lane::CopyOut ? sim::Lane::CopyOut
                                                     : sim::Lane::CopyIn;
    m.events.push_back({0, lane, t.kind, t.name, t.start_s, t.dur_s});
    if (t.lane == Lane::Compute && (t.kind == sched::OpKind::Forward || t.kind == sched::OpKind::Backward))
      busy += t.dur_s;
  }
  m.compute_s = busy;
  m.bubble_ratio = busy > 0 ? (r.step_s - busy) / busy : 0;
  m.memory = {r.memory};
  return m;
}

void write_timelines(const TrainOptions& o, const StepResult& r, i64 S) {
  if (o.trace_path.empty() && o.svg_path.empty()) return;
  sim::write_timelines(measured_as_sim(r, S), o.trace_path, o.svg_path,
                       "measured step: S " + std::to_string(S) + ", " + o.step.model_name);
}

}  // namespace

int run_train(const TrainOptions& o) {
  apply_threads(o.step.threads);
  SPPO_CHECK(o.steps >= 1, "options") << "--steps must be at least 1 (got " << o.steps << ")";
  SPPO_CHECK(o.lr > 0, "options") << "--lr must be positive (got " << o.lr << ")";
  SPPO_CHECK(o.save_every >= 0, "options") << "--save-every must be >= 0";
  StepSetup s = make_setup(o.step);
  Runtime& rt = *s.runtime;
  const ModelConfig& c = s.config;
  const i64 S = o.step.seq_len;
  const i64 P = c.num_params();
  rt.record_memory(!o.trace_path.empty() || !o.svg_path.empty());

  int start_step = 0;
  auto weights = tensors_of(c, rt.params(), "");
  std::vector<io::CheckpointTensor> opt_state = tensors_of(c, rt.adam_m(), ".m");
  for (auto& t : tensors_of(c, rt.adam_v(), ".v")) opt_state.push_back(t);
  if (!o.resume_dir.empty()) {
    std::string from;
    nlohmann::json state = io::load_checkpoint(o.resume_dir, weights, opt_state, &from);
    SPPO_CHECK(model_config_from_json(state.at("config")).hidden == c.hidden &&
                   state.at("config") == to_json(c), "checkpoint")
        << "checkpoint " << from << " holds a model " << state.at("config").dump()
        << ", not the requested " << to_json(c).dump() << "; pass the same model options";
    start_step = state.at("step").get<int>();
    s.data->seek(state.at("data_position"));
    SPPO_CHECK(start_step <= o.steps, "checkpoint")
        << "checkpoint is at step " << start_step << " but --steps is " << o.steps
        << "; raise --steps to continue training";
  } else {
    init_params(c, rt.params(), o.step.seed);
  }

  std::unique_ptr<io::JsonlWriter> metrics;
  if (!o.metrics_path.empty())
    metrics = std::make_unique<io::JsonlWriter>(
        o.metrics_path, start_step > 0 ? io::JsonlWriter::Mode::Append : io::JsonlWriter::Mode::Truncate);
  const bool tty = isatty(STDERR_FILENO);
  if (!o.quiet) {
    std::fprintf(stderr, "sppo train: %s (%.2fM params, H %d, L %d, Z %d, V %d) | S %lld in %zu subseqs | offload %s | data %s | %d threads\n",
                 o.step.model_name.c_str(), double(P) / 1e6, c.hidden, c.layers, c.heads, c.vocab,
                 (long long)S, s.lengths.size(), o.step.offload.c_str(), s.data->describe().c_str(),
                 omp_get_max_threads());
  }

  auto save = [&](int step_done) {
    nlohmann::json state = {{"step", step_done},
                            {"data_position", s.data->position()},
                            {"config", to_json(c)},
                            {"seed", o.step.seed},
                            {"seq_len", S}};
    io::save_checkpoint(o.save_dir, weights, opt_state, state);
  };

  std::vector<std::int32_t> tokens(std::size_t(S + 1));
  const i64 half = io::repeat_start(S);
  const auto t_run = std::chrono::steady_clock::now();
  std::vector<double> step_times;
  for (int step = start_step; step < o.steps; ++step) {
    s.data->next(tokens.data(), S + 1);
    StepResult r = rt.step(s.schedule, tokens.data());
    // Optimizer: clip the global norm, then AdamW per tensor (no decay on vectors).
    const double norm = std::sqrt(cpu::sum_squares(rt.grads(), P));
    SPPO_CHECK(std::isfinite(r.loss) && std::isfinite(norm), "train")
        << "loss or gradient is not finite at step " << step + 1 << "; lower --lr";
    if (o.clip > 0 && norm > o.clip) cpu::scale_inplace(rt.grads(), P, float(o.clip / norm));
    const float lr = lr_at(o, step);
    i64 off = 0;
    for (const auto& spec : parameter_specs(c)) {
      const i64 n = spec.numel();
      const float wd = spec.shape.size() == 2 ? o.weight_decay : 0.0f;
      cpu::adamw_step(rt.params() + off, rt.adam_m() + off, rt.adam_v() + off, rt.grads() + off,
                      n, lr, o.beta1, o.beta2, o.adam_eps, wd, step + 1);
      off += n;
    }
    step_times.push_back(r.step_s);
    const int done = step + 1;
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_run).count();
    const double eta = elapsed / double(done - start_step) * double(o.steps - done);
    const double tps = double(S) / r.step_s;
    nlohmann::json m = {{"step", done},
                        {"loss", r.loss},
                        {"lr", lr},
                        {"grad_norm", norm},
                        {"step_time_s", r.step_s},
                        {"tokens_per_s", tps},
                        {"peak_device_bytes", r.device.peak},
                        {"offloaded_bytes", r.offloaded_bytes},
                        {"exposed_copy_s", r.exposed_copy_s}};
    std::string halves;
    if (s.repeat_task) {
      const double first = mean_loss(r.losses, 0, half), second = mean_loss(r.losses, half, S);
      m["loss_first_half"] = first;
      m["loss_second_half"] = second;
      char buf[64];
      std::snprintf(buf, sizeof buf, " (1st half %.3f, 2nd %.3f)", first, second);
      halves = buf;
    }
    if (metrics) metrics->write(m);
    if (!o.quiet) {
      std::fprintf(stderr, "%sstep %d/%d | loss %.4f%s | %s tok/s | peak %s | offloaded %s | ETA %s%s",
                   tty ? "\r\033[K" : "", done, o.steps, r.loss, halves.c_str(), fmt_rate(tps).c_str(),
                   format_bytes(double(r.device.peak)).c_str(),
                   format_bytes(double(r.offloaded_bytes)).c_str(), fmt_duration(eta).c_str(),
                   tty && done < o.steps ? "" : "\n");
    }
    if (done == o.steps || (o.stop_after > 0 && done == o.stop_after)) write_timelines(o, r, S);
    const bool stopping = o.stop_after > 0 && done == o.stop_after && done < o.steps;
    if (!o.save_dir.empty() &&
        ((o.save_every > 0 && done % o.save_every == 0) || done == o.steps || stopping))
      save(done);
    if (stopping) break;
  }
  // Summary: the measured step time (median, the first step excluded as warm-up) beside the
  // simulator's prediction of the same schedule on this machine's profile.
  const std::size_t warmup = step_times.size() > 1 ? 1 : 0;
  std::vector<double> timed(step_times.begin() + std::ptrdiff_t(warmup), step_times.end());
  std::sort(timed.begin(), timed.end());
  const double measured = timed.empty() ? 0 : timed[timed.size() / 2];
  nlohmann::json summary = {{"summary", true},
                            {"step", start_step + int(step_times.size())},
                            {"measured_step_time_s", measured},
                            {"predicted_peak_device_bytes", s.predicted_peak_bytes},
                            {"measured_peak_device_bytes", rt.device().stats().peak}};
  if (s.profile_measured) {
    summary["simulated_step_time_s"] = s.predicted_step_s;
    summary["profile"] = s.profile.name;
  }
  if (metrics) metrics->write(summary);
  if (!o.quiet) {
    std::fprintf(stderr, "done: %d steps, step time %.3f s measured (median)",
                 int(step_times.size()), measured);
    if (s.profile_measured) std::fprintf(stderr, ", %.3f s simulated on profile %s", s.predicted_step_s, s.profile.name.c_str());
    std::fprintf(stderr, "; peak device memory %s measured", format_bytes(double(rt.device().stats().peak)).c_str());
    if (s.predicted_peak_bytes > 0)
      std::fprintf(stderr, ", %s predicted", format_bytes(double(s.predicted_peak_bytes)).c_str());
    std::fprintf(stderr, "\n");
  }
  return 0;
}

int run_grads(const StepOptions& o, const std::string& out_dir, const std::string& init_from) {
  apply_threads(o.threads);
  SPPO_CHECK(!out_dir.empty(), "options") << "sppo grads needs --out DIR";
  StepSetup s = make_setup(o);
  Runtime& rt = *s.runtime;
  const ModelConfig& c = s.config;
  const i64 S = o.seq_len;
  if (!init_from.empty()) {
    // A checkpoint is loaded whole (its optimizer state lands in the unused moments).
    auto weights = tensors_of(c, rt.params(), "");
    auto opt_state = tensors_of(c, rt.adam_m(), ".m");
    for (auto& t : tensors_of(c, rt.adam_v(), ".v")) opt_state.push_back(t);
    io::load_checkpoint(init_from, weights, opt_state);
  } else {
    init_params(c, rt.params(), o.seed);
  }
  std::vector<std::int32_t> tokens(std::size_t(S + 1));
  s.data->next(tokens.data(), S + 1);
  StepResult r = rt.step(s.schedule, tokens.data());

  std::filesystem::create_directories(out_dir);
  write_json_file(out_dir + "/config.json", to_json(c));
  {
    std::vector<std::uint32_t> u(tokens.begin(), tokens.end());
    std::ofstream f(out_dir + "/tokens.u32", std::ios::binary);
    f.write(reinterpret_cast<const char*>(u.data()), std::streamsize(u.size() * 4));
    SPPO_CHECK(f.good(), "io") << "error writing " << out_dir << "/tokens.u32";
  }
  auto views = [&](float* base) {
    std::vector<io::TensorView> v;
    for (const auto& t : tensors_of(c, base, "")) v.push_back({t.name, io::DType::F32, t.shape, t.data});
    return v;
  };
  io::write_safetensors(out_dir + "/weights.safetensors", views(rt.params()));
  io::write_safetensors(out_dir + "/grads.safetensors", views(rt.grads()));
  nlohmann::json result = {{"loss", r.loss},
                           {"seq_len", S},
                           {"subseqs", s.lengths.size()},
                           {"lengths", s.lengths},
                           {"alpha", s.alpha},
                           {"recompute", o.recompute},
                           {"peak_device_bytes", r.device.peak},
                           {"offloaded_bytes", r.offloaded_bytes},
                           {"step_time_s", r.step_s}};
  write_json_file(out_dir + "/result.json", result);
  std::printf("loss %.6f -> %s\n", r.loss, out_dir.c_str());
  return 0;
}

}  // namespace sppo
