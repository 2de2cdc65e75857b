// Throughput of the CUDA attention kernels (backends/cuda/attention.h): bf16 on tensor cores,
// 32 heads of 128, forward + backward, on the two patterns the issue compares with PyTorch 2.11's
// scaled_dot_product_attention on the same GPU:
//   whole_32k              32768 queries against their own 32768 keys, causal (one KV block)
//   prefix_16k_after_112k  16384 queries at positions [114688, 131072) against keys [0, 131072):
//                          the KV cache of the earlier subsequences (one block of 114688 keys)
//                          and the subsequence's own keys (a second block), causal bottom-right
// FLOPs are counted as FlashAttention counts them and as PyTorch's figures were: forward
// 4 A Z (Tq p + Tq^2 / 2) for Tq queries after a prefix of p keys (p = 0: 4 S^2 A Z / 2), the
// backward 2.5x that, so forward + backward is 3.5x the forward.
// Timed with CUDA events over --iters iterations after a warm-up: "fwd" is the forward alone,
// "fwd+bwd" one forward, delta, zeroing of the gradient accumulators and the backward (dq, dk,
// dv), the work PyTorch's forward + backward call does.
//
// Before timing, a check of both patterns at full size compares head 0 of the tensor-core
// results (all 32 heads computed) with the fp32 SIMT kernels run on head 0 alone, on the same
// bf16 inputs: ||tc - simt|| / ||simt|| per output (out, lse, dq, every block's dk and dv),
// expected about 2^-8 (bf16 rounding of P, dS and the outputs), failing above 2e-2. The SIMT
// reference costs about 1 fp32 TFLOP per pattern (a second or two).
//
// Usage: gpu_attention_bench [--iters N] [--skip-check]
// Prints a readable line per pattern, then one JSON line:
//   {"whole_32k": {"sppo_tflops": ..., ...}, "prefix_16k_after_112k": {"sppo_tflops": ...}, ...}
// where sppo_tflops is forward + backward. Exit status 1 when the check fails.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "backends/cuda/attention.h"
#include "backends/cuda/check.h"

