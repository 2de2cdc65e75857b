#include "backends/cuda/nccl_comm.h"

#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "backends/cuda/check.h"
#include "comm/rendezvous.h"
#include "core/check.h"
#include "core/layout.h"

namespace sppo::cuda {

namespace {

// Control messages between two ranks over the host (Note [Rendezvous]); above the runtime's
// tags (the ring's reach 2^29 + 2^26, the trainer's gathers 2^30 + a few).
constexpr int kNoticeTag = (1 << 30) + (1 << 28);
constexpr int kGrantTag = kNoticeTag + 1;
// A notice or grant that says the sender is done: the standing receives complete with it.
constexpr std::int64_t kClosing = -1;

class Nccl final : public comm::Comm {
 public:
  Nccl(comm::Comm& host, cudaStream_t compute) : host_(host), compute_(compute) {
    set_timeout_s(host.timeout_s());
    ncclUniqueId id{};
    if (host.rank() == 0) nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    comm::wait(host, host.ibroadcast(&id, sizeof id, comm::Type::U8, 0, comm::world_group(host)),
               "NCCL's unique id from rank 0");
    nccl(ncclCommInitRank(&world_, host.size(), id, host.rank()), "ncclCommInitRank");
    SPPO_CUDA_CHECK(cudaStreamCreateWithFlags(&collective_, cudaStreamNonBlocking));
  }

  ~Nccl() override {
    close_channels();
    for (auto& [g, c] : groups_) ncclCommDestroy(c);
    for (auto& [k, ch] : channels_) {
      ncclCommDestroy(ch.comm);
      cudaStreamDestroy(ch.stream);
    }
    ncclCommDestroy(world_);
    cudaStreamDestroy(collective_);
  }

  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  const char* name() const override { return "nccl"; }

  comm::Request isend(const void* data, i64 bytes, int peer, int tag) override {
    count_sent(bytes);
    if (!on_device(data)) return pass(host_.isend(data, bytes, peer, tag));
    const comm::Request r = add(Pending{State::WaitGrant, const_cast<void*>(data), bytes, peer});
    ready(pending_[r]);
    const comm::Rendezvous::Notice n = rendezvous_.send(peer, tag, bytes, r);
    if (peer == rank()) {  // a message to itself: matched here, no notice crosses the host
      if (auto m = rendezvous_.noticed(peer, n)) start_self(rendezvous_.granted(peer, m->seq), *m);
      return r;
    }
    control(peer, kNoticeTag, n);
    return r;
  }

  comm::Request irecv(void* data, i64 bytes, int peer, int tag) override {
    if (!on_device(data)) return pass(host_.irecv(data, bytes, peer, tag));
    const comm::Request r = add(Pending{State::WaitNotice, data, bytes, peer});
    ready(pending_[r]);
    if (auto m = rendezvous_.receive(peer, tag, bytes, r)) {
      if (peer == rank()) start_self(rendezvous_.granted(peer, m->seq), *m);
      else grant(peer, *m);
    }
    return r;
  }

  comm::Request iallreduce(void* data, i64 count, comm::Type type, const comm::Group& g) override {
    comm::check_member(*this, g, "all-reduce");
    SPPO_CHECK(count >= 0, "comm") << "rank " << rank() << ": all-reduce of " << count << " elements";
    if (count == 0 || !on_device(data)) return pass(host_.iallreduce(data, count, type, g));
    return collective([&](ncclComm_t c, cudaStream_t s) {
      nccl(ncclAllReduce(data, data, std::size_t(count), nccl_type(type), ncclSum, c, s), "ncclAllReduce");
    }, g);
  }

