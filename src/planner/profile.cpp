#include "planner/profile.h"

#include <cmath>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/check.h"
#include "core/json_fields.h"

namespace sppo::plan {

namespace {

// The presets of profiles/, compiled in so `sppo plan` works from any directory. A test
// checks that they equal the files.
struct Embedded {
  const char* name;
  const char* json;
};
const Embedded kEmbedded[] = {
    {"a100-80gb", R"json({
  "name": "a100-80gb",
  "description": "NVIDIA A100-SXM4-80GB, NVLink 3 (8 per node), 4x HDR 200 Gb/s InfiniBand per node pair, PCIe gen4 host link. Rates are achieved, not peak: 312 TFLOP/s bf16 peak GEMM reaches about 200 in large transformer GEMMs.",
  "precision": "bf16",
  "gemm_tflops": 200.0,
  "attention_efficiency": 0.8,
  "elementwise_gbps": 1600.0,
  "d2h_gbps": 22.0,
  "h2d_gbps": 22.0,
  "duplex_factor": 0.8,
  "intra_node_gbps": 200.0,
  "intra_node_latency_us": 10.0,
  "inter_node_gbps": 22.0,
  "inter_node_latency_us": 20.0,
  "device_memory_bytes": 85899345920,
  "memory_reserve_bytes": 3221225472,
  "host_memory_bytes": 137438953472,
  "devices_per_node": 8,
  "layer_overhead_us": 40.0
})json"},
    {"h100-sxm", R"json({
  "name": "h100-sxm",
  "description": "NVIDIA H100 SXM5 80GB, NVLink 4 (8 per node), 400 Gb/s NDR InfiniBand per GPU, PCIe gen5 host link. 989 TFLOP/s bf16 dense peak reaches about 600 in large GEMMs.",
  "precision": "bf16",
  "gemm_tflops": 600.0,
  "attention_efficiency": 0.75,
  "elementwise_gbps": 2800.0,
  "d2h_gbps": 45.0,
  "h2d_gbps": 45.0,
  "duplex_factor": 0.8,
  "intra_node_gbps": 360.0,
  "intra_node_latency_us": 8.0,
  "inter_node_gbps": 45.0,
  "inter_node_latency_us": 15.0,
  "device_memory_bytes": 85899345920,
  "memory_reserve_bytes": 3221225472,
  "host_memory_bytes": 137438953472,
  "devices_per_node": 8,
  "layer_overhead_us": 30.0
})json"},
    {"h200", R"json({
  "name": "h200",
  "description": "NVIDIA H200 SXM 141GB (143771 MiB), NVLink 4 (8 per node), 400 Gb/s NDR InfiniBand per GPU, PCIe gen5 host link. Same compute as H100; more and faster HBM3e.",
  "precision": "bf16",
  "gemm_tflops": 620.0,
  "attention_efficiency": 0.75,
  "elementwise_gbps": 4000.0,
  "d2h_gbps": 45.0,
  "h2d_gbps": 45.0,
  "duplex_factor": 0.8,
  "intra_node_gbps": 360.0,
  "intra_node_latency_us": 8.0,
  "inter_node_gbps": 45.0,
  "inter_node_latency_us": 15.0,
  "device_memory_bytes": 150754820096,
  "memory_reserve_bytes": 3221225472,
  "host_memory_bytes": 274877906944,
  "devices_per_node": 8,
  "layer_overhead_us": 30.0
})json"},
};

constexpr double kTera = 1e12, kGiga = 1e9, kMicro = 1e-6;

double required(const nlohmann::json& j, const char* key, const std::string& where, const char* meaning) {
  SPPO_CHECK(j.contains(key), "profile")
      << where << ": missing field '" << key << "' (" << meaning << ")";
  SPPO_CHECK(j[key].is_number(), "profile") << where << ": field '" << key << "' must be a number";
  const double v = j[key].get<double>();
  SPPO_CHECK(v >= 0, "profile") << where << ": field '" << key << "' must not be negative (got " << v << ")";
  return v;
}

double optional(const nlohmann::json& j, const char* key, double fallback, const std::string& where) {
  if (!j.contains(key)) return fallback;
  SPPO_CHECK(j[key].is_number() && j[key].get<double>() >= 0, "profile")
      << where << ": field '" << key << "' must be a non-negative number";
  return j[key].get<double>();
}

std::string exe_dir() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "";
  buf[n] = 0;
  return std::filesystem::path(buf).parent_path().string();
}

