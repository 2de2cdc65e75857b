#include "backends/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <vector>

#include "backend/attention_pieces.h"
#include "backends/cuda/attention.h"
#include "backends/cuda/check.h"
#include "backends/cuda/library_attention.h"
#include "backends/cuda/nccl_comm.h"
#include "backends/cuda/ops.h"
#include "core/adamw.h"
#include "comm/comm.h"
#include "core/check.h"

namespace sppo {

namespace {

double steady_now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Note [One slab]: the device tier's memory is one cudaMalloc'd slab, carved first-fit
// with 256-byte alignment and coalesced on free, so that allocation costs no CUDA call and
// no synchronisation, and a block freed from a copy stream's host callback (an offload's
// release) is bookkeeping only (no CUDA call may run there). The runtime's MemoryTier keeps
// the budget and the byte counts above it; the slab only has to be large enough. Its last
// kGuard bytes are never handed out: a library attention call with a padding mask may read a
// tile of rows past a tensor's last row (Note [Length classes] in sdpa.h), which must stay
// inside the allocation.
class Slab {
 public:
  static constexpr std::size_t kAlign = 256;
  static constexpr std::size_t kGuard = std::size_t{64} << 20;

  // sharing: processes that drive this device, each with its share of the memory.
  explicit Slab(int sharing) : sharing_(std::max(1, sharing)) {}

  ~Slab() {
    if (base_) cudaFree(base_);
  }

  // The bytes it can hand out in all (the slab is reserved on first use).
  std::size_t capacity() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!base_) reserve();
    return capacity_;
  }

  void* alloc(std::size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!base_) reserve();
    const std::size_t need = std::max<std::size_t>(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < need) continue;
      const std::size_t at = it->first, left = it->second - need;
      free_.erase(it);
      if (left > 0) free_[at + need] = left;
      used_[at] = need;
      return base_ + at;
    }
    return nullptr;
  }

  void free(void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    const std::size_t at = std::size_t(static_cast<char*>(p) - base_);
    auto u = used_.find(at);
    SPPO_ASSERT_MSG(u != used_.end(), "free of a device pointer the slab did not give out");
    std::size_t size = u->second;
    used_.erase(u);
    auto next = free_.lower_bound(at);
    if (next != free_.end() && next->first == at + size) {
      size += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == at) {
        prev->second += size;
        return;
      }
    }
    free_[at] = size;
  }

 private:
  // All the memory the device has free, less a reserve for cuBLASLt's workspaces, the
  // kernels' stream-ordered scratch and the CUDA context.
  // Where several processes share the device, each takes at most its share of the whole.
  void reserve() {
    std::size_t free_bytes = 0, total = 0;
    SPPO_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
    constexpr std::size_t kReserve = kDeviceReserveBytes;
    SPPO_CHECK(free_bytes > kReserve + kGuard, "backend") << "the GPU has only " << free_bytes << " bytes free";
    const std::size_t share = total / std::size_t(sharing_) > kReserve ? total / std::size_t(sharing_) - kReserve : 0;
    SPPO_CHECK(share > kGuard, "backend") << sharing_ << " ranks share a GPU of " << total
                                          << " bytes: too little for each; start fewer ranks on it";
    const std::size_t bytes = std::min(free_bytes - kReserve, share) / kAlign * kAlign;
    void* p = nullptr;
    SPPO_CUDA_CHECK(cudaMalloc(&p, bytes));
    base_ = static_cast<char*>(p);
    free_[0] = capacity_ = bytes - kGuard;
  }

  int sharing_;
  std::mutex mu_;
  char* base_ = nullptr;
  std::size_t capacity_ = 0;
  std::map<std::size_t, std::size_t> free_, used_;  // offset -> bytes
};

