// `sppo` chooses OpenBLAS's kernel before OpenBLAS loads it: when the reported core is
// generic it sets OPENBLAS_CORETYPE and re-executes itself once; a user's setting wins.
// SPPO_TEST_BLAS_CORENAME makes this machine's OpenBLAS look generic, as it does on a
// processor newer than the library.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>

#include "backends/cpu/blas_setup.h"

namespace {

using sppo::cpu::choose_blas_core;
using sppo::cpu::cpu_features;

nlohmann::json bench_layer_json(const std::string& env) {
  const std::string cmd = "env -u OPENBLAS_CORETYPE -u SPPO_BLAS_CORE_CHOSEN " + env + " " +
                          std::string(SPPO_BINARY_DIR) +
                          "/sppo bench layer --hidden 64 --heads 4 --seq-len 64 --reps 1 --json 2>&1";
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return {};
  std::array<char, 4096> buf;
  while (std::fgets(buf.data(), int(buf.size()), p)) out += buf.data();
  EXPECT_EQ(pclose(p), 0) << cmd << "\n" << out;
  return nlohmann::json::parse(out, nullptr, false);
}

TEST(CliBlasCore, GenericCoreIsReplacedOnce) {
  const std::string want = choose_blas_core("Prescott", cpu_features()).core;
  if (want.empty()) GTEST_SKIP() << "this processor has no AVX: nothing better than Prescott";
  const nlohmann::json j = bench_layer_json("SPPO_TEST_BLAS_CORENAME=Prescott");
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["blas_core"], want);
  const std::string d = j["blas_core_description"];
  EXPECT_NE(d.find("OpenBLAS core " + want + " (chosen: CPU has"), std::string::npos) << d;
  EXPECT_NE(d.find("OpenBLAS detected Prescott; set OPENBLAS_CORETYPE to override"), std::string::npos) << d;
}

TEST(CliBlasCore, UsersSettingWins) {
  // Haswell where the processor runs it (quicker to benchmark), else the generic core.
  const std::string core = cpu_features().avx2 && cpu_features().fma ? "Haswell" : "Prescott";
  const nlohmann::json j = bench_layer_json("OPENBLAS_CORETYPE=" + core + " SPPO_TEST_BLAS_CORENAME=Prescott");
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["blas_core"], core);
  EXPECT_EQ(j["blas_core_description"], "OpenBLAS core " + core + " (OPENBLAS_CORETYPE=" + core + ", set by the user)");
}

TEST(CliBlasCore, RecognisedCoreIsKept) {
  const nlohmann::json j = bench_layer_json("");
  ASSERT_TRUE(j.is_object());
  // What this machine's OpenBLAS detects, seen from this process (which nothing re-ran).
  const char* user = std::getenv("OPENBLAS_CORETYPE");
  const std::string detected = sppo::cpu::blas_core_name();
  const std::string better = choose_blas_core(detected, cpu_features()).core;
  if (user == nullptr && !better.empty()) {
    // A processor newer than this OpenBLAS: the run chose the core its instruction set runs.
    EXPECT_EQ(j["blas_core"], better);
    const std::string d = j["blas_core_description"];
    EXPECT_NE(d.find("OpenBLAS detected " + detected), std::string::npos) << d;
  } else {
    EXPECT_EQ(j["blas_core_description"], "OpenBLAS core " + j["blas_core"].get<std::string>() + " (detected)");
  }
  // The peak and the layer are timed a second apart, and ctest runs other tests beside
  // this one: either can lose a few percent to a neighbour. A peak loop that misses the
  // FMA units (accumulators spilled, too few chains) measures under half and still fails.
  EXPECT_LE(j["fraction_of_peak"].get<double>(), 1.15) << "model FLOP/s above the FMA peak";
  EXPECT_GT(j["cpu_peak_flops_per_s"].get<double>(), 0);
  EXPECT_GT(j["sgemm_flops_per_s"].get<double>(), 0);
  EXPECT_EQ(j["sgemm_flops_per_s"], j["gemm_peak_flops_per_s"]);
}

}  // namespace
