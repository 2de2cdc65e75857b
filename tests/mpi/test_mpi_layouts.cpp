// Every multi-rank layout reproduces the single-process reference (docs/design.md 3): the same
// loss and every gradient within relative 1e-5, through `sppo grads` exports made under a
// real mpirun with one thread a rank. Pipelines of 2 and 4 stages with 1, 4 and 7
// subsequences and offload none, full and adaptive (under a budget that makes it offload);
// data parallelism against one process training the same two sequences; ZeRO-1; ring
// attention over 2 and 4 ranks, contiguous and zigzag, alone and with the others; tensor
// parallelism with sequence-parallel regions over 2, 3 (heads, MLP and vocabulary split
// unevenly) and 4 ranks, alone and with the others; MSP over 2, 3 and 4 stages, alone and
// with tensor, data and context parallelism; the K/V cache on the host under pipeline,
// tensor, data and context parallelism and MSP; K/V and saved tensors recomputed under
// each layout that runs them; MLP tiles; the layers' weights on the host under pipeline,
// data and context parallelism; every layout's messages staged as on GPUs
// (--comm mpi); Qwen3's block (query/key norms, heads wider than H / Z) under each of them;
// Ulysses over 2, 3 and 4 ranks, alone, across a ring (USP) and with the others.
#include <gtest/gtest.h>

#include <tuple>

#include "io/fileutil.h"
#include "support/documents.h"
#include "support/megatron.h"
#include "support/mpi_run.h"

namespace sppo {
namespace {

using testing::mpirun;
using testing::read_json;

constexpr double kTolerance = 1e-5;
const std::string kModel = "--model tiny --layers 4 --seq-len 96 --seed 3 --threads 1";
const std::string kBidirectional = "--attention bidirectional --objective mlm";

// The Llama-family block (grouped-query attention, RMSNorm, SwiGLU, untied head) under the
// layouts it runs.
const std::string kLlama = "--model llama-tiny --layers 4 --seq-len 96 --seed 3 --threads 1";

// The Llama block with its LM head tied to the embedding and q/k/v biases (Qwen2.5's small
// models, Llama 3.2's): the head's gradient sums into the embedding's across the first and
// last stage, and shares the vocabulary's shards under TP.
const std::string kTied = "--model llama-tiny-tied --layers 4 --seq-len 96 --seed 3 --threads 1";

// Six query heads of 16 over the preset's two key/value heads: under --tp 4 each K/V head
// sits on two ranks whose query heads split its three 2 + 1 (Note [Replicated key/value
// heads]).
const std::string kLlama6 = kLlama + " --hidden 96 --heads 6";

// Qwen3's block: query/key norms before RoPE, 4 heads of 24 (queries 96 wide on H 64) over
// 2 key/value heads, the LM head tied to the embedding.
const std::string kQwen3 = "--model qwen3-tiny --layers 4 --seq-len 96 --seed 3 --threads 1";

ModelConfig model(const std::string& flags = kModel) {
  ModelConfig c = preset(flags.rfind(kTied, 0) == 0    ? "llama-tiny-tied"
                         : flags.rfind(kLlama, 0) == 0 ? "llama-tiny"
                         : flags.rfind(kQwen3, 0) == 0 ? "qwen3-tiny"
                                                       : "tiny");
  c.layers = 4;
  if (flags.rfind(kLlama6, 0) == 0) c.hidden = 96, c.heads = 6;
  return c;
}

class Layouts : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tmp_ = new io::TempDir("sppo-mpi-layouts");
    // Documents of 1 to 40 tokens, each ended by token 0, for packing (--pack).
    {
      const std::vector<std::uint16_t> docs = testing::random_documents(400, 7, 40);
      testing::write_u16(tmp_->path() + "/docs.u16", docs);
      packed_ = kLlama + " --data " + tmp_->path() + "/docs.u16 --doc-sep 0 --pack";
      // The same documents as a Megatron dataset (each its tokens and its 0, in two
      // sequences), packed by the document index: the same step as by the separator.
      std::vector<std::vector<std::vector<std::uint16_t>>> megatron;
      std::vector<std::uint16_t> doc;
      for (const std::uint16_t t : docs) {
        doc.push_back(t);
        if (t != 0) continue;
        const auto half = doc.begin() + std::ptrdiff_t(doc.size() / 2);
        megatron.push_back({{doc.begin(), half}, {half, doc.end()}});
        doc.clear();
      }
      testing::write_megatron<std::uint16_t>(tmp_->path() + "/docs-megatron", 8, megatron, 0);
      megatron_ = kLlama + " --data " + tmp_->path() + "/docs-megatron --pack";
      // Labels of those tokens: a third -100 (no loss), the rest random ids, not the tokens.
      std::vector<std::int32_t> labels(docs.size());
      std::uint32_t x = 11;
      for (auto& l : labels) l = (x = x * 1103515245u + 12345u) % 3 == 0 ? -100 : std::int32_t(x % 61);
      io::write_file_atomic(tmp_->path() + "/labels.i32",
                            std::string_view(reinterpret_cast<const char*>(labels.data()), labels.size() * 4));
      labeled_ = kTied + " --data " + tmp_->path() + "/docs.u16 --labels " + tmp_->path() + "/labels.i32";
    }
    // The references: one process started without a launcher, the whole sequence; and one
    // process with two sequences a step (what two data-parallel replicas train together).
    for (const auto& [dir, flags] : {std::pair<std::string, std::string>{"ref1", kModel},
                                     {"ref2", kModel + " --batch 2"},
                                     {"refb", kModel + " " + kBidirectional},
                                     {"llama1", kLlama},
                                     {"llama2", kLlama + " --batch 2"},
                                     {"llama6", kLlama6},
                                     {"llama6b", kLlama6 + " --batch 2"},
                                     {"tied1", kTied},
                                     {"tied2", kTied + " --batch 2"},
                                     {"qwen3", kQwen3},
                                     {"qwen3b", kQwen3 + " --batch 2"},
                                     {"packed", packed_},
                                     {"labeled1", labeled_},
                                     {"labeled2", labeled_ + " --batch 2"},
                                     {"packlabel", labeled_ + " --doc-sep 0 --pack"}}) {
      const auto r = testing::run_command(testing::sppo_binary() + " grads " + flags + " --out " +
                                          tmp_->path() + "/" + dir);
      ASSERT_EQ(r.status, 0) << r.output;
    }
  }
  static void TearDownTestSuite() { delete tmp_; }

