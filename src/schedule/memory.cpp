#include "schedule/memory.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"

namespace sppo::sched {

namespace {

// Elements of the final norm (LayerNorm's weight and bias, or RMSNorm's weight).
i64 final_norm_params(const ModelConfig& c) { return (c.llama() ? 1 : 2) * i64(c.hidden); }

}  // namespace

i64 param_count(const ModelConfig& c, int b, int e, bool embed, bool head) {
  const i64 VH = i64(c.vocab) * c.hidden;
  i64 n = i64(e - b) * layer_params(c, TpShard{});
  if (embed) n += VH;
  if (head) n += final_norm_params(c) + (embed && c.tied_embeddings() ? 0 : VH);
  return n;
}

i64 layer_params(const ModelConfig& c, const TpShard& tp) {
  const i64 H = c.hidden, Hr = tp.local_hidden(c), Qr = tp.local_qkv_width(c), Wr = tp.local_fc_width(c);
  const auto [f0, f1] = tp.ffn(c);
  const i64 Fr = f1 - f0, norm = c.llama() ? H : 2 * H, b = c.biases() ? 1 : 0;
  const i64 qk_norms = c.qk_norm ? 2 * i64(c.head_size()) : 0;  // whole on every member
  return 2 * norm + (Qr * H + (c.qkv_bias ? Qr : 0)) + qk_norms + (H * Hr + b * H) + (Wr * H + b * Wr) +
         (H * Fr + b * H);
}

i64 param_count(const ModelConfig& c, int b, int e, const TpShard& tp) {
  if (!tp.on()) return param_count(c, b, e, b == 0, e == c.layers);
  return total_bytes(parameter_specs(c, b, e, tp)) / i64(sizeof(float));
}

i64 layer_copy_bytes(const ModelConfig& c, ActPrecision p, const TpShard& tp) {
  return layer_params(c, tp) * (4 + (p == ActPrecision::F32 ? 0 : 2));
}

i64 zero_state_params(const ModelConfig& c, int b, int e, int shards, int index, const TpShard& tp) {
  std::vector<i64> buckets;
  const auto [v0, v1] = tp.vocab(c);
  const i64 vocab_rows = (v1 - v0) * c.hidden;
  if (b == 0 || (e == c.layers && c.tied_embeddings())) buckets.push_back(vocab_rows);
  for (int l = b; l < e; ++l) buckets.push_back(layer_params(c, tp));
  if (e == c.layers) buckets.push_back(final_norm_params(c) + (c.tied_embeddings() ? 0 : vocab_rows));
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
  const i64 acc = 2 * i64(c.kv_width()) * rules.accum_bytes * S;        // dK, dV
  const i64 head_ws = total_bytes(head_workspace_specs(c, S, rules.head_chunk, p)) + rules.head_scratch.bytes(S);
  const i64 fixed = param_count(c, 0, L, true, true) * (rules.device_param_bytes() + rules.device_state_bytes()) +
                    step_input_bytes(c, S);
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

i64 allreduce_bytes(const Op& op, const ModelConfig& c, int layers, const TpShard& tp) {
  const auto [v0, v1] = tp.vocab(c);
  if (op.payload == Payload::TiedGrads) return (v1 - v0) * c.hidden * 4;
  if (tp.on()) return param_count(c, op.layer_begin, op.layer_end, tp) * 4;
  return param_count(c, op.layer_begin, op.layer_end, op.layer_begin == 0, op.layer_end == layers) * 4;
}

i64 collective_bytes(const Schedule& s, int rank, const ModelConfig& c) {
  const TpShard tp = s.tp_shard(rank);
  i64 bytes = 0;
  for (const Op& op : s.ops.at(std::size_t(rank))) {
    if (op.kind == OpKind::AllGather) bytes += layer_params(c, tp) * 4;
    if (op.kind != OpKind::AllReduce && op.kind != OpKind::ReduceScatter) continue;
    if (op.payload == Payload::TiedGrads && s.par.zero != ZeroStage::None) {
      const auto [v0, v1] = tp.vocab(c);
      const auto [pb, pe] = piece_range((v1 - v0) * c.hidden, s.par.zero_index(rank), s.par.zero_shards());
      bytes += (pe - pb) * 4;
    } else {
      bytes += allreduce_bytes(op, c, s.layers, tp);
    }
  }
  return bytes;
}

std::vector<i64> unit_tensor_bytes(const MemoryRules& rules, i64 T, const RankShard& shard, SavedSet recompute) {
  std::vector<i64> bytes;
  const auto specs = block_saved_specs(rules.model, T, rules.precision, shard);
  for (std::size_t k = 0; k < specs.size(); ++k)
    if (specs[k].role == Role::Offloadable && !in_set(recompute, int(k))) bytes.push_back(specs[k].bytes());
  return bytes;
}

UnitSizes::UnitSizes(const MemoryRules& rules, const Schedule& s) {
  for (int r = 0; r < s.ranks(); ++r) {
    const RankShard shard = s.shard(r);
    for (const Op& op : s.ops[std::size_t(r)])
      if (op.kind == OpKind::Forward) {
        const i64 T = span_tokens(s.spans(op));
        auto [it, fresh] = sizes_.try_emplace({shard.tp.index, shard.ulysses.index, T});
        if (fresh) it->second = unit_tensor_bytes(rules, T, shard, s.place.recompute);
      }
  }
}

const std::vector<i64>* UnitSizes::find(const RankShard& shard, i64 tokens) const {
  auto it = sizes_.find({shard.tp.index, shard.ulysses.index, tokens});
  return it == sizes_.end() ? nullptr : &it->second;
}

RankMemory::RankMemory(const MemoryRules& rules, const Schedule& s, int rank, const UnitSizes* shared)
    : rules_(rules), s_(s), rank_(rank), shard_(s.shard(rank)), tp_(shard_.tp), heads_(shard_.heads()) {
  const ModelConfig& c = rules.model;
  const ActPrecision p = rules.precision;
  kv_pt_ = skeletal_bytes_per_token(c, p);
  unit_pt_ = saved_bytes(1, Role::Offloadable);
  rc_pt_ = recomputed_bytes(1);
  ws_pt_ = total_bytes(block_workspace_specs(c, 1, p));
  head_pt_ = total_bytes(head_saved_specs(c, 1, p));
  acc_pt_ = 2 * i64(c.kv_width()) * rules.accum_bytes;
  if (shard_.on()) {  // per-token averages over one token a member
    const i64 n = std::max(tp_.size, shard_.ulysses.size);
    kv_pt_ = kv_bytes(n) / n;
    unit_pt_ = unit_bytes(n) / n;
    rc_pt_ = recomputed_bytes(n) / n;
    ws_pt_ = total_bytes(block_workspace_specs(c, n, p, shard_)) / n;
    head_pt_ = head_bytes(n) / n;
    acc_pt_ = 2 * i64(heads_.local_kv_width(c)) * rules.accum_bytes;
  }
  weight_work_pp_ = rules.act_bytes() + 4;

  const int L = s.layers;
  int ob = 0, oe = L;
  if (!s.owned.empty()) std::tie(ob, oe) = s.owned.at(rank);
  own_ = {ob, oe};
  if (oe > ob) {
    const i64 params = param_count(c, ob, oe, tp_);
    i64 state = params;
    if (rules.zero && rules.zero_shards > 1) {
      state = zero_state_params(c, ob, oe, rules.zero_shards, 0, tp_);
    } else if (rules.zero) {
      for (const Op& op : s.ops.at(rank))
        if (reduces_weight_grads(op)) {
          const int index = int(std::find(op.group.begin(), op.group.end(), rank) - op.group.begin());
          state = zero_state_params(c, ob, oe, int(op.group.size()), index, tp_);
        }
    }
    owned_params_ = params;
    state_params_ = state;
    // Note [Weights on the host]: the device keeps the embedding, final norm and head only;
    // Note [ZeRO-2] (schedule/weights.h): their gradients only, and the rank's shard of all.
    // Note [ZeRO-3]: its layers' weights come and go as on the host, from the master's shard.
    const i64 layer_total = i64(oe - ob) * layer_params(c, tp_);
    const i64 layers = layer_weights_stream(s) ? layer_total : 0, resident = params - layers;
    const bool grads_stream = layer_grads_stream(s);
    const i64 resident_grads = params - (grads_stream ? layer_total : 0);
    const i64 grad_shard = shards_gradients(s.par.zero) ? state : 0;
    const i64 weight_shard = shards_weights(s.par.zero) ? state : 0;
    resident_params_ = resident;
    SPPO_CHECK(!s.place.weights_host() || (rules.optimizer_host && state == params), "memory")
        << "the layers' weights on the host are the optimizer's master there: --weights host needs "
           "--optimizer-state host, without --zero 1";
    fixed_terms_[int(MemTerm::Weights)] = (resident + weight_shard) * rules.weight_bytes();
    fixed_terms_[int(MemTerm::WeightCopy)] = resident * rules.weight_copy_bytes;
    fixed_terms_[int(MemTerm::Gradients)] = (resident_grads + grad_shard) * rules.grad_bytes;
    fixed_terms_[int(MemTerm::Optimizer)] = state * rules.device_state_bytes();
    if (rules.optimizer_host) {
      host_fixed_terms_[int(MemTerm::Weights)] = state * rules.weight_bytes();
      host_fixed_terms_[int(MemTerm::Gradients)] = state * rules.grad_bytes;
      host_fixed_terms_[int(MemTerm::Optimizer)] = state * rules.optimizer_bytes;
    }
    if (layer_weights_stream(s)) {
      layer_w_ = layer_copy_bytes(c, rules.precision, tp_);
      layer_in_ = layer_params(c, tp_) * i64(sizeof(float));
    }
    if (grads_stream) {
      layer_g_ = layer_params(c, tp_) * rules.grad_bytes;
      uses_ = LayerUses(s, rank);
    }
  }
  fixed_terms_[int(MemTerm::StepInputs)] = step_input_bytes(rules.model, s.seq_len(), s.targets_given());
  for (i64 bytes : fixed_terms_) fixed_ += bytes;
  for (i64 bytes : host_fixed_terms_) host_fixed_ += bytes;
  host_ = host_peak_ = host_fixed_;

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
        release_after_[last] += param_count(c, range.first, range.second, tp_) * rules.act_bytes();
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
      if (op.kind == OpKind::Recv && is_hidden_message(op))
        posted_at_[post] += op.tokens * i64(c.hidden) * rules.act_bytes();
    }
  }
  for (size_t k = 0; k < s.ops.at(rank).size(); ++k)
    if (s.ops.at(rank)[k].kind == OpKind::Forward) last_forward_ = k;
  acc_tokens_.assign(L, 0);
  acc_live_.assign(L, false);
  kv_rows_before_.assign(L, {});
  sums_below_.assign(L, 0);
  const int N = int(s.lengths.size());
  std::map<i64, std::vector<i64>> layer_units;  // tokens -> one layer's offloadable tensors' bytes
  for (const Op& op : s.ops.at(rank)) {
    if (op.kind == OpKind::Forward) {
      const i64 T = tokens_of(op);
      for (int l = op.layer_begin; l < op.layer_end; ++l) {
        acc_tokens_[l] += T;
        if (!streamed(l)) continue;
        if (kv_rows_before_[l].empty()) kv_rows_before_[l].assign(std::size_t(N) + 1, 0);
        kv_rows_before_[l][std::size_t(op.subseq) + 1] += T;
      }
      // Offloading moves units of the rank's own layers (MSP pieces of other stages stay).
      if (op.layer_begin >= ob && op.layer_end <= oe) {
        auto& sizes = unit_tensors_[op.subseq];
        const std::vector<i64>* layer = shared ? shared->find(shard_, T) : nullptr;
        if (!layer) {  // every layer's unit has the same tensors
          auto [it, fresh] = layer_units.try_emplace(T);
          if (fresh) it->second = unit_tensor_bytes(rules, T, shard_, s.place.recompute);
          layer = &it->second;
        }
        auto& layers = unit_layers_[op.subseq];
        for (int l = op.layer_begin; l < op.layer_end; ++l) {
          // A rebuilt layer's x (its first offloadable tensor) is gone before the offload.
          const auto first = layer->begin() + (s.place.input_rebuilt(l) ? 1 : 0);
          sizes.insert(sizes.end(), first, layer->end());
          layers.insert(layers.end(), std::size_t(layer->end() - first), l);
        }
        if (op.layer_end == L && !loss_in_backward())
          for (const auto& t : head_saved_specs(c, T, p, shard_)) {
            sizes.push_back(t.bytes());
            layers.push_back(L - 1);
          }
      }
    } else if (op.kind == OpKind::Recv && op.payload == Payload::KV) {
      for (int l = op.layer_begin; l < op.layer_end; ++l) {
        acc_tokens_[l] += op.tokens;
        if (!streamed(l)) continue;  // an MSP owner streams its helpers' pieces with its own
        if (kv_rows_before_[l].empty()) kv_rows_before_[l].assign(std::size_t(N) + 1, 0);
        kv_rows_before_[l][std::size_t(op.subseq) + 1] += op.tokens;
      }
    }
  }
  for (auto& before : kv_rows_before_)  // each subsequence's tokens -> the tokens of those before it
    for (std::size_t i = 1; i < before.size(); ++i) before[i] += before[i - 1];
}

