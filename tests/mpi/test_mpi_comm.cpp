// Every collective of comm/comm.h between real ranks (2 and 3, under mpirun), in every type,
// against a reference each rank computes alone: every rank draws every member's inputs from
// one seed, fresh each run. Blocks even, uneven, and with a member of none; over the world
// and over a group of fewer ranks in another order than the world's (member index != rank);
// reduce-scatter and all-gather apart and in place; several operations in flight at once,
// waited for in reverse order. Through MPI itself and through the staged transport on the CPU
// (runtime/staged_comm.h, what `--comm mpi` runs), each once with MPI's own count limit and
// once with a limit of 7 elements, which sends every operation here over the split paths of
// Note [Counts past MPI's int]. Floating-point sums must equal one of the orders of adding
// (support/collectives.h): exactly, not within a tolerance.
//
// The test program starts itself: Collectives.* run `mpirun -np N <this program>
// --gtest_filter=Ranks.*`, and Ranks.* run only under mpirun.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "comm/comm.h"
#include "comm/mpi/mpi_comm.h"
#include "runtime/staged_comm.h"
#include "support/collectives.h"
#include "support/mpi_run.h"

namespace sppo {
namespace {

using comm::Counts;
using comm::Group;
using comm::Type;
using testing::Elements;

constexpr const char* kSeed = "SPPO_COMM_TEST_SEED";

std::string this_program() {
  char path[4096];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof path - 1);
  if (n <= 0) return "";
  return std::string(path, std::size_t(n));
}

void run_ranks(int np) {
  const std::uint64_t seed = std::random_device{}();
  const auto r = testing::run_command(std::string(kSeed) + "=" + std::to_string(seed) +
                                      " mpirun --oversubscribe --bind-to none -np " + std::to_string(np) + " " +
                                      this_program() + " --gtest_filter='Ranks.*' --gtest_brief=1 --gtest_color=no");
  EXPECT_EQ(r.status, 0) << np << " ranks, " << kSeed << "=" << seed << ":\n" << r.output;
  EXPECT_NE(r.output.find("[  PASSED  ] 2 tests"), std::string::npos) << r.output;
}

TEST(Collectives, TwoRanks) { run_ranks(2); }
TEST(Collectives, ThreeRanks) { run_ranks(3); }

// ---- under mpirun ---------------------------------------------------------------------------

// Every member's inputs of one case, drawn alike on every rank.
std::mt19937_64 stream(std::uint64_t seed, int case_id, int member) {
  std::seed_seq s{std::uint32_t(seed), std::uint32_t(seed >> 32), std::uint32_t(case_id), std::uint32_t(member)};
  return std::mt19937_64(s);
}

class Checker {
 public:
  Checker(comm::Comm& c, std::string transport, std::uint64_t seed)
      : c_(c), transport_(std::move(transport)), seed_(seed) {}

