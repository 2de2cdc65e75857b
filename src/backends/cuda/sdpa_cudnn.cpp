// cuDNN's fused scaled-dot-product attention (sdpa.h) through cudnn-frontend's graph API:
// one graph per SdpaGraphKey, described by describe_graph, built on first use (validated,
// lowered, an engine picked by cuDNN's heuristics and finalised) and kept for the process.
// Compiled only where the build found cudnn-frontend's headers and cuDNN (CMakeLists.txt:
// SPPO_CUDNN); sdpa_none.cpp stands in elsewhere.
#include <cudnn.h>
#include <cudnn_frontend.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "backends/cuda/check.h"
#include "backends/cuda/sdpa.h"
#include "core/check.h"

namespace sppo::cuda {

namespace fe = cudnn_frontend;

namespace {

// Tensor ids of a graph's variant pack.
enum Uid : std::int64_t { kQ = 1, kK, kV, kO, kStats, kSeqQ, kSeqKv, kDout, kDq, kDk, kDv };

// Note [cuDNN's dP workspace]: cudnn-frontend's backward keeps dP in its workspace, B Z rows
// keys bf16 elements, quadratic in the lengths, wherever that stays under 256 MiB, unless
// CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT says otherwise. The kernels' scratch is budgeted per
// token (library_attention_scratch), so the limit is 0 here unless the user set one: the
// backward's workspace stays linear in the lengths.
void keep_workspace_linear() { setenv("CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT", "0", /*overwrite=*/0); }

fe::DataType_t io_type(DType t) { return t == DType::BF16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::FLOAT; }

std::shared_ptr<fe::graph::Tensor_attributes> tensor(fe::graph::Graph& g, const char* name, Uid uid,
                                                     std::vector<std::int64_t> dim, std::vector<std::int64_t> stride) {
  return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dim).set_stride(stride));
}

// The graph of a key: cuDNN's [batch, heads, rows, head size] view of our row-major
// [rows, ld] tensors (head z at columns z*A ..: head stride A, row stride ld). sm_version: the
// GPU's to decide for (0: this process's GPU). Its nodes take the graph's properties as they
// are made, so the version is set first.
std::shared_ptr<fe::graph::Graph> describe_graph(const SdpaGraphKey& k, int sm_version = 0) {
  keep_workspace_linear();
  auto g = std::make_shared<fe::graph::Graph>();
  if (sm_version > 0) g->set_sm_version(sm_version);
  g->set_io_data_type(io_type(k.act))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const std::int64_t R = k.rows, K = k.keys, Z = k.Z, G = k.Zkv, A = k.A;
  auto q = tensor(*g, "Q", kQ, {1, Z, R, A}, {R * k.ldq, A, k.ldq, 1});
  auto key = tensor(*g, "K", kK, {1, G, K, A}, {K * k.ldk, A, k.ldk, 1});
  auto v = tensor(*g, "V", kV, {1, G, K, A}, {K * k.ldv, A, k.ldv, 1});
  std::shared_ptr<fe::graph::Tensor_attributes> seq_q, seq_kv;
  if (k.padded) {
    auto length = [&](const char* name, Uid uid) {
      return g->tensor(fe::graph::Tensor_attributes()
                           .set_name(name)
                           .set_uid(uid)
                           .set_dim({1, 1, 1, 1})
                           .set_stride({1, 1, 1, 1})
                           .set_data_type(fe::DataType_t::INT32));
    };
    seq_q = length("seq_q", kSeqQ);
    seq_kv = length("seq_kv", kSeqKv);
  }
  const float scale = 1.0f / std::sqrt(float(A));
  auto masked = [&](auto& opts) {
    if (k.mask == PieceMask::BottomRight)
      opts.set_diagonal_alignment(fe::DiagonalAlignment_t::BOTTOM_RIGHT).set_diagonal_band_right_bound(0);
    if (k.padded) opts.set_padding_mask(true).set_seq_len_q(seq_q).set_seq_len_kv(seq_kv);
  };
  const std::vector<std::int64_t> dense_q{R * Z * A, A, Z * A, 1}, stats_stride{Z * R, R, 1, 1};
  if (!k.backward) {
    auto opts = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(true).set_attn_scale(scale);
    masked(opts);
    auto [o, stats] = g->sdpa(q, key, v, opts);
    o->set_output(true).set_uid(kO).set_dim({1, Z, R, A}).set_stride(dense_q);
    stats->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT).set_dim({1, Z, R, 1}).set_stride(
        stats_stride);
  } else {
    auto o = tensor(*g, "O", kO, {1, Z, R, A}, dense_q);
    auto dout = tensor(*g, "dO", kDout, {1, Z, R, A}, {R * k.ld_dout, A, k.ld_dout, 1});
    auto stats = g->tensor(fe::graph::Tensor_attributes()
                               .set_name("Stats")
                               .set_uid(kStats)
                               .set_dim({1, Z, R, 1})
                               .set_stride(stats_stride)
                               .set_data_type(fe::DataType_t::FLOAT));
    auto opts = fe::graph::SDPA_backward_attributes().set_name("sdpa_backward").set_attn_scale(scale);
    masked(opts);
    auto [dq, dk, dv] = g->sdpa_backward(q, key, v, o, dout, stats, opts);
    const std::vector<std::int64_t> dense_kv{K * G * A, A, G * A, 1};
    dq->set_output(true).set_uid(kDq).set_dim({1, Z, R, A}).set_stride(dense_q);
    dk->set_output(true).set_uid(kDk).set_dim({1, G, K, A}).set_stride(dense_kv);
    dv->set_output(true).set_uid(kDv).set_dim({1, G, K, A}).set_stride(dense_kv);
  }
  return g;
}

