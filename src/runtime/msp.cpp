#include "runtime/msp.h"

#include <algorithm>
#include <memory>
#include <string>

#include "core/check.h"
#include "runtime/op_rows.h"
#include "schedule/memory.h"

namespace sppo {

MspExchange::MspExchange(comm::Comm* comm, Backend& be, MemoryTier& device, const ModelConfig& c, const TpShard& tp,
                         const sched::Schedule& sc, const std::vector<sched::Op>& ops, std::pair<int, int> layers,
                         OwnWeights own, KvStore& kv, StageMessages& messages, GradReduce& grads,
                         const Buffer& loss_sum, StepResult& result)
    : comm_(comm),
      be_(be),
      device_(device),
      config_(c),
      tp_(tp),
      act_(be.act()),
      sched_(sc),
      lb_(layers.first),
      le_(layers.second),
      own_(own),
      kv_(kv),
      messages_(messages),
      reduce_(grads),
      loss_sum_(loss_sum),
      result_(result) {
  std::map<std::pair<int, int>, std::vector<std::size_t>> leases;  // Recv Weights op indices by range
  for (std::size_t k = 0; k < ops.size(); ++k)
    if (ops[k].kind == sched::OpKind::Recv && ops[k].payload == sched::Payload::Weights)
      leases[{ops[k].layer_begin, ops[k].layer_end}].push_back(k);
  // A lease of borrowed weights that another of the same layers follows ends with the
  // last F/B on them before it (memory rules).
  for (const auto& [range, starts] : leases)
    for (std::size_t n = 0; n + 1 < starts.size(); ++n) {
      std::size_t last = starts[n];
      for (std::size_t k = starts[n]; k < starts[n + 1]; ++k)
        if (is_compute(ops[k]) && ops[k].layer_begin == range.first && ops[k].layer_end == range.second) last = k;
      lease_ends_[last] = range;
    }
}

StageWeights MspExchange::weights_for(const sched::Op& op) {
  if (lb_ <= op.layer_begin && op.layer_end <= le_) return own_.views;
  auto it = borrowed_.find({op.layer_begin, op.layer_end});
  SPPO_ASSERT_MSG(it != borrowed_.end() && it->second.w,
                  "'" << sched::to_string(op) << "' runs another stage's layers without their weights");
  Borrowed& b = it->second;
  // Their gradients from the first backward on them, or the first forward through the LM
  // head, which computes its gradients there (memory rules: BorrowedGrads).
  if (!b.g && (op.kind == sched::OpKind::Backward || op.layer_end == config_.layers)) {
    b.g = device_.alloc_zeroed(b.count * i64(sizeof(float)), "borrowed gradients of layers " +
                                                                 std::to_string(op.layer_begin) + "-" +
                                                                 std::to_string(op.layer_end - 1));
    b.gv = param_view(config_, b.g.f32(), op.layer_begin, op.layer_end, tp_);
  }
  return {&b.wv, &b.gv, &b.mv};
}

void MspExchange::send(const sched::Op& op) {
  const int i = op.subseq, b = op.layer_begin, e = op.layer_end;
  auto isend = [&](std::shared_ptr<Buffer> keep, const void* data, i64 bytes) {
    messages_.start_send(std::move(keep), data, bytes, op);
  };
  switch (op.payload) {
    case sched::Payload::Weights:  // the owner lends its stage's weights (all it owns)
      isend(nullptr, own_.params.data(), own_.params.bytes());
      break;
    case sched::Payload::KV:  // a helper's copy of its piece's K, V to the owner
      for (int l = b; l < e; ++l) {
        isend(nullptr, kv_.k(l, i).data(), kv_.k(l, i).bytes());
        isend(nullptr, kv_.v(l, i).data(), kv_.v(l, i).bytes());
      }
      break;
    case sched::Payload::KVGrad: {  // the owner returns a helper piece's dK, dV and drops its copy
      const i64 pos0 = sched_.offset(i) + sched_.spans(op).front().first;
      for (int l = b; l < e; ++l) {
        kv_.alloc_accumulators(l, i);
        auto [dk_sum, dv_sum] = kv_.take_held(op, l, pos0);
        auto dk = std::make_shared<Buffer>(std::move(dk_sum));
        auto dv = std::make_shared<Buffer>(std::move(dv_sum));
        isend(dk, dk->data(), dk->bytes());
        isend(dv, dv->data(), dv->bytes());
      }
      break;
    }
    case sched::Payload::WeightGrads: {  // a helper's gradients (and loss) go home
      auto& lease = borrowed_.at({b, e});
      auto g = std::make_shared<Buffer>(std::move(lease.g));
      SPPO_ASSERT_MSG(*g, "'" << sched::to_string(op) << "' before any backward on the borrowed layers");
      lease.w.reset();
      be_.synchronize();
      // Gone before this rank computes on: the owner takes them at the end of the same
      // task, and the memory rules free them with this send.
      messages_.send_now(g->data(), g->bytes(), op);
      if (e == config_.layers) {
        be_.to_host(&helper_loss_, loss_sum_.data(), sizeof(double));
        isend(nullptr, &helper_loss_, sizeof(double));
        isend(nullptr, result_.losses.data(), i64(result_.losses.size() * sizeof(float)));
      }
      break;
    }
    default:
      SPPO_ASSERT_MSG(false, "the runtime cannot send '" << sched::to_string(op) << "'");
  }
}

double MspExchange::receive(const sched::Op& op, std::size_t index) {
  const int i = op.subseq, b = op.layer_begin, e = op.layer_end;
  const int tag = sched::message_tag(op);
  const std::string what = "op " + std::to_string(index) + " '" + sched::to_string(op) + "'";
  double waited = 0;
  auto recv = [&](void* data, i64 bytes) { waited += comm::wait(*comm_, comm_->irecv(data, bytes, op.peer, tag), what); };
  const i64 H = tp_.local_kv_width(config_);  // the K/V cache's width (this member's heads)
  switch (op.payload) {
    case sched::Payload::Weights: {
      auto& lease = borrowed_[{b, e}];
      SPPO_ASSERT(!lease.w);
      lease.count = sched::param_count(config_, b, e, tp_);
      lease.w = device_.alloc(lease.count * i64(sizeof(float)),
                              "borrowed weights of layers " + std::to_string(b) + "-" + std::to_string(e - 1));
      recv(lease.w.data(), lease.w.bytes());
      lease.wv = param_view(config_, lease.w.f32(), b, e, tp_);
      lease.mv = matrix_view(config_, lease.w.data(), act_, b, e, tp_);
      break;
    }
    case sched::Payload::KV: {
      const PosSpan rows{sched_.offset(i) + sched_.spans(op).front().first, int(op.tokens), 0};
      for (int l = b; l < e; ++l) {
        KvStore::Held& h = kv_.hold(l, i, rows, op.tokens * H * dtype_bytes(act_));
        recv(h.k.data(), h.k.bytes());
        recv(h.v.data(), h.v.bytes());
        kv_.received(l, i);
      }
      break;
    }
    case sched::Payload::KVGrad:
      for (int l = b; l < e; ++l) {
        kv_.alloc_accumulators(l, i);
        recv(kv_.dk(l, i).data(), kv_.dk(l, i).bytes());
        recv(kv_.dv(l, i).data(), kv_.dv(l, i).bytes());
      }
      break;
    case sched::Payload::WeightGrads: {
      Buffer g = device_.alloc(own_.grads.bytes(), "an MSP helper's weight gradients");
      recv(g.data(), g.bytes());
      be_.add_inplace(own_.grads.data(), g.data(), own_.count);
      if (e == config_.layers) {
        double loss = 0;
        std::vector<float> losses(result_.losses.size());
        recv(&loss, sizeof loss);
        recv(losses.data(), i64(losses.size() * sizeof(float)));
        double sum = 0;
        be_.to_host(&sum, loss_sum_.data(), sizeof sum);
        sum += loss;
        be_.to_device(loss_sum_.data(), &sum, sizeof sum);
        for (std::size_t p = 0; p < losses.size(); ++p) result_.losses[p] += losses[p];
      }
      be_.synchronize();
      reduce_.helpers_added(index);
      break;
    }
    default:
      SPPO_ASSERT_MSG(false, "the runtime cannot receive '" << sched::to_string(op) << "'");
  }
  return waited;
}

void MspExchange::end_lease(std::size_t index) {
  if (auto lease = lease_ends_.find(index); lease != lease_ends_.end()) borrowed_.at(lease->second).w.reset();
}

void MspExchange::check_empty() const {
  for (const auto& [range, b] : borrowed_)
    SPPO_ASSERT_MSG(!b.w && !b.g, "borrowed weights of layers " << range.first << "-" << range.second - 1
                                                                << " are left over after the step");
}

}  // namespace sppo