  // One reduce-scatter where the blocks are equal; else a reduce per block to its member
  // (NCCL's reduce-scatter takes one count), in one NCCL group.
  comm::Request ireduce_scatter(const void* send, void* recv, const comm::Counts& counts, comm::Type type,
                                const comm::Group& g) override {
    const comm::OwnBlock own = comm::check_reduce_scatter(*this, send, recv, counts, type, g);
    const i64 all = comm::total(counts), mine = counts[std::size_t(own.index)];
    if (!on_device(send, all * comm::type_bytes(type), recv, mine * comm::type_bytes(type), "reduce-scatter"))
      return pass(host_.ireduce_scatter(send, recv, counts, type, g));
    const ncclDataType_t t = nccl_type(type);
    const char* s = static_cast<const char*>(send);
    const i64 e = comm::type_bytes(type);
    return collective([&](ncclComm_t c, cudaStream_t st) {
      if (equal(counts)) {
        nccl(ncclReduceScatter(send, recv, std::size_t(mine), t, ncclSum, c, st), "ncclReduceScatter");
        return;
      }
      nccl(ncclGroupStart(), "ncclGroupStart");
      for (std::size_t m = 0; m < g.size(); ++m) {
        if (counts[m] == 0) continue;
        // recvbuff is only the root's (NCCL reads and writes no other member's).
        const char* from = s + comm::block_offset(counts, int(m)) * e;
        void* to = int(m) == own.index ? recv : const_cast<char*>(from);
        nccl(ncclReduce(from, to, std::size_t(counts[m]), t, ncclSum, int(m), c, st), "ncclReduce");
      }
      nccl(ncclGroupEnd(), "ncclGroupEnd");
    }, g);
  }

  // One all-gather where the blocks are equal; else this member's block sent to every other
  // and theirs received, in one NCCL group (NCCL's all-gather takes one count).
  comm::Request iallgather(const void* send, void* recv, const comm::Counts& counts, comm::Type type,
                           const comm::Group& g) override {
    const comm::OwnBlock own = comm::check_allgather(*this, send, recv, counts, type, g);
    const i64 e = comm::type_bytes(type), all = comm::total(counts), mine = counts[std::size_t(own.index)];
    if (!on_device(send, mine * e, recv, all * e, "all-gather"))
      return pass(host_.iallgather(send, recv, counts, type, g));
    const ncclDataType_t t = nccl_type(type);
    char* r = static_cast<char*>(recv);
    return collective([&](ncclComm_t c, cudaStream_t st) {
      if (equal(counts)) {
        nccl(ncclAllGather(send, recv, std::size_t(mine), t, c, st), "ncclAllGather");
        return;
      }
      if (!own.in_place && mine > 0)
        SPPO_CUDA_CHECK(cudaMemcpyAsync(r + own.offset * e, send, std::size_t(mine * e), cudaMemcpyDeviceToDevice, st));
      nccl(ncclGroupStart(), "ncclGroupStart");
      for (std::size_t m = 0; m < g.size(); ++m) {
        if (int(m) == own.index) continue;
        if (mine > 0) nccl(ncclSend(send, std::size_t(mine), t, int(m), c, st), "ncclSend");
        if (counts[m] > 0)
          nccl(ncclRecv(r + comm::block_offset(counts, int(m)) * e, std::size_t(counts[m]), t, int(m), c, st),
               "ncclRecv");
      }
      nccl(ncclGroupEnd(), "ncclGroupEnd");
    }, g);
  }

  // A send and a receive per other member in one NCCL group; this member's own block a copy.
  comm::Request ialltoall(const void* send, const comm::Counts& send_counts, void* recv,
                          const comm::Counts& recv_counts, comm::Type type, const comm::Group& g) override {
    const int k = comm::check_alltoall(*this, send, send_counts, recv, recv_counts, type, g);
    count_sent(comm::alltoall_sent_bytes(send_counts, type, k));
    const i64 e = comm::type_bytes(type);
    if (!on_device(send, comm::total(send_counts) * e, recv, comm::total(recv_counts) * e, "all-to-all"))
      return pass(host_.ialltoall(send, send_counts, recv, recv_counts, type, g));
    const ncclDataType_t t = nccl_type(type);
    const char* s = static_cast<const char*>(send);
    char* r = static_cast<char*>(recv);
    return collective([&](ncclComm_t c, cudaStream_t st) {
      if (const i64 n = send_counts[std::size_t(k)]; n > 0)
        SPPO_CUDA_CHECK(cudaMemcpyAsync(r + comm::block_offset(recv_counts, k) * e,
                                        s + comm::block_offset(send_counts, k) * e, std::size_t(n * e),
                                        cudaMemcpyDeviceToDevice, st));
      nccl(ncclGroupStart(), "ncclGroupStart");
      for (std::size_t j = 0; j < g.size(); ++j) {
        if (int(j) == k) continue;
        if (send_counts[j] > 0)
          nccl(ncclSend(s + comm::block_offset(send_counts, int(j)) * e, std::size_t(send_counts[j]), t, int(j), c, st),
               "ncclSend");
        if (recv_counts[j] > 0)
          nccl(ncclRecv(r + comm::block_offset(recv_counts, int(j)) * e, std::size_t(recv_counts[j]), t, int(j), c, st),
               "ncclRecv");
      }
      nccl(ncclGroupEnd(), "ncclGroupEnd");
    }, g);
  }