// A copy stream: a CUDA stream that first waits for the compute stream's work submitted so
// far (the data to copy out exists; a reused destination is no longer read), then copies;
// host functions before and after record when it ran and run the caller's `then`.
class CudaCopyStream final : public CopyStream {
 public:
  explicit CudaCopyStream(cudaStream_t compute) : compute_(compute) {
    SPPO_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~CudaCopyStream() override {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }

  std::shared_ptr<Event> copy(void* dst, const void* src, std::size_t bytes, std::function<void()> then) override {
    auto* task = new Task{std::move(then), std::make_shared<Event>(), 0};
    cudaEvent_t ready;
    SPPO_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    SPPO_CUDA_CHECK(cudaEventRecord(ready, compute_));
    SPPO_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready, 0));
    SPPO_CUDA_CHECK(cudaEventDestroy(ready));  // released once the wait has happened
    SPPO_CUDA_CHECK(cudaLaunchHostFunc(stream_, &CudaCopyStream::started, task));
    SPPO_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
    SPPO_CUDA_CHECK(cudaLaunchHostFunc(stream_, &CudaCopyStream::finished, task));
    return task->done;
  }

  void synchronize() override { SPPO_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

 private:
  struct Task {
    std::function<void()> then;
    std::shared_ptr<Event> done;
    double start_s;
  };
  static void started(void* p) { static_cast<Task*>(p)->start_s = steady_now_s(); }
  static void finished(void* p) {
    Task* t = static_cast<Task*>(p);
    if (t->then) t->then();
    t->done->signal(t->start_s, steady_now_s());
    delete t;
  }

  cudaStream_t compute_;
  cudaStream_t stream_;
};

// Note [Kernel times from events]: a span of the compute stream is timed by two events
// recorded around it, read once the stream has passed them, so that timing every kernel of a
// step neither stops the stream between kernels nor counts a launch's host-side cost as the
// kernel's: what the kernels leave of the step is the time between them (launch gaps, waits
// for the host, synchronisations). Events are kept and reused across collects.
class EventClock final : public StreamClock {
 public:
  explicit EventClock(cudaStream_t stream) : stream_(stream) {}
  ~EventClock() override {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  void begin() override { open_ = record(); }
  void end(double* total) override {
    SPPO_ASSERT_MSG(open_ >= 0, "StreamClock::end without begin");
    spans_.push_back({std::size_t(open_), std::size_t(record()), total});
    open_ = -1;
  }
  void collect() override {
    SPPO_CUDA_CHECK(cudaStreamSynchronize(stream_));
    for (const Span& s : spans_) {
      float ms = 0;
      SPPO_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[s.start], events_[s.stop]));
      *s.total += double(ms) * 1e-3;
    }
    spans_.clear();
    used_ = 0;
  }

 private:
  struct Span {
    std::size_t start, stop;
    double* total;
  };
  long record() {
    if (used_ == events_.size()) {
      cudaEvent_t e;
      SPPO_CUDA_CHECK(cudaEventCreate(&e));
      events_.push_back(e);
    }
    SPPO_CUDA_CHECK(cudaEventRecord(events_[used_], stream_));
    return long(used_++);
  }

  cudaStream_t stream_;
  std::vector<cudaEvent_t> events_;
  std::size_t used_ = 0;
  long open_ = -1;
  std::vector<Span> spans_;
};

cuda::AttnDims dims_of(const AttnShape& s) {
  cuda::AttnDims d;
  d.Tq = s.Tq;
  d.Z = s.Z;
  d.A = s.A;
  d.q_pos0 = s.q_pos0;
  d.ldq = s.ldq, d.ldk = s.ldk, d.ldv = s.ldv, d.ldo = s.ldo;
  d.Zkv = s.Zkv;
  return d;
}

std::vector<cuda::KVBlock> blocks_of(const std::vector<KVRef>& refs) {
  std::vector<cuda::KVBlock> b;
  b.reserve(refs.size());
  for (const KVRef& r : refs) b.push_back({r.k, r.v, r.dk, r.dv, r.Tk, r.k_pos0});
  return b;
}

