// The backend interface (docs/design.md 8): what model/ and runtime/ are written against, in the
// spirit of ggml-backend and MLX. One implementation per folder below src/backends; a
// program picks one at start-up (make_backend), and nothing above this header includes a
// backend's own headers or tests for one with #ifdef.
//
// Contract:
//  - Memory: the device tier's raw bytes come from device_alloc (the runtime's MemoryTier
//    keeps the budget and the byte accounting on top), the host tier's from host_alloc
//    (pinned on CUDA). Device memory is not addressable by the host except through the
//    copy functions (on the CPU backend it is, but callers do not rely on it).
//  - Kernels run in order on one compute stream and may return before they finish; the
//    copy streams run concurrently with it. synchronize() waits for the compute stream.
//  - Activations are `void*` of the backend's activation type (act(): F32, or BF16 on
//    CUDA); master weights, weight gradients, AdamW state, LayerNorm statistics, the
//    attention LSE and delta, and dK/dV accumulators are fp32 everywhere.
//  - Every kernel's semantics are those of the CPU kernels (backends/cpu/ops.h,
//    attention.h): same formulas, same accumulate-vs-overwrite rules, same argument order
//    (outputs, saved, inputs, weights, dims). Row strides are in elements; 0 means dense.
//  - Scratch: kernels that need scratch memory take it from the Workspace passed in,
//    carved from the device tier and sized by block_scratch / head_scratch, so that the
//    device budget covers every byte a step allocates.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <condition_variable>
#include <string>
#include <utility>
#include <vector>

#include "core/adamw.h"
#include "core/config.h"
#include "core/dims.h"
#include "core/layout.h"
#include "core/rope.h"

namespace sppo {

namespace comm {
class Comm;
}

// Completion of work submitted to a stream, with when it ran (for traces and for
// exposed-time accounting). Signalled by the backend from the host once the work is done.
// Times are seconds on std::chrono::steady_clock since its epoch, a clock every process of
// a machine shares, so that several ranks' traces line up.
class Event {
 public:
  // Blocks until the work has run; returns the seconds spent waiting.
  double wait();
  bool done() const;
  double start_s() const { return start_s_; }  // on the backend's clock
  double end_s() const { return end_s_; }
  // For backends: the work ran from start to end (seconds on the clock).
  void signal(double start_s, double end_s);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  double start_s_ = 0, end_s_ = 0;
};

// An ordered queue of copies that runs beside the compute stream (a CUDA stream on a copy
// engine; a worker thread on the CPU).
class CopyStream {
 public:
  virtual ~CopyStream() = default;
  // Copies `bytes` from src to dst once everything submitted before has; `then` (may be
  // empty) runs on the host after the copy, e.g. to release the source's memory.
  virtual std::shared_ptr<Event> copy(void* dst, const void* src, std::size_t bytes, std::function<void()> then) = 0;
  virtual void synchronize() = 0;
};

// Scratch memory handed to one kernel call (see the contract above).
struct Workspace {
  void* base = nullptr;
  std::size_t bytes = 0;
};

// A position whose token is not predicted (xent).
inline constexpr std::int32_t kNoTarget = -1;

// Attention of a block of queries against several key/value blocks (backends/cpu/attention.h).
// Grouped-query attention: Zkv key/value heads (0: Z), query head z reading key/value head
// z / (Z / Zkv); k, v and their dk, dv have Zkv heads of A columns.
struct AttnShape {
  int Tq = 0, Z = 0, A = 0;
  int Zkv = 0;
  i64 q_pos0 = 0;
  int ldq = 0, ldk = 0, ldv = 0, ldo = 0;  // row strides of q (and dq), k, v, out (and dout)
};
struct KVRef {
  const void* k = nullptr;  // [Tk, ldk] activations
  const void* v = nullptr;
  float* dk = nullptr;      // [Tk, ldk] fp32 accumulators (backward only)
  float* dv = nullptr;
  int Tk = 0;
  i64 k_pos0 = 0;
};

// Which kernels run attention (--attention): the backend's own; a fused attention library's
// (the CUDA backend: cuDNN's SDPA, backends/cuda/library_attention.h); or auto: per shape
// class as measured (prefer_attention), else the library wherever it takes a call.
enum class AttentionKernels { Auto, Own, Library };

// A shape class measured for --attention auto (sppo profile --backend cuda): calls of this
// head size, with a causal piece (a subsequence's own block) or with keys all before their
// queries, whose query rows are nearest `rows` (in ratio), run the library's kernels or not.
struct AttentionClassChoice {
  int head_size = 0;
  bool causal = false;
  int rows = 0;
  bool library = false;
};

// What runs a model's attention (Backend::prepare_attention): `library` true for a fused
// attention library's kernels (cuDNN's), false for the backend's own; `description` says
// which, and why auto fell back to the own kernels where it did.
struct AttentionServed {
  bool library = false;
  std::string description = "own kernels";
};

// A fused attention library's graphs built so far in this process, and the seconds their
// builds took (the first one's apart).
struct AttentionBuildStats {
  int graphs = 0;
  double seconds = 0, first_seconds = 0;
};

// Spans of the compute stream's work, timed without stopping the stream where the backend
// can: a GPU backend records an event at each end of a span and reads the events once the
// stream has run them (collect); the default, for backends whose kernels have finished when
// they return, synchronises at each end and reads the wall clock. `bench layer --breakdown`
// times every kernel of a step through one (bench/timed_backend.h).
class StreamClock {
 public:
  virtual ~StreamClock() = default;
  virtual void begin() = 0;
  // Ends the span begun last; its seconds are added to *total by collect() at the latest.
  virtual void end(double* total) = 0;
  // Waits for the stream's work and adds every span ended so far to its total.
  virtual void collect() = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;  // "cpu", "cuda"
  virtual DType act() const = 0;         // the activation type