i64 RankMemory::tokens_of(const Op& op) const { return span_tokens(s_.spans(op)); }

i64 RankMemory::head_ws(i64 T) const {
  // The head runs on a Ulysses member's rows; on a tensor-parallel member's piece.
  return total_bytes(head_workspace_specs(rules_.model, T, rules_.head_chunk, rules_.precision, shard_)) +
         rules_.head_scratch.bytes(shard_.ulysses.on() ? rows_of(T) : T);
}

i64 RankMemory::saved_bytes(i64 T, Role role) const {
  i64 b = 0;
  const auto specs = block_saved_specs(rules_.model, T, rules_.precision, shard_);
  for (std::size_t k = 0; k < specs.size(); ++k)
    if (specs[k].role == role && !in_set(s_.place.recompute, int(k))) b += specs[k].bytes();
  return b;
}

i64 RankMemory::recomputed_bytes(i64 T) const {
  i64 b = 0;
  const auto specs = block_saved_specs(rules_.model, T, rules_.precision, shard_);
  const MlpTiles tiles = s_.place.mlp_tiles();
  for (std::size_t k = 0; k < specs.size(); ++k)  // under MLP tiles fc_pre is in the workspace
    if (in_set(s_.place.recompute, int(k)) && !(int(k) == kSavedFcPre && tiles.on())) b += specs[k].bytes();
  return b;
}

