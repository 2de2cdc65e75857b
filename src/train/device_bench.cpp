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
  return time_attention(be, AttentionTiming{queries, prefix, heads, head_dim, true, 0}, reps);
}

double attention_forward_flops(const AttentionTiming& t) {
  return t.own_block ? attention_forward_flops(t.queries, t.prefix, t.heads, t.head_dim)
                     : 4.0 * t.heads * t.head_dim * double(t.queries) * double(t.prefix);
}

double time_attention(Backend& be, const AttentionTiming& t, int reps) {
  const i64 T = t.queries, Tk = t.prefix + (t.own_block ? T : 0), D = i64(t.heads) * t.head_dim;
  const std::size_t act = std::size_t(dtype_bytes(be.act()));
  auto q = random_device(be, T * D, true, 5), k = random_device(be, Tk * D, true, 6),
       v = random_device(be, Tk * D, true, 7), dout = random_device(be, T * D, true, 8);
  DeviceBuffer out(be, std::size_t(T * D) * act), dq(be, std::size_t(T * D) * act);
  DeviceBuffer lse(be, std::size_t(t.heads * T) * sizeof(float)), delta(be, std::size_t(t.heads * T) * sizeof(float));
  DeviceBuffer dk(be, std::size_t(Tk * D) * sizeof(float)), dv(be, std::size_t(Tk * D) * sizeof(float));
  AttnShape d;
  d.Tq = int(T), d.Z = t.heads, d.A = t.head_dim, d.q_pos0 = t.prefix;
  d.ldq = d.ldk = d.ldv = d.ldo = int(D);
  auto rows = [&](const DeviceBuffer& b, i64 row, std::size_t bytes) { return static_cast<char*>(b.get()) + row * D * i64(bytes); };
  auto block = [&](i64 row0, i64 n) {
    return KVRef{rows(*k, row0, act), rows(*v, row0, act), reinterpret_cast<float*>(rows(dk, row0, 4)),
                 reinterpret_cast<float*>(rows(dv, row0, 4)), int(n), row0};
  };
  if (!t.own_block || t.chunk <= 0) {
    const std::vector<KVRef> blocks{block(0, Tk)};
    return median_seconds(be, reps, [&] {
      be.attention_forward(out.get(), lse.f32(), q->get(), blocks, d, Workspace{});
      be.attention_backward_delta(delta.f32(), dout->get(), out.get(), d);
      be.attention_backward(dq.get(), dout->get(), q->get(), blocks, lse.f32(), delta.f32(), d, Workspace{});
    });
  }
  // The runtime's streamed chunks: the own block first, then each chunk merged.
  DeviceBuffer part(be, std::size_t(T * D) * act), part_lse(be, std::size_t(t.heads * T) * sizeof(float));
  std::vector<KVRef> chunks;
  for (i64 r = 0; r < t.prefix; r += t.chunk) chunks.push_back(block(r, std::min(t.chunk, t.prefix - r)));
  const KVRef own = block(t.prefix, T);
  return median_seconds(be, reps, [&] {
    be.attention_forward(out.get(), lse.f32(), q->get(), {own}, d, Workspace{});
    for (const KVRef& c : chunks) {
      be.attention_forward(part.get(), part_lse.f32(), q->get(), {c}, d, Workspace{});
      be.attention_merge(out.get(), lse.f32(), part.get(), part_lse.f32(), d);
    }
    be.attention_backward_delta(delta.f32(), dout->get(), out.get(), d);
    be.attention_backward(dq.get(), dout->get(), q->get(), {own}, lse.f32(), delta.f32(), d, Workspace{});
    for (const KVRef& c : chunks)
      be.attention_backward(dq.get(), dout->get(), q->get(), {c}, lse.f32(), delta.f32(), d, Workspace{});
  });
}

}  // namespace sppo