  // Exports the gradients of `layout` on `np` ranks and compares them with `ref`.
  nlohmann::json check(int np, const std::string& layout, const std::string& ref, const std::string& flags = kModel) {
    const std::string out = tmp_->path() + "/run" + std::to_string(runs_++);
    const auto r = mpirun(np, "grads " + flags + " " + layout + " --out " + out);
    EXPECT_EQ(r.status, 0) << layout << "\n" << r.output;
    if (r.status != 0) return {};
    const double loss = read_json(out + "/result.json")["loss"].get<double>();
    const double loss_ref = read_json(tmp_->path() + "/" + ref + "/result.json")["loss"].get<double>();
    EXPECT_LT(std::fabs(loss - loss_ref) / loss_ref, kTolerance) << layout;
    const auto [worst, name] = testing::worst_grad_error(tmp_->path() + "/" + ref, out, model(flags));
    EXPECT_LT(worst, kTolerance) << layout << ": gradient of " << name;
    const auto result = read_json(out + "/result.json");
    // Every rank's point-to-point traffic is the simulator's, message by message (the
    // two-pass RSA ring's keys, values and dK, dV too: sched::rsa_step_bytes).
    EXPECT_EQ(result["measured_sent_bytes_per_rank"], result["predicted_sent_bytes_per_rank"]) << layout;
    // And the buffers of its gradient reductions, bucket by bucket (sched::collective_bytes).
    EXPECT_EQ(result["measured_collective_bytes_per_rank"], result["predicted_collective_bytes_per_rank"]) << layout;
    return result;
  }

  // check(), and the peaks against the memory model: the host's to the byte, the device's
  // too where `exact`, else bounded by it (within 3%).
  // An offload releases its device bytes when its copy ends, and the simulator times that
  // copy on the shipped profile; a starved copy thread (a loaded machine) can hold them past
  // the next op's allocations. A run under the predicted peak as its budget waits for those
  // copies before it allocates, as a GPU run does under its budget: such a run is checked
  // again that way, and must then meet the prediction without going over it.
  void check_peaks(int np, const std::string& layout, const std::string& ref, const std::string& flags, bool exact) {
    auto r = check(np, layout, ref, flags);
    ASSERT_FALSE(r.empty()) << layout;
    if (r["peak_device_bytes"].get<i64>() > r["predicted_peak_device_bytes"].get<i64>() &&
        layout.find("--device-memory") == std::string::npos) {
      const std::string budget = std::to_string(r["predicted_peak_device_bytes"].get<i64>());
      r = check(np, layout + " --device-memory " + budget, ref, flags);
      ASSERT_FALSE(r.empty()) << layout << " --device-memory " << budget;
    }
    const i64 peak = r["peak_device_bytes"].get<i64>(), predicted = r["predicted_peak_device_bytes"].get<i64>();
    if (exact) {
      EXPECT_EQ(peak, predicted) << layout;
    }
    EXPECT_LE(peak, predicted) << layout;
    EXPECT_GT(double(peak), 0.97 * double(predicted)) << layout;
    EXPECT_EQ(r["peak_host_bytes"], r["predicted_peak_host_bytes"]) << layout;
  }

  // N 1, 4, 7; offload none, full, and adaptive under a budget halfway between their peaks.
  void pipeline(int pp) {
    const std::string stages = "--pp " + std::to_string(pp);
    check(pp, stages, "ref1");
    for (int n : {4, 7}) {
      const std::string sub = stages + " --subseqs " + std::to_string(n);
      const auto none = check(pp, sub + " --offload none", "ref1");
      const auto full = check(pp, sub + " --offload full", "ref1");
      ASSERT_FALSE(none.empty() || full.empty());
      EXPECT_EQ(none["offloaded_bytes"].get<i64>(), 0);
      EXPECT_GT(full["offloaded_bytes"].get<i64>(), 0);
      const i64 budget = (none["peak_device_bytes"].get<i64>() + full["peak_device_bytes"].get<i64>()) / 2;
      // A shipped profile prices the choice (measuring this machine would dominate the test).
      const auto adaptive = check(
          pp, sub + " --offload adaptive --hardware a100-80gb --device-memory " + std::to_string(budget) + "B", "ref1");
      ASSERT_FALSE(adaptive.empty());
      EXPECT_GT(adaptive["offloaded_bytes"].get<i64>(), 0) << "the budget should make adaptive offload";
      EXPECT_LE(adaptive["peak_device_bytes"].get<i64>(), budget);
    }
  }

  static io::TempDir* tmp_;
  static std::string packed_;    // the Llama model on packed documents
  static std::string megatron_;  // the same documents from a Megatron dataset's index
  static std::string labeled_;   // the tied Llama model on those tokens with --labels
  int runs_ = 0;
};

io::TempDir* Layouts::tmp_ = nullptr;
std::string Layouts::packed_;
std::string Layouts::megatron_;
std::string Layouts::labeled_;

TEST_F(Layouts, Pipeline2) { pipeline(2); }

TEST_F(Layouts, Pipeline4) { pipeline(4); }

TEST_F(Layouts, DataParallel) {
  check(2, "--dp 2", "ref2");
  check(2, "--dp 2 --zero 1", "ref2");
  check(2, "--dp 2 --subseqs 3 --offload full", "ref2");
}

