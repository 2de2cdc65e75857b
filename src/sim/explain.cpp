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

// Note [Why each tensor sits where it does]: per kind of saved tensor of a layer, its bytes
// per token and layer and its placement in the plan, with the reason: a tensor is kept
// (and offloaded at the plan's alpha, hidden behind compute where the copies allow) unless
// the plan recomputes it, which it does only where no plan with the K/V on the device and
// nothing more recomputed fits the budgets, and then because the fastest plan that fits
// does (Note [Placing every tensor] in solver/placements.cpp); K/V stay on the device
// unless no plan with them there fits.
std::vector<TensorPlacement> placements_of(const plan::Plan& p, ActPrecision prec, const RankShard& shard) {
  const ModelConfig& c = p.model;
  // One token's bytes a member, as the memory rules count them: n tokens' over n.
  const i64 n = std::max(shard.tp.size, shard.ulysses.size);
  const std::vector<TensorSpec> specs = block_saved_specs(c, n, prec, shard);
  double alpha = 0, alpha_max = 0;
  for (double a : p.alpha) alpha += a / double(p.alpha.size()), alpha_max = std::max(alpha_max, a);
  const std::string offloaded = alpha_max > 0 ? "device, offloaded at alpha (mean " + num(alpha) + ", max " +
                                                    num(alpha_max) + ", " + p.alpha_rule + ")"
                                              : "device";
  const bool kv_host = !p.place.kv_layers(KvPlace::Host).empty(), kv_rc = !p.place.kv_layers(KvPlace::Recompute).empty();
  const std::string recompute_why = "recomputed in backward: no plan with the K/V on the device and nothing more "
                                    "recomputed fits the budgets, and the fastest that fits recomputes it; or "
                                    "--recompute-tensors named it";
  std::vector<TensorPlacement> out;
  auto bytes_of = [&](SavedSet set) {
    i64 b = 0;
    for (std::size_t k = 0; k < specs.size(); ++k)
      if (in_set(set, int(k))) b += specs[k].bytes();
    return b / n;
  };
  auto names_of = [&](SavedSet set) {
    std::string names;
    for (std::size_t k = 0; k < specs.size(); ++k)
      if (in_set(set, int(k))) names += (names.empty() ? "" : ", ") + specs[k].name;
    return names;
  };
  if (!p.place.any_input_rebuilt())
    out.push_back({"x", bytes_of(1u << kSavedX), offloaded,
                   "the block's input, the previous block's output: kept (recomputing it is the whole previous "
                   "block); offloaded where the device needs the room"});
  else
    out.push_back({"x", bytes_of(1u << kSavedX),
                   "every other layer's rebuilt; the rest " + offloaded,
                   "the block's input, the previous block's output: a rebuilt layer's is made again by the layer "
                   "below's forward in each of its backward's ops (the notes say why); the others kept, offloaded "
                   "where the device needs the room"});
  // Note [Head size]: q and the output projection are Z A wide where A is not H / Z.
  const bool wide = c.q_width() != c.hidden;
  const std::string costs[] = {"a LayerNorm of x again, elementwise",
                               c.qk_norm ? "2 H (Z A + G A) FLOPs a token (q's and k's rows of the projection, their norms)"
                               : wide    ? "2 H Z A FLOPs a token (q's rows of the projection)"
                                         : "2 H^2 FLOPs a token (q's rows of the projection)",
                               "the attention again",
                               wide ? "2 H Z A FLOPs a token (the output projection)"
                                    : "2 H^2 FLOPs a token (the output projection)",
                         "a LayerNorm of x_mid again, elementwise",
                         p.model.gated() ? "4 H F FLOPs a token (the MLP's gate and up GEMM)"
                                         : "2 H F FLOPs a token (the MLP's first GEMM)"};
  for (std::size_t g = 0; g < recompute_groups().size(); ++g) {
    const RecomputeGroup& group = recompute_groups()[g];
    if (in_set(group.tensors, kSavedHeadGrad)) continue;  // the last stage's, below
    const bool rc = (p.place.recompute & group.tensors) != 0;
    out.push_back({names_of(group.tensors), bytes_of(group.tensors), rc ? "recomputed" : offloaded,
                   rc ? recompute_why + "; costs " + costs[g]
                      : std::string("kept: recomputing it would cost ") + costs[g]});
  }
  // Note [The loss in backward] (core/layout.h).
  const i64 head_row = total_bytes(head_saved_specs(c, n, prec, shard)) / n;
  if (in_set(p.place.recompute, kSavedHeadGrad))
    out.push_back({"head_grad (the last stage's)", head_row, "recomputed",
                   recompute_why + "; costs the last layer's MLP output again (2 H F FLOPs a token), and the LM "
                                   "head runs in its backward rather than its forward"});
  else
    out.push_back({"head_grad (the last stage's)", head_row, offloaded,
                   "kept: the loss's gradient at the last layer's output, from the head in the forward; "
                   "recomputing it would cost the last layer's MLP output again (2 H F FLOPs a token)"});
  const i64 kv = bytes_of(1u << kSavedK | 1u << kSavedV);
  const i64 sums = 2 * i64(shard.heads().local_kv_width(c)) * 4;
  // The k and v rows of the projection: [G A, H] each with grouped-query attention.
  const std::string kv_flops = c.kv_head_count() == c.heads ? "4 H^2" : "4 H G A";
  if (kv_rc) {
    out.push_back({"k, v", kv, "recomputed from x",
                   "--kv-cache recompute, or the planner's choice (no plan with K/V on the device or the host fits, "
                   "or none is as fast): each later "
                   "subsequence and the backward recompute an earlier block's K, V from its x, a chunk at a time "
                   "(" + kv_flops + " FLOPs a token each time)"});
    out.push_back({"dK/dV sums", i64(c.hidden) * 4, "host, as d(LayerNorm-1 output)",
                   "sums of the later subsequences' gradients, taken through the K/V projection into the layer "
                   "input's (H x 4 B a token, " +
                       std::string(c.kv_head_count() == c.heads ? "half of dK and dV"
                                                                 : "against 2 G A x 4 B of dK and dV") +
                       "; Note [dK/dV into the layer input])"});
  } else if (kv_host) {
    out.push_back({"k, v", kv, "host, streamed back through a window",
                   "--kv-cache host, or the planner's choice (no plan with K/V on the device fits, or none is as "
                   "fast): copied out after the forward, streamed "
                   "back to each later subsequence's attention"});
    out.push_back({"dK/dV sums", sums, "host", "fp32 sums of the later subsequences' gradients, streamed in and "
                                                "out with the K/V chunks"});
  } else {
    out.push_back({"k, v", kv, "device", "the K/V cache: every later subsequence attends to it"});
    out.push_back({"dK/dV sums", sums, "device", "fp32 accumulators from the first backward to reach a block"});
  }
  return out;
}