  comm::Request ibroadcast(void* data, i64 count, comm::Type type, int root, const comm::Group& g) override {
    const int root_index = comm::check_root(*this, g, root, "broadcast");
    SPPO_CHECK(count >= 0, "comm") << "rank " << rank() << ": broadcast of " << count << " elements";
    if (count == 0 || !on_device(data)) return pass(host_.ibroadcast(data, count, type, root, g));
    return collective([&](ncclComm_t c, cudaStream_t s) {
      nccl(ncclBroadcast(data, data, std::size_t(count), nccl_type(type), root_index, c, s), "ncclBroadcast");
    }, g);
  }

  bool test(comm::Request r) override {
    if (r == comm::kDone) return true;
    progress();
    auto it = pending_.find(r);
    SPPO_ASSERT_MSG(it != pending_.end(), "test of an unknown request " << r);
    Pending& p = it->second;
    bool finished = false;
    if (p.state == State::Host) {
      finished = host_.test(p.host);
    } else if (p.state == State::Event) {
      const cudaError_t e = cudaEventQuery(p.done);
      if (e != cudaErrorNotReady) SPPO_CUDA_CHECK(e);
      finished = e == cudaSuccess;
    }
    if (!finished) return false;
    release(p);
    pending_.erase(it);
    return true;
  }

  void progress() override {
    host_.progress();
    for (auto& [peer, in] : notices_in_) {
      if (!in.open || !host_.test(in.req)) continue;
      const comm::Rendezvous::Notice n = in.notice;
      if (n.seq == kClosing) {
        in.open = false;
        continue;
      }
      in.req = host_.irecv(&in.notice, sizeof in.notice, peer, kNoticeTag);
      if (auto m = rendezvous_.noticed(peer, n)) grant(peer, *m);
    }
    for (auto& [peer, in] : grants_in_) {
      if (!in.open || !host_.test(in.req)) continue;
      const std::int64_t seq = in.seq;
      if (seq == kClosing) {
        in.open = false;
        continue;
      }
      in.req = host_.irecv(&in.seq, sizeof in.seq, peer, kGrantTag);
      start(rendezvous_.granted(peer, seq), channel(rank(), peer));
    }
    for (auto it = controls_.begin(); it != controls_.end();)
      it = host_.test(it->req) ? controls_.erase(it) : std::next(it);
    if (++polls_ % 64 == 0) check_async_errors();
  }

  void prepare_groups(const std::vector<comm::Group>& groups) override {
    host_.prepare_groups(groups);
    for (const comm::Group& g : groups) {
      if (groups_.count(g) || is_world(g)) continue;
      int key = -1;
      for (std::size_t k = 0; k < g.size(); ++k)
        if (g[k] == rank()) key = int(k);
      ncclComm_t c = nullptr;
      nccl(ncclCommSplit(world_, key >= 0 ? 0 : NCCL_SPLIT_NOCOLOR, key, &c, nullptr), "ncclCommSplit");
      if (key >= 0) groups_[g] = c;
    }
  }