// ZeRO-2 and ZeRO-3 (Notes [ZeRO-2], [ZeRO-3] and [ZeRO-3 gathers] in schedule/weights.h):
// the gradients reduce-scattered into the shards, and under ZeRO-3 the weights gathered from
// them layer by layer, are the whole-sequence reference's in every layout whose layer group
// has two or more ranks, and every bucket reduced and layer gathered is the simulator's.
TEST_F(Layouts, ZeroTwoAndThree) {
  const std::string each = " --subseqs 3 --offload 0.5";
  check(2, "--dp 2 --zero 2" + each, "ref2");
  check(2, "--dp 2 --zero 3" + each, "ref2");
  check(4, "--ulysses 2 --dp 2 --zero 3" + each, "ref2");
  check(4, "--pp 2 --dp 2 --zero 3" + each, "ref2");
  check(4, "--cp 2 --dp 2 --zero 3" + each, "ref2");
  check(4, "--pp 2 --dp 2 --zero 3" + each, "tied2", kTied);
}

// Note [Staged messages] (runtime/staged_comm.h): --comm mpi stages every message and
// collective through the backend's copy streams and host buffers, as CUDA ranks that share a
// GPU (or have no NCCL) do; on the CPU the same code runs, and every layout's gradients, peaks
// and traffic are what they are without it.
TEST_F(Layouts, EveryLayoutThroughStagedMessages) {
  const std::string staged = " --comm mpi";
  check(2, "--pp 2 --subseqs 4 --offload 0.5" + staged, "ref1");
  check(2, "--cp 2 --ring zigzag --subseqs 2" + staged, "ref1");
  check(2, "--cp 2 --ring contiguous --kv-cache host --subseqs 3" + staged, "ref1");
  check(3, "--tp 3 --subseqs 2" + staged, "ref1");
  check(2, "--dp 2 --zero 1" + staged, "ref2");
  check(2, "--pp 2 --subseqs 4 --msp on" + staged, "ref1");
  check(4, "--pp 2 --dp 2 --zero 1 --subseqs 4 --offload 0.5" + staged, "ref2");
  check(2, kBidirectional + " --cp 2 --ring rsa,zigzag" + staged, "refb");
  check(4, "--tp 4" + staged, "llama6", kLlama6);
}

TEST_F(Layouts, TiedLlamaEmbeddings) {
  check(2, "--pp 2 --subseqs 3 --offload 0.5", "tied1", kTied);
  check(4, "--pp 4 --subseqs 4", "tied1", kTied);
  check(2, "--tp 2 --subseqs 2", "tied1", kTied);
  check(2, "--cp 2 --subseqs 2", "tied1", kTied);
  check(4, "--pp 2 --dp 2 --zero 1 --subseqs 2", "tied2", kTied);
  check(2, "--pp 2 --subseqs 4 --msp on", "tied1", kTied);
}

// Labels (--labels): the loss averages over the step's counted positions in every layout;
// with --batch 2 the two sequences count different numbers of positions.
TEST_F(Layouts, Labels) {
  check_peaks(2, "--pp 2 --subseqs 3 --offload 0.5", "labeled1", labeled_, true);
  check(2, "--tp 2 --subseqs 2", "labeled1", labeled_);
  check(2, "--cp 2 --ring zigzag --subseqs 2", "labeled1", labeled_);
  check(2, "--pp 2 --subseqs 4 --msp on", "labeled1", labeled_);
  check(2, "--dp 2 --zero 1", "labeled2", labeled_);
  check(4, "--pp 2 --dp 2 --subseqs 3 --offload 0.5", "labeled2", labeled_);
  const std::string packed = labeled_ + " --doc-sep 0 --pack";
  check(2, "--pp 2 --subseqs 4 --offload 0.5", "packlabel", packed);
  check(2, "--cp 2 --ring contiguous --subseqs 2", "packlabel", packed);
}

TEST_F(Layouts, PipelineTimesDataParallel) {
  check(4, "--pp 2 --dp 2 --subseqs 3", "ref2");
  check(4, "--pp 2 --dp 2 --zero 1 --subseqs 4 --offload 0.5", "ref2");
}

// Ring attention (context parallelism): both layouts, 2 and 4 ranks, with subsequences
// (queries of later subsequences meet the keys of earlier ones on every rank) and offload.
TEST_F(Layouts, ContextParallel) {
  for (const std::string ring : {"contiguous", "zigzag"}) {
    check(2, "--cp 2 --ring " + ring, "ref1");
    check(4, "--cp 4 --ring " + ring, "ref1");
    check(2, "--cp 2 --subseqs 4 --offload full --ring " + ring, "ref1");
  }
  check(4, "--cp 4 --subseqs 3 --offload 0.5", "ref1");
}

// A bidirectional model (masked tokens): every query sees keys on every rank of the ring;
// the one-pass ring and the two-pass Ring Self-Attention (rsa).
TEST_F(Layouts, ContextParallelBidirectional) {
  for (const std::string ring : {"contiguous", "zigzag", "rsa,contiguous", "rsa,zigzag"})
    for (int np : {2, 4}) {
      const auto r = check(np, kBidirectional + " --cp " + std::to_string(np) + " --ring " + ring, "refb");
      // The memory model counts RSA's score rows, [heads, piece, 96] fp32 (RankMemory::
      // piece_fwd_extra), to the byte: the pieces are equal, so its bounds are exact.
      if (!r.empty()) {
        EXPECT_EQ(r["peak_device_bytes"], r["predicted_peak_device_bytes"]) << ring << " on " << np;
      }
    }
  check(4, kBidirectional + " --pp 2 --cp 2", "refb");
}

TEST_F(Layouts, ContextTimesPipelineAndData) {
  check(4, "--pp 2 --cp 2 --subseqs 3", "ref1");
  check(4, "--cp 2 --dp 2 --zero 1 --subseqs 2", "ref2");
}

// Tensor parallelism (--tp, Megatron-LM's with sequence-parallel regions): every member
// holds its heads, MLP columns and vocabulary rows, and its rows of the LayerNorm regions;
// subsequences whose lengths the group does not divide, offload of each member's shards.
TEST_F(Layouts, TensorParallel) {
  check(2, "--tp 2", "ref1");
  check(4, "--tp 4", "ref1");
  check(3, "--tp 3 --subseqs 5", "ref1");
  check(2, "--tp 2 --subseqs 4 --offload full", "ref1");
  check(2, "--tp 2 --subseqs 3 --offload 0.5 --partition flops", "ref1");
}

