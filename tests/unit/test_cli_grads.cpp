// `sppo grads` writes the export format (config.json, tokens.u32, weights and grads as
// safetensors, result.json) for any mode, so anyone can check the model against their own.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/layout.h"
#include "io/fileutil.h"
#include "io/safetensors.h"
#include "support/grads.h"

namespace sppo {
namespace {

nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  return nlohmann::json::parse(f);
}

void export_grads(const std::string& dir, const std::string& mode) {
  const std::string cmd = std::string(SPPO_BINARY_DIR) + "/sppo grads --model tiny --seq-len 45 --seed 3 " + mode +
                          " --out " + dir + " > /dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

TEST(CliGrads, ExportFormatAndModesAgree) {
  io::TempDir tmp("sppo-grads");
  const std::string ref = tmp.path() + "/ref", sub = tmp.path() + "/sub";
  export_grads(ref, "");
  export_grads(sub, "--subseqs 4 --partition flops --offload 0.5");

  const auto cfg = read_json(ref + "/config.json");
  for (const char* k : {"vocab", "hidden", "layers", "heads", "ffn_mult", "rope_theta", "ln_eps"})
    EXPECT_TRUE(cfg.contains(k)) << k;
  ModelConfig c = preset("tiny");
  EXPECT_EQ(cfg["hidden"].get<int>(), c.hidden);

  EXPECT_EQ(std::filesystem::file_size(ref + "/tokens.u32"), (45u + 1u) * 4u);
  const double loss_ref = read_json(ref + "/result.json")["loss"].get<double>();
  const double loss_sub = read_json(sub + "/result.json")["loss"].get<double>();
  EXPECT_TRUE(std::isfinite(loss_ref));
  EXPECT_LT(std::fabs(loss_sub - loss_ref) / loss_ref, 1e-5);

  io::SafetensorsReader w(ref + "/weights.safetensors"), g(ref + "/grads.safetensors");
  const auto specs = parameter_specs(c);
  ASSERT_EQ(g.tensors().size(), specs.size());
  for (const auto& s : specs) {
    ASSERT_TRUE(w.contains(s.name) && g.contains(s.name)) << s.name;
    EXPECT_EQ(g.at(s.name).shape, s.shape) << s.name;
    EXPECT_EQ(g.at(s.name).dtype, io::DType::F32) << s.name;
  }
  const auto [worst, name] = testing::worst_grad_error(ref, sub, c);
  EXPECT_LT(worst, 1e-5) << name;
}

}  // namespace
}  // namespace sppo
