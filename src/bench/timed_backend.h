// A backend that runs every call on another one and adds each kernel's wall time to one of
// a few parts of a block: attention forward, attention backward, GEMMs, other. `bench layer
// --breakdown` runs one more step through it to say where the step's time goes.
//
// Each kernel is timed by the backend's StreamClock (backend/backend.h): on a GPU by events
// around it on the compute stream, which keeps running (Note [Kernel times from events] in
// backends/cuda/cuda_backend.cpp); on the CPU, whose kernels are synchronous, by the wall
// clock. The step's time less the kernels' is what ran between them: launches, waits on the
// host, synchronisations.
#pragma once

#include <memory>

#include "backend/backend.h"

namespace sppo {

struct KernelTimes {
  double attention_forward_s = 0;   // attention_forward, attention_merge
  double attention_backward_s = 0;  // attention_backward_delta, attention_backward
  double gemm_s = 0;                // gemm, linear_forward, linear_backward (with its bias sums)
  double other_s = 0;               // norms, GeLU, SwiGLU, RoPE, adds, column copies, the rest
};

class TimedBackend final : public Backend {
 public:
  explicit TimedBackend(Backend& inner) : be_(inner), clock_(inner.make_stream_clock()) {}
  // The parts so far; waits for the kernels still running.
  const KernelTimes& times() {
    clock_->collect();
    return t_;
  }
  void reset() {
    clock_->collect();
    t_ = {};
  }

  const char* name() const override { return be_.name(); }
  DType act() const override { return be_.act(); }
  std::size_t device_memory() const override { return be_.device_memory(); }
  void* device_alloc(std::size_t bytes) override { return be_.device_alloc(bytes); }
  void device_free(void* p) override { be_.device_free(p); }
  void* host_alloc(std::size_t bytes) override { return be_.host_alloc(bytes); }
  void host_free(void* p) override { be_.host_free(p); }
  std::unique_ptr<CopyStream> make_copy_stream() override { return be_.make_copy_stream(); }
  std::unique_ptr<StreamClock> make_stream_clock() override { return be_.make_stream_clock(); }
  void to_host(void* dst, const void* src, std::size_t bytes) override { be_.to_host(dst, src, bytes); }
  void to_device(void* dst, const void* src, std::size_t bytes) override { be_.to_device(dst, src, bytes); }
  void fill_zero(void* p, std::size_t bytes) override { timed(t_.other_s, [&] { be_.fill_zero(p, bytes); }); }
  void synchronize() override { be_.synchronize(); }
  KernelScratch block_scratch(const ModelConfig& c) const override { return be_.block_scratch(c); }
  KernelScratch head_scratch(const ModelConfig& c, int chunk) const override { return be_.head_scratch(c, chunk); }

