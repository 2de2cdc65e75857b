// Which OpenBLAS core to run: the pure decision from the reported core and the
// processor's instruction set.
#include <gtest/gtest.h>

#include "backends/cpu/blas_setup.h"

namespace sppo::cpu {
namespace {

CpuFeatures avx512_intel() {
  CpuFeatures f;
  f.intel = true;
  f.avx = f.avx2 = f.fma = true;
  f.avx512f = f.avx512bw = f.avx512dq = f.avx512vl = true;
  return f;
}

CpuFeatures avx2_amd() {
  CpuFeatures f;
  f.amd = true;
  f.avx = f.avx2 = f.fma = true;
  return f;
}

TEST(BlasCore, GenericCoreOnAnAvx512ProcessorBecomesSkylakeX) {
  // The machine: AVX-512 (with FP16) that OpenBLAS 0.3.21 does not know.
  for (const char* generic : {"Prescott", "Core2", "Katmai", "Nehalem", "Penryn", "Atom", "Sandybridge", "Haswell"}) {
    const BlasCoreChoice c = choose_blas_core(generic, avx512_intel());
    EXPECT_EQ(c.core, "SkylakeX") << generic;
    EXPECT_EQ(c.reason, "CPU has AVX-512") << generic;
  }
  CpuFeatures zen4 = avx512_intel();
  zen4.intel = false, zen4.amd = true;
  EXPECT_EQ(choose_blas_core("Prescott", zen4).core, "SkylakeX") << "OpenBLAS runs Zen 4 on SkylakeX kernels";
}

TEST(BlasCore, Avx2ProcessorsGetHaswellOrZen) {
  EXPECT_EQ(choose_blas_core("Prescott", avx2_amd()).core, "Zen");
  EXPECT_EQ(choose_blas_core("Barcelona", avx2_amd()).core, "Zen");
  CpuFeatures intel = avx2_amd();
  intel.amd = false, intel.intel = true;
  EXPECT_EQ(choose_blas_core("Prescott", intel).core, "Haswell");
  EXPECT_EQ(choose_blas_core("Sandybridge", intel).core, "Haswell");
  EXPECT_EQ(choose_blas_core("Prescott", intel).reason, "CPU has AVX2 and FMA");
  CpuFeatures no_fma = intel;
  no_fma.fma = false;
  EXPECT_EQ(choose_blas_core("Prescott", no_fma).core, "Sandybridge") << "AVX2 without FMA: AVX kernels";
}

TEST(BlasCore, AGoodOrUnknownCoreIsKept) {
  EXPECT_TRUE(choose_blas_core("Zen", avx2_amd()).core.empty()) << "this machine: detected correctly";
  EXPECT_TRUE(choose_blas_core("Haswell", avx2_amd()).core.empty()) << "same level";
  EXPECT_TRUE(choose_blas_core("SkylakeX", avx512_intel()).core.empty());
  EXPECT_TRUE(choose_blas_core("Cooperlake", avx512_intel()).core.empty());
  EXPECT_TRUE(choose_blas_core("Sapphirerapids", avx512_intel()).core.empty());
  EXPECT_TRUE(choose_blas_core("SKYLAKEX", avx512_intel()).core.empty()) << "names compare without case";
  EXPECT_TRUE(choose_blas_core("SomeFutureCore", avx512_intel()).core.empty()) << "a newer library's name";
  EXPECT_TRUE(choose_blas_core("", avx512_intel()).core.empty());
}

TEST(BlasCore, NothingBetterWithoutWideVectors) {
  EXPECT_TRUE(choose_blas_core("Prescott", CpuFeatures{}).core.empty());
  CpuFeatures partial = avx512_intel();
  partial.avx512vl = false;  // SkylakeX kernels need F, BW, DQ and VL
  EXPECT_EQ(choose_blas_core("Prescott", partial).core, "Haswell");
}

TEST(OpenMpWait, ChosenOnlyWhereTheUserSetNothing) {
  const WaitPolicyChoice c = choose_wait_policy(nullptr, nullptr);
  EXPECT_EQ(c.var, "GOMP_SPINCOUNT");
  EXPECT_EQ(c.value, kSppoSpinCount);
  EXPECT_EQ(choose_wait_policy("", "").var, "GOMP_SPINCOUNT") << "set to nothing: libgomp ignores it";
  EXPECT_TRUE(choose_wait_policy("passive", nullptr).var.empty());
  EXPECT_TRUE(choose_wait_policy("ACTIVE", nullptr).var.empty());
  EXPECT_TRUE(choose_wait_policy(nullptr, "300000").var.empty());
  EXPECT_TRUE(choose_wait_policy("active", "1000").var.empty());
}

TEST(BlasCore, ThisProcessorIsDescribed) {
  EXPECT_FALSE(blas_core_name().empty());
  EXPECT_NE(blas_core_description().find("OpenBLAS core " + blas_core_name()), std::string::npos);
}

}  // namespace
}  // namespace sppo::cpu