  // ---- memory ---------------------------------------------------------------------------
  virtual std::size_t device_memory() const = 0;      // bytes the device has in all
  // The most the device tier can hold: on CUDA what device_alloc draws from (the memory free
  // at start less kDeviceReserveBytes for the CUDA context and libraries; its share where
  // several ranks drive the GPU), the budget a run takes unless --device-memory says
  // otherwise; 0 on the CPU, whose device tier is bounded by the machine alone.
  virtual std::size_t device_capacity() { return 0; }
  virtual void* device_alloc(std::size_t bytes) = 0;  // 64-byte aligned; null when out of memory
  virtual void device_free(void* p) = 0;
  virtual void* host_alloc(std::size_t bytes) = 0;    // pinned where that matters
  virtual void host_free(void* p) = 0;
  virtual std::unique_ptr<CopyStream> make_copy_stream() = 0;
  virtual std::unique_ptr<StreamClock> make_stream_clock();
  // Whether p is device memory that the host (and so MPI) cannot read: CUDA's device memory;
  // never on the CPU, whose device tier is host memory.
  virtual bool device_pointer(const void* p) const { return false; }
  // Blocking copies between host memory and device memory (after the compute stream's work).
  virtual void to_host(void* dst, const void* src, std::size_t bytes) = 0;
  virtual void to_device(void* dst, const void* src, std::size_t bytes) = 0;
  virtual void fill_zero(void* p, std::size_t bytes) = 0;  // on the compute stream
  virtual void synchronize() = 0;

  // Scratch bounds of one block's kernels on T rows, and of the head's (chunked logits).
  virtual KernelScratch block_scratch(const ModelConfig& c) const = 0;
  virtual KernelScratch head_scratch(const ModelConfig& c, int chunk) const = 0;

