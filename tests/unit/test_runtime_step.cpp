// The runtime on real steps (Runtime::step): offload copies run while compute does, and the
// device arena's measured peak equals the simulator's prediction for the same schedule.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/check.h"
#include "io/fileutil.h"
#include "runtime/executor.h"
#include "schedule/memory.h"
#include "train/parallel.h"
#include "train/profile_machine.h"
#include "support/nominal_profile.h"
#include "train/setup.h"

namespace sppo {
namespace {

using testing::nominal_profile_path;

StepOptions step_options(const std::string& model, i64 S, const std::string& subseqs, const std::string& offload,
                         i64 budget = 0) {
  StepOptions o;
  o.model = preset(model);
  o.model_name = model;
  o.seq_len = S;
  o.subseqs = subseqs;
  o.offload = offload;
  o.device_memory = budget;
  o.hardware = nominal_profile_path();
  return o;
}

// One step of `s` from the seed's weights and the first sequence of its data.
StepResult run_step(StepSetup& s, i64 S) {
  init_owned(*s.runtime, 1234);
  std::vector<std::int32_t> tokens(std::size_t(S + 1));
  s.data->next(tokens.data(), S + 1);
  return s.runtime->step(s.schedule, tokens.data());
}

bool overlap(const TraceSpan& a, const TraceSpan& b) {
  return std::max(a.start_s, b.start_s) < std::min(a.start_s + a.dur_s, b.start_s + b.dur_s);
}

// How many of a step's offload copies ran while a forward or backward pass computed.
int overlapped_copies(const StepResult& r) {
  std::vector<TraceSpan> copies, compute;
  for (const TraceSpan& t : r.trace) {
    if (t.lane == Lane::CopyOut) copies.push_back(t);
    if (t.lane == Lane::Compute && (t.kind == sched::OpKind::Forward || t.kind == sched::OpKind::Backward))
      compute.push_back(t);
  }
  EXPECT_EQ(copies.size(), 3u) << "one offload per subsequence but the last";
  int overlapped = 0;
  for (const TraceSpan& c : copies) {
    EXPECT_GT(c.dur_s, 0.0) << c.name;
    for (const TraceSpan& f : compute)
      if (overlap(c, f)) {
        ++overlapped;
        break;
      }
  }
  return overlapped;
}

TEST(RuntimeStep, OffloadCopiesOverlapCompute) {
  const i64 S = 2048;
  StepSetup s = make_setup(step_options("small", S, "4", "full"));
  // A copy made on the compute thread never overlaps a pass. An asynchronous one can miss
  // in one step when ctest keeps both cores busy (the copy thread runs its millisecond
  // while the compute thread waits for a core), so the step gets a few tries.
  int overlapped = 0;
  for (int attempt = 0; attempt < 5 && overlapped == 0; ++attempt) {
    const StepResult r = run_step(s, S);
    EXPECT_GT(r.offloaded_bytes, 0);
    overlapped = overlapped_copies(r);
  }
  EXPECT_GE(overlapped, 1) << "no offload ran while a subsequence computed, in 5 steps";
}

struct PeakCase {
  const char* model;
  i64 S;
  const char* subseqs;
  const char* offload;
  double budget_fraction;  // of the unbudgeted, unoffloaded peak; 0: no budget
  const char* kv_cache = "device";
  const char* partition = "length";
  const char* recompute = "none";  // --recompute-tensors
  const char* optimizer = "device";  // --optimizer-state
  i64 mlp_tile_rows = 0;           // --mlp-tile-rows
  const char* backward = "subseq"; // --backward-order
  const char* weights = "auto";    // --weights
  int layers = 0;                  // the preset's layers (0), or these
  const char* residual = "device"; // --residual-grads
  const char* rebuild = "none";    // --rebuild-inputs
};

TEST(RuntimeStep, MeasuredPeakEqualsTheSimulatorsPrediction) {
  const PeakCase cases[] = {
      {"tiny", 256, "1", "none", 0},          {"tiny", 1024, "4", "none", 0},
      {"tiny", 1024, "4", "0.5", 0},          {"tiny", 1024, "4", "full", 0},
      {"tiny", 1000, "3", "0.3", 0},          {"small", 1024, "8", "full", 0},
      {"small", 1024, "8", "adaptive", 0.75}, {"small", 1024, "auto", "adaptive", 0.5},
      {"medium", 512, "2", "full", 0},
      // K/V on the host: the window, the K/V and their dK/dV sums on the host.
      {"tiny", 1024, "4", "none", 0, "host"}, {"tiny", 1000, "3", "0.3", 0, "host"},
      {"small", 1024, "8", "full", 0, "host"}, {"small", 1024, "1", "none", 0, "host"},
      {"small", 2048, "8", "adaptive", 0.45, "auto"},
      // Equal FLOPs: the first subsequences are longer than later ones, whose attention
      // streams them in several chunks.
      {"tiny", 4096, "8", "0.5", 0, "host", "flops"},
      // K/V recomputed from x: the window holds x and the LayerNorm's output too, the host
      // the d(LayerNorm-1 output) sums; with offload an x streams back from the host.
      {"tiny", 1024, "4", "none", 0, "recompute"}, {"tiny", 1000, "3", "0.3", 0, "recompute"},
      {"small", 1024, "8", "full", 0, "recompute"}, {"tiny", 4096, "8", "0.5", 0, "recompute", "flops"},
      // Saved tensors recomputed in backward (Note [Recomputed tensors]).
      {"tiny", 1024, "4", "0.5", 0, "device", "length", "ln1,ln2,fc_pre"},
      {"small", 1024, "8", "full", 0, "device", "length", "all"},
      {"small", 1024, "8", "0.5", 0, "host", "length", "ln1,q,x_mid,ln2,fc_pre"},
      {"tiny", 1000, "3", "full", 0, "recompute", "flops", "q,fc_pre"},
      // The loss in backward (Note [The loss in backward]): the last layer's output and the
      // head's workspace inside its backward; head_grad is not offloaded.
      {"tiny", 1000, "3", "0.3", 0, "device", "length", "head_grad"},
      {"small", 1024, "8", "full", 0, "device", "flops", "fc_pre,head_grad", "device", 100},
      // The attention recomputed on streamed layers: a forward window, then the backward's.
      {"small", 1024, "8", "0.5", 0, "host", "length", "all"},
      {"tiny", 4096, "8", "0.5", 0, "recompute", "flops", "all"},
      // Under a budget nothing else fits: auto recomputes.
      {"small", 2048, "8", "adaptive", 0.35, "auto", "length", "auto"},
      // The optimizer state on the host: its master, m, v and gradients' copy there too.
      {"tiny", 1000, "3", "0.3", 0, "device", "length", "none", "host"},
      {"small", 1024, "8", "full", 0, "host", "length", "none", "host"},
      {"small", 1024, "8", "adaptive", 0.5, "device", "length", "none", "host"},
      // MLP tiles (Note [MLP tiles]): with fc_pre kept, and recomputed a tile at a time;
      // tiles that do not divide T, and longer than T.
      {"tiny", 1024, "1", "none", 0, "device", "length", "none", "device", 100},
      {"tiny", 1000, "3", "0.3", 0, "device", "length", "ln1,ln2,fc_pre", "device", 64},
      {"small", 1024, "8", "full", 0, "host", "length", "fc_pre", "device", 37},
      {"small", 1024, "1", "none", 0, "device", "length", "all", "device", 256},
      {"tiny", 1000, "3", "full", 0, "device", "flops", "q,fc_pre", "device", 5000},
      // The layer-major backward (Note [Layer-major backward]): one layer's dK/dV sums, each
      // layer's part of a unit prefetched alone, the residual gradients waiting between
      // layers; with every placement and the loss in backward.
      {"tiny", 1024, "4", "none", 0, "device", "length", "none", "device", 0, "layer"},
      {"tiny", 1000, "3", "0.3", 0, "device", "length", "none", "device", 0, "layer"},
      {"small", 1024, "8", "full", 0, "device", "flops", "none", "device", 0, "layer"},
      {"small", 1024, "8", "0.5", 0, "host", "length", "none", "device", 0, "layer"},
      {"tiny", 4096, "8", "0.5", 0, "recompute", "flops", "all", "device", 0, "layer"},
      {"small", 1024, "8", "full", 0, "device", "length", "fc_pre,head_grad", "host", 100, "layer"},
      // Under a budget the subsequence order does not fit: auto runs the layers' order.
      {"small", 2048, "8", "adaptive", 0.45, "device", "length", "none", "device", 0, "auto"},
      // The layers' weights on the host (Note [Weights on the host]): each layer's working
      // copy from the use before its own to its last in a row, its gradient from its first
      // backward to the use after its last; in both orders, with offload, every K/V
      // placement, recomputed tensors, MLP tiles and a budget.
      {"tiny", 256, "1", "none", 0, "device", "length", "none", "host", 0, "subseq", "host"},
      {"tiny", 1000, "3", "0.3", 0, "device", "length", "none", "host", 0, "subseq", "host", 5},
      {"tiny", 1024, "4", "none", 0, "device", "length", "none", "host", 0, "layer", "host", 6},
      {"small", 1024, "8", "full", 0, "host", "length", "none", "host", 0, "layer", "host"},
      {"small", 1024, "8", "0.5", 0, "device", "flops", "fc_pre,head_grad", "host", 100, "subseq", "host"},
      {"tiny", 4096, "8", "0.5", 0, "recompute", "flops", "all", "host", 0, "layer", "host"},
      {"small", 2048, "8", "adaptive", 0.3, "device", "length", "none", "host", 0, "layer", "host", 4},
      // The residual gradients on the host between the layers (Note [Residual gradients on
      // the host]): sent at each B's end, back at the next one's start.
      {"tiny", 1024, "4", "none", 0, "device", "length", "none", "device", 0, "layer", "auto", 0, "host"},
      {"small", 1024, "8", "0.5", 0, "host", "length", "none", "device", 0, "layer", "auto", 0, "host"},
      {"tiny", 4096, "8", "0.5", 0, "recompute", "flops", "all", "host", 0, "layer", "host", 0, "host"},
      {"small", 1024, "8", "full", 0, "device", "length", "fc_pre,head_grad", "host", 100, "auto", "auto", 0, "host"},
      // Rebuilt layer inputs (Note [Rebuilt layer inputs]): the layer below's forward again
      // at the start of each B op, its saved tensors, workspace and window with it; the
      // rebuilt layers' K/V on the host where the others' are recomputed.
      {"tiny", 1024, "4", "none", 0, "device", "length", "none", "device", 0, "layer", "auto", 0, "device", "odd"},
      {"small", 1024, "8", "none", 0, "recompute", "length", "all", "device", 0, "auto", "auto", 0, "device", "odd"},
      {"tiny", 1000, "3", "none", 0, "recompute", "flops", "ln1,ln2,fc_pre", "device", 64, "layer", "auto", 0, "device",
       "1"},
      {"tiny", 4096, "8", "0.5", 0, "recompute", "flops", "all", "host", 0, "layer", "auto", 0, "host", "odd"},
      // With the layers' weights on the host the layer below's come with the first B op of
      // a rebuilt layer's run.
      {"small", 1024, "8", "none", 0, "recompute", "length", "all", "host", 0, "layer", "host", 0, "device", "odd"},
      {"tiny", 1000, "3", "0.3", 0, "device", "flops", "fc_pre,head_grad", "host", 100, "layer", "host", 4, "host",
       "1,3"},
  };
  for (const PeakCase& c : cases) {
    i64 budget = 0;
    if (c.budget_fraction > 0) {
      StepOptions w = step_options(c.model, c.S, "1", "none");
      if (c.layers > 0) w.model.layers = c.layers;
      const StepSetup whole = make_setup(w);
      budget = i64(double(whole.predicted_peak_bytes) * c.budget_fraction);
    }
    StepOptions o = step_options(c.model, c.S, c.subseqs, c.offload, budget);
    if (c.layers > 0) o.model.layers = c.layers;
    o.place.kv = parse_kv_cache(c.kv_cache);
    o.partition = c.partition;
    o.place.recompute = parse_recompute_option(c.recompute);
    o.place.optimizer_state = parse_tier_option(c.optimizer, "--optimizer-state");
    o.mlp_tile_rows = c.mlp_tile_rows;
    o.place.backward = parse_backward_order_option(c.backward);
    o.place.weights = parse_tier_option(c.weights, "--weights");
    o.place.residual_grads = parse_tier(c.residual, "--residual-grads");
    o.place.rebuild = parse_rebuild_inputs(c.rebuild);
    StepSetup s = make_setup(o);
    ASSERT_GT(s.predicted_peak_bytes, 0);
    s.runtime->device().reset_peak();
    const StepResult r = run_step(s, c.S);
    const std::string what = std::string(c.model) + " S " + std::to_string(c.S) + " N " + c.subseqs + " (" +
                             std::to_string(s.lengths.size()) + ") offload " + c.offload + " budget " +
                             std::to_string(budget) + " kv-cache " + c.kv_cache + " recompute " + c.recompute +
                             " optimizer state " + c.optimizer +
                             " mlp tiles " + std::to_string(c.mlp_tile_rows) + " backward " + c.backward +
                             " weights " + c.weights + " residual gradients " + c.residual + " rebuilt inputs " +
                             c.rebuild;
    EXPECT_EQ(s.schedule.place.any_input_rebuilt(), std::string(c.rebuild) != "none") << what;
    EXPECT_EQ(s.schedule.place.weights_host(), std::string(c.weights) == "host") << what;
    EXPECT_EQ(s.schedule.place.residual_host(), std::string(c.residual) == "host") << what;
    if (std::string(c.backward) != "subseq") {
      EXPECT_EQ(s.schedule.place.backward, BackwardOrder::Layer) << what;
    }
    if (std::string(c.recompute) == "auto") {
      const bool kv_recomputed = std::count(s.schedule.place.kv.begin(), s.schedule.place.kv.end(),
                                            KvPlace::Recompute) > 0;
      EXPECT_TRUE(s.schedule.place.recompute != 0 || kv_recomputed) << what << ": the budget should have demanded recomputing";
    }
    if (std::string(c.kv_cache) == "auto") {
      EXPECT_FALSE(s.schedule.place.kv.empty()) << what << ": the budget should have put some K/V on the host";
    }
    // The layer-major backward holds one layer's dK/dV sums, so its peak can fall in the
    // forward beside an offload still copying, whose device bytes go when the copy ends on
    // this machine's clock rather than the simulator's: there the peak is held within 3%.
    const bool in_flight = std::string(c.backward) != "subseq" && std::string(c.offload) != "none";
    if (in_flight) {
      EXPECT_NEAR(double(r.device.peak), double(s.predicted_peak_bytes), 0.03 * double(s.predicted_peak_bytes)) << what;
    } else {
      EXPECT_EQ(s.runtime->device().stats().peak, s.predicted_peak_bytes) << what;
      EXPECT_EQ(r.device.peak, s.predicted_peak_bytes) << what;
    }
    // The host tier holds the offloaded copies; the simulator's host peak is theirs.
    EXPECT_EQ(r.host.peak, s.predicted_host_bytes) << what;
    if (s.schedule.place.kv.empty() && !s.runtime->state_on_host() && !s.schedule.place.residual_host()) {
      EXPECT_EQ(r.host.peak > 0, r.offloaded_bytes > 0) << what;
    }
    if (budget > 0) {
      EXPECT_LE(r.device.peak, budget) << what;
      if (s.schedule.place.kv.empty()) {
        EXPECT_GT(r.offloaded_bytes, 0) << what << ": the budget should have demanded offloading";
      }
    }
  }
}

// --host-memory bounds the offloaded copies. Without offload every subsequence's
// activations stay on the device, so the bytes that must leave it hardly fall with N: a
// host budget under what the device budget forces out fits nothing, and says so; one at
// it fits, and the run holds what was predicted. A fixed ratio over the budget is refused
// before any work, naming the budget that would do.
TEST(RuntimeStep, HostBudgetBoundsTheOffloadedCopies) {
  const i64 S = 2048;
  const StepSetup whole = make_setup(step_options("small", S, "1", "none"));
  StepOptions o = step_options("small", S, "auto", "adaptive", whole.predicted_peak_bytes / 2);
  const StepSetup unbounded = make_setup(o);
  ASSERT_GT(unbounded.predicted_host_bytes, 0) << "the device budget should demand offloading";

  o.host_memory = unbounded.predicted_host_bytes;
  StepSetup at = make_setup(o);
  EXPECT_LE(at.predicted_host_bytes, o.host_memory);
  EXPECT_LE(at.predicted_peak_bytes, o.device_memory);
  const StepResult r = run_step(at, S);
  EXPECT_EQ(r.host.peak, at.predicted_host_bytes);
  EXPECT_LE(r.device.peak, o.device_memory);

  o.host_memory = unbounded.predicted_host_bytes / 2;
  o.place.recompute = parse_recompute_option("none");  // recomputing would fit (RecomputeFitsWhereOffloadDoesNot)
  try {
    make_setup(o);
    ADD_FAILURE() << "a host budget of half what must leave the device was accepted";
  } catch (const DoesNotFit& e) {
    EXPECT_NE(std::string(e.what()).find("nothing fits both budgets"), std::string::npos) << e.what();
  }

  const StepSetup full = make_setup(step_options("small", S, "8", "full"));
  ASSERT_GT(full.predicted_host_bytes, 0);
  StepOptions fixed = step_options("small", S, "8", "full");
  fixed.host_memory = full.predicted_host_bytes / 2;
  try {
    make_setup(fixed);
    ADD_FAILURE() << "--offload full over --host-memory was accepted";
  } catch (const DoesNotFit& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("--host-memory " + std::to_string(full.predicted_host_bytes) + " or more"), std::string::npos)
        << m;
  }
}

// Steps of training (step, then optimizer_step) from the seed's weights, on one process.
struct Trained {
  std::vector<double> losses;
  std::vector<float> params, m, v;
  std::vector<StepResult> steps;
};
Trained train_steps(StepSetup& s, i64 S, int steps) {
  const auto solo = comm::make_solo();
  init_owned(*s.runtime, 1234);
  Runtime& rt = *s.runtime;
  Trained out;
  std::vector<std::int32_t> tokens(std::size_t(S + 1));
  for (int t = 1; t <= steps; ++t) {
    s.data->next(tokens.data(), S + 1);
    out.steps.push_back(rt.step(s.schedule, tokens.data()));
    out.losses.push_back(out.steps.back().loss);
    // Clipped (the first steps' norms are over 0.1), with weight decay.
    optimizer_step(rt, s.layout, *solo, AdamWSettings{5e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.1f}, t);
  }
  const i64 n = rt.num_params(), k = rt.num_state();
  out.params.resize(std::size_t(n));
  out.m.resize(std::size_t(k));
  out.v.resize(std::size_t(k));
  rt.read_device(out.params.data(), rt.params(), n);
  rt.read_state(out.m.data(), rt.adam_m(), k);
  rt.read_state(out.v.data(), rt.adam_v(), k);
  return out;
}

// --optimizer-state host: the same AdamW kernel on the host, so the same losses, weights
// and moments to the bit; the device holds 8 B a parameter less (m, v), the host 16 B
// more (master, m, v, the gradients' copy), as predicted, in steps that begin while the
// last update still runs.
TEST(RuntimeStep, OptimizerStateOnTheHostTrainsAsOnTheDevice) {
  for (const char* subseqs : {"1", "3", "8"}) {
    const i64 S = 512;
    StepOptions o = step_options("tiny", S, subseqs, "0.5");
    StepSetup on_device = make_setup(o);
    o.place.optimizer_state = Tier::Host;
    StepSetup on_host = make_setup(o);
    ASSERT_TRUE(on_host.runtime->state_on_host());
    const i64 state = on_host.runtime->num_state();
    EXPECT_EQ(on_device.predicted_peak_bytes - on_host.predicted_peak_bytes, 8 * state) << subseqs;
    EXPECT_EQ(on_host.predicted_host_bytes - on_device.predicted_host_bytes, 16 * state) << subseqs;
    const Trained a = train_steps(on_device, S, 4), b = train_steps(on_host, S, 4);
    EXPECT_EQ(a.losses, b.losses) << "N " << subseqs;
    EXPECT_LT(a.losses.back(), a.losses.front()) << "the steps should learn";
    EXPECT_TRUE(a.params == b.params) << "N " << subseqs << ": the weights differ";
    EXPECT_TRUE(a.m == b.m && a.v == b.v) << "N " << subseqs << ": the AdamW moments differ";
    for (std::size_t k = 0; k < b.steps.size(); ++k) {
      EXPECT_EQ(b.steps[k].device.peak, on_host.predicted_peak_bytes) << "N " << subseqs << " step " << k + 1;
      EXPECT_EQ(b.steps[k].host.peak, on_host.predicted_host_bytes) << "N " << subseqs << " step " << k + 1;
      EXPECT_EQ(a.steps[k].device.peak, on_device.predicted_peak_bytes) << "N " << subseqs << " step " << k + 1;
    }
    EXPECT_EQ(on_host.runtime->host_update_bytes(), 8 * state) << "gradients down, weights up, fp32";
  }
}

// --weights host (Note [Weights on the host]): the layers' weights come from the host's
// master for the ops that run them and their gradients go to the host's copy, which the
// update reads in place, so training gives --weights device's losses, weights and moments
// to the bit (both with the optimizer state on the host), in both backward orders and with
// the steps beginning while the last update runs. The device peaks are the predicted ones;
// in the layer order the device holds every other layer's weights and gradients less (at
// the first backward only the last layer's are there). With one subsequence that first
// backward is also the last layer's last: the next layer's weights come in beside it, so
// the peak falls by a layer's weights less. The host holds what it held with --weights
// device (its master and gradients' copy are the layers' own), and only the embedding's,
// final norm's and head's gradients go down and weights up.
TEST(RuntimeStep, WeightsOnTheHostTrainAsOnTheDevice) {
  for (const char* backward : {"subseq", "layer"})
    for (const char* subseqs : {"1", "3", "8"}) {
      const std::string what = std::string("backward ") + backward + " N " + subseqs;
      const i64 S = 256;
      // No offload: a copy that releases device memory at its own time may move a peak on
      // a loaded machine, and these steps compare every peak (the weights' copies release
      // nothing at their own time: Note [Weights on the host]).
      StepOptions o = step_options("tiny", S, subseqs, "none");
      o.model.layers = 6;
      o.place.optimizer_state = Tier::Host;
      o.place.backward = parse_backward_order_option(backward);
      o.place.weights = Tier::Device;
      StepSetup on_device = make_setup(o);
      o.place.weights = Tier::Host;
      StepSetup on_host = make_setup(o);
      ASSERT_TRUE(on_host.runtime->weights_on_host() && on_host.schedule.place.weights_host()) << what;
      const ModelConfig& c = on_host.config;
      const i64 layer = sched::layer_params(c, TpShard{}), resident = on_host.runtime->num_params() - c.layers * layer;
      // Every other layer's fp32 weights and gradients (less a layer's weights on the way
      // with one subsequence).
      const i64 less = (c.layers - 1) * layer * 8 - (std::string(subseqs) == "1" ? layer * 4 : 0);
      if (std::string(backward) == "layer") {
        EXPECT_GE(on_device.predicted_peak_bytes - on_host.predicted_peak_bytes, less) << what;
      } else {
        EXPECT_LT(on_host.predicted_peak_bytes, on_device.predicted_peak_bytes) << what;
      }
      EXPECT_EQ(on_host.predicted_host_bytes, on_device.predicted_host_bytes) << what;
      const Trained a = train_steps(on_device, S, 3), b = train_steps(on_host, S, 3);
      EXPECT_EQ(a.losses, b.losses) << what;
      EXPECT_LT(a.losses.back(), a.losses.front()) << "the steps should learn";
      EXPECT_TRUE(a.params == b.params) << what << ": the weights differ";
      EXPECT_TRUE(a.m == b.m && a.v == b.v) << what << ": the AdamW moments differ";
      for (std::size_t k = 0; k < b.steps.size(); ++k) {
        EXPECT_EQ(b.steps[k].device.peak, on_host.predicted_peak_bytes) << what << " step " << k + 1;
        EXPECT_EQ(b.steps[k].host.peak, on_host.predicted_host_bytes) << what << " step " << k + 1;
        EXPECT_EQ(a.steps[k].device.peak, on_device.predicted_peak_bytes) << what << " step " << k + 1;
        if (std::string(backward) == "layer") {
          EXPECT_GE(a.steps[k].device.peak - b.steps[k].device.peak, less)
              << what << " step " << k + 1 << ": the measured peaks";
        }
      }
      EXPECT_EQ(on_host.runtime->host_update_bytes(), 8 * resident) << what;
    }
}

}  // namespace
}  // namespace sppo