i64 RankMemory::kv_bytes(i64 T) const { return shard_.on() ? saved_bytes(T, Role::Skeletal) : kv_pt_ * T; }

i64 RankMemory::unit_bytes(i64 T) const { return shard_.on() ? saved_bytes(T, Role::Offloadable) : unit_pt_ * T; }

i64 RankMemory::ws_bytes(i64 T) const {
  const MlpTiles tiles = s_.place.mlp_tiles();
  const i64 layer = shard_.on() || tiles.on()
                        ? total_bytes(block_workspace_specs(rules_.model, T, rules_.precision, shard_, tiles))
                        : ws_pt_ * T;
  return layer + rules_.block_scratch.bytes(T);
}

i64 RankMemory::head_bytes(i64 T) const {
  return shard_.on() ? total_bytes(head_saved_specs(rules_.model, T, rules_.precision, shard_)) : head_pt_ * T;
}

const RankMemory::LayerBytes& RankMemory::layer_bytes(i64 T) {
  auto it = layer_bytes_.find(T);
  if (it == layer_bytes_.end()) {
    const i64 rc = shard_.on() ? recomputed_bytes(T) : rc_pt_ * T;
    it = layer_bytes_.emplace(T, LayerBytes{kv_bytes(T), unit_bytes(T), rc, ws_bytes(T)}).first;
  }
  return it->second;
}