  // ---- kernels (on the compute stream) ---------------------------------------------------
  // c[M, N] = alpha op(a) op(b) + beta c, row-major; a, b of type ab, c of type cd.
  virtual void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const void* a, int lda, const void* b,
                    int ldb, float beta, void* c, int ldc, DType ab, DType cd) = 0;
  // out[T, O] = in[T, I] w^T + b (w [O, I] and b [O], or null, from the weights' working
  // copy in the activation type).
  virtual void linear_forward(void* out, const void* in, const void* w, const void* b, int T, int I, int O,
                              int ld_out, int ld_in) = 0;
  // din = dout w (null: skipped); dw += dout^T in; db += column sums of dout (null: skipped).
  virtual void linear_backward(void* din, float* dw, float* db, const void* dout, const void* in, const void* w,
                               int T, int I, int O, int ld_dout, int ld_in, const Workspace& ws) = 0;
  virtual void embedding_forward(void* out, const std::int32_t* ids, const float* embed, int T, int H, int V) = 0;
  virtual void embedding_backward(float* dembed, const void* dout, const std::int32_t* ids, int T, int H, int V) = 0;
  // Vocabulary-parallel embedding (tensor parallelism): this rank holds rows [v0, v0 + Vr)
  // of the table, embed [Vr, H]. out[T, H] (activations) = embed[ids[t] - v0] for ids in
  // that range and zeros for every other row, so that the sum over the ranks is the lookup.
  virtual void embedding_shard_forward(void* out, const std::int32_t* ids, const float* embed, int T, int H, int v0, int Vr) = 0;
  // dembed[Vr, H] += the rows of dout [T, H] whose ids are in [v0, v0 + Vr); others are skipped.
  virtual void embedding_shard_backward(float* dembed, const void* dout, const std::int32_t* ids, int T, int H, int v0, int Vr) = 0;
  virtual void layernorm_forward(void* out, float* mean, float* rstd, const void* x, const float* w,
                                 const float* b, int T, int H, float eps) = 0;
  virtual void layernorm_backward(void* dx, float* dw, float* db, const void* dout, const void* x, const float* w,
                                  const float* mean, const float* rstd, int T, int H, const Workspace& ws) = 0;
  // RMSNorm (Llama family): out = x * rstd * w, rstd[t] = 1 / sqrt(mean_j x[t, j]^2 + eps)
  // (fp32; rstd may be null, then not stored). Backward as layernorm_backward: dx and dw
  // ACCUMULATE (+=). A model's per-head norms run these on [T Z, A] rows (Note [Query/key
  // norms], model/gpt.h).
  virtual void rmsnorm_forward(void* out, float* rstd, const void* x, const float* w, int T, int H, float eps) = 0;
  virtual void rmsnorm_backward(void* dx, float* dw, const void* dout, const void* x, const float* w,
                                const float* rstd, int T, int H, const Workspace& ws) = 0;
  // The residual add and the norm after it: y[T, H] += x (activations), then out = the norm
  // of the new y, RMSNorm when rms (mean and b unused) else LayerNorm, as the two above. The
  // default runs add_inplace and the norm; a backend may do both in one pass over y, with
  // the same results to the bit.
  virtual void add_norm_forward(void* y, const void* x, void* out, float* mean, float* rstd, const float* w,
                                const float* b, int T, int H, float eps, bool rms);
  virtual void gelu_forward(void* out, const void* in, i64 n) = 0;
  virtual void gelu_backward(void* din, const void* dout, const void* in, i64 n) = 0;
  // SwiGLU (Llama family): gu [T, 2F] holds each row's gate (columns [0, F)) and up
  // ([F, 2F)); out [T, F] = silu(gate) * up, silu(g) = g / (1 + e^-g).
  virtual void swiglu_forward(void* out, const void* gu, int T, int F) = 0;
  // In place: on entry columns [0, F) of dgu [T, 2F] hold d out (columns [F, 2F) are free);
  // on exit dgu holds d gate | d up. gu as in forward (not dgu).
  virtual void swiglu_backward(void* dgu, const void* gu, int T, int F) = 0;
  // RoPE on Z heads of A dims of x [T, ld] at positions pos0 .. pos0 + T - 1, in place:
  // dims j and j + A/2 of each head rotate by pos * r.inv_freq[j], scaled by r.scale
  // (core/rope.h). Backward rotates back by the transpose (the same scale).
  virtual void rope_forward(void* x, int T, int Z, int A, i64 pos0, const RopeTable& r, int ld) = 0;
  virtual void rope_backward(void* dx, int T, int Z, int A, i64 pos0, const RopeTable& r, int ld) = 0;
  // y[n] += x[n], both activations.
  virtual void add_inplace(void* y, const void* x, i64 n) = 0;
  // `rows` rows of `width` bytes from src to dst, the rows `src_pitch` and `dst_pitch` bytes
  // apart: a block of any element type (the packing of an all-to-all's exchanges).
  virtual void copy_2d(void* dst, i64 dst_pitch, const void* src, i64 src_pitch, i64 width, i64 rows) = 0;
  // Columns [col, col + width) of src [T, ld_src] -> dense dst [T, width] (activations).
  virtual void copy_cols(void* dst, const void* src, int T, int width, int ld_src, int col) = 0;
  // Dense src [T, width] (activations, or fp32 when src_f32) -> columns of dst [T, ld_dst].
  virtual void put_cols(void* dst, const void* src, bool src_f32, int T, int width, int ld_dst, int col) = 0;
  virtual void zero_cols(void* dst, int T, int width, int ld, int col) = 0;
  virtual void attention_forward(void* out, float* lse, const void* q, const std::vector<KVRef>& blocks,
                                 const AttnShape& d, const Workspace& ws) = 0;
  // Joins a partial result over other keys (part_out [Tq, ldo], part_lse [Z, Tq], from a
  // disjoint key set) into out/lse by log-sum-exp: lse = log(e^lse + e^part_lse) and out the
  // two weighted by e^(their lse - lse). A row -inf in both stays out = 0, lse = -inf.
  virtual void attention_merge(void* out, float* lse, const void* part_out, const float* part_lse,
                               const AttnShape& d) = 0;
  virtual void attention_backward_delta(float* delta, const void* dout, const void* out, const AttnShape& d) = 0;
  // dq [Tq, ldq] (activations) and every block's dk/dv accumulate.
  virtual void attention_backward(void* dq, const void* dout, const void* q, const std::vector<KVRef>& blocks,
                                  const float* lse, const float* delta, const AttnShape& d, const Workspace& ws) = 0;
  // logits [T, V] fp32 are overwritten by (softmax - onehot(targets)) * grad_scale in
  // dlogits (activations; it may be logits itself when act() is F32); losses[T] per row;
  // *loss_sum (device double) ACCUMULATES their sum. A target of kNoTarget (-1) is not
  // predicted (masked-token training leaves most positions so): its row's loss and gradient
  // are 0.
  virtual void xent(void* dlogits, float* losses, double* loss_sum, float* logits, const std::int32_t* targets, int T,
                    int V, float grad_scale, const Workspace& ws) = 0;
  // lse[T] = log sum_v exp(logits[t, v]) over the V columns of fp32 logits [T, V] (read only).
  virtual void row_logsumexp(float* lse, const float* logits, int T, int V) = 0;
  // Cross-entropy over a vocabulary split across `parts` ranks, this one holding columns
  // [v0, v0 + V) as logits [T, V] fp32. lse_parts [parts, T]: every rank's row_logsumexp
  // (part p's T values contiguous); the row's lse is their log-sum-exp. Then
  // dlogits[t, :] = (exp(logits[t, :] - lse) - onehot(targets[t] - v0)) * grad_scale
  // (the onehot only when targets[t] is in [v0, v0 + V)); losses[t] = lse - logits[t, targets[t] - v0]
  // when the target is in this rank's range, else 0, so that the ranks' losses sum to the
  // row's loss; *loss_sum (device double) ACCUMULATES the sum of this rank's losses. A
  // target of kNoTarget: loss 0 and a zero gradient row. dlogits may be logits itself
  // when act() is F32 (as in xent); else it is an activation-typed [T, V] buffer.
  virtual void xent_shard(void* dlogits, float* losses, double* loss_sum, float* logits, const float* lse_parts, int parts,
                          const std::int32_t* targets, int T, int V, int v0, float grad_scale, const Workspace& ws) = 0;

