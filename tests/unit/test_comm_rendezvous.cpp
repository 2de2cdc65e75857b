// Note [Rendezvous] (comm/rendezvous.h), the bookkeeping NCCL's point-to-point runs on, here
// without NCCL: two ranks post tagged sends and receives in random orders (each receive of a
// tag after as many sends of it, or before), notices and grants travel between them with
// random delays but in order, and the transfers each side starts must pair up one to one in
// the same order (an untagged channel matches them so), with each receive filled by the send
// MPI would have matched it to: the k-th receive of a tag by the k-th send of it.
#include <gtest/gtest.h>

#include <deque>
#include <map>
#include <random>
#include <vector>

#include "comm/rendezvous.h"

namespace sppo::comm {
namespace {

struct Message {
  int tag;
  i64 bytes;
};

TEST(Rendezvous, TransfersPairUpInOrderAndEachReceiveGetsItsMessage) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 500; ++trial) {
    const int n = 1 + int(rng() % 30);
    std::vector<Message> sends;  // A's, in posting order
    for (int k = 0; k < n; ++k) sends.push_back({int(rng() % 4), i64(1 + rng() % 1000)});
    // B posts a receive for every message, each tag's in order, the tags interleaved at random.
    std::map<int, std::deque<std::size_t>> by_tag;
    for (std::size_t k = 0; k < sends.size(); ++k) by_tag[sends[k].tag].push_back(k);
    std::vector<std::size_t> recv_order;  // which message each receive expects
    while (recv_order.size() < sends.size()) {
      auto it = by_tag.begin();
      std::advance(it, rng() % by_tag.size());
      recv_order.push_back(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) by_tag.erase(it);
    }

    Rendezvous a, b;  // A sends to rank 1 (B); B receives from rank 0 (A)
    std::deque<Rendezvous::Notice> notices;  // A -> B, in order
    std::deque<std::int64_t> grants;          // B -> A, in order
    std::vector<Request> a_started;           // A's send requests, in the order A starts them
    std::vector<Request> b_started;           // B's receive requests, in the order B starts them
    std::map<Request, std::size_t> b_expects;  // receive request -> the message it must get
    std::size_t a_posted = 0, b_posted = 0;
    auto b_match = [&](const Rendezvous::Match& m) {
      EXPECT_EQ(m.bytes, m.posted_bytes) << "trial " << trial;
      b_started.push_back(m.recv);
      grants.push_back(m.seq);
    };
    for (int guard = 0; guard < 100000; ++guard) {
      const bool all_posted = a_posted == sends.size() && b_posted == sends.size();
      if (all_posted && notices.empty() && grants.empty()) break;
      switch (rng() % 4) {
        case 0:
          if (a_posted < sends.size()) {
            const Message& m = sends[a_posted];
            notices.push_back(a.send(1, m.tag, m.bytes, Request(a_posted)));
            ++a_posted;
          }
          break;
        case 1:
          if (b_posted < sends.size()) {
            const std::size_t want = recv_order[b_posted];
            const Request r = Request(1000 + b_posted);
            b_expects[r] = want;
            if (auto m = b.receive(0, sends[want].tag, sends[want].bytes, r)) b_match(*m);
            ++b_posted;
          }
          break;
        case 2:
          if (!notices.empty()) {
            const Rendezvous::Notice got = notices.front();
            notices.pop_front();
            if (auto m = b.noticed(0, got)) b_match(*m);
          }
          break;
        case 3:
          if (!grants.empty()) {
            a_started.push_back(a.granted(1, grants.front()));
            grants.pop_front();
          }
          break;
      }
    }
    ASSERT_EQ(a_started.size(), sends.size()) << "trial " << trial << ": a send never started";
    ASSERT_EQ(b_started.size(), sends.size()) << "trial " << trial << ": a receive never started";
    EXPECT_EQ(a.waiting(), 0u);
    EXPECT_EQ(b.waiting(), 0u);
    // The i-th transfer A starts meets the i-th B starts (NCCL pairs them so): it must be the
    // message that receive expects.
    for (std::size_t i = 0; i < sends.size(); ++i)
      ASSERT_EQ(std::size_t(a_started[i]), b_expects[b_started[i]]) << "trial " << trial << ", transfer " << i;
  }
}

TEST(Rendezvous, ASizeMismatchIsReported) {
  Rendezvous b;
  ASSERT_FALSE(b.receive(0, 7, 100, 1).has_value());
  const auto m = b.noticed(0, {7, 64, 0});
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->bytes, 64);
  EXPECT_EQ(m->posted_bytes, 100);
}

}  // namespace
}  // namespace sppo::comm
