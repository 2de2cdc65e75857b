// Tagged messages over a channel without tags (NCCL's point-to-point, comm/nccl): which posted
// receive each message fills, and the order in which both ends start their transfers.
//
// Note [Rendezvous]
// ~~~~~~~~~~~~~~~~~
// The runtime's messages are matched as MPI matches them: a receive takes the next message
// from its peer with its tag, so messages of one tag arrive in the order sent and messages of
// different tags in any. NCCL matches a receive with the next send of its peer, whatever it
// is, and a send blocks its stream until the receive is posted. So before a device message
// moves, the sender tells the receiver of it over the host's communicator (a notice: tag,
// bytes, sequence number), and the receiver, once a receive of that tag is posted and the
// notice is the oldest of its tag, grants it (the notice's sequence number back). The receiver
// starts its NCCL receives in the order of its grants; the sender starts its NCCL sends in the
// order the grants arrive, which is the order they were sent (one tag between two ranks, in
// order). Each direction between two ranks has its own NCCL communicator and stream, so that a
// send waiting for its receive never holds back a message going the other way.
//
// This class is the bookkeeping of one rank, for every peer, with no I/O: the NCCL
// communicator feeds it what was posted and what arrived, and does what it returns.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <utility>

#include "comm/comm.h"

namespace sppo::comm {

class Rendezvous {
 public:
  // What a sender tells its receiver of a message (sent as bytes over the host).
  struct Notice {
    std::int64_t tag = 0;
    std::int64_t bytes = 0;
    std::int64_t seq = 0;  // the sender's count of its messages to this receiver
  };
  // A notice matched with a posted receive: grant `seq` to the sender and start the receive.
  struct Match {
    Request recv = kDone;
    std::int64_t seq = 0;
    std::int64_t bytes = 0;         // the notice's
    std::int64_t posted_bytes = 0;  // the receive's (a mismatch: ranks disagree on the schedule)
  };

  // The sender posted send `r` of `bytes` with `tag` to `peer`: the notice to send it.
  Notice send(int peer, int tag, i64 bytes, Request r);
  // A grant of `seq` arrived from `peer`: the send to start now.
  Request granted(int peer, std::int64_t seq);

  // The receiver posted receive `r`; the oldest waiting notice of its (peer, tag), if any.
  std::optional<Match> receive(int peer, int tag, i64 bytes, Request r);
  // A notice arrived from `peer`; the oldest posted receive of its tag, if any.
  std::optional<Match> noticed(int peer, const Notice& n);

  // Sends waiting for their grant and notices waiting for their receive (none at a step's end).
  std::size_t waiting() const;

 private:
  struct PostedRecv {
    Request r;
    i64 bytes;
  };
  std::map<int, std::int64_t> next_seq_;                               // by receiver
  std::map<std::pair<int, std::int64_t>, Request> sends_;              // (receiver, seq) -> send
  std::map<std::pair<int, std::int64_t>, std::deque<PostedRecv>> recvs_;  // (sender, tag), posting order
  std::map<std::pair<int, std::int64_t>, std::deque<Notice>> notices_;    // (sender, tag), arrival order
};

}  // namespace sppo::comm