TEST_F(Layouts, TensorTimesPipelineAndData) {
  check(4, "--pp 2 --tp 2", "ref1");
  check(4, "--pp 2 --tp 2 --subseqs 3 --offload 0.5", "ref1");
  check(4, "--tp 2 --dp 2 --zero 1 --subseqs 2", "ref2");
}

// Both kinds of sequence parallelism at once: each ring member's piece is split again over
// a tensor-parallel group, and the ring moves each member's heads only.
TEST_F(Layouts, TensorTimesContext) {
  check(4, "--tp 2 --cp 2 --ring zigzag --subseqs 2", "ref1");
  check(4, "--tp 2 --cp 2 --ring contiguous --subseqs 3 --offload 0.5", "ref1");
  check(2, kBidirectional + " --tp 2", "refb");
  check(4, kBidirectional + " --tp 2 --cp 2 --ring rsa,contiguous", "refb");
}

// K/V and their dK/dV sums on the host (--kv-cache host): each stage, replica or
// tensor-parallel member streams the blocks of its own layers, heads and subsequences.
TEST_F(Layouts, HostKvCache) {
  check(2, "--pp 2 --subseqs 4 --kv-cache host", "ref1");
  check(2, "--pp 2 --subseqs 7 --offload full --kv-cache host", "ref1");
  check(2, "--tp 2 --subseqs 3 --offload 0.5 --kv-cache host", "ref1");
  check(2, "--dp 2 --subseqs 3 --kv-cache host", "ref2");
}

// K/V on the host under ring attention: each member streams its own pieces of the earlier
// subsequences, once a layer, to its own queries and to every member's that pass; the
// device and host peaks are the memory model's to the byte.
TEST_F(Layouts, HostKvCacheOnTheRing) {
  check_peaks(2, "--cp 2 --ring zigzag --subseqs 3 --kv-cache host", "ref1", kModel, true);
  check_peaks(2, "--cp 2 --ring contiguous --subseqs 4 --offload 0.5 --kv-cache host", "ref1", kModel, true);
  check_peaks(4, "--cp 4 --ring zigzag --subseqs 2 --kv-cache host", "ref1", kModel, true);
  check_peaks(4, "--pp 2 --cp 2 --subseqs 3 --offload full --kv-cache host", "ref1", kModel, true);
  check_peaks(4, "--tp 2 --cp 2 --ring zigzag --subseqs 3 --kv-cache host", "llama1", kLlama, true);
  check_peaks(2, "--cp 2 --ring zigzag --subseqs 3 --kv-cache host", "packed", packed_, true);
  check_peaks(2, "--cp 2 --ring contiguous --subseqs 4 --kv-cache host", "packed", packed_, true);
}

// K/V on the host under MSP: a stage's owner sends its helpers' pieces to the host with its
// own blocks and streams them all to every piece's queries; a helper keeps its pieces of the
// owner's layers on the device. The host peak is the memory model's to the byte; the device
// peak is bounded by it (the ring's buffers under MSP are a bound).
TEST_F(Layouts, HostKvCacheUnderMsp) {
  check_peaks(2, "--pp 2 --subseqs 4 --msp on --kv-cache host", "ref1", kModel, false);
  check_peaks(3, "--pp 3 --subseqs 5 --partition flops --offload 0.5 --msp on --kv-cache host", "ref1", kModel, false);
  check_peaks(4, "--pp 2 --dp 2 --subseqs 3 --msp on --kv-cache host", "ref2", kModel, false);
  check_peaks(3, "--pp 3 --subseqs 5 --partition flops --msp on --kv-cache host", "llama1", kLlama, false);
  check_peaks(2, "--pp 2 --subseqs 6 --msp on --kv-cache host", "packed", packed_, false);
  // A split task on its own stage and the nearest idle one only (Note [MSP reach]).
  check_peaks(4, "--pp 4 --subseqs 6 --msp on --msp-reach 2 --kv-cache host", "ref1", kModel, false);
  check_peaks(3, "--pp 3 --subseqs 5 --offload 0.5 --msp on --msp-reach 2", "llama1", kLlama, false);
}

// MSP on a ring: each split task's pieces run over the SP ranks of every stage group it
// spans, a helper's SP rank r beside the owner's, as contiguous pieces; beside a zigzag
// ring's two-span pieces the hidden states move as runs of consecutive positions. With the
// K/V on the host too.
TEST_F(Layouts, MspOnTheRing) {
  check_peaks(4, "--pp 2 --cp 2 --ring zigzag --subseqs 4 --msp on", "ref1", kModel, false);
  check_peaks(6, "--pp 3 --cp 2 --ring zigzag --subseqs 5 --msp on --msp-reach 2 --kv-cache host", "ref1", kModel,
              false);
  check_peaks(4, "--pp 2 --cp 2 --ring zigzag --subseqs 4 --msp on", "packed", packed_, false);
  check_peaks(4, "--pp 2 --cp 2 --ring contiguous --subseqs 4 --msp on", "ref1", kModel, false);
  check_peaks(6, "--pp 3 --cp 2 --ring contiguous --subseqs 5 --offload 0.5 --msp on", "ref1", kModel, false);
  check_peaks(4, "--pp 2 --cp 2 --ring contiguous --subseqs 4 --msp on --kv-cache host", "ref1", kModel, false);
  check_peaks(4, "--pp 2 --cp 2 --ring contiguous --subseqs 4 --msp on", "packed", packed_, false);
}