std::string version_text(std::size_t v) {
  // cuDNN 9 numbers its versions major * 10000 + minor * 100 + patch.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

class CudnnSdpa final : public SdpaLibrary {
 public:
  CudnnSdpa() {
    const std::size_t runtime = cudnnGetVersion();
    SPPO_CHECK(runtime >= CUDNN_VERSION, "attention")
        << "cuDNN " << version_text(runtime) << " is loaded, older than the " << version_text(CUDNN_VERSION)
        << " sppo was built with; put cuDNN " << version_text(CUDNN_VERSION) << " or newer on LD_LIBRARY_PATH, or "
        << "use --attention own";
    const cudnnStatus_t st = cudnnCreate(&handle_);
    SPPO_CHECK(st == CUDNN_STATUS_SUCCESS, "attention")
        << "cuDNN could not start (" << cudnnGetErrorString(st) << "); use --attention own";
    name_ = "cuDNN " + version_text(runtime);
  }
  ~CudnnSdpa() override { cudnnDestroy(handle_); }

  std::string name() const override { return name_; }

  std::string check(const SdpaGraphKey& key) override { return entry(key).error; }

  std::size_t workspace_bytes(const SdpaGraphKey& key) override {
    const Entry& e = built(key);
    return std::size_t(e.workspace);
  }

  void forward(const SdpaGraphKey& key, const SdpaForwardCall& c, void* workspace, cudaStream_t stream) override {
    const Entry& e = built(key);
    std::unordered_map<std::int64_t, void*> pack{{kQ, const_cast<void*>(c.q)}, {kK, const_cast<void*>(c.k)},
                                                 {kV, const_cast<void*>(c.v)}, {kO, c.o},
                                                 {kStats, c.stats}};
    lengths(key, c.seq_lens, pack);
    run(e, pack, workspace, stream);
  }

  void backward(const SdpaGraphKey& key, const SdpaBackwardCall& c, void* workspace, cudaStream_t stream) override {
    const Entry& e = built(key);
    std::unordered_map<std::int64_t, void*> pack{
        {kQ, const_cast<void*>(c.q)},         {kK, const_cast<void*>(c.k)},
        {kV, const_cast<void*>(c.v)},         {kO, const_cast<void*>(c.o)},
        {kDout, const_cast<void*>(c.dout)},   {kStats, const_cast<float*>(c.stats)},
        {kDq, c.dq},                          {kDk, c.dk},
        {kDv, c.dv}};
    lengths(key, c.seq_lens, pack);
    run(e, pack, workspace, stream);
  }

  BuildStats build_stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

 private:
  struct Entry {
    std::shared_ptr<fe::graph::Graph> graph;
    std::string error;
    std::int64_t workspace = 0;
  };

  // The key's graph, built on first use; a graph cuDNN refuses keeps its reason.
  Entry& entry(const SdpaGraphKey& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = graphs_.find(key);
    if (it != graphs_.end()) return it->second;
    Entry e;
    const double t0 = now_s();
    e.graph = describe_graph(key);
    auto fail = [&](fe::error_t st, const char* stage) {
      e.error = std::string(stage) + ": " + st.get_message();
      e.graph.reset();
    };
    if (auto st = e.graph->validate(); st.is_bad()) fail(st, "validate");
    else if (st = e.graph->build_operation_graph(handle_); st.is_bad()) fail(st, "operation graph");
    else if (st = e.graph->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}); st.is_bad())
      fail(st, "execution plans");
    else if (st = e.graph->check_support(); st.is_bad()) fail(st, "support");
    else if (st = e.graph->build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE); st.is_bad()) fail(st, "build");
    else if (st = e.graph->get_workspace_size(e.workspace); st.is_bad()) fail(st, "workspace");
    if (e.error.empty()) {
      const double s = now_s() - t0;
      if (stats_.graphs == 0) stats_.first_seconds = s;
      ++stats_.graphs;
      stats_.seconds += s;
    }
    return graphs_.emplace(key, std::move(e)).first->second;
  }

  const Entry& built(const SdpaGraphKey& key) {
    const Entry& e = entry(key);
    SPPO_CHECK(e.error.empty(), "attention") << name_ << " refuses " << describe(key) << " (" << e.error
                                             << "); use --attention own";
    return e;
  }

  static void lengths(const SdpaGraphKey& key, const int* seq_lens, std::unordered_map<std::int64_t, void*>& pack) {
    if (!key.padded) return;
    SPPO_ASSERT_MSG(seq_lens != nullptr, "a padded attention graph called without its lengths");
    pack[kSeqQ] = const_cast<int*>(seq_lens);
    pack[kSeqKv] = const_cast<int*>(seq_lens + 1);
  }

  void run(const Entry& e, std::unordered_map<std::int64_t, void*>& pack, void* workspace, cudaStream_t stream) {
    if (stream != stream_) {
      const cudnnStatus_t st = cudnnSetStream(handle_, stream);
      SPPO_CHECK(st == CUDNN_STATUS_SUCCESS, "attention") << "cudnnSetStream: " << cudnnGetErrorString(st);
      stream_ = stream;
    }
    auto st = e.graph->execute(handle_, pack, workspace);
    SPPO_CHECK(st.is_good(), "attention") << name_ << " failed to run an attention graph: " << st.get_message();
  }

  cudnnHandle_t handle_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::string name_;
  mutable std::mutex mu_;
  std::map<SdpaGraphKey, Entry> graphs_;
  BuildStats stats_;
};

}  // namespace

bool cudnn_sdpa_built() { return true; }

std::unique_ptr<SdpaLibrary> open_cudnn_sdpa() { return std::make_unique<CudnnSdpa>(); }

std::string validate_cudnn_sdpa(const SdpaGraphKey& key, int sm_version) {
  auto g = describe_graph(key, sm_version);
  auto st = g->validate();
  return st.is_good() ? std::string() : st.get_message();
}

}  // namespace sppo::cuda
