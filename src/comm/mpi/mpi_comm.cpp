#include "comm/mpi/mpi_comm.h"

#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/check.h"
#include "core/layout.h"

namespace sppo::comm {

namespace {

int g_rank = -1;

// mpirun ends the other ranks with SIGTERM when one fails. Say which rank this is and
// what it was doing before going, so the job's output names every rank's last op.
extern "C" void on_terminate(int) {
  char buf[768];
  const int n = std::snprintf(buf, sizeof buf,
                              "sppo: [comm] rank %d: ended by the launcher while at %s (another rank failed; "
                              "see its message above)\n",
                              g_rank, current_activity());
  if (n > 0) {
    const ssize_t ignored = ::write(STDERR_FILENO, buf, std::size_t(std::min<int>(n, int(sizeof buf) - 1)));
    (void)ignored;
  }
  _exit(143);
}

class Mpi final : public Comm {
 public:
  Mpi() {
    int provided = 0;
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
    check(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check(MPI_Comm_rank(MPI_COMM_WORLD, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(MPI_COMM_WORLD, &size_), "MPI_Comm_size");
    g_rank = rank_;
    struct sigaction sa {};
    sa.sa_handler = on_terminate;
    sigaction(SIGTERM, &sa, nullptr);
  }

  ~Mpi() override {
    for (auto& [g, c] : comms_) MPI_Comm_free(&c);
    MPI_Finalize();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "mpi"; }

  Request isend(const void* data, i64 bytes, int peer, int tag) override {
    Pending p;
    check(MPI_Isend(data, count_of(bytes), MPI_BYTE, peer, tag, MPI_COMM_WORLD, &p.req), "MPI_Isend");
    count_sent(bytes);
    return add(std::move(p));
  }

  Request irecv(void* data, i64 bytes, int peer, int tag) override {
    Pending p;
    p.expect_bytes = bytes;
    p.peer = peer;
    check(MPI_Irecv(data, count_of(bytes), MPI_BYTE, peer, tag, MPI_COMM_WORLD, &p.req), "MPI_Irecv");
    return add(std::move(p));
  }

  Request iallreduce(float* data, i64 count, const Group& g) override {
    Pending p;
    check(MPI_Iallreduce(MPI_IN_PLACE, data, count_of(count), MPI_FLOAT, MPI_SUM, comm_of(g), &p.req),
          "MPI_Iallreduce");
    return add(std::move(p));
  }

  Request iallreduce(double* data, i64 count, const Group& g) override {
    Pending p;
    check(MPI_Iallreduce(MPI_IN_PLACE, data, count_of(count), MPI_DOUBLE, MPI_SUM, comm_of(g), &p.req),
          "MPI_Iallreduce");
    return add(std::move(p));
  }

  Request ireduce_scatter(float* data, i64 count, const Group& g) override {
    Pending p;
    const int k = index_in(g);
    split(count, int(g.size()), &p.counts, &p.displs);
    // In place, MPI leaves this member's piece at the start of the buffer: move it home.
    const i64 off = p.displs[std::size_t(k)], n = p.counts[std::size_t(k)];
    p.done = [data, off, n] { std::memmove(data + off, data, std::size_t(n) * sizeof(float)); };
    check(MPI_Ireduce_scatter(MPI_IN_PLACE, data, p.counts.data(), MPI_FLOAT, MPI_SUM, comm_of(g), &p.req),
          "MPI_Ireduce_scatter");
    return add(std::move(p));
  }

  Request iallgather(float* data, i64 count, const Group& g) override {
    Pending p;
    split(count, int(g.size()), &p.counts, &p.displs);
    check(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, p.counts.data(), p.displs.data(), MPI_FLOAT,
                          comm_of(g), &p.req),
          "MPI_Iallgatherv");
    return add(std::move(p));
  }

  Request ibroadcast(void* data, i64 bytes, int root, const Group& g) override {
    Pending p;
    int root_index = -1;
    for (std::size_t k = 0; k < g.size(); ++k)
      if (g[k] == root) root_index = int(k);
    SPPO_ASSERT_MSG(root_index >= 0, "broadcast root " << root << " is not in its group");
    check(MPI_Ibcast(data, count_of(bytes), MPI_BYTE, root_index, comm_of(g), &p.req), "MPI_Ibcast");
    return add(std::move(p));
  }

  Request iallgather_bytes(void* data, i64 bytes, const Group& g) override {
    Pending p;
    check(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, count_of(bytes), MPI_BYTE, comm_of(g), &p.req),
          "MPI_Iallgather");
    return add(std::move(p));
  }

