#include "runtime/stage_messages.h"

#include <algorithm>

#include "core/check.h"
#include "runtime/fault.h"
#include "runtime/op_rows.h"

namespace sppo {

namespace {

// The row of rows `q` that holds global position `pos`, and how many rows from it on stay
// consecutive positions (to the end of its span).
std::pair<i64, i64> row_at(const Subseq& q, i64 pos) {
  if (q.spans.empty()) {
    SPPO_ASSERT(pos >= q.offset && pos < q.offset + q.T);
    return {pos - q.offset, q.offset + q.T - pos};
  }
  for (const PosSpan& s : q.spans)
    if (pos >= s.pos0 && pos < s.pos0 + s.rows) return {s.row0 + (pos - s.pos0), s.pos0 + s.rows - pos};
  SPPO_ASSERT_MSG(false, "position " << pos << " is not in the rows");
  return {0, 0};
}

// q's rows as runs of consecutive positions.
std::vector<PosSpan> runs_of(const Subseq& q) {
  return q.spans.empty() ? std::vector<PosSpan>{PosSpan{q.offset, q.T, 0}} : q.spans;
}

// Whether rows p and q share a position.
bool share(const Subseq& p, const Subseq& q) {
  for (const PosSpan& a : runs_of(p))
    for (const PosSpan& c : runs_of(q))
      if (std::min(a.pos0 + a.rows, c.pos0 + c.rows) > std::max(a.pos0, c.pos0)) return true;
  return false;
}

}  // namespace

StageMessages::StageMessages(comm::Comm* comm, int rank, Backend& be, MemoryTier& device, const ModelConfig& c,
                             const sched::Schedule& sc, const std::vector<sched::Op>& ops, int& sent,
                             StepResult& result)
    : comm_(comm),
      rank_(rank),
      be_(be),
      device_(device),
      config_(c),
      act_(be.act()),
      sched_(sc),
      ops_(ops),
      sent_(sent),
      result_(result) {
  // Outputs of this rank's F/B ops, and the rows of them it holds (its tensor-parallel or
  // Ulysses member's).
  std::map<HiddenKey, Subseq> made_here;
  for (const sched::Op& op : ops) {
    if (is_compute(op)) {
      // Under MSP a piece may take rows that this rank produced for it (Note [MSP pieces]).
      auto made = made_here.find(sched::input_id(op));
      if (sched::has_input(op, c.layers) && made != made_here.end()) {
        if (share(made->second, member_rows(sc, op, rank))) taken_here_.insert(made->first);
      }
      made_here[sched::output_id(op)] = member_rows(sc, op, rank);
    }
    if (sched::is_hidden_message(op) && op.kind == sched::OpKind::Send) ++sends_of_[sched::hidden_id(op)];
  }
  // Receives are posted as the compute op before them starts (schedule/memory.h).
  posts_.assign(ops.size(), {});
  std::size_t post = 0;
  for (std::size_t k = 0; k < ops.size(); ++k) {
    if (is_compute(ops[k])) post = k;
    if (ops[k].kind == sched::OpKind::Recv && sched::is_hidden_message(ops[k])) posts_[post].push_back(k);
  }
}

StageMessages::~StageMessages() = default;

void StageMessages::post_receives(std::size_t k) {
  for (std::size_t j : posts_[k]) post_receive(j);
}

void StageMessages::post_receive(std::size_t index) {
  const sched::Op& op = ops_[index];
  const int i = op.subseq;
  Incoming in;
  in.op = index;
  in.first = op.first;
  in.tokens = op.tokens > 0 ? op.tokens : sched_.lengths[i];
  const i64 bytes = in.tokens * config_.hidden * dtype_bytes(act_);
  in.buf = device_.alloc(bytes, "received " + std::string(sched::to_string(op.payload)) + " of subseq " +
                                    std::to_string(i));
  in.req = comm_->irecv(in.buf.data(), bytes, op.peer, sched::message_tag(op));
  incoming_[sched::hidden_id(op)].push_back(std::move(in));
}

double StageMessages::wait_receive(std::size_t k) {
  const sched::Op& op = ops_[k];
  auto& parts = incoming_[sched::hidden_id(op)];
  auto part = std::find_if(parts.begin(), parts.end(), [k](const Incoming& in) { return in.op == k; });
  SPPO_ASSERT(part != parts.end());
  const double waited = comm::wait(*comm_, part->req, "op " + std::to_string(k) + " '" + sched::to_string(op) + "'");
  part->req = comm::kDone;
  return waited;
}


void StageMessages::produce(const HiddenKey& key, Buffer buf, const Subseq& rows) {
  const int sends = sends_of_.count(key) ? sends_of_.at(key) : 0;
  const bool local = taken_here_.count(key) > 0;
  if (sends == 0 && !local) return;  // nobody takes it (a helper's rows that stay with their stage)
  Produced& p = produced_[key];
  SPPO_ASSERT_MSG(!p.buf, "a second output for one hidden state of subseq " << std::get<2>(key));
  p.buf = std::make_shared<Buffer>(std::move(buf));
  p.rows = rows;
  p.sends_left = sends;
  p.local = local;
}

Buffer StageMessages::take_input(const HiddenKey& key, const Subseq& q) {
  const i64 row_bytes = i64(config_.hidden) * dtype_bytes(act_);
  auto it = incoming_.find(key);
  std::vector<Incoming> parts;
  if (it != incoming_.end()) {
    parts = std::move(it->second);
    incoming_.erase(it);
  }
  auto mine = produced_.find(key);
  const bool local = mine != produced_.end() && mine->second.local;
  // One message of the whole piece (under tensor parallelism, of this member's rows of it).
  if (!local && parts.size() == 1 && (parts[0].first < 0 || parts[0].tokens == q.T)) return std::move(parts[0].buf);
  // Pieces that split the subsequence differently (MSP, beside a zigzag ring's two-span
  // pieces): one [T, H] in q's row order from the received parts, each a run of consecutive
  // positions, and the rows this rank produced itself.
  const i64 base = sched_.offset(std::get<2>(key));  // parts' positions are in the subsequence
  Buffer whole = device_.alloc(i64(q.T) * row_bytes, "hidden state assembled from parts");
  i64 filled = 0;
  for (const auto& part : parts) {
    const auto [row, run] = row_at(q, base + part.first);
    SPPO_ASSERT(part.first >= 0 && part.tokens <= run);
    be_.copy_cols(act_at(whole.data(), row * config_.hidden, act_), part.buf.data(), int(part.tokens),
                  config_.hidden, config_.hidden, 0);
    filled += part.tokens;
  }
  if (local) {
    const Subseq& p = mine->second.rows;
    for (const PosSpan& a : runs_of(p))
      for (const PosSpan& c : runs_of(q)) {
        const i64 b = std::max(a.pos0, c.pos0), e = std::min(a.pos0 + a.rows, c.pos0 + c.rows);
        if (e <= b) continue;
        be_.copy_cols(act_at(whole.data(), (c.row0 + (b - c.pos0)) * config_.hidden, act_),
                      act_at(mine->second.buf->data(), (a.row0 + (b - a.pos0)) * config_.hidden, act_), int(e - b),
                      config_.hidden, config_.hidden, 0);
        filled += e - b;
      }
    mine->second.local = false;
    if (mine->second.sends_left == 0) produced_.erase(mine);
  }
  SPPO_ASSERT_MSG(filled == q.T, "the parts of a hidden state cover " << filled << " of its " << q.T << " rows");
  return whole;
}

void StageMessages::send(const sched::Op& op) {
  auto it = produced_.find(sched::hidden_id(op));
  SPPO_ASSERT_MSG(it != produced_.end() && it->second.sends_left > 0,
                  "send of " << sched::to_string(op) << " before its data was computed");
  Produced& p = it->second;
  const std::shared_ptr<Buffer> buf = p.buf;
  const Subseq rows = p.rows;
  if (--p.sends_left == 0 && !p.local) produced_.erase(it);
  const FaultPlan& fault = fault_plan();
  if (fault.kind == FaultPlan::Kind::Drop && fault.rank == rank_ && ++sent_ == fault.count)
    return;  // the message that never arrives
  const i64 row_bytes = i64(config_.hidden) * dtype_bytes(act_);
  const void* data = buf->data();
  i64 bytes = buf->bytes();
  if (op.first >= 0) {  // part of this rank's rows: a run of consecutive positions
    const auto [row, run] = row_at(rows, sched_.offset(op.subseq) + op.first);
    SPPO_ASSERT(op.tokens <= run);
    data = act_at(buf->data(), row * config_.hidden, act_);
    bytes = op.tokens * row_bytes;
  }
  SPPO_ASSERT(op.tokens == 0 || bytes == op.tokens * row_bytes);
  start_send(buf, data, bytes, op);
  // Note [Forward-only steps]: nothing holds a stage back but the next stage, so its hidden
  // states would pile up in sends the next stage has not yet taken, as many as its lag;
  // each goes before the next F instead, at a point of the program, as the memory rules say.
  if (sched_.forward_only)
    while (!sends_.empty()) finish_oldest("before the next forward");
}

void StageMessages::start_send(std::shared_ptr<Buffer> keep, const void* data, i64 bytes, const sched::Op& op) {
  sends_.push_back({std::move(keep), comm_->isend(data, bytes, op.peer, sched::message_tag(op)), now_s(),
                    sched::to_string(op)});
}

void StageMessages::send_now(const void* data, i64 bytes, const sched::Op& op) {
  const double start = now_s();
  const std::string name = sched::to_string(op);
  comm::wait(*comm_, comm_->isend(data, bytes, op.peer, sched::message_tag(op)), "the send '" + name + "'");
  add_span(result_, name, sched::OpKind::Send, Lane::Network, start, now_s());
}

void StageMessages::poll() {
  if (!comm_) return;
  comm_->progress();
  for (auto it = sends_.begin(); it != sends_.end();) {
    if (comm_->test(it->req)) {
      add_span(result_, it->name, sched::OpKind::Send, Lane::Network, it->start, now_s());
      it = sends_.erase(it);  // the buffer is released here, as the send has completed
    } else {
      ++it;
    }
  }
}

void StageMessages::finish_oldest(const std::string& why) {
  comm::wait(*comm_, sends_.front().req, "the send '" + sends_.front().name + "' " + why);
  sends_.front().req = comm::kDone;
  poll();
}

bool StageMessages::reclaim() {
  if (sends_.empty()) return false;
  finish_oldest("to free its memory");
  return true;
}

void StageMessages::drain() {
  while (!sends_.empty()) finish_oldest("at the end of the step");
}

void StageMessages::check_empty() const {
  SPPO_ASSERT_MSG(incoming_.empty() && produced_.empty(), "a hidden-state buffer is left over after the step");
}

}  // namespace sppo