// K/V recomputed from each layer's input (--kv-cache recompute) and saved tensors
// recomputed in backward (--recompute-tensors) under every layout that runs them: the
// pipeline, data parallelism, tensor parallelism (the recompute's collectives), the ring
// and MSP pieces (on borrowed weights).
TEST_F(Layouts, RecomputedTensorsAndKv) {
  check(2, "--pp 2 --subseqs 4 --kv-cache recompute", "ref1");
  check(2, "--pp 2 --subseqs 7 --offload full --kv-cache recompute --recompute-tensors ln1,q,x_mid,ln2,fc_pre", "ref1");
  check(2, "--tp 2 --subseqs 3 --offload 0.5 --recompute-tensors all", "ref1");
  check(2, "--cp 2 --subseqs 3 --recompute-tensors ln1,q,x_mid,ln2,fc_pre", "ref1");
  check(2, "--dp 2 --subseqs 3 --kv-cache recompute --recompute-tensors fc_pre", "ref2");
  check(2, "--pp 2 --subseqs 4 --msp on --recompute-tensors ln1,ln2,fc_pre", "ref1");
  // The attention recomputed on streamed layers, and the loss in backward on the last
  // stage (Note [The loss in backward]), with data parallel replicas too.
  check(2, "--pp 2 --subseqs 3 --offload 0.5 --kv-cache recompute --recompute-tensors all,head_grad", "ref1");
  check(2, "--pp 2 --subseqs 8 --kv-cache host --recompute-tensors attention,head_grad --mlp-tile-rows 5", "ref1");
  check(2, "--dp 2 --zero 1 --subseqs 3 --kv-cache host --recompute-tensors head_grad", "ref2");
  // head_grad on a ring: each member runs the head on its own rows, in either layout.
  check(2, "--cp 2 --subseqs 3 --offload 0.5 --recompute-tensors ln1,q,x_mid,ln2,fc_pre,head_grad", "ref1");
  check_peaks(2, "--cp 2 --ring contiguous --subseqs 2 --kv-cache host --recompute-tensors fc_pre,head_grad", "ref1",
              kModel, true);
  check(4, "--pp 2 --cp 2 --subseqs 4 --recompute-tensors head_grad", "ref1");
  // ... and tensor parallel: the head's collectives run inside the backward.
  check_peaks(2, "--tp 2 --subseqs 3 --offload 0.5 --recompute-tensors fc_pre,head_grad", "ref1", kModel, true);
  check(4, "--pp 2 --tp 2 --subseqs 3 --recompute-tensors all,head_grad", "ref1");
}

// The layer-major backward (--backward-order layer, Note [Layer-major backward]) under every
// other layout: the ring (each layer's steps on that layer alone), tensor parallelism,
// replicas (each layer's bucket reduced as soon as B(l, 0) ends), pipeline stages (a stage
// receives its gradients in its last layer's pass and sends them in its first's), with K/V
// on the host, offload, recomputed tensors and packed documents; the device and host peaks
// are the memory model's to the byte without offload. (With offload, one layer's sums at a
// time can leave the step's peak in the forward, beside an offload whose copy is still
// running: the device frees its bytes when the copy ends, on this machine's clock, not the
// simulator's.) With MSP it is refused before any work.
TEST_F(Layouts, LayerMajorBackward) {
  check(2, "--cp 2 --ring zigzag --subseqs 3 --offload 0.5 --backward-order layer", "ref1");
  check_peaks(2, "--cp 2 --ring contiguous --subseqs 4 --kv-cache host --backward-order layer", "ref1", kModel, true);
  check_peaks(2, "--tp 2 --subseqs 3 --offload 0.5 --recompute-tensors fc_pre,head_grad --backward-order layer", "ref1",
              kModel, true);
  check(4, "--tp 2 --cp 2 --subseqs 2 --backward-order layer", "llama1", kLlama);
  check(2, "--dp 2 --zero 1 --subseqs 3 --kv-cache recompute --offload full --backward-order layer", "ref2");
  check_peaks(2, "--cp 2 --subseqs 3 --kv-cache host --backward-order layer", "packed", packed_, true);
  check_peaks(2, "--pp 2 --subseqs 4 --backward-order layer", "ref1", kModel, true);
  check_peaks(2, "--pp 2 --subseqs 3 --kv-cache host --recompute-tensors all,head_grad --backward-order layer", "ref1",
              kModel, true);
  check(2, "--pp 2 --subseqs 4 --offload 0.5 --backward-order layer", "ref1");
  check(4, "--pp 2 --cp 2 --subseqs 3 --backward-order layer", "ref1");
  check(4, "--pp 2 --dp 2 --subseqs 3 --kv-cache recompute --backward-order layer", "ref2");
  check(2, "--pp 2 --subseqs 3 --backward-order layer", "tied1", kTied);
  // The residual gradients on the host between layers (--residual-grads host): a stage's
  // first and last layers keep theirs, and the ring's members each send their own.
  check_peaks(2, "--pp 2 --subseqs 4 --backward-order layer --residual-grads host", "ref1", kModel, true);
  check_peaks(2, "--cp 2 --ring contiguous --subseqs 3 --kv-cache host --backward-order layer --residual-grads host",
              "ref1", kModel, true);
  check(2, "--tp 2 --subseqs 3 --offload 0.5 --backward-order layer --residual-grads host", "ref1");
  const auto r = mpirun(2, "grads " + kModel + " --pp 2 --subseqs 3 --msp on --backward-order layer --out " +
                               tmp_->path() + "/refused");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--msp off"), std::string::npos) << r.output;
}

// The layers' weights on the host (--weights host, Note [Weights on the host] in
// schedule/weights.h): each stage's own layers brought to it, the gradients all-reduced over
// the replicas before they leave the device, each ring member streaming its own copy; the
// gradients are one process's and the peaks the memory model's (on a ring the device's is
// bounded: the ring attention's buffers are counted as a bound). Tensor parallelism and
// ZeRO-1 are refused before any work.
TEST_F(Layouts, WeightsOnTheHost) {
  check_peaks(2, "--pp 2 --subseqs 3 --offload 0.5 --weights host", "ref1", kModel, true);
  check_peaks(2, "--pp 2 --subseqs 3 --backward-order layer --weights host", "ref1", kModel, true);
  check_peaks(2, "--dp 2 --subseqs 3 --weights host --backward-order layer", "ref2", kModel, true);
  check_peaks(2, "--cp 2 --ring zigzag --subseqs 3 --kv-cache host --weights host --backward-order layer", "ref1",
              kModel, false);
  check_peaks(4, "--pp 2 --dp 2 --subseqs 4 --weights host", "ref2", kModel, true);
  for (const auto& [layout, named] : {std::pair<std::string, std::string>{"--tp 2", "--tp"}, {"--dp 2 --zero 1", "--zero 1"}}) {
    const auto r = mpirun(2, "grads " + kModel + " " + layout + " --weights host --out " + tmp_->path() + "/refused");
    EXPECT_EQ(r.status, 2) << layout << "\n" << r.output;
    EXPECT_NE(r.output.find("does not run with " + named), std::string::npos) << r.output;
  }
}