  // A communicator and stream per direction between two ranks (Note [Rendezvous]); the same
  // list on every rank, in the same order.
  void prepare_peers(const std::vector<std::pair<int, int>>& pairs) override {
    for (const auto& [from, to] : pairs) {
      if (from == to || channels_.count({from, to})) continue;
      const bool member = rank() == from || rank() == to;
      ncclComm_t c = nullptr;
      nccl(ncclCommSplit(world_, member ? 0 : NCCL_SPLIT_NOCOLOR, rank() == from ? 0 : 1, &c, nullptr),
           "ncclCommSplit");
      if (!member) continue;
      Channel ch;
      ch.comm = c;
      ch.peer_index = rank() == from ? 1 : 0;
      SPPO_CUDA_CHECK(cudaStreamCreateWithFlags(&ch.stream, cudaStreamNonBlocking));
      channels_[{from, to}] = ch;
      if (rank() == to && !notices_in_.count(from)) {
        NoticeIn& in = notices_in_[from];
        in.req = host_.irecv(&in.notice, sizeof in.notice, from, kNoticeTag);
      }
      if (rank() == from && !grants_in_.count(to)) {
        GrantIn& in = grants_in_[to];
        in.req = host_.irecv(&in.seq, sizeof in.seq, to, kGrantTag);
      }
    }
  }

  [[noreturn]] void abort(const std::string& message, int code) override {
    // Kernels waiting for a peer that is gone would hold the GPU: abort NCCL first.
    for (auto& [k, ch] : channels_) ncclCommAbort(ch.comm);
    for (auto& [g, c] : groups_) ncclCommAbort(c);
    if (world_) ncclCommAbort(world_);
    host_.abort(message, code);
    std::_Exit(code);
  }

 private:
  enum class State { Host, WaitGrant, WaitNotice, Event };
  struct Pending {
    State state;
    void* data = nullptr;
    i64 bytes = 0;
    int peer = -1;
    comm::Request host = comm::kDone;
    cudaEvent_t ready = nullptr;  // the compute stream's work queued before the call
    cudaEvent_t done = nullptr;   // after the NCCL operation
  };
  struct Channel {
    ncclComm_t comm = nullptr;
    cudaStream_t stream = nullptr;
    int peer_index = 0;
  };
  struct NoticeIn {
    comm::Rendezvous::Notice notice;
    comm::Request req = comm::kDone;
    bool open = true;
  };
  struct GrantIn {
    std::int64_t seq = 0;
    comm::Request req = comm::kDone;
    bool open = true;
  };
  struct Control {
    std::unique_ptr<comm::Rendezvous::Notice> notice;
    std::unique_ptr<std::int64_t> seq;
    comm::Request req = comm::kDone;
  };

  void nccl(ncclResult_t rc, const char* call) {
    if (rc == ncclSuccess) return;
    abort("[comm] rank " + std::to_string(rank()) + ": " + call + " failed: " + ncclGetErrorString(rc) + " (" +
              (ncclGetLastError(nullptr) ? ncclGetLastError(nullptr) : "") +
              "); NCCL_DEBUG=WARN says more, NCCL_SOCKET_IFNAME and NCCL_IB_HCA pick the network",
          4);
  }

  void check_async_errors() {
    auto check = [&](ncclComm_t c) {
      ncclResult_t async = ncclSuccess;
      if (c && ncclCommGetAsyncError(c, &async) == ncclSuccess && async != ncclSuccess)
        abort("[comm] rank " + std::to_string(rank()) + ": NCCL reports " + ncclGetErrorString(async) +
                  " (a peer failed, or the network did); the job ends",
              4);
    };
    check(world_);
    for (auto& [g, c] : groups_) check(c);
    for (auto& [k, ch] : channels_) check(ch.comm);
  }

  bool on_device(const void* p) const {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
  }

  // Where a collective's two buffers are (a buffer of no bytes is wherever the other is):
  // both on the device, or both on the host (true: the device).
  bool on_device(const void* send, i64 send_bytes, const void* recv, i64 recv_bytes, const char* op) const {
    if (send_bytes == 0) return recv_bytes > 0 && on_device(recv);
    const bool s = on_device(send);
    if (recv_bytes == 0) return s;
    SPPO_CHECK(s == on_device(recv), "comm") << "rank " << rank() << ": a " << op << " from " << (s ? "device" : "host")
                                             << " memory into " << (s ? "host" : "device")
                                             << " memory; give it two buffers on the same side";
    return s;
  }

