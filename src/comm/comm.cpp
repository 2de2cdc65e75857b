#include "comm/comm.h"

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "comm/launcher.h"
#include "comm/mpi/mpi_comm.h"
#include "core/check.h"

namespace sppo::comm {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// One process, one rank: collectives over {0} are copies (none where in place); messages
// have no peer.
class Solo final : public Comm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const char* name() const override { return "solo"; }
  Request isend(const void*, i64, int peer, int) override { no_peer(peer); }
  Request irecv(void*, i64, int peer, int) override { no_peer(peer); }
  Request iallreduce(void*, i64 count, Type, const Group& g) override {
    alone(g);
    SPPO_CHECK(count >= 0, "comm") << "all-reduce of " << count << " elements";
    return kDone;
  }
  Request ireduce_scatter(const void* send, void* recv, const Counts& counts, Type type, const Group& g) override {
    alone(g);
    check_reduce_scatter(*this, send, recv, counts, type, g);
    return copy(recv, send, counts[0], type);
  }
  Request iallgather(const void* send, void* recv, const Counts& counts, Type type, const Group& g) override {
    alone(g);
    check_allgather(*this, send, recv, counts, type, g);
    return copy(recv, send, counts[0], type);
  }
  Request ialltoall(const void* send, const Counts& send_counts, void* recv, const Counts& recv_counts, Type type,
                    const Group& g) override {
    alone(g);
    check_alltoall(*this, send, send_counts, recv, recv_counts, type, g);
    return copy(recv, send, send_counts[0], type);
  }
  Request ibroadcast(void*, i64 count, Type, int root, const Group& g) override {
    alone(g);
    check_root(*this, g, root, "broadcast");
    SPPO_CHECK(count >= 0, "comm") << "broadcast of " << count << " elements";
    return kDone;
  }
  bool test(Request) override { return true; }
  void progress() override {}
  void prepare_groups(const std::vector<Group>& groups) override {
    for (const Group& g : groups) alone(g);
  }
  [[noreturn]] void abort(const std::string& message, int code) override {
    std::fprintf(stderr, "sppo: %s\n", message.c_str());
    std::fflush(stderr);
    std::_Exit(code);
  }

 private:
  [[noreturn]] static void no_peer(int peer) {
    SPPO_CHECK(false, "comm") << "this process runs alone but its schedule talks to rank " << peer
                              << "; start the job with mpirun -np <ranks>";
    std::abort();
  }
  static void alone(const Group& g) {
    SPPO_CHECK(g.size() == 1 && g[0] == 0, "comm")
        << "a collective over " << g.size() << " ranks in a process started alone; use mpirun";
  }
  static Request copy(void* to, const void* from, i64 count, Type type) {
    if (to != from && count > 0) std::memcpy(to, from, std::size_t(count) * std::size_t(type_bytes(type)));
    return kDone;
  }
};

char g_activity[512] = "starting";

}  // namespace

void set_activity(const std::string& text) {
  const std::size_t n = std::min(text.size(), sizeof g_activity - 1);
  std::memcpy(g_activity, text.data(), n);
  g_activity[n] = '\0';
}

const char* current_activity() { return g_activity; }