// Note [Pinned host pool]: the host tier's blocks are page-locked (cudaHostAlloc), so that
// the copy streams' transfers run at the link's rate and overlap compute. Pinning is slow
// (the pages are faulted in and locked, a few GB/s) and cudaFreeHost waits for the whole
// device, so a step that pinned and unpinned its offloaded activations paid for both every
// step, outside the copies (seen on an H200: full offload 6x the step time of none, with
// 0.06 s of exposed copies). Freed blocks are kept by size class and handed out again; a
// step's allocations repeat the last step's, so after the first step nothing is pinned.
// Classes round a request up by at most 1/16; release is bookkeeping only, so a copy
// stream's host callback may free. The runtime frees a block only after the transfers that
// use it have completed (as the CPU backend, where a free is immediate, requires).
class PinnedPool {
 public:
  ~PinnedPool() { trim(); }

  void* alloc(std::size_t bytes) {
    const std::size_t size = size_class(bytes);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = cached_.find(size);
      if (it != cached_.end()) {
        void* p = it->second;
        cached_.erase(it);
        sizes_[p] = size;
        return p;
      }
    }
    void* p = nullptr;
    if (cudaHostAlloc(&p, size, cudaHostAllocDefault) != cudaSuccess) {
      (void)cudaGetLastError();
      trim();  // the cached blocks of other sizes may be what stands in the way
      if (cudaHostAlloc(&p, size, cudaHostAllocDefault) != cudaSuccess) {
        (void)cudaGetLastError();
        return nullptr;
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    sizes_[p] = size;
    return p;
  }

  void free(void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sizes_.find(p);
    SPPO_ASSERT_MSG(it != sizes_.end(), "free of a host pointer the pinned pool did not give out");
    cached_.emplace(it->second, p);
    sizes_.erase(it);
  }

  // Unpins every cached block (none may be in use by a transfer: see the Note).
  void trim() {
    std::multimap<std::size_t, void*> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      drop.swap(cached_);
    }
    for (const auto& [size, p] : drop) cudaFreeHost(p);
  }

 private:
  // Up to 64 KiB: whole 4 KiB pages; above, 16 steps per power of two.
  static std::size_t size_class(std::size_t bytes) {
    bytes = std::max<std::size_t>(bytes, 64);
    if (bytes <= (std::size_t{64} << 10)) return (bytes + 4095) / 4096 * 4096;
    std::size_t step = 4096;
    while (step * 16 * 2 <= bytes) step *= 2;  // step = 2^floor(log2(bytes)) / 16
    return (bytes + step - 1) / step * step;
  }

  std::mutex mu_;
  std::multimap<std::size_t, void*> cached_;  // free blocks by class size
  std::map<void*, std::size_t> sizes_;        // blocks in use and their class size
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(DType act, AttentionKernels kernels, const DevicePlacement& place)
      : act_(act), kernels_(kernels), slab_(place.sharing) {
    if (place.device >= 0) SPPO_CUDA_CHECK(cudaSetDevice(place.device));
    SPPO_CUDA_CHECK(cudaStreamCreateWithFlags(&compute_, cudaStreamNonBlocking));
    blas_ = std::make_unique<cuda::Blas>();
    if (kernels_ != AttentionKernels::Own) open_library();
    library_usable_ = library_ && act_ == DType::BF16;
  }
  ~CudaBackend() override {
    cudaStreamSynchronize(compute_);
    library_.reset();
    blas_.reset();
    cudaStreamDestroy(compute_);
  }

  const char* name() const override { return "cuda"; }
  DType act() const override { return act_; }

