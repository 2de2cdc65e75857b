// Communication between ranks (docs/design.md 8): one small interface that the runtime and the
// trainer are written against, with an MPI implementation for CPU ranks (comm/mpi) and a
// one-rank implementation for a process started without a launcher. No MPI type appears
// here, so an NCCL implementation (bootstrapped by MPI) can sit beside it.
//
// Contract:
//  - Point-to-point and collective operations are non-blocking and return a Request; the
//    caller's buffers must stay valid, and untouched (a send buffer: unwritten; a receive
//    buffer: unread), until test() reports the request done. Messages between two ranks
//    with equal tags are received in the order sent.
//  - Collectives run over a Group (world ranks; a member's position in it is its index k).
//    Every member must call them in the same order, with the same type and the same counts
//    (an all-to-all's: member i's send count for j is member j's receive count from i).
//  - Collectives move elements of one Type (F32, F64, BF16, I32, U8); counts are elements,
//    64-bit, and may pass 2^31 (Note [Counts past MPI's int] in comm/mpi/mpi_comm.h). Sums
//    are element-wise in the type: integers wrap (U8 modulo 256), BF16 adds each pair in
//    fp32 and rounds to nearest even, so a sum over more than two members depends on the
//    order the transport combines them in (as it does for F32 and F64).
//  - Block layout: where a collective takes per-member counts, a buffer of blocks holds
//    member 0's block, then member 1's, ..., contiguous (block k starts at the sum of the
//    counts before it). A send buffer is not written, except in place: a reduce-scatter
//    whose receive buffer is its own block of the send buffer, an all-gather whose send
//    buffer is its own block of the receive buffer. Otherwise send and receive must not
//    overlap.
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
#include "core/layout.h"

namespace sppo::comm {

using Group = std::vector<int>;  // world ranks
using Counts = std::vector<i64>;  // elements per member of a group, in member order
using Request = std::int64_t;    // a handle; kDone is a request that is already complete
inline constexpr Request kDone = -1;

// The element types collectives move.
enum class Type { F32, F64, BF16, I32, U8 };
int type_bytes(Type t);
const char* type_name(Type t);  // "f32", "f64", "bf16", "i32", "u8"
// The activations' and tensors' type (core/layout.h) as collectives move it.
Type type_of(DType t);

class Comm {
 public:
  virtual ~Comm() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* name() const = 0;  // "mpi", "solo"

  virtual Request isend(const void* data, i64 bytes, int peer, int tag) = 0;
  virtual Request irecv(void* data, i64 bytes, int peer, int tag) = 0;

  // One virtual per collective (the conveniences below are built on them). Counts are the
  // group's, in member order, the same on every member; blocks are laid out as the
  // contract above says.
  //
  // The sum over the group of `count` elements of data, in place.
  virtual Request iallreduce(void* data, i64 count, Type type, const Group& group) = 0;
  // send holds every member's block (counts[k] elements each); member k receives into recv
  // the sum over the group of the k-th blocks. In place when recv is this member's block
  // of send; the rest of send is then unspecified.
  virtual Request ireduce_scatter(const void* send, void* recv, const Counts& counts, Type type,
                                  const Group& group) = 0;
  // Member k's send (counts[k] elements) to every member: recv ends with every member's
  // block. In place when send is this member's block of recv.
  virtual Request iallgather(const void* send, void* recv, const Counts& counts, Type type, const Group& group) = 0;
  // Send block j (send_counts[j] elements) goes to member j; receive block j
  // (recv_counts[j]) comes from member j's send block for this member. Not in place.
  virtual Request ialltoall(const void* send, const Counts& send_counts, void* recv, const Counts& recv_counts,
                            Type type, const Group& group) = 0;
  // Root's `count` elements to every member of the group, in place.
  virtual Request ibroadcast(void* data, i64 count, Type type, int root, const Group& group) = 0;

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

  // Bytes handed to isend since this rank started, and the blocks its all-to-alls sent to
  // the other members: the traffic the simulator predicts message by message. Other
  // collectives are not counted (what they move depends on the library's algorithm).
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

// Blocks of a group's collectives.
i64 total(const Counts& counts);
// Where member k's block starts: the sum of the counts before it.
i64 block_offset(const Counts& counts, int k);
// The blocks ZeRO and tensor parallelism cut `count` elements into over `members`: member
// k's is piece_range(count, k, members) (core/layout.h).
Counts pieces(i64 count, int members);

// In-place fp32 conveniences over pieces(count, n) of data (ZeRO's shards of a bucket):
// member k ends with the group's sum of its piece (the rest of data is then unspecified) ...
Request ireduce_scatter_pieces(Comm& c, float* data, i64 count, const Group& group);
// ... and member k's piece goes to every member.
Request iallgather_pieces(Comm& c, float* data, i64 count, const Group& group);

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

// The one-rank implementation (also what world() is without a launcher). Its collectives
// copy with memcpy where send and receive differ: host memory only.
std::unique_ptr<Comm> make_solo();

// For implementations of Comm: the checks every transport makes of a collective's arguments
// before it starts (each a CHECK naming the op and this rank: a count per member, none
// negative, this rank a member of the group, buffers apart or in place as the contract
// allows), and what they find.
struct OwnBlock {
  int index = 0;          // this member's position in the group
  i64 offset = 0;         // elements before its block
  bool in_place = false;  // reduce-scatter: recv is its block of send; all-gather: send is its block of recv
};
int check_member(const Comm& c, const Group& group, const char* op);
int check_root(const Comm& c, const Group& group, int root, const char* op);  // the root's index
OwnBlock check_reduce_scatter(const Comm& c, const void* send, const void* recv, const Counts& counts, Type type,
                              const Group& group);
OwnBlock check_allgather(const Comm& c, const void* send, const void* recv, const Counts& counts, Type type,
                         const Group& group);
int check_alltoall(const Comm& c, const void* send, const Counts& send_counts, const void* recv,
                   const Counts& recv_counts, Type type, const Group& group);
// The bytes of an all-to-all's send blocks for the other members (member k's own stays):
// what bytes_sent counts for it.
i64 alltoall_sent_bytes(const Counts& send_counts, Type type, int k);

}  // namespace sppo::comm
