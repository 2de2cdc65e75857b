#include "planner/profile.h"

#include <cmath>

#include <unistd.h>

#include <filesystem>
#include <limits>
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
  "description": [
    "NVIDIA A100-SXM4-80GB, 8 per node (DGX A100): NVLink 3, PCIe gen4 host links, HDR InfiniBand.",
    "Sources per field. Measured: only on the H200, by PyTorch 2.11 (shared/peers/h200, anchors.json, 2026-12-01); efficiencies measured there are applied to the other GPUs' datasheet figures, an assumption, not a measurement of those GPUs. Assumed: figures marked so, pending a measurement.",
    "gemm_tflops: 312 TFLOP/s bf16 dense (datasheet) x 0.744, the H200's measured rate on a block's GEMMs (16K x 4096 x 12288/4096/16384 and 16K x 16384 x 4096: 801/715/720/713 TFLOP/s, 736 FLOP-weighted) over its 989 = 232.1.",
    "attention_efficiency: 0.747 = the H200's measured causal flash attention, forward + backward, S 8K/32K/128K (539/559/551 TFLOP/s) over its GEMM rate. PyTorch reaches only 326 TFLOP/s (0.44) for a subsequence after a cached prefix; a kernel that takes the offset should reach the whole-sequence rate (to be measured by the CUDA backend).",
    "attention_prefix_ratio: 1 (assumed: a kernel that takes the subsequence offset runs the unmasked blocks after a prefix at the causal rate; to be measured by the CUDA backend's profile).",
    "elementwise_gbps: 2039 GB/s HBM (datasheet) x 0.8 (assumed, not measured).",
    "d2h_gbps, h2d_gbps: PCIe 31.5 GB/s per direction (datasheet, x16) x 0.88, the H200's measured pinned copies (55.5 / 55.4 GB/s over gen5 x16's 63) = 27.7.",
    "duplex_factor: 0.916, measured on the H200 (101.6 GB/s both ways at once over 2 x 55.45).",
    "precision: bf16 activations and GEMMs, fp32 master weights, gradients, optimizer state and dK/dV accumulators (the CUDA backend).",
    "intra_node_gbps: NVLink 300 GB/s per direction (datasheet) x 0.8 (assumed) = 240. devices_per_node: 8 (the board's GPUs, datasheet).",
    "inter_node_gbps and nic_gbps: one 200 Gb/s InfiniBand NIC per GPU, gpus_per_nic 1 (datasheet) x 0.9 (assumed) = 22.5 GB/s.",
    "intra_node_latency_us, inter_node_latency_us: assumed.",
    "device_memory_bytes: 80 GiB (datasheet). memory_reserve_bytes: 3 GiB (assumed: CUDA context, library workspaces, allocator fragmentation).",
    "host_memory_bytes: 1 TiB per DGX A100 node / 8 GPUs (datasheet).",
    "gpus_per_pcie_switch 2, pcie_switch_gbps 27.7: two GPUs share each PCIe switch's x16 uplink to the host, as in the DGX A100 (assumed for the HGX boards), at the same rate as one GPU's link.",
    "gpus_per_numa_node 4, numa_host_gbps 163.8: 8 channels of DDR4-3200 per AMD EPYC 7742 socket, 204.8 GB/s (datasheet) x 0.8 (assumed), both directions together.",
    "layer_overhead_us: 40 (assumed: launches and synchronisation of a layer's kernels).",
    "copy_issue_us, copy_compute_share, attention_chunk_us: 0 (assumed, not measured: a GPU's host copies run on its copy engines beside the kernels and are issued asynchronously, and a streamed chunk's kernel launch overlaps the kernel before it; Note [Streamed chunks] in planner/profile.h)."
  ],
  "precision": "bf16",
  "gemm_tflops": 232.1,
  "attention_efficiency": 0.747,
  "elementwise_gbps": 1631.2,
  "d2h_gbps": 27.7,
  "h2d_gbps": 27.7,
  "duplex_factor": 0.916,
  "intra_node_gbps": 240.0,
  "intra_node_latency_us": 10.0,
  "inter_node_gbps": 22.5,
  "inter_node_latency_us": 20.0,
  "device_memory_bytes": 85899345920,
  "memory_reserve_bytes": 3221225472,
  "host_memory_bytes": 137438953472,
  "devices_per_node": 8,
  "layer_overhead_us": 40.0,
  "gpus_per_pcie_switch": 2,
  "pcie_switch_gbps": 27.7,
  "gpus_per_numa_node": 4,
  "numa_host_gbps": 163.8,
  "copy_issue_us": 0.0,
  "copy_compute_share": 0.0,
  "attention_chunk_us": 0.0,
  "gpus_per_nic": 1,
  "nic_gbps": 22.5
})json"},
    {"h100-sxm", R"json({
  "name": "h100-sxm",
  "description": [
    "NVIDIA H100 SXM5 80GB, 8 per node (DGX/HGX H100): NVLink 4, PCIe gen5 host links, NDR InfiniBand.",
    "Sources per field. Measured: only on the H200, by PyTorch 2.11 (shared/peers/h200, anchors.json, 2026-12-01); efficiencies measured there are applied to the other GPUs' datasheet figures, an assumption, not a measurement of those GPUs. Assumed: figures marked so, pending a measurement.",
    "gemm_tflops: 989 TFLOP/s bf16 dense (datasheet) x 0.744, the H200's measured rate on a block's GEMMs (16K x 4096 x 12288/4096/16384 and 16K x 16384 x 4096: 801/715/720/713 TFLOP/s, 736 FLOP-weighted) over its 989 = 735.8.",
    "attention_efficiency: 0.747 = the H200's measured causal flash attention, forward + backward, S 8K/32K/128K (539/559/551 TFLOP/s) over its GEMM rate. PyTorch reaches only 326 TFLOP/s (0.44) for a subsequence after a cached prefix; a kernel that takes the offset should reach the whole-sequence rate (to be measured by the CUDA backend).",
    "attention_prefix_ratio: 1 (assumed: a kernel that takes the subsequence offset runs the unmasked blocks after a prefix at the causal rate; to be measured by the CUDA backend's profile).",
    "elementwise_gbps: 3350 GB/s HBM (datasheet) x 0.8 (assumed, not measured).",
    "d2h_gbps, h2d_gbps: PCIe 63 GB/s per direction (datasheet, x16) x 0.88, the H200's measured pinned copies (55.5 / 55.4 GB/s over gen5 x16's 63) = 55.5.",
    "duplex_factor: 0.916, measured on the H200 (101.6 GB/s both ways at once over 2 x 55.45).",
    "precision: bf16 activations and GEMMs, fp32 master weights, gradients, optimizer state and dK/dV accumulators (the CUDA backend).",
    "intra_node_gbps: NVLink 450 GB/s per direction (datasheet) x 0.8 (assumed) = 360. devices_per_node: 8 (the board's GPUs, datasheet).",
    "inter_node_gbps and nic_gbps: one 400 Gb/s InfiniBand NIC per GPU, gpus_per_nic 1 (datasheet) x 0.9 (assumed) = 45 GB/s.",
    "intra_node_latency_us, inter_node_latency_us: assumed.",
    "device_memory_bytes: 80 GiB (datasheet). memory_reserve_bytes: 3 GiB (assumed: CUDA context, library workspaces, allocator fragmentation).",
    "host_memory_bytes: 2 TiB per DGX H100 node / 8 GPUs (datasheet).",
    "gpus_per_pcie_switch 2, pcie_switch_gbps 55.5: two GPUs share each PCIe switch's x16 uplink to the host, as in the DGX A100 (assumed for the HGX boards), at the same rate as one GPU's link.",
    "gpus_per_numa_node 4, numa_host_gbps 245.8: 8 channels of DDR5-4800 per Xeon Platinum 8480C socket, 307.2 GB/s (datasheet) x 0.8 (assumed), both directions together.",
    "layer_overhead_us: 30 (assumed: launches and synchronisation of a layer's kernels).",
    "copy_issue_us, copy_compute_share, attention_chunk_us: 0 (assumed, not measured: a GPU's host copies run on its copy engines beside the kernels and are issued asynchronously, and a streamed chunk's kernel launch overlaps the kernel before it; Note [Streamed chunks] in planner/profile.h)."
  ],
  "precision": "bf16",
  "gemm_tflops": 735.8,
  "attention_efficiency": 0.747,
  "elementwise_gbps": 2680.0,
  "d2h_gbps": 55.5,
  "h2d_gbps": 55.5,
  "duplex_factor": 0.916,
  "intra_node_gbps": 360.0,
  "intra_node_latency_us": 8.0,
  "inter_node_gbps": 45.0,
  "inter_node_latency_us": 15.0,
  "device_memory_bytes": 85899345920,
  "memory_reserve_bytes": 3221225472,
  "host_memory_bytes": 274877906944,
  "devices_per_node": 8,
  "layer_overhead_us": 30.0,
  "gpus_per_pcie_switch": 2,
  "pcie_switch_gbps": 55.5,
  "gpus_per_numa_node": 4,
  "numa_host_gbps": 245.8,
  "copy_issue_us": 0.0,
  "copy_compute_share": 0.0,
  "attention_chunk_us": 0.0,
  "gpus_per_nic": 1,
  "nic_gbps": 45.0
})json"},
    {"h200", R"json({
  "name": "h200",
  "description": [
    "NVIDIA H200 SXM 141GB, 8 per node (HGX H200): NVLink 4, PCIe gen5 host links, NDR InfiniBand. Same compute as the H100; more and faster HBM3e.",
    "Sources per field. Measured: only on the H200, by PyTorch 2.11 (shared/peers/h200, anchors.json, 2026-12-01); efficiencies measured there are applied to the other GPUs' datasheet figures, an assumption, not a measurement of those GPUs. Assumed: figures marked so, pending a measurement.",
    "gemm_tflops: 989 TFLOP/s bf16 dense (datasheet) x 0.744, the H200's measured rate on a block's GEMMs (16K x 4096 x 12288/4096/16384 and 16K x 16384 x 4096: 801/715/720/713 TFLOP/s, 736 FLOP-weighted) over its 989 = 735.8.",
    "attention_efficiency: 0.747 = the H200's measured causal flash attention, forward + backward, S 8K/32K/128K (539/559/551 TFLOP/s) over its GEMM rate. PyTorch reaches only 326 TFLOP/s (0.44) for a subsequence after a cached prefix; a kernel that takes the offset should reach the whole-sequence rate (to be measured by the CUDA backend).",
    "attention_prefix_ratio: 1 (assumed: a kernel that takes the subsequence offset runs the unmasked blocks after a prefix at the causal rate; to be measured by the CUDA backend's profile).",
    "elementwise_gbps: 4800 GB/s HBM (datasheet) x 0.8 (assumed, not measured).",
    "d2h_gbps, h2d_gbps: PCIe 63 GB/s per direction (datasheet, x16) x 0.88, the H200's measured pinned copies (55.5 / 55.4 GB/s over gen5 x16's 63) = 55.5.",
    "duplex_factor: 0.916, measured on the H200 (101.6 GB/s both ways at once over 2 x 55.45).",
    "precision: bf16 activations and GEMMs, fp32 master weights, gradients, optimizer state and dK/dV accumulators (the CUDA backend).",
    "intra_node_gbps: NVLink 450 GB/s per direction (datasheet) x 0.8 (assumed) = 360. devices_per_node: 8 (the board's GPUs, datasheet).",
    "inter_node_gbps and nic_gbps: one 400 Gb/s InfiniBand NIC per GPU, gpus_per_nic 1 (datasheet) x 0.9 (assumed) = 45 GB/s.",
    "intra_node_latency_us, inter_node_latency_us: assumed.",
    "device_memory_bytes: 143771 MiB as the driver reports it on the measured H200 (PyTorch sees 143156 MiB). memory_reserve_bytes: 3 GiB (assumed: CUDA context, library workspaces, allocator fragmentation).",
    "host_memory_bytes: 2 TiB per HGX H200 node / 8 GPUs (assumed, as the DGX H100).",
    "gpus_per_pcie_switch 2, pcie_switch_gbps 55.5: two GPUs share each PCIe switch's x16 uplink to the host, as in the DGX A100 (assumed for the HGX boards), at the same rate as one GPU's link.",
    "gpus_per_numa_node 4, numa_host_gbps 245.8: 8 channels of DDR5-4800 per Xeon Platinum 8480C socket, 307.2 GB/s (datasheet, assumed host) x 0.8 (assumed), both directions together.",
    "layer_overhead_us: 30 (assumed: launches and synchronisation of a layer's kernels).",
    "copy_issue_us, copy_compute_share, attention_chunk_us: 0 (assumed, not measured: a GPU's host copies run on its copy engines beside the kernels and are issued asynchronously, and a streamed chunk's kernel launch overlaps the kernel before it; Note [Streamed chunks] in planner/profile.h).",
    "Check against measurement: the cost model with this profile prices PyTorch's one-GPT-block step on the H200 (H 4096, S 16K / 64K / 128K, anchors.json: 42.6 / 343 / 1134 ms) at 43.5 / 342 / 1132 ms (within 2.1%)."
  ],
  "precision": "bf16",
  "gemm_tflops": 735.8,
  "attention_efficiency": 0.747,
  "elementwise_gbps": 3840.0,
  "d2h_gbps": 55.5,
  "h2d_gbps": 55.5,
  "duplex_factor": 0.916,
  "intra_node_gbps": 360.0,
  "intra_node_latency_us": 8.0,
  "inter_node_gbps": 45.0,
  "inter_node_latency_us": 15.0,
  "device_memory_bytes": 150754820096,
  "memory_reserve_bytes": 3221225472,
  "host_memory_bytes": 274877906944,
  "devices_per_node": 8,
  "layer_overhead_us": 30.0,
  "gpus_per_pcie_switch": 2,
  "pcie_switch_gbps": 55.5,
  "gpus_per_numa_node": 4,
  "numa_host_gbps": 245.8,
  "copy_issue_us": 0.0,
  "copy_compute_share": 0.0,
  "attention_chunk_us": 0.0,
  "gpus_per_nic": 1,
  "nic_gbps": 45.0
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

nlohmann::json description_json(const std::string& d) {
  if (d.find('\n') == std::string::npos) return d;
  nlohmann::json lines = nlohmann::json::array();
  size_t b = 0;
  for (size_t e; (e = d.find('\n', b)) != std::string::npos; b = e + 1) lines.push_back(d.substr(b, e - b));
  lines.push_back(d.substr(b));
  return lines;
}

}  // namespace