namespace {

using sppo::DType;
using sppo::i64;
namespace cuda = sppo::cuda;

constexpr int kZ = 32, kA = 128, kH = kZ * kA;

// Deterministic pseudo-random bf16 in [-sqrt(3), sqrt(3)) (unit variance) from a hash.
__global__ void fill_kernel(__nv_bfloat16* x, i64 n, std::uint32_t seed) {
  for (i64 i = blockIdx.x * i64{blockDim.x} + threadIdx.x; i < n;
       i += i64{gridDim.x} * blockDim.x) {
    std::uint32_t h = static_cast<std::uint32_t>(i) * 0x9E3779B1u ^ seed;
    h ^= static_cast<std::uint32_t>(i >> 32) * 0x85EBCA77u;
    h ^= h >> 16;
    h *= 0x7FEB352Du;
    h ^= h >> 15;
    h *= 0x846CA68Bu;
    h ^= h >> 16;
    const float u = (h >> 8) * (1.0f / 16777216.0f);  // [0, 1)
    x[i] = __float2bfloat16_rn((2.0f * u - 1.0f) * 1.7320508f);
  }
}

struct Buf {
  void* p = nullptr;
  std::size_t bytes = 0;
  explicit Buf(std::size_t n) : bytes(n) { SPPO_CUDA_CHECK(cudaMalloc(&p, n)); }
  ~Buf() { cudaFree(p); }
  Buf(Buf&& o) noexcept : p(o.p), bytes(o.bytes) { o.p = nullptr; }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  float* f() const { return static_cast<float*>(p); }
};

void fill(const Buf& b, i64 n, std::uint32_t seed) {
  fill_kernel<<<1024, 256>>>(static_cast<__nv_bfloat16*>(b.p), n, seed);
  SPPO_CUDA_CHECK_LAUNCH();
}

// One attention problem: Tq queries at q_pos0 against blocks (Tk, k_pos0), all heads, bf16.
struct Problem {
  int Tq;
  i64 q_pos0;
  std::vector<std::pair<int, i64>> blocks;
};

struct Tensors {
  Buf q, out, dout, dq, lse, delta;
  std::vector<Buf> k, v, dk, dv;
  std::vector<cuda::KVBlock> kv;
  cuda::AttnDims d;
  explicit Tensors(const Problem& pr)
      : q(std::size_t(pr.Tq) * kH * 2),
        out(std::size_t(pr.Tq) * kH * 2),
        dout(std::size_t(pr.Tq) * kH * 2),
        dq(std::size_t(pr.Tq) * kH * 2),
        lse(std::size_t(pr.Tq) * kZ * 4),
        delta(std::size_t(pr.Tq) * kZ * 4) {
    std::uint32_t seed = 1;
    fill(q, i64(pr.Tq) * kH, seed++);
    fill(dout, i64(pr.Tq) * kH, seed++);
    for (const auto& [Tk, pos] : pr.blocks) {
      k.emplace_back(std::size_t(Tk) * kH * 2);
      v.emplace_back(std::size_t(Tk) * kH * 2);
      dk.emplace_back(std::size_t(Tk) * kH * 4);
      dv.emplace_back(std::size_t(Tk) * kH * 4);
      fill(k.back(), i64(Tk) * kH, seed++);
      fill(v.back(), i64(Tk) * kH, seed++);
      kv.push_back({k.back().p, v.back().p, dk.back().f(), dv.back().f(), Tk, pos});
    }
    SPPO_CUDA_CHECK(cudaDeviceSynchronize());  // the fills ran on the legacy default stream
    d.Tq = pr.Tq;
    d.Z = kZ;
    d.A = kA;
    d.q_pos0 = pr.q_pos0;
  }
  void zero_grads(cudaStream_t s) {
    SPPO_CUDA_CHECK(cudaMemsetAsync(dq.p, 0, dq.bytes, s));
    for (std::size_t b = 0; b < dk.size(); ++b) {
      SPPO_CUDA_CHECK(cudaMemsetAsync(dk[b].p, 0, dk[b].bytes, s));
      SPPO_CUDA_CHECK(cudaMemsetAsync(dv[b].p, 0, dv[b].bytes, s));
    }
  }
  void forward(cudaStream_t s, cuda::AttnKernel kern = cuda::AttnKernel::TensorCore) {
    cuda::attention_forward_blocks(out.p, lse.f(), q.p, kv, d, DType::BF16, s, kern);
  }
  void backward(cudaStream_t s) {
    cuda::attention_backward_delta(delta.f(), dout.p, out.p, d, DType::BF16, s);
    zero_grads(s);
    cuda::attention_backward_blocks(dq.p, dout.p, q.p, kv, lse.f(), delta.f(), d, DType::BF16, s,
                                    cuda::AttnKernel::TensorCore);
  }
};

// Forward FLOPs as FlashAttention counts them (causal half of the diagonal block).
double forward_flops(const Problem& pr) {
  const double s = pr.Tq, p = static_cast<double>(pr.q_pos0);
  return 4.0 * kA * kZ * (s * p + s * s / 2.0);
}

// Columns [0, kA) (head 0) of a [rows, kH] device buffer, as floats on the host.
std::vector<float> head0_bf16(const void* p, int rows) {
  std::vector<std::uint16_t> raw(std::size_t(rows) * kA);
  SPPO_CUDA_CHECK(
      cudaMemcpy2D(raw.data(), kA * 2, p, kH * 2, kA * 2, rows, cudaMemcpyDeviceToHost));
  std::vector<float> x(raw.size());
  for (std::size_t i = 0; i < raw.size(); ++i) {
    const std::uint32_t u = std::uint32_t{raw[i]} << 16;
    std::memcpy(&x[i], &u, 4);
  }
  return x;
}
std::vector<float> head0_f32(const void* p, int rows) {
  std::vector<float> x(std::size_t(rows) * kA);
  SPPO_CUDA_CHECK(cudaMemcpy2D(x.data(), kA * 4, p, kH * 4, kA * 4, rows, cudaMemcpyDeviceToHost));
  return x;
}
std::vector<float> first_f32(const void* p, int n) {
  std::vector<float> x(n);
  SPPO_CUDA_CHECK(cudaMemcpy(x.data(), p, std::size_t(n) * 4, cudaMemcpyDeviceToHost));
  return x;
}
double rel_err(const std::vector<float>& a, const std::vector<float>& ref) {
  double e = 0.0, r = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = double(a[i]) - ref[i];
    e += d * d;
    r += double(ref[i]) * ref[i];
  }
  return r > 0.0 ? std::sqrt(e / r) : std::sqrt(e);
}

