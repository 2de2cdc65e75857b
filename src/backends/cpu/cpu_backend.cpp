#include "backends/cpu/cpu_backend.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <immintrin.h>
#include <optional>
#include <thread>

#include "backends/cpu/attention.h"
#include "backends/cpu/ops.h"
#include "backends/cpu/scratch.h"
#include "core/check.h"

namespace sppo {

namespace {

double steady_now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The copy engine's memcpy. Offloaded bytes are not read again until backward, so the copy
// streams them past the caches (non-temporal stores): the compute threads keep their working
// set in cache, and no read-for-ownership doubles the memory traffic. (glibc only streams
// copies larger than most of the last-level cache.)
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

// One worker thread that runs copies in submission order, like a CUDA stream on a copy
// engine: compute continues while it works.
class WorkerStream final : public CopyStream {
 public:
  WorkerStream() : worker_([this] { loop(); }) {}
  ~WorkerStream() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  std::shared_ptr<Event> copy(void* dst, const void* src, std::size_t bytes, std::function<void()> then) override {
    auto ev = std::make_shared<Event>();
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back({dst, src, bytes, std::move(then), ev});
      ++in_flight_;
    }
    cv_.notify_one();
    return ev;
  }

  void synchronize() override {
    std::unique_lock<std::mutex> lock(mu_);
    idle_cv_.wait(lock, [&] { return in_flight_ == 0; });
  }

 private:
  struct Task {
    void* dst;
    const void* src;
    std::size_t bytes;
    std::function<void()> then;
    std::shared_ptr<Event> done;
  };

  void loop() {
    for (;;) {
      Task t;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        t = std::move(queue_.front());
        queue_.pop_front();
      }
      const double t0 = steady_now_s();
      stream_copy(t.dst, t.src, t.bytes);
      if (t.then) t.then();
      t.done->signal(t0, steady_now_s());
      {
        std::lock_guard<std::mutex> lock(mu_);
        --in_flight_;
      }
      idle_cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<Task> queue_;
  bool stop_ = false;
  int in_flight_ = 0;
  std::thread worker_;
};

// Scratch of one kernel call, or none (the kernel's own memory).
struct ScratchOf {
  explicit ScratchOf(const Workspace& ws) {
    if (ws.base) s.emplace(ws.base, ws.bytes);
  }
  cpu::Scratch* get() { return s ? &*s : nullptr; }
  std::optional<cpu::Scratch> s;
};

float* f(void* p) { return static_cast<float*>(p); }
const float* f(const void* p) { return static_cast<const float*>(p); }

std::vector<cpu::KVBlock> blocks_of(const std::vector<KVRef>& refs) {
  std::vector<cpu::KVBlock> b;
  b.reserve(refs.size());
  for (const KVRef& r : refs) b.push_back({f(r.k), f(r.v), r.dk, r.dv, r.Tk, r.k_pos0});
  return b;
}

cpu::AttnDims dims_of(const AttnShape& s) {
  cpu::AttnDims d;
  d.Tq = s.Tq;
  d.Z = s.Z;
  d.A = s.A;
  d.q_pos0 = s.q_pos0;
  d.ldq = s.ldq, d.ldk = s.ldk, d.ldv = s.ldv, d.ldo = s.ldo;
  d.Zkv = s.Zkv;
  return d;
}

class CpuBackend final : public Backend {
 public:
  const char* name() const override { return "cpu"; }
  DType act() const override { return DType::F32; }

  std::size_t device_memory() const override {
    return std::size_t(sysconf(_SC_PHYS_PAGES)) * std::size_t(sysconf(_SC_PAGE_SIZE));
  }
  void* device_alloc(std::size_t bytes) override { return aligned(bytes); }
  void device_free(void* p) override { std::free(p); }
  void* host_alloc(std::size_t bytes) override { return aligned(bytes); }
  void host_free(void* p) override { std::free(p); }
  std::unique_ptr<CopyStream> make_copy_stream() override { return std::make_unique<WorkerStream>(); }
  void to_host(void* dst, const void* src, std::size_t bytes) override { std::memcpy(dst, src, bytes); }
  void to_device(void* dst, const void* src, std::size_t bytes) override { std::memcpy(dst, src, bytes); }
  void fill_zero(void* p, std::size_t bytes) override { std::memset(p, 0, bytes); }
  void synchronize() override {}

  KernelScratch block_scratch(const ModelConfig& c) const override {
    const int threads = omp_get_max_threads();
    KernelScratch s = cpu::attention_forward_scratch(c.head_size(), threads);
    s = cpu::max(s, cpu::attention_backward_scratch(c.heads, c.head_size(), threads, c.kv_head_count()));
    s = cpu::max(s, cpu::layernorm_backward_scratch(c.hidden));
    // Note [Query/key norms]: the norm of Z heads of A a token.
    if (c.qk_norm) s = cpu::max(s, cpu::rmsnorm_backward_scratch(c.head_size(), c.heads));
    return cpu::max(s, cpu::linear_backward_scratch(std::max({3 * c.hidden, c.qkv_width(), c.ffn()})));
  }
  KernelScratch head_scratch(const ModelConfig& c, int chunk) const override {
    return cpu::max(cpu::layernorm_backward_scratch(c.hidden), cpu::xent_scratch(chunk));
  }