  void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const void* a, int lda, const void* b,
            int ldb, float beta, void* c, int ldc, DType ab, DType cd) override {
    timed(t_.gemm_s, [&] { be_.gemm(trans_a, trans_b, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc, ab, cd); });
  }
  void linear_forward(void* out, const void* in, const void* w, const void* b, int T, int I, int O, int ld_out,
                      int ld_in) override {
    timed(t_.gemm_s, [&] { be_.linear_forward(out, in, w, b, T, I, O, ld_out, ld_in); });
  }
  void linear_backward(void* din, float* dw, float* db, const void* dout, const void* in, const void* w, int T, int I,
                       int O, int ld_dout, int ld_in, const Workspace& ws) override {
    timed(t_.gemm_s, [&] { be_.linear_backward(din, dw, db, dout, in, w, T, I, O, ld_dout, ld_in, ws); });
  }
  void embedding_forward(void* out, const std::int32_t* ids, const float* embed, int T, int H, int V) override {
    timed(t_.other_s, [&] { be_.embedding_forward(out, ids, embed, T, H, V); });
  }
  void embedding_backward(float* dembed, const void* dout, const std::int32_t* ids, int T, int H, int V) override {
    timed(t_.other_s, [&] { be_.embedding_backward(dembed, dout, ids, T, H, V); });
  }
  void embedding_shard_forward(void* out, const std::int32_t* ids, const float* embed, int T, int H, int v0,
                               int Vr) override {
    timed(t_.other_s, [&] { be_.embedding_shard_forward(out, ids, embed, T, H, v0, Vr); });
  }
  void embedding_shard_backward(float* dembed, const void* dout, const std::int32_t* ids, int T, int H, int v0,
                                int Vr) override {
    timed(t_.other_s, [&] { be_.embedding_shard_backward(dembed, dout, ids, T, H, v0, Vr); });
  }
  void layernorm_forward(void* out, float* mean, float* rstd, const void* x, const float* w, const float* b, int T,
                         int H, float eps) override {
    timed(t_.other_s, [&] { be_.layernorm_forward(out, mean, rstd, x, w, b, T, H, eps); });
  }
  void layernorm_backward(void* dx, float* dw, float* db, const void* dout, const void* x, const float* w,
                          const float* mean, const float* rstd, int T, int H, const Workspace& ws) override {
    timed(t_.other_s, [&] { be_.layernorm_backward(dx, dw, db, dout, x, w, mean, rstd, T, H, ws); });
  }
  void add_norm_forward(void* y, const void* x, void* out, float* mean, float* rstd, const float* w, const float* b,
                        int T, int H, float eps, bool rms) override {
    timed(t_.other_s, [&] { be_.add_norm_forward(y, x, out, mean, rstd, w, b, T, H, eps, rms); });
  }
  void rmsnorm_forward(void* out, float* rstd, const void* x, const float* w, int T, int H, float eps) override {
    timed(t_.other_s, [&] { be_.rmsnorm_forward(out, rstd, x, w, T, H, eps); });
  }
  void rmsnorm_backward(void* dx, float* dw, const void* dout, const void* x, const float* w, const float* rstd, int T,
                        int H, const Workspace& ws) override {
    timed(t_.other_s, [&] { be_.rmsnorm_backward(dx, dw, dout, x, w, rstd, T, H, ws); });
  }
  void gelu_forward(void* out, const void* in, i64 n) override {
    timed(t_.other_s, [&] { be_.gelu_forward(out, in, n); });
  }
  void gelu_backward(void* din, const void* dout, const void* in, i64 n) override {
    timed(t_.other_s, [&] { be_.gelu_backward(din, dout, in, n); });
  }
  void swiglu_forward(void* out, const void* gu, int T, int F) override {
    timed(t_.other_s, [&] { be_.swiglu_forward(out, gu, T, F); });
  }
  void swiglu_backward(void* dgu, const void* gu, int T, int F) override {
    timed(t_.other_s, [&] { be_.swiglu_backward(dgu, gu, T, F); });
  }
  void rope_forward(void* x, int T, int Z, int A, i64 pos0, const RopeTable& r, int ld) override {
    timed(t_.other_s, [&] { be_.rope_forward(x, T, Z, A, pos0, r, ld); });
  }
  void rope_backward(void* dx, int T, int Z, int A, i64 pos0, const RopeTable& r, int ld) override {
    timed(t_.other_s, [&] { be_.rope_backward(dx, T, Z, A, pos0, r, ld); });
  }
  void add_inplace(void* y, const void* x, i64 n) override { timed(t_.other_s, [&] { be_.add_inplace(y, x, n); }); }
  void copy_2d(void* dst, i64 dst_pitch, const void* src, i64 src_pitch, i64 width, i64 rows) override {
    timed(t_.other_s, [&] { be_.copy_2d(dst, dst_pitch, src, src_pitch, width, rows); });
  }
  void copy_cols(void* dst, const void* src, int T, int width, int ld_src, int col) override {
    timed(t_.other_s, [&] { be_.copy_cols(dst, src, T, width, ld_src, col); });
  }
  void put_cols(void* dst, const void* src, bool src_f32, int T, int width, int ld_dst, int col) override {
    timed(t_.other_s, [&] { be_.put_cols(dst, src, src_f32, T, width, ld_dst, col); });
  }
  void zero_cols(void* dst, int T, int width, int ld, int col) override {
    timed(t_.other_s, [&] { be_.zero_cols(dst, T, width, ld, col); });
  }
  void attention_forward(void* out, float* lse, const void* q, const std::vector<KVRef>& blocks, const AttnShape& d,
                         const Workspace& ws) override {
    timed(t_.attention_forward_s, [&] { be_.attention_forward(out, lse, q, blocks, d, ws); });
  }
  void attention_merge(void* out, float* lse, const void* part_out, const float* part_lse,
                       const AttnShape& d) override {
    timed(t_.attention_forward_s, [&] { be_.attention_merge(out, lse, part_out, part_lse, d); });
  }
  void attention_backward_delta(float* delta, const void* dout, const void* out, const AttnShape& d) override {
    timed(t_.attention_backward_s, [&] { be_.attention_backward_delta(delta, dout, out, d); });
  }
  void attention_backward(void* dq, const void* dout, const void* q, const std::vector<KVRef>& blocks,
                          const float* lse, const float* delta, const AttnShape& d, const Workspace& ws) override {
    timed(t_.attention_backward_s, [&] { be_.attention_backward(dq, dout, q, blocks, lse, delta, d, ws); });
  }
  void xent(void* dlogits, float* losses, double* loss_sum, float* logits, const std::int32_t* targets, int T, int V,
            float grad_scale, const Workspace& ws) override {
    timed(t_.other_s, [&] { be_.xent(dlogits, losses, loss_sum, logits, targets, T, V, grad_scale, ws); });
  }
  void row_logsumexp(float* lse, const float* logits, int T, int V) override {
    timed(t_.other_s, [&] { be_.row_logsumexp(lse, logits, T, V); });
  }
  void xent_shard(void* dlogits, float* losses, double* loss_sum, float* logits, const float* lse_parts, int parts,
                  const std::int32_t* targets, int T, int V, int v0, float grad_scale, const Workspace& ws) override {
    timed(t_.other_s, [&] {
      be_.xent_shard(dlogits, losses, loss_sum, logits, lse_parts, parts, targets, T, V, v0, grad_scale, ws);
    });
  }
  void softmax_rows(float* x, float* lse, i64 rows, int cols, bool with_lse) override {
    timed(t_.other_s, [&] { be_.softmax_rows(x, lse, rows, cols, with_lse); });
  }
  void softmax_backward_rows(float* dx, const float* p, i64 rows, int cols) override {
    timed(t_.other_s, [&] { be_.softmax_backward_rows(dx, p, rows, cols); });
  }
  double sum_squares(const float* g, i64 n) override {
    double r = 0;
    timed(t_.other_s, [&] { r = be_.sum_squares(g, n); });
    return r;
  }
  std::vector<double> sum_squares_spans(const float* g, const std::vector<std::pair<i64, i64>>& ranges) override {
    std::vector<double> r;
    timed(t_.other_s, [&] { r = be_.sum_squares_spans(g, ranges); });
    return r;
  }
  void scale(float* x, i64 n, float s) override { timed(t_.other_s, [&] { be_.scale(x, n, s); }); }
  void add_f32(float* y, const float* x, i64 n) override { timed(t_.other_s, [&] { be_.add_f32(y, x, n); }); }
  void adamw_spans(float* p, float* m, float* v, const float* g, const std::vector<AdamwSpan>& spans, float lr,
                   float beta1, float beta2, float eps, int t, void* p_act) override {
    timed(t_.other_s, [&] { be_.adamw_spans(p, m, v, g, spans, lr, beta1, beta2, eps, t, p_act); });
  }
  void adamw(float* p, float* m, float* v, const float* g, i64 n, float lr, float beta1, float beta2, float eps,
             float weight_decay, int t, void* p_act) override {
    timed(t_.other_s, [&] { be_.adamw(p, m, v, g, n, lr, beta1, beta2, eps, weight_decay, t, p_act); });
  }
  // Work of the host's processor beside the device's, not one of its kernels: not timed.
  void host_adamw(float* p, float* m, float* v, const float* g, i64 n, float lr, float beta1, float beta2, float eps,
                  float weight_decay, int t) override {
    be_.host_adamw(p, m, v, g, n, lr, beta1, beta2, eps, weight_decay, t);
  }
  double host_sum_squares(const float* g, i64 n) override { return be_.host_sum_squares(g, n); }
  void host_scale(float* x, i64 n, float s) override { be_.host_scale(x, n, s); }
  void to_act(void* dst, const float* src, i64 n) override { timed(t_.other_s, [&] { be_.to_act(dst, src, n); }); }
  void to_f32(float* dst, const void* src, i64 n) override { timed(t_.other_s, [&] { be_.to_f32(dst, src, n); }); }

 private:
  template <typename F>
  void timed(double& part, F&& f) {
    clock_->begin();
    f();
    clock_->end(&part);
  }

  Backend& be_;
  std::unique_ptr<StreamClock> clock_;
  KernelTimes t_;
};

}  // namespace sppo