  bool test(Request r) override {
    if (r == kDone) return true;
    if (completed_.erase(r)) return true;
    auto it = pending_.find(r);
    SPPO_ASSERT_MSG(it != pending_.end(), "test of an unknown request " << r);
    if (!poll(it->second)) return false;
    pending_.erase(it);
    return true;
  }

  void progress() override {
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (poll(it->second)) {
        completed_.insert(it->first);
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
  }

  void prepare_groups(const std::vector<Group>& groups) override {
    for (const Group& g : groups) {
      if (comms_.count(g) || is_world(g)) continue;
      int key = 0;
      bool member = false;
      for (std::size_t k = 0; k < g.size(); ++k)
        if (g[k] == rank_) member = true, key = int(k);
      MPI_Comm c = MPI_COMM_NULL;
      check(MPI_Comm_split(MPI_COMM_WORLD, member ? 0 : MPI_UNDEFINED, key, &c), "MPI_Comm_split");
      if (member) comms_[g] = c;
    }
  }

  [[noreturn]] void abort(const std::string& message, int code) override {
    std::fprintf(stderr, "sppo: %s\n", message.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);
  }

 private:
  struct Pending {
    MPI_Request req = MPI_REQUEST_NULL;
    i64 expect_bytes = -1;  // receives: the size the schedule expects
    int peer = -1;
    std::vector<int> counts, displs;  // kept alive until the collective completes
    std::function<void()> done;
  };

  void check(int rc, const char* call) {
    if (rc == MPI_SUCCESS) return;
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, text, &len);
    abort("[comm] rank " + std::to_string(rank_) + ": " + call + " failed: " + std::string(text, std::size_t(len)), 4);
  }

  int count_of(i64 n) {
    if (n > INT_MAX)
      abort("[comm] rank " + std::to_string(rank_) + ": a message of " + std::to_string(n) +
                " elements is over MPI's count limit of 2^31 - 1; use more pipeline stages or subsequences",
            4);
    return int(n);
  }

  Request add(Pending p) {
    const Request r = next_++;
    pending_.emplace(r, std::move(p));
    return r;
  }

  bool poll(Pending& p) {
    int flag = 0;
    MPI_Status st;
    check(MPI_Test(&p.req, &flag, &st), "MPI_Test");
    if (!flag) return false;
    if (p.expect_bytes >= 0) {
      int got = 0;
      MPI_Get_count(&st, MPI_BYTE, &got);
      if (i64(got) != p.expect_bytes)
        abort("[comm] rank " + std::to_string(rank_) + ": a message from rank " + std::to_string(p.peer) +
                  " holds " + std::to_string(got) + " bytes where the schedule expects " +
                  std::to_string(p.expect_bytes) + " (ranks started with different options?)",
              4);
    }
    if (p.done) p.done();
    return true;
  }

  static void split(i64 count, int n, std::vector<int>* counts, std::vector<int>* displs) {
    for (int k = 0; k < n; ++k) {
      const auto [b, e] = piece_range(count, k, n);
      counts->push_back(int(e - b));
      displs->push_back(int(b));
    }
  }

  bool is_world(const Group& g) const {
    if (int(g.size()) != size_) return false;
    for (int k = 0; k < size_; ++k)
      if (g[std::size_t(k)] != k) return false;
    return true;
  }

  int index_in(const Group& g) const {
    for (std::size_t k = 0; k < g.size(); ++k)
      if (g[k] == rank_) return int(k);
    SPPO_ASSERT_MSG(false, "rank " << rank_ << " is not in the group of its collective");
    return -1;
  }

  MPI_Comm comm_of(const Group& g) {
    if (is_world(g)) return MPI_COMM_WORLD;
    auto it = comms_.find(g);
    SPPO_ASSERT_MSG(it != comms_.end(), "collective over a group that prepare_groups() did not make");
    return it->second;
  }

  int rank_ = 0, size_ = 1;
  Request next_ = 0;
  std::unordered_map<Request, Pending> pending_;
  std::unordered_set<Request> completed_;
  std::map<Group, MPI_Comm> comms_;
};

}  // namespace

std::unique_ptr<Comm> make_mpi() { return std::make_unique<Mpi>(); }

}  // namespace sppo::comm