// Pieces (ring pieces, and the pieces of an MSP task, which run as one ring): the ring
// attention's buffers (runtime/ring.h). Forward: the M - 1 other pieces' queries, the
// partial outputs and LSEs received for this piece's rows and those sent for theirs.
// Backward: their queries, output gradients, LSEs and deltas, partial dq both ways, and
// this piece's dq. A partial exists only for a (holder, span) pair where the holder has a
// key the span sees (RingAttention::sees), as the runtime allocates them: in a causal
// model's subsequence 0 a member whose piece starts after a span's last position sends
// nothing for it, so counting every pair over-predicts a step of one subsequence (later
// subsequences see every member's earlier keys).
RankMemory::RingRows RankMemory::ring_rows(const Op& op) const {
  const int R = op.pieces, me = op.piece;
  const i64 o = s_.offset(op.subseq);
  std::vector<i64> first_key(static_cast<std::size_t>(R));
  std::vector<Spans> spans(static_cast<std::size_t>(R));
  for (int h = 0; h < R; ++h) {
    first_key[std::size_t(h)] = ring_first_key(s_, op, h);
    spans[std::size_t(h)] = s_.spans(op, h);
  }
  auto sees = [&](int h, const std::pair<i64, i64>& span) {
    return !rules_.model.causal || first_key[std::size_t(h)] <= o + span.second - 1;
  };
  RingRows r;
  for (int h = 0; h < R; ++h) {
    if (h == me) continue;
    r.others += span_tokens(spans[std::size_t(h)]);
    for (const auto& span : spans[std::size_t(me)])
      if (sees(h, span)) r.in += span.second - span.first;  // h's partials for this piece's rows
    for (const auto& span : spans[std::size_t(h)])
      if (sees(me, span)) r.out += span.second - span.first;  // this piece's partials for h's rows
  }
  return r;
}

// The largest piece's tokens: the Ring Self-Attention's rules count every other member's
// block at it.
i64 RankMemory::ring_piece_max(const Op& op) const {
  auto [it, fresh] = piece_max_.try_emplace({op.subseq, op.pieces}, 0);
  if (fresh)
    for (int h = 0; h < op.pieces; ++h) it->second = std::max(it->second, span_tokens(s_.spans(op, h)));
  return it->second;
}

// The two-pass Ring Self-Attention (Schedule::ring_rsa) holds its queries' fp32 score rows
// against the whole subsequence, [Z, T, L]. Forward: the scores and the other members'
// blocks of one pass (keys, then values). Backward: probabilities and score gradients, the
// dK, dV every other member sends for this piece's keys, the blocks of the first pass
// (keys and values) then, alive to the end, the dK, dV this piece computes for each other
// member, its dq and the blocks of the last pass (keys).
i64 RankMemory::piece_fwd_extra(const Op& op, i64 T) const {
  if (op.pieces <= 1) return 0;
  // Under tensor parallelism the ring moves this member's heads only.
  const i64 R = op.pieces, Tm = ring_piece_max(op), row = i64(heads_.local_hidden(rules_.model)) * rules_.act_bytes(),
            heads = heads_.local_heads(rules_.model), stats = heads * i64(sizeof(float));
  if (rsa_piece(op)) return heads * T * s_.lengths[std::size_t(op.subseq)] * i64(sizeof(float)) + (R - 1) * Tm * row;
  const RingRows r = ring_rows(op);
  return r.others * row + (r.in + r.out) * (row + stats);
}

i64 RankMemory::piece_bwd_extra(const Op& op, i64 T) const {
  if (op.pieces <= 1) return 0;
  const i64 R = op.pieces, Tm = ring_piece_max(op), row = i64(heads_.local_hidden(rules_.model)) * rules_.act_bytes(),
            heads = heads_.local_heads(rules_.model), stats = heads * i64(sizeof(float));
  if (rsa_piece(op))
    return 2 * heads * T * s_.lengths[std::size_t(op.subseq)] * i64(sizeof(float)) + 2 * (R - 1) * T * row +
           3 * (R - 1) * Tm * row + T * row;
  const RingRows r = ring_rows(op);
  return r.others * 2 * (row + stats) + (r.in + r.out) * row + T * row;
}

void RankMemory::host_change(i64 delta) {
  host_ += delta;
  host_peak_ = std::max(host_peak_, host_);
  op_host_peak_ = std::max(op_host_peak_, host_);
}

