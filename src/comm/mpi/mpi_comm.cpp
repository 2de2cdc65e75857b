#include "comm/mpi/mpi_comm.h"

#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/bf16.h"
#include "core/check.h"
#include "core/layout.h"

namespace sppo::comm {

namespace {

int g_rank = -1;
i64 g_count_limit = INT_MAX;

// MPI has no bf16: sums of 16-bit elements by a user-defined operation, each pair added in
// fp32 and rounded back.
extern "C" void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = float_to_bf16(bf16_to_float(a[i]) + bf16_to_float(b[i]));
}

// u8 sums wrap modulo 256 by an operation of our own too: OpenMPI 4.1's vectorised MPI_SUM
// (its op/avx component) saturates 8- and 16-bit integers at their largest value instead
// (open-mpi/ompi#8045, closed as won't fix), which the MPI tests caught over 3 ranks.
extern "C" void u8_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const std::uint8_t*>(in);
  auto* b = static_cast<std::uint8_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = std::uint8_t(a[i] + b[i]);
}

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
    check(MPI_Op_create(&bf16_sum, 1, &bf16_sum_), "MPI_Op_create");
    check(MPI_Op_create(&u8_sum, 1, &u8_sum_), "MPI_Op_create");
    check(MPI_Comm_dup(MPI_COMM_WORLD, &world_exchange_), "MPI_Comm_dup");
    struct sigaction sa {};
    sa.sa_handler = on_terminate;
    sigaction(SIGTERM, &sa, nullptr);
  }

  ~Mpi() override {
    for (auto& [g, c] : comms_) MPI_Comm_free(&c);
    MPI_Comm_free(&world_exchange_);
    MPI_Op_free(&bf16_sum_);
    MPI_Op_free(&u8_sum_);
    MPI_Finalize();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "mpi"; }

  // A message past MPI's count limit goes as several, in order (Note [Counts past MPI's int]:
  // messages between two ranks with one tag are not overtaken); one of no bytes is still one.
  Request isend(const void* data, i64 bytes, int peer, int tag) override {
    Pending p;
    const char* d = static_cast<const char*>(data);
    for (const Chunk& c : message_chunks(bytes))
      check(MPI_Isend(d + c.offset, int(c.count), MPI_BYTE, peer, tag, MPI_COMM_WORLD, &p.add()), "MPI_Isend");
    count_sent(bytes);
    return add(std::move(p));
  }

  Request irecv(void* data, i64 bytes, int peer, int tag) override {
    Pending p;
    p.peer = peer;
    char* d = static_cast<char*>(data);
    for (const Chunk& c : message_chunks(bytes)) {
      p.expect_bytes.push_back(c.count);
      check(MPI_Irecv(d + c.offset, int(c.count), MPI_BYTE, peer, tag, MPI_COMM_WORLD, &p.add()), "MPI_Irecv");
    }
    return add(std::move(p));
  }

  Request iallreduce(void* data, i64 count, Type type, const Group& g) override {
    check_member(*this, g, "all-reduce");
    SPPO_CHECK(count >= 0, "comm") << "rank " << rank_ << ": all-reduce of " << count << " elements";
    Pending p;
    char* d = static_cast<char*>(data);
    for (const Chunk& c : chunks(count, g_count_limit))
      check(MPI_Iallreduce(MPI_IN_PLACE, d + c.offset * type_bytes(type), int(c.count), mpi_type(type), sum_op(type),
                           comm_of(g), &p.add()),
            "MPI_Iallreduce");
    return add(std::move(p));
  }

  Request ireduce_scatter(const void* send, void* recv, const Counts& counts, Type type, const Group& g) override {
    const OwnBlock own = check_reduce_scatter(*this, send, recv, counts, type, g);
    const i64 e = type_bytes(type), mine = counts[std::size_t(own.index)];
    const char* s = static_cast<const char*>(send);
    char* r = static_cast<char*>(recv);
    Pending p;
    if (total(counts) <= g_count_limit) {
      ints(counts, &p.counts, &p.displs);
      if (own.in_place) {
        // In place, MPI leaves this member's block at the start of the buffer: move it home.
        char* all = const_cast<char*>(s);
        p.done = [all, r, mine, e] { std::memmove(r, all, std::size_t(mine * e)); };
        check(MPI_Ireduce_scatter(MPI_IN_PLACE, all, p.counts.data(), mpi_type(type), sum_op(type), comm_of(g),
                                  &p.add()),
              "MPI_Ireduce_scatter");
      } else {
        check(MPI_Ireduce_scatter(s, r, p.counts.data(), mpi_type(type), sum_op(type), comm_of(g), &p.add()),
              "MPI_Ireduce_scatter");
      }
      return add(std::move(p));
    }
    // Note [Counts past MPI's int]: each block's chunks reduced to its member.
    for (std::size_t m = 0; m < g.size(); ++m) {
      const i64 at = block_offset(counts, int(m));
      for (const Chunk& c : chunks(counts[m], g_count_limit)) {
        const char* from = s + (at + c.offset) * e;
        const bool root = int(m) == own.index;
        check(MPI_Ireduce(root && own.in_place ? MPI_IN_PLACE : from, root ? r + c.offset * e : nullptr, int(c.count),
                          mpi_type(type), sum_op(type), int(m), comm_of(g), &p.add()),
              "MPI_Ireduce");
      }
    }
    return add(std::move(p));
  }

  Request iallgather(const void* send, void* recv, const Counts& counts, Type type, const Group& g) override {
    const OwnBlock own = check_allgather(*this, send, recv, counts, type, g);
    const i64 e = type_bytes(type), mine = counts[std::size_t(own.index)];
    char* r = static_cast<char*>(recv);
    Pending p;
    if (total(counts) <= g_count_limit) {
      ints(counts, &p.counts, &p.displs);
      check(MPI_Iallgatherv(own.in_place ? MPI_IN_PLACE : send, int(mine), mpi_type(type), r, p.counts.data(),
                            p.displs.data(), mpi_type(type), comm_of(g), &p.add()),
            "MPI_Iallgatherv");
      return add(std::move(p));
    }
    // Note [Counts past MPI's int]: each block's chunks broadcast from its member.
    if (!own.in_place && mine > 0) std::memcpy(r + own.offset * e, send, std::size_t(mine * e));
    for (std::size_t m = 0; m < g.size(); ++m) {
      const i64 at = block_offset(counts, int(m));
      for (const Chunk& c : chunks(counts[m], g_count_limit))
        check(MPI_Ibcast(r + (at + c.offset) * e, int(c.count), mpi_type(type), int(m), comm_of(g), &p.add()),
              "MPI_Ibcast");
    }
    return add(std::move(p));
  }

  Request ialltoall(const void* send, const Counts& send_counts, void* recv, const Counts& recv_counts, Type type,
                    const Group& g) override {
    const int k = check_alltoall(*this, send, send_counts, recv, recv_counts, type, g);
    count_sent(alltoall_sent_bytes(send_counts, type, k));
    const i64 e = type_bytes(type);
    const char* s = static_cast<const char*>(send);
    char* r = static_cast<char*>(recv);
    const MPI_Comm c = exchange_of(g);
    Pending p;
    // Note [Counts past MPI's int]: receives posted first, then the sends, chunk by chunk;
    // this member's own block is a copy.
    for (std::size_t j = 0; j < g.size(); ++j) {
      if (int(j) == k) continue;
      const i64 at = block_offset(recv_counts, int(j));
      for (const Chunk& ch : chunks(recv_counts[j], g_count_limit))
        check(MPI_Irecv(r + (at + ch.offset) * e, int(ch.count), mpi_type(type), int(j), kExchangeTag, c, &p.add()),
              "MPI_Irecv");
    }
    for (std::size_t j = 0; j < g.size(); ++j) {
      if (int(j) == k) continue;
      const i64 at = block_offset(send_counts, int(j));
      for (const Chunk& ch : chunks(send_counts[j], g_count_limit))
        check(MPI_Isend(s + (at + ch.offset) * e, int(ch.count), mpi_type(type), int(j), kExchangeTag, c, &p.add()),
              "MPI_Isend");
    }
    if (const i64 n = send_counts[std::size_t(k)]; n > 0)
      std::memcpy(r + block_offset(recv_counts, k) * e, s + block_offset(send_counts, k) * e, std::size_t(n * e));
    return add(std::move(p));
  }

  Request ibroadcast(void* data, i64 count, Type type, int root, const Group& g) override {
    const int root_index = check_root(*this, g, root, "broadcast");
    SPPO_CHECK(count >= 0, "comm") << "rank " << rank_ << ": broadcast of " << count << " elements";
    Pending p;
    char* d = static_cast<char*>(data);
    for (const Chunk& c : chunks(count, g_count_limit))
      check(MPI_Ibcast(d + c.offset * type_bytes(type), int(c.count), mpi_type(type), root_index, comm_of(g),
                       &p.add()),
            "MPI_Ibcast");
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
      if (member) comms_[g] = c;  // also its all-to-alls' messages: nothing else sends on it
    }
  }

  [[noreturn]] void abort(const std::string& message, int code) override {
    std::fprintf(stderr, "sppo: %s\n", message.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);
  }

 private:
  // One operation: a message (one MPI request), or a collective (one or more).
  struct Pending {
    std::vector<MPI_Request> reqs;
    std::vector<i64> expect_bytes;  // receives: the size the schedule expects of each of reqs
    int peer = -1;
    std::vector<int> counts, displs;  // kept alive until the collective completes
    std::function<void()> done;
    MPI_Request& add() { return reqs.emplace_back(MPI_REQUEST_NULL); }
  };

  // The tag of all-to-alls' messages, on communicators of their own.
  static constexpr int kExchangeTag = 0;

  void check(int rc, const char* call) {
    if (rc == MPI_SUCCESS) return;
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, text, &len);
    abort("[comm] rank " + std::to_string(rank_) + ": " + call + " failed: " + std::string(text, std::size_t(len)), 4);
  }

  static std::vector<Chunk> message_chunks(i64 bytes) {
    return bytes == 0 ? std::vector<Chunk>{{0, 0}} : chunks(bytes, g_count_limit);
  }

  Request add(Pending p) {
    const Request r = next_++;
    pending_.emplace(r, std::move(p));
    return r;
  }

  // True once every request of `p` is done (its completion then run); a receive's size is
  // checked against the schedule's.
  bool poll(Pending& p) {
    int flag = 0;
    if (p.expect_bytes.empty()) {
      check(MPI_Testall(int(p.reqs.size()), p.reqs.data(), &flag, MPI_STATUSES_IGNORE), "MPI_Testall");
    } else {
      std::vector<MPI_Status> st(p.reqs.size());
      check(MPI_Testall(int(p.reqs.size()), p.reqs.data(), &flag, st.data()), "MPI_Testall");
      for (std::size_t k = 0; flag && k < st.size(); ++k) {
        int got = 0;
        check(MPI_Get_count(&st[k], MPI_BYTE, &got), "MPI_Get_count");
        if (i64(got) != p.expect_bytes[k])
          abort("[comm] rank " + std::to_string(rank_) + ": a message from rank " + std::to_string(p.peer) +
                    " holds " + std::to_string(got) + " bytes where the schedule expects " +
                    std::to_string(p.expect_bytes[k]) + " (ranks started with different options?)",
                4);
      }
    }
    if (flag && p.done) p.done();
    return flag != 0;
  }

  // Counts and displacements as MPI takes them (their total fits: Note [Counts past MPI's int]).
  static void ints(const Counts& counts, std::vector<int>* out, std::vector<int>* displs) {
    i64 at = 0;
    for (const i64 c : counts) {
      SPPO_ASSERT(at + c <= INT_MAX);
      out->push_back(int(c));
      displs->push_back(int(at));
      at += c;
    }
  }

  static MPI_Datatype mpi_type(Type t) {
    switch (t) {
      case Type::F32: return MPI_FLOAT;
      case Type::F64: return MPI_DOUBLE;
      case Type::BF16: return MPI_UINT16_T;  // summed by bf16_sum_
      case Type::I32: return MPI_INT32_T;
      case Type::U8: return MPI_UINT8_T;  // summed by u8_sum_
    }
    SPPO_ASSERT_MSG(false, "an unknown element type " << int(t));
    return MPI_DATATYPE_NULL;
  }

  MPI_Op sum_op(Type t) const { return t == Type::BF16 ? bf16_sum_ : t == Type::U8 ? u8_sum_ : MPI_SUM; }

  bool is_world(const Group& g) const {
    if (int(g.size()) != size_) return false;
    for (int k = 0; k < size_; ++k)
      if (g[std::size_t(k)] != k) return false;
    return true;
  }

  MPI_Comm comm_of(const Group& g) {
    if (is_world(g)) return MPI_COMM_WORLD;
    auto it = comms_.find(g);
    SPPO_ASSERT_MSG(it != comms_.end(), "collective over a group that prepare_groups() did not make");
    return it->second;
  }

  // The communicator of a group's all-to-all messages: the world's own duplicate (the
  // runtime's messages travel on the world), a group's communicator otherwise.
  MPI_Comm exchange_of(const Group& g) { return is_world(g) ? world_exchange_ : comm_of(g); }

  int rank_ = 0, size_ = 1;
  MPI_Op bf16_sum_ = MPI_OP_NULL, u8_sum_ = MPI_OP_NULL;
  MPI_Comm world_exchange_ = MPI_COMM_NULL;
  Request next_ = 0;
  std::unordered_map<Request, Pending> pending_;
  std::unordered_set<Request> completed_;
  std::map<Group, MPI_Comm> comms_;
};

}  // namespace

std::unique_ptr<Comm> make_mpi() { return std::make_unique<Mpi>(); }

std::vector<Chunk> chunks(i64 count, i64 limit) {
  SPPO_ASSERT(count >= 0 && limit >= 1);
  std::vector<Chunk> out;
  for (i64 at = 0; at < count; at += limit) out.push_back({at, std::min(limit, count - at)});
  return out;
}

i64 mpi_count_limit() { return g_count_limit; }

void set_mpi_count_limit(i64 elements) {
  SPPO_CHECK(elements >= 1 && elements <= INT_MAX, "comm")
      << "an MPI count limit of " << elements << " elements; it lies in [1, 2^31 - 1]";
  g_count_limit = elements;
}

}  // namespace sppo::comm