  static bool equal(const comm::Counts& counts) {
    return std::all_of(counts.begin(), counts.end(), [&](i64 c) { return c == counts[0]; });
  }

  static ncclDataType_t nccl_type(comm::Type t) {
    switch (t) {
      case comm::Type::F32: return ncclFloat32;
      case comm::Type::F64: return ncclFloat64;
      case comm::Type::BF16: return ncclBfloat16;
      case comm::Type::I32: return ncclInt32;
      case comm::Type::U8: return ncclUint8;
    }
    SPPO_ASSERT_MSG(false, "an unknown element type " << int(t));
    return ncclUint8;
  }

  // The world's ranks in their own order; a group of every rank in another order is a group.
  bool is_world(const comm::Group& g) const {
    if (int(g.size()) != size()) return false;
    for (std::size_t k = 0; k < g.size(); ++k)
      if (g[k] != int(k)) return false;
    return true;
  }

  comm::Request add(Pending p) {
    const comm::Request r = next_++;
    pending_.emplace(r, p);
    return r;
  }
  comm::Request pass(comm::Request host) { return add(Pending{State::Host, nullptr, 0, -1, host}); }

  // The compute stream's work so far, for a later operation to wait for.
  void ready(Pending& p) {
    SPPO_CUDA_CHECK(cudaEventCreateWithFlags(&p.ready, cudaEventDisableTiming));
    SPPO_CUDA_CHECK(cudaEventRecord(p.ready, compute_));
  }
  void release(Pending& p) {
    if (p.ready) cudaEventDestroy(p.ready);
    if (p.done) cudaEventDestroy(p.done);
    p.ready = p.done = nullptr;
  }

  template <typename F>
  comm::Request collective(F&& enqueue, const comm::Group& g) {
    ncclComm_t c = world_;
    if (!is_world(g)) {
      auto it = groups_.find(g);
      SPPO_ASSERT_MSG(it != groups_.end(), "collective over a group that prepare_groups() did not make");
      c = it->second;
    }
    const comm::Request r = add(Pending{State::Event});
    Pending& p = pending_[r];
    ready(p);
    SPPO_CUDA_CHECK(cudaStreamWaitEvent(collective_, p.ready, 0));
    enqueue(c, collective_);
    SPPO_CUDA_CHECK(cudaEventCreateWithFlags(&p.done, cudaEventDisableTiming));
    SPPO_CUDA_CHECK(cudaEventRecord(p.done, collective_));
    return r;
  }

  Channel& channel(int from, int to) {
    auto it = channels_.find({from, to});
    SPPO_ASSERT_MSG(it != channels_.end(), "a device message from rank " << from << " to rank " << to
                                                                       << " that prepare_peers() did not declare");
    return it->second;
  }

  // Starts send or receive r on its direction's channel, after the compute stream's work it waits for.
  void start(comm::Request r, Channel& ch) {
    Pending& p = pending_.at(r);
    SPPO_CUDA_CHECK(cudaStreamWaitEvent(ch.stream, p.ready, 0));
    if (p.state == State::WaitGrant)
      nccl(ncclSend(p.data, std::size_t(p.bytes), ncclUint8, ch.peer_index, ch.comm, ch.stream), "ncclSend");
    else
      nccl(ncclRecv(p.data, std::size_t(p.bytes), ncclUint8, ch.peer_index, ch.comm, ch.stream), "ncclRecv");
    SPPO_CUDA_CHECK(cudaEventCreateWithFlags(&p.done, cudaEventDisableTiming));
    SPPO_CUDA_CHECK(cudaEventRecord(p.done, ch.stream));
    p.state = State::Event;
  }

  // The receiver's side of a match: grant the notice, then start the receive.
  void grant(int peer, const comm::Rendezvous::Match& m) {
    check_size(peer, m);
    Control c;
    c.seq = std::make_unique<std::int64_t>(m.seq);
    c.req = host_.isend(c.seq.get(), sizeof(std::int64_t), peer, kGrantTag);
    controls_.push_back(std::move(c));
    start(m.recv, channel(peer, rank()));
  }