i64 RankMemory::ring_span_max(const Op& op) const {
  i64 most = 0;
  for (int h = 0; h < op.pieces; ++h)
    for (const auto& span : s_.spans(op, h)) most = std::max<i64>(most, span.second - span.first);
  return most;
}

i64 RankMemory::kv_window(int l, int subseq, i64 T, i64 span_rows, bool backward) const {
  if (!streamed(l)) return 0;
  // This rank's earlier rows in chunks of C (runtime/kv_stream.h); the forward's partial
  // output and LSE are one query span's, the longest.
  const i64 C = kv_chunk_rows(T), rows = kv_rows_before_[l][std::size_t(subseq)], chunks = (rows + C - 1) / C;
  // The slots' K, V and dK, dV are the K/V's width (G A of this member's key/value heads);
  // the forward's partial output is the queries' [T, Z A]: kv_window_bytes counts it at the
  // width it is given, so the rest of its row is added here (none without grouped-query
  // attention).
  const i64 kv_width = heads_.local_kv_width(rules_.model), q_width = heads_.local_hidden(rules_.model);
  const i64 partial_rest = backward || chunks == 0 ? 0 : span_rows * (q_width - kv_width) * rules_.act_bytes();
  const bool recompute = s_.place.kv_recomputed(l);
  return kv_window_bytes(chunks, std::min(rows, C), span_rows, kv_width, heads_.local_heads(rules_.model), rules_.act_bytes(),
                         backward, recompute ? rules_.model.hidden : 0,
                         recompute && rules_.model.qk_norm ? rules_.model.kv_head_count() : 0) +
         partial_rest;
}

void RankMemory::emit(std::vector<MemEvent>* out, double at, i64 delta, MemTerm term) {
  live_ += delta;
  out->push_back({at, delta, term});
}

void RankMemory::move(std::vector<MemEvent>* out, double at, i64 bytes, MemTerm from, MemTerm to) {
  if (bytes == 0) return;
  emit(out, at, -bytes, from);
  emit(out, at, bytes, to);
}

std::vector<i64> RankMemory::unit_tensors(int subseq) const {
  auto it = unit_tensors_.find(subseq);
  return it == unit_tensors_.end() ? std::vector<i64>{} : it->second;
}

std::vector<int> RankMemory::unit_layers(int subseq) const {
  auto it = unit_layers_.find(subseq);
  return it == unit_layers_.end() ? std::vector<int>{} : it->second;
}

i64 RankMemory::offload_bytes(const Op& op) const {
  auto it = unit_tensors_.find(op.subseq);
  return it == unit_tensors_.end() ? 0 : select_offload(it->second, op.fraction, nullptr);
}

i64 RankMemory::prefetch_bytes(const Op& op) const {
  if (op.layer_end > op.layer_begin) return offloaded_layers(op.subseq, op.layer_begin, op.layer_end);
  auto it = offloaded_.find(op.subseq);
  return it == offloaded_.end() ? 0 : it->second;
}

i64 RankMemory::offloaded_layers(int subseq, int b, int e) const {
  i64 bytes = 0;
  for (int l = b; l < e; ++l)
    if (auto it = offloaded_layer_.find({subseq, l}); it != offloaded_layer_.end()) bytes += it->second;
  return bytes;
}

i64 RankMemory::residual_bytes(const Op& op) const {
  return i64(rules_.model.hidden) * rules_.act_bytes() * rows_of(tokens_of(op));
}

void RankMemory::layer_in(std::vector<MemEvent>* out, size_t index, int k, double at) {
  if (uses_.empty() || uses_.first(index) == uses_.last(index)) return;
  const LayerUse& u = uses_.at(index, k);
  if (u.load_now >= 0) emit(out, at, layer_w_, MemTerm::LayerWeights);
  if (u.load_next >= 0) emit(out, at, layer_w_, MemTerm::LayerWeights);
  if (u.load_below >= 0) emit(out, at, layer_w_, MemTerm::LayerWeights);
  if (u.grad_first) emit(out, at, layer_g_, MemTerm::LayerGrads);
}

void RankMemory::layer_out(std::vector<MemEvent>* out, size_t index, int k, double at) {
  if (uses_.empty() || uses_.first(index) == uses_.last(index)) return;
  const LayerUse& u = uses_.at(index, k);
  for (int l : u.grad_free)
    if (l >= 0) emit(out, at, -layer_g_, MemTerm::LayerGrads);
  if (u.weights_free) emit(out, at, -layer_w_, MemTerm::LayerWeights);
}