  void gemm(bool ta, bool tb, int M, int N, int K, float alpha, const void* a, int lda, const void* b, int ldb,
            float beta, void* c, int ldc, DType ab, DType cd) override {
    SPPO_ASSERT(ab == DType::F32 && cd == DType::F32);
    cpu::gemm(ta, tb, M, N, K, alpha, f(a), lda, f(b), ldb, beta, f(c), ldc);
  }
  void linear_forward(void* out, const void* in, const void* w, const void* b, int T, int I, int O, int ld_out,
                      int ld_in) override {
    cpu::linear_forward(f(out), f(in), f(w), f(b), T, I, O, ld_out, ld_in);
  }
  void linear_backward(void* din, float* dw, float* db, const void* dout, const void* in, const void* w, int T, int I,
                       int O, int ld_dout, int ld_in, const Workspace& ws) override {
    ScratchOf s(ws);
    cpu::linear_backward(f(din), dw, db, f(dout), f(in), f(w), T, I, O, ld_dout, ld_in, s.get());
  }
  void embedding_forward(void* out, const std::int32_t* ids, const float* embed, int T, int H, int V) override {
    cpu::embedding_forward(f(out), ids, embed, T, H);
  }
  void embedding_backward(float* dembed, const void* dout, const std::int32_t* ids, int T, int H, int V) override {
    cpu::embedding_backward(dembed, f(dout), ids, T, H, V);
  }
  void embedding_shard_forward(void* out, const std::int32_t* ids, const float* embed, int T, int H, int v0,
                               int Vr) override {
    cpu::embedding_shard_forward(f(out), ids, embed, T, H, v0, Vr);
  }
  void embedding_shard_backward(float* dembed, const void* dout, const std::int32_t* ids, int T, int H, int v0,
                                int Vr) override {
    cpu::embedding_shard_backward(dembed, f(dout), ids, T, H, v0, Vr);
  }
  void layernorm_forward(void* out, float* mean, float* rstd, const void* x, const float* w, const float* b, int T,
                         int H, float eps) override {
    cpu::layernorm_forward(f(out), mean, rstd, f(x), w, b, T, H, eps);
  }
  void layernorm_backward(void* dx, float* dw, float* db, const void* dout, const void* x, const float* w,
                          const float* mean, const float* rstd, int T, int H, const Workspace& ws) override {
    ScratchOf s(ws);
    cpu::layernorm_backward(f(dx), dw, db, f(dout), f(x), w, mean, rstd, T, H, s.get());
  }
  // Within block_scratch: rmsnorm_backward_scratch(H) is half of layernorm_backward_scratch(H).
  void rmsnorm_forward(void* out, float* rstd, const void* x, const float* w, int T, int H, float eps) override {
    cpu::rmsnorm_forward(f(out), rstd, f(x), w, T, H, eps);
  }
  void rmsnorm_backward(void* dx, float* dw, const void* dout, const void* x, const float* w, const float* rstd, int T,
                        int H, const Workspace& ws) override {
    ScratchOf s(ws);
    cpu::rmsnorm_backward(f(dx), dw, f(dout), f(x), w, rstd, T, H, s.get());
  }
  void gelu_forward(void* out, const void* in, i64 n) override { cpu::gelu_forward(f(out), f(in), n); }
  void gelu_backward(void* din, const void* dout, const void* in, i64 n) override {
    cpu::gelu_backward(f(din), f(dout), f(in), n);
  }
  void swiglu_forward(void* out, const void* gu, int T, int F) override { cpu::swiglu_forward(f(out), f(gu), T, F); }
  void swiglu_backward(void* dgu, const void* gu, int T, int F) override {
    cpu::swiglu_backward(f(dgu), f(gu), T, F);
  }
  void rope_forward(void* x, int T, int Z, int A, i64 pos0, const RopeTable& r, int ld) override {
    cpu::rope_forward(f(x), T, Z, A, pos0, r, ld);
  }
  void rope_backward(void* dx, int T, int Z, int A, i64 pos0, const RopeTable& r, int ld) override {
    cpu::rope_backward(f(dx), T, Z, A, pos0, r, ld);
  }
  void add_inplace(void* y, const void* x, i64 n) override {
    float* yy = f(y);
    const float* xx = f(x);
#pragma omp parallel for simd schedule(static)
    for (i64 i = 0; i < n; ++i) yy[i] += xx[i];
  }
  void copy_2d(void* dst, i64 dst_pitch, const void* src, i64 src_pitch, i64 width, i64 rows) override {
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
#pragma omp parallel for schedule(static) if (rows * width > (i64{1} << 20))
    for (i64 r = 0; r < rows; ++r) std::memcpy(d + r * dst_pitch, s + r * src_pitch, std::size_t(width));
  }
  void copy_cols(void* dst, const void* src, int T, int width, int ld_src, int col) override {
    float* d = f(dst);
    const float* s = f(src);
#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; ++t) std::memcpy(d + i64(t) * width, s + i64(t) * ld_src + col, sizeof(float) * width);
  }
  void put_cols(void* dst, const void* src, bool src_f32, int T, int width, int ld_dst, int col) override {
    float* d = f(dst);
    const float* s = f(src);
#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; ++t) std::memcpy(d + i64(t) * ld_dst + col, s + i64(t) * width, sizeof(float) * width);
  }
  void zero_cols(void* dst, int T, int width, int ld, int col) override {
    float* d = f(dst);
    for (int t = 0; t < T; ++t) std::memset(d + i64(t) * ld + col, 0, sizeof(float) * width);
  }
  void attention_forward(void* out, float* lse, const void* q, const std::vector<KVRef>& blocks, const AttnShape& d,
                         const Workspace& ws) override {
    ScratchOf s(ws);
    cpu::attention_forward_blocks(f(out), lse, f(q), blocks_of(blocks), dims_of(d), s.get());
  }
  void attention_merge(void* out, float* lse, const void* part_out, const float* part_lse,
                       const AttnShape& d) override {
    cpu::attention_merge(f(out), lse, f(part_out), part_lse, dims_of(d));
  }
  void attention_backward_delta(float* delta, const void* dout, const void* out, const AttnShape& d) override {
    cpu::attention_backward_delta(delta, f(dout), f(out), dims_of(d));
  }
  void attention_backward(void* dq, const void* dout, const void* q, const std::vector<KVRef>& blocks,
                          const float* lse, const float* delta, const AttnShape& d, const Workspace& ws) override {
    ScratchOf s(ws);
    cpu::attention_backward_blocks(f(dq), f(dout), f(q), blocks_of(blocks), lse, delta, dims_of(d), s.get());
  }
  void xent(void* dlogits, float* losses, double* loss_sum, float* logits, const std::int32_t* targets, int T, int V,
            float grad_scale, const Workspace& ws) override {
    SPPO_ASSERT(dlogits == logits);  // fp32: the gradient overwrites the logits
    ScratchOf s(ws);
    *loss_sum += cpu::xent_forward_backward(logits, losses, targets, T, V, grad_scale, s.get());
  }
  void row_logsumexp(float* lse, const float* logits, int T, int V) override { cpu::row_logsumexp(lse, logits, T, V); }
  // Within head_scratch: xent_shard takes xent_scratch(T) (the rows' double losses), as xent.
  void xent_shard(void* dlogits, float* losses, double* loss_sum, float* logits, const float* lse_parts, int parts,
                  const std::int32_t* targets, int T, int V, int v0, float grad_scale, const Workspace& ws) override {
    ScratchOf s(ws);
    *loss_sum += cpu::xent_shard(f(dlogits), losses, logits, lse_parts, parts, targets, T, V, v0, grad_scale, s.get());
  }
  void softmax_rows(float* x, float* lse, i64 rows, int cols, bool with_lse) override {
    cpu::softmax_rows(x, lse, rows, cols, with_lse);
  }
  void softmax_backward_rows(float* dx, const float* p, i64 rows, int cols) override {
    cpu::softmax_backward_rows(dx, p, rows, cols);
  }
  double sum_squares(const float* g, i64 n) override { return cpu::sum_squares(g, n); }
  void scale(float* x, i64 n, float s) override { cpu::scale_inplace(x, n, s); }
  void add_f32(float* y, const float* x, i64 n) override { add_inplace(y, x, n); }  // the CPU computes in fp32
  void adamw(float* p, float* m, float* v, const float* g, i64 n, float lr, float beta1, float beta2, float eps,
             float weight_decay, int t, void* p_act) override {
    SPPO_ASSERT(p_act == nullptr);  // fp32: the weights are their own working copy
    cpu::adamw_step(p, m, v, g, n, lr, beta1, beta2, eps, weight_decay, t);
  }
  void to_act(void* dst, const float* src, i64 n) override {
    if (dst != src) std::memcpy(dst, src, std::size_t(n) * sizeof(float));
  }
  void to_f32(float* dst, const void* src, i64 n) override {
    if (dst != src) std::memcpy(dst, src, std::size_t(n) * sizeof(float));
  }
  void host_adamw(float* p, float* m, float* v, const float* g, i64 n, float lr, float beta1, float beta2, float eps,
                  float weight_decay, int t) override {
    cpu::adamw_step(p, m, v, g, n, lr, beta1, beta2, eps, weight_decay, t);
  }
  double host_sum_squares(const float* g, i64 n) override { return cpu::sum_squares(g, n); }
  void host_scale(float* x, i64 n, float s) override { cpu::scale_inplace(x, n, s); }

 private:
  static void* aligned(std::size_t bytes) {
    constexpr std::size_t kAlign = 64;  // one cache line; AVX-512 loads stay aligned
    const std::size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
    return std::aligned_alloc(kAlign, rounded == 0 ? kAlign : rounded);
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace sppo
