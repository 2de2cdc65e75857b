#include "cli/cmd_plan.h"

#include "backend/attention_pieces.h"

#include <CLI/CLI.hpp>
#include <omp.h>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <memory>
#include <sstream>

#include "backends/cpu/cpu_backend.h"
#include "cli/commands.h"
#include "cli/config_file.h"
#include "core/check.h"
#include "core/config.h"
#include "planner/profile.h"
#include "runtime/step_io.h"
#include "sim/explain.h"
#include "sim/solver.h"

namespace sppo::cli {

namespace {

sim::PlanRequest request_of(const PlanOptions& o) {
  sim::PlanRequest r;
  r.model_name = o.model;
  r.model = preset(o.model);
  r.seq_len = parse_count(o.seq_len, "--seq-len");
  SPPO_CHECK(o.gpus >= 1, "options") << "--gpus must be at least 1";
  SPPO_CHECK(o.gpus_per_node >= 1, "options") << "--gpus-per-node must be at least 1";
  r.gpus = o.gpus;
  r.gpus_per_node = o.gpus_per_node;
  r.hardware = o.hardware;
  r.hw = plan::load_profile(o.hardware);
  SPPO_CHECK(o.system == "sppo" || o.system == "megatron" || o.system == "deepspeed", "options")
      << "--system must be sppo, megatron or deepspeed (got '" << o.system << "')";
  r.system = plan::parse_system(o.system);
  r.offload = sim::parse_offload(o.offload);
  SPPO_CHECK(o.msp == "auto" || o.msp == "on" || o.msp == "off", "options")
      << "--msp must be on, off or auto (got '" << o.msp << "')";
  if (o.msp != "auto") r.msp = o.msp == "on";
  SPPO_CHECK(o.zero == "auto" || (o.zero.size() == 1 && o.zero[0] >= '0' && o.zero[0] <= '3'), "options")
      << "--zero must be 0, 1, 2, 3 or auto (got '" << o.zero << "')";
  if (o.zero != "auto") r.zero = ZeroStage(o.zero[0] - '0');
  SPPO_CHECK(o.ring_layout == "zigzag" || o.ring_layout == "contiguous", "options")
      << "--ring-layout must be zigzag or contiguous (got '" << o.ring_layout << "')";
  r.ring_layout = parse_ring_layout(o.ring_layout);
  PlacementRequest& pl = r.place;
  pl.kv = parse_kv_cache(o.kv_cache);
  pl.backward = parse_backward_order_option(o.backward_order);
  pl.rebuild = parse_rebuild_inputs(o.rebuild_inputs);
  SPPO_CHECK(pl.rebuild.kind != RebuildRequest::Kind::Layers, "options")
      << "--rebuild-inputs must be none, odd or auto (got '" << o.rebuild_inputs << "'); a plan rebuilds every "
         "other layer's input of each stage, or none";
  if (pl.rebuild.kind == RebuildRequest::Kind::Odd) {
    SPPO_CHECK(pl.backward != BackwardOrder::Subseq, "options")
        << "--rebuild-inputs odd runs the layer below's forward again inside a layer's backward, which only the "
           "layer-major backward orders so: use --backward-order layer (or auto), or --rebuild-inputs auto";
    SPPO_CHECK(pl.kv != KvPlace::Host, "options")
        << "--rebuild-inputs odd: the layer below a rebuilt one cannot stream its K/V from the host; use "
           "--kv-cache device, recompute or auto";
    pl.backward = BackwardOrder::Layer;
  }
  pl.optimizer_state = parse_tier_option(o.optimizer_state, "--optimizer-state");
  pl.weights = parse_tier_option(o.weights, "--weights");
  SPPO_CHECK(pl.weights != Tier::Host || pl.optimizer_state != Tier::Device, "options")
      << "--weights host keeps the layers' weights where the optimizer's update reads them, on the host: it needs "
         "--optimizer-state host or auto (or use --weights device)";
  SPPO_CHECK(pl.weights != Tier::Host || !r.zero || r.zero == ZeroStage::None, "options")
      << "--weights host keeps each rank's whole master on its host: it runs without ZeRO; use --zero 0 or auto";
  if (pl.weights == Tier::Host) pl.optimizer_state = Tier::Host;
  pl.recompute = parse_recompute_option(o.recompute_tensors);
  r.budget = o.budget.empty() ? 0 : parse_bytes(o.budget, "--budget");
  if (!o.host_budget.empty()) r.hw.host_memory = parse_bytes(o.host_budget, "--host-budget");
  // A CPU profile's ranks run the CPU backend's kernels at its threads, whose scratch comes
  // from the device tier as train counts it. A GPU's runs attention through cuDNN (train's
  // --attention auto), whose calls take their scratch from the device tier too; its other
  // kernels keep theirs outside the budget.
  if (r.hw.threads == 0 && r.hw.precision == "bf16")
    r.block_scratch = library_attention_scratch(r.model, std::size_t(dtype_bytes(DType::BF16)));
  if (r.hw.threads > 0 && r.hw.precision == "f32") {
    const int before = omp_get_max_threads();
    omp_set_num_threads(r.hw.threads);
    const std::unique_ptr<Backend> cpu = make_cpu_backend();
    r.block_scratch = cpu->block_scratch(r.model);
    r.head_scratch = cpu->head_scratch(r.model, RuntimeOptions{}.head_chunk);
    omp_set_num_threads(before);
  }
  return r;
}

void print_error_json(const std::string& error) {
  std::cout << nlohmann::json{{"error", error}}.dump() << std::endl;
}

void print_plan(const plan::Plan& p) {
  std::printf("system      %s\n", to_string(p.system));
  const double params = double(p.model.num_params());
  std::printf("model       %s (L %d, H %d, Z %d, %.*f%s parameters)\n", p.model_name.c_str(), p.model.layers,
              p.model.hidden, p.model.heads, params >= 1e9 ? 2 : 1, params >= 1e9 ? params / 1e9 : params / 1e6,
              params >= 1e9 ? "B" : "M");
  std::printf("sequence    %lld tokens on %d devices (%d per node), %s\n", (long long)p.seq_len, p.gpus,
              p.gpus_per_node, p.hardware.c_str());
  std::printf("layout      %s\n", plan::layout_text(p).c_str());
  if (!p.stage_layers.empty()) {
    std::printf("stages      ");
    for (size_t k = 0; k < p.stage_layers.size(); ++k) std::printf("%s%d", k ? "," : "", p.stage_layers[k]);
    std::printf(" layers\n");
  }
  if (p.system == plan::System::Sppo) {
    std::printf("lengths     %lld .. %lld tokens (FLOPs-balanced)\n", (long long)p.lengths.front(),
                (long long)p.lengths.back());
    double mx = 0, sum = 0;
    for (double a : p.alpha) {
      mx = std::max(mx, a);
      sum += a;
    }
    std::printf("alpha       mean %.3f, max %.3f (%s)\n", p.alpha.empty() ? 0.0 : sum / p.alpha.size(), mx,
                p.alpha_rule.c_str());
  }
  std::printf("step        %.4g s\n", p.predicted.step_time_s);
  std::printf("throughput  %.1f tokens/GPU/s\n", p.predicted.tokens_per_gpu_per_s);
  std::printf("bubble      %.4f\n", p.predicted.bubble_ratio);
  std::printf("exposed     %.4g s of copies\n", p.predicted.exposed_copy_s);
  std::printf("peak        %s per device (budget %s)\n", format_bytes(double(p.predicted.peak_device_bytes)).c_str(),
              format_bytes(double(p.budget)).c_str());
  if (p.predicted.peak_host_bytes > 0) std::printf("host        %s per device\n",
                                                   format_bytes(double(p.predicted.peak_host_bytes)).c_str());
  for (const auto& n : p.notes) std::printf("note        %s\n", n.c_str());
}

template <typename F>
int guarded(F&& f) {
  try {
    return f();
  } catch (const Error& e) {
    std::cerr << e.what() << std::endl;
    return 2;
  }
}

}  // namespace

int run_plan(const PlanOptions& o) {
  if (o.table) return run_plan_table(o);
  return guarded([&] {
    const sim::PlanRequest req = request_of(o);
    const sim::PlanOutcome out = sim::solve_plan(req);
    if (!out.ok) {
      print_error_json(out.error);
      if (!o.json) std::cerr << "[planner] " << out.error << std::endl;
      return 3;
    }
    const nlohmann::json j = plan::to_json(out.plan);
    if (!o.out.empty()) {
      std::ofstream f(o.out);
      SPPO_CHECK(f.good(), "planner") << "cannot write " << o.out;
      f << j.dump(2) << "\n";
    }
    if (o.explain) {
      const sim::MemoryExplain m = sim::explain_memory(out.plan, req.hw);
      if (o.json) {
        nlohmann::json both = j;
        both["memory"] = sim::to_json(m);
        std::cout << both.dump() << std::endl;
      } else {
        print_plan(out.plan);
        std::printf("\n%s", sim::explain_text(m).c_str());
      }
      return 0;
    }
    if (o.json) std::cout << j.dump() << std::endl;
    else print_plan(out.plan);
    return 0;
  });
}

int run_plan_table(const PlanOptions& o) {
  return guarded([&] {
    struct Row {
      const char* model;
      const char* seq;
      int gpus;
    };
    const Row rows[] = {{"gpt-7b", "1M", 32},    {"gpt-7b", "2M", 64},    {"gpt-7b", "4M", 128},
                        {"gpt-13b", "512K", 32}, {"gpt-13b", "768K", 48}, {"gpt-13b", "1024K", 64},
                        {"gpt-13b", "1280K", 80}, {"gpt-65b", "512K", 64}, {"gpt-65b", "768K", 96},
                        {"gpt-65b", "1024K", 128}};
    nlohmann::json all = nlohmann::json::array();
    if (!o.json)
      std::printf("%-8s %6s %5s | %-10s %-28s %10s %10s\n", "model", "seq", "gpus", "system", "plan", "tok/GPU/s",
                  "peak");
    for (const Row& r : rows) {
      for (const char* system : {"sppo", "megatron", "deepspeed"}) {
        PlanOptions p = o;
        p.model = r.model;
        p.seq_len = r.seq;
        p.gpus = r.gpus;
        p.system = system;
        const auto t0 = std::chrono::steady_clock::now();
        const sim::PlanOutcome out = sim::solve_plan(request_of(p));
        const double solve_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        nlohmann::json j = {{"model", r.model}, {"seq_len", r.seq}, {"gpus", r.gpus}, {"system", system}};
        if (out.ok) {
          j["plan"] = plan::layout_text(out.plan);
          j["tokens_per_gpu_per_s"] = out.plan.predicted.tokens_per_gpu_per_s;
          j["peak_device_bytes"] = out.plan.predicted.peak_device_bytes;
          j["step_time_s"] = out.plan.predicted.step_time_s;
          j["bubble_ratio"] = out.plan.predicted.bubble_ratio;
        } else {
          j["error"] = out.error;
        }
        j["solve_s"] = solve_s;
        if (!o.json) {
          if (out.ok)
            std::printf("%-8s %6s %5d | %-10s %-28s %10.1f %10s\n", r.model, r.seq, r.gpus, system,
                        plan::layout_text(out.plan).c_str(), out.plan.predicted.tokens_per_gpu_per_s,
                        format_bytes(double(out.plan.predicted.peak_device_bytes)).c_str());
          else
            std::printf("%-8s %6s %5d | %-10s %-28s %10s %10s\n", r.model, r.seq, r.gpus, system, "-", "OOM", "-");
          std::fflush(stdout);
        }
        all.push_back(j);
      }
    }
    if (o.json) std::cout << all.dump(1) << std::endl;
    return 0;
  });
}

int run_simulate(const SimulateOptions& o) {
  return guarded([&] {
    std::ifstream in(o.plan);
    SPPO_CHECK(in.good(), "sim") << "cannot open plan " << o.plan;
    nlohmann::json j;
    try {
      in >> j;
    } catch (const nlohmann::json::exception& e) {
      SPPO_CHECK(false, "sim") << o.plan << " is not valid JSON: " << e.what();
    }
    const plan::Plan p = plan::plan_from_json(j);
    const plan::HardwareProfile hw = plan::load_profile(o.hardware.empty() ? p.hardware : o.hardware);
    sim::SimOptions so;
    so.record = !o.trace.empty() || !o.svg.empty();
    const auto t0 = std::chrono::steady_clock::now();
    const sim::SimResult r = sim::simulate_plan(p, hw, so);
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    sim::write_timelines(r, o.trace, o.svg,
                         std::string(to_string(p.system)) + " " + p.model_name + " " + std::to_string(p.seq_len) +
                             " tokens, " + plan::layout_text(p));
    const nlohmann::json out = {{"step_time_s", r.step_time_s},
                                {"tokens_per_gpu_per_s", r.tokens_per_device_per_s},
                                {"bubble_ratio", r.bubble_ratio},
                                {"exposed_copy_s", r.exposed_copy_s},
                                {"peak_device_bytes", r.peak_device_bytes},
                                {"peak_bytes_per_rank", r.peak_bytes},
                                {"simulate_wall_s", wall}};
    if (o.json) {
      std::cout << out.dump() << std::endl;
    } else {
      std::printf("step        %.4g s\nthroughput  %.1f tokens/GPU/s\nbubble      %.4f\nexposed     %.4g s\n"
                  "peak        %s per device\nsimulated   in %.3f s\n",
                  r.step_time_s, r.tokens_per_device_per_s, r.bubble_ratio, r.exposed_copy_s,
                  format_bytes(double(r.peak_device_bytes)).c_str(), wall);
    }
    if (p.budget > 0 && r.peak_device_bytes > p.budget) {
      std::cerr << "[sim] " << o.plan << ": the simulated peak of " << format_bytes(double(r.peak_device_bytes))
                << " per device is over the plan's budget_bytes of " << format_bytes(double(p.budget))
                << "; this plan does not fit (re-plan with `sppo plan`, or raise budget_bytes if the devices have "
                   "that memory)"
                << std::endl;
      return 3;
    }
    return 0;
  });
}

void add_plan_commands(CLI::App& app, Commands& out) {
  auto plan_options = std::make_shared<PlanOptions>();
  auto simulate_options = std::make_shared<SimulateOptions>();
  PlanOptions& plan = *plan_options;
  SimulateOptions& simulate = *simulate_options;
  auto* p = app.add_subcommand("plan", "Choose the layout (tp, ulysses, cp, pp, dp), N, alpha, the placements and MSP for a model on a cluster and predict the step");
  auto config = std::make_shared<std::string>();
  add_config_option(p, *config);
  std::string presets;
  for (const auto& n : preset_names()) presets += (presets.empty() ? "" : ", ") + n;
  p->add_option("--model", plan.model, "Model preset: " + presets)->capture_default_str();
  p->add_option("--seq-len", plan.seq_len, "Tokens per sequence; K and M suffixes (1M = 1048576)")->capture_default_str();
  p->add_option("--gpus", plan.gpus, "Devices in the cluster")->capture_default_str();
  p->add_option("--gpus-per-node", plan.gpus_per_node, "Devices per node")->capture_default_str();
  std::string profiles;
  for (const auto& n : plan::profile_names()) profiles += (profiles.empty() ? "" : ", ") + n;
  p->add_option("--hardware", plan.hardware, "Hardware profile (" + profiles + ") or a profile JSON file")
      ->capture_default_str();
  p->add_option("--system", plan.system, "sppo, megatron or deepspeed")->capture_default_str();
  p->add_option("--offload", plan.offload,
                "none, full, paper (alpha_i A_i = BW x balanced compute) or adaptive (least step time under the budget)")
      ->capture_default_str();
  p->add_option("--msp", plan.msp, "Multiplexed sequence partitioning: on, off or auto (the faster in simulation)")
      ->capture_default_str();
  p->add_option("--zero", plan.zero, "What the ranks that hold the same layers (each stage's dp, cp and Ulysses ranks) shard: 0 nothing, 1 the AdamW "
                "state, 2 the gradients too, 3 the weights too (2 and 3 without tp); auto: 1 where a stage has two or more "
                "such ranks, weighed against 2 and 3 where they run")
      ->capture_default_str();
  p->add_option("--ring-layout", plan.ring_layout, "How the cp ranks of a ring split a subsequence: zigzag or contiguous")
      ->capture_default_str();
  p->add_option("--kv-cache", plan.kv_cache,
                "Where each layer keeps the K/V cache and its dK/dV sums: device, host (streamed back through a "
                "window; a ring member, or an MSP stage's owner, streams its own pieces), recompute (no K/V kept: "
                "recomputed from each layer's input, the sums on the host; no ring, MSP or TP), or auto (the others "
                "only where nothing fits with the device)")
      ->capture_default_str();
  p->add_option("--backward-order", plan.backward_order,
                "The backward's order (as train --backward-order): subseq (the paper's), layer (the layers from "
                "the last, one layer's dK/dV sums at a time; not with MSP), or auto (layer only "
                "where nothing fits otherwise)")
      ->capture_default_str();
  p->add_option("--rebuild-inputs", plan.rebuild_inputs,
                "Whether the plan rebuilds every other layer's input of each stage in the layer-major backward "
                "(as train --rebuild-inputs: the layer below's forward again inside each backward op): none, odd "
                "(always; with the layer-major order, K/V not on the host), or auto (where the plans keeping every "
                "input do not fit or already need the layer-major order)")
      ->capture_default_str();
  p->add_option("--recompute-tensors", plan.recompute_tensors,
                "Saved tensors backward recomputes (as train --recompute-tensors: tensors or groups ln1, q, "
                "attention, x_mid, ln2, fc_pre, head_grad), none, or auto (more only where nothing fits otherwise)")
      ->capture_default_str();
  p->add_option("--optimizer-state", plan.optimizer_state,
                "Where the fp32 master weights and AdamW state live and update: device, host (train "
                "--optimizer-state host: gradients down, the update on the host's processor, weights up, each "
                "step), or auto (the host only where no plan fits with the device)")
      ->capture_default_str();
  p->add_option("--weights", plan.weights,
                "Where the transformer layers' weights and gradients live (as train --weights): device, host (each "
                "layer's brought for the forward and backward that run it; with the optimizer state on the host, "
                "without tensor parallelism, ZeRO-1 or MSP), or auto (the host only where no plan fits with the "
                "optimizer state alone there)")
      ->capture_default_str();
  p->add_flag("--explain", plan.explain, "Also print device and host memory term by term, with formulas");
  p->add_option("--budget", plan.budget, "Device memory per device, e.g. 70GiB (default: the profile's usable memory)");
  p->add_option("--host-budget", plan.host_budget,
                "Host memory per device for offloaded activations, e.g. 128GiB (default: the profile's "
                "host_memory_bytes)");
  p->add_option("--out", plan.out, "Also write the plan JSON to this file (for `sppo simulate`)");
  p->add_flag("--json", plan.json, "Print one JSON object");
  p->add_flag("--table", plan.table, "Print the sppo/megatron/deepspeed comparison table for gpt-7b/13b/65b");
  out.push_back({p, [plan_options, config, p](const Invocation&) {
                   apply_config_file(p, *config);
                   return run_plan(*plan_options);
                 }});

  auto* s = app.add_subcommand("simulate", "Simulate a plan's step: time, bubbles, copies, memory; trace and SVG");
  s->add_option("plan", simulate.plan, "PLAN.json written by `sppo plan --out` or `--json`")->required();
  s->add_option("--hardware", simulate.hardware, "Profile to simulate on (default: the plan's)");
  s->add_option("--trace", simulate.trace, "Write a Chrome trace (chrome://tracing, Perfetto)");
  s->add_option("--svg", simulate.svg, "Write an SVG timeline");
  s->add_flag("--json", simulate.json, "Print one JSON object");
  out.push_back({s, [simulate_options](const Invocation&) { return run_simulate(*simulate_options); }});
}

}  // namespace sppo::cli
