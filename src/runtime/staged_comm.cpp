#include "runtime/staged_comm.h"

#include <cstdlib>
#include <cstring>

#include "core/check.h"

namespace sppo {

StagedComm::StagedComm(comm::Comm& host, Backend& be, bool stage_all)
    : host_(host), be_(be), stage_all_(stage_all), out_stream_(be.make_copy_stream()),
      in_stream_(be.make_copy_stream()) {
  set_timeout_s(host.timeout_s());
}

StagedComm::~StagedComm() {
  // Nothing may be in flight at the end (every caller waits for its requests); the staging
  // buffers of any that were abandoned go back once their copies have.
  out_stream_->synchronize();
  in_stream_->synchronize();
  for (auto& [r, op] : ops_)
    if (op.staging) be_.host_free(op.staging);
}

bool StagedComm::done(const std::vector<std::shared_ptr<Event>>& events) {
  for (const auto& e : events)
    if (!e->done()) return false;
  return true;
}

comm::Request StagedComm::post(Op op) {
  std::size_t bytes = 0;
  for (const auto& c : op.out) bytes = std::max(bytes, c.at + c.bytes);
  for (const auto& c : op.in) bytes = std::max(bytes, c.at + c.bytes);
  if (bytes > 0) {
    op.staging = be_.host_alloc(bytes);
    SPPO_CHECK(op.staging != nullptr, "comm") << "rank " << rank() << ": no pinned host memory left for a "
                                              << bytes << "-byte message staged through the host";
    for (const auto& c : op.out) {
      if (c.bytes == 0) continue;
      op.copies_out.push_back(out_stream_->copy(static_cast<char*>(op.staging) + c.at, c.device, c.bytes, nullptr));
      staged_out_ += i64(c.bytes);
    }
  }
  const comm::Request r = next_++;
  ops_.emplace_back(r, std::move(op));
  advance();
  return r;
}

void StagedComm::advance() {
  host_.progress();
  bool in_order = true;  // every earlier operation's host part has started
  for (auto it = ops_.begin(); it != ops_.end();) {
    auto& [r, op] = *it;
    if (!op.started && in_order && done(op.copies_out)) {
      op.host = op.start(static_cast<char*>(op.staging));
      op.started = true;
    }
    in_order = in_order && op.started;
    if (op.started && !op.copied_in && host_.test(op.host)) {
      for (const auto& c : op.in) {
        if (c.bytes == 0) continue;
        op.copies_in.push_back(
            in_stream_->copy(c.device, static_cast<const char*>(op.staging) + c.at, c.bytes, nullptr));
        staged_in_ += i64(c.bytes);
      }
      op.copied_in = true;
    }
    if (op.copied_in && done(op.copies_in)) {
      if (op.staging) be_.host_free(op.staging);
      finished_.insert(r);
      it = ops_.erase(it);
      continue;
    }
    ++it;
  }
}

bool StagedComm::test(comm::Request r) {
  if (r == comm::kDone) return true;
  if (finished_.erase(r)) return true;
  advance();
  return finished_.erase(r) > 0;
}

void StagedComm::progress() { advance(); }

void StagedComm::abort(const std::string& message, int code) {
  host_.abort(message, code);
  std::_Exit(code);
}

comm::Request StagedComm::isend(const void* data, i64 bytes, int peer, int tag) {
  count_sent(bytes);
  Op op;
  if (staged(data)) op.out.push_back({const_cast<void*>(data), 0, std::size_t(bytes)});
  op.start = [this, bytes, peer, tag, data](char* staging) {
    return host_.isend(staging ? staging : data, bytes, peer, tag);
  };
  return post(std::move(op));
}

comm::Request StagedComm::irecv(void* data, i64 bytes, int peer, int tag) {
  Op op;
  if (staged(data)) op.in.push_back({data, 0, std::size_t(bytes)});
  op.start = [this, bytes, peer, tag, data](char* staging) {
    return host_.irecv(staging ? staging : data, bytes, peer, tag);
  };
  return post(std::move(op));
}

// The collectives check their arguments here, where the caller's pointers are, before any
// copy; the host's communicator checks the staged ones again.

comm::Request StagedComm::iallreduce(void* data, i64 count, comm::Type type, const comm::Group& group) {
  comm::check_member(*this, group, "all-reduce");
  SPPO_CHECK(count >= 0, "comm") << "rank " << rank() << ": all-reduce of " << count << " elements";
  Op op;
  if (staged(data)) {
    op.out.push_back({data, 0, std::size_t(count * comm::type_bytes(type))});
    op.in = op.out;
  }
  op.start = [this, count, type, group, data](char* buf) {
    return host_.iallreduce(buf ? buf : data, count, type, group);
  };
  return post(std::move(op));
}

comm::Request StagedComm::ireduce_scatter(const void* send, void* recv, const comm::Counts& counts, comm::Type type,
                                          const comm::Group& group) {
  const comm::OwnBlock own = comm::check_reduce_scatter(*this, send, recv, counts, type, group);
  const std::size_t e = std::size_t(comm::type_bytes(type)), all = std::size_t(comm::total(counts)) * e,
                    mine = std::size_t(counts[std::size_t(own.index)]) * e, at = std::size_t(own.offset) * e;
  char* s = const_cast<char*>(static_cast<const char*>(send));
  Op op;
  if (own.in_place) {
    // Every block goes out; only this member's comes back (the rest is then unspecified).
    const bool st = staged(send);
    if (st) {
      op.out.push_back({s, 0, all});
      op.in.push_back({recv, at, mine});
    }
    op.start = [this, st, s, at, counts, type, group](char* buf) {
      char* base = st && buf ? buf : s;
      return host_.ireduce_scatter(base, base + at, counts, type, group);
    };
    return post(std::move(op));
  }
  const bool ss = staged(send), rs = staged(recv);
  const std::size_t recv_at = ss ? all : 0;
  if (ss) op.out.push_back({s, 0, all});
  if (rs) op.in.push_back({recv, recv_at, mine});
  op.start = [this, ss, rs, s, recv, recv_at, counts, type, group](char* buf) {
    return host_.ireduce_scatter(ss && buf ? buf : s, rs && buf ? buf + recv_at : recv, counts, type, group);
  };
  return post(std::move(op));
}

comm::Request StagedComm::iallgather(const void* send, void* recv, const comm::Counts& counts, comm::Type type,
                                     const comm::Group& group) {
  const comm::OwnBlock own = comm::check_allgather(*this, send, recv, counts, type, group);
  const std::size_t e = std::size_t(comm::type_bytes(type)), all = std::size_t(comm::total(counts)) * e,
                    mine = std::size_t(counts[std::size_t(own.index)]) * e, at = std::size_t(own.offset) * e;
  char* s = const_cast<char*>(static_cast<const char*>(send));
  char* r = static_cast<char*>(recv);
  Op op;
  if (own.in_place) {
    // This member's block goes out; every block comes back.
    const bool st = staged(recv);
    if (st) {
      op.out.push_back({s, at, mine});
      op.in.push_back({r, 0, all});
    }
    op.start = [this, st, r, at, counts, type, group](char* buf) {
      char* base = st && buf ? buf : r;
      return host_.iallgather(base + at, base, counts, type, group);
    };
    return post(std::move(op));
  }
  const bool ss = staged(send), rs = staged(recv);
  const std::size_t recv_at = ss ? mine : 0;
  if (ss) op.out.push_back({s, 0, mine});
  if (rs) op.in.push_back({r, recv_at, all});
  op.start = [this, ss, rs, s, r, recv_at, counts, type, group](char* buf) {
    return host_.iallgather(ss && buf ? buf : s, rs && buf ? buf + recv_at : r, counts, type, group);
  };
  return post(std::move(op));
}

comm::Request StagedComm::ialltoall(const void* send, const comm::Counts& send_counts, void* recv,
                                    const comm::Counts& recv_counts, comm::Type type, const comm::Group& group) {
  const int k = comm::check_alltoall(*this, send, send_counts, recv, recv_counts, type, group);
  count_sent(comm::alltoall_sent_bytes(send_counts, type, k));
  const std::size_t e = std::size_t(comm::type_bytes(type)), out = std::size_t(comm::total(send_counts)) * e,
                    in = std::size_t(comm::total(recv_counts)) * e;
  char* s = const_cast<char*>(static_cast<const char*>(send));
  char* r = static_cast<char*>(recv);
  const bool ss = staged(send), rs = staged(recv);
  const std::size_t recv_at = ss ? out : 0;
  Op op;
  if (ss) op.out.push_back({s, 0, out});
  if (rs) op.in.push_back({r, recv_at, in});
  op.start = [this, ss, rs, s, r, recv_at, send_counts, recv_counts, type, group](char* buf) {
    return host_.ialltoall(ss && buf ? buf : s, send_counts, rs && buf ? buf + recv_at : r, recv_counts, type, group);
  };
  return post(std::move(op));
}

comm::Request StagedComm::ibroadcast(void* data, i64 count, comm::Type type, int root, const comm::Group& group) {
  comm::check_root(*this, group, root, "broadcast");
  SPPO_CHECK(count >= 0, "comm") << "rank " << rank() << ": broadcast of " << count << " elements";
  Op op;
  if (staged(data)) {
    const std::size_t bytes = std::size_t(count * comm::type_bytes(type));
    if (rank() == root) op.out.push_back({data, 0, bytes});
    else op.in.push_back({data, 0, bytes});
  }
  op.start = [this, count, type, root, group, data](char* buf) {
    return host_.ibroadcast(buf ? buf : data, count, type, root, group);
  };
  return post(std::move(op));
}

}  // namespace sppo