  // ---- attention kernels (--attention) ----------------------------------------------------
  // Readies attention for a model's heads and says what serves it. Throws sppo::Error where
  // the kernels asked for (make_backend's `attention`) cannot serve the model, naming what
  // would. Call before block_scratch: the scratch follows the choice.
  virtual AttentionServed prepare_attention(const ModelConfig& c) { return {}; }
  // The measured classes --attention auto follows; empty: the library wherever it takes a call.
  virtual void prefer_attention(const std::vector<AttentionClassChoice>& classes) {}
  virtual AttentionBuildStats attention_build_stats() const { return {}; }

  // ---- communication between ranks (--comm) ---------------------------------------------
  // NCCL between the ranks' devices over `host` (the MPI world, which carries NCCL's id),
  // made collectively. Throws sppo::Error where the backend has none (the CPU's, a CUDA build
  // without NCCL), naming what would run.
  virtual std::unique_ptr<comm::Comm> make_nccl_comm(comm::Comm& host);

  // ---- softmax over rows of materialised scores (fp32; the two-pass ring, runtime/ring.h) --
  // forward: x[rows, cols] becomes softmax(x) per row and lse[rows] its log-sum-exp;
  // with_lse: x becomes exp(x - lse) from a given lse (the softmax again, in backward).
  virtual void softmax_rows(float* x, float* lse, i64 rows, int cols, bool with_lse) = 0;
  // dx[rows, cols] (on entry d softmax) becomes d scores = p * (dx - rowsum(dx * p)).
  virtual void softmax_backward_rows(float* dx, const float* p, i64 rows, int cols) = 0;

