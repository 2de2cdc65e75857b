// The collectives of comm/comm.h on one rank (the solo transport: copies), in every type, in
// place and apart, on fresh random data; the arguments every transport refuses; the blocks'
// arithmetic; and the cutting of Note [Counts past MPI's int] under small limits. Between real
// ranks: tests/mpi/test_mpi_comm.cpp.
#include <gtest/gtest.h>

#include <climits>
#include <random>
#include <string>

#include "comm/comm.h"
#include "comm/mpi/mpi_comm.h"
#include "core/check.h"
#include "support/collectives.h"

namespace sppo {
namespace {

using comm::Counts;
using comm::Type;
using testing::Elements;
using testing::random_elements;

class Solo : public ::testing::Test {
 protected:
  std::unique_ptr<comm::Comm> c = comm::make_solo();
  const comm::Group one{0};
  std::mt19937_64 rng{std::random_device{}()};
};

TEST_F(Solo, EveryCollectiveInEveryTypeCopiesOrLeaves) {
  for (const Type t : testing::every_type()) {
    for (const i64 n : {i64{0}, i64{1}, i64{37}}) {
      const std::string what = std::string(comm::type_name(t)) + " x " + std::to_string(n);
      const Elements x = random_elements(t, n, rng);
      Elements d = x;
      comm::wait(*c, c->iallreduce(d.data(), n, t, one), what);
      EXPECT_EQ(d, x) << "all-reduce " << what;
      comm::wait(*c, c->ibroadcast(d.data(), n, t, 0, one), what);
      EXPECT_EQ(d, x) << "broadcast " << what;
      // Apart: the receive buffer starts as other random elements, and the send's stays.
      Elements r = random_elements(t, n, rng);
      comm::wait(*c, c->ireduce_scatter(d.data(), r.data(), {n}, t, one), what);
      EXPECT_EQ(r, x) << "reduce-scatter " << what;
      EXPECT_EQ(d, x) << "reduce-scatter's send buffer " << what;
      r = random_elements(t, n, rng);
      comm::wait(*c, c->iallgather(d.data(), r.data(), {n}, t, one), what);
      EXPECT_EQ(r, x) << "all-gather " << what;
      r = random_elements(t, n, rng);
      comm::wait(*c, c->ialltoall(d.data(), {n}, r.data(), {n}, t, one), what);
      EXPECT_EQ(r, x) << "all-to-all " << what;
      EXPECT_EQ(d, x) << "all-to-all's send buffer " << what;
      // In place.
      comm::wait(*c, c->ireduce_scatter(d.data(), d.data(), {n}, t, one), what);
      EXPECT_EQ(d, x) << "reduce-scatter in place " << what;
      comm::wait(*c, c->iallgather(d.data(), d.data(), {n}, t, one), what);
      EXPECT_EQ(d, x) << "all-gather in place " << what;
    }
  }
}

TEST_F(Solo, PiecesInPlace) {
  std::mt19937_64 r(rng());
  const Elements x = random_elements(Type::F32, 101, r);
  Elements d = x;
  comm::wait(*c, comm::ireduce_scatter_pieces(*c, static_cast<float*>(d.data()), 101, one), "reduce-scatter");
  EXPECT_EQ(d, x);
  comm::wait(*c, comm::iallgather_pieces(*c, static_cast<float*>(d.data()), 101, one), "all-gather");
  EXPECT_EQ(d, x);
}

// Each refusal names the component and what was wrong.
void expect_refused(const std::function<void()>& call, const std::string& part) {
  try {
    call();
    ADD_FAILURE() << "accepted; expected a refusal naming '" << part << "'";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind("[comm] ", 0), 0u) << what;
    EXPECT_NE(what.find(part), std::string::npos) << what;
  }
}

TEST_F(Solo, RefusesBadArguments) {
  std::vector<float> a(16, 1.0f), b(16, 2.0f);
  expect_refused([&] { c->ireduce_scatter(a.data(), b.data(), {4, 4}, Type::F32, one); }, "one count per member");
  expect_refused([&] { c->iallgather(a.data(), b.data(), {-1}, Type::F32, one); }, "counts are zero or more");
  expect_refused([&] { c->ireduce_scatter(a.data(), a.data() + 1, {8}, Type::F32, one); }, "overlapping");
  expect_refused([&] { c->iallgather(a.data() + 2, a.data(), {8}, Type::F32, one); }, "overlapping");
  expect_refused([&] { c->ialltoall(a.data(), {8}, a.data() + 4, {8}, Type::F32, one); }, "not in place");
  expect_refused([&] { c->ialltoall(a.data(), {8}, b.data(), {6}, Type::F32, one); }, "to itself");
  expect_refused([&] { c->ibroadcast(a.data(), 4, Type::F32, 3, one); }, "not in its group");
  expect_refused([&] { c->iallreduce(a.data(), 4, Type::F32, comm::Group{0, 1}); }, "started alone");
}

// The checks of a group this rank (0) belongs to in second place, on any transport.
TEST_F(Solo, ChecksFindTheMembersBlock) {
  std::vector<float> all(12), mine(5);
  const Counts counts{3, 5, 4};
  const comm::Group g{2, 0, 1};
  comm::OwnBlock b = comm::check_reduce_scatter(*c, all.data(), all.data() + 3, counts, Type::F32, g);
  EXPECT_EQ(b.index, 1);
  EXPECT_EQ(b.offset, 3);
  EXPECT_TRUE(b.in_place);
  b = comm::check_allgather(*c, mine.data(), all.data(), counts, Type::F32, g);
  EXPECT_FALSE(b.in_place);
  b = comm::check_allgather(*c, all.data() + 3, all.data(), counts, Type::F32, g);
  EXPECT_TRUE(b.in_place);
  // In units of the type: 3 elements of bf16 are 6 bytes.
  std::vector<std::uint16_t> h(12);
  EXPECT_TRUE(comm::check_reduce_scatter(*c, h.data(), h.data() + 3, counts, Type::BF16, g).in_place);
  EXPECT_EQ(comm::check_alltoall(*c, mine.data(), {1, 2, 2}, all.data(), {3, 2, 7}, Type::F32, g), 1);
  expect_refused([&] { comm::check_member(*c, comm::Group{1, 2}, "all-reduce"); }, "does not hold it");
}

TEST(Blocks, OffsetsTotalsAndPieces) {
  const Counts c{4, 0, 7, 2};
  EXPECT_EQ(comm::total(c), 13);
  EXPECT_EQ(comm::block_offset(c, 0), 0);
  EXPECT_EQ(comm::block_offset(c, 2), 4);
  EXPECT_EQ(comm::block_offset(c, 3), 11);
  EXPECT_EQ(comm::block_offset(c, 4), 13);
  EXPECT_EQ(comm::pieces(10, 3), (Counts{4, 3, 3}));
  EXPECT_EQ(comm::pieces(2, 3), (Counts{1, 1, 0}));
  for (int n = 1; n <= 5; ++n)
    for (i64 count = 0; count < 20; ++count) {
      const Counts p = comm::pieces(count, n);
      ASSERT_EQ(int(p.size()), n);
      EXPECT_EQ(comm::total(p), count);
      for (int k = 0; k < n; ++k) EXPECT_EQ(comm::block_offset(p, k), piece_range(count, k, n).first);
    }
}

TEST(Blocks, TypesAndTheirSizes) {
  EXPECT_EQ(comm::type_bytes(Type::F32), 4);
  EXPECT_EQ(comm::type_bytes(Type::F64), 8);
  EXPECT_EQ(comm::type_bytes(Type::BF16), 2);
  EXPECT_EQ(comm::type_bytes(Type::I32), 4);
  EXPECT_EQ(comm::type_bytes(Type::U8), 1);
  EXPECT_EQ(comm::type_of(DType::BF16), Type::BF16);
  EXPECT_EQ(comm::type_of(DType::F32), Type::F32);
  EXPECT_EQ(comm::type_of(DType::I32), Type::I32);
  EXPECT_STREQ(comm::type_name(Type::BF16), "bf16");
}

// Note [Counts past MPI's int]: every element in exactly one chunk, in order, none empty,
// none over the limit, as few as the limit allows; under small limits standing in for 2^31 - 1.
TEST(CountLimit, ChunksCoverEveryElementOnceUnderTheLimit) {
  for (const i64 limit : {i64{1}, i64{2}, i64{3}, i64{7}, i64{64}}) {
    for (i64 count = 0; count <= 3 * limit + 2; ++count) {
      const auto ch = comm::chunks(count, limit);
      ASSERT_EQ(i64(ch.size()), (count + limit - 1) / limit) << count << " under " << limit;
      i64 at = 0;
      for (const comm::Chunk& c : ch) {
        EXPECT_EQ(c.offset, at) << count << " under " << limit;
        EXPECT_GT(c.count, 0);
        EXPECT_LE(c.count, limit);
        at += c.count;
      }
      EXPECT_EQ(at, count) << count << " under " << limit;
    }
  }
  EXPECT_TRUE(comm::chunks(0, 5).empty());
  EXPECT_EQ(comm::chunks(5, 5), (std::vector<comm::Chunk>{{0, 5}}));
  EXPECT_EQ(comm::chunks(11, 5), (std::vector<comm::Chunk>{{0, 5}, {5, 5}, {10, 1}}));
  // 8 Gi elements (a 16 GiB bf16 buffer) under MPI's own limit: five calls, the last the rest.
  const i64 big = i64{8} << 30;
  const auto ch = comm::chunks(big, INT_MAX);
  ASSERT_EQ(ch.size(), 5u);
  EXPECT_EQ(ch[4].offset, 4 * i64{INT_MAX});
  EXPECT_EQ(ch[4].count, big - 4 * i64{INT_MAX});
}

TEST(CountLimit, DefaultsToMpisIntAndRefusesWhatMpiCannotCount) {
  EXPECT_EQ(comm::mpi_count_limit(), INT_MAX);
  expect_refused([] { comm::set_mpi_count_limit(0); }, "count limit");
  expect_refused([] { comm::set_mpi_count_limit(i64{INT_MAX} + 1); }, "count limit");
  comm::set_mpi_count_limit(7);
  EXPECT_EQ(comm::mpi_count_limit(), 7);
  comm::set_mpi_count_limit(INT_MAX);
}

}  // namespace
}  // namespace sppo