  // Every collective on one group, one type and one pattern of counts.
  void run(const Group& g, Type t, const Counts& counts, const std::vector<Counts>& exchange, int case_id) {
    const int n = int(g.size());
    int k = -1;
    for (int m = 0; m < n; ++m)
      if (g[std::size_t(m)] == c_.rank()) k = m;
    if (k < 0) return;
    where_ = transport_ + ", group of " + std::to_string(n) + " ranks (this one member " + std::to_string(k) + "), " +
             comm::type_name(t) + ", counts " + show(counts) + ", limit " + std::to_string(comm::mpi_count_limit());
    const i64 all = comm::total(counts), mine = counts[std::size_t(k)], at = comm::block_offset(counts, k);
    // Inputs: member m's buffer of every block (reduce-scatter, all-reduce, broadcast) and its
    // all-to-all send blocks.
    std::vector<Elements> x, send;
    for (int m = 0; m < n; ++m) {
      auto rng = stream(seed_, case_id, m);
      x.push_back(testing::random_elements(t, all, rng));
      send.push_back(testing::random_elements(t, comm::total(exchange[std::size_t(m)]), rng));
    }
    auto rng = stream(seed_, case_id, n + c_.rank());  // this rank's own: the receive buffers' garbage
    const Counts& send_counts = exchange[std::size_t(k)];
    Counts recv_counts(std::size_t(n), 0);
    for (int j = 0; j < n; ++j) recv_counts[std::size_t(j)] = exchange[std::size_t(j)][std::size_t(k)];

    Elements reduced = x[std::size_t(k)];
    Elements rs_send = x[std::size_t(k)], rs_recv = testing::random_elements(t, mine, rng);
    Elements rs_in_place = x[std::size_t(k)];
    Elements ag_send = block(x[std::size_t(k)], at, mine), ag_recv = testing::random_elements(t, all, rng);
    Elements ag_in_place = testing::random_elements(t, all, rng);
    copy_block(&ag_in_place, at, x[std::size_t(k)], at, mine);
    Elements a2a_send = send[std::size_t(k)], a2a_recv = testing::random_elements(t, comm::total(recv_counts), rng);
    const int root = g[std::size_t(case_id % n)];
    Elements bcast = c_.rank() == root ? x[std::size_t(k)] : testing::random_elements(t, all, rng);

    // All in flight at once, waited for in reverse order.
    std::vector<std::pair<comm::Request, const char*>> reqs;
    reqs.push_back({c_.iallreduce(reduced.data(), all, t, g), "all-reduce"});
    reqs.push_back({c_.ireduce_scatter(rs_send.data(), rs_recv.data(), counts, t, g), "reduce-scatter"});
    reqs.push_back(
        {c_.ireduce_scatter(rs_in_place.data(), element(rs_in_place, at), counts, t, g), "reduce-scatter in place"});
    reqs.push_back({c_.iallgather(ag_send.data(), ag_recv.data(), counts, t, g), "all-gather"});
    reqs.push_back({c_.iallgather(element(ag_in_place, at), ag_in_place.data(), counts, t, g), "all-gather in place"});
    reqs.push_back({c_.ialltoall(a2a_send.data(), send_counts, a2a_recv.data(), recv_counts, t, g), "all-to-all"});
    reqs.push_back({c_.ibroadcast(bcast.data(), all, t, root, g), "broadcast"});
    for (auto it = reqs.rbegin(); it != reqs.rend(); ++it) comm::wait(c_, it->first, it->second);

    // The references.
    for (i64 i = 0; i < all; ++i) expect_sum(reduced.at(i), x, i, "all-reduce", i);
    for (i64 i = 0; i < mine; ++i) {
      expect_sum(rs_recv.at(i), x, at + i, "reduce-scatter", i);
      expect_sum(rs_in_place.at(at + i), x, at + i, "reduce-scatter in place", at + i);
    }
    EXPECT_EQ(rs_send, x[std::size_t(k)]) << "reduce-scatter changed its send buffer; " << where_;
    EXPECT_EQ(ag_send, block(x[std::size_t(k)], at, mine)) << "all-gather changed its send buffer; " << where_;
    for (int m = 0; m < n; ++m) {
      const i64 b = comm::block_offset(counts, m);
      for (i64 i = 0; i < counts[std::size_t(m)]; ++i) {
        expect_element(t, ag_recv.at(b + i), x[std::size_t(m)].at(b + i), "all-gather", b + i);
        expect_element(t, ag_in_place.at(b + i), x[std::size_t(m)].at(b + i), "all-gather in place", b + i);
      }
    }
    const std::string a2a =
        "all-to-all (send counts " + show(send_counts) + ", receive counts " + show(recv_counts) + ")";
    EXPECT_EQ(a2a_send, send[std::size_t(k)]) << a2a << " changed its send buffer; " << where_;
    for (int j = 0; j < n; ++j) {
      // Member j's send block for this member.
      const i64 from = comm::block_offset(exchange[std::size_t(j)], k), to = comm::block_offset(recv_counts, j);
      for (i64 i = 0; i < recv_counts[std::size_t(j)]; ++i)
        expect_element(t, a2a_recv.at(to + i), send[std::size_t(j)].at(from + i), a2a.c_str(), to + i);
    }
    int root_index = 0;
    for (int m = 0; m < n; ++m)
      if (g[std::size_t(m)] == root) root_index = m;
    EXPECT_EQ(bcast, x[std::size_t(root_index)]) << "broadcast from rank " << root << "; " << where_;
    ++cases_;
  }

  int cases() const { return cases_; }

 private:
  static std::string show(const Counts& c) {
    std::string s = "{";
    for (std::size_t m = 0; m < c.size(); ++m) s += (m ? ", " : "") + std::to_string(c[m]);
    return s + "}";
  }
  static Elements block(const Elements& x, i64 at, i64 n) {
    Elements b(x.type(), n);
    copy_block(&b, 0, x, at, n);
    return b;
  }
  static void copy_block(Elements* to, i64 to_at, const Elements& from, i64 from_at, i64 n) {
    for (i64 i = 0; i < n; ++i) to->set(to_at + i, from.at(from_at + i));
  }
  static void* element(Elements& x, i64 i) { return static_cast<char*>(x.data()) + i * comm::type_bytes(x.type()); }

  void expect_sum(std::uint64_t got, const std::vector<Elements>& x, i64 i, const char* op, i64 at) {
    std::vector<std::uint64_t> operands;
    for (const Elements& e : x) operands.push_back(e.at(i));
    const auto sums = testing::possible_sums(x[0].type(), operands);
    if (std::find(sums.begin(), sums.end(), got) != sums.end()) return;
    if (++failures_ > 10) return;
    ADD_FAILURE() << op << "[" << at << "]: got " << testing::show(x[0].type(), got) << ", want "
                  << testing::show(x[0].type(), sums[0]) << "; " << where_;
  }
  void expect_element(Type t, std::uint64_t got, std::uint64_t want, const char* op, i64 at) {
    if (got == want || ++failures_ > 10) return;
    ADD_FAILURE() << op << "[" << at << "]: got " << testing::show(t, got) << ", want " << testing::show(t, want)
                  << "; " << where_;
  }