double HardwareProfile::gemm_rate(int hidden) const {
  return gemm_flops_by_hidden.empty() ? gemm_flops : interpolate(gemm_flops_by_hidden, hidden);
}

double HardwareProfile::attention_rate(int head_size) const {
  return gemm_flops * (attention_efficiency_by_head.empty() ? attention_efficiency
                                                            : interpolate(attention_efficiency_by_head, head_size));
}

double HardwareProfile::attention_prefix_rate(int head_size, i64 queries) const {
  const int rows = int(std::min<i64>(queries, std::numeric_limits<int>::max()));
  return attention_rate(head_size) * (attention_prefix_ratio_by_queries.empty()
                                          ? attention_prefix_ratio
                                          : interpolate(attention_prefix_ratio_by_queries, std::max(1, rows)));
}

nlohmann::json to_json(const HardwareProfile& p) {
  nlohmann::json j = {
      {"name", p.name},
      {"description", description_json(p.description)},
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
      {"attention_prefix_ratio", p.attention_prefix_ratio},
      {"attention_prefix_ratio_by_queries", table_json(p.attention_prefix_ratio_by_queries, 1.0)},
      {"copy_issue_us", p.copy_issue / kMicro},
      {"copy_compute_share", p.copy_compute_share},
      {"attention_chunk_us", p.attention_chunk / kMicro},
  };
  if (p.threads > 0) j["threads"] = p.threads;
  if (!p.attention_kernels.empty()) {
    nlohmann::json classes = nlohmann::json::array();
    for (const auto& k : p.attention_kernels)
      classes.push_back({{"head_size", k.head_size},
                         {"pattern", k.causal ? "causal" : "after_keys"},
                         {"rows", k.rows},
                         {"kernel", k.kernel},
                         {"cudnn_tflops", k.cudnn_flops / kTera},
                         {"own_tflops", k.own_flops / kTera}});
    j["attention_kernels"] = classes;
  }
  if (p.gpus_per_pcie_switch > 0) {
    j["gpus_per_pcie_switch"] = p.gpus_per_pcie_switch;
    j["pcie_switch_gbps"] = p.pcie_switch_bw / kGiga;
  }
  if (p.gpus_per_numa_node > 0) {
    j["gpus_per_numa_node"] = p.gpus_per_numa_node;
    j["numa_host_gbps"] = p.numa_host_bw / kGiga;
  }
  if (p.gpus_per_nic > 0) {
    j["gpus_per_nic"] = p.gpus_per_nic;
    j["nic_gbps"] = p.nic_bw / kGiga;
  }
  return j;
}

