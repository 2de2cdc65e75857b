// Throughput of the CPU causal flash-attention kernels against the SGEMM rate of this machine.
//
// Not built by CMake; build it against the kernels library of a build directory and the
// OpenMP build of OpenBLAS, as CMake links it (one thread pool for SGEMM and the kernels):
//   g++ -std=c++20 -O3 -march=native -fopenmp -Isrc bench/attention_bench.cpp
//       build/libsppo_kernels.a build/libsppo_core.a
//       -L$OMPBLAS -Wl,-rpath,$OMPBLAS -lopenblas -o attention_bench
// with OMPBLAS=/usr/lib/x86_64-linux-gnu/openblas-openmp.
//   ./attention_bench [Tq Tk Z A q_pos0 k_pos0 rounds]   (default 8192 8192 16 64 0 0 3)
// Each round times the SGEMM, the forward and the backward once; the best of the rounds is
// reported, so that a machine shared with other work is sampled alike for all three.
//
// FLOPs are causal: forward 4 * A * (visible query-key pairs) per head (two matmuls),
// backward 2.5x the forward. The SGEMM reference is a 2048^3 cblas_sgemm in the same run.
// Two rates per line: FLOPs per wall second, and threads * FLOPs per process CPU second,
// which is the wall rate on an idle machine and stays near it when other work takes cores.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <random>
#include <vector>

#include "backends/cpu/attention.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Wall and CPU seconds of one call. CPU time excludes the time the process was descheduled,
// so on a machine shared with other work the single-thread CPU rate is the steadier figure.
struct Times {
  double wall = 1e30, cpu = 1e30;
};

double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

void time_once(Times& best, const std::function<void()>& f) {
  const double c0 = cpu_seconds();
  const auto t0 = Clock::now();
  f();
  best.wall = std::min(best.wall, seconds_since(t0));
  best.cpu = std::min(best.cpu, cpu_seconds() - c0);
}

std::vector<float> randn(std::size_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& e : x) e = dist(rng);
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  const auto arg = [&](int i, long def) { return argc > i ? std::atol(argv[i]) : def; };
  sppo::cpu::AttnDims d;
  d.Tq = int(arg(1, 8192));
  d.Tk = int(arg(2, 8192));
  d.Z = int(arg(3, 16));
  d.A = int(arg(4, 64));
  d.q_pos0 = arg(5, 0);
  d.k_pos0 = arg(6, 0);
  const int rounds = int(arg(7, 3));
  const long H = long(d.Z) * d.A;

  std::mt19937 rng(1);
  const int n = 2048;
  auto ga = randn(std::size_t(n) * n, rng), gb = randn(std::size_t(n) * n, rng);
  std::vector<float> gc(std::size_t(n) * n);
  const auto sgemm = [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, ga.data(), n, gb.data(),
                n, 0.0f, gc.data(), n);
  };
  sgemm();

  auto q = randn(std::size_t(d.Tq) * H, rng), k = randn(std::size_t(d.Tk) * H, rng);
  auto v = randn(std::size_t(d.Tk) * H, rng), dout = randn(std::size_t(d.Tq) * H, rng);
  std::vector<float> out(std::size_t(d.Tq) * H), lse(std::size_t(d.Z) * d.Tq);
  std::vector<float> delta(lse.size()), dq(q.size()), dk(k.size()), dv(v.size());

  double pairs = 0;  // visible (query, key) pairs of one head
  for (long t = 0; t < d.Tq; ++t)
    pairs += double(std::clamp<long>(d.q_pos0 + t - d.k_pos0 + 1, 0, d.Tk));
  const double fwd_flops = 4.0 * pairs * d.A * d.Z;
  const double bwd_flops = 2.5 * fwd_flops;

  const auto forward = [&] {
    sppo::cpu::attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), d, false);
  };
  const auto backward = [&] {
    sppo::cpu::attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(),
                                  v.data(), lse.data(), delta.data(), d);
  };
  forward();
  sppo::cpu::attention_backward_delta(delta.data(), dout.data(), out.data(), d);
  backward();
  Times gemm_t, fwd_t, bwd_t;
  for (int r = 0; r < rounds; ++r) {
    time_once(gemm_t, sgemm);
    time_once(fwd_t, forward);
    time_once(bwd_t, backward);
  }
  const int threads = omp_get_max_threads();
  std::printf("threads %d  Tq %d Tk %d Z %d A %d q_pos0 %ld k_pos0 %ld  (best of %d rounds)\n",
              threads, d.Tq, d.Tk, d.Z, d.A, long(d.q_pos0), long(d.k_pos0), rounds);
  const double gemm_flops = 2.0 * n * n * n;
  const auto report = [&](const char* what, double flops, const Times& t) {
    const double wall_rate = flops / t.wall / 1e9, cpu_rate = threads * flops / t.cpu / 1e9;
    const double gemm_wall = gemm_flops / gemm_t.wall / 1e9;
    const double gemm_cpu = threads * gemm_flops / gemm_t.cpu / 1e9;
    std::printf(
        "%-9s wall %8.4f s %7.1f GFLOP/s %5.1f%% of sgemm | per-CPU-time %7.1f GFLOP/s %5.1f%%\n",
        what, t.wall, wall_rate, 100.0 * wall_rate / gemm_wall, cpu_rate,
        100.0 * cpu_rate / gemm_cpu);
  };
  std::printf("sgemm %dx%dx%d\n", n, n, n);
  report("sgemm", gemm_flops, gemm_t);
  report("forward", fwd_flops, fwd_t);
  report("backward", bwd_flops, bwd_t);
  return 0;
}