  comm::Comm& c_;
  std::string transport_, where_;
  std::uint64_t seed_;
  int cases_ = 0, failures_ = 0;
};

// Counts of a group of n: even, uneven, and uneven with member 1 holding none; an all-to-all's
// are a matrix (row i: member i's send counts), even or uneven with zeros.
std::vector<Counts> block_patterns(int n) {
  Counts even(std::size_t(n), 6), uneven, with_none;
  for (int m = 0; m < n; ++m) {
    uneven.push_back(3 + 4 * m);
    with_none.push_back(m == 1 ? 0 : 5 + 6 * m);
  }
  return {even, uneven, with_none};
}

std::vector<Counts> exchange_pattern(int n, int which) {
  std::vector<Counts> e(std::size_t(n), Counts(std::size_t(n), 6));
  if (which == 0) return e;
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j)
      e[std::size_t(i)][std::size_t(j)] = (i + 2 * j + which) % 3 == 0 ? 0 : 1 + 4 * i + 3 * j;
  return e;
}

TEST(Ranks, EveryCollectiveInEveryType) {
  if (!comm::launched_by_mpi()) GTEST_SKIP() << "runs under mpirun: Collectives.* start it";
  const char* s = std::getenv(kSeed);
  ASSERT_NE(s, nullptr) << kSeed << " names the inputs' seed";
  const std::uint64_t seed = std::stoull(s);
  comm::Comm& world = comm::world();
  const int np = world.size();
  ASSERT_GE(np, 2);
  ASSERT_LE(np, 3);
  // The world, and a group of fewer ranks whose order is not the world's.
  const Group all = comm::world_group(world);
  const Group part = np == 2 ? Group{1} : Group{2, 0};
  const Group reversed = np == 2 ? Group{1, 0} : Group{2, 1, 0};
  world.prepare_groups({part, reversed});
  const auto be = make_backend("cpu");
  StagedComm staged(world, *be, true);

  int case_id = 0, run = 0;
  for (const i64 limit : {i64{INT_MAX}, i64{7}}) {
    comm::set_mpi_count_limit(limit);
    for (comm::Comm* c : {&world, static_cast<comm::Comm*>(&staged)}) {
      Checker check(*c, c->name(), seed);
      for (const Group& g : {all, part, reversed}) {
        for (const Type t : testing::every_type()) {
          const auto patterns = block_patterns(int(g.size()));
          for (std::size_t p = 0; p < patterns.size(); ++p)
            check.run(g, t, patterns[p], exchange_pattern(int(g.size()), int(p)), case_id++);
        }
      }
      run += check.cases();
    }
  }
  comm::set_mpi_count_limit(INT_MAX);
  EXPECT_GT(staged.staged_out_bytes(), 0);
  EXPECT_GT(staged.staged_in_bytes(), 0);
  EXPECT_GT(run, 0);
  comm::barrier(world, "the end of the collectives' test");
}

}  // namespace
// Point-to-point messages past MPI's count limit go as several in order (Note [Counts past
// MPI's int]): under a limit of 7 bytes, messages of 0 to 40 bytes, several in flight with
// one tag and others between them, each arrive whole and in the order sent.
TEST(Ranks, MessagesPastTheCountLimit) {
  if (!comm::launched_by_mpi()) GTEST_SKIP() << "runs under mpirun: Collectives.* start it";
  comm::Comm& world = comm::world();
  const int np = world.size(), me = world.rank(), next = (me + 1) % np, prev = (me + np - 1) % np;
  for (const i64 limit : {i64{INT_MAX}, i64{7}}) {
    comm::set_mpi_count_limit(limit);
    const std::vector<i64> sizes = {0, 1, 6, 7, 8, 13, 14, 15, 40};
    // Each byte names its sender, its message and its place.
    auto byte_of = [](int from, std::size_t m, i64 k) { return char((from * 31 + int(m) * 7 + int(k)) & 0x7f); };
    std::vector<std::string> out(sizes.size()), in(sizes.size());
    std::vector<comm::Request> reqs;
    for (std::size_t m = 0; m < sizes.size(); ++m) {
      out[m].resize(std::size_t(sizes[m]));
      for (i64 k = 0; k < sizes[m]; ++k) out[m][std::size_t(k)] = byte_of(me, m, k);
      in[m].assign(std::size_t(sizes[m]), '?');
      const int tag = m % 3 == 0 ? 5 : 9;  // two streams of equal tags, interleaved
      reqs.push_back(world.irecv(in[m].data(), sizes[m], prev, tag));
      reqs.push_back(world.isend(out[m].data(), sizes[m], next, tag));
    }
    for (std::size_t k = reqs.size(); k-- > 0;) comm::wait(world, reqs[k], "a message of the test");
    for (std::size_t m = 0; m < sizes.size(); ++m)
      for (i64 k = 0; k < sizes[m]; ++k)
        ASSERT_EQ(in[m][std::size_t(k)], byte_of(prev, m, k)) << "limit " << limit << ", message " << m << ", byte " << k;
  }
  comm::set_mpi_count_limit(INT_MAX);
  comm::barrier(world, "the end of the messages' test");
}

}  // namespace sppo
