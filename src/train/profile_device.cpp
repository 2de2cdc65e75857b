#include "train/profile_device.h"

#include <algorithm>
#include <chrono>
#include <random>
#include <string>
#include <vector>

#include "core/check.h"
#include "model/gpt.h"

namespace sppo {

namespace {

// A device buffer of the backend's, freed on scope exit.
class DeviceBuffer {
 public:
  DeviceBuffer(Backend& be, std::size_t bytes) : be_(be), p_(be.device_alloc(bytes)) {
    SPPO_CHECK(p_ != nullptr, "profile") << "the device has no room for " << bytes << " bytes of benchmark data";
  }
  ~DeviceBuffer() { be_.device_free(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return p_; }
  float* f32() const { return static_cast<float*>(p_); }

 private:
  Backend& be_;
  void* p_;
};

// n random values, fp32 or in the activation type.
std::unique_ptr<DeviceBuffer> random(Backend& be, i64 n, bool act, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> host(std::size_t(n), 0.0f);
  for (auto& x : host) x = d(rng);
  DeviceBuffer f32(be, host.size() * sizeof(float));
  be.to_device(f32.get(), host.data(), host.size() * sizeof(float));
  auto out = std::make_unique<DeviceBuffer>(be, host.size() * std::size_t(dtype_bytes(act ? be.act() : DType::F32)));
  if (act) be.to_act(out->get(), f32.f32(), n);
  else be.to_device(out->get(), host.data(), host.size() * sizeof(float));
  be.synchronize();
  return out;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The median of `reps` timed runs of f after one warm-up, the backend synchronised around.
template <typename F>
double median_s(Backend& be, int reps, F&& f) {
  f();
  be.synchronize();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const double t0 = now_s();
    f();
    be.synchronize();
    t.push_back(now_s() - t0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

plan::HardwareProfile measure_backend_profile(Backend& be, bool quick, nlohmann::json* details) {
  const bool gpu = std::string(be.name()) != "cpu";
  const DType act = be.act();
  const int reps = quick ? 3 : 5;
  plan::HardwareProfile p;
  p.name = std::string(be.name()) + "-local";
  p.precision = act == DType::F32 ? "f32" : "bf16";
  nlohmann::json more = nlohmann::json::object();

  // The GEMM rate on a large square product, in the activation type.
  {
    const int n = gpu ? (quick ? 4096 : 8192) : (quick ? 1024 : 2048);
    auto a = random(be, i64(n) * n, true, 1), b = random(be, i64(n) * n, true, 2);
    DeviceBuffer c(be, std::size_t(n) * n * std::size_t(dtype_bytes(act)));
    const double s = median_s(be, reps, [&] {
      be.gemm(false, true, n, n, n, 1.0f, a->get(), n, b->get(), n, 0.0f, c.get(), n, act, act);
    });
    p.gemm_flops = 2.0 * n * double(n) * n / s;
  }
  // A block's four GEMMs, forward and backward, by hidden size.
  for (int H : gpu ? std::vector<int>{1024, 4096, 8192} : std::vector<int>{256, 1024}) {
    const int T = gpu ? 8192 : 1024;
    const int shapes[4][2] = {{H, 3 * H}, {H, H}, {H, 4 * H}, {4 * H, H}};  // {in, out}
    std::vector<std::unique_ptr<DeviceBuffer>> x, w, y, dw;
    for (const auto& sh : shapes) {
      x.push_back(random(be, i64(T) * sh[0], true, 3));
      w.push_back(random(be, i64(sh[1]) * sh[0], true, 4));
      y.push_back(std::make_unique<DeviceBuffer>(be, std::size_t(T) * sh[1] * std::size_t(dtype_bytes(act))));
      dw.push_back(std::make_unique<DeviceBuffer>(be, std::size_t(sh[1]) * sh[0] * sizeof(float)));
    }
    const double s = median_s(be, reps, [&] {
      for (int k = 0; k < 4; ++k) {
        be.linear_forward(y[k]->get(), x[k]->get(), w[k]->get(), nullptr, T, shapes[k][0], shapes[k][1], 0, 0);
        be.linear_backward(x[k]->get(), dw[k]->f32(), nullptr, y[k]->get(), x[k]->get(), w[k]->get(), T,
                           shapes[k][0], shapes[k][1], 0, 0, Workspace{});
      }
    });
    p.gemm_flops_by_hidden.emplace_back(H, 3.0 * 24.0 * T * double(H) * H / s);
  }
  // Causal attention forward + backward by head size, whole; and queries after a prefix
  // three times their length (the SPPO pattern), recorded beside.
  for (int A : gpu ? std::vector<int>{64, 128} : std::vector<int>{32, 64, 128}) {
    const int T = gpu ? 8192 : 1024, Z = (gpu ? 4096 : 512) / A, D = Z * A;
    for (const bool prefix : {false, true}) {
      const int Tk = prefix ? 4 * T : T;
      auto q = random(be, i64(T) * D, true, 5), k = random(be, i64(Tk) * D, true, 6), v = random(be, i64(Tk) * D, true, 7),
           dout = random(be, i64(T) * D, true, 8);
      DeviceBuffer out(be, std::size_t(T) * D * std::size_t(dtype_bytes(act))), dq(be, std::size_t(T) * D * std::size_t(dtype_bytes(act)));
      DeviceBuffer lse(be, std::size_t(Z) * T * sizeof(float)), delta(be, std::size_t(Z) * T * sizeof(float));
      DeviceBuffer dk(be, std::size_t(Tk) * D * sizeof(float)), dv(be, std::size_t(Tk) * D * sizeof(float));
      AttnShape d;
      d.Tq = T, d.Z = Z, d.A = A, d.q_pos0 = Tk - T;
      d.ldq = d.ldk = d.ldv = d.ldo = D;
      std::vector<KVRef> blocks{{k->get(), v->get(), dk.f32(), dv.f32(), Tk, 0}};
      const double s = median_s(be, reps, [&] {
        be.attention_forward(out.get(), lse.f32(), q->get(), blocks, d, Workspace{});
        be.attention_backward_delta(delta.f32(), dout->get(), out.get(), d);
        be.attention_backward(dq.get(), dout->get(), q->get(), blocks, lse.f32(), delta.f32(), d, Workspace{});
      });
      const double fwd = 4.0 * A * Z * (double(T) * (Tk - T) + double(T) * (T + 1) / 2);
      const double rate = 3.5 * fwd / s;  // forward + 2.5x backward
      if (!prefix) {
        p.attention_efficiency_by_head.emplace_back(A, rate / p.gemm_flops);
        if (A == 64 || (gpu && A == 128)) p.attention_efficiency = rate / p.gemm_flops;
      } else {
        more["attention_after_prefix_flops_per_s"][std::to_string(A)] = rate;
      }
    }
  }
  // Elementwise: a LayerNorm forward reads and writes [T, H].
  {
    const int T = gpu ? 32768 : 4096, H = 1024;
    auto x = random(be, i64(T) * H, true, 9), w = random(be, H, false, 10), b = random(be, H, false, 11);
    DeviceBuffer y(be, std::size_t(T) * H * std::size_t(dtype_bytes(act))), st(be, 2 * std::size_t(T) * sizeof(float));
    const double s = median_s(be, reps, [&] {
      be.layernorm_forward(y.get(), st.f32(), st.f32() + T, x->get(), w->f32(), b->f32(), T, H, 1e-5f);
    });
    p.elementwise_bw = 2.0 * T * double(H) * dtype_bytes(act) / s;
  }
  // Copies between pinned host memory and the device: each way, both at once, and while the
  // compute stream runs GEMMs.
  {
    const std::size_t n = std::size_t(gpu ? 512 : 32) << 20;
    void* host_a = be.host_alloc(n);
    void* host_b = be.host_alloc(n);
    SPPO_CHECK(host_a && host_b, "profile") << "no room for " << n << " bytes of host memory";
    DeviceBuffer dev_a(be, n), dev_b(be, n);
    auto out = be.make_copy_stream(), in = be.make_copy_stream();
    auto copy = [&](CopyStream& s, void* dst, const void* src) { s.copy(dst, src, n, nullptr)->wait(); };
    const double d2h = median_s(be, reps, [&] { copy(*out, host_a, dev_a.get()); });
    const double h2d = median_s(be, reps, [&] { copy(*in, dev_b.get(), host_b); });
    const double both = median_s(be, reps, [&] {
      auto e1 = out->copy(host_a, dev_a.get(), n, nullptr);
      auto e2 = in->copy(dev_b.get(), host_b, n, nullptr);
      e1->wait();
      e2->wait();
    });
    p.d2h_bw = double(n) / d2h;
    p.h2d_bw = double(n) / h2d;
    p.duplex_factor = std::min(1.0, (d2h + h2d) / 2 / both);
    p.intra_node_bw = p.inter_node_bw = p.d2h_bw;
    p.intra_node_latency = p.inter_node_latency = 2e-6;
    more["copy_both_ways_bytes_per_s"] = 2.0 * double(n) / both;
    be.host_free(host_a);
    be.host_free(host_b);
    be.synchronize();
  }
  // Fixed cost per layer: a block on 8 tokens is all overhead.
  {
    ModelConfig c;
    c.vocab = 64, c.hidden = 64, c.heads = 2, c.layers = 1;
    const int T = 8;
    auto params = random(be, c.num_params(), false, 12);
    auto matrices = random(be, c.num_params(), true, 13);
    const ParamView pv = param_view(c, params->f32());
    const MatrixView mv = matrix_view(c, matrices->get(), act, 0, 1);
    std::vector<std::unique_ptr<DeviceBuffer>> saved, ws;
    std::vector<void*> sp, wp;
    const ActPrecision prec = act == DType::F32 ? ActPrecision::F32 : ActPrecision::BF16;
    for (const auto& s : block_saved_specs(c, T, prec)) saved.push_back(std::make_unique<DeviceBuffer>(be, s.bytes()));
    for (const auto& s : block_workspace_specs(c, T, prec)) ws.push_back(std::make_unique<DeviceBuffer>(be, s.bytes()));
    for (auto& b : saved) sp.push_back(b->get());
    for (auto& b : ws) wp.push_back(b->get());
    DeviceBuffer out(be, std::size_t(T) * c.hidden * std::size_t(dtype_bytes(act)));
    BlockSaved bs = block_saved_from(sp);
    const BlockWorkspace w = block_workspace_from(wp);
    p.layer_overhead = median_s(be, reps * 5, [&] {
      block_forward(be, out.get(), bs, pv.blocks[0], mv.blocks[0], w, KVBlocks{}, c, Subseq{0, T});
    });
  }
  p.device_memory = i64(be.device_memory());
  p.memory_reserve = gpu ? i64{2} << 30 : 0;  // the CUDA backend's slab leaves this free
  p.devices_per_node = 1;
  p.description = std::string("measured through the ") + be.name() + " backend (" + p.precision + ")";
  if (details) *details = more;
  return p;
}

}  // namespace sppo