MemoryExplain explain_sppo(const plan::Plan& p, const HardwareProfile& hw) {
  const SimResult r = simulate_plan(p, hw);
  const int rank = r.peak_rank;
  const auto& terms = r.peak_terms.at(std::size_t(rank));
  auto at = [&](sched::MemTerm t) { return terms[std::size_t(t)]; };
  const ActPrecision prec = precision_of(hw);
  const int e = prec == ActPrecision::F32 ? 4 : 2;
  const ModelConfig& c = p.model;
  const sched::Schedule s = plan_schedule(p);
  const sched::MemoryRules rules = plan_rules(p, prec);
  const sched::RankMemory mem(rules, s, rank);
  auto on_host = [&](sched::MemTerm t) { return mem.host_fixed_terms()[std::size_t(t)]; };
  const i64 params = mem.owned_params(), state = mem.state_params();
  const auto [ob, oe] = s.owned.empty() ? std::pair<int, int>{0, c.layers} : s.owned.at(std::size_t(rank));
  const i64 kv_pt = mem.kv_per_token(), acc_pt = mem.acc_per_token(), unit_pt = mem.unit_per_token();
  const i64 h_row = i64(c.hidden) * e;
  const int stage = p.par.coord_of(rank).stage;
  // Tensor parallelism divides the heads' tensors by tp: K, V and their accumulators are
  // 2 x (H / tp) wide on each member (core/layout.h TpShard).
  // Grouped-query attention narrows them to G A (G key/value heads).
  const std::string kv_w = c.kv_head_count() == c.heads ? "H" : "G A";
  // More members than key/value heads: each holds one whole head (Note [Replicated key/value
  // heads]). A Ulysses member holds its heads' K/V of every row of the piece (runtime/ulysses.h).
  const bool uly = p.par.ulysses > 1;
  const int split = uly ? p.par.ulysses : p.par.tp;
  const std::string by = uly ? "ulysses" : "tp";
  const std::string Hw = split > c.kv_head_count()
                             ? "A (one key/value head, on " + by + " / G = " +
                                   std::to_string(split / c.kv_head_count()) + " ranks, each holding it whole)"
                         : split > 1 ? "(" + kv_w + " / " + by + " " + std::to_string(split) + ")"
                                     : kv_w;
  const std::string shards = p.par.tp > 1 ? " (this rank's tensor-parallel shards)"
                             : uly        ? " (this rank's rows of each piece; q, k, v of its heads for every row)"
                                          : "";
  std::vector<MemoryLine> lines;
  const std::string P = num(double(params)) + " parameters of layers " + std::to_string(ob) + "-" +
                        std::to_string(oe - 1) + (ob == 0 ? " + embedding" : "") +
                        (oe == c.layers ? (c.llama() ? " + final RMSNorm + LM head"
                                                     : ob == 0 ? " + final LayerNorm"
                                                               : " + tied head + final LayerNorm")
                                        : "") +
                        shards;
  const std::string copy = rules.weight_copy_bytes > 0 ? " + " + std::to_string(rules.weight_copy_bytes) +
                                                             " B x P (their working copy for the GEMMs)"
                                                       : "";
  // The state's parameters: every owned one, or this rank's ZeRO-1 shard of them.
  const std::string Ps = p.par.zero != ZeroStage::None ? num(double(state)) + " (this rank's ZeRO-1 shard, P / " +
                                                            std::to_string(p.par.zero_shards()) + ")"
                                                      : std::string("P");
  const bool state_host = rules.optimizer_host;
  // With the layers' weights on the host (Note [Weights on the host]) the device holds the
  // embedding's, final norm's and head's, and the layers in flight with their gradients.
  const bool layers_host = p.place.weights_host();
  const std::string in_flight =
      layers_host ? "; on the device, those of the embedding, final norm and head, and of the layer running and "
                    "the next, each brought from the host's master for the forward or backward that runs it" +
                        std::string(rules.weight_copy_bytes > 0 ? " (fp32, its working copy converted there)" : "") +
                        ": --weights host"
                  : "";
  lines.push_back({Row::Weights,
                   at(sched::MemTerm::Weights) + at(sched::MemTerm::WeightCopy) + at(sched::MemTerm::LayerWeights),
                   on_host(sched::MemTerm::Weights) + on_host(sched::MemTerm::WeightCopy),
                   "4 B x P (fp32 master weights)" + copy + ", P = " + P + in_flight +
                       (state_host ? "; the host keeps the update's fp32 master, 4 B x " + Ps : "")});
  lines.push_back({Row::Gradients, at(sched::MemTerm::Gradients) + at(sched::MemTerm::LayerGrads),
                   on_host(sched::MemTerm::Gradients),
                   "4 B x P (fp32)" +
                       std::string(layers_host ? "; on the device, those of the embedding, final norm and head, and "
                                                 "of the layers whose backward runs, each leaving for the host's "
                                                 "after its last"
                                               : "") +
                       (state_host ? "; the host a copy the update reads, 4 B x " + Ps : "")});
  lines.push_back({Row::Optimizer, at(sched::MemTerm::Optimizer), on_host(sched::MemTerm::Optimizer),
                   "8 B x " + Ps + " (AdamW m, v" +
                       (state_host ? ", on the host, updated there: --optimizer-state host)" : ")")});
  const i64 window = at(sched::MemTerm::KVWindow);
  lines.push_back({Row::KVCache, at(sched::MemTerm::KVCache) + window, 0,
                   "2 " + Hw + " e = " + num(double(kv_pt)) + " B per token and layer x " +
                       num(double(at(sched::MemTerm::KVCache)) / double(kv_pt)) +
                       (p.place.kv_layers(KvPlace::Host).empty()
                            ? std::string(" token-layers (every subsequence before its backward)")
                            : " token-layers on the device (the running subsequence's; " +
                                  std::to_string(p.place.kv_layers(KvPlace::Host).size()) +
                                  " layers keep the rest on the host) + the streaming window " + num(double(window)) +
                                  " B (two chunks of K, V, and in backward their dK/dV)")});
  lines.push_back({Row::KVGradAccum, at(sched::MemTerm::KVGradAccum), 0,
                   "2 " + Hw + " x 4 B = " + num(double(acc_pt)) + " B per position and layer x " +
                       num(double(at(sched::MemTerm::KVGradAccum)) / double(acc_pt)) + " position-layers" +
                       (p.place.layer_major()
                            ? std::string(" (the layer-major backward: one layer's at a time)")
                            : std::string(" (the paper's backward order: every layer's from the first backward)"))});
  const i64 units = at(sched::MemTerm::Units), host = r.host_at_peak.at(std::size_t(rank)) - mem.host_fixed_bytes();
  lines.push_back({Row::Units, units, host,
                   num(double(unit_pt)) + " B per token and layer (x, LN outputs and statistics, q, attention output, "
                   "LSE, MLP input and pre-activation" +
                       (c.qk_norm ? std::string(", q and k before their norms with the norms' statistics") : "") +
                       shards + ")" +
                       (in_set(p.place.recompute, kSavedHeadGrad)
                            ? std::string(" (head_grad recomputed: the head runs in the last layer's backward)")
                            : " + head_grad " + num(double(h_row)) + " B per token" +
                                  (p.par.tp > 1 || uly ? " of this rank's rows" : "")) +
                       ": " +
                       num(double(units) / double(unit_pt)) + " token-layers' worth on the device; the host holds "
                       "the offloaded part (alpha " + p.alpha_rule + ")"});
  lines.push_back({Row::Checkpoints, 0, 0, "none: SPPO keeps activations and does not recompute"});
  lines.push_back({Row::Recompute, at(sched::MemTerm::Recomputed), 0,
                   p.place.recompute == 0 ? std::string("none")
                                    : "the recomputed groups " + recompute_tensors_text(p.place.recompute) + ", " +
                                          num(double(mem.recompute_per_token())) +
                                          " B per token and layer, while one layer runs forward or backward"});
  lines.push_back({Row::Hidden, at(sched::MemTerm::Hidden), 0,
                   "[T, H] rows of " + num(double(h_row)) + " B: layer outputs, residual gradients, hidden states "
                   "sent and received between stages: " + num(double(at(sched::MemTerm::Hidden)) / double(h_row)) +
                       " rows"});
  // Note [MLP tiles]: the MLP activation (and a recomputed fc_pre) a tile of R rows at a time.
  const i64 mlp_row = i64(c.fc_width()) * rules.act_bytes();
  const bool fc_tile = p.place.mlp_tile_rows > 0 && in_set(p.place.recompute, kSavedFcPre);
  lines.push_back(
      {Row::LayerWorkspace, at(sched::MemTerm::Workspace), 0,
       p.place.mlp_tile_rows == 0
           ? "one layer's scratch: qkv, MLP activation, a gradient row, delta" +
                 std::string(uly ? ", and Ulysses' all-to-all buffers (its rows' K, V and dK, dV; its heads' q, "
                                   "output, LSE, delta and dq of every row; the packed blocks sent and received)"
                                 : "") +
                 " (" + num(double(mem.ws_per_token())) + " B per token) + kernel scratch"
           : "one layer's scratch: qkv, a gradient row, delta (" + num(double(mem.ws_per_token() - mlp_row)) +
                 " B per token) + the MLP activation" + (fc_tile ? " and fc_pre" : "") + " in tiles of min(T, " +
                 std::to_string(p.place.mlp_tile_rows) + ") rows (" + num(double(mlp_row * (fc_tile ? 2 : 1))) +
                 " B per row) + kernel scratch"});
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
  m.system = to_string(p.system);
  m.lines = complete(std::move(lines));
  char where[160];
  std::snprintf(where, sizeof where, "rank %d (stage %d), at %.4g s of a %.4g s step", rank, stage,
                r.peak_time_s.at(std::size_t(rank)), r.step_time_s);
  m.where = where;
  m.notes.push_back("H " + std::to_string(c.hidden) + ", e " + std::to_string(e) + " (" + hw.precision +
                    " activations); the simulator's accounting at the peak (schedule/memory.h, the runtime's "
                    "arena rules), so the terms sum to the predicted peak");
  m.notes.push_back(state_host ? "optimizer state on the host: the fp32 master and AdamW m, v of " + Ps +
                                     " parameters with their gradients' copy; each step the gradients go down, the "
                                     "host's processor updates them and the weights come back up"
                               : std::string("optimizer state on the device, beside the weights (--optimizer-state "
                                             "host would move the fp32 master and AdamW m, v to the host)"));
  if (uly) {
    // Note [Replicated key/value heads]: members past G each hold a replicated head whole.
    const int G = c.kv_head_count(), m_rep = TpShard{0, p.par.ulysses}.kv_replicas(c);
    m.notes.push_back(
        "ulysses " + std::to_string(p.par.ulysses) + ": each rank keeps its heads' K/V of every row, " +
        (m_rep > 1 ? "a key/value head on each of its " + std::to_string(m_rep) + " replicas (" +
                         std::to_string(p.par.ulysses) + " ranks over " + std::to_string(G) +
                         " key/value heads): the K/V cache and its dK/dV sums are 1/" + std::to_string(G) +
                         " of one rank's on each, " + std::to_string(m_rep) + " times what an even split would " +
                         "give, and the replicas sum their dK, dV once a layer"
                   : "1/" + std::to_string(p.par.ulysses) + " of one rank's cache") +
        "; four all-to-alls a layer move q, k, v to the heads' ranks and the outputs back, their gradients in "
        "backward (train --ulysses)");
  }
  SPPO_ASSERT(m.device_total() == r.peak_device_bytes);
  m.placements = placements_of(p, prec, s.shard(rank));
  return m;
}

}  // namespace