void RankMemory::events(const Op& op, std::vector<MemEvent>* out) {
  using T = MemTerm;
  const int L = s_.layers;
  const int n = op.layer_end - op.layer_begin;
  const size_t index = next_++;
  op_host_peak_ = host_;
  SPPO_ASSERT_MSG(index < s_.ops[rank_].size() && &op == &s_.ops[rank_][index],
                  "RankMemory::events must see every op of its rank in program order");
  auto borrowed_params = [&] {
    return param_count(rules_.model, op.layer_begin, op.layer_end, tp_);  // this member's shard
  };
  if (auto it = posted_at_.find(index); it != posted_at_.end()) emit(out, 0.0, it->second, T::Hidden);
  // Borrowed layers' gradients: from the first backward on them, or the first forward
  // through the LM head, which computes its gradients there.
  if ((op.kind == OpKind::Backward || (op.kind == OpKind::Forward && op.layer_end == L)) &&
      !(op.layer_begin >= own_.first && op.layer_end <= own_.second) &&
      borrowed_grads_.insert({op.layer_begin, op.layer_end}).second)
    emit(out, 0.0, borrowed_params() * 4, T::BorrowedGrads);
  const i64 h_bytes = i64(rules_.model.hidden) * rules_.act_bytes();  // one token's hidden state
  switch (op.kind) {
    case OpKind::Forward: {
      const i64 T = tokens_of(op);
      const auto [kv, unit, rc, ws] = layer_bytes(T);
      const i64 ring = piece_fwd_extra(op, T);
      // The longest query span that meets a streamed window (once an op, not a layer).
      const i64 span_rows = op.pieces > 1 && s_.place.any_kv_streamed() ? ring_span_max(op) : T;
      // Each layer writes its output into a fresh [T, H] buffer: the next layer's saved
      // input x (already counted when that layer's unit is), or, after the stage's last
      // layer, the head's input, freed once used, or the next stage's input, freed as its
      // sends complete. A stage after the first finds its input already allocated: the
      // received hidden state (or, for an MSP piece, the part its own rank produced).
      const i64 x_bytes = h_bytes * rows_of(T);
      const bool input_held = op.layer_begin > 0;
      for (int k = 0; k < n; ++k) {
        const int l = op.layer_begin + k;
        const double at = double(k) / n, end = double(k + 1) / n;
        const i64 window = kv_window(l, op.subseq, T, span_rows, false);
        layer_in(out, index, k, at);
        if (k > 0 || input_held) move(out, at, x_bytes, T::Hidden, T::Units);
        emit(out, at, kv, T::KVCache);
        emit(out, at, unit - (k > 0 || input_held ? x_bytes : 0), T::Units);
        if (rc) emit(out, at, rc, T::Recomputed);
        emit(out, at, ws, T::Workspace);
        if (ring) emit(out, at, ring, T::RingBuffers);
        emit(out, at, x_bytes, T::Hidden);
        if (window) emit(out, at, window, T::KVWindow);
        if (ring) emit(out, end, -ring, T::RingBuffers);
        emit(out, end, -ws, T::Workspace);
        if (window) emit(out, end, -window, T::KVWindow);
        if (rc) emit(out, end, -rc, T::Recomputed);
        if (streamed(l)) emit(out, end, -kv, T::KVCache);
        if (streamed(l) && s_.place.kv_at(l) == KvPlace::Host) host_change(kv);  // K_i, V_i go to the host
        if (s_.forward_only) {  // Note [Forward-only steps]: nothing is saved for a backward
          emit(out, end, -unit, T::Units);
          (streamed(l) ? kv_held_host_ : kv_held_) += kv;
        } else if (s_.place.input_rebuilt(l)) {
          emit(out, end, -x_bytes, T::Units);  // Note [Rebuilt layer inputs]
        }
        layer_out(out, index, k, end);
      }
      if (op.layer_end == L && loss_in_backward() && !s_.forward_only) {  // Note [The loss in backward]: no head here
        emit(out, 1.0, -x_bytes, T::Hidden);
      } else if (op.layer_end == L) {
        const i64 hws = head_ws(T);
        if (!s_.forward_only) emit(out, 1.0, head_bytes(T), T::Units);
        emit(out, 1.0, hws, T::HeadWorkspace);
        emit(out, 1.0, -hws, T::HeadWorkspace);
        emit(out, 1.0, -x_bytes, T::Hidden);
      }
      if (s_.forward_only && index == last_forward_) {  // every K/V this rank held goes
        emit(out, 1.0, -kv_held_, T::KVCache);
        host_change(-kv_held_host_);
        kv_held_ = kv_held_host_ = 0;
      }
      break;
    }
    case OpKind::Backward: {
      const i64 T = tokens_of(op);
      const auto [kv, unit, rc, ws] = layer_bytes(T);
      const i64 ring = piece_bwd_extra(op, T);
      // The residual gradient starts as head_grad (part of the unit) on the rank that ran
      // the head, else as the received gradient. Note [The loss in backward]: the head
      // runs below, once the last layer's tensors are back.
      const bool loss_here = op.layer_end == L && loss_in_backward();
      if (op.layer_end == L && !loss_here) move(out, 0.0, head_bytes(T), T::Units, T::Hidden);
      // Note [Residual gradients on the host]: back from the host before anything else.
      const ResidualMove moves = residual_move(s_, rank_, op);
      const i64 residual = moves.in || moves.out ? residual_bytes(op) : 0;
      if (moves.in) {
        emit(out, 0.0, residual, T::Hidden);
        host_change(-residual);
      }
      for (int k = 0; k < n; ++k) {
        const int l = op.layer_end - 1 - k;
        const double at = double(k) / n, end = double(k + 1) / n;
        layer_in(out, index, k, at);
        if (s_.place.input_rebuilt(l)) {
          // Note [Rebuilt layer inputs] (builders.cpp): x of this layer, made by the layer
          // below's forward again, through a copy of its saved tensors (its input among
          // them), its workspace and the attention's window of its K/V.
          const i64 again = kv + unit + rc, window = kv_window(l - 1, op.subseq, T, T, false);
          emit(out, at, h_bytes * rows_of(T), T::Units);
          emit(out, at, again, T::Recomputed);
          emit(out, at, ws, T::Workspace);
          if (window) {
            emit(out, at, window, T::KVWindow);
            emit(out, at, -window, T::KVWindow);
          }
          emit(out, at, -ws, T::Workspace);
          emit(out, at, -again, T::Recomputed);
        }
        emit(out, at, ws, T::Workspace);
        if (rc) emit(out, at, rc, T::Recomputed);
        if (streamed(l)) {
          // K_i, V_i come back from the host (or are recomputed), with the dK/dV sums of i
          // from the host; the window streams the earlier blocks, whose sums the host holds
          // from the first backward on them.
          const i64 sums_pt = sums_per_token(l);
          const bool recomputed = s_.place.kv_recomputed(l);
          emit(out, at, kv, T::KVCache);
          emit(out, at, (acc_pt_ + (recomputed ? sums_pt : 0)) * T, T::KVGradAccum);
          int& below = sums_below_[l];
          host_change(-(recomputed ? 0 : kv) - (op.subseq < below ? sums_pt * T : 0));
          // A recomputed attention runs its forward first, through a forward window that
          // closes before the backward's opens.
          const i64 again = s_.place.recompute & kAttentionGroup ? kv_window(l, op.subseq, T, T, false) : 0;
          if (again) {
            emit(out, at, again, T::KVWindow);
            emit(out, at, -again, T::KVWindow);
          }
          if (op.subseq > below) {
            const auto& before = kv_rows_before_[l];
            host_change(sums_pt * (before[std::size_t(op.subseq)] - before[std::size_t(below)]));
            below = op.subseq;
          }
        } else if (!acc_live_[l]) {
          acc_live_[l] = true;
          emit(out, at, acc_pt_ * acc_tokens_[l], T::KVGradAccum);
        }
        if (loss_here && l == L - 1) {
          // The last layer's output again, then the head on it: its gradient stays as the
          // residual gradient, the output and the head's workspace go.
          const i64 x_bytes = h_bytes * rows_of(T), hws = head_ws(T);
          emit(out, at, x_bytes, T::Hidden);
          emit(out, at, head_bytes(T), T::Hidden);
          emit(out, at, hws, T::HeadWorkspace);
          emit(out, at, -hws, T::HeadWorkspace);
          emit(out, at, -x_bytes, T::Hidden);
        }
        if (ring) emit(out, at, ring, T::RingBuffers);  // the ring's, from its backward on
        if (const i64 window = kv_window(l, op.subseq, T, T, true)) {
          emit(out, at, window, T::KVWindow);
          emit(out, end, -window, T::KVWindow);
        }
        emit(out, end, -kv, T::KVCache);
        emit(out, end, -(acc_pt_ + (s_.place.kv_recomputed(l) ? sums_per_token(l) : 0)) * T, T::KVGradAccum);
        emit(out, end, -unit, T::Units);
        if (rc) emit(out, end, -rc, T::Recomputed);
        if (ring) emit(out, end, -ring, T::RingBuffers);
        emit(out, end, -ws, T::Workspace);
        layer_out(out, index, k, end);
      }
      // The residual gradient runs through every layer: freed at the end on the first
      // stage, else handed to the sends towards the previous stage; or it waits on the
      // host for the layer below, after everything else.
      if (op.layer_begin == 0) emit(out, 1.0, -h_bytes * rows_of(T), T::Hidden);
      if (moves.out) {
        emit(out, 1.0, -residual, T::Hidden);
        host_change(residual);
      }
      break;
    }
    case OpKind::Offload: {
      const i64 bytes = offload_bytes(op);
      offloaded_[op.subseq] += bytes;
      if (s_.place.backward == BackwardOrder::Layer) {  // what each layer's prefetch will bring
        std::vector<bool> take;
        const auto& sizes = unit_tensors_[op.subseq];
        select_offload(sizes, op.fraction, &take);
        const auto& layers = unit_layers_[op.subseq];
        for (std::size_t t = 0; t < sizes.size(); ++t)
          if (take[t]) offloaded_layer_[{op.subseq, layers[t]}] += sizes[t];
      }
      host_change(bytes);
      emit(out, 1.0, -bytes, T::Units);
      break;
    }
    case OpKind::Prefetch: {
      // Its host copies leave at the wait (Note [Host copies leave at the wait]).
      const i64 bytes = prefetch_bytes(op);
      if (op.layer_end > op.layer_begin) {
        offloaded_[op.subseq] -= bytes;
        for (int l = op.layer_begin; l < op.layer_end; ++l) {
          coming_back_layer_[{op.subseq, l}] += offloaded_layer_[{op.subseq, l}];
          offloaded_layer_[{op.subseq, l}] = 0;
        }
      } else {
        offloaded_[op.subseq] = 0;
        coming_back_[op.subseq] += bytes;
      }
      emit(out, 0.0, bytes, T::Units);
      break;
    }
    case OpKind::WaitPrefetch:
      if (op.layer_end > op.layer_begin) {
        for (int l = op.layer_begin; l < op.layer_end; ++l) {
          host_change(-coming_back_layer_[{op.subseq, l}]);
          coming_back_layer_[{op.subseq, l}] = 0;
        }
        break;
      }
      host_change(-coming_back_[op.subseq]);
      coming_back_[op.subseq] = 0;
      break;
    case OpKind::Recv:
      if (op.payload == Payload::KV) {
        for (int l = op.layer_begin; l < op.layer_end; ++l) {
          const i64 kv = kv_pt_ * op.tokens;
          emit(out, 1.0, kv, T::KVCache);
          if (!streamed(l)) continue;
          emit(out, 1.0, -kv, T::KVCache);  // a layer at a time, to the host once received
          host_change(kv);
        }
      } else if (op.payload == Payload::Weights) {
        emit(out, 0.0, borrowed_params() * rules_.act_bytes(), T::BorrowedWeights);
      } else if (op.payload == Payload::WeightGrads) {
        // The helper's gradients land in a buffer and are added to the owner's.
        emit(out, 0.0, borrowed_params() * 4, T::BorrowedGrads);
        emit(out, 1.0, -borrowed_params() * 4, T::BorrowedGrads);
      } else if (op.payload == Payload::KVGrad) {
        for (int l = op.layer_begin; l < op.layer_end; ++l) {
          if (acc_live_[l]) continue;
          acc_live_[l] = true;
          emit(out, 0.0, acc_pt_ * acc_tokens_[l], T::KVGradAccum);
        }
      }
      break;
    case OpKind::Send:
      if (is_hidden_message(op)) {
        emit(out, 1.0, -h_bytes * op.tokens, T::Hidden);
      } else if (op.payload == Payload::WeightGrads) {
        // The weights go as the send starts; the gradients once it has gone.
        borrowed_grads_.erase({op.layer_begin, op.layer_end});
        emit(out, 0.0, -borrowed_params() * rules_.act_bytes(), T::BorrowedWeights);
        emit(out, 1.0, -borrowed_params() * (weight_work_pp_ - rules_.act_bytes()), T::BorrowedGrads);
      } else if (op.payload == Payload::KVGrad) {
        int held = 0;  // layers whose K, V and sums of the piece the device holds
        for (int l = op.layer_begin; l < op.layer_end; ++l) {
          if (streamed(l)) {
            // The piece's sums come back from the host (once a backward reached them) into
            // buffers that go out with the send; its K, V leave the host.
            emit(out, 0.0, acc_pt_ * op.tokens, T::KVGradAccum);
            host_change(-(kv_pt_ + (op.subseq < sums_below_[l] ? acc_pt_ : 0)) * op.tokens);
            continue;
          }
          ++held;
          if (acc_live_[l]) continue;  // accumulators not yet touched go out zero
          acc_live_[l] = true;
          emit(out, 0.0, acc_pt_ * acc_tokens_[l], T::KVGradAccum);
        }
        emit(out, 1.0, -kv_pt_ * op.tokens * held, T::KVCache);
        emit(out, 1.0, -acc_pt_ * op.tokens * n, T::KVGradAccum);
      }
      break;
    case OpKind::WaitOffload:
    case OpKind::RingStep:
    case OpKind::AllReduce:
    case OpKind::ReduceScatter:
    case OpKind::AllGather:  // into the buffers its F or B's uses allocate (LayerUses)
    case OpKind::AllToAll:  // into the F/B's workspace (Note [Ulysses buffers] in core/layout.cpp)
      break;
  }
  if (auto it = release_after_.find(index); it != release_after_.end())
    emit(out, 1.0, -it->second, T::BorrowedWeights);
}

