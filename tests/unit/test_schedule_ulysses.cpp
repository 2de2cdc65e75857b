// Ulysses' tables and schedules (core/layout.h UlyssesShard and Note [Ulysses exchanges],
// sched::expand_ulysses): members' heads and rows cover the model once, every expanded
// schedule over a grid of (pp, cp, U, N, dp) passes the validator with an all-to-all before
// each F and B, the exchanges' blocks add up both ways, each member keeps 1/U of one rank's
// K/V cache, and the simulator counts the all-to-alls' bytes as the member's traffic.
#include <gtest/gtest.h>

#include <numeric>

#include "core/check.h"
#include "core/layout.h"
#include "planner/cost.h"
#include "planner/profile.h"
#include "schedule/builders.h"
#include "schedule/memory.h"
#include "schedule/validate.h"
#include "sim/simulator.h"

namespace sppo {
namespace {

using namespace sched;

ModelConfig gpt() {
  ModelConfig c;
  c.vocab = 37;
  c.hidden = 24;
  c.layers = 3;
  c.heads = 6;
  c.ffn_mult = 4;
  return c;
}

ModelConfig llama(int heads, int kv_heads) {
  ModelConfig c = preset("llama-tiny");
  c.layers = 3;
  c.heads = heads;
  c.kv_heads = kv_heads;
  c.hidden = heads * 16;
  c.head_dim = 16;
  return c;
}

MemoryRules rules(const ModelConfig& c) {
  MemoryRules r;
  r.model = c;
  r.precision = ActPrecision::F32;
  return r;
}

// Every query head on exactly one member; every member's queries read key/value heads it
// holds (a head's query group inside its key/value head's range).
TEST(Ulysses, HeadsAndRowsCoverTheModelOnce) {
  for (const ModelConfig& c : {gpt(), llama(8, 2), llama(6, 2), llama(12, 6), llama(4, 4)})
    for (int U = 1; U <= c.heads; ++U) {
      if (!ulysses_runs(c, U)) continue;
      std::vector<int> seen(std::size_t(c.heads), 0);
      const int r = c.heads / c.kv_head_count();
      for (int u = 0; u < U; ++u) {
        const TpShard h = UlyssesShard{u, U}.heads();
        const auto [z0, z1] = h.heads(c);
        const auto [g0, g1] = h.kv_heads(c);
        EXPECT_GT(z1, z0) << "U " << U << " member " << u;
        for (i64 z = z0; z < z1; ++z) {
          ++seen[std::size_t(z)];
          EXPECT_TRUE(z / r >= g0 && z / r < g1) << "query head " << z << " of member " << u << " of " << U;
        }
      }
      for (int n : seen) EXPECT_EQ(n, 1) << "U " << U << " heads " << c.heads;
      for (i64 T : {1, 7, 32, 97}) {
        if (T < U) continue;
        i64 rows = 0;
        for (int u = 0; u < U; ++u) rows += UlyssesShard{u, U}.row_count(T);
        EXPECT_EQ(rows, T);
      }
    }
  // Refused: more members than heads, and more than the key/value heads without being a
  // multiple of them.
  EXPECT_FALSE(ulysses_runs(gpt(), 7));
  EXPECT_FALSE(ulysses_runs(llama(8, 2), 3));
  EXPECT_TRUE(ulysses_runs(llama(8, 2), 4));
  EXPECT_TRUE(ulysses_runs(llama(6, 2), 4));  // three query heads a key/value head, 2 + 1 over its replicas
}

// What member f sends t is what t receives from f (the same function both sides call); the
// rows exchange returns what the heads exchange sent, in bytes of its own fields.
TEST(Ulysses, ExchangesAddUpBothWays) {
  for (const ModelConfig& c : {gpt(), llama(8, 2), llama(6, 2)})
    for (int U : {2, 3, 4})
      for (ActPrecision p : {ActPrecision::F32, ActPrecision::BF16}) {
        if (!ulysses_runs(c, U)) continue;
        const i64 T = 29, e = p == ActPrecision::F32 ? 4 : 2;
        i64 heads_q = 0, rows_q = 0;
        for (int f = 0; f < U; ++f)
          for (int t = 0; t < U; ++t) {
            // Heads: f's rows of t's q, k, v; Rows: t's rows of f's output and LSE.
            const UlyssesShard rf{f, U}, rt{t, U};
            const TpShard ht{t, U}, hf{f, U};
            EXPECT_EQ(ulysses_block_bytes(c, T, p, f, t, U, UlyssesExchange::Heads),
                      rf.row_count(T) * (ht.local_hidden(c) + 2 * i64(ht.local_kv_width(c))) * e);
            heads_q += rf.row_count(T) * ht.local_hidden(c);
            rows_q += rt.row_count(T) * hf.local_hidden(c);
          }
        EXPECT_EQ(heads_q, T * c.q_width());  // every query element moves once each way
        EXPECT_EQ(rows_q, T * c.q_width());
        for (int u = 0; u < U; ++u) {
          const UlyssesShard m{u, U};
          for (UlyssesExchange x : {UlyssesExchange::Heads, UlyssesExchange::Rows, UlyssesExchange::GradHeads,
                                    UlyssesExchange::GradRows})
            EXPECT_EQ(ulysses_send_total(c, T, p, m, x),
                      ulysses_sent_bytes(c, T, p, m, x) + ulysses_block_bytes(c, T, p, u, u, U, x));
        }
      }
}

Schedule grid_schedule(const ModelConfig& c, int pp, int cp, int U, int n, int dp) {
  PipelineSpec spec;
  spec.layers = c.layers;
  spec.par.pp = pp;
  spec.par.cp = cp;
  spec.par.ulysses = U;
  spec.par.dp = dp;
  for (int i = 0; i < n; ++i) spec.lengths.push_back(40 - 3 * i);
  spec.alpha.assign(std::size_t(n), 0.5);
  spec.alpha.back() = 0;
  spec.tied = true;
  return build_pipeline(spec);
}

TEST(Ulysses, ExpandedGridIsValid) {
  const ModelConfig c = gpt();
  const MemoryRules rl = rules(c);
  for (int pp : {1, 2})
    for (int cp : {1, 2})
      for (int U : {2, 3})
        for (int n : {1, 3})
          for (int dp : {1, 2}) {
            const Schedule s = grid_schedule(c, pp, cp, U, n, dp);
            ASSERT_EQ(s.ranks(), pp * cp * U * dp);
            const Validation v = validate(s, {&rl, 0});
            EXPECT_TRUE(v.ok()) << "pp " << pp << " cp " << cp << " U " << U << " n " << n << " dp " << dp << "\n"
                                << v.message();
            for (int r = 0; r < s.ranks(); ++r) {
              const auto& ops = s.ops[std::size_t(r)];
              for (std::size_t k = 0; k < ops.size(); ++k) {
                const Op& op = ops[k];
                if (op.kind == OpKind::Forward || op.kind == OpKind::Backward) {
                  ASSERT_GT(k, 0u);
                  EXPECT_EQ(ops[k - 1].kind, OpKind::AllToAll) << to_string(op);
                  EXPECT_EQ(ops[k - 1].group, s.par.ulysses_group(r));
                }
                // Weights are whole on every member: their gradients sum over the layer group.
                if (reduces_weight_grads(op)) {
                  EXPECT_EQ(op.group, s.par.layer_group(r));
                }
              }
            }
          }
  // The layer-major backward splits each B's all-to-all with it.
  Schedule s = grid_schedule(c, 2, 1, 2, 3, 1);
  s = to_layer_major(std::move(s));
  const Validation v = validate(s, {&rl, 0});
  EXPECT_TRUE(v.ok()) << v.message();
}

TEST(Ulysses, RefusesPiecesShorterThanTheGroup) {
  PipelineSpec spec;
  spec.layers = 2;
  spec.par.ulysses = 4;
  spec.lengths = {3, 5};
  EXPECT_THROW(build_pipeline(spec), Error);
  spec.par.tp = 2;
  spec.lengths = {8, 8};
  EXPECT_THROW(build_pipeline(spec), Error);  // Ulysses beside tensor parallelism
}

// Each member keeps its key/value heads of every row: 1/U of the cache one rank keeps, when
// U divides the key/value heads (a replicated head is each replica's whole).
TEST(Ulysses, EachMemberKeepsItsShareOfTheKvCache) {
  for (const ModelConfig& c : {gpt(), llama(8, 4)})
    for (int U : {1, 2, 4}) {
      if (c.kv_head_count() % U != 0 || !ulysses_runs(c, U)) continue;
      const MemoryRules rl = rules(c);
      const Schedule one = grid_schedule(c, 1, 1, 1, 3, 1);
      const Schedule s = grid_schedule(c, 1, 1, U, 3, 1);
      const RankMemory alone(rl, one, 0);
      for (int r = 0; r < U; ++r) {
        const RankMemory member(rl, s, r);
        EXPECT_EQ(member.kv_per_token() * U, alone.kv_per_token()) << "U " << U << " member " << r;
        EXPECT_EQ(member.acc_per_token() * U, alone.acc_per_token());
      }
    }
}

// The simulator's traffic of a member is its all-to-alls' bytes: every exchange of every
// layer of its F and B ops.
TEST(Ulysses, TrafficIsTheExchanges) {
  const ModelConfig c = gpt();
  const MemoryRules rl = rules(c);
  const Schedule s = grid_schedule(c, 1, 1, 3, 2, 1);
  const plan::CostModel cost(plan::load_profile("a100-80gb"), c, ActPrecision::F32);
  const sim::SimResult r = sim::simulate(s, cost, rl);
  for (int u = 0; u < 3; ++u) {
    i64 bytes = 0;
    for (int i = 0; i < 2; ++i) {
      const i64 T = s.lengths[std::size_t(i)];
      for (UlyssesExchange x : {UlyssesExchange::Heads, UlyssesExchange::Rows, UlyssesExchange::GradHeads,
                                UlyssesExchange::GradRows})
        bytes += c.layers * ulysses_sent_bytes(c, T, ActPrecision::F32, UlyssesShard{u, 3}, x);
    }
    EXPECT_EQ(r.sent_bytes[std::size_t(u)], bytes) << "member " << u;
    EXPECT_GT(bytes, 0);
  }
}

}  // namespace
}  // namespace sppo