  // A message to itself: the send and its receive in one NCCL group on the world's
  // communicator (of one rank, where this happens), so neither waits for the other.
  void start_self(comm::Request send, const comm::Rendezvous::Match& m) {
    check_size(rank(), m);
    Pending& s = pending_.at(send);
    Pending& r = pending_.at(m.recv);
    SPPO_CUDA_CHECK(cudaStreamWaitEvent(collective_, s.ready, 0));
    SPPO_CUDA_CHECK(cudaStreamWaitEvent(collective_, r.ready, 0));
    if (size() == 1) {
      nccl(ncclGroupStart(), "ncclGroupStart");
      nccl(ncclSend(s.data, std::size_t(s.bytes), ncclUint8, 0, world_, collective_), "ncclSend");
      nccl(ncclRecv(r.data, std::size_t(r.bytes), ncclUint8, 0, world_, collective_), "ncclRecv");
      nccl(ncclGroupEnd(), "ncclGroupEnd");
    } else {
      SPPO_CUDA_CHECK(cudaMemcpyAsync(r.data, s.data, std::size_t(s.bytes), cudaMemcpyDeviceToDevice, collective_));
    }
    for (Pending* p : {&s, &r}) {
      SPPO_CUDA_CHECK(cudaEventCreateWithFlags(&p->done, cudaEventDisableTiming));
      SPPO_CUDA_CHECK(cudaEventRecord(p->done, collective_));
      p->state = State::Event;
    }
  }

  void check_size(int peer, const comm::Rendezvous::Match& m) {
    if (m.bytes == m.posted_bytes) return;
    abort("[comm] rank " + std::to_string(rank()) + ": a message from rank " + std::to_string(peer) + " holds " +
              std::to_string(m.bytes) + " bytes where the schedule expects " + std::to_string(m.posted_bytes) +
              " (ranks started with different options?)",
          4);
  }

  void control(int peer, int tag, const comm::Rendezvous::Notice& n) {
    Control c;
    c.notice = std::make_unique<comm::Rendezvous::Notice>(n);
    c.req = host_.isend(c.notice.get(), sizeof n, peer, tag);
    controls_.push_back(std::move(c));
  }

  // The end: every peer's standing receives complete with a closing notice and grant, and
  // this rank's with theirs.
  void close_channels() {
    for (auto& [peer, in] : grants_in_) control(peer, kNoticeTag, comm::Rendezvous::Notice{0, 0, kClosing});
    for (auto& [peer, in] : notices_in_) {
      Control c;
      c.seq = std::make_unique<std::int64_t>(kClosing);
      c.req = host_.isend(c.seq.get(), sizeof(std::int64_t), peer, kGrantTag);
      controls_.push_back(std::move(c));
    }
    auto open = [&] {
      for (auto& [p, in] : notices_in_)
        if (in.open) return true;
      for (auto& [p, in] : grants_in_)
        if (in.open) return true;
      return !controls_.empty();
    };
    const double t0 = steady_s();
    while (open()) {
      progress();
      if (steady_s() - t0 > timeout_s())
        abort("[comm] rank " + std::to_string(rank()) + ": the peers did not close their NCCL channels within " +
                  std::to_string(int(timeout_s())) + " s",
              4);
    }
  }

  static double steady_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }

  comm::Comm& host_;
  cudaStream_t compute_;
  cudaStream_t collective_ = nullptr;
  ncclComm_t world_ = nullptr;
  std::map<comm::Group, ncclComm_t> groups_;
  std::map<std::pair<int, int>, Channel> channels_;  // (from, to)
  std::map<int, NoticeIn> notices_in_;               // by sender
  std::map<int, GrantIn> grants_in_;                 // by receiver
  std::vector<Control> controls_;                    // control messages in flight
  comm::Rendezvous rendezvous_;
  std::unordered_map<comm::Request, Pending> pending_;
  comm::Request next_ = 1;
  long polls_ = 0;
};

}  // namespace

bool nccl_built() { return true; }

std::unique_ptr<comm::Comm> make_nccl_comm(comm::Comm& host, cudaStream_t compute) {
  return std::make_unique<Nccl>(host, compute);
}

}  // namespace sppo::cuda
