#include "backends/cuda/nccl_comm.h"

#include <nccl.h>

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
    comm::wait(host, host.ibroadcast(&id, sizeof id, 0, comm::world_group(host)), "NCCL's unique id from rank 0");
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

  comm::Request iallreduce(float* data, i64 count, const comm::Group& g) override {
    if (!on_device(data)) return pass(host_.iallreduce(data, count, g));
    return collective([&](ncclComm_t c, cudaStream_t s) {
      nccl(ncclAllReduce(data, data, std::size_t(count), ncclFloat, ncclSum, c, s), "ncclAllReduce");
    }, g);
  }

  comm::Request iallreduce(double* data, i64 count, const comm::Group& g) override {
    if (!on_device(data)) return pass(host_.iallreduce(data, count, g));
    return collective([&](ncclComm_t c, cudaStream_t s) {
      nccl(ncclAllReduce(data, data, std::size_t(count), ncclDouble, ncclSum, c, s), "ncclAllReduce");
    }, g);
  }

  // Member k ends with the sum of its piece piece_range(count, k, n), in place: one
  // reduce-scatter where the pieces are equal, else a reduce per piece to its member.
  comm::Request ireduce_scatter(float* data, i64 count, const comm::Group& g) override {
    if (!on_device(data)) return pass(host_.ireduce_scatter(data, count, g));
    const int n = int(g.size()), k = index_in(g);
    return collective([&](ncclComm_t c, cudaStream_t s) {
      if (count % n == 0) {
        const i64 piece = count / n;
        nccl(ncclReduceScatter(data, data + k * piece, std::size_t(piece), ncclFloat, ncclSum, c, s),
             "ncclReduceScatter");
        return;
      }
      nccl(ncclGroupStart(), "ncclGroupStart");
      for (int m = 0; m < n; ++m) {
        const auto [b, e] = piece_range(count, m, n);
        nccl(ncclReduce(data + b, data + b, std::size_t(e - b), ncclFloat, ncclSum, m, c, s), "ncclReduce");
      }
      nccl(ncclGroupEnd(), "ncclGroupEnd");
    }, g);
  }

  // Member k's piece to every member, in place: one all-gather where the pieces are equal,
  // else a broadcast per piece from its member.
  comm::Request iallgather(float* data, i64 count, const comm::Group& g) override {
    if (!on_device(data)) return pass(host_.iallgather(data, count, g));
    const int n = int(g.size()), k = index_in(g);
    return collective([&](ncclComm_t c, cudaStream_t s) {
      if (count % n == 0) {
        const i64 piece = count / n;
        nccl(ncclAllGather(data + k * piece, data, std::size_t(piece), ncclFloat, c, s), "ncclAllGather");
        return;
      }
      nccl(ncclGroupStart(), "ncclGroupStart");
      for (int m = 0; m < n; ++m) {
        const auto [b, e] = piece_range(count, m, n);
        nccl(ncclBroadcast(data + b, data + b, std::size_t(e - b), ncclFloat, m, c, s), "ncclBroadcast");
      }
      nccl(ncclGroupEnd(), "ncclGroupEnd");
    }, g);
  }

  comm::Request ibroadcast(void* data, i64 bytes, int root, const comm::Group& g) override {
    if (!on_device(data)) return pass(host_.ibroadcast(data, bytes, root, g));
    int root_index = -1;
    for (std::size_t k = 0; k < g.size(); ++k)
      if (g[k] == root) root_index = int(k);
    SPPO_ASSERT_MSG(root_index >= 0, "broadcast root " << root << " is not in its group");
    return collective([&](ncclComm_t c, cudaStream_t s) {
      nccl(ncclBroadcast(data, data, std::size_t(bytes), ncclUint8, root_index, c, s), "ncclBroadcast");
    }, g);
  }

  comm::Request iallgather_bytes(void* data, i64 bytes, const comm::Group& g) override {
    if (!on_device(data)) return pass(host_.iallgather_bytes(data, bytes, g));
    const int k = index_in(g);
    return collective([&](ncclComm_t c, cudaStream_t s) {
      char* d = static_cast<char*>(data);
      nccl(ncclAllGather(d + i64(k) * bytes, d, std::size_t(bytes), ncclUint8, c, s), "ncclAllGather");
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
      if (groups_.count(g) || int(g.size()) == size()) continue;
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

  int index_in(const comm::Group& g) const {
    for (std::size_t k = 0; k < g.size(); ++k)
      if (g[k] == rank()) return int(k);
    SPPO_ASSERT_MSG(false, "rank " << rank() << " is not in the group of its collective");
    return -1;
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
    if (int(g.size()) != size()) {
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
