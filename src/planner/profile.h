// Hardware profiles (docs/design.md 5): the rates the cost model divides by, as JSON files a
// user can edit (profiles/<name>.json). Files store friendly units (TFLOP/s, GB/s, us);
// the struct holds SI units (FLOP/s, B/s, s). `sppo profile` measures this machine and
// fills the same struct.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/dims.h"

namespace sppo::plan {

struct HardwareProfile {
  std::string name;
  std::string description;
  std::string precision = "bf16";     // activations: "bf16" on GPUs, "f32" on the CPU
  double gemm_flops = 0;              // achieved dense GEMM rate, FLOP/s
  double attention_efficiency = 0;    // attention kernel rate / gemm_flops
  double elementwise_bw = 0;          // device memory bandwidth for elementwise ops, B/s (0: free)
  double d2h_bw = 0;                  // device -> host copy, B/s
  double h2d_bw = 0;                  // host -> device copy, B/s
  double duplex_factor = 1;           // share of each direction's bandwidth when both run
  double intra_node_bw = 0;           // device <-> device in a node, B/s per direction
  double intra_node_latency = 0;      // s
  double inter_node_bw = 0;           // per device across nodes, B/s
  double inter_node_latency = 0;      // s
  i64 device_memory = 0;              // bytes per device
  i64 memory_reserve = 0;             // bytes the framework and allocator keep (not usable)
  i64 host_memory = 0;                // pinned host bytes available per device (0: unlimited)
  int devices_per_node = 1;
  // Host links that several devices share (0: not shared). A device's copies to and from
  // host memory cross its own link (d2h_bw, h2d_bw), then the uplink of its PCIe switch,
  // shared by gpus_per_pcie_switch devices (pcie_switch_bw per direction), then the host
  // memory of its NUMA node, shared by gpus_per_numa_node devices (numa_host_bw, both
  // directions together). Messages between nodes leave through a NIC shared by
  // gpus_per_nic devices (nic_bw per direction). Devices are numbered in order within a
  // node: devices 0..k-1 share the first switch, and so on. The simulator shares each link
  // among the transfers crossing it at the same time (Note [Shared host links]).
  int gpus_per_pcie_switch = 0;
  double pcie_switch_bw = 0;          // B/s per direction
  int gpus_per_numa_node = 0;
  double numa_host_bw = 0;            // B/s, both directions together
  int gpus_per_nic = 0;
  double nic_bw = 0;                  // B/s per direction
  double layer_overhead = 0;          // fixed seconds per layer of a forward or backward op
  // A CPU profile: the compute threads it was measured with, one device's worth (0: not a
  // CPU measurement). Ranks sharing a machine each run at their own threads' rate, so a
  // run whose ranks have another count is priced wrong (train --plan says so).
  int threads = 0;
  // Measured rate of a block's four GEMMs (forward and backward together) at hidden sizes H,
  // ascending: small H runs far below the peak on CPUs. Empty: gemm_flops for every H.
  std::vector<std::pair<int, double>> gemm_flops_by_hidden;

  // Measured attention efficiency (forward + backward rate / gemm_flops) at head sizes A,
  // ascending. Empty: attention_efficiency for every A.
  std::vector<std::pair<int, double>> attention_efficiency_by_head;

  // Note [Attention after a prefix]: queries against keys wholly before them (an earlier
  // subsequence's KV cache) run the kernel's unmasked blocks, faster per FLOP than the
  // causal diagonal block that attention_efficiency measures; this is the ratio of the
  // two rates, measured at the same head size (1: the same rate). Long sequences cut into
  // many subsequences spend most of their attention FLOPs there.
  double attention_prefix_ratio = 1;
  // The same ratio by the query rows of a kernel call (a subsequence's length), ascending:
  // short subsequences fill the kernel's query tiles less and repeat its per-tile work more
  // often, so a CPU runs 256 query rows at about 0.9 and 64 at about 0.65 the rate of 1024.
  // Empty: attention_prefix_ratio for every length.
  std::vector<std::pair<int, double>> attention_prefix_ratio_by_queries;

