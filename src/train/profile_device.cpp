#include "train/profile_device.h"

#include <algorithm>
#include <string>
#include <vector>

#include "core/check.h"
#include "model/gpt.h"
#include "train/device_bench.h"

namespace sppo {

namespace {

ModelConfig attention_model(int heads, int head_size) {
  ModelConfig c;
  c.heads = heads;
  c.hidden = heads * head_size;
  return c;
}

// Each class timed with the library's kernels and with the backend's own; the backend then
// runs the faster of each (prefer_attention).
void measure_attention_classes(Backend& be, int reps, plan::HardwareProfile& p) {
  for (const int A : {64, 128}) {
    const int Z = 4096 / A;
    if (!be.prepare_attention(attention_model(Z, A)).library) return;
    for (const bool causal : {true, false})
      for (const int rows : {1024, 8192}) {
        const AttentionTiming t{rows, causal ? 0 : rows, Z, A, causal, 0};
        const double flops = 3.5 * attention_forward_flops(t);
        plan::HardwareProfile::AttentionClass k{A, causal, rows, "", 0, 0};
        for (const bool library : {true, false}) {
          be.prefer_attention({{A, causal, rows, library}});
          (library ? k.cudnn_flops : k.own_flops) = flops / time_attention(be, t, reps);
        }
        k.kernel = k.cudnn_flops >= k.own_flops ? "cudnn" : "own";
        p.attention_kernels.push_back(k);
      }
  }
  be.prefer_attention(attention_classes(p));
}

}  // namespace

std::vector<AttentionClassChoice> attention_classes(const plan::HardwareProfile& p) {
  std::vector<AttentionClassChoice> classes;
  for (const auto& k : p.attention_kernels) classes.push_back({k.head_size, k.causal, k.rows, k.kernel == "cudnn"});
  return classes;
}

plan::HardwareProfile measure_backend_profile(Backend& be, bool quick, nlohmann::json* details) {
  const bool gpu = std::string(be.name()) != "cpu";
  const DType act = be.act();
  const int reps = quick ? 3 : 5;
  plan::HardwareProfile p;
  p.name = std::string(be.name()) + "-local";
  p.precision = act == DType::F32 ? "f32" : "bf16";
  nlohmann::json more = nlohmann::json::object();

  // The GEMM rate on a large square product, in the activation type.
  p.gemm_flops = time_gemm_flops(be, gpu ? (quick ? 4096 : 8192) : (quick ? 1024 : 2048), reps);
  // A block's four GEMMs, forward and backward, by hidden size.
  for (int H : gpu ? std::vector<int>{1024, 4096, 8192} : std::vector<int>{256, 1024}) {
    const int T = gpu ? 8192 : 1024;
    const int shapes[4][2] = {{H, 3 * H}, {H, H}, {H, 4 * H}, {4 * H, H}};  // {in, out}
    std::vector<std::unique_ptr<DeviceBuffer>> x, w, y, dw;
    for (const auto& sh : shapes) {
      x.push_back(random_device(be, i64(T) * sh[0], true, 3));
      w.push_back(random_device(be, i64(sh[1]) * sh[0], true, 4));
      y.push_back(std::make_unique<DeviceBuffer>(be, std::size_t(T) * sh[1] * std::size_t(dtype_bytes(act))));
      dw.push_back(std::make_unique<DeviceBuffer>(be, std::size_t(sh[1]) * sh[0] * sizeof(float)));
    }
    const double s = median_seconds(be, reps, [&] {
      for (int k = 0; k < 4; ++k) {
        be.linear_forward(y[k]->get(), x[k]->get(), w[k]->get(), nullptr, T, shapes[k][0], shapes[k][1], 0, 0);
        be.linear_backward(x[k]->get(), dw[k]->f32(), nullptr, y[k]->get(), x[k]->get(), w[k]->get(), T,
                           shapes[k][0], shapes[k][1], 0, 0, Workspace{});
      }
    });
    p.gemm_flops_by_hidden.emplace_back(H, 3.0 * 24.0 * T * double(H) * H / s);
  }
  // Note [Attention kernels by shape class]: where a fused library serves attention, each
  // class timed with both kernels first, so that the rates below are the faster kernels'.
  if (gpu) measure_attention_classes(be, reps, p);
  // Causal attention forward + backward by head size, whole; and queries after a prefix
  // three times their length (the SPPO pattern), recorded beside.
  for (int A : gpu ? std::vector<int>{64, 128} : std::vector<int>{32, 64, 128}) {
    const int T = gpu ? 8192 : 1024, Z = (gpu ? 4096 : 512) / A;
    for (const bool prefix : {false, true}) {
      const double s = time_attention(be, T, prefix ? 3 * T : 0, Z, A, reps);
      const double rate = 3.5 * attention_forward_flops(T, prefix ? 3 * T : 0, Z, A) / s;
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
    auto x = random_device(be, i64(T) * H, true, 9), w = random_device(be, H, false, 10), b = random_device(be, H, false, 11);
    DeviceBuffer y(be, std::size_t(T) * H * std::size_t(dtype_bytes(act))), st(be, 2 * std::size_t(T) * sizeof(float));
    const double s = median_seconds(be, reps, [&] {
      be.layernorm_forward(y.get(), st.f32(), st.f32() + T, x->get(), w->f32(), b->f32(), T, H, 1e-5f);
    });
    p.elementwise_bw = 2.0 * T * double(H) * dtype_bytes(act) / s;
  }
  // Copies between pinned host memory and the device: each way, both at once, and while the
  // compute stream runs GEMMs.
  {
    const std::size_t n = std::size_t(gpu ? (quick ? 128 : 512) : 32) << 20;
    void* host_a = be.host_alloc(n);
    void* host_b = be.host_alloc(n);
    SPPO_CHECK(host_a && host_b, "profile") << "no room for " << n << " bytes of host memory";
    DeviceBuffer dev_a(be, n), dev_b(be, n);
    auto out = be.make_copy_stream(), in = be.make_copy_stream();
    auto copy = [&](CopyStream& s, void* dst, const void* src) { s.copy(dst, src, n, nullptr)->wait(); };
    const double d2h = median_seconds(be, reps, [&] { copy(*out, host_a, dev_a.get()); });
    const double h2d = median_seconds(be, reps, [&] { copy(*in, dev_b.get(), host_b); });
    const double both = median_seconds(be, reps, [&] {
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
    auto params = random_device(be, c.num_params(), false, 12);
    auto matrices = random_device(be, c.num_params(), true, 13);
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
    p.layer_overhead = median_seconds(be, reps * 5, [&] {
      block_forward(be, out.get(), bs, pv.blocks[0], mv.blocks[0], w, KVBlocks{}, c, Subseq{0, T});
    });
  }
  p.device_memory = i64(be.device_memory());
  p.memory_reserve = gpu ? i64{2} << 30 : 0;  // the CUDA backend's slab leaves this free
  p.devices_per_node = 1;
  p.description = std::string("measured through the ") + be.name() + " backend (" + p.precision + ")";
  if (!p.attention_kernels.empty())
    p.description += "; attention by the faster kernels of each shape class (attention_kernels)";
  if (details) *details = more;
  return p;
}

const plan::HardwareProfile& measured_device_profile(Backend& be) {
  static const plan::HardwareProfile measured = measure_backend_profile(be, true);
  return measured;
}

}  // namespace sppo
