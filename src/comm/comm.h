// Communication between ranks (docs/design.md 8): one small interface that the runtime and the
// trainer are written against, with an MPI implementation for CPU ranks (comm/mpi) and a
// one-rank implementation for a process started without a launcher. No MPI type appears
// here, so an NCCL implementation (bootstrapped by MPI) can sit beside it.
//
// Contract:
//  - Point-to-point and collective operations are non-blocking and return a Request; the
//    caller's buffer must stay valid and untouched until test() reports the request done.
//    Messages between two ranks with equal tags are received in the order sent.
//  - Collectives run over a Group (world ranks; a member's position in it is its index for
//    reduce-scatter and all-gather pieces). Every member must call them in the same order.
//  - Nothing here blocks forever: wait() polls with a deadline and, past it, ends the whole
//    job with a message naming the rank and what it waited for. A failing rank calls
//    abort(), which ends every rank.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/dims.h"

namespace sppo::comm {

using Group = std::vector<int>;  // world ranks
using Request = std::int64_t;    // a handle; kDone is a request that is already complete
inline constexpr Request kDone = -1;

class Comm {
 public:
  virtual ~Comm() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* name() const = 0;  // "mpi", "solo"

  virtual Request isend(const void* data, i64 bytes, int peer, int tag) = 0;
  virtual Request irecv(void* data, i64 bytes, int peer, int tag) = 0;
  // Sum of float arrays across the group, in place.
  virtual Request iallreduce(float* data, i64 count, const Group& group) = 0;
  virtual Request iallreduce(double* data, i64 count, const Group& group) = 0;
  // Member k of the group ends with the sum over the group of its piece
  // piece_range(count, k, n) (core/layout.h) of data; the rest of data is then unspecified.
  virtual Request ireduce_scatter(float* data, i64 count, const Group& group) = 0;
  // Member k contributes its piece piece_range(count, k, n) of data, in place; afterwards
  // every member holds all of it.
  virtual Request iallgather(float* data, i64 count, const Group& group) = 0;
  // Root's bytes to every member of the group.
  virtual Request ibroadcast(void* data, i64 bytes, int root, const Group& group) = 0;
  // data holds group.size() slots of `bytes` each; member k fills slot k, and afterwards
  // every member holds every slot.
  virtual Request iallgather_bytes(void* data, i64 bytes, const Group& group) = 0;

  // Advances communication; true once `r` has completed (its handle is then released).
  virtual bool test(Request r) = 0;
  // Advances every outstanding operation without waiting (MPI progresses only inside calls).
  virtual void progress() = 0;

  // Communicators for groups are made collectively over the world: call this on every
  // rank with the same list before a collective over any of them is used.
  virtual void prepare_groups(const std::vector<Group>& groups) = 0;
  // The pairs (from, to) of ranks that messages on device memory will travel between, the
  // same list on every rank: a transport that connects pairs ahead (NCCL's, one communicator
  // a direction: Note [Rendezvous] in comm/rendezvous.h) makes their connections here,
  // collectively. Others need nothing.
  virtual void prepare_peers(const std::vector<std::pair<int, int>>& pairs) {}

  // Ends the job on every rank: prints "[component] rank R: message" and exits with `code`.
  [[noreturn]] virtual void abort(const std::string& message, int code) = 0;

  // Seconds a wait may take before the job is ended (the watchdog).
  double timeout_s() const { return timeout_s_; }
  void set_timeout_s(double s) { timeout_s_ = s; }

  // Bytes handed to isend since this rank started: its point-to-point traffic, which the
  // simulator predicts message by message. Collectives are not counted (what they move
  // depends on the library's algorithm).
  i64 bytes_sent() const { return bytes_sent_; }

 protected:
  void count_sent(i64 bytes) { bytes_sent_ += bytes; }

 private:
  double timeout_s_ = kDefaultTimeoutS;
  i64 bytes_sent_ = 0;

 public:
  static constexpr double kDefaultTimeoutS = 20.0;
};

// Polls `r` until it completes and returns the seconds waited. Past c.timeout_s() it
// aborts the job: "rank R waited S s for <what>; ...". `what` names the op.
double wait(Comm& c, Request r, const std::string& what);
// The same without ever leaving the core: for collectives on the critical path of every
// member (tensor parallelism's), where a rank's sleep delays the whole group, and MPI's
// non-blocking collectives advance only inside the polls.
double wait_spinning(Comm& c, Request r, const std::string& what);

// Blocking conveniences built on the above (each a wait with the watchdog).
void allreduce_sum(Comm& c, std::vector<double>& values, const Group& group, const std::string& what);
// Every rank's string, on every rank (for option checks, traces and error reports).
std::vector<std::string> allgather_strings(Comm& c, const std::string& mine, const std::string& what);
void barrier(Comm& c, const std::string& what);
Group world_group(const Comm& c);

// What this rank is doing, for the message printed when the launcher ends the job
// because another rank failed. Cheap: call it before every op.
void set_activity(const std::string& text);

// True when this process was started by an MPI launcher (mpirun, mpiexec, srun --mpi=pmix).
bool launched_by_mpi();

// The process's communicator: MPI when launched by mpirun or srun, else one rank (refused
// where srun started several tasks without an MPI plugin: Note [Launchers] in
// comm/launcher.h). Made on first use and finalized at exit.
Comm& world();

// The one-rank implementation (also what world() is without a launcher).
std::unique_ptr<Comm> make_solo();

}  // namespace sppo::comm
