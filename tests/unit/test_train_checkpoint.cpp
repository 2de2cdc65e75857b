// Checkpoints: a run that stops and resumes is bit-identical to one that never stopped;
// a damaged checkpoint is refused and nothing is overwritten.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "io/fileutil.h"
#include "support/documents.h"
#include "train/trainer.h"

namespace sppo {
namespace {

TrainOptions base_options(const std::string& dir) {
  TrainOptions o;
  o.step.model = preset("tiny");
  o.step.model_name = "tiny";
  o.step.seq_len = 96;
  o.step.subseqs = "3";
  o.step.offload = "0.5";
  o.steps = 8;
  o.warmup = 2;
  o.quiet = true;
  o.metrics_path = dir + "/metrics.jsonl";
  o.save_dir = dir + "/ckpt";
  return o;
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

// Step, loss and gradient norm of every metrics line (timings legitimately differ).
std::vector<std::string> loss_curve(const std::string& path) {
  std::vector<std::string> out;
  std::ifstream f(path);
  for (std::string l; std::getline(f, l);) {
    const auto j = nlohmann::json::parse(l);
    if (j.contains("summary")) continue;
    out.push_back(nlohmann::json{{"step", j["step"]}, {"loss", j["loss"]}, {"grad_norm", j["grad_norm"]}}.dump());
  }
  return out;
}

// Runs `options` straight through in one directory and, in another, stopped after 3 steps
// and resumed from its checkpoint: the same losses, norms and files at the end.
void expect_resume_bit_identical(const std::string& root, const std::function<TrainOptions(const std::string&)>& options,
                                 const std::vector<const char*>& files) {
  const std::string a = root + "/straight", b = root + "/resumed";
  std::filesystem::create_directories(a);
  std::filesystem::create_directories(b);
  ASSERT_EQ(run_train(options(a)), 0);
  TrainOptions interrupted = options(b);
  interrupted.stop_after = 3;
  ASSERT_EQ(run_train(interrupted), 0);
  TrainOptions resumed = options(b);
  resumed.resume_dir = b + "/ckpt";
  ASSERT_EQ(run_train(resumed), 0);
  const auto curve_a = loss_curve(a + "/metrics.jsonl"), curve_b = loss_curve(b + "/metrics.jsonl");
  ASSERT_EQ(curve_a.size(), 8u);
  EXPECT_EQ(curve_a, curve_b);
  for (const char* f : files) EXPECT_EQ(slurp(a + "/ckpt/" + f), slurp(b + "/ckpt/" + f)) << f << " differs after resume";
}

TEST(Checkpoint, ResumeIsBitIdentical) {
  io::TempDir tmp("sppo-resume");
  expect_resume_bit_identical(tmp.path(), base_options, {"model.safetensors", "optimizer.safetensors"});
}

// Packed documents (--pack): the resumed run packs the same documents into the same steps.
TEST(Checkpoint, PackedResumeContinuesAtTheSameDocument) {
  io::TempDir tmp("sppo-resume-packed");
  testing::write_u16(tmp.path() + "/docs.u16", testing::random_documents(4000, 11, 70));
  expect_resume_bit_identical(
      tmp.path(),
      [&](const std::string& dir) {
        TrainOptions o = base_options(dir);
        o.step.model = preset("llama-tiny");
        o.step.model_name = "llama-tiny";
        o.step.data = tmp.path() + "/docs.u16";
        o.step.doc_sep = 0;
        o.step.pack = true;
        return o;
      },
      {"model.safetensors"});
}

TEST(Checkpoint, CorruptedCheckpointIsRefusedAndKept) {
  io::TempDir tmp("sppo-corrupt");
  TrainOptions o = base_options(tmp.path());
  o.stop_after = 2;
  ASSERT_EQ(run_train(o), 0);
  const std::string model = tmp.path() + "/ckpt/model.safetensors";
  std::string bytes = slurp(model);
  bytes[bytes.size() / 2] ^= 0x40;
  { std::ofstream(model, std::ios::binary | std::ios::trunc) << bytes; }
  TrainOptions r = base_options(tmp.path());
  r.resume_dir = tmp.path() + "/ckpt";
  try {
    run_train(r);
    FAIL() << "a corrupted checkpoint was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.safetensors"), std::string::npos) << e.what();
  }
  EXPECT_EQ(slurp(model), bytes) << "the refused checkpoint was modified";
}

TEST(Checkpoint, ResumeWithAnotherModelIsRefused) {
  io::TempDir tmp("sppo-mismatch");
  TrainOptions o = base_options(tmp.path());
  o.stop_after = 1;
  ASSERT_EQ(run_train(o), 0);
  TrainOptions r = base_options(tmp.path());
  r.step.model.hidden = 32;
  r.resume_dir = tmp.path() + "/ckpt";
  EXPECT_THROW(run_train(r), Error);
}

}  // namespace
}  // namespace sppo