HardwareProfile load_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  SPPO_CHECK(in.good(), "profile") << "cannot open " << path.string();
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    SPPO_CHECK(false, "profile") << path.string() << " is not valid JSON: " << e.what();
  }
  return profile_from_json(j, path.string());
}

}  // namespace

std::vector<std::string> profile_names() {
  std::vector<std::string> names;
  for (const auto& e : kEmbedded) names.push_back(e.name);
  return names;
}

namespace {

// Log-linear interpolation in a table of (size, value) sorted by size, clamped at the ends.
double interpolate(const std::vector<std::pair<int, double>>& t, int size) {
  if (size <= t.front().first) return t.front().second;
  if (size >= t.back().first) return t.back().second;
  for (std::size_t k = 1; k < t.size(); ++k)
    if (size <= t[k].first) {
      const double x = std::log(double(size) / t[k - 1].first) / std::log(double(t[k].first) / t[k - 1].first);
      return t[k - 1].second * std::pow(t[k].second / t[k - 1].second, x);
    }
  return t.back().second;
}

nlohmann::json table_json(const std::vector<std::pair<int, double>>& t, double unit) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& [size, v] : t) j.push_back({size, v / unit});
  return j;
}

std::vector<std::pair<int, double>> table_from_json(const nlohmann::json& j, const char* field,
                                                    const std::string& where, double unit) {
  std::vector<std::pair<int, double>> t;
  if (!j.contains(field)) return t;
  const auto& a = j[field];
  SPPO_CHECK(a.is_array(), "profile") << where << ": " << field << " must be a list of [size, value] pairs";
  for (const auto& e : a) {
    SPPO_CHECK(e.is_array() && e.size() == 2 && e[0].is_number_integer() && e[1].is_number() &&
                   e[0].get<int>() > 0 && e[1].get<double>() > 0, "profile")
        << where << ": " << field << " entries are [size, value] with both positive (got " << e.dump() << ")";
    SPPO_CHECK(t.empty() || e[0].get<int>() > t.back().first, "profile")
        << where << ": " << field << " must be sorted by size";
    t.emplace_back(e[0].get<int>(), e[1].get<double>() * unit);
  }
  return t;
}

}  // namespace

double HardwareProfile::gemm_rate(int hidden) const {
  return gemm_flops_by_hidden.empty() ? gemm_flops : interpolate(gemm_flops_by_hidden, hidden);
}

double HardwareProfile::attention_rate(int head_size) const {
  return gemm_flops * (attention_efficiency_by_head.empty() ? attention_efficiency
                                                            : interpolate(attention_efficiency_by_head, head_size));
}

nlohmann::json to_json(const HardwareProfile& p) {
  return {
      {"name", p.name},
      {"description", p.description},
      {"precision", p.precision},
      {"gemm_tflops", p.gemm_flops / kTera},
      {"attention_efficiency", p.attention_efficiency},
      {"elementwise_gbps", p.elementwise_bw / kGiga},
      {"d2h_gbps", p.d2h_bw / kGiga},
      {"h2d_gbps", p.h2d_bw / kGiga},
      {"duplex_factor", p.duplex_factor},
      {"intra_node_gbps", p.intra_node_bw / kGiga},
      {"intra_node_latency_us", p.intra_node_latency / kMicro},
      {"inter_node_gbps", p.inter_node_bw / kGiga},
      {"inter_node_latency_us", p.inter_node_latency / kMicro},
      {"device_memory_bytes", p.device_memory},
      {"memory_reserve_bytes", p.memory_reserve},
      {"host_memory_bytes", p.host_memory},
      {"devices_per_node", p.devices_per_node},
      {"layer_overhead_us", p.layer_overhead / kMicro},
      {"gemm_tflops_by_hidden", table_json(p.gemm_flops_by_hidden, kTera)},
      {"attention_efficiency_by_head_size", table_json(p.attention_efficiency_by_head, 1.0)},
  };
}

