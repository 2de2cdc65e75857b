#include "runtime/staged_comm.h"

#include <cstdlib>
#include <cstring>

#include "core/check.h"
#include "core/layout.h"

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
  if (op.device && bytes > 0) {
    op.staging = be_.host_alloc(bytes);
    SPPO_CHECK(op.staging != nullptr, "comm") << "rank " << rank() << ": no pinned host memory left for a "
                                              << bytes << "-byte message staged through the host";
    for (const auto& c : op.out) {
      op.copies_out.push_back(out_stream_->copy(static_cast<char*>(op.staging) + c.at,
                                                static_cast<const char*>(op.device) + c.at, c.bytes, nullptr));
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
      op.host = op.start(op.staging ? op.staging : op.device);
      op.started = true;
    }
    in_order = in_order && op.started;
    if (op.started && !op.copied_in && host_.test(op.host)) {
      for (const auto& c : op.in) {
        op.copies_in.push_back(in_stream_->copy(static_cast<char*>(op.device) + c.at,
                                                static_cast<const char*>(op.staging) + c.at, c.bytes, nullptr));
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
  if (staged(data)) {
    op.device = const_cast<void*>(data);
    op.out.push_back({0, std::size_t(bytes)});
  }
  op.start = [this, bytes, peer, tag, data](void* staging) {
    return host_.isend(staging ? staging : data, bytes, peer, tag);
  };
  return post(std::move(op));
}

comm::Request StagedComm::irecv(void* data, i64 bytes, int peer, int tag) {
  Op op;
  if (staged(data)) {
    op.device = data;
    op.in.push_back({0, std::size_t(bytes)});
  }
  op.start = [this, bytes, peer, tag, data](void* staging) {
    return host_.irecv(staging ? staging : data, bytes, peer, tag);
  };
  return post(std::move(op));
}

namespace {

int index_in(const comm::Group& g, int rank) {
  for (std::size_t k = 0; k < g.size(); ++k)
    if (g[k] == rank) return int(k);
  SPPO_ASSERT_MSG(false, "rank " << rank << " is not in the group of its collective");
  return -1;
}

}  // namespace

comm::Request StagedComm::iallreduce(float* data, i64 count, const comm::Group& group) {
  Op op;
  if (staged(data)) {
    op.device = data;
    op.out.push_back({0, std::size_t(count) * sizeof(float)});
    op.in = op.out;
  }
  op.start = [this, count, group, data](void* buf) {
    return host_.iallreduce(buf ? static_cast<float*>(buf) : data, count, group);
  };
  return post(std::move(op));
}

comm::Request StagedComm::iallreduce(double* data, i64 count, const comm::Group& group) {
  Op op;
  if (staged(data)) {
    op.device = data;
    op.out.push_back({0, std::size_t(count) * sizeof(double)});
    op.in = op.out;
  }
  op.start = [this, count, group, data](void* buf) {
    return host_.iallreduce(buf ? static_cast<double*>(buf) : data, count, group);
  };
  return post(std::move(op));
}

comm::Request StagedComm::ireduce_scatter(float* data, i64 count, const comm::Group& group) {
  Op op;
  if (staged(data)) {
    // Every piece goes out; only this member's comes back (the rest is then unspecified).
    const auto [b, e] = piece_range(count, index_in(group, rank()), int(group.size()));
    op.device = data;
    op.out.push_back({0, std::size_t(count) * sizeof(float)});
    op.in.push_back({std::size_t(b) * sizeof(float), std::size_t(e - b) * sizeof(float)});
  }
  op.start = [this, count, group, data](void* buf) {
    return host_.ireduce_scatter(buf ? static_cast<float*>(buf) : data, count, group);
  };
  return post(std::move(op));
}

comm::Request StagedComm::iallgather(float* data, i64 count, const comm::Group& group) {
  Op op;
  if (staged(data)) {
    // This member's piece goes out; every piece comes back.
    const auto [b, e] = piece_range(count, index_in(group, rank()), int(group.size()));
    op.device = data;
    op.out.push_back({std::size_t(b) * sizeof(float), std::size_t(e - b) * sizeof(float)});
    op.in.push_back({0, std::size_t(count) * sizeof(float)});
  }
  op.start = [this, count, group, data](void* buf) {
    return host_.iallgather(buf ? static_cast<float*>(buf) : data, count, group);
  };
  return post(std::move(op));
}

comm::Request StagedComm::ibroadcast(void* data, i64 bytes, int root, const comm::Group& group) {
  Op op;
  if (staged(data)) {
    op.device = data;
    if (rank() == root) op.out.push_back({0, std::size_t(bytes)});
    else op.in.push_back({0, std::size_t(bytes)});
  }
  op.start = [this, bytes, root, group, data](void* buf) { return host_.ibroadcast(buf ? buf : data, bytes, root, group); };
  return post(std::move(op));
}

comm::Request StagedComm::iallgather_bytes(void* data, i64 bytes, const comm::Group& group) {
  Op op;
  if (staged(data)) {
    const std::size_t slot = std::size_t(bytes), k = std::size_t(index_in(group, rank()));
    op.device = data;
    op.out.push_back({k * slot, slot});
    op.in.push_back({0, slot * group.size()});
  }
  op.start = [this, bytes, group, data](void* buf) { return host_.iallgather_bytes(buf ? buf : data, bytes, group); };
  return post(std::move(op));
}

}  // namespace sppo