HardwareProfile profile_from_json(const nlohmann::json& j, const std::string& where) {
  SPPO_CHECK(j.is_object(), "profile") << where << ": a profile is a JSON object";
  HardwareProfile p;
  const std::string at = where + ": field ";
  p.name = json_string_field(j, "name", std::filesystem::path(where).stem().string(), "profile", at);
  if (j.contains("description") && j["description"].is_array()) {  // one line per element
    for (const auto& line : j["description"]) {
      SPPO_CHECK(line.is_string(), "profile") << where << ": description lines must be strings";
      p.description += (p.description.empty() ? "" : "\n") + line.get<std::string>();
    }
  } else {
    p.description = json_string_field(j, "description", "", "profile", at);
  }
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
  p.threads = int(count(optional(j, "threads", 0, where), "threads", 1 << 16));
  p.gpus_per_pcie_switch = int(optional(j, "gpus_per_pcie_switch", 0, where));
  p.pcie_switch_bw = optional(j, "pcie_switch_gbps", 0, where) * kGiga;
  p.gpus_per_numa_node = int(optional(j, "gpus_per_numa_node", 0, where));
  p.numa_host_bw = optional(j, "numa_host_gbps", 0, where) * kGiga;
  p.gpus_per_nic = int(optional(j, "gpus_per_nic", 0, where));
  p.nic_bw = optional(j, "nic_gbps", 0, where) * kGiga;
  SPPO_CHECK((p.gpus_per_pcie_switch > 0) == (p.pcie_switch_bw > 0) &&
                 (p.gpus_per_numa_node > 0) == (p.numa_host_bw > 0) && (p.gpus_per_nic > 0) == (p.nic_bw > 0),
             "profile")
      << where << ": a shared link needs both its device count and its bandwidth (gpus_per_pcie_switch with "
      << "pcie_switch_gbps, gpus_per_numa_node with numa_host_gbps, gpus_per_nic with nic_gbps)";
  p.gemm_flops_by_hidden = table_from_json(j, "gemm_tflops_by_hidden", where, kTera);
  p.attention_efficiency_by_head = table_from_json(j, "attention_efficiency_by_head_size", where, 1.0);
  p.attention_prefix_ratio = optional(j, "attention_prefix_ratio", 1, where);
  p.attention_prefix_ratio_by_queries = table_from_json(j, "attention_prefix_ratio_by_queries", where, 1.0);
  p.copy_issue = optional(j, "copy_issue_us", 0, where) * kMicro;
  p.copy_compute_share = optional(j, "copy_compute_share", 0, where);
  p.attention_chunk = optional(j, "attention_chunk_us", 0, where) * kMicro;
  if (j.contains("attention_kernels")) {
    const auto& classes = j["attention_kernels"];
    SPPO_CHECK(classes.is_array(), "profile") << where << ": attention_kernels must be a list of shape classes";
    for (const auto& k : classes) {
      const std::string what = where + ": an attention_kernels entry";
      SPPO_CHECK(k.is_object(), "profile") << what << " must be an object";
      HardwareProfile::AttentionClass c;
      c.head_size = int(count(required(k, "head_size", what, "head size"), "head_size", 4096));
      c.rows = int(count(required(k, "rows", what, "query rows"), "rows", 1 << 30));
      const std::string pattern = json_string_field(k, "pattern", "", "profile", what + ": field ");
      c.kernel = json_string_field(k, "kernel", "", "profile", what + ": field ");
      SPPO_CHECK(pattern == "causal" || pattern == "after_keys", "profile")
          << what << ": pattern must be \"causal\" or \"after_keys\" (got \"" << pattern << "\")";
      SPPO_CHECK(c.kernel == "cudnn" || c.kernel == "own", "profile")
          << what << ": kernel must be \"cudnn\" or \"own\" (got \"" << c.kernel << "\")";
      SPPO_CHECK(c.head_size > 0 && c.rows > 0, "profile") << what << ": head_size and rows must be positive";
      c.causal = pattern == "causal";
      c.cudnn_flops = optional(k, "cudnn_tflops", 0, what) * kTera;
      c.own_flops = optional(k, "own_tflops", 0, what) * kTera;
      p.attention_kernels.push_back(c);
    }
  }

  SPPO_CHECK(p.attention_prefix_ratio > 0 && p.attention_prefix_ratio <= 100, "profile")
      << where << ": attention_prefix_ratio must be in (0, 100] (the rate after a prefix over the causal rate; "
      << "1 when unknown)";
  for (const auto& [rows, ratio] : p.attention_prefix_ratio_by_queries)
    SPPO_CHECK(ratio <= 100, "profile") << where << ": attention_prefix_ratio_by_queries at " << rows
                                        << " query rows is " << ratio << "; at most 100 is accepted";
  SPPO_CHECK(p.copy_compute_share <= 1, "profile")
      << where << ": copy_compute_share must be in [0, 1] (the share of a copy's seconds the compute stream loses "
      << "while it runs; 0 when copies run beside the kernels)";
  // A second or more per copy or chunk is a unit mistake (the fields are microseconds).
  SPPO_CHECK(p.copy_issue < 1 && p.attention_chunk < 1, "profile")
      << where << ": copy_issue_us and attention_chunk_us are microseconds; below 1e6 is accepted (got "
      << p.copy_issue / kMicro << " and " << p.attention_chunk / kMicro << ")";
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