HardwareProfile profile_from_json(const nlohmann::json& j, const std::string& where) {
  SPPO_CHECK(j.is_object(), "profile") << where << ": a profile is a JSON object";
  HardwareProfile p;
  const std::string at = where + ": field ";
  p.name = json_string_field(j, "name", std::filesystem::path(where).stem().string(), "profile", at);
  p.description = json_string_field(j, "description", "", "profile", at);
  p.precision = json_string_field(j, "precision", "", "profile", at);
  SPPO_CHECK(p.precision == "bf16" || p.precision == "f32", "profile")
      << where << ": field 'precision' must be \"bf16\" or \"f32\" (got \"" << p.precision << "\")";
  p.gemm_flops = required(j, "gemm_tflops", where, "achieved dense GEMM rate, TFLOP/s") * kTera;
  p.attention_efficiency =
      required(j, "attention_efficiency", where, "attention kernel rate as a fraction of the GEMM rate");
  p.elementwise_bw = optional(j, "elementwise_gbps", 0, where) * kGiga;
  p.d2h_bw = required(j, "d2h_gbps", where, "device to host copy bandwidth, GB/s") * kGiga;
  p.h2d_bw = required(j, "h2d_gbps", where, "host to device copy bandwidth, GB/s") * kGiga;
  p.duplex_factor = required(j, "duplex_factor", where,
                             "share of each direction's copy bandwidth when both directions run, 0..1");
  p.intra_node_bw = required(j, "intra_node_gbps", where, "device to device bandwidth in a node, GB/s") * kGiga;
  p.intra_node_latency = required(j, "intra_node_latency_us", where, "latency in a node, us") * kMicro;
  p.inter_node_bw = required(j, "inter_node_gbps", where, "per-device bandwidth across nodes, GB/s") * kGiga;
  p.inter_node_latency = required(j, "inter_node_latency_us", where, "latency across nodes, us") * kMicro;
  // Counts are converted only within range (a double beyond it converts with undefined
  // behaviour).
  auto count = [&](double v, const char* key, double limit) {
    SPPO_CHECK(v <= limit, "profile") << where << ": field '" << key << "' is " << v << "; at most " << limit
                                      << " is accepted";
    return v;
  };
  constexpr double kMaxBytes = 1e18, kMaxDevices = 1 << 20;
  p.device_memory = i64(count(required(j, "device_memory_bytes", where, "device memory, bytes"),
                              "device_memory_bytes", kMaxBytes));
  p.memory_reserve = i64(count(optional(j, "memory_reserve_bytes", 0, where), "memory_reserve_bytes", kMaxBytes));
  p.host_memory = i64(count(optional(j, "host_memory_bytes", 0, where), "host_memory_bytes", kMaxBytes));
  p.devices_per_node =
      int(count(required(j, "devices_per_node", where, "devices per node"), "devices_per_node", kMaxDevices));
  p.layer_overhead = optional(j, "layer_overhead_us", 0, where) * kMicro;
  p.gemm_flops_by_hidden = table_from_json(j, "gemm_tflops_by_hidden", where, kTera);
  p.attention_efficiency_by_head = table_from_json(j, "attention_efficiency_by_head_size", where, 1.0);
  SPPO_CHECK(p.gemm_flops > 0 && p.attention_efficiency > 0, "profile")
      << where << ": gemm_tflops and attention_efficiency must be positive";
  SPPO_CHECK(p.d2h_bw > 0 && p.h2d_bw > 0 && p.intra_node_bw > 0 && p.inter_node_bw > 0, "profile")
      << where << ": bandwidths must be positive";
  SPPO_CHECK(p.duplex_factor > 0 && p.duplex_factor <= 1, "profile")
      << where << ": duplex_factor must be in (0, 1]";
  SPPO_CHECK(p.device_memory > p.memory_reserve, "profile")
      << where << ": device_memory_bytes must exceed memory_reserve_bytes";
  SPPO_CHECK(p.devices_per_node >= 1, "profile") << where << ": devices_per_node must be at least 1";
  return p;
}

HardwareProfile load_profile(const std::string& name_or_path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_regular_file(name_or_path, ec)) return load_file(name_or_path);
  const std::string file = name_or_path + ".json";
  const std::string dir = exe_dir();
  if (!dir.empty()) {
    const fs::path p = fs::path(dir) / ".." / "profiles" / file;
    if (fs::is_regular_file(p, ec)) return load_file(p);
  }
  if (fs::is_regular_file(fs::path("profiles") / file, ec)) return load_file(fs::path("profiles") / file);
  for (const auto& e : kEmbedded)
    if (name_or_path == e.name) return profile_from_json(nlohmann::json::parse(e.json), e.name);
  std::string list;
  for (const auto& e : kEmbedded) list += std::string(list.empty() ? "" : ", ") + e.name;
  SPPO_CHECK(false, "profile") << "no hardware profile '" << name_or_path
                               << "': not a file, and the presets are " << list
                               << " (or write one with `sppo profile`)";
  return {};
}

void save_profile(const HardwareProfile& p, const std::string& path) {
  std::ofstream out(path);
  SPPO_CHECK(out.good(), "profile") << "cannot write " << path;
  out << to_json(p).dump(2) << "\n";
  SPPO_CHECK(out.good(), "profile") << "writing " << path << " failed";
}

}  // namespace sppo::plan