// Rebuilt layer inputs (--rebuild-inputs, Note [Rebuilt layer inputs] in
// schedule/builders.cpp) inside each pipeline stage and on replicas, with K/V recomputed
// below and on the host at the rebuilt layers, on the device, and with the layers' weights
// on the host: the gradients are one process's and the peaks the memory model's. A stage's
// first layer, and a ring, are refused before any work.
TEST_F(Layouts, RebuiltInputs) {
  check(2, "--pp 2 --subseqs 3 --offload 0.5 --kv-cache recompute --rebuild-inputs odd", "ref1");
  check_peaks(2, "--pp 2 --subseqs 4 --kv-cache recompute --recompute-tensors all --rebuild-inputs odd", "ref1",
              kModel, true);
  check_peaks(2, "--pp 2 --subseqs 3 --kv-cache device --rebuild-inputs odd --weights host", "ref1", kModel, true);
  check_peaks(2, "--dp 2 --subseqs 3 --kv-cache recompute --rebuild-inputs 1,3", "ref2", kModel, true);
  for (const auto& [layout, says] :
       {std::pair<std::string, std::string>{"--pp 2 --rebuild-inputs 2", "is the first of a pipeline stage"},
        {"--cp 2 --rebuild-inputs odd", "they run without --tp and --cp"}}) {
    const auto r = mpirun(2, "grads " + kModel + " " + layout + " --kv-cache device --out " + tmp_->path() + "/refused");
    EXPECT_EQ(r.status, 2) << layout << "\n" << r.output;
    EXPECT_NE(r.output.find(says), std::string::npos) << r.output;
  }
}

// MLP tiles (--mlp-tile-rows, Note [MLP tiles] in core/layout.h) with fc_pre kept and
// recomputed a tile at a time: N 1, 3, 8 on a pipeline of 2 stages and a ring of 2 ranks,
// and MSP pieces.
TEST_F(Layouts, MlpTiles) {
  check(2, "--pp 2 --mlp-tile-rows 7", "ref1");
  check(2, "--pp 2 --subseqs 3 --offload 0.5 --mlp-tile-rows 7 --recompute-tensors fc_pre", "ref1");
  check(2, "--pp 2 --subseqs 8 --offload full --mlp-tile-rows 5 --recompute-tensors ln1,ln2,fc_pre", "ref1");
  check(2, "--cp 2 --mlp-tile-rows 16 --recompute-tensors fc_pre", "ref1");
  check(2, "--cp 2 --subseqs 3 --mlp-tile-rows 7", "ref1");
  check(2, "--cp 2 --subseqs 8 --mlp-tile-rows 5 --recompute-tensors ln1,q,x_mid,ln2,fc_pre", "ref1");
  check(2, "--pp 2 --subseqs 4 --msp on --mlp-tile-rows 5 --recompute-tensors fc_pre", "ref1");
}

// Multiplexed sequence partitioning (Note [MSP pieces]): the bubble-adjacent subsequences
// run split over the stages that would idle, on borrowed weights, as one ring.
TEST_F(Layouts, MultiplexedSequencePartitioning) {
  check(2, "--pp 2 --subseqs 4 --msp on", "ref1");
  check(2, "--pp 2 --subseqs 2 --msp on", "ref1");
  check(4, "--pp 4 --subseqs 8 --msp on", "ref1");
  check(3, "--pp 3 --subseqs 5 --partition flops --offload 0.5 --msp on", "ref1");
  check(4, "--pp 2 --dp 2 --zero 1 --subseqs 4 --msp on", "ref2");
}

// MSP with tensor parallelism: each member borrows its shard from the owner's member of the
// same index, and where a split task and its neighbours split a subsequence differently the
// members' rows meet across members, inside a group too (Note [Hidden states of MSP pieces
// under tensor parallelism] in schedule/builders.cpp). Uneven groups (tp 3), the ring,
// data parallelism, K/V on the host and replicated key/value heads (tp 4 over 2).
TEST_F(Layouts, MspWithTensorParallelism) {
  check_peaks(4, "--pp 2 --tp 2 --subseqs 4 --msp on", "ref1", kModel, false);
  check_peaks(6, "--pp 3 --tp 2 --subseqs 5 --partition flops --offload 0.5 --msp on --kv-cache host", "ref1", kModel,
              false);
  check(6, "--pp 2 --tp 3 --subseqs 4 --msp on --msp-reach 2", "ref1");
  check(8, "--pp 2 --tp 2 --cp 2 --ring zigzag --subseqs 4 --msp on", "ref1");
  check(8, "--pp 2 --tp 2 --dp 2 --zero 1 --subseqs 3 --msp on", "ref2");
  check(8, "--pp 2 --tp 4 --subseqs 4 --msp on", "llama6", kLlama6);
}

