#include "sim/simulator.h"

#include <algorithm>
#include <deque>
#include <map>
#include <tuple>

#include "core/check.h"

namespace sppo::sim {

using sched::Op;
using sched::OpKind;
using sched::Payload;
using sched::Schedule;

namespace {

struct MemPoint {
  double t;
  i64 seq;
  i64 delta;
};

struct RankState {
  explicit RankState(const sched::MemoryRules& rules, const Schedule& s, int r) : mem(rules, s, r) {}
  size_t pc = 0;
  double t_compute = 0, t_out = 0, t_in = 0, t_net = 0;
  double busy = 0, exposed = 0;
  double ring_ready = 0;     // latest arrival of the ring steps before the next F/B
  int ring_steps = 0;        // ring steps since the last F/B
  bool posted = false;       // the current ring step's send, or all-reduce arrival, is out
  std::map<int, double> off_end, pre_end;
  sched::RankMemory mem;
  std::vector<MemPoint> points;
  std::vector<sched::MemEvent> ev;
};

bool take(std::deque<std::pair<sched::MessageKey, double>>& q, const sched::MessageKey& key, double* arrival) {
  for (auto it = q.begin(); it != q.end(); ++it)
    if (it->first == key) {
      *arrival = it->second;
      q.erase(it);
      return true;
    }
  return false;
}

}  // namespace

SimResult simulate(const Schedule& s, const CostModel& cost, const sched::MemoryRules& rules,
                   const SimOptions& options) {
  SPPO_CHECK(int(s.ops.size()) == s.ranks, "sim") << "schedule has " << s.ops.size()
                                                  << " op lists for " << s.ranks << " ranks";
  const int R = s.ranks;
  std::vector<RankState> st;
  st.reserve(R);
  for (int r = 0; r < R; ++r) st.emplace_back(rules, s, r);
  std::map<std::pair<int, int>, std::deque<std::pair<sched::MessageKey, double>>> channel;  // (src, dst)
  std::map<std::pair<std::vector<int>, int>, std::vector<double>> arrived;
  std::map<std::pair<std::vector<int>, int>, double> reduced;  // all-reduce end times
  std::vector<std::map<std::vector<int>, int>> passed(R);
  SimResult res;
  i64 seq = 0;
  std::vector<i64> offsets(s.lengths.size() + 1, 0);
  for (size_t i = 0; i < s.lengths.size(); ++i) offsets[i + 1] = offsets[i] + s.lengths[i];

  auto record = [&](int r, Lane lane, const Op& op, double start, double end) {
    if (options.record && end > start) res.events.push_back({r, lane, op.kind, to_string(op), start, end - start});
  };
  auto mem_at = [&](RankState& rs, const Op& op, double start, double end) {
    rs.ev.clear();
    rs.mem.events(op, &rs.ev);
    for (const auto& e : rs.ev) rs.points.push_back({start + e.at * (end - start), seq++, e.delta});
  };

  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < R; ++r) {
      RankState& rs = st[r];
      const auto& ops = s.ops[r];
      while (rs.pc < ops.size()) {
        const Op& op = ops[rs.pc];
        switch (op.kind) {
          case OpKind::Forward:
          case OpKind::Backward: {
            const i64 o = offsets[op.subseq];
            const double dur = op.kind == OpKind::Forward ? cost.forward_s(op, s, o) : cost.backward_s(op, s, o);
            const double start = rs.t_compute;
            double end = start + dur;
            if (rs.ring_steps > 0) {
              // The last ring block's attention follows its arrival.
              const int n = std::max(1, op.layer_end - op.layer_begin);
              end = std::max(end, rs.ring_ready + dur / double((rs.ring_steps + 1) * n));
            }
            rs.ring_ready = 0;
            rs.ring_steps = 0;
            rs.busy += dur;
            rs.t_compute = end;
            record(r, Lane::Compute, op, start, end);
            mem_at(rs, op, start, end);
            break;
          }
          case OpKind::Offload: {
            rs.ev.clear();
            const i64 bytes = rs.mem.offload_bytes(op);
            const double start = std::max(rs.t_out, rs.t_compute);
            const double end = start + cost.d2h_s(bytes, rs.t_in > start);
            rs.t_out = end;
            rs.off_end[op.subseq] = end;
            record(r, Lane::CopyOut, op, start, end);
            mem_at(rs, op, start, end);
            res.peak_host_bytes = std::max(res.peak_host_bytes, rs.mem.host_bytes());
            break;
          }
          case OpKind::Prefetch: {
            const i64 bytes = rs.mem.prefetch_bytes(op);
            const double start = std::max(rs.t_in, rs.t_compute);
            const double end = start + cost.h2d_s(bytes, rs.t_out > start);
            rs.t_in = end;
            rs.pre_end[op.subseq] = end;
            record(r, Lane::CopyIn, op, start, end);
            mem_at(rs, op, start, end);
            break;
          }
          case OpKind::WaitOffload:
          case OpKind::WaitPrefetch: {
            const double done = (op.kind == OpKind::WaitOffload ? rs.off_end : rs.pre_end)[op.subseq];
            if (done > rs.t_compute) {
              rs.exposed += done - rs.t_compute;
              rs.t_compute = done;
            }
            mem_at(rs, op, rs.t_compute, rs.t_compute);
            break;
          }
          case OpKind::Send: {
            const double start = std::max(rs.t_net, rs.t_compute);
            const double end = start + cost.message_s(cost.message_bytes(op, s), r, op.peer);
            rs.t_net = end;
            channel[{r, op.peer}].push_back({sched::message_key(op), end});
            record(r, Lane::Network, op, start, end);
            mem_at(rs, op, start, end);
            break;
          }
          case OpKind::Recv: {
            double arrival = 0;
            if (!take(channel[{op.peer, r}], sched::message_key(op), &arrival)) goto blocked;
            mem_at(rs, op, std::max(rs.t_compute, arrival), std::max(rs.t_compute, arrival));
            rs.t_compute = std::max(rs.t_compute, arrival);
            break;
          }
          case OpKind::RingStep: {
            if (!rs.posted) {
              const double start = std::max(rs.t_net, rs.t_compute);
              const double end = start + cost.message_s(cost.message_bytes(op, s), r, op.peer);
              rs.t_net = end;
              channel[{r, op.peer}].push_back({sched::message_key(op), end});
              record(r, Lane::Network, op, start, end);
              rs.posted = true;
              progress = true;
            }
            double arrival = 0;
            if (!take(channel[{op.recv_peer, r}], sched::message_key(op), &arrival)) goto blocked;
            rs.ring_ready = std::max({rs.ring_ready, arrival, rs.t_net});
            ++rs.ring_steps;
            rs.posted = false;
            mem_at(rs, op, arrival, arrival);
            break;
          }
          case OpKind::AllReduce: {
            const auto key = std::make_pair(op.group, passed[r][op.group]);
            auto& there = arrived[key];
            if (!rs.posted) {
              there.push_back(std::max(rs.t_compute, rs.t_net));
              rs.posted = true;
              progress = true;
            }
            if (there.size() < op.group.size()) goto blocked;
            auto it = reduced.find(key);
            if (it == reduced.end()) {
              const double start = *std::max_element(there.begin(), there.end());
              const i64 bytes = sched::allreduce_bytes(op, cost.model(), s.layers);
              it = reduced.emplace(key, start + cost.allreduce_s(bytes, op.group)).first;
            }
            const double start = std::max(rs.t_compute, rs.t_net);
            record(r, Lane::Network, op, start, it->second);
            rs.t_compute = rs.t_net = std::max(start, it->second);
            mem_at(rs, op, start, rs.t_compute);
            rs.posted = false;
            ++passed[r][op.group];
            break;
          }
        }
        ++rs.pc;
        progress = true;
      }
    blocked:;
    }
  }
  for (int r = 0; r < R; ++r)
    SPPO_CHECK(st[r].pc == s.ops[r].size(), "sim")
        << "rank " << r << " is blocked forever at op " << st[r].pc << " '" << to_string(s.ops[r][st[r].pc])
        << "': the schedule deadlocks (run the validator)";

  double step = 0;
  for (const auto& rs : st) step = std::max({step, rs.t_compute, rs.t_out, rs.t_in, rs.t_net});
  res.step_time_s = step;
  res.peak_bytes.assign(R, 0);
  res.fixed_bytes.assign(R, 0);
  if (options.record) res.memory.resize(R);
  double bubble_sum = 0;
  int busy_ranks = 0;
  for (int r = 0; r < R; ++r) {
    RankState& rs = st[r];
    std::sort(rs.points.begin(), rs.points.end(),
              [](const MemPoint& a, const MemPoint& b) { return std::tie(a.t, a.seq) < std::tie(b.t, b.seq); });
    i64 cur = rs.mem.fixed_bytes(), peak = cur;
    res.fixed_bytes[r] = cur;
    if (options.record) res.memory[r].push_back({0.0, cur});
    for (const auto& p : rs.points) {
      cur += p.delta;
      peak = std::max(peak, cur);
      if (options.record) res.memory[r].push_back({p.t, cur});
    }
    res.peak_bytes[r] = peak;
    res.peak_device_bytes = std::max(res.peak_device_bytes, peak);
    res.exposed_copy_s = std::max(res.exposed_copy_s, rs.exposed);
    res.compute_s = std::max(res.compute_s, rs.busy);
    if (rs.busy > 0) {
      bubble_sum += (step - rs.busy) / rs.busy;
      ++busy_ranks;
    }
  }
  res.bubble_ratio = busy_ranks ? bubble_sum / busy_ranks : 0;
  if (step > 0) res.tokens_per_device_per_s = double(s.seq_len()) * s.replicas / (double(R) * step);
  return res;
}

}  // namespace sppo::sim
