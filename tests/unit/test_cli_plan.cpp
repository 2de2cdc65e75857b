// `sppo plan` from the command line: --explain gives every system's memory term by term,
// summing to the peak the plan predicts; --zero, --ring-layout and --offload paper reach
// the plan; bad values are refused with exit 2 naming the option.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>

#include "io/fileutil.h"
#include "planner/profile.h"
#include "support/mpi_run.h"

namespace sppo {
namespace {

const std::string kPlan = " plan --model gpt-7b --seq-len 256K --gpus 16 --hardware a100-80gb ";

nlohmann::json plan_json(const std::string& args) {
  const auto r = testing::run_command(testing::sppo_binary() + kPlan + args + " --json 2>&1");
  EXPECT_EQ(r.status, 0) << args << "\n" << r.output;
  try {
    return nlohmann::json::parse(r.output);
  } catch (const nlohmann::json::exception& e) {
    ADD_FAILURE() << args << ": not one JSON object: " << e.what() << "\n" << r.output;
    return nlohmann::json::object();
  }
}

// A one-thread CPU profile (the a100 profile's rates, fp32, 1 GiB, no reserve) written
// into `dir`; its path.
std::string cpu_profile(const io::TempDir& dir) {
  plan::HardwareProfile cpu = plan::load_profile("a100-80gb");
  cpu.name = "cpu-test";
  cpu.precision = "f32";
  cpu.threads = 1;
  cpu.devices_per_node = 1;
  cpu.device_memory = i64(1) << 30;
  cpu.memory_reserve = 0;
  const std::string path = dir.path() + "/cpu.json";
  plan::save_profile(cpu, path);
  return path;
}

// The summary line of a train --metrics file (null: none).
nlohmann::json metrics_summary(const std::string& path) {
  std::ifstream lines(path);
  nlohmann::json summary;
  for (std::string line; std::getline(lines, line);)
    if (auto j = nlohmann::json::parse(line); j.contains("summary")) summary = j;
  return summary;
}

TEST(PlanCli, ExplainSumsToThePredictedPeakForEverySystem) {
  std::set<std::string> rows_of_sppo;
  for (const std::string system : {"sppo", "megatron", "deepspeed"}) {
    const nlohmann::json j = plan_json("--system " + system + " --explain");
    ASSERT_TRUE(j.contains("memory")) << system << ": " << j.dump();
    const nlohmann::json& m = j["memory"];
    EXPECT_EQ(m["system"], system);
    EXPECT_EQ(m["device_bytes"].get<long long>(), j["predicted"]["peak_device_bytes"].get<long long>()) << system;
    long long device = 0, host = 0;
    std::set<std::string> rows;
    for (const auto& t : m["terms"]) {
      rows.insert(t["term"].get<std::string>());
      device += t["device_bytes"].get<long long>();
      host += t["host_bytes"].get<long long>();
      if (t["device_bytes"].get<long long>() > 0 || t["host_bytes"].get<long long>() > 0) {
        EXPECT_FALSE(t["formula"].get<std::string>().empty()) << system << ": " << t.dump();
      }
    }
    EXPECT_EQ(device, m["device_bytes"].get<long long>()) << system;
    EXPECT_EQ(host, m["host_bytes"].get<long long>()) << system;
    EXPECT_LE(m["device_bytes"].get<long long>(), m["budget_bytes"].get<long long>()) << system;
    for (const char* row : {"weights", "gradients", "optimizer state", "K/V cache", "dK/dV accumulators",
                            "activation units", "checkpointed inputs", "recompute working set", "logits and loss",
                            "attention workspace", "communication buffers"})
      EXPECT_EQ(rows.count(row), 1u) << system << " has no row '" << row << "'";
    if (system == "sppo") {
      rows_of_sppo = rows;
    } else {
      EXPECT_EQ(rows, rows_of_sppo) << "the systems' tables differ in their rows";
    }
  }
}

// A CPU profile's plan counts the CPU kernels' scratch at the profile's threads, as train
// does: `train --plan` predicts the plan's peak to the byte, and measures it. (Plans left
// it out: a plan at 89.36 MiB ran at 89.71 MiB against a 90 MiB budget.)
TEST(PlanCli, CpuPlanCountsTheKernelsScratchAsTrainDoes) {
  io::TempDir tmp("sppo-plan-scratch");
  const std::string profile = cpu_profile(tmp), planned = tmp.path() + "/plan.json";
  auto r = testing::run_command(testing::sppo_binary() + " plan --model tiny --seq-len 2048 --gpus 1 "
                                "--gpus-per-node 1 --hardware " + profile + " --out " + planned + " 2>&1");
  ASSERT_EQ(r.status, 0) << r.output;
  std::ifstream in(planned);
  const nlohmann::json p = nlohmann::json::parse(in);
  EXPECT_GT(p["kernel_scratch"]["block"][1].get<long long>(), 0) << p.dump();
  EXPECT_GT(p["kernel_scratch"]["head"][0].get<long long>() + p["kernel_scratch"]["head"][1].get<long long>(), 0);
  const std::string metrics = tmp.path() + "/m.jsonl";
  // Priced on the plan's profile, not on one measured here (seconds, a minute under ASan).
  r = testing::run_command(testing::sppo_binary() + " train --plan " + planned + " --hardware " + profile +
                           " --steps 1 --threads 1 --metrics " +
                           metrics + " 2>&1");
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json summary = metrics_summary(metrics);
  ASSERT_FALSE(summary.is_null()) << r.output;
  const long long planned_peak = p["predicted"]["peak_device_bytes"].get<long long>();
  EXPECT_EQ(summary["predicted_peak_device_bytes"].get<long long>(), planned_peak);
  EXPECT_EQ(summary["measured_peak_device_bytes"].get<long long>(), planned_peak);
}

// `plan --weights host` writes "weights": "host" with the optimizer state there, and
// `train --plan` runs it so, at the plan's peak to the byte, below the peak of the same
// plan with the weights on the device.
TEST(PlanCli, WeightsOnTheHostReachTheRunAsPlanned) {
  io::TempDir tmp("sppo-plan-weights");
  const std::string profile = cpu_profile(tmp);
  auto planned = [&](const std::string& weights) {
    const std::string out = tmp.path() + "/" + weights + ".json";
    const auto r = testing::run_command(testing::sppo_binary() + " plan --model small --seq-len 512 --gpus 1 "
                                        "--gpus-per-node 1 --optimizer-state host --hardware " + profile +
                                        " --weights " + weights + " --out " + out + " 2>&1");
    EXPECT_EQ(r.status, 0) << r.output;
    std::ifstream in(out);
    return std::make_pair(out, nlohmann::json::parse(in));
  };
  const auto [host_path, host] = planned("host");
  const auto [device_path, device] = planned("device");
  EXPECT_EQ(host["weights"], "host");
  EXPECT_EQ(host["optimizer_state"], "host");
  EXPECT_EQ(device["weights"], "device");
  const long long host_peak = host["predicted"]["peak_device_bytes"].get<long long>();
  EXPECT_LT(host_peak, device["predicted"]["peak_device_bytes"].get<long long>());
  const std::string metrics = tmp.path() + "/m.jsonl";
  const auto r = testing::run_command(testing::sppo_binary() + " train --plan " + host_path + " --hardware " + profile +
                                      " --steps 1 --threads 1 --metrics " + metrics + " 2>&1");
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json summary = metrics_summary(metrics);
  ASSERT_FALSE(summary.is_null()) << r.output;
  EXPECT_EQ(summary["predicted_peak_device_bytes"].get<long long>(), host_peak);
  EXPECT_EQ(summary["measured_peak_device_bytes"].get<long long>(), host_peak);
}

// --rebuild-inputs odd: the plan names every other layer of its stage, and train --plan runs
// it with the device peak it predicted, to the byte.
TEST(PlanCli, RebuiltInputsReachTheRunAsPlanned) {
  io::TempDir tmp("sppo-plan-rebuilt");
  const std::string profile = cpu_profile(tmp), planned = tmp.path() + "/plan.json";
  auto r = testing::run_command(testing::sppo_binary() + " plan --model medium --seq-len 1024 --gpus 1 "
                                "--gpus-per-node 1 --hardware " + profile + " --rebuild-inputs odd --kv-cache "
                                "recompute --out " + planned + " 2>&1");
  ASSERT_EQ(r.status, 0) << r.output;
  std::ifstream in(planned);
  const nlohmann::json p = nlohmann::json::parse(in);
  EXPECT_EQ(p["rebuilt_inputs"], nlohmann::json::parse("[1, 3]"));
  EXPECT_EQ(p["kv_host_layers"], nlohmann::json::parse("[1, 3]"));
  EXPECT_EQ(p["kv_recompute_layers"], nlohmann::json::parse("[0, 2]"));
  EXPECT_EQ(p["backward_order"], "layer");
  const long long peak = p["predicted"]["peak_device_bytes"].get<long long>();
  const std::string metrics = tmp.path() + "/m.jsonl";
  r = testing::run_command(testing::sppo_binary() + " train --plan " + planned + " --hardware " + profile +
                           " --steps 1 --threads 1 --metrics " + metrics + " 2>&1");
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json summary = metrics_summary(metrics);
  ASSERT_FALSE(summary.is_null()) << r.output;
  EXPECT_EQ(summary["predicted_peak_device_bytes"].get<long long>(), peak);
  EXPECT_EQ(summary["measured_peak_device_bytes"].get<long long>(), peak);
  for (const char* bad : {"--rebuild-inputs odd --backward-order subseq", "--rebuild-inputs odd --kv-cache host",
                          "--rebuild-inputs sideways"}) {
    const auto e = testing::run_command(testing::sppo_binary() + " plan --model medium --seq-len 1024 --gpus 1 " +
                                        bad + " 2>&1");
    EXPECT_EQ(e.status, 2) << bad << "\n" << e.output;
    EXPECT_NE(e.output.find("--rebuild-inputs"), std::string::npos) << e.output;
  }
}

TEST(PlanCli, ExplainPrintsTheTableAfterThePlan) {
  const auto r = testing::run_command(testing::sppo_binary() + kPlan + "--explain 2>&1");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto plan_at = r.output.find("layout      ");
  const auto table_at = r.output.find("| term | device | host | formula |");
  ASSERT_NE(plan_at, std::string::npos) << r.output;
  ASSERT_NE(table_at, std::string::npos) << r.output;
  EXPECT_LT(plan_at, table_at);
  for (const char* s : {"| total |", "| framework and allocator reserve |", "| token ids and loss sum |"})
    EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;
}

TEST(PlanCli, ZeroRingLayoutAndOffloadReachThePlan) {
  const nlohmann::json zero0 = plan_json("--zero 0 --ring-layout contiguous --msp off");
  EXPECT_EQ(zero0["zero"].get<int>(), 0);
  EXPECT_EQ(zero0["ring_layout"], "contiguous");
  const nlohmann::json zero1 = plan_json("--zero 1 --msp off");
  EXPECT_EQ(zero1["zero"].get<int>(), 1);
  EXPECT_EQ(zero1["ring_layout"], "zigzag");
  // Each kind of sequence parallelism by its own name (`train --tp`, `--cp`).
  EXPECT_FALSE(zero1.contains("sp"));
  for (const char* kind : {"tp", "ulysses", "cp"}) EXPECT_GE(zero1[kind].get<int>(), 1) << kind;
  const nlohmann::json paper = plan_json("--offload paper --msp off");
  EXPECT_EQ(paper["offload"], "paper");
  const auto alpha = paper["alpha"].get<std::vector<double>>();
  ASSERT_FALSE(alpha.empty());
  for (std::size_t i = 1; i < alpha.size(); ++i) EXPECT_LE(alpha[i], alpha[i - 1]) << "at " << i;
  EXPECT_EQ(alpha.back(), 0.0);
}

TEST(PlanCli, BadValuesAreRefusedNamingTheOption) {
  for (const std::string option : {"--zero", "--ring-layout", "--offload", "--msp", "--system"}) {
    const auto r = testing::run_command(testing::sppo_binary() + kPlan + option + " bogus 2>&1");
    EXPECT_EQ(r.status, 2) << option << "\n" << r.output;
    EXPECT_NE(r.output.find(option), std::string::npos) << r.output;
  }
}

}  // namespace
}  // namespace sppo