const char* to_string(MemTerm t) {
  switch (t) {
    case MemTerm::Weights: return "weights";
    case MemTerm::WeightCopy: return "weights' working copy";
    case MemTerm::Gradients: return "gradients";
    case MemTerm::Optimizer: return "optimizer state";
    case MemTerm::KVCache: return "K/V cache";
    case MemTerm::KVGradAccum: return "dK/dV accumulators";
    case MemTerm::Units: return "activation units on the device";
    case MemTerm::Hidden: return "hidden states between layers and stages";
    case MemTerm::Workspace: return "layer workspace";
    case MemTerm::HeadWorkspace: return "logits and loss workspace";
    case MemTerm::RingBuffers: return "ring attention buffers";
    case MemTerm::KVWindow: return "K/V streaming window";
    case MemTerm::Recomputed: return "recomputed tensors";
    case MemTerm::BorrowedWeights: return "MSP borrowed weights";
    case MemTerm::BorrowedGrads: return "MSP borrowed gradients";
    case MemTerm::StepInputs: return "token ids and loss sum";
    case MemTerm::LayerWeights: return "layers' weights brought from the host";
    case MemTerm::LayerGrads: return "layers' gradients before they go to the host";
    case MemTerm::kCount: break;
  }
  SPPO_ASSERT(false);
  return "";
}

}  // namespace sppo::sched
