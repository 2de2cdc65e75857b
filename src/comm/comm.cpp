#include "comm/comm.h"

#include <time.h>

#include <algorithm>
#include <chrono>
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

// One process, one rank: collectives over {0} are complete at once; messages have no peer.
class Solo final : public Comm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const char* name() const override { return "solo"; }
  Request isend(const void*, i64, int peer, int) override { no_peer(peer); }
  Request irecv(void*, i64, int peer, int) override { no_peer(peer); }
  Request iallreduce(float*, i64, const Group& g) override { return alone(g); }
  Request iallreduce(double*, i64, const Group& g) override { return alone(g); }
  Request ireduce_scatter(float*, i64, const Group& g) override { return alone(g); }
  Request iallgather(float*, i64, const Group& g) override { return alone(g); }
  Request ibroadcast(void*, i64, int, const Group& g) override { return alone(g); }
  Request iallgather_bytes(void*, i64, const Group& g) override { return alone(g); }
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
  static Request alone(const Group& g) {
    SPPO_CHECK(g.size() == 1 && g[0] == 0, "comm")
        << "a collective over " << g.size() << " ranks in a process started alone; use mpirun";
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

Group world_group(const Comm& c) {
  Group g(std::size_t(c.size()));
  for (int r = 0; r < c.size(); ++r) g[std::size_t(r)] = r;
  return g;
}

void allreduce_sum(Comm& c, std::vector<double>& values, const Group& group, const std::string& what) {
  wait(c, c.iallreduce(values.data(), i64(values.size()), group), what);
}

std::vector<std::string> allgather_strings(Comm& c, const std::string& mine, const std::string& what) {
  const Group all = world_group(c);
  // The longest string sizes every slot (a max through a sum: each rank adds its own bit).
  std::vector<double> sizes(std::size_t(c.size()), 0.0);
  sizes[std::size_t(c.rank())] = double(mine.size());
  allreduce_sum(c, sizes, all, what);
  std::size_t slot = 0;
  for (double s : sizes) slot = std::max(slot, std::size_t(s));
  std::vector<char> buf(slot * std::size_t(c.size()) + 1, '\0');
  std::memcpy(buf.data() + slot * std::size_t(c.rank()), mine.data(), mine.size());
  wait(c, c.iallgather_bytes(buf.data(), i64(slot), all), what);
  std::vector<std::string> out;
  for (int r = 0; r < c.size(); ++r)
    out.emplace_back(buf.data() + slot * std::size_t(r), std::size_t(sizes[std::size_t(r)]));
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