  std::size_t device_memory() const override {
    std::size_t free_bytes = 0, total = 0;
    SPPO_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
    return total;
  }
  std::size_t device_capacity() override { return slab_.capacity(); }
  void* device_alloc(std::size_t bytes) override { return slab_.alloc(bytes); }
  void device_free(void* p) override { slab_.free(p); }
  void* host_alloc(std::size_t bytes) override { return pinned_.alloc(bytes); }
  // May run in a copy stream's host callback, where no CUDA call is allowed: bookkeeping
  // only (Note [Pinned host pool]).
  void host_free(void* p) override { pinned_.free(p); }
  bool device_pointer(const void* p) const override {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      (void)cudaGetLastError();  // memory CUDA does not know: the host's
      return false;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
  }
  std::unique_ptr<CopyStream> make_copy_stream() override { return std::make_unique<CudaCopyStream>(compute_); }
  std::unique_ptr<StreamClock> make_stream_clock() override { return std::make_unique<EventClock>(compute_); }
  void to_host(void* dst, const void* src, std::size_t bytes) override {
    SPPO_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, compute_));
    SPPO_CUDA_CHECK(cudaStreamSynchronize(compute_));
  }
  void to_device(void* dst, const void* src, std::size_t bytes) override {
    SPPO_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, compute_));
    SPPO_CUDA_CHECK(cudaStreamSynchronize(compute_));  // the host source may go away
  }
  void fill_zero(void* p, std::size_t bytes) override { SPPO_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, compute_)); }
  void synchronize() override {
    SPPO_CUDA_CHECK(cudaStreamSynchronize(compute_));
  }

  // The CUDA kernels take their small scratch (row-block partials, the loss and norm
  // reductions, the embedding sort) from CUDA's stream-ordered pool, outside the budget; a
  // fused attention library's calls take theirs from the block's scratch, so that the device
  // budget covers it (Note [Library scratch] in backend/attention_pieces.h).
  KernelScratch block_scratch(const ModelConfig& c) const override {
    return serve(c, false).library ? library_attention_scratch(c, std::size_t(dtype_bytes(act_))) : KernelScratch{};
  }
  KernelScratch head_scratch(const ModelConfig&, int) const override { return {}; }

  void gemm(bool ta, bool tb, int M, int N, int K, float alpha, const void* a, int lda, const void* b, int ldb,
            float beta, void* c, int ldc, DType ab, DType cd) override {
    cuda::gemm(*blas_, ta, tb, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc, ab, cd, compute_);
  }
  void linear_forward(void* out, const void* in, const void* w, const void* b, int T, int I, int O, int ld_out,
                      int ld_in) override {
    cuda::linear_forward(*blas_, out, in, w, b, T, I, O, act_, compute_, ld_out, ld_in);
  }
  void linear_backward(void* din, float* dw, float* db, const void* dout, const void* in, const void* w, int T, int I,
                       int O, int ld_dout, int ld_in, const Workspace&) override {
    cuda::linear_backward(*blas_, din, dw, db, dout, in, w, T, I, O, act_, compute_, ld_dout, ld_in);
  }
  void embedding_forward(void* out, const std::int32_t* ids, const float* embed, int T, int H, int V) override {
    cuda::embedding_forward(out, ids, embed, T, H, V, act_, compute_);
  }
  void embedding_backward(float* dembed, const void* dout, const std::int32_t* ids, int T, int H, int V) override {
    cuda::embedding_backward(dembed, dout, ids, T, H, V, act_, compute_);
  }
  void embedding_shard_forward(void* out, const std::int32_t* ids, const float* embed, int T, int H, int v0,
                               int Vr) override {
    cuda::embedding_shard_forward(out, ids, embed, T, H, v0, Vr, act_, compute_);
  }
  void embedding_shard_backward(float* dembed, const void* dout, const std::int32_t* ids, int T, int H, int v0,
                                int Vr) override {
    cuda::embedding_shard_backward(dembed, dout, ids, T, H, v0, Vr, act_, compute_);
  }
  void layernorm_forward(void* out, float* mean, float* rstd, const void* x, const float* w, const float* b, int T,
                         int H, float eps) override {
    cuda::layernorm_forward(out, mean, rstd, x, w, b, T, H, eps, act_, compute_);
  }
  void layernorm_backward(void* dx, float* dw, float* db, const void* dout, const void* x, const float* w,
                          const float* mean, const float* rstd, int T, int H, const Workspace&) override {
    cuda::layernorm_backward(dx, dw, db, dout, x, w, mean, rstd, T, H, act_, compute_);
  }
  void add_norm_forward(void* y, const void* x, void* out, float* mean, float* rstd, const float* w, const float* b,
                        int T, int H, float eps, bool rms) override {
    cuda::add_norm_forward(y, x, out, mean, rstd, w, b, T, H, eps, rms, act_, compute_);
  }
  void rmsnorm_forward(void* out, float* rstd, const void* x, const float* w, int T, int H, float eps) override {
    cuda::rmsnorm_forward(out, rstd, x, w, T, H, eps, act_, compute_);
  }
  void rmsnorm_backward(void* dx, float* dw, const void* dout, const void* x, const float* w, const float* rstd, int T,
                        int H, const Workspace&) override {
    cuda::rmsnorm_backward(dx, dw, dout, x, w, rstd, T, H, act_, compute_);
  }
  void gelu_forward(void* out, const void* in, i64 n) override { cuda::gelu_forward(out, in, n, act_, compute_); }
  void gelu_backward(void* din, const void* dout, const void* in, i64 n) override {
    cuda::gelu_backward(din, dout, in, n, act_, compute_);
  }
  void swiglu_forward(void* out, const void* gu, int T, int F) override {
    cuda::swiglu_forward(out, gu, T, F, act_, compute_);
  }
  void swiglu_backward(void* dgu, const void* gu, int T, int F) override {
    cuda::swiglu_backward(dgu, gu, T, F, act_, compute_);
  }
  void rope_forward(void* x, int T, int Z, int A, i64 pos0, const RopeTable& r, int ld) override {
    cuda::rope_forward(x, T, Z, A, pos0, r, ld, act_, compute_);
  }
  void rope_backward(void* dx, int T, int Z, int A, i64 pos0, const RopeTable& r, int ld) override {
    cuda::rope_backward(dx, T, Z, A, pos0, r, ld, act_, compute_);
  }
  void add_inplace(void* y, const void* x, i64 n) override { cuda::add_inplace(y, act_, x, act_, n, compute_); }
  void copy_2d(void* dst, i64 dst_pitch, const void* src, i64 src_pitch, i64 width, i64 rows) override {
    if (rows == 0 || width == 0) return;
    SPPO_CUDA_CHECK(cudaMemcpy2DAsync(dst, std::size_t(dst_pitch), src, std::size_t(src_pitch), std::size_t(width),
                                      std::size_t(rows), cudaMemcpyDeviceToDevice, compute_));
  }
  void copy_cols(void* dst, const void* src, int T, int width, int ld_src, int col) override {
    cuda::copy_cols(dst, act_, src, act_, T, width, ld_src, col, compute_);
  }
  void put_cols(void* dst, const void* src, bool src_f32, int T, int width, int ld_dst, int col) override {
    cuda::put_cols(dst, act_, src, src_f32 ? DType::F32 : act_, T, width, ld_dst, col, compute_);
  }
  void zero_cols(void* dst, int T, int width, int ld, int col) override {
    cuda::zero_cols(dst, act_, T, width, ld, col, compute_);
  }
  void attention_forward(void* out, float* lse, const void* q, const std::vector<KVRef>& blocks, const AttnShape& d,
                         const Workspace& ws) override {
    if (use_library(d, blocks) && ran_on_library(library_->forward(out, lse, q, blocks, d, ws, compute_))) return;
    cuda::attention_forward_blocks(out, lse, q, blocks_of(blocks), dims_of(d), act_, compute_);
  }
  void attention_merge(void* out, float* lse, const void* part_out, const float* part_lse,
                       const AttnShape& d) override {
    cuda::attention_merge(out, lse, part_out, part_lse, dims_of(d), act_, compute_);
  }
  void attention_backward_delta(float* delta, const void* dout, const void* out, const AttnShape& d) override {
    cuda::attention_backward_delta(delta, dout, out, dims_of(d), act_, compute_);
  }
  void attention_backward(void* dq, const void* dout, const void* q, const std::vector<KVRef>& blocks,
                          const float* lse, const float* delta, const AttnShape& d, const Workspace& ws) override {
    if (use_library(d, blocks) &&
        ran_on_library(library_->backward(dq, dout, q, blocks, lse, delta, d, ws, compute_)))
      return;
    cuda::attention_backward_blocks(dq, dout, q, blocks_of(blocks), lse, delta, dims_of(d), act_, compute_);
  }
  void xent(void* dlogits, float* losses, double* loss_sum, float* logits, const std::int32_t* targets, int T, int V,
            float grad_scale, const Workspace&) override {
    cuda::xent_forward_backward(dlogits, act_, losses, loss_sum, logits, targets, T, V, grad_scale, compute_);
  }
  void row_logsumexp(float* lse, const float* logits, int T, int V) override {
    cuda::row_logsumexp(lse, logits, T, V, compute_);
  }
  void xent_shard(void* dlogits, float* losses, double* loss_sum, float* logits, const float* lse_parts, int parts,
                  const std::int32_t* targets, int T, int V, int v0, float grad_scale, const Workspace&) override {
    cuda::xent_shard(dlogits, act_, losses, loss_sum, logits, lse_parts, parts, targets, T, V, v0, grad_scale,
                     compute_);
  }
  double sum_squares(const float* g, i64 n) override {
    double* d = nullptr;
    SPPO_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&d), sizeof(double), compute_));
    SPPO_CUDA_CHECK(cudaMemsetAsync(d, 0, sizeof(double), compute_));
    cuda::sum_squares(d, g, n, compute_);
    double result = 0;
    SPPO_CUDA_CHECK(cudaMemcpyAsync(&result, d, sizeof result, cudaMemcpyDeviceToHost, compute_));
    SPPO_CUDA_CHECK(cudaFreeAsync(d, compute_));
    SPPO_CUDA_CHECK(cudaStreamSynchronize(compute_));
    return result;
  }
  std::vector<double> sum_squares_spans(const float* g, const std::vector<std::pair<i64, i64>>& ranges) override {
    std::vector<double> sums(ranges.size());
    if (ranges.empty()) return sums;
    const std::size_t bytes = sizeof(double) * ranges.size();
    double* d = nullptr;
    SPPO_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&d), bytes, compute_));
    SPPO_CUDA_CHECK(cudaMemsetAsync(d, 0, bytes, compute_));
    for (std::size_t i = 0; i < ranges.size(); ++i) cuda::sum_squares(d + i, g + ranges[i].first, ranges[i].second, compute_);
    SPPO_CUDA_CHECK(cudaMemcpyAsync(sums.data(), d, bytes, cudaMemcpyDeviceToHost, compute_));
    SPPO_CUDA_CHECK(cudaFreeAsync(d, compute_));
    SPPO_CUDA_CHECK(cudaStreamSynchronize(compute_));
    return sums;
  }
  void scale(float* x, i64 n, float s) override { cuda::scale_inplace(x, n, s, compute_); }
  void add_f32(float* y, const float* x, i64 n) override {
    cuda::add_inplace(y, DType::F32, x, DType::F32, n, compute_);
  }
  AttentionServed prepare_attention(const ModelConfig& c) override { return serve(c, true); }
  void prefer_attention(const std::vector<AttentionClassChoice>& classes) override { classes_ = classes; }
  std::unique_ptr<comm::Comm> make_nccl_comm(comm::Comm& host) override {
    return cuda::make_nccl_comm(host, compute_);
  }
  AttentionBuildStats attention_build_stats() const override {
    if (!library_) return {};
    const auto s = library_->library().build_stats();
    return {s.graphs, s.seconds, s.first_seconds};
  }

  void softmax_rows(float* x, float* lse, i64 rows, int cols, bool with_lse) override {
    cuda::softmax_rows(x, lse, rows, cols, with_lse, compute_);
  }
  void softmax_backward_rows(float* dx, const float* p, i64 rows, int cols) override {
    cuda::softmax_backward_rows(dx, p, rows, cols, compute_);
  }
  void adamw_spans(float* p, float* m, float* v, const float* g, const std::vector<AdamwSpan>& spans, float lr,
                   float beta1, float beta2, float eps, int t, void* p_act) override {
    cuda::adamw_spans(p, m, v, g, spans.data(), int(spans.size()), lr, beta1, beta2, eps, t, compute_, p_act);
  }
  void adamw(float* p, float* m, float* v, const float* g, i64 n, float lr, float beta1, float beta2, float eps,
             float weight_decay, int t, void* p_act) override {
    cuda::adamw_step(p, m, v, g, n, lr, beta1, beta2, eps, weight_decay, t, compute_, p_act);
  }
  void to_f32(float* dst, const void* src, i64 n) override {
    if (dst != src) cuda::convert(dst, DType::F32, src, act_, n, compute_);
  }
  void to_act(void* dst, const float* src, i64 n) override {
    if (dst != src) cuda::convert(dst, act_, src, DType::F32, n, compute_);
  }
  // The formula of the CPU backend's adamw_step and of the GPU's kernel (core/adamw.h). The
  // GPU's kernel contracts its products into FMAs where the host compiler need not, so the
  // two agree to fp32 rounding, not bitwise.
  void host_adamw(float* p, float* m, float* v, const float* g, i64 n, float lr, float beta1, float beta2, float eps,
                  float weight_decay, int t) override {
    const AdamwScalars k = adamw_scalars(lr, beta1, beta2, eps, weight_decay, t);
#pragma omp parallel for schedule(static)
    for (i64 i = 0; i < n; ++i) p[i] = adamw_update(p[i], m[i], v[i], g[i], k);
  }
  double host_sum_squares(const float* g, i64 n) override {
    double s = 0;
#pragma omp parallel for schedule(static) reduction(+ : s)
    for (i64 i = 0; i < n; ++i) s += double(g[i]) * g[i];
    return s;
  }
  void host_scale(float* x, i64 n, float s) override {
#pragma omp parallel for schedule(static)
    for (i64 i = 0; i < n; ++i) x[i] *= s;
  }

 private:
  // cuDNN's fused attention; where it cannot open, --attention cudnn ends here and auto
  // keeps the reason for prepare_attention.
  void open_library() {
    try {
      const char* lengths = std::getenv("SPPO_CUDNN_LENGTHS");  // Note [Length classes] in sdpa.h
      const bool exact = lengths && std::string(lengths) == "exact";
      library_ = std::make_unique<cuda::LibraryAttention>(cuda::open_cudnn_sdpa(), act_, !exact);
    } catch (const Error& e) {
      if (kernels_ == AttentionKernels::Library) throw;
      library_error_ = e.what();
    }
  }

  // What runs a model's attention; `refuse`: --attention cudnn where the library cannot
  // serve it ends here, naming what would.
  AttentionServed serve(const ModelConfig& c, bool refuse) const {
    if (kernels_ == AttentionKernels::Own) return {false, "own kernels (--attention own)"};
    if (!library_) return {false, "own kernels (" + library_error_ + ")"};
    const bool must = refuse && kernels_ == AttentionKernels::Library;
    const std::string lib = library_->library().name();
    if (act_ != DType::BF16) {
      SPPO_CHECK(!must, "attention") << "--attention cudnn: " << lib << "'s fused attention computes in bf16, and "
                                     << "this run's activations are fp32; use --precision bf16, or --attention own "
                                     << "for fp32";
      return {false, "own kernels (fp32 activations; " + lib + " computes in bf16)"};
    }
    // The model's calls: q and dq at Z A (the forward, a Llama block's backward; H for GPT's
    // heads) or at 3H (a GPT block's backward reads q where its dq goes, in dqkv).
    std::string why;
    for (const int ldq : {c.q_width(), 3 * c.hidden}) {
      AttnShape d;
      d.Z = c.heads, d.Zkv = c.kv_head_count(), d.A = c.head_size();
      d.ldq = ldq, d.ldo = c.q_width(), d.ldk = d.ldv = c.kv_width();
      if (why.empty()) why = library_->check(d);
    }
    if (!why.empty()) {
      SPPO_CHECK(!must, "attention") << "--attention cudnn: " << lib << " cannot take this model's attention ("
                                     << why << "); use --attention own, or auto (the own kernels wherever cuDNN "
                                     << "refuses)";
      return {false, "own kernels (" + lib + " refuses the model's heads: " + why + ")"};
    }
    return {true, lib + " fused attention" + (library_->length_classes() ? "" : " (a graph per exact length)")};
  }

  // A call the library refused a graph of (nothing of it ran): --attention cudnn stops here;
  // auto runs the own kernels.
  bool ran_on_library(bool ran) {
    SPPO_CHECK(ran || kernels_ != AttentionKernels::Library, "attention")
        << "--attention cudnn: " << library_->library().name() << " refuses an attention call ("
        << library_->refused() << "); use --attention own or auto";
    return ran;
  }

  // Whether a call runs on the library: as --attention says; under auto, as the measured
  // class nearest the call says (the library where none was measured for its head size).
  bool use_library(const AttnShape& d, const std::vector<KVRef>& blocks) {
    if (!library_usable_) return false;
    const std::string why = library_->check(d);  // kept per head layout
    if (!why.empty()) {
      SPPO_CHECK(kernels_ != AttentionKernels::Library, "attention")
          << "--attention cudnn: " << library_->library().name() << " refuses an attention call (" << why
          << "); use --attention own or auto";
      return false;
    }
    if (kernels_ == AttentionKernels::Library || classes_.empty()) return true;
    bool causal = false;
    for (const KVRef& b : blocks) causal = causal || b.k_pos0 + b.Tk - 1 > d.q_pos0;
    const AttentionClassChoice* best = nullptr;
    double best_gap = 0;
    for (const AttentionClassChoice& k : classes_) {
      if (k.head_size != d.A || k.causal != causal || k.rows <= 0) continue;
      const double gap = std::abs(std::log(double(d.Tq) / k.rows));
      if (!best || gap < best_gap) best = &k, best_gap = gap;
    }
    return !best || best->library;
  }

  DType act_;
  AttentionKernels kernels_;
  Slab slab_;
  std::unique_ptr<cuda::LibraryAttention> library_;
  std::string library_error_;
  bool library_usable_ = false;  // opened, and the activations bf16
  std::vector<AttentionClassChoice> classes_;
  cudaStream_t compute_ = nullptr;
  std::unique_ptr<cuda::Blas> blas_;
  PinnedPool pinned_;
};

}  // namespace

