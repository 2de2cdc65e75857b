#include "runtime/executor.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

#include "core/check.h"
#include "kernels/ops.h"
#include "runtime/copy_stream.h"

namespace sppo {

namespace {

double now_s() {
  static const auto origin = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - origin).count();
}

constexpr int kSavedTensors = 14;  // block_saved_specs() entries

// The copy engine's memcpy. Offloaded bytes are not read again until backward, so the
// copy streams them past the caches (non-temporal stores): the compute threads keep their
// working set in cache, and no read-for-ownership doubles the memory traffic. (glibc only
// streams copies larger than most of the last-level cache.)
void stream_copy(void* dst, const void* src, std::size_t bytes) {
#ifdef __AVX512F__
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  if ((reinterpret_cast<std::uintptr_t>(d) % 64) == 0 && bytes >= 4096) {
    const std::size_t body = bytes / 64 * 64;
    for (std::size_t k = 0; k < body; k += 64)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(d + k), _mm512_loadu_si512(s + k));
    _mm_sfence();
    std::memcpy(d + body, s + body, bytes - body);
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

}  // namespace

struct Runtime::StepState {
  const sched::Schedule* sched = nullptr;
  const std::int32_t* tokens = nullptr;
  i64 S = 0;
  int N = 0;
  std::vector<std::vector<std::vector<Buffer>>> dev;   // [N][L][kSavedTensors] device copies
  std::vector<std::vector<std::vector<Buffer>>> host;  // same shape: offloaded parts
  std::vector<Buffer> head_grad, head_grad_host;       // [N]
  std::vector<std::vector<Buffer>> dk, dv;             // [L][N] dK/dV accumulators
  std::vector<std::shared_ptr<Event>> offload_first, offload_last;    // [N]
  std::vector<std::shared_ptr<Event>> prefetch_first, prefetch_last;  // [N]
  std::vector<Role> roles;                             // of the saved tensors
  double loss_sum = 0;
  StepResult* result = nullptr;
  std::unique_ptr<CopyStream> d2h, h2d;
};

Runtime::Runtime(const ModelConfig& c, const RuntimeOptions& o)
    : config_(c),
      opts_(o),
      device_(std::make_unique<MemoryTier>(Tier::Device, o.device_budget)),
      host_(std::make_unique<MemoryTier>(Tier::Host, 0)) {
  c.validate();
  SPPO_CHECK(o.head_chunk >= 1, "runtime") << "head chunk must be positive";
  const i64 bytes = c.num_params() * i64(sizeof(float));
  params_ = device_->alloc_zeroed(bytes, "parameters");
  grads_ = device_->alloc_zeroed(bytes, "gradients");
  adam_m_ = device_->alloc_zeroed(bytes, "AdamW first moments");
  adam_v_ = device_->alloc_zeroed(bytes, "AdamW second moments");
  weights_ = param_view(c, params_.f32());
  dweights_ = param_view(c, grads_.f32());
}

Runtime::~Runtime() = default;

namespace {

std::vector<float*> ptrs(const std::vector<Buffer>& bufs) {
  std::vector<float*> p;
  for (const auto& b : bufs) p.push_back(b.f32());
  return p;
}

std::vector<Buffer> alloc_specs(MemoryTier& tier, const std::vector<TensorSpec>& specs,
                                const std::string& prefix) {
  std::vector<Buffer> bufs;
  for (const auto& s : specs) bufs.push_back(tier.alloc(s.bytes(), prefix + s.name));
  return bufs;
}

std::string unit_name(int l, int i) {
  return "blocks." + std::to_string(l) + " subseq " + std::to_string(i) + " ";
}

}  // namespace

void Runtime::forward(StepState& st, int i) {
  const auto& sc = *st.sched;
  const int T = int(sc.lengths[i]), H = config_.hidden, L = config_.layers;
  const i64 o = sc.offset(i);
  const std::int32_t* ids = st.tokens + o;
  const auto specs = block_saved_specs(config_, T, ActPrecision::F32);
  Subseq q{o, T};

  for (int l = 0; l < L; ++l) {
    auto& unit = st.dev[i][l];
    for (int k = 0; k < kSavedTensors; ++k)
      if (!unit[k]) unit[k] = device_->alloc(specs[k].bytes(), unit_name(l, i) + specs[k].name);
    if (l == 0) cpu::embedding_forward(unit[0].f32(), ids, weights_.embed, T, H);
    auto ws = alloc_specs(*device_, block_workspace_specs(config_, T, ActPrecision::F32), "workspace ");
    // The block's output is the next block's saved input, or the head's input.
    Buffer out;
    float* x_out;
    if (l + 1 < L) {
      st.dev[i][l + 1][0] = device_->alloc(specs[0].bytes(), unit_name(l + 1, i) + "x");
      x_out = st.dev[i][l + 1][0].f32();
    } else {
      out = device_->alloc(specs[0].bytes(), "final hidden");
      x_out = out.f32();
    }
    KVBlocks past;
    for (int j = 0; j < i; ++j) {
      past.k.push_back(st.dev[j][l][5].f32());
      past.v.push_back(st.dev[j][l][6].f32());
      past.offsets.push_back(sc.offset(j));
      past.lengths.push_back(sc.lengths[j]);
    }
    BlockSaved saved = block_saved_from(ptrs(unit));
    block_forward(x_out, saved, weights_.blocks[l], block_workspace_from(ptrs(ws)), past, config_, q);
    if (opts_.recompute)  // keep the block input only; backward recomputes the rest
      for (int k = 1; k < kSavedTensors; ++k) unit[k].reset();
    if (l + 1 == L) {
      ws.clear();
      auto hw_bufs = alloc_specs(*device_, head_workspace_specs(config_, T, opts_.head_chunk, ActPrecision::F32),
                                 "head workspace ");
      const HeadWorkspace hw = head_workspace_from(ptrs(hw_bufs), opts_.head_chunk);
      st.head_grad[i] = device_->alloc(specs[0].bytes(), "subseq " + std::to_string(i) + " head_grad");
      st.loss_sum += head_forward_backward(st.head_grad[i].f32(), x_out, ids + 1, weights_, dweights_,
                                           hw, config_, T, st.S);
      std::memcpy(st.result->losses.data() + o, hw.losses, sizeof(float) * T);
    }
  }
}

void Runtime::backward(StepState& st, int i) {
  const auto& sc = *st.sched;
  const int T = int(sc.lengths[i]), H = config_.hidden, L = config_.layers;
  const i64 o = sc.offset(i);
  const auto specs = block_saved_specs(config_, T, ActPrecision::F32);
  Subseq q{o, T};
  float* d = st.head_grad[i].f32();
  SPPO_ASSERT_MSG(d, "backward of subsequence " << i << " before its forward");

  for (int l = L - 1; l >= 0; --l) {
    // dK/dV accumulators of every subsequence this backward reaches, zeroed on first use.
    for (int j = 0; j <= i; ++j)
      if (!st.dk[l][j]) {
        const i64 b = sc.lengths[j] * H * i64(sizeof(float));
        st.dk[l][j] = device_->alloc_zeroed(b, unit_name(l, j) + "dK");
        st.dv[l][j] = device_->alloc_zeroed(b, unit_name(l, j) + "dV");
      }
    auto& unit = st.dev[i][l];
    auto ws = alloc_specs(*device_, block_workspace_specs(config_, T, ActPrecision::F32), "workspace ");
    const BlockWorkspace w = block_workspace_from(ptrs(ws));
    KVBlocks past;
    for (int j = 0; j < i; ++j) {
      past.k.push_back(st.dev[j][l][5].f32());
      past.v.push_back(st.dev[j][l][6].f32());
      past.dk.push_back(st.dk[l][j].f32());
      past.dv.push_back(st.dv[l][j].f32());
      past.offsets.push_back(sc.offset(j));
      past.lengths.push_back(sc.lengths[j]);
    }
    if (opts_.recompute) {
      for (int k = 1; k < kSavedTensors; ++k)
        unit[k] = device_->alloc(specs[k].bytes(), unit_name(l, i) + specs[k].name);
      Buffer out = device_->alloc(specs[0].bytes(), "recomputed block output");
      BlockSaved s = block_saved_from(ptrs(unit));
      block_forward(out.f32(), s, weights_.blocks[l], w, past, config_, q);
    }
    for (int k = 0; k < kSavedTensors; ++k)
      SPPO_ASSERT_MSG(unit[k], "saved tensor " << specs[k].name << " of layer " << l
                                               << " subseq " << i << " is not on the device");
    const BlockSaved s = block_saved_from(ptrs(unit));
    block_backward(d, dweights_.blocks[l], st.dk[l][i].f32(), st.dv[l][i].f32(), s,
                   weights_.blocks[l], w, past, config_, q);
    for (auto& b : unit) b.reset();
    st.dk[l][i].reset();
    st.dv[l][i].reset();
  }
  cpu::embedding_backward(dweights_.embed, d, st.tokens + o, T, H, config_.vocab);
  st.head_grad[i].reset();
}

void Runtime::offload(StepState& st, int i, double fraction) {
  if (fraction <= 0) return;
  const int L = config_.layers;
  // The same walk as the simulator's: layers in order (layer 0 is needed last in
  // backward), each layer's offloadable tensors in table order, head_grad last.
  std::vector<std::pair<Buffer*, Buffer*>> tensors;
  std::vector<i64> sizes;
  for (int l = 0; l < L; ++l)
    for (int k = 0; k < kSavedTensors; ++k)
      if (st.roles[k] == Role::Offloadable) {
        tensors.push_back({&st.dev[i][l][k], &st.host[i][l][k]});
        sizes.push_back(st.dev[i][l][k].bytes());
      }
  tensors.push_back({&st.head_grad[i], &st.head_grad_host[i]});
  sizes.push_back(st.head_grad[i].bytes());
  std::vector<bool> take;
  st.result->offloaded_bytes += select_offload(sizes, fraction, &take);
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    if (!take[t]) continue;
    Buffer& dev = *tensors[t].first;
    Buffer& host = *tensors[t].second;
    SPPO_ASSERT(dev);
    host = host_->alloc(dev.bytes(), "subseq " + std::to_string(i) + " host copy");
    device_->expect_release(dev.bytes());
    auto ev = st.d2h->submit([&dev, &host, tier = device_.get()] {
      const i64 bytes = dev.bytes();
      stream_copy(host.data(), dev.data(), std::size_t(bytes));
      dev.reset();  // the device bytes are really released when the copy completes
      tier->settle(bytes);
    });
    if (!st.offload_first[i]) st.offload_first[i] = ev;
    st.offload_last[i] = ev;
  }
}