// Head 0 of the tensor-core results against the SIMT kernels run on head 0 alone (Z = 1, the
// same strides), given the same lse and delta. Returns the worst relative error.
double check(const Problem& pr, const char* name, cudaStream_t s) {
  Tensors t(pr);
  t.forward(s);
  t.backward(s);  // delta, zeroed accumulators, tensor-core backward of all heads
  // The SIMT reference of head 0: its own outputs and accumulators, same inputs, lse and delta.
  Buf out1(t.out.bytes), lse1(std::size_t(pr.Tq) * 4), dq1(t.dq.bytes);
  std::vector<Buf> dk1, dv1;
  std::vector<cuda::KVBlock> kv1 = t.kv;
  for (std::size_t b = 0; b < t.kv.size(); ++b) {
    dk1.emplace_back(t.dk[b].bytes);
    dv1.emplace_back(t.dv[b].bytes);
    SPPO_CUDA_CHECK(cudaMemsetAsync(dk1.back().p, 0, dk1.back().bytes, s));
    SPPO_CUDA_CHECK(cudaMemsetAsync(dv1.back().p, 0, dv1.back().bytes, s));
    kv1[b].dk = dk1.back().f();
    kv1[b].dv = dv1.back().f();
  }
  SPPO_CUDA_CHECK(cudaMemsetAsync(dq1.p, 0, dq1.bytes, s));
  cuda::AttnDims d1 = t.d;
  d1.Z = 1;
  d1.ldq = d1.ldk = d1.ldv = d1.ldo = kH;
  cuda::attention_forward_blocks(out1.p, lse1.f(), t.q.p, kv1, d1, DType::BF16, s,
                                 cuda::AttnKernel::Simt);
  // lse of head 0 is the first row of the [Z, Tq] lse; delta likewise.
  cuda::attention_backward_blocks(dq1.p, t.dout.p, t.q.p, kv1, t.lse.f(), t.delta.f(), d1,
                                  DType::BF16, s, cuda::AttnKernel::Simt);
  SPPO_CUDA_CHECK(cudaStreamSynchronize(s));
  double worst = 0.0;
  const auto report = [&](const char* what, double e) {
    std::printf("  check %-22s %-4s ||tc - simt|| / ||simt|| = %.2e\n", name, what, e);
    worst = std::max(worst, e);
  };
  report("out", rel_err(head0_bf16(t.out.p, pr.Tq), head0_bf16(out1.p, pr.Tq)));
  report("lse", rel_err(first_f32(t.lse.p, pr.Tq), first_f32(lse1.p, pr.Tq)));
  report("dq", rel_err(head0_bf16(t.dq.p, pr.Tq), head0_bf16(dq1.p, pr.Tq)));
  for (std::size_t b = 0; b < t.kv.size(); ++b) {
    const int Tk = t.kv[b].Tk;
    report("dk", rel_err(head0_f32(t.dk[b].p, Tk), head0_f32(dk1[b].p, Tk)));
    report("dv", rel_err(head0_f32(t.dv[b].p, Tk), head0_f32(dv1[b].p, Tk)));
  }
  return worst;
}

struct Rates {
  double fwd_s, fwdbwd_s, fwd_tflops, bwd_tflops, fwdbwd_tflops;
};

