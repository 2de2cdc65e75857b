// The hidden states that pipeline stages pass on (a forward's output to the next stage,
// a backward's gradient to the previous one), and every message this rank has in flight.
//
// Contract: a Recv of a hidden state (or its gradient) is posted, with its [tokens, H]
// buffer from the device tier, when the compute op before it starts (post_receives; the
// memory rules count the buffer from there, schedule/memory.h), and waited for where the
// program reaches it (wait_receive). What an F (B) produces for another stage is kept
// (produce) until its last Send has started and, under MSP, until this rank's own later
// piece has taken its rows of it (take_input, which assembles a piece's input from parts
// when pieces split the subsequence differently; Note [MSP pieces] in
// schedule/builders.cpp). A send keeps its buffer until it completes (poll), and then
// adds its span to the timeline; MSP's messages go out the same way (start_send). Every
// wait has the communicator's watchdog. At the end of a step nothing is left (drain,
// check_empty).
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "backend/backend.h"
#include "comm/comm.h"
#include "core/config.h"
#include "model/gpt.h"
#include "runtime/memory.h"
#include "runtime/step_io.h"
#include "schedule/ir.h"

namespace sppo {

// Hidden states are kept by their sched::HiddenId.
using HiddenKey = sched::HiddenId;

class StageMessages {
 public:
  // `ops`: this rank's. `sent`: the hidden-state sends of the runtime so far, which
  // runtime/fault.h counts over steps.
  StageMessages(comm::Comm* comm, int rank, Backend& be, MemoryTier& device, const ModelConfig& c,
                const sched::Schedule& sc, const std::vector<sched::Op>& ops, int& sent, StepResult& result);
  ~StageMessages();

  // Posts the receives that op k's start posts.
  void post_receives(std::size_t k);
  // Recv op k of a hidden state: the seconds spent waiting for it.
  double wait_receive(std::size_t k);
  // The output of an F (B) on rows `rows`, kept for its Sends and this rank's later pieces.
  void produce(const HiddenKey& key, Buffer buf, const Subseq& rows);
  // [q.T, H] what an F (B) on rows q starts from.
  Buffer take_input(const HiddenKey& key, const Subseq& q);
  // A Send of a hidden state (or its gradient).
  void send(const sched::Op& op);
  // Sends `bytes` from `data` with Send op's peer and tag; `keep` (may be null) is
  // released when the send completes.
  void start_send(std::shared_ptr<Buffer> keep, const void* data, i64 bytes, const sched::Op& op);
  // Sends `bytes` from `data` with Send op's peer and tag, and waits until it has gone.
  void send_now(const void* data, i64 bytes, const sched::Op& op);
  // Completes the sends that have finished, releasing their buffers.
  void poll();
  // Waits for the oldest send (an allocation over the budget waits for the memory it
  // frees); false if none is in flight.
  bool reclaim();
  // Waits for every send.
  void drain();
  // No hidden state left (ASSERT).
  void check_empty() const;

 private:
  struct Incoming {
    Buffer buf;
    comm::Request req = comm::kDone;
    i64 first = -1;   // position in the subsequence of its first row; -1: the whole piece
    i64 tokens = 0;
    std::size_t op = 0;  // the Recv op that waits for it
  };
  struct Produced {
    std::shared_ptr<Buffer> buf;
    Subseq rows;
    int sends_left = 0;      // Send ops of it still to come
    bool local = false;      // a later F/B of this rank takes some of its rows
  };
  struct Outgoing {
    std::shared_ptr<Buffer> buf;  // released when the send completes (may be null)
    comm::Request req;
    double start;
    std::string name;
  };
  void post_receive(std::size_t index);
  void finish_oldest(const std::string& why);

  comm::Comm* comm_;
  int rank_;
  Backend& be_;
  MemoryTier& device_;
  const ModelConfig& config_;
  DType act_;
  const sched::Schedule& sched_;
  const std::vector<sched::Op>& ops_;
  int& sent_;
  StepResult& result_;
  // Hidden states from the previous stage (gradients from the next), received before
  // their F (B) in one or more parts, and the ones this rank produced, waiting for their
  // Sends and, under MSP, for a piece of this rank that takes some of their rows.
  std::map<HiddenKey, std::vector<Incoming>> incoming_;
  std::map<HiddenKey, Produced> produced_;
  std::map<HiddenKey, int> sends_of_;    // Send ops of each, in this rank's op list
  std::set<HiddenKey> taken_here_;       // consumed in part by this rank's own later F/B
  std::vector<std::vector<std::size_t>> posts_;  // op index -> receives posted as it starts
  std::vector<Outgoing> sends_;
};

}  // namespace sppo
