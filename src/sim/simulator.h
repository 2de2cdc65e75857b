// The simulator: a discrete-event executor of the schedule IR on the cost model
// (docs/design.md 7). Every device has four resources, each a timeline: compute, copy-out
// (d2h), copy-in (h2d) and network. Ops are taken in each rank's program order:
//   F, B       run on compute when it is free; a ring-attention F/B ends no earlier than
//              its last ring step's arrival plus the attention of one block
//   O(i)       on copy-out once the compute issued before it is done (its data exists);
//              the device bytes are released when the copy ends
//   P(i)       on copy-in as soon as it is issued (it overlaps the next compute op)
//   WO, WP     hold the compute stream until the copy ends (the wait is "exposed copy")
//   Send       on the network once the compute before it is done; arrives after latency +
//              bytes / bandwidth. Recv holds compute until its message arrives.
//   RingStep   sends on the network when issued; the following F/B waits for its receive
//   AllReduce  starts when every member has arrived; holds every member until done
//   AllToAll   the same, for its Ulysses exchanges (CostModel::alltoall_s); its bytes count
//              as the rank's sent bytes
// Memory events come from schedule/memory.h (the runtime's rules) at their time inside
// each op; the peak per rank is taken over the time-ordered events, and the bytes of every
// term (schedule/memory.h MemTerm) at that moment are kept.
//
// Note [Shared host links]: a profile may say that several devices share a PCIe switch's
// uplink, a NUMA node's host memory or a NIC (planner/profile.h). The simulator prices a
// copy (or a message between nodes) at its own link's rate, records when each transfer
// ran, then replays the transfers of each node as fluid flows: at every moment each link's
// capacity is shared max-min fairly among the transfers crossing it, no transfer faster
// than its own link. Each transfer's duration is stretched by what that replay gives it,
// and the schedule is simulated again with the stretched durations, until the step time
// moves by less than 0.1% (at most kContentionPasses simulations). Without shared links,
// or without transfers that cross one, one simulation is all.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "schedule/ir.h"
#include "schedule/memory.h"
#include "planner/cost.h"

namespace sppo::sim {

using plan::CostModel;
using plan::HardwareProfile;

enum class Lane { Compute = 0, CopyOut = 1, CopyIn = 2, Network = 3 };

struct TraceEvent {
  int rank = 0;
  Lane lane = Lane::Compute;
  sched::OpKind kind = sched::OpKind::Forward;
  std::string name;
  double start = 0;  // s
  double dur = 0;    // s
};

struct SimOptions {
  bool record = false;  // keep trace events and the memory timeline (for trace/SVG output)
};

inline constexpr int kContentionPasses = 6;

struct SimResult {
  double step_time_s = 0;
  double tokens_per_device_per_s = 0;
  double bubble_ratio = 0;       // mean over ranks of idle compute time / busy compute time
  double exposed_copy_s = 0;     // max over ranks of compute time spent waiting on copies
  double compute_s = 0;          // max over ranks of busy compute time
  std::vector<i64> peak_bytes;   // per rank
  i64 peak_device_bytes = 0;     // max over ranks
  i64 peak_host_bytes = 0;       // max over ranks of the bytes held on the host (offloaded
                                 // copies, host K/V and their sums, the optimizer state)
  std::vector<i64> peak_host_per_rank;
  double host_update_s = 0;      // the host's optimizer update, in step_time_s (Note
                                 // [Pricing the host's update] in simulator.cpp); 0: none
  std::vector<i64> sent_bytes;   // per rank: bytes sent (Send, ring messages, Ulysses all-to-alls)
  std::vector<i64> collective_bytes;  // per rank: the weight collectives' buffers (sched::collective_bytes)
  std::vector<i64> fixed_bytes;  // per rank: weights, gradients, optimizer state
  // Per rank, at the moment of its peak: device bytes by term (they sum to peak_bytes),
  // bytes on the host, and the time.
  std::vector<std::array<i64, sched::kMemTerms>> peak_terms;
  std::vector<i64> host_at_peak;
  std::vector<double> peak_time_s;
  int peak_rank = 0;             // the rank whose peak is peak_device_bytes
  // Per rank and subsequence: when its last forward op there ends and its first backward
  // op there starts (-1: none on that rank). An offload of i completes by the end of
  // F(i+1) and its prefetch starts with B(i+1), so these say which units can be off the
  // device at a given moment.
  std::vector<std::vector<double>> forward_end, backward_start;
  int passes = 1;                // simulations run (more than one: shared links)
  double copy_slowdown = 1;      // host copies' total time, shared links over alone
  std::vector<TraceEvent> events;                            // with record
  std::vector<std::vector<std::pair<double, i64>>> memory;   // with record: per rank (t, bytes)
  std::vector<std::string> names;  // per rank, as traces label it (empty: "device r")
};

// Throws sppo::Error when the schedule deadlocks.
SimResult simulate(const sched::Schedule& s, const CostModel& cost, const sched::MemoryRules& rules,
                   const SimOptions& options = {});

// The same schedule simulated again as its Offload and Prefetch fractions change (the
// planner's alpha search): what does not depend on the fractions is worked out once
// (Note [Simulating again with other fractions] in simulator.cpp). simulate() equals
// sim::simulate(schedule(), cost, rules, options) after any set_fractions.
class Resimulator {
 public:
  Resimulator(sched::Schedule s, const CostModel& cost, const sched::MemoryRules& rules);
  ~Resimulator();
  Resimulator(Resimulator&&) noexcept;
  Resimulator& operator=(Resimulator&&) noexcept;

  const sched::Schedule& schedule() const;
  // sched::set_offload_fractions on the schedule: alpha must offload the same subsequences
  // as the schedule's own fractions.
  void set_fractions(const std::vector<double>& alpha);
  // Another schedule of the same layout in place of this one, offloading other
  // subsequences: what does not depend on the copies is kept (Note [Another set of
  // offloaded subsequences] in simulator.cpp), or, for any other schedule, worked out anew
  // (then false).
  bool replace(sched::Schedule s);
  SimResult simulate(const SimOptions& options = {}) const;
  // The least peak device bytes (of the fullest rank) any timing of the schedule reaches
  // (Note [A floor under the peak] in simulator.cpp): no more than simulate()'s, and a
  // small part of its cost.
  i64 peak_floor() const;

 private:
  struct State;
  std::unique_ptr<State> st_;
};

// Chrome trace JSON (chrome://tracing, Perfetto): one process per device, threads
// compute / copy-out / copy-in / network, complete events with ts and dur in microseconds,
// plus a "memory" counter per device.
std::string chrome_trace(const SimResult& r);
// An SVG timeline: one row per device with coloured blocks (forward, backward, offload,
// onload, communication), bubbles as gaps, and each device's memory beneath.
std::string svg_timeline(const SimResult& r, const std::string& title);

// Writes chrome_trace(r) to trace_path and svg_timeline(r, title) to svg_path, each when
// its path is not empty; throws sppo::Error naming a file that cannot be written.
void write_timelines(const SimResult& r, const std::string& trace_path, const std::string& svg_path,
                     const std::string& title);

}  // namespace sppo::sim