// Grouped-query K/V (2 heads for 4 queries' heads) through the pipeline, the ring (the
// queries travel, the narrower keys stay), MSP pieces, data parallelism with ZeRO-1, and
// the saved-tensor placements; the untied LM head on the last stage alone.
TEST_F(Layouts, LlamaFamily) {
  check(2, "--pp 2 --subseqs 4 --offload 0.5", "llama1", kLlama);
  check(2, "--cp 2 --ring zigzag --subseqs 3", "llama1", kLlama);
  check(3, "--pp 3 --subseqs 5 --partition flops --offload 0.5 --msp on", "llama1", kLlama);
  check(4, "--pp 2 --dp 2 --zero 1 --subseqs 3", "llama2", kLlama);
  check(2, "--pp 2 --subseqs 8 --offload full --mlp-tile-rows 5 --recompute-tensors ln1,ln2,fc_pre", "llama1", kLlama);
  // The K/V streams (runtime/kv_stream.h) with grouped-query K/V: on the host, recomputed.
  check(2, "--pp 2 --subseqs 4 --kv-cache host", "llama1", kLlama);
  check(2, "--pp 2 --subseqs 4 --offload 0.5 --kv-cache recompute --recompute-tensors ln1,ln2,fc_pre", "llama1", kLlama);
  // Packed documents: attention and positions kept apart through the pipeline.
  check(2, "--pp 2 --subseqs 4 --offload 0.5", "packed", packed_);
  check(2, "--pp 2 --subseqs 7 --recompute-tensors all", "packed", packed_);
  check(4, "--pp 2 --tp 2 --subseqs 3 --offload 0.5", "packed", packed_);
  check(2, "--pp 2 --subseqs 4 --kv-cache host", "packed", packed_);
  check(4, "--pp 2 --tp 2 --subseqs 3 --kv-cache host", "packed", packed_);
  check(2, "--pp 2 --subseqs 4 --offload 0.5 --kv-cache recompute", "packed", packed_);
  // On the ring: documents cut every span, the messages stay the positional spans'.
  check(2, "--cp 2 --ring zigzag --subseqs 3", "packed", packed_);
  check(2, "--cp 2 --ring contiguous --subseqs 2 --offload 0.5", "packed", packed_);
  check(4, "--cp 4 --ring zigzag", "packed", packed_);
  check(4, "--pp 2 --cp 2 --subseqs 4", "packed", packed_);
  // MSP's pieces run on the same ring.
  check(3, "--pp 3 --subseqs 5 --partition flops --offload 0.5 --msp on", "packed", packed_);
  check(2, "--pp 2 --subseqs 6 --msp on --kv-cache device", "packed", packed_);
  // Documents from a Megatron dataset's index, no separator given.
  check(2, "--pp 2 --subseqs 3 --offload 0.5", "packed", megatron_);
  check(2, "--pp 2 --subseqs 4", "packed", megatron_);
}

// Tensor parallelism of the Llama-family block: each member holds whole key/value heads
// (--tp divides G = 2), its query heads' q rows and its kv heads' k, v rows of the
// projection, gate and up rows of its MLP columns, and vocabulary rows of the embedding
// and of the untied LM head.
TEST_F(Layouts, LlamaTensorParallel) {
  check(2, "--tp 2", "llama1", kLlama);
  check(2, "--tp 2 --subseqs 4 --offload full", "llama1", kLlama);
  check(4, "--pp 2 --tp 2 --subseqs 3 --offload 0.5", "llama1", kLlama);
  check(4, "--tp 2 --cp 2", "llama1", kLlama);
  check(4, "--tp 2 --cp 2 --ring zigzag --subseqs 2", "llama1", kLlama);
  check(4, "--tp 2 --dp 2 --zero 1 --subseqs 2", "llama2", kLlama);
  check(2, "--tp 2 --subseqs 3 --offload 0.5 --recompute-tensors all", "llama1", kLlama);
  check(2, "--tp 2 --subseqs 3 --kv-cache host --recompute-tensors all,head_grad", "llama1", kLlama);
  // More members than key/value heads: each head on two members, summed gradients.
  check(4, "--tp 4", "llama1", kLlama);
  for (const char* layout : {"--tp 4 --subseqs 3 --offload 0.5", "--tp 4 --subseqs 2 --kv-cache host"}) {
    const auto r = check(4, layout, "llama6", kLlama6);
    ASSERT_FALSE(r.empty());
    EXPECT_EQ(r["peak_device_bytes"], r["predicted_peak_device_bytes"]) << layout;
    EXPECT_EQ(r["peak_host_bytes"], r["predicted_peak_host_bytes"]) << layout;
  }
  // Members of 2 or 1 query heads send ring messages of their own sizes.
  check(8, "--tp 4 --cp 2", "llama6", kLlama6);
  check(8, "--tp 4 --dp 2 --zero 1 --subseqs 2", "llama6b", kLlama6);
}

// Qwen3 (Note [Query/key norms] in model/gpt.h): the norms' weights whole on every
// tensor-parallel member and their gradients summed over the group, on members of whole
// key/value heads (tp 2) and on members that split the query heads of one (tp 4: two
// replicas a head); the ring's queries Z A wide (Note [Head size]); MSP pieces on borrowed
// norms; ZeRO-1's buckets; the K/V on the host and recomputed (the key norm inside the
// recompute) with q's group recomputed; the tied head across the pipeline's ends. The
// peaks are the memory model's to the byte where its bounds are exact.
TEST_F(Layouts, Qwen3) {
  check_peaks(2, "--pp 2 --subseqs 3 --offload 0.5", "qwen3", kQwen3, true);
  check(4, "--pp 4 --subseqs 4", "qwen3", kQwen3);
  check_peaks(2, "--tp 2 --subseqs 3 --offload 0.5", "qwen3", kQwen3, true);
  check_peaks(4, "--tp 4 --subseqs 3 --offload 0.5 --recompute-tensors q,fc_pre", "qwen3", kQwen3, true);
  check(4, "--tp 4 --subseqs 2 --kv-cache host --recompute-tensors all,head_grad", "qwen3", kQwen3);
  check(2, "--cp 2 --ring zigzag --subseqs 3", "qwen3", kQwen3);
  check_peaks(2, "--cp 2 --ring contiguous --subseqs 3 --kv-cache host", "qwen3", kQwen3, true);
  check(4, "--tp 2 --cp 2 --ring zigzag --subseqs 2", "qwen3", kQwen3);
  check(4, "--pp 2 --dp 2 --zero 1 --subseqs 3", "qwen3b", kQwen3);
  check(4, "--tp 2 --dp 2 --zero 1 --subseqs 2", "qwen3b", kQwen3);
  check(2, "--pp 2 --subseqs 4 --msp on", "qwen3", kQwen3);
  check(3, "--pp 3 --subseqs 5 --partition flops --offload 0.5 --msp on --kv-cache host", "qwen3", kQwen3);
  check(2, "--pp 2 --subseqs 4 --kv-cache host --recompute-tensors q", "qwen3", kQwen3);
  check(2, "--pp 2 --subseqs 4 --offload 0.5 --kv-cache recompute --recompute-tensors ln1,q,ln2,fc_pre", "qwen3",
        kQwen3);
  check(2, "--pp 2 --subseqs 8 --mlp-tile-rows 5 --recompute-tensors fc_pre", "qwen3", kQwen3);
}

