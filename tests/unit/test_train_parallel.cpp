// The parts of a multi-rank step that one process can check: the layout's arithmetic and
// its errors, and that the runtime's parameter buckets and ZeRO-1 shards are the ones the
// memory rules (and so the simulator) count.
#include <gtest/gtest.h>

#include <algorithm>

#include "comm/comm.h"
#include "schedule/memory.h"
#include "support/expect_error.h"
#include "train/parallel.h"

namespace sppo {
namespace {

ParallelDims dims(int pp, int dp, int cp = 1, int tp = 1) {
  ParallelDims d;
  d.pp = pp, d.dp = dp, d.cp = cp, d.tp = tp;
  return d;
}

TEST(ParallelLayout, RanksAndGroups) {
  const auto solo = comm::make_solo();
  const ParallelLayout one = make_layout(dims(1, 1), 0, *solo);
  EXPECT_EQ(one.batch, 1);
  ParallelLayout l;
  l.par = dims(3, 2);
  l.batch = 4, l.rank = 4;
  EXPECT_EQ(l.stage(), 1);
  EXPECT_EQ(l.replica(), 1);
  EXPECT_EQ(l.per_replica(), 2);
  EXPECT_EQ(l.stage_group(), (comm::Group{1, 4}));
}

// Note [Rank layout]: every rank has one place along every dimension and back; each group
// holds the ranks that differ from it in that dimension alone, in its order; tensor-parallel
// groups are consecutive, and a ring's members a TP (and Ulysses) group apart.
TEST(ParallelDims, RankLayoutIsOneFormula) {
  for (int tp : {1, 2, 3})
    for (int u : {1, 2})
      for (int cp : {1, 2, 3})
        for (int pp : {1, 2})
          for (int dp : {1, 2}) {
            ParallelDims d = dims(pp, dp, cp, tp);
            d.ulysses = u;
            d.zero = ZeroStage::OptimizerState;
            const std::string what = layout_text(d);
            std::vector<int> seen(std::size_t(d.ranks()), 0);
            for (int r = 0; r < d.ranks(); ++r) {
              const ParallelDims::Coord c = d.coord_of(r);
              EXPECT_EQ(d.rank_of(c), r) << what;
              ++seen[std::size_t(d.rank_of(c))];
              const auto tpg = d.tp_group(r);
              ASSERT_EQ(int(tpg.size()), tp) << what;
              for (int t = 0; t < tp; ++t) EXPECT_EQ(tpg[std::size_t(t)], r - c.member + t) << what;
              const auto ring = d.ring_group(r);
              ASSERT_EQ(int(ring.size()), cp) << what;
              for (int k = 0; k < cp; ++k) EXPECT_EQ(ring[std::size_t(k)], r + (k - c.ring) * tp * u) << what;
              const auto layer = d.layer_group(r);
              ASSERT_EQ(int(layer.size()), d.zero_shards()) << what;
              EXPECT_EQ(layer.at(std::size_t(d.zero_index(r))), r) << what;
              for (int q : layer) {
                EXPECT_EQ(d.coord_of(q).stage, c.stage) << what;
                EXPECT_EQ(d.coord_of(q).member, c.member) << what;
              }
              EXPECT_TRUE(std::is_sorted(layer.begin(), layer.end())) << what;
            }
            EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), d.ranks()) << what;
          }
}

TEST(ParallelLayout, RefusesWhatCannotRun) {
  const auto solo = comm::make_solo();
  EXPECT_ERROR_WITH(make_layout(dims(2, 1), 0, *solo), "--pp 2 x --dp 1 = 2 ranks", "mpirun -np 2");
  EXPECT_EQ(make_layout(dims(1, 1), 3, *solo).batch, 3);  // one process accumulates three sequences
  EXPECT_ERROR_WITH(make_layout(dims(1, 1), -2, *solo), "--batch -2 is not a positive multiple");
  EXPECT_ERROR_WITH(make_layout(dims(0, 1), 0, *solo), "--pp must be at least 1");
  EXPECT_ERROR_WITH(parse_zero_stage(2, 1, "options", "--zero"), "--zero 2 is not a ZeRO stage", "use 0");
}

TEST(ParallelLayout, OnEveryRankAloneRethrows) {
  const auto solo = comm::make_solo();
  EXPECT_ERROR_WITH(on_every_rank(*solo, [] { SPPO_CHECK(false, "options") << "bad"; }), "[options] bad");
  EXPECT_NO_THROW(on_every_rank(*solo, [] {}));
}

// Buckets cover the stage's parameters in order, and the ZeRO-1 state of every shard is
// what schedule/memory.h counts for it.
TEST(ParallelLayout, BucketsAndShardsMatchTheMemoryRules) {
  ModelConfig c = preset("tiny");
  c.layers = 5;
  for (auto [b, e] : {std::pair{0, 5}, std::pair{0, 2}, std::pair{2, 4}, std::pair{4, 5}})
    for (int shards : {1, 2, 3}) {
      i64 state = 0;
      for (int k = 0; k < shards; ++k) {
        RuntimeOptions o;
        o.layers = {b, e};
        o.zero_shards = shards;
        o.zero_index = k;
        Runtime rt(c, o);
        EXPECT_EQ(rt.num_params(), sched::param_count(c, b, e, b == 0, e == c.layers));
        EXPECT_EQ(rt.num_state(), sched::zero_state_params(c, b, e, shards, k)) << b << "-" << e << " " << k;
        i64 covered = 0;
        for (const ParamBucket& k : rt.buckets()) {
          EXPECT_EQ(k.offset, covered);
          covered += k.count;
        }
        EXPECT_EQ(covered, rt.num_params());
        state += rt.num_state();
      }
      EXPECT_EQ(state, sched::param_count(c, b, e, b == 0, e == c.layers)) << "shards cover every parameter once";
    }
}

}  // namespace
}  // namespace sppo