  // Note [Streamed chunks]: a layer whose K/V stream from the host (or are recomputed)
  // runs its attention a chunk at a time (runtime/kv_stream.h), and each chunk's pieces go
  // through the copy streams. What that costs the compute stream beyond the FLOPs and the
  // bytes over the link:
  //   copy_issue          seconds the compute stream loses per copy it issues (a CPU: the
  //                       lock and the wake-up of the copy thread; 0: none)
  //   copy_compute_share  the share of a copy's seconds (bytes / bandwidth) the compute
  //                       stream loses while it runs, 0..1. 0: the copies run beside the
  //                       kernels (a GPU's copy engines); a CPU whose copy threads share
  //                       the cores with the compute threads loses nearly all of it.
  //   attention_chunk     fixed seconds of one chunk's attention kernel call, the forward
  //                       with its log-sum-exp merge or the backward, over what its FLOPs
  //                       cost in one call (packing the queries, the merge, the parallel
  //                       region); measured with 256 query rows.
  // A short subsequence (a few hundred tokens) at a long offset streams thousands of
  // chunks of a few pieces each, so these fixed costs add up to as much as the attention.
  double copy_issue = 0;           // s per copy
  double copy_compute_share = 0;   // 0..1
  double attention_chunk = 0;      // s per chunk, forward or backward

  // Note [Attention kernels by shape class]: which kernels run attention faster on this
  // device, measured by `sppo profile --backend cuda` per head size, pattern and query rows:
  // a fused library's (cuDNN's) or the backend's own, with both rates (forward + backward,
  // FLOP/s). `causal`: a subsequence's own block (a causal call of rows x rows); else rows
  // queries against as many keys all before them (an earlier block, a streamed chunk).
  // --attention auto follows the class nearest a call. Empty: not measured.
  struct AttentionClass {
    int head_size = 0;
    bool causal = false;
    int rows = 0;
    std::string kernel;  // "cudnn" | "own": the faster
    double cudnn_flops = 0, own_flops = 0;
  };
  std::vector<AttentionClass> attention_kernels;

  // The GEMM rate for a model of hidden size H: log-linear between measured sizes,
  // clamped at the ends; gemm_flops when nothing was measured.
  double gemm_rate(int hidden) const;
  // The attention rate for head size A, likewise from attention_efficiency_by_head.
  double attention_rate(int head_size) const;
  // The rate against keys wholly before `queries` query rows (Note [Attention after a
  // prefix]): log-linear in attention_prefix_ratio_by_queries, clamped at the ends.
  double attention_prefix_rate(int head_size, i64 queries) const;

  double attention_flops() const { return gemm_flops * attention_efficiency; }
  i64 usable_memory() const { return device_memory - memory_reserve; }
  // Whether some host link or NIC is shared by several devices.
  bool shares_links() const {
    return (gpus_per_pcie_switch > 1 && pcie_switch_bw > 0) || (gpus_per_numa_node > 1 && numa_host_bw > 0) ||
           (gpus_per_nic > 1 && nic_bw > 0);
  }
};

// Names of the built-in profiles (also compiled in, so any working directory works).
std::vector<std::string> profile_names();

// Loads `name_or_path`: the path as given, then "<exe dir>/../profiles/<name>.json",
// then "profiles/<name>.json" under the working directory, then the compiled-in preset.
// Throws sppo::Error naming the missing field or the profiles that exist.
HardwareProfile load_profile(const std::string& name_or_path);
void save_profile(const HardwareProfile& p, const std::string& path);

nlohmann::json to_json(const HardwareProfile& p);
// `where` names the source in error messages. Every field is required except
// description (a string, or a list of strings joined by newlines), elementwise_gbps,
// memory_reserve_bytes, host_memory_bytes, layer_overhead_us, the tables,
// attention_prefix_ratio (1 when missing), copy_issue_us, copy_compute_share,
// attention_chunk_us (0 when missing: profiles written before they were measured),
// attention_kernels (empty when missing), threads
// (0 when missing: not a CPU measurement), and the
// shared links (gpus_per_pcie_switch with pcie_switch_gbps, gpus_per_numa_node with
// numa_host_gbps, gpus_per_nic with nic_gbps).
HardwareProfile profile_from_json(const nlohmann::json& j, const std::string& where);

}  // namespace sppo::plan
