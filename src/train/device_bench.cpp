#include "train/device_bench.h"

#include <random>

#include "core/check.h"

namespace sppo {

DeviceBuffer::DeviceBuffer(Backend& be, std::size_t bytes) : be_(be), p_(be.device_alloc(bytes)) {
  SPPO_CHECK(p_ != nullptr, "bench") << "the device has no room for " << bytes << " bytes of benchmark data";
}

std::unique_ptr<DeviceBuffer> random_device(Backend& be, i64 n, bool act, unsigned seed) {
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

double time_gemm_flops(Backend& be, int n, int reps) {
  const DType act = be.act();
  auto a = random_device(be, i64(n) * n, true, 1), b = random_device(be, i64(n) * n, true, 2);
  DeviceBuffer c(be, std::size_t(n) * n * std::size_t(dtype_bytes(act)));
  const double s = median_seconds(be, reps, [&] {
    be.gemm(false, true, n, n, n, 1.0f, a->get(), n, b->get(), n, 0.0f, c.get(), n, act, act);
  });
  return 2.0 * n * double(n) * n / s;
}

double time_attention(Backend& be, i64 queries, i64 prefix, int heads, int head_dim, int reps) {
  const i64 T = queries, Tk = prefix + queries, D = i64(heads) * head_dim;
  const std::size_t act = std::size_t(dtype_bytes(be.act()));
  auto q = random_device(be, T * D, true, 5), k = random_device(be, Tk * D, true, 6),
       v = random_device(be, Tk * D, true, 7), dout = random_device(be, T * D, true, 8);
  DeviceBuffer out(be, std::size_t(T * D) * act), dq(be, std::size_t(T * D) * act);
  DeviceBuffer lse(be, std::size_t(heads * T) * sizeof(float)), delta(be, std::size_t(heads * T) * sizeof(float));
  DeviceBuffer dk(be, std::size_t(Tk * D) * sizeof(float)), dv(be, std::size_t(Tk * D) * sizeof(float));
  AttnShape d;
  d.Tq = int(T), d.Z = heads, d.A = head_dim, d.q_pos0 = prefix;
  d.ldq = d.ldk = d.ldv = d.ldo = int(D);
  const std::vector<KVRef> blocks{{k->get(), v->get(), dk.f32(), dv.f32(), int(Tk), 0}};
  return median_seconds(be, reps, [&] {
    be.attention_forward(out.get(), lse.f32(), q->get(), blocks, d, Workspace{});
    be.attention_backward_delta(delta.f32(), dout->get(), out.get(), d);
    be.attention_backward(dq.get(), dout->get(), q->get(), blocks, lse.f32(), delta.f32(), d, Workspace{});
  });
}

}  // namespace sppo