  // ---- optimizer (fp32 device arrays) ----------------------------------------------------
  virtual double sum_squares(const float* g, i64 n) = 0;  // synchronises
  virtual void scale(float* x, i64 n, float s) = 0;
  // y[n] += x[n] in fp32 (a gradient added to a sum kept over several sequences).
  virtual void add_f32(float* y, const float* x, i64 n) = 0;
  // AdamW as backends/cpu/ops.h adamw_step; p_act (may be null): the activation-typed
  // working copy of p, refreshed.
  virtual void adamw(float* p, float* m, float* v, const float* g, i64 n, float lr, float beta1, float beta2, float eps,
                     float weight_decay, int t, void* p_act) = 0;
  // adamw on every span (core/adamw.h), p_act (may be null) indexed as p: a step's update of
  // all its tensors in as few kernels as the backend can. The default: one adamw a span.
  virtual void adamw_spans(float* p, float* m, float* v, const float* g, const std::vector<AdamwSpan>& spans,
                           float lr, float beta1, float beta2, float eps, int t, void* p_act);
  // sum_squares of each range [first, first + second) of g, in order, with one wait for the
  // device where the default waits once a range (the gradient norm's one synchronisation).
  virtual std::vector<double> sum_squares_spans(const float* g, const std::vector<std::pair<i64, i64>>& ranges);
  // dst[n] = src[n] converted from fp32 to the activation type (the weights' working copy).
  virtual void to_act(void* dst, const float* src, i64 n) = 0;
  // dst[n] = src[n] converted from the activation type to fp32 (a sum's fp32 operands).
  virtual void to_f32(float* dst, const void* src, i64 n) = 0;
  // AdamW on host memory (p, m, v, g all from host_alloc), run by the host's processor on
  // the calling thread: the update of optimizer state kept on the host
  // (runtime/host_optimizer.h). The formula of adamw; on the CPU backend its very kernel,
  // so the two agree bitwise.
  virtual void host_adamw(float* p, float* m, float* v, const float* g, i64 n, float lr, float beta1, float beta2,
                          float eps, float weight_decay, int t) = 0;
  // sum_squares and scale of host memory on the host's processor: the gradients' norm and
  // clipping where the gradients are on the host (--weights host, Note [Weights on the
  // host] in schedule/weights.h). On the CPU backend its very kernels, so the norm is the
  // device path's to the bit.
  virtual double host_sum_squares(const float* g, i64 n) = 0;
  virtual void host_scale(float* x, i64 n, float s) = 0;
};

// What the CUDA backend leaves free on its GPU for the CUDA context, cuBLASLt's workspaces,
// cuDNN and NCCL, which allocate outside the device tier.
inline constexpr std::size_t kDeviceReserveBytes = std::size_t{2} << 30;

// Which device a process drives, and how many processes of its machine share that device
// (CUDA ranks sharing one GPU: each takes its share of the device's memory).
struct DevicePlacement {
  int device = -1;  // -1: the default (the first)
  int sharing = 1;
};

// The backends this program was built with: "cpu" always; "cuda" when built with it
// (SPPO_CUDA) and a GPU is visible.
std::vector<std::string> available_backends();
// `name`: cpu | cuda | auto (cuda when available, else cpu); `precision`: fp32 | bf16
// ("" : the backend's default, bf16 on CUDA); `attention`: auto | own | cudnn (--attention).
// Throws sppo::Error naming what is missing.
std::unique_ptr<Backend> make_backend(const std::string& name, const std::string& precision = "",
                                      const std::string& attention = "auto", const DevicePlacement& place = {});
// --attention's kernel word: auto, own, cudnn. Throws sppo::Error for another.
AttentionKernels parse_attention_kernels(const std::string& word);

}  // namespace sppo
