#include "schedule/memory.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"

namespace sppo::sched {

i64 param_count(const ModelConfig& c, int b, int e, bool embed, bool head) {
  const i64 H = c.hidden, F = c.ffn();
  const i64 per_layer = 2 * H + (3 * H * H + 3 * H) + (H * H + H) + 2 * H + (F * H + F) + (H * F + H);
  i64 n = i64(e - b) * per_layer;
  if (embed) n += i64(c.vocab) * H;
  if (head) n += 2 * H + (embed ? 0 : i64(c.vocab) * H);
  return n;
}

i64 zero_state_params(const ModelConfig& c, int b, int e, int shards, int index) {
  std::vector<i64> buckets;
  if (b == 0 || e == c.layers) buckets.push_back(i64(c.vocab) * c.hidden);
  for (int l = b; l < e; ++l) buckets.push_back(param_count(c, 0, 1, false, false));
  if (e == c.layers) buckets.push_back(2 * i64(c.hidden));
  i64 n = 0;
  for (i64 count : buckets) {
    const auto [pb, pe] = piece_range(count, index, shards);
    n += pe - pb;
  }
  return n;
}

i64 recompute_peak_bytes(const MemoryRules& rules, i64 S) {
  const ModelConfig& c = rules.model;
  const ActPrecision p = rules.precision;
  const int L = c.layers;
  const i64 x = i64(c.hidden) * rules.act_bytes() * S;                 // one block's input
  const i64 saved = total_bytes(block_saved_specs(c, S, p));            // all its saved tensors
  const i64 ws = total_bytes(block_workspace_specs(c, S, p)) + rules.block_scratch.bytes(S);
  const i64 acc = 2 * i64(c.hidden) * rules.accum_bytes * S;            // dK, dV
  const i64 head_ws = total_bytes(head_workspace_specs(c, S, rules.head_chunk, p)) + rules.head_scratch.bytes(S);
  const i64 fixed = param_count(c, 0, L, true, true) * (rules.param_state_bytes + rules.weight_copy_bytes) +
                    step_input_bytes(S);
  i64 peak = 0;
  // Forward of layer l: the inputs kept so far, its saved tensors, workspace and output.
  for (int l = 0; l < L; ++l) peak = std::max(peak, l * x + saved + ws + x);
  // The head: every input kept, the final hidden state, head_grad and the head's workspace.
  peak = std::max(peak, L * x + x + x + head_ws);
  // Backward of layer l: head_grad, the inputs of layers 0..l, dK/dV, workspace, and the
  // recomputed saved tensors with the recomputed output.
  for (int l = L - 1; l >= 0; --l) peak = std::max(peak, x + (l + 1) * x + acc + ws + (saved - x) + x);
  return fixed + peak;
}

i64 allreduce_bytes(const Op& op, const ModelConfig& c, int layers) {
  if (op.payload == Payload::TiedGrads) return i64(c.vocab) * c.hidden * 4;
  return param_count(c, op.layer_begin, op.layer_end, op.layer_begin == 0, op.layer_end == layers) * 4;
}

RankMemory::RankMemory(const MemoryRules& rules, const Schedule& s, int rank)
    : rules_(rules), s_(s), rank_(rank) {
  const ModelConfig& c = rules.model;
  const ActPrecision p = rules.precision;
  kv_pt_ = skeletal_bytes_per_token(c, p);
  unit_pt_ = offloadable_bytes_per_token(c, p);
  ws_pt_ = total_bytes(block_workspace_specs(c, 1, p));
  head_pt_ = total_bytes(head_saved_specs(c, 1, p));
  acc_pt_ = 2 * i64(c.hidden) * rules.accum_bytes;
  weight_work_pp_ = rules.act_bytes() + 4;

  const int L = s.layers;
  int ob = 0, oe = L;
  if (!s.owned.empty()) std::tie(ob, oe) = s.owned.at(rank);
  own_ = {ob, oe};
  if (oe > ob) {
    const i64 params = param_count(c, ob, oe, ob == 0, oe == L);
    i64 state = params;
    if (rules.zero)
      for (const Op& op : s.ops.at(rank))
        if (op.kind == OpKind::AllReduce && op.payload == Payload::WeightGrads) {
          const int index = int(std::find(op.group.begin(), op.group.end(), rank) - op.group.begin());
          state = zero_state_params(c, ob, oe, int(op.group.size()), index);
        }
    fixed_ = params * (rules.param_state_bytes - rules.optimizer_bytes + rules.weight_copy_bytes) +
             state * rules.optimizer_bytes;
  }
  fixed_ += step_input_bytes(s.seq_len());

  // Leases of borrowed weights: each Recv Weights of a layer range that a later one of the
  // same range follows ends at the last F/B on that range before the later one.
  {
    const auto& ops = s.ops.at(rank);
    std::map<std::pair<int, int>, std::vector<size_t>> leases;
    for (size_t k = 0; k < ops.size(); ++k)
      if (ops[k].kind == OpKind::Recv && ops[k].payload == Payload::Weights)
        leases[{ops[k].layer_begin, ops[k].layer_end}].push_back(k);
    for (const auto& [range, starts] : leases)
      for (size_t n = 0; n + 1 < starts.size(); ++n) {
        size_t last = starts[n];
        for (size_t k = starts[n]; k < starts[n + 1]; ++k)
          if ((ops[k].kind == OpKind::Forward || ops[k].kind == OpKind::Backward) &&
              ops[k].layer_begin == range.first && ops[k].layer_end == range.second)
            last = k;
        release_after_[last] += param_count(c, range.first, range.second, range.first == 0, range.second == L) *
                                rules.act_bytes();
      }
  }
  // A receive of hidden states (or their gradients) is posted, and its buffer allocated,
  // when the compute op before it starts, so that the message can land while it runs.
  {
    const auto& ops = s.ops.at(rank);
    size_t post = 0;
    for (size_t k = 0; k < ops.size(); ++k) {
      const Op& op = ops[k];
      if (op.kind == OpKind::Forward || op.kind == OpKind::Backward) post = k;
      if (op.kind == OpKind::Recv && (op.payload == Payload::Hidden || op.payload == Payload::HiddenGrad))
        posted_at_[post] += op.tokens * i64(c.hidden) * rules.act_bytes();
    }
  }
  acc_tokens_.assign(L, 0);
  acc_live_.assign(L, false);
  for (const Op& op : s.ops.at(rank)) {
    if (op.kind == OpKind::Forward) {
      const i64 T = tokens_of(op);
      for (int l = op.layer_begin; l < op.layer_end; ++l) acc_tokens_[l] += T;
      // Offloading moves units of the rank's own layers (MSP pieces of other stages stay).
      if (op.layer_begin >= ob && op.layer_end <= oe) {
        auto& sizes = unit_tensors_[op.subseq];
        for (int l = op.layer_begin; l < op.layer_end; ++l)
          for (const auto& t : block_saved_specs(c, T, p))
            if (t.role == Role::Offloadable) sizes.push_back(t.bytes());
        if (op.layer_end == L)
          for (const auto& t : head_saved_specs(c, T, p)) sizes.push_back(t.bytes());
      }
    } else if (op.kind == OpKind::Recv && op.payload == Payload::KV) {
      for (int l = op.layer_begin; l < op.layer_end; ++l) acc_tokens_[l] += op.tokens;
    }
  }
}

i64 RankMemory::tokens_of(const Op& op) const {
  auto [b, e] = piece_range(s_.lengths.at(op.subseq), op.piece, op.pieces);
  return e - b;
}

i64 RankMemory::head_ws(i64 T) const {
  return total_bytes(head_workspace_specs(rules_.model, T, rules_.head_chunk, rules_.precision)) +
         rules_.head_scratch.bytes(T);
}

i64 RankMemory::piece_fwd_extra(const Op& op, i64 T) const {
  return op.pieces > 1 ? 2 * kv_pt_ * T : 0;
}

i64 RankMemory::piece_bwd_extra(const Op& op, i64 T) const {
  return op.pieces > 1 ? 2 * (kv_pt_ + acc_pt_) * T : 0;
}

void RankMemory::emit(std::vector<MemEvent>* out, double at, i64 delta) {
  live_ += delta;
  out->push_back({at, delta});
}

i64 RankMemory::offload_bytes(const Op& op) const {
  auto it = unit_tensors_.find(op.subseq);
  return it == unit_tensors_.end() ? 0 : select_offload(it->second, op.fraction, nullptr);
}

i64 RankMemory::prefetch_bytes(const Op& op) const {
  auto it = offloaded_.find(op.subseq);
  return it == offloaded_.end() ? 0 : it->second;
}

void RankMemory::events(const Op& op, std::vector<MemEvent>* out) {
  const int L = s_.layers;
  const int n = op.layer_end - op.layer_begin;
  const size_t index = next_++;
  SPPO_ASSERT_MSG(index < s_.ops[rank_].size() && &op == &s_.ops[rank_][index],
                  "RankMemory::events must see every op of its rank in program order");
  auto borrowed_params = [&] {
    return param_count(rules_.model, op.layer_begin, op.layer_end, op.layer_begin == 0, op.layer_end == L);
  };
  if (auto it = posted_at_.find(index); it != posted_at_.end()) emit(out, 0.0, it->second);
  if (op.kind == OpKind::Backward && !(op.layer_begin >= own_.first && op.layer_end <= own_.second) &&
      borrowed_grads_.insert({op.layer_begin, op.layer_end}).second)
    emit(out, 0.0, borrowed_params() * 4);
  const i64 h_bytes = i64(rules_.model.hidden) * rules_.act_bytes();  // one token's hidden state
  switch (op.kind) {
    case OpKind::Forward: {
      const i64 T = tokens_of(op);
      const i64 ws = ws_pt_ * T + rules_.block_scratch.bytes(T) + piece_fwd_extra(op, T);
      // Each layer writes its output into a fresh [T, H] buffer: the next layer's saved
      // input x (already counted when that layer's unit is), or, after the stage's last
      // layer, the head's input, freed once used, or the next stage's input, freed as its
      // sends complete. A stage after the first finds its input already allocated: the
      // received hidden state (or, for an MSP piece, the part its own rank produced).
      const i64 x_bytes = h_bytes * T;
      const bool input_held = op.layer_begin > 0;
      for (int k = 0; k < n; ++k) {
        emit(out, double(k) / n, (kv_pt_ + unit_pt_) * T - (k > 0 || input_held ? x_bytes : 0));
        emit(out, double(k) / n, ws);
        emit(out, double(k) / n, x_bytes);
        emit(out, double(k + 1) / n, -ws);
      }
      if (op.layer_end == L) {
        const i64 hws = head_ws(T);
        emit(out, 1.0, head_pt_ * T);
        emit(out, 1.0, hws);
        emit(out, 1.0, -hws);
        emit(out, 1.0, -x_bytes);
      }
      break;
    }
    case OpKind::Backward: {
      const i64 T = tokens_of(op);
      const i64 ws = ws_pt_ * T + rules_.block_scratch.bytes(T) + piece_bwd_extra(op, T);
      for (int k = 0; k < n; ++k) {
        const int l = op.layer_end - 1 - k;
        emit(out, double(k) / n, ws);
        if (!acc_live_[l]) {
          acc_live_[l] = true;
          emit(out, double(k) / n, acc_pt_ * acc_tokens_[l]);
        }
        emit(out, double(k + 1) / n, -((kv_pt_ + acc_pt_ + unit_pt_) * T + ws));
      }
      // The residual gradient (head_grad on the last stage, else the received one) runs
      // through every layer: freed at the end on the first stage, else handed to the sends
      // towards the previous stage.
      if (op.layer_begin == 0) emit(out, 1.0, -h_bytes * T);
      break;
    }
    case OpKind::Offload: {
      const i64 bytes = offload_bytes(op);
      offloaded_[op.subseq] += bytes;
      host_ += bytes;
      emit(out, 1.0, -bytes);
      break;
    }
    case OpKind::Prefetch: {
      const i64 bytes = prefetch_bytes(op);
      offloaded_[op.subseq] = 0;
      host_ -= bytes;
      emit(out, 0.0, bytes);
      break;
    }
    case OpKind::Recv:
      if (op.payload == Payload::KV) {
        emit(out, 1.0, kv_pt_ * op.tokens * n);
      } else if (op.payload == Payload::Weights) {
        emit(out, 0.0, borrowed_params() * rules_.act_bytes());
      } else if (op.payload == Payload::KVGrad || op.payload == Payload::KVGradStream) {
        for (int l = op.layer_begin; l < op.layer_end; ++l) {
          if (acc_live_[l]) continue;
          acc_live_[l] = true;
          emit(out, 0.0, acc_pt_ * acc_tokens_[l]);
        }
      }
      break;
    case OpKind::Send:
      if (op.payload == Payload::Hidden || op.payload == Payload::HiddenGrad) {
        emit(out, 1.0, -h_bytes * op.tokens);
      } else if (op.payload == Payload::WeightGrads) {
        borrowed_grads_.erase({op.layer_begin, op.layer_end});
        emit(out, 1.0, -borrowed_params() * weight_work_pp_);
      } else if (op.payload == Payload::KVGrad) {
        emit(out, 1.0, -(kv_pt_ + acc_pt_) * op.tokens * n);
      }
      break;
    case OpKind::WaitOffload:
    case OpKind::WaitPrefetch:
    case OpKind::RingStep:
    case OpKind::AllReduce:
      break;
  }
  if (auto it = release_after_.find(index); it != release_after_.end()) emit(out, 1.0, -it->second);
}

}  // namespace sppo::sched
