#include "backends/cpu/blas_setup.h"

#include <cblas.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace sppo::cpu {

namespace {

// Set in the re-executed process: the core this program chose and why ("SkylakeX|CPU has
// AVX-512|Prescott").
constexpr const char* kChosenVar = "SPPO_BLAS_CORE_CHOSEN";
// For tests: stands in for the core OpenBLAS reports, so that the re-execution can be
// exercised on a processor OpenBLAS recognises.
constexpr const char* kTestReportedVar = "SPPO_TEST_BLAS_CORENAME";

// OpenBLAS core names (openblas_get_corename) by the widest instruction set their kernels
// use: 0 SSE-era, 1 AVX, 2 AVX2 + FMA, 3 AVX-512.
struct KnownCore {
  const char* name;
  int level;
};
constexpr KnownCore kKnownCores[] = {
    {"Katmai", 0},        {"Coppermine", 0}, {"Northwood", 0},     {"Prescott", 0},   {"Banias", 0},
    {"Atom", 0},          {"Core2", 0},      {"Penryn", 0},        {"Dunnington", 0}, {"Nehalem", 0},
    {"Athlon", 0},        {"Opteron", 0},    {"Opteron(SSE3)", 0}, {"Barcelona", 0},  {"Bobcat", 0},
    {"Nano", 0},          {"Sandybridge", 1}, {"Bulldozer", 1},    {"Piledriver", 1}, {"Steamroller", 1},
    {"Haswell", 2},       {"Excavator", 2},  {"Zen", 2},           {"SkylakeX", 3},   {"Cooperlake", 3},
    {"Sapphirerapids", 3},
};

int level_of(std::string_view name) {
  for (const auto& c : kKnownCores)
    if (name.size() == std::strlen(c.name) && strncasecmp(name.data(), c.name, name.size()) == 0) return c.level;
  return -1;
}

// What the process found at start-up, for blas_core_description().
enum class Origin { Detected, User, Chosen, ChosenButIgnored, ExecFailed };
struct Selection {
  Origin origin = Origin::Detected;
  std::string chosen, reason, reported, exec_error;
};
Selection g_selection;
bool g_selected = false;

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

}  // namespace

CpuFeatures cpu_features() {
  CpuFeatures f;
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(0, &a, &b, &c, &d) == 0) return f;
  const unsigned max_leaf = a;
  char vendor[13] = {};
  std::memcpy(vendor, &b, 4), std::memcpy(vendor + 4, &d, 4), std::memcpy(vendor + 8, &c, 4);
  f.intel = std::strcmp(vendor, "GenuineIntel") == 0;
  f.amd = std::strcmp(vendor, "AuthenticAMD") == 0 || std::strcmp(vendor, "HygonGenuine") == 0;
  __get_cpuid(1, &a, &b, &c, &d);
  const bool osxsave = (c >> 27) & 1;
  const bool cpu_avx = (c >> 28) & 1, cpu_fma = (c >> 12) & 1;
  unsigned long long xcr0 = 0;
  if (osxsave) {
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (static_cast<unsigned long long>(hi) << 32) | lo;
  }
  const bool os_ymm = (xcr0 & 0x6) == 0x6;     // SSE and AVX state
  const bool os_zmm = (xcr0 & 0xe6) == 0xe6;   // plus opmask and both ZMM halves
  f.avx = cpu_avx && os_ymm;
  f.fma = cpu_fma && os_ymm;
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    f.avx2 = ((b >> 5) & 1) && os_ymm;
    f.avx512f = ((b >> 16) & 1) && os_zmm;
    f.avx512dq = ((b >> 17) & 1) && os_zmm;
    f.avx512bw = ((b >> 30) & 1) && os_zmm;
    f.avx512vl = ((b >> 31) & 1) && os_zmm;
  }
#endif
  return f;
}