Rates time_problem(const Problem& pr, int iters, cudaStream_t s) {
  Tensors t(pr);
  t.forward(s);  // warm-up (and the inputs of the first backward)
  t.backward(s);
  cudaEvent_t e0, e1;
  SPPO_CUDA_CHECK(cudaEventCreate(&e0));
  SPPO_CUDA_CHECK(cudaEventCreate(&e1));
  SPPO_CUDA_CHECK(cudaEventRecord(e0, s));
  for (int i = 0; i < iters; ++i) t.forward(s);
  SPPO_CUDA_CHECK(cudaEventRecord(e1, s));
  SPPO_CUDA_CHECK(cudaEventSynchronize(e1));
  float ms_f = 0.0f;
  SPPO_CUDA_CHECK(cudaEventElapsedTime(&ms_f, e0, e1));
  SPPO_CUDA_CHECK(cudaEventRecord(e0, s));
  for (int i = 0; i < iters; ++i) {
    t.forward(s);
    t.backward(s);
  }
  SPPO_CUDA_CHECK(cudaEventRecord(e1, s));
  SPPO_CUDA_CHECK(cudaEventSynchronize(e1));
  float ms_fb = 0.0f;
  SPPO_CUDA_CHECK(cudaEventElapsedTime(&ms_fb, e0, e1));
  SPPO_CUDA_CHECK(cudaEventDestroy(e0));
  SPPO_CUDA_CHECK(cudaEventDestroy(e1));
  Rates r;
  r.fwd_s = ms_f / 1e3 / iters;
  r.fwdbwd_s = ms_fb / 1e3 / iters;
  const double f = forward_flops(pr);
  r.fwd_tflops = f / r.fwd_s / 1e12;
  r.fwdbwd_tflops = 3.5 * f / r.fwdbwd_s / 1e12;
  r.bwd_tflops = 2.5 * f / (r.fwdbwd_s - r.fwd_s) / 1e12;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 5;
  bool do_check = true;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--iters") == 0 && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--skip-check") == 0) {
      do_check = false;
    } else {
      std::fprintf(stderr, "usage: %s [--iters N] [--skip-check]\n", argv[0]);
      return 2;
    }
  }
  if (iters < 1) iters = 1;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "gpu_attention_bench: no CUDA device visible\n");
    return 2;
  }
  cudaDeviceProp prop{};
  SPPO_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs; attention bf16, %d heads of %d\n", prop.name,
              prop.multiProcessorCount, kZ, kA);
  cudaStream_t s;
  SPPO_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  const Problem whole{32768, 0, {{32768, 0}}};
  const Problem prefix{16384, 114688, {{114688, 0}, {16384, 114688}}};
  double worst = 0.0;
  if (do_check) {
    worst = std::max(worst, check(whole, "whole_32k", s));
    worst = std::max(worst, check(prefix, "prefix_16k_after_112k", s));
  }
  const bool ok = worst <= 2e-2;

  const Rates rw = time_problem(whole, iters, s);
  const Rates rp = time_problem(prefix, iters, s);
  std::printf(
      "whole_32k:             fwd %.1f TFLOP/s (%.2f ms), bwd %.1f, fwd+bwd %.1f TFLOP/s (%.2f "
      "ms)\n",
      rw.fwd_tflops, rw.fwd_s * 1e3, rw.bwd_tflops, rw.fwdbwd_tflops, rw.fwdbwd_s * 1e3);
  std::printf(
      "prefix_16k_after_112k: fwd %.1f TFLOP/s (%.2f ms), bwd %.1f, fwd+bwd %.1f TFLOP/s (%.2f "
      "ms)\n",
      rp.fwd_tflops, rp.fwd_s * 1e3, rp.bwd_tflops, rp.fwdbwd_tflops, rp.fwdbwd_s * 1e3);
  std::printf(
      "{\"whole_32k\": {\"sppo_tflops\": %.1f, \"fwd_tflops\": %.1f, \"bwd_tflops\": %.1f, "
      "\"fwdbwd_s\": %.6f}, \"prefix_16k_after_112k\": {\"sppo_tflops\": %.1f, \"fwd_tflops\": "
      "%.1f, \"bwd_tflops\": %.1f, \"fwdbwd_s\": %.6f}, \"check\": {\"ran\": %s, "
      "\"worst_rel_err\": %.3e, \"ok\": %s}}\n",
      rw.fwdbwd_tflops, rw.fwd_tflops, rw.bwd_tflops, rw.fwdbwd_s, rp.fwdbwd_tflops, rp.fwd_tflops,
      rp.bwd_tflops, rp.fwdbwd_s, do_check ? "true" : "false", worst, ok ? "true" : "false");
  SPPO_CUDA_CHECK(cudaStreamDestroy(s));
  return ok ? 0 : 1;
}