MemoryExplain explain_memory(const plan::Plan& p, const plan::HardwareProfile& hw) {
  MemoryExplain m = explain_sppo(p, hw);
  m.lines = complete(std::move(m.lines));
  m.layout = plan::layout_text(p);
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
  if (!m.placements.empty()) {
    os << "\nsaved tensors of a layer, placed (bytes per token and layer, this rank's shards):\n";
    os << "| tensors | bytes | placement | why |\n|---|---|---|---|\n";
    for (const auto& t : m.placements)
      os << "| " << t.tensors << " | " << t.bytes_per_token << " | " << t.placement << " | " << t.why << " |\n";
  }
  return os.str();
}

nlohmann::json to_json(const MemoryExplain& m) {
  nlohmann::json placements = nlohmann::json::array();
  for (const auto& t : m.placements)
    placements.push_back({{"tensors", t.tensors}, {"bytes_per_token", t.bytes_per_token},
                          {"placement", t.placement}, {"why", t.why}});
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& l : m.lines)
    rows.push_back({{"term", to_string(l.row)}, {"device_bytes", l.device}, {"host_bytes", l.host},
                    {"formula", l.formula}});
  return {{"system", m.system},         {"layout", m.layout},
          {"where", m.where},           {"terms", rows},
          {"device_bytes", m.device_total()}, {"host_bytes", m.host_total()},
          {"budget_bytes", m.budget},   {"reserve_bytes", m.reserve},
          {"device_memory_bytes", m.device_memory}, {"notes", m.notes},
          {"placements", placements}};
}

}  // namespace sppo::sim
