#include "schedule/weights.h"

#include <map>
#include <optional>

#include "core/check.h"

namespace sppo::sched {

LayerUses::LayerUses(const Schedule& s, int rank) {
  if (!layer_grads_stream(s)) return;
  const auto& ops = s.ops.at(std::size_t(rank));
  const auto [ob, oe] = s.owned.empty() ? std::pair<int, int>{0, s.layers} : s.owned.at(std::size_t(rank));
  first_.reserve(ops.size() + 1);
  for (std::size_t k = 0; k < ops.size(); ++k) {
    first_.push_back(uses_.size());
    const Op& op = ops[k];
    const bool fwd = op.kind == OpKind::Forward, bwd = op.kind == OpKind::Backward;
    if (!(fwd || bwd) || op.layer_begin < ob || op.layer_end > oe) continue;
    const int n = op.layer_end - op.layer_begin;
    for (int j = 0; j < n; ++j) {
      LayerUse u;
      u.op = k;
      u.k = j;
      u.layer = fwd ? op.layer_begin + j : op.layer_end - 1 - j;
      u.backward = bwd;
      uses_.push_back(u);
    }
  }
  first_.push_back(uses_.size());
  // Each layer's first and last backward use.
  std::map<int, std::size_t> first_b, last_b;
  for (std::size_t u = 0; u < uses_.size(); ++u) {
    if (!uses_[u].backward) continue;
    first_b.try_emplace(uses_[u].layer, u);
    last_b[uses_[u].layer] = u;
  }
  for (const auto& [l, u] : first_b) uses_[u].grad_first = true;
  for (const auto& [l, u] : last_b) uses_[u].grad_last = true;
  const std::size_t n = uses_.size();
  int below = -1;  // the layer a rebuilt layer's run brought (its next run's)
  for (std::size_t u = 0; u < n; ++u) {
    LayerUse& x = uses_[u];
    if (u == 0) x.load_now = x.layer;
    const bool run_starts = x.backward && (u == 0 || uses_[u - 1].layer != x.layer || !uses_[u - 1].backward);
    if (run_starts && s.place.input_rebuilt(x.layer)) below = x.load_below = x.layer - 1;
    const bool next_other = u + 1 < n && uses_[u + 1].layer != x.layer;
    if (next_other && uses_[u + 1].layer != below) x.load_next = uses_[u + 1].layer;
    if (next_other && uses_[u + 1].layer == below) below = -1;
    x.weights_free = u + 1 == n || next_other;
    if (!layer_weights_stream(s)) x.load_now = x.load_next = x.load_below = -1, x.weights_free = false;
    int f = 0;
    if (u > 0 && uses_[u - 1].grad_last) x.grad_free[std::size_t(f++)] = uses_[u - 1].layer;
    if (u + 1 == n && x.grad_last) x.grad_free[std::size_t(f++)] = x.layer;
  }
}

const LayerUse& LayerUses::at(std::size_t index, int k) const {
  const std::size_t u = first(index) + std::size_t(k);
  SPPO_ASSERT_MSG(u < last(index) && uses_[u].k == k, "op " << index << " runs no own layer at position " << k);
  return uses_[u];
}

std::vector<int> gathered_layers(const LayerUses& uses, std::size_t index) {
  std::vector<int> layers;
  for (std::size_t u = uses.first(index); u < uses.last(index); ++u)
    for (int l : {uses.uses()[u].load_now, uses.uses()[u].load_next, uses.uses()[u].load_below})
      if (l >= 0) layers.push_back(l);
  return layers;
}

Schedule with_weight_gathers(Schedule s) {
  for (auto& ops : s.ops) std::erase_if(ops, [](const Op& op) { return op.kind == OpKind::AllGather; });
  if (!shards_weights(s.par.zero) || s.place.weights_host()) return s;
  for (int r = 0; r < s.ranks(); ++r) {
    auto& ops = s.ops[std::size_t(r)];
    const LayerUses uses(s, r);
    if (uses.empty()) continue;
    const std::vector<int> group = s.par.layer_group(r);
    std::vector<Op> out;
    out.reserve(ops.size() + uses.uses().size());
    for (std::size_t k = 0; k < ops.size(); ++k) {
      const std::vector<int> layers = gathered_layers(uses, k);
      // Before the op's all-to-all, which comes right before it (Note [Ulysses exchanges]).
      std::optional<Op> alltoall;
      if (k > 0 && ops[k - 1].kind == OpKind::AllToAll && !layers.empty())
        alltoall = std::move(out.back()), out.pop_back();
      for (int l : layers) {
        Op g;
        g.kind = OpKind::AllGather;
        g.payload = Payload::Weights;
        g.layer_begin = l;
        g.layer_end = l + 1;
        g.subseq = ops[k].subseq;
        g.group = group;
        out.push_back(std::move(g));
      }
      if (alltoall) out.push_back(std::move(*alltoall));
      out.push_back(std::move(ops[k]));
    }
    ops = std::move(out);
  }
  return s;
}

}  // namespace sppo::sched