void Runtime::prefetch(StepState& st, int i) {
  const int L = config_.layers;
  auto move_in = [&](Buffer& dev, Buffer& host, const std::string& what) {
    if (!host) return;
    dev = device_->alloc(host.bytes(), what);
    auto ev = st.h2d->submit([&dev, &host] {
      stream_copy(dev.data(), host.data(), std::size_t(host.bytes()));
      host.reset();
    });
    if (!st.prefetch_first[i]) st.prefetch_first[i] = ev;
    st.prefetch_last[i] = ev;
  };
  move_in(st.head_grad[i], st.head_grad_host[i], "head_grad");
  for (int l = L - 1; l >= 0; --l)
    for (int k = 0; k < kSavedTensors; ++k) move_in(st.dev[i][l][k], st.host[i][l][k], unit_name(l, i));
}

StepResult Runtime::step(const sched::Schedule& sc, const std::int32_t* tokens) {
  SPPO_CHECK(sc.ranks == 1, "runtime") << "this runtime executes single-rank schedules; got "
                                      << sc.ranks << " ranks";
  SPPO_CHECK(!opts_.recompute || sc.lengths.size() == 1, "runtime")
      << "full recomputation runs the whole sequence at once; use --subseqs 1";
  StepResult result;
  StepState st;
  st.sched = &sc;
  st.tokens = tokens;
  st.S = sc.seq_len();
  st.N = int(sc.lengths.size());
  const int L = config_.layers, N = st.N;
  st.dev.resize(N);
  st.host.resize(N);
  for (int i = 0; i < N; ++i) {
    st.dev[i].resize(L);
    st.host[i].resize(L);
  }
  for (int i = 0; i < N; ++i)
    for (int l = 0; l < L; ++l) {
      st.dev[i][l].resize(kSavedTensors);
      st.host[i][l].resize(kSavedTensors);
    }
  st.head_grad.resize(N);
  st.head_grad_host.resize(N);
  st.dk.resize(L);
  st.dv.resize(L);
  for (int l = 0; l < L; ++l) {
    st.dk[l].resize(N);
    st.dv[l].resize(N);
  }
  st.offload_first.resize(N);
  st.offload_last.resize(N);
  st.prefetch_first.resize(N);
  st.prefetch_last.resize(N);
  for (const auto& s : block_saved_specs(config_, 1, ActPrecision::F32)) st.roles.push_back(s.role);
  SPPO_ASSERT(int(st.roles.size()) == kSavedTensors);
  st.result = &result;
  result.losses.assign(std::size_t(st.S), 0.0f);
  st.d2h = std::make_unique<CopyStream>(&now_s);
  st.h2d = std::make_unique<CopyStream>(&now_s);

  std::memset(grads_.data(), 0, std::size_t(grads_.bytes()));
  device_->reset_peak();
  const double t_start = now_s();
  if (opts_.record_memory) device_->record_timeline(&now_s);
  auto span = [&](const std::string& name, sched::OpKind kind, Lane lane, double t0, double t1) {
    result.trace.push_back({name, kind, lane, t0 - t_start, t1 - t0});
  };
  for (const sched::Op& op : sc.ops.at(0)) {
    const double t0 = now_s();
    const int i = op.subseq;
    switch (op.kind) {
      case sched::OpKind::Forward:
        forward(st, i);
        span("F" + std::to_string(i), op.kind, Lane::Compute, t0, now_s());
        break;
      case sched::OpKind::Backward:
        backward(st, i);
        span("B" + std::to_string(i), op.kind, Lane::Compute, t0, now_s());
        break;
      case sched::OpKind::Offload:
        offload(st, i, op.fraction);
        break;
      case sched::OpKind::Prefetch:
        prefetch(st, i);
        break;
      case sched::OpKind::WaitOffload:
        if (st.offload_last[i]) result.exposed_copy_s += st.offload_last[i]->wait();
        break;
      case sched::OpKind::WaitPrefetch:
        if (st.prefetch_last[i]) {
          const double waited = st.prefetch_last[i]->wait();
          result.exposed_copy_s += waited;
          if (waited > 1e-4) span("wait P" + std::to_string(i), op.kind, Lane::Compute, t0, now_s());
        }
        break;
      case sched::OpKind::Send:
      case sched::OpKind::Recv:
      case sched::OpKind::RingStep:
      case sched::OpKind::AllReduce:
        SPPO_CHECK(false, "runtime") << "op '" << sched::to_string(op)
                                     << "' needs several ranks; this runtime runs one";
    }
  }
  st.d2h->synchronize();
  st.h2d->synchronize();
  result.step_s = now_s() - t_start;
  result.exposed_copy_s += device_->release_wait_s();
  for (int i = 0; i < N; ++i) {
    if (st.offload_first[i])
      span("O" + std::to_string(i), sched::OpKind::Offload, Lane::CopyOut, st.offload_first[i]->start_s(),
           st.offload_last[i]->end_s());
    if (st.prefetch_first[i])
      span("P" + std::to_string(i), sched::OpKind::Prefetch, Lane::CopyIn, st.prefetch_first[i]->start_s(),
           st.prefetch_last[i]->end_s());
  }
  for (int i = 0; i < N; ++i)
    for (int l = 0; l < L; ++l)
      for (int k = 0; k < kSavedTensors; ++k)
        SPPO_ASSERT_MSG(!st.dev[i][l][k] && !st.host[i][l][k],
                        "tensor left over after the step: layer " << l << " subseq " << i);
  if (opts_.record_memory) {
    result.memory = device_->take_timeline();
    device_->record_timeline(nullptr);
    for (auto& [t, bytes] : result.memory) t = std::max(0.0, t - t_start);
  }
  result.loss = st.loss_sum / double(st.S);
  result.device = device_->stats();
  return result;
}

}  // namespace sppo
