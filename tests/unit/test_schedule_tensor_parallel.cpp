// Tensor parallelism's tables and schedules (core/layout.h TpShard, sched::
// expand_tensor_parallel): a group's shards put back together are the whole model, every
// expanded schedule over a grid of (pp, tp, N, dp) passes the validator, and the memory
// rules count each member's shards.
#include <gtest/gtest.h>

#include <map>
#include <numeric>
#include <tuple>

#include "core/check.h"
#include "core/layout.h"
#include "schedule/builders.h"
#include "schedule/memory.h"
#include "schedule/validate.h"

namespace sppo {
namespace {

using namespace sched;

ModelConfig model() {
  ModelConfig c;
  c.vocab = 37;  // divides by none of the group sizes below
  c.hidden = 24;
  c.layers = 3;
  c.heads = 6;
  c.ffn_mult = 4;
  return c;
}

TEST(TensorParallel, ShardsPutTogetherAreTheWholeModel) {
  const ModelConfig c = model();
  const i64 total = c.num_params();
  std::vector<float> whole(static_cast<std::size_t>(total));
  std::iota(whole.begin(), whole.end(), 1.0f);
  for (int tp : {1, 2, 3, 4, 6})
    for (auto [b, e] : {std::pair{0, 3}, {0, 1}, {1, 3}, {1, 2}, {2, 3}}) {
      // How often each element of the whole model appears in some member's shard, and
      // whether the member's copy holds the whole model's value.
      std::vector<int> seen(static_cast<std::size_t>(total), 0);
      for (int t = 0; t < tp; ++t) {
        const TpShard shard{t, tp};
        const i64 local_count = total_bytes(parameter_specs(c, b, e, shard)) / 4;
        std::vector<float> local(std::size_t(local_count), 0.0f);
        i64 covered = 0;
        for (const ParamSlice& sl : param_slices(c, b, e, shard)) {
          ASSERT_EQ(sl.local, covered) << "slices run in local order";
          covered += sl.count;
          for (i64 k = 0; k < sl.count; ++k) {
            local[std::size_t(sl.local + k)] = whole[std::size_t(sl.full + k)];
            if (!sl.copy) ++seen[std::size_t(sl.full + k)];
          }
        }
        EXPECT_EQ(covered, local_count) << "tp " << tp << " member " << t;
        // The member's q, k, v rows are its heads: the first row of its q block is row
        // z0 * A of the whole qkv weight.
        const auto specs = parameter_specs(c, b, e, shard);
        i64 off = 0;
        for (const auto& s : specs) {
          if (s.name == "blocks." + std::to_string(b) + ".attn.qkv.weight") {
            const i64 row = shard.heads(c).first * c.head_size();
            i64 full = 0;
            for (const auto& w : parameter_specs(c)) {
              if (w.name == s.name) break;
              full += w.numel();
            }
            EXPECT_EQ(local[std::size_t(off)], whole[std::size_t(full + row * c.hidden)]);
          }
          off += s.numel();
        }
      }
      // Every element of the stage's tensors once (replicated ones counted on member 0).
      i64 off = 0;
      for (const auto& s : parameter_specs(c)) {
        const bool owned = s.name == "embed.weight" ? (b == 0 || e == c.layers)
                           : s.name.rfind("ln_f.", 0) == 0
                               ? e == c.layers
                               : [&] {
                                   const int l = std::stoi(s.name.substr(7));
                                   return b <= l && l < e;
                                 }();
        for (i64 k = 0; k < s.numel(); ++k)
          ASSERT_EQ(seen[std::size_t(off + k)], owned ? 1 : 0) << s.name << " element " << k << " tp " << tp;
        off += s.numel();
      }
    }
}

TEST(TensorParallel, SavedTensorsDivideByTheGroup) {
  const ModelConfig c = model();
  for (int tp : {2, 3})
    for (i64 T : {1 * tp, 7 * tp + 1, 40}) {
      i64 skeletal = 0, rows = 0;
      for (int t = 0; t < tp; ++t) {
        const auto specs = block_saved_specs(c, T, ActPrecision::F32, TpShard{t, tp});
        ASSERT_EQ(specs.size(), block_saved_specs(c, T, ActPrecision::F32).size());
        for (const auto& s : specs)
          if (s.role == Role::Skeletal) skeletal += s.bytes();
        rows += specs[0].shape[0];  // x: the member's rows of the residual stream
      }
      EXPECT_EQ(rows, T);
      EXPECT_EQ(skeletal, T * skeletal_bytes_per_token(c, ActPrecision::F32)) << "the K/V cache splits by heads";
    }
}

MemoryRules rules() {
  MemoryRules r;
  r.model = model();
  r.precision = ActPrecision::F32;
  return r;
}

TEST(TensorParallel, ExpandedGridIsValid) {
  const MemoryRules rl = rules();
  for (int pp : {1, 2, 3})
    for (int tp : {1, 2, 3})
      for (int n : {1, 3, 5})
        for (int dp : {1, 2}) {
          PipelineSpec spec;
          spec.layers = 3;
          spec.par.pp = pp;
          spec.par.dp = dp;
          for (int i = 0; i < n; ++i) spec.lengths.push_back(20 - 3 * i);
          spec.alpha.assign(std::size_t(n), 0.5);
          spec.alpha.back() = 0;
          const Schedule base = build_pipeline(spec);
          const Schedule s = expand_tensor_parallel(base, tp);
          ASSERT_EQ(s.ranks(), base.ranks() * tp);
          const Validation v = validate(s, {&rl, 0});
          EXPECT_TRUE(v.ok()) << "pp " << pp << " tp " << tp << " n " << n << " dp " << dp << "\n" << v.message();
          // Members run their rank's ops; a hidden state's rows split over them.
          for (int r = 0; r < base.ranks(); ++r)
            for (std::size_t k = 0; k < base.ops[std::size_t(r)].size(); ++k) {
              const Op& op = base.ops[std::size_t(r)][k];
              i64 rows = 0;
              for (int t = 0; t < tp; ++t) {
                const Op& m = s.ops[std::size_t(r * tp + t)][k];
                EXPECT_EQ(m.kind, op.kind);
                EXPECT_EQ(m.peer, op.peer < 0 ? op.peer : op.peer * tp + t);
                rows += m.tokens;
              }
              if ((op.kind == OpKind::Send || op.kind == OpKind::Recv) && op.payload == Payload::Hidden) {
                EXPECT_EQ(rows, base.lengths[std::size_t(op.subseq)]);
              }
            }
        }
}

// Under MSP a split task's pieces and its unsplit neighbours' split a subsequence
// differently, so a member's rows meet several members' rows of the other side, its own
// group's among them (Note [Hidden states of MSP pieces under tensor parallelism]). Every
// expanded schedule is valid, and each member's input to each F/B is exactly its rows of
// the piece: what it receives (each row once) and what it made itself.
TEST(TensorParallel, MspMembersReceiveExactlyTheirRows) {
  const MemoryRules rl = rules();
  int local_messages = 0;
  for (int pp : {2, 3})
    for (int tp : {2, 3})
      for (int sp : {1, 2})
        for (int reach : {0, 2})
          for (int n : {pp, pp + 2}) {
            PipelineSpec spec;
            spec.layers = 3;
            spec.par.pp = pp;
            spec.par.cp = sp;
            spec.par.ring_layout = RingLayout::Contiguous;
            spec.par.msp.on = true;
            spec.par.msp.reach = reach;
            for (int i = 0; i < n; ++i) spec.lengths.push_back(40 - 3 * i);
            const Schedule base = build_pipeline(spec);
            const Schedule s = expand_tensor_parallel(base, tp);
            const std::string at = "pp " + std::to_string(pp) + " tp " + std::to_string(tp) + " sp " +
                                   std::to_string(sp) + " reach " + std::to_string(reach) + " n " + std::to_string(n);
            const Validation v = validate(s, {&rl, 0});
            EXPECT_TRUE(v.ok()) << at << "\n" << v.message();
            for (int rank = 0; rank < s.ranks(); ++rank) {
              const int t = rank % tp;
              std::map<std::tuple<Payload, int, int>, std::vector<std::pair<i64, i64>>> got;  // rows received
              std::map<std::tuple<Payload, int, int>, Spans> made;                            // rows made here
              for (const Op& op : s.ops[std::size_t(rank)]) {
                const bool fwd = op.kind == OpKind::Forward;
                if ((op.kind == OpKind::Recv || op.kind == OpKind::Send) &&
                    (op.payload == Payload::Hidden || op.payload == Payload::HiddenGrad)) {
                  if (op.peer / tp == rank / tp) ++local_messages;
                  if (op.kind == OpKind::Send) continue;
                  const auto key = std::tuple{op.payload, op.payload == Payload::Hidden ? op.layer_begin : op.layer_end,
                                              op.subseq};
                  const Spans whole = member_spans(s.spans(op), t, tp);
                  got[key].push_back(op.first < 0 ? whole.front() : std::pair{op.first, op.first + op.tokens});
                  continue;
                }
                if (op.kind != OpKind::Forward && op.kind != OpKind::Backward) continue;
                const Spans mine = member_spans(s.spans(op), t, tp);
                const bool input = fwd ? op.layer_begin > 0 : op.layer_end < spec.layers;
                if (input) {
                  const auto key = std::tuple{fwd ? Payload::Hidden : Payload::HiddenGrad,
                                              fwd ? op.layer_begin : op.layer_end, op.subseq};
                  // Each of its rows once: from messages or from what this member made.
                  std::vector<int> seen(std::size_t(s.lengths[std::size_t(op.subseq)]), 0);
                  for (const auto& [b, e] : got[key])
                    for (i64 p = b; p < e; ++p) ++seen[std::size_t(p)];
                  if (made.count(key))
                    for (const auto& [b, e] : overlaps(made.at(key), mine))
                      for (i64 p = b; p < e; ++p) ++seen[std::size_t(p)];
                  for (std::size_t p = 0; p < seen.size(); ++p) {
                    const bool wanted = overlap(mine, Spans{{i64(p), i64(p) + 1}}) > 0;
                    ASSERT_EQ(seen[p], wanted ? 1 : 0) << at << " rank " << rank << " " << to_string(op) << " row " << p;
                  }
                }
                const bool output = fwd ? op.layer_end < spec.layers : op.layer_begin > 0;
                if (output)
                  made[std::tuple{fwd ? Payload::Hidden : Payload::HiddenGrad, fwd ? op.layer_end : op.layer_begin,
                                  op.subseq}] = mine;
              }
            }
          }
  EXPECT_GT(local_messages, 0) << "rows changing hands inside a group";
}

TEST(TensorParallel, MembersHoldTheirShardsOfTheWeights) {
  const MemoryRules rl = rules();
  const ModelConfig& c = rl.model;
  const Schedule s = expand_tensor_parallel(build_single(c.layers, {30, 10}, {0.0, 0.0}), 3);
  i64 weights = 0;
  for (int t = 0; t < 3; ++t) {
    RankMemory mem(rl, s, t);
    weights += mem.fixed_terms()[int(MemTerm::Weights)];
  }
  // The whole model once, plus the tensors every member holds twice more.
  i64 replicated = 0;
  for (const auto& spec : parameter_specs(c))
    if (tp_replicated(spec.name)) replicated += spec.numel();
  EXPECT_EQ(weights, (c.num_params() + 2 * replicated) * 4);
}

// A Llama-family model with a q/k/v bias and an untied LM head.
ModelConfig small_llama(int vocab, int hidden, int layers, int heads, int kv_heads, int ffn) {
  ModelConfig c;
  c.family = Family::Llama;
  c.vocab = vocab;
  c.hidden = hidden;
  c.layers = layers;
  c.heads = heads;
  c.kv_heads = kv_heads;
  c.ffn_size = ffn;
  c.qkv_bias = true;
  return c;
}

// A Llama-family block (grouped-query attention with G = 4 kv heads for Z = 8, a q/k/v
// bias, a gated MLP of F = 30 columns, an untied LM head) split over groups that divide
// G: every element once, each member's q rows its query heads', its k and v rows those of
// the kv heads its queries read, its fc rows the gate and up rows of its MLP columns.
TEST(TensorParallel, LlamaShardsPutTogetherAreTheWholeModel) {
  const ModelConfig c = small_llama(37, 32, 2, 8, 4, 30);
  const i64 H = c.hidden, A = c.head_size(), KV = c.kv_width(), F = c.ffn();
  const auto specs = parameter_specs(c);
  std::vector<i64> full_at;
  i64 total = 0;
  for (const auto& s : specs) full_at.push_back(total), total += s.numel();
  ASSERT_EQ(total, c.num_params());
  auto full_of = [&](const std::string& name) {
    for (std::size_t k = 0; k < specs.size(); ++k)
      if (specs[k].name == name) return full_at[k];
    ADD_FAILURE() << "no parameter " << name;
    return i64{0};
  };
  // tp 8: each kv head on two members, one query head each (Note [Replicated key/value heads]).
  for (int tp : {1, 2, 4, 8})
    for (auto [b, e] : {std::pair{0, 2}, {0, 1}, {1, 2}}) {
      std::vector<int> seen(static_cast<std::size_t>(total), 0);
      for (int t = 0; t < tp; ++t) {
        const TpShard shard{t, tp};
        EXPECT_EQ(shard.local_qkv_width(c), tp <= 4 ? c.qkv_width() / tp : 3 * A);
        EXPECT_EQ(shard.local_fc_width(c), 2 * (shard.ffn(c).second - shard.ffn(c).first));
        // Its query heads read exactly its kv heads.
        const auto [z0, z1] = shard.heads(c);
        const auto [g0, g1] = shard.kv_heads(c);
        const i64 group = c.heads / c.kv_head_count();
        EXPECT_EQ(z0 / group, g0);
        EXPECT_EQ((z1 - 1) / group, g1 - 1);
        const ModelConfig ac = attention_view(c, shard);
        EXPECT_EQ(ac.kv_width(), shard.local_kv_width(c));
        EXPECT_EQ(ac.qkv_width(), shard.local_qkv_width(c));
        // Where each of the member's local elements comes from.
        const auto local_specs = parameter_specs(c, b, e, shard);
        const i64 local_count = total_bytes(local_specs) / 4;
        std::vector<i64> from(std::size_t(local_count), -1);
        i64 covered = 0;
        for (const ParamSlice& sl : param_slices(c, b, e, shard)) {
          ASSERT_EQ(sl.local, covered);
          covered += sl.count;
          for (i64 k = 0; k < sl.count; ++k) {
            from[std::size_t(sl.local + k)] = sl.full + k;
            if (!sl.copy) ++seen[std::size_t(sl.full + k)];
          }
        }
        ASSERT_EQ(covered, local_count);
        i64 off = 0;
        for (const auto& s : local_specs) {
          const i64 full = full_of(s.name);
          const i64 Hr = (z1 - z0) * A, KVr = (g1 - g0) * A;
          const auto [f0, f1] = shard.ffn(c);
          if (s.name.find("attn.qkv.weight") != std::string::npos) {
            EXPECT_EQ(s.shape[0], Hr + 2 * KVr);
            EXPECT_EQ(from[std::size_t(off)], full + z0 * A * H);                      // q of its first head
            EXPECT_EQ(from[std::size_t(off + Hr * H)], full + (H + g0 * A) * H);       // k of its first kv head
            EXPECT_EQ(from[std::size_t(off + (Hr + KVr) * H)], full + (H + KV + g0 * A) * H);  // v
          } else if (s.name.find("attn.qkv.bias") != std::string::npos) {
            EXPECT_EQ(from[std::size_t(off + Hr)], full + H + g0 * A);
          } else if (s.name.find("mlp.fc.weight") != std::string::npos) {
            EXPECT_EQ(from[std::size_t(off)], full + f0 * H);                     // gate
            EXPECT_EQ(from[std::size_t(off + (f1 - f0) * H)], full + (F + f0) * H);  // up
          } else if (s.name == "lm_head.weight") {
            EXPECT_EQ(from[std::size_t(off)], full + shard.vocab(c).first * H);
          }
          off += s.numel();
        }
      }
      for (std::size_t k = 0; k < specs.size(); ++k) {
        const std::string& n = specs[k].name;
        const bool owned = n == "embed.weight"      ? b == 0
                           : n == "lm_head.weight" || n.rfind("ln_f.", 0) == 0
                               ? e == c.layers
                               : [&] {
                                   const int l = std::stoi(n.substr(7));
                                   return b <= l && l < e;
                                 }();
        for (i64 j = 0; j < specs[k].numel(); ++j)
          ASSERT_EQ(seen[std::size_t(full_at[k] + j)], owned ? 1 : 0) << n << " element " << j << " tp " << tp;
      }
    }
}

// Three query heads a key/value head (Z 6, G 2) over 4 and 6 members: each K/V head on 2 or 3
// consecutive members, which split its query heads 2 + 1 or 1 + 1 + 1; the k and v rows are
// flagged as replicas, counted (copy false) on the first holder only; every query head on
// exactly one member.
TEST(TensorParallel, ReplicatedKeyValueHeadsSplitTheirQueryHeads) {
  const ModelConfig c = small_llama(11, 48, 1, 6, 2, 12);
  EXPECT_FALSE(sched::llama_tp_runs(c, 3));  // neither divides the other
  EXPECT_FALSE(sched::llama_tp_runs(c, 8));  // 4 replicas for 3 query heads
  for (const int tp : {4, 6}) {
    ASSERT_TRUE(sched::llama_tp_runs(c, tp));
    const int m = tp / 2;
    std::vector<int> query_seen(6, 0);
    for (int t = 0; t < tp; ++t) {
      const TpShard shard{t, tp};
      EXPECT_EQ(shard.kv_replicas(c), m);
      const auto [z0, z1] = shard.heads(c);
      const auto [g0, g1] = shard.kv_heads(c);
      EXPECT_EQ(g1 - g0, 1);
      EXPECT_EQ(g0, t / m);
      EXPECT_EQ(z1 - z0, tp == 4 ? (t % 2 == 0 ? 2 : 1) : 1);
      for (i64 z = z0; z < z1; ++z) {
        EXPECT_EQ(z / 3, g0) << "query head " << z << " reads kv head " << g0;
        ++query_seen[std::size_t(z)];
      }
      int kv_slices = 0;
      for (const ParamSlice& sl : param_slices(c, 0, 1, shard)) {
        if (!sl.kv_replica) continue;
        ++kv_slices;
        EXPECT_EQ(sl.copy, t % m != 0);
      }
      EXPECT_EQ(kv_slices, 4);  // k and v rows of the weight and of the bias
    }
    for (int z = 0; z < 6; ++z) EXPECT_EQ(query_seen[std::size_t(z)], 1) << "tp " << tp << " head " << z;
  }
}

TEST(TensorParallel, RefusesSubsequencesShorterThanTheGroup) {
  EXPECT_THROW(expand_tensor_parallel(build_single(2, {5, 2}, {0.0, 0.0}), 3), Error);
}

}  // namespace
}  // namespace sppo
