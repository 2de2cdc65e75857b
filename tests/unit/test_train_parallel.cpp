// The parts of a multi-rank step that one process can check: the layout's arithmetic and
// its errors, and that the runtime's parameter buckets and ZeRO-1 shards are the ones the
// memory rules (and so the simulator) count.
#include <gtest/gtest.h>

#include "comm/comm.h"
#include "schedule/memory.h"
#include "support/expect_error.h"
#include "train/parallel.h"

namespace sppo {
namespace {

TEST(ParallelLayout, RanksAndGroups) {
  const auto solo = comm::make_solo();
  const ParallelLayout one = make_layout(1, 1, 0, 0, *solo);
  EXPECT_EQ(one.batch, 1);
  ParallelLayout l;
  l.pp = 3, l.dp = 2, l.batch = 4, l.rank = 4;
  EXPECT_EQ(l.stage(), 1);
  EXPECT_EQ(l.replica(), 1);
  EXPECT_EQ(l.per_replica(), 2);
  EXPECT_EQ(l.stage_group(), (comm::Group{1, 4}));
}

TEST(ParallelLayout, RefusesWhatCannotRun) {
  const auto solo = comm::make_solo();
  EXPECT_ERROR_WITH(make_layout(2, 1, 0, 0, *solo), "--pp 2 x --dp 1 = 2 ranks", "mpirun -np 2");
  EXPECT_EQ(make_layout(1, 1, 0, 3, *solo).batch, 3);  // one process accumulates three sequences
  EXPECT_ERROR_WITH(make_layout(1, 1, 0, -2, *solo), "--batch -2 is not a positive multiple");
  EXPECT_ERROR_WITH(make_layout(0, 1, 0, 0, *solo), "--pp must be at least 1");
  EXPECT_ERROR_WITH(make_layout(1, 1, 2, 0, *solo), "--zero must be 0 or 1");
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