// Ulysses (--ulysses, runtime/ulysses.h): each member's rows through the block, every row of
// the piece for its heads through the attention. Subsequences and offload throughout; 2 and 4
// members; a Llama with 2 key/value heads over 4 members (each head on two, Note [Replicated
// key/value heads]) and 6 heads over 4 (2, 2, 1, 1 a member); pieces U does not divide (32
// tokens over 3); USP (the ring across groups of Ulysses members); the K/V on the host; the
// layer-major backward; packed documents; a pipeline. Every rank's gradients are one
// process's, its peaks and traffic the simulator's to the byte.
TEST_F(Layouts, Ulysses) {
  const std::string each = " --subseqs 3 --offload 0.5";
  check_peaks(2, "--ulysses 2" + each, "ref1", kModel, true);
  check_peaks(4, "--ulysses 4" + each, "ref1", kModel, true);
  check_peaks(4, "--ulysses 4" + each, "llama1", kLlama, true);
  check_peaks(4, "--ulysses 4" + each, "llama6", kLlama6, true);
  check_peaks(3, "--ulysses 3" + each, "ref1", kModel, true);
  check_peaks(4, "--ulysses 2 --cp 2" + each, "ref1", kModel, true);
  check_peaks(4, "--ulysses 2 --cp 2 --ring contiguous" + each, "llama1", kLlama, true);
  check_peaks(2, "--ulysses 2 --kv-cache host" + each, "ref1", kModel, true);
  check_peaks(2, "--ulysses 2 --backward-order layer" + each, "ref1", kModel, true);
  check_peaks(2, "--ulysses 2" + each, "packed", packed_, true);
  check_peaks(4, "--ulysses 2 --pp 2" + each, "ref1", kModel, true);
}

// Ulysses with the rest of what a step places and runs: recomputed tensors (the loss in the
// backward too), MLP tiles, rebuilt inputs, the layers' weights on the host, data
// parallelism with ZeRO-1, the tied head across a pipeline, Qwen3's norms (on replicated
// key/value heads), a bidirectional model, USP with the K/V on the host, messages staged as
// on GPUs. What does not compose is refused before any work, naming what runs.
TEST_F(Layouts, UlyssesWithTheRest) {
  check_peaks(2, "--ulysses 2 --subseqs 3 --recompute-tensors ln1,q,x_mid,ln2,fc_pre,head_grad", "ref1", kModel,
              true);
  check_peaks(2, "--ulysses 2 --subseqs 3 --recompute-tensors q,head_grad --mlp-tile-rows 16", "llama1", kLlama,
              true);
  check_peaks(2, "--ulysses 2 --subseqs 3 --kv-cache device --rebuild-inputs odd --weights host", "ref1", kModel,
              true);
  check(4, "--ulysses 2 --dp 2 --zero 1 --subseqs 2", "ref2", kModel);
  check(4, "--ulysses 2 --pp 2 --subseqs 3", "tied1", kTied);
  check_peaks(4, "--ulysses 4 --subseqs 2 --recompute-tensors q", "qwen3", kQwen3, true);
  check(2, kBidirectional + " --ulysses 2", "refb");
  check(4, kBidirectional + " --ulysses 2 --cp 2", "refb");
  check(4, "--ulysses 2 --cp 2 --subseqs 3 --kv-cache host", "ref1");
  check(2, "--ulysses 2 --subseqs 3 --comm mpi", "ref1");
  for (const auto& [np, layout, says] : std::vector<std::tuple<int, std::string, std::string>>{
           {4, "--ulysses 2 --tp 2", "use one of them"},
           {4, "--ulysses 2 --pp 2 --msp on --subseqs 4", "runs without --msp on"},
           {2, "--ulysses 2 --kv-cache recompute", "without --tp, --cp, --ulysses"},
           {2, "--ulysses 2 --recompute-tensors attention", "Ulysses' all-to-alls (--ulysses)"},
           {2, "--ulysses 3", "--ulysses 3 x --dp 1 = 3 ranks"},
           {2, "--ulysses 2 --subseqs 96", "fewer than the 2 Ulysses ranks"}}) {
    const auto r = mpirun(np, "grads " + kModel + " " + layout + " --out " + tmp_->path() + "/refused");
    EXPECT_EQ(r.status, 2) << layout << "\n" << r.output;
    EXPECT_NE(r.output.find(says), std::string::npos) << layout << "\n" << r.output;
  }
  const auto r = mpirun(3, "grads " + kLlama + " --ulysses 3 --out " + tmp_->path() + "/refused");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("use one of --ulysses 1, 2, 4"), std::string::npos) << r.output;
}

TEST_F(Layouts, ExportLayoutMatchesOneProcess) {
  // The consolidated export has the single-process file set and tensor names.
  const std::string out = tmp_->path() + "/layout";
  ASSERT_EQ(mpirun(2, "grads " + kModel + " --pp 2 --out " + out).status, 0);
  for (const char* f : {"config.json", "tokens.u32", "weights.safetensors", "grads.safetensors", "result.json"})
    EXPECT_TRUE(std::filesystem::exists(out + "/" + f)) << f;
  EXPECT_EQ(std::filesystem::file_size(out + "/tokens.u32"), std::filesystem::file_size(tmp_->path() + "/ref1/tokens.u32"));
  io::SafetensorsReader w(out + "/weights.safetensors");
  EXPECT_EQ(w.tensors().size(), parameter_specs(model()).size());
}

}  // namespace
}  // namespace sppo
