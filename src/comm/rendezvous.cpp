#include "comm/rendezvous.h"

#include "core/check.h"

namespace sppo::comm {

Rendezvous::Notice Rendezvous::send(int peer, int tag, i64 bytes, Request r) {
  const std::int64_t seq = next_seq_[peer]++;
  sends_[{peer, seq}] = r;
  return Notice{tag, bytes, seq};
}

Request Rendezvous::granted(int peer, std::int64_t seq) {
  auto it = sends_.find({peer, seq});
  SPPO_ASSERT_MSG(it != sends_.end(), "a grant from rank " << peer << " for message " << seq << " never sent");
  const Request r = it->second;
  sends_.erase(it);
  return r;
}

std::optional<Rendezvous::Match> Rendezvous::receive(int peer, int tag, i64 bytes, Request r) {
  auto n = notices_.find({peer, tag});
  if (n == notices_.end() || n->second.empty()) {
    recvs_[{peer, tag}].push_back({r, bytes});
    return std::nullopt;
  }
  const Notice got = n->second.front();
  n->second.pop_front();
  if (n->second.empty()) notices_.erase(n);
  return Match{r, got.seq, got.bytes, bytes};
}

std::optional<Rendezvous::Match> Rendezvous::noticed(int peer, const Notice& got) {
  auto p = recvs_.find({peer, got.tag});
  if (p == recvs_.end() || p->second.empty()) {
    notices_[{peer, got.tag}].push_back(got);
    return std::nullopt;
  }
  const PostedRecv r = p->second.front();
  p->second.pop_front();
  if (p->second.empty()) recvs_.erase(p);
  return Match{r.r, got.seq, got.bytes, r.bytes};
}

std::size_t Rendezvous::waiting() const {
  std::size_t n = sends_.size();
  for (const auto& [k, q] : notices_) n += q.size();
  return n;
}

}  // namespace sppo::comm