BlasCoreChoice choose_blas_core(const std::string& reported, const CpuFeatures& cpu) {
  BlasCoreChoice best;
  int level = -1;
  if (cpu.avx512f && cpu.avx512bw && cpu.avx512dq && cpu.avx512vl) {
    best = {"SkylakeX", "CPU has AVX-512"};
    level = 3;
  } else if (cpu.avx2 && cpu.fma) {
    best = {cpu.amd ? "Zen" : "Haswell", "CPU has AVX2 and FMA"};
    level = 2;
  } else if (cpu.avx) {
    best = {"Sandybridge", "CPU has AVX"};
    level = 1;
  }
  const int have = level_of(reported);
  if (level < 0 || have < 0 || have >= level) return {};
  return best;
}

void select_blas_core(char** argv) {
  g_selected = true;
  Selection& s = g_selection;
  const std::string chosen = env(kChosenVar);
  const std::string user = env("OPENBLAS_CORETYPE");
  if (!chosen.empty()) {
    // The re-executed process: chosen = "core|reason|reported".
    const auto bar1 = chosen.find('|'), bar2 = chosen.find('|', bar1 == std::string::npos ? 0 : bar1 + 1);
    s.chosen = chosen.substr(0, bar1);
    if (bar2 != std::string::npos) {
      s.reason = chosen.substr(bar1 + 1, bar2 - bar1 - 1);
      s.reported = chosen.substr(bar2 + 1);
    }
    if (user != s.chosen) {
      s.origin = Origin::User;  // the user changed it since, e.g. in a child's environment
      return;
    }
    s.origin = strcasecmp(blas_core_name().c_str(), s.chosen.c_str()) == 0 ? Origin::Chosen : Origin::ChosenButIgnored;
    return;
  }
  if (!user.empty()) {
    s.origin = Origin::User;
    return;
  }
  const std::string test_reported = env(kTestReportedVar);
  s.reported = test_reported.empty() ? blas_core_name() : test_reported;
  const BlasCoreChoice c = choose_blas_core(s.reported, cpu_features());
  if (c.core.empty()) return;
  s.chosen = c.core;
  s.reason = c.reason;
  const std::string mark = c.core + "|" + c.reason + "|" + s.reported;
  if (::setenv("OPENBLAS_CORETYPE", c.core.c_str(), 1) == 0 && ::setenv(kChosenVar, mark.c_str(), 1) == 0) {
    std::fflush(nullptr);
    ::execv("/proc/self/exe", argv);
  }
  // Still here: run on with the reported core, and say so.
  s.origin = Origin::ExecFailed;
  s.exec_error = std::strerror(errno);
  ::unsetenv("OPENBLAS_CORETYPE");
  ::unsetenv(kChosenVar);
}

std::string blas_core_name() { return openblas_get_corename(); }

std::string blas_core_description() {
  const std::string running = blas_core_name();
  std::string line = "OpenBLAS core " + running;
  if (!g_selected) {
    const std::string user = env("OPENBLAS_CORETYPE");
    return line + (user.empty() ? " (detected)" : " (OPENBLAS_CORETYPE=" + user + ")");
  }
  const Selection& s = g_selection;
  switch (s.origin) {
    case Origin::Detected:
      return line + " (detected)";
    case Origin::User:
      return line + " (OPENBLAS_CORETYPE=" + env("OPENBLAS_CORETYPE") + ", set by the user)";
    case Origin::Chosen:
      return line + " (chosen: " + s.reason + ", OpenBLAS detected " + s.reported +
             "; set OPENBLAS_CORETYPE to override)";
    case Origin::ChosenButIgnored:
      return line + " (OPENBLAS_CORETYPE=" + s.chosen + " was set because the " + s.reason +
             ", but this OpenBLAS ignores it: it was built without DYNAMIC_ARCH)";
    case Origin::ExecFailed:
      return line + " (detected; " + s.chosen + " would be faster, but re-executing with it failed: " +
             s.exec_error + ")";
  }
  return line;
}

}  // namespace sppo::cpu
