#include "sim/explain.h"

#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/check.h"
#include "core/config.h"
#include "core/layout.h"
#include "schedule/memory.h"
#include "sim/baselines.h"
#include "sim/solver.h"

namespace sppo::sim {

const char* to_string(Row r) {
  switch (r) {
    case Row::Weights: return "weights";
    case Row::Gradients: return "gradients";
    case Row::Optimizer: return "optimizer state";
    case Row::KVCache: return "K/V cache";
    case Row::KVGradAccum: return "dK/dV accumulators";
    case Row::Units: return "activation units";
    case Row::Checkpoints: return "checkpointed inputs";
    case Row::Recompute: return "recompute working set";
    case Row::Hidden: return "hidden states";
    case Row::LayerWorkspace: return "layer workspace";
    case Row::AttentionWorkspace: return "attention workspace";
    case Row::Logits: return "logits and loss";
    case Row::CommBuffers: return "communication buffers";
    case Row::Borrowed: return "MSP borrowed weights";
    case Row::StepInputs: return "token ids and loss sum";
    case Row::kCount: break;
  }
  SPPO_ASSERT(false);
  return "";
}

i64 MemoryExplain::device_total() const {
  i64 t = 0;
  for (const auto& l : lines) t += l.device;
  return t;
}

i64 MemoryExplain::host_total() const {
  i64 t = 0;
  for (const auto& l : lines) t += l.host;
  return t;
}

namespace {

std::string num(double v) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

std::string layout_of(const plan::Plan& p) {
  std::ostringstream os;
  if (p.system == "megatron") os << "tp " << p.tp << " cp " << p.sp;
  else if (p.system == "deepspeed") os << "ulysses " << p.sp;
  else if (p.tp > 1) os << "tp " << p.tp;
  else os << "sp " << p.sp;
  os << " pp " << p.pp << " dp " << p.dp;
  if (p.system != "megatron") os << " N " << p.subseqs;
  if (p.msp) os << " msp";
  if (p.system == "sppo" && p.zero) os << " zero-1";
  return os.str();
}

// Lines in Row order: every row present once.
std::vector<MemoryLine> complete(std::vector<MemoryLine> given) {
  std::vector<MemoryLine> out(static_cast<std::size_t>(Row::kCount));
  for (int r = 0; r < int(Row::kCount); ++r) out[r].row = Row(r);
  for (auto& l : given) {
    MemoryLine& o = out[int(l.row)];
    o.device += l.device;
    o.host += l.host;
    if (!l.formula.empty()) o.formula += (o.formula.empty() ? "" : "; ") + l.formula;
  }
  return out;
}

MemoryExplain explain_sppo(const plan::Plan& p, const HardwareProfile& hw) {
  const SimResult r = simulate_plan(p, hw);
  const int rank = r.peak_rank;
  const auto& terms = r.peak_terms.at(std::size_t(rank));
  auto at = [&](sched::MemTerm t) { return terms[std::size_t(t)]; };
  const ActPrecision prec = hw.precision == "f32" ? ActPrecision::F32 : ActPrecision::BF16;
  const int e = prec == ActPrecision::F32 ? 4 : 2;
  const ModelConfig& c = p.model;
  const sched::Schedule s = plan_schedule(p);
  const sched::MemoryRules rules = memory_rules(c, prec, p.zero == 1);
  const sched::RankMemory mem(rules, s, rank);
  const i64 params = mem.owned_params(), state = mem.state_params();
  const auto [ob, oe] = s.owned.empty() ? std::pair<int, int>{0, c.layers} : s.owned.at(std::size_t(rank));
  const i64 kv_pt = mem.kv_per_token(), acc_pt = mem.acc_per_token(), unit_pt = mem.unit_per_token();
  const i64 h_row = i64(c.hidden) * e;
  const int stage = (rank / (p.sp * p.tp)) % p.pp;
  // Tensor parallelism divides the heads' tensors by tp: K, V and their accumulators are
  // 2 x (H / tp) wide on each member (core/layout.h TpShard).
  const std::string Hw = p.tp > 1 ? "(H / tp " + std::to_string(p.tp) + ")" : "H";
  const std::string shards = p.tp > 1 ? " (this rank's tensor-parallel shards)" : "";
  std::vector<MemoryLine> lines;
  const std::string P = num(double(params)) + " parameters of layers " + std::to_string(ob) + "-" +
                        std::to_string(oe - 1) + (ob == 0 ? " + embedding" : "") +
                        (oe == c.layers ? (ob == 0 ? " + final LayerNorm" : " + tied head + final LayerNorm") : "") +
                        shards;
  const std::string copy = rules.weight_copy_bytes > 0 ? " + " + std::to_string(rules.weight_copy_bytes) +
                                                             " B x P (their working copy for the GEMMs)"
                                                       : "";
  lines.push_back({Row::Weights, at(sched::MemTerm::Weights) + at(sched::MemTerm::WeightCopy), 0,
                   "4 B x P (fp32 master weights)" + copy + ", P = " + P});
  lines.push_back({Row::Gradients, at(sched::MemTerm::Gradients), 0, "4 B x P (fp32)"});
  lines.push_back({Row::Optimizer, at(sched::MemTerm::Optimizer), 0,
                   p.zero ? "8 B x " + num(double(state)) + " (AdamW m, v of this rank's ZeRO-1 shard, P / " +
                                std::to_string(p.sp * p.dp) + ")"
                          : "8 B x P (AdamW m, v)"});
  const i64 window = at(sched::MemTerm::KVWindow);
  lines.push_back({Row::KVCache, at(sched::MemTerm::KVCache) + window, 0,
                   "2 " + Hw + " e = " + num(double(kv_pt)) + " B per token and layer x " +
                       num(double(at(sched::MemTerm::KVCache)) / double(kv_pt)) +
                       (p.kv_host_layers.empty()
                            ? std::string(" token-layers (every subsequence before its backward)")
                            : " token-layers on the device (the running subsequence's; " +
                                  std::to_string(p.kv_host_layers.size()) +
                                  " layers keep the rest on the host) + the streaming window " + num(double(window)) +
                                  " B (two chunks of K, V, and in backward their dK/dV)")});
  lines.push_back({Row::KVGradAccum, at(sched::MemTerm::KVGradAccum), 0,
                   "2 " + Hw + " x 4 B = " + num(double(acc_pt)) + " B per position and layer x " +
                       num(double(at(sched::MemTerm::KVGradAccum)) / double(acc_pt)) + " position-layers"});
  const i64 units = at(sched::MemTerm::Units), host = r.host_at_peak.at(std::size_t(rank));
  lines.push_back({Row::Units, units, host,
                   num(double(unit_pt)) + " B per token and layer (x, LN outputs and statistics, q, attention output, "
                   "LSE, MLP input and pre-activation" + shards + ") + head_grad " + num(double(h_row)) +
                       " B per token" + (p.tp > 1 ? " of this rank's rows" : "") + ": " +
                       num(double(units) / double(unit_pt)) + " token-layers' worth on the device; the host holds "
                       "the offloaded part (alpha " + p.alpha_rule + ")"});
  lines.push_back({Row::Checkpoints, 0, 0, "none: SPPO keeps activations and does not recompute"});
  lines.push_back({Row::Recompute, 0, 0, "none"});
  lines.push_back({Row::Hidden, at(sched::MemTerm::Hidden), 0,
                   "[T, H] rows of " + num(double(h_row)) + " B: layer outputs, residual gradients, hidden states "
                   "sent and received between stages: " + num(double(at(sched::MemTerm::Hidden)) / double(h_row)) +
                       " rows"});
  lines.push_back({Row::LayerWorkspace, at(sched::MemTerm::Workspace), 0,
                   "one layer's scratch: qkv, MLP activation, a gradient row, delta (" +
                       num(double(mem.ws_per_token())) + " B per token) + kernel scratch"});
  lines.push_back({Row::AttentionWorkspace, 0, 0, "in the layer workspace (the flash kernel's blocks)"});
  lines.push_back({Row::Logits, at(sched::MemTerm::HeadWorkspace), 0,
                   "logits of " + std::to_string(rules.head_chunk) + " rows at a time, [chunk, V] and its gradient"});
  lines.push_back({Row::CommBuffers, at(sched::MemTerm::RingBuffers), 0,
                   "ring attention (queries travel, keys stay): the other pieces' queries with the partial outputs "
                   "and LSEs both ways in forward; their queries, output gradients, LSEs, deltas and partial dq "
                   "in backward; the gradient all-reduce works in place"});
  lines.push_back({Row::Borrowed, at(sched::MemTerm::BorrowedWeights) + at(sched::MemTerm::BorrowedGrads), 0,
                   "MSP helpers: another stage's weights (e B a parameter) and fp32 gradients"});
  lines.push_back({Row::StepInputs, at(sched::MemTerm::StepInputs), 0,
                   "4 B x (S + 1) token ids + 8 B loss sum, S = " + std::to_string(s.seq_len())});
  MemoryExplain m;
  m.system = "sppo";
  m.lines = complete(std::move(lines));
  char where[160];
  std::snprintf(where, sizeof where, "rank %d (stage %d), at %.4g s of a %.4g s step", rank, stage,
                r.peak_time_s.at(std::size_t(rank)), r.step_time_s);
  m.where = where;
  m.notes.push_back("H " + std::to_string(c.hidden) + ", e " + std::to_string(e) + " (" + hw.precision +
                    " activations); the simulator's accounting at the peak (schedule/memory.h, the runtime's "
                    "arena rules), so the terms sum to the predicted peak");
  SPPO_ASSERT(m.device_total() == r.peak_device_bytes);
  return m;
}

}  // namespace

MemoryExplain explain_memory(const plan::Plan& p, const plan::HardwareProfile& hw) {
  MemoryExplain m = p.system == "sppo" ? explain_sppo(p, hw) : explain_baseline(p, hw);
  m.lines = complete(std::move(m.lines));
  m.layout = layout_of(p);
  m.budget = p.budget;
  m.device_memory = hw.device_memory;
  m.reserve = hw.memory_reserve;
  return m;
}

std::string explain_text(const MemoryExplain& m) {
  std::ostringstream os;
  os << "memory per device: " << m.system << " (" << m.layout << "), peak on " << m.where << "\n";
  os << "| term | device | host | formula |\n|---|---|---|---|\n";
  auto bytes = [](i64 b) { return b == 0 ? std::string("-") : format_bytes(double(b)); };
  for (const auto& l : m.lines)
    os << "| " << to_string(l.row) << " | " << bytes(l.device) << " | " << bytes(l.host) << " | "
       << (l.formula.empty() ? "-" : l.formula) << " |\n";
  os << "| total | " << format_bytes(double(m.device_total())) << " | " << bytes(m.host_total()) << " | budget "
     << format_bytes(double(m.budget)) << " |\n";
  os << "| framework and allocator reserve | " << format_bytes(double(m.reserve)) << " | - | the profile's "
     << "memory_reserve_bytes (CUDA context, library workspaces, allocator fragmentation), outside the budget of "
     << format_bytes(double(m.device_memory)) << " less this |\n";
  for (const auto& n : m.notes) os << n << "\n";
  return os.str();
}

nlohmann::json to_json(const MemoryExplain& m) {
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& l : m.lines)
    rows.push_back({{"term", to_string(l.row)}, {"device_bytes", l.device}, {"host_bytes", l.host},
                    {"formula", l.formula}});
  return {{"system", m.system},         {"layout", m.layout},
          {"where", m.where},           {"terms", rows},
          {"device_bytes", m.device_total()}, {"host_bytes", m.host_total()},
          {"budget_bytes", m.budget},   {"reserve_bytes", m.reserve},
          {"device_memory_bytes", m.device_memory}, {"notes", m.notes}};
}

}  // namespace sppo::sim