namespace {

double wait_for(Comm& c, Request r, const std::string& what, bool spin) {
  if (r == kDone || c.test(r)) return 0;
  const double t0 = now_s();
  // Spin briefly (a message in flight lands within microseconds), then poll every 50 us
  // so that a waiting rank leaves its core to ranks that compute.
  for (int spins = 0;; ++spins) {
    if (c.test(r)) return now_s() - t0;
    if (!spin && spins > 200) {
      const timespec pause{0, 50'000};
      nanosleep(&pause, nullptr);
    }
    const double waited = now_s() - t0;
    if (waited > c.timeout_s()) {
      std::ostringstream os;
      os << "[comm] rank " << c.rank() << " waited " << int(waited) << " s for " << what
         << " and gave up: the peer has failed, hangs, or runs a different schedule (were all ranks "
            "started with the same options?); if it is only slow, raise --comm-timeout (now "
         << c.timeout_s() << " s)";
      c.abort(os.str(), 4);
    }
  }
}

}  // namespace

double wait(Comm& c, Request r, const std::string& what) { return wait_for(c, r, what, false); }

double wait_spinning(Comm& c, Request r, const std::string& what) { return wait_for(c, r, what, true); }

int type_bytes(Type t) {
  switch (t) {
    case Type::F32: return 4;
    case Type::F64: return 8;
    case Type::BF16: return 2;
    case Type::I32: return 4;
    case Type::U8: return 1;
  }
  SPPO_ASSERT_MSG(false, "an unknown element type " << int(t));
  return 0;
}

const char* type_name(Type t) {
  switch (t) {
    case Type::F32: return "f32";
    case Type::F64: return "f64";
    case Type::BF16: return "bf16";
    case Type::I32: return "i32";
    case Type::U8: return "u8";
  }
  SPPO_ASSERT_MSG(false, "an unknown element type " << int(t));
  return "";
}

Type type_of(DType t) {
  switch (t) {
    case DType::F32: return Type::F32;
    case DType::BF16: return Type::BF16;
    case DType::I32: return Type::I32;
  }
  SPPO_ASSERT_MSG(false, "an unknown tensor type " << int(t));
  return Type::U8;
}

i64 total(const Counts& counts) {
  i64 n = 0;
  for (const i64 c : counts) n += c;
  return n;
}

i64 block_offset(const Counts& counts, int k) {
  SPPO_ASSERT(k >= 0 && std::size_t(k) <= counts.size());
  i64 at = 0;
  for (int m = 0; m < k; ++m) at += counts[std::size_t(m)];
  return at;
}

Counts pieces(i64 count, int members) {
  Counts c;
  for (int k = 0; k < members; ++k) {
    const auto [b, e] = piece_range(count, k, members);
    c.push_back(e - b);
  }
  return c;
}

Request ireduce_scatter_pieces(Comm& c, float* data, i64 count, const Group& group) {
  const Counts counts = pieces(count, int(group.size()));
  const i64 at = block_offset(counts, check_member(c, group, "reduce-scatter"));
  return c.ireduce_scatter(data, data + at, counts, Type::F32, group);
}

Request iallgather_pieces(Comm& c, float* data, i64 count, const Group& group) {
  const Counts counts = pieces(count, int(group.size()));
  const i64 at = block_offset(counts, check_member(c, group, "all-gather"));
  return c.iallgather(data + at, data, counts, Type::F32, group);
}

namespace {

// Whether [a, a + a_bytes) and [b, b + b_bytes) share a byte.
bool overlap(const void* a, i64 a_bytes, const void* b, i64 b_bytes) {
  if (a_bytes <= 0 || b_bytes <= 0) return false;
  const auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + std::uintptr_t(b_bytes) && y < x + std::uintptr_t(a_bytes);
}

void check_counts(const Comm& c, const Counts& counts, const Group& group, const char* op, const char* which) {
  SPPO_CHECK(counts.size() == group.size(), "comm")
      << "rank " << c.rank() << ": " << op << " over a group of " << group.size() << " members with "
      << counts.size() << " " << which << "; give one count per member, in member order";
  for (std::size_t k = 0; k < counts.size(); ++k)
    SPPO_CHECK(counts[k] >= 0, "comm") << "rank " << c.rank() << ": " << op << " with " << counts[k]
                                       << " elements for member " << k << "; counts are zero or more";
}

// The checks of reduce-scatter and all-gather, which differ in which buffer holds every block.
OwnBlock check_blocks(const Comm& c, const void* one, const void* all, const Counts& counts, Type type,
                      const Group& group, const char* op, const char* in_place) {
  check_counts(c, counts, group, op, "counts");
  OwnBlock b;
  b.index = check_member(c, group, op);
  b.offset = block_offset(counts, b.index);
  const i64 e = type_bytes(type);
  b.in_place = one == static_cast<const char*>(all) + b.offset * e;
  SPPO_CHECK(b.in_place || !overlap(one, counts[std::size_t(b.index)] * e, all, total(counts) * e), "comm")
      << "rank " << c.rank() << ": " << op << " with overlapping send and receive buffers; they must be apart, or "
      << in_place;
  return b;
}

}  // namespace

int check_member(const Comm& c, const Group& group, const char* op) {
  for (std::size_t k = 0; k < group.size(); ++k)
    if (group[k] == c.rank()) return int(k);
  SPPO_CHECK(false, "comm") << "rank " << c.rank() << " runs a " << op << " over a group of " << group.size()
                            << " ranks that does not hold it; only members call a group's collectives";
  return -1;
}

int check_root(const Comm& c, const Group& group, int root, const char* op) {
  check_member(c, group, op);
  for (std::size_t k = 0; k < group.size(); ++k)
    if (group[k] == root) return int(k);
  SPPO_CHECK(false, "comm") << "rank " << c.rank() << ": a " << op << " from rank " << root
                            << ", which is not in its group of " << group.size() << " ranks";
  return -1;
}

OwnBlock check_reduce_scatter(const Comm& c, const void* send, const void* recv, const Counts& counts, Type type,
                              const Group& group) {
  return check_blocks(c, recv, send, counts, type, group, "reduce-scatter",
                      "in place: the receive buffer this member's block of the send buffer");
}

OwnBlock check_allgather(const Comm& c, const void* send, const void* recv, const Counts& counts, Type type,
                         const Group& group) {
  return check_blocks(c, send, recv, counts, type, group, "all-gather",
                      "in place: the send buffer this member's block of the receive buffer");
}

i64 alltoall_sent_bytes(const Counts& send_counts, Type type, int k) {
  i64 n = 0;
  for (std::size_t j = 0; j < send_counts.size(); ++j)
    if (int(j) != k) n += send_counts[j];
  return n * type_bytes(type);
}

int check_alltoall(const Comm& c, const void* send, const Counts& send_counts, const void* recv,
                   const Counts& recv_counts, Type type, const Group& group) {
  check_counts(c, send_counts, group, "all-to-all", "send counts");
  check_counts(c, recv_counts, group, "all-to-all", "receive counts");
  const int k = check_member(c, group, "all-to-all");
  SPPO_CHECK(send_counts[std::size_t(k)] == recv_counts[std::size_t(k)], "comm")
      << "rank " << c.rank() << ": all-to-all sends " << send_counts[std::size_t(k)]
      << " elements to itself but receives " << recv_counts[std::size_t(k)] << " from itself";
  const i64 e = type_bytes(type);
  SPPO_CHECK(!overlap(send, total(send_counts) * e, recv, total(recv_counts) * e), "comm")
      << "rank " << c.rank() << ": all-to-all with overlapping send and receive buffers; an all-to-all is not in place";
  return k;
}

Group world_group(const Comm& c) {
  Group g(std::size_t(c.size()));
  for (int r = 0; r < c.size(); ++r) g[std::size_t(r)] = r;
  return g;
}

void allreduce_sum(Comm& c, std::vector<double>& values, const Group& group, const std::string& what) {
  wait(c, c.iallreduce(values.data(), i64(values.size()), Type::F64, group), what);
}

std::vector<std::string> allgather_strings(Comm& c, const std::string& mine, const std::string& what) {
  const Group all = world_group(c);
  Counts sizes(std::size_t(c.size()), 0);
  sizes[std::size_t(c.rank())] = i64(mine.size());
  {
    std::vector<double> s(sizes.begin(), sizes.end());  // each rank adds its own
    allreduce_sum(c, s, all, what);
    for (std::size_t r = 0; r < s.size(); ++r) sizes[r] = i64(s[r]);
  }
  std::vector<char> buf(std::size_t(total(sizes)) + 1, '\0');
  wait(c, c.iallgather(mine.data(), buf.data(), sizes, Type::U8, all), what);
  std::vector<std::string> out;
  for (int r = 0; r < c.size(); ++r)
    out.emplace_back(buf.data() + block_offset(sizes, r), std::size_t(sizes[std::size_t(r)]));
  return out;
}

void barrier(Comm& c, const std::string& what) {
  std::vector<double> one{1.0};
  allreduce_sum(c, one, world_group(c), what);
}

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(v)) return true;
  return false;
}

std::unique_ptr<Comm> make_solo() { return std::make_unique<Solo>(); }

Comm& world() {
  static std::unique_ptr<Comm> w = launched_by_mpi() ? make_mpi() : (check_launch(), make_solo());
  return *w;
}

}  // namespace sppo::comm
