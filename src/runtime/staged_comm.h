// A communicator for device memory that the host's cannot read (`--comm mpi` on GPUs): every
// message and collective on device memory goes through pinned host buffers, copied out and in
// by the backend's copy streams, and crosses over the host's communicator (MPI). Host memory
// goes through the host's communicator as it is. The same interface as comm/comm.h.
//
// Note [Staged messages]
// ~~~~~~~~~~~~~~~~~~~~~~
// A send copies its device bytes into a pinned buffer on the copy-out stream (which first
// waits for the compute stream's work queued so far: the bytes exist), then sends the buffer;
// a receive receives into a pinned buffer, then copies it in on the copy-in stream (which first
// waits for the compute stream's work queued so far: the destination is no longer read); a
// collective copies out, runs on the buffer, copies in. The host's operations must start in
// the order the caller posted them (collectives in the same order on every member; messages of
// a tag in the order sent), so they start strictly in posting order: an operation whose copy
// out has not landed holds back every later one (the copies land in order, on one stream).
// Every test() advances every operation, so a caller may wait for any of them first. Where
// several ranks share one GPU, NCCL refuses them (2.28); this transport serves them and ranks
// with a GPU each alike, at the host link's rate.
//
// On the CPU backend (`--comm mpi` there) the device tier is host memory, and every pointer is
// staged all the same: the same code as on GPUs, run by the MPI tests in CI.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "backend/backend.h"
#include "comm/comm.h"

namespace sppo {

class StagedComm final : public comm::Comm {
 public:
  // stage_all: stage every pointer (the CPU backend), else those the backend calls device
  // memory (Backend::device_pointer).
  StagedComm(comm::Comm& host, Backend& be, bool stage_all);
  ~StagedComm() override;

  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  const char* name() const override { return "mpi (staged)"; }

  comm::Request isend(const void* data, i64 bytes, int peer, int tag) override;
  comm::Request irecv(void* data, i64 bytes, int peer, int tag) override;
  comm::Request iallreduce(void* data, i64 count, comm::Type type, const comm::Group& group) override;
  comm::Request ireduce_scatter(const void* send, void* recv, const comm::Counts& counts, comm::Type type,
                                const comm::Group& group) override;
  comm::Request iallgather(const void* send, void* recv, const comm::Counts& counts, comm::Type type,
                           const comm::Group& group) override;
  comm::Request ialltoall(const void* send, const comm::Counts& send_counts, void* recv,
                          const comm::Counts& recv_counts, comm::Type type, const comm::Group& group) override;
  comm::Request ibroadcast(void* data, i64 count, comm::Type type, int root, const comm::Group& group) override;

  bool test(comm::Request r) override;
  void progress() override;
  void prepare_groups(const std::vector<comm::Group>& groups) override { host_.prepare_groups(groups); }
  [[noreturn]] void abort(const std::string& message, int code) override;

  // Bytes staged each way since the start (for the record).
  i64 staged_out_bytes() const { return staged_out_; }
  i64 staged_in_bytes() const { return staged_in_; }

 private:
  // One staged operation: copy `out` (device -> staging) first where it has one, then the host
  // operation `start` makes on the staging buffer (null where nothing is staged), then `in`
  // (staging -> device). A collective with a send and a receive buffer stages each in its own
  // range of the one staging buffer; in place, the one buffer's.
  struct Op {
    struct Copy {
      void* device = nullptr;         // the caller's bytes
      std::size_t at = 0, bytes = 0;  // and their range of the staging buffer
    };
    void* staging = nullptr;
    std::vector<Copy> out, in;
    std::function<comm::Request(char* staging)> start;
    std::vector<std::shared_ptr<Event>> copies_out, copies_in;
    comm::Request host = comm::kDone;
    bool started = false, copied_in = false;
  };

  bool staged(const void* p) const { return stage_all_ || be_.device_pointer(p); }
  comm::Request post(Op op);
  // Advances every operation as far as it can go, host operations started in posting order.
  void advance();
  static bool done(const std::vector<std::shared_ptr<Event>>& events);

  comm::Comm& host_;
  Backend& be_;
  bool stage_all_;
  std::unique_ptr<CopyStream> out_stream_, in_stream_;
  comm::Request next_ = 1;
  std::deque<std::pair<comm::Request, Op>> ops_;  // in posting order, host memory's too
  std::unordered_set<comm::Request> finished_;
  i64 staged_out_ = 0, staged_in_ = 0;
};

}  // namespace sppo