bool cuda_device_visible() { return cuda::device_available(); }

bool cuda_nccl_built() { return cuda::nccl_built(); }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

std::string cuda_device_id(int device) {
  cudaDeviceProp p{};
  SPPO_CUDA_CHECK(cudaGetDeviceProperties(&p, device));
  char id[2 * sizeof p.uuid.bytes + 1];
  for (std::size_t k = 0; k < sizeof p.uuid.bytes; ++k)
    std::snprintf(id + 2 * k, 3, "%02x", static_cast<unsigned char>(p.uuid.bytes[k]));
  return id;
}

std::unique_ptr<Backend> make_cuda_backend(DType act, AttentionKernels attention, const DevicePlacement& place) {
  SPPO_CHECK(cuda::device_available(), "backend")
      << "--backend cuda: no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)";
  SPPO_CHECK(act == DType::F32 || act == DType::BF16, "backend") << "activations are fp32 or bf16";
  const int n = cuda_device_count();
  SPPO_CHECK(place.device < n, "backend") << "--device " << place.device << ": this process sees " << n
                                          << " GPU" << (n == 1 ? "" : "s") << " (0.." << n - 1
                                          << "; CUDA_VISIBLE_DEVICES may hide others)";
  return std::make_unique<CudaBackend>(act, attention, place);
}

}  // namespace sppo
