// `sppo` chooses OpenBLAS's kernel before OpenBLAS loads it: when the reported core is
// generic it sets OPENBLAS_CORETYPE and re-executes itself once; a user's setting wins.
// SPPO_TEST_BLAS_CORENAME makes this machine's OpenBLAS look generic, as it does on a
// processor newer than the library. The same for OpenMP's wait (GOMP_SPINCOUNT), which
// libgomp reads when it loads: OMP_DISPLAY_ENV=verbose makes each start of libgomp print
// what it read.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backends/cpu/blas_setup.h"

namespace {

using sppo::cpu::choose_blas_core;
using sppo::cpu::cpu_features;

std::string output_of(const std::string& cmd) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return {};
  std::array<char, 4096> buf;
  while (std::fgets(buf.data(), int(buf.size()), p)) out += buf.data();
  EXPECT_EQ(pclose(p), 0) << cmd << "\n" << out;
  return out;
}

// Unsets every variable that decides OpenMP's wait, then sets `env`.
const std::string kNoWaitSetting = "env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT -u SPPO_OMP_WAIT_CHOSEN ";

nlohmann::json bench_layer_json(const std::string& env) {
  const std::string cmd = "env -u OPENBLAS_CORETYPE -u SPPO_BLAS_CORE_CHOSEN " + env + " " +
                          std::string(SPPO_BINARY_DIR) +
                          "/sppo bench layer --hidden 64 --heads 4 --seq-len 64 --reps 1 --json 2>&1";
  return nlohmann::json::parse(output_of(cmd), nullptr, false);
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
  EXPECT_TRUE(j.contains("openmp_wait"));
  // The peak and the layer are timed a second apart, and ctest runs other tests beside
  // this one: either can lose a few percent to a neighbour. A peak loop that misses the
  // FMA units (accumulators spilled, too few chains) measures under half and still fails.
  EXPECT_LE(j["fraction_of_peak"].get<double>(), 1.15) << "model FLOP/s above the FMA peak";
  EXPECT_GT(j["cpu_peak_flops_per_s"].get<double>(), 0);
  EXPECT_GT(j["sgemm_flops_per_s"].get<double>(), 0);
  EXPECT_EQ(j["sgemm_flops_per_s"], j["gemm_peak_flops_per_s"]);
}

// The spin counts libgomp started with, in order: "GOMP_SPINCOUNT = '1000'" lines.
std::vector<std::string> spin_counts_loaded(const std::string& env) {
  const std::string out = output_of(kNoWaitSetting + env + " OMP_DISPLAY_ENV=verbose " + std::string(SPPO_BINARY_DIR) +
                                    "/sppo train --help 2>&1 >/dev/null");
  std::vector<std::string> counts;
  const std::string key = "GOMP_SPINCOUNT = '";
  for (auto at = out.find(key); at != std::string::npos; at = out.find(key, at + 1)) {
    const auto from = at + key.size();
    counts.push_back(out.substr(from, out.find('\'', from) - from));
  }
  return counts;
}

TEST(CliOpenMpWait, ChosenBeforeLibgompLoadsWhenUnset) {
  // libgomp's default first, then the re-executed program's.
  const std::vector<std::string> want = {sppo::cpu::kLibgompSpinCount, sppo::cpu::kSppoSpinCount};
  EXPECT_EQ(spin_counts_loaded(""), want);
  const nlohmann::json j = bench_layer_json(kNoWaitSetting);
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["openmp_wait"], std::string("GOMP_SPINCOUNT=") + sppo::cpu::kSppoSpinCount +
                                  " (chosen: spinning shorter shares busy cores; set OMP_WAIT_POLICY or "
                                  "GOMP_SPINCOUNT to override)");
}

TEST(CliOpenMpWait, UsersSettingWins) {
  // One start of libgomp each: nothing re-executed.
  EXPECT_EQ(spin_counts_loaded("OMP_WAIT_POLICY=passive"), std::vector<std::string>{"0"});
  EXPECT_EQ(spin_counts_loaded("GOMP_SPINCOUNT=1234"), std::vector<std::string>{"1234"});
  EXPECT_EQ(spin_counts_loaded("OMP_WAIT_POLICY=active GOMP_SPINCOUNT=77"), std::vector<std::string>{"77"});
  const nlohmann::json j = bench_layer_json(kNoWaitSetting + "OMP_WAIT_POLICY=passive");
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["openmp_wait"], "OMP_WAIT_POLICY=passive (set by the user)");
}

}  // namespace
