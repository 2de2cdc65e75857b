// The simulator: a discrete-event executor of the schedule IR on the cost model
// (DESIGN.md 7). Every device has four resources, each a timeline: compute, copy-out
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
// Memory events come from schedule/memory.h (the runtime's rules) at their time inside
// each op; the peak per rank is taken over the time-ordered events.
#pragma once

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

struct SimResult {
  double step_time_s = 0;
  double tokens_per_device_per_s = 0;
  double bubble_ratio = 0;       // mean over ranks of idle compute time / busy compute time
  double exposed_copy_s = 0;     // max over ranks of compute time spent waiting on copies
  double compute_s = 0;          // max over ranks of busy compute time
  std::vector<i64> peak_bytes;   // per rank
  i64 peak_device_bytes = 0;     // max over ranks
  i64 peak_host_bytes = 0;       // max over ranks of offloaded bytes held on the host
  std::vector<i64> fixed_bytes;  // per rank: weights, gradients, optimizer state
  std::vector<TraceEvent> events;                            // with record
  std::vector<std::vector<std::pair<double, i64>>> memory;   // with record: per rank (t, bytes)
  std::vector<std::string> names;  // per rank, as traces label it (empty: "device r")
};

// Throws sppo::Error when the schedule deadlocks.
SimResult simulate(const sched::Schedule& s, const CostModel& cost, const sched::MemoryRules& rules,
                   const SimOptions& options = {});

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
