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
// Set in the re-executed process: the GOMP_SPINCOUNT this program chose.
constexpr const char* kWaitChosenVar = "SPPO_OMP_WAIT_CHOSEN";
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

// The same for the OpenMP wait setting.
struct WaitSelection {
  Origin origin = Origin::Detected;  // Detected: nothing set, libgomp's default
  std::string chosen, exec_error;
};
WaitSelection g_wait;

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

bool is_set(const char* v) { return v != nullptr && *v != '\0'; }

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

namespace {

// OpenBLAS's core: fills g_selection; returns the OPENBLAS_CORETYPE to set, or "".
std::string plan_blas_core() {
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
      return "";
    }
    s.origin = strcasecmp(blas_core_name().c_str(), s.chosen.c_str()) == 0 ? Origin::Chosen : Origin::ChosenButIgnored;
    return "";
  }
  if (!user.empty()) {
    s.origin = Origin::User;
    return "";
  }
  const std::string test_reported = env(kTestReportedVar);
  s.reported = test_reported.empty() ? blas_core_name() : test_reported;
  const BlasCoreChoice c = choose_blas_core(s.reported, cpu_features());
  if (c.core.empty()) return "";
  s.chosen = c.core;
  s.reason = c.reason;
  return c.core;
}

// OpenMP's wait setting: fills g_wait; returns the GOMP_SPINCOUNT to set, or "".
std::string plan_wait_policy() {
  WaitSelection& w = g_wait;
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  const char* spin = std::getenv("GOMP_SPINCOUNT");
  const std::string chosen = env(kWaitChosenVar);
  if (!chosen.empty() && !is_set(policy) && env("GOMP_SPINCOUNT") == chosen) {
    w.origin = Origin::Chosen;  // the re-executed process, or a child of one (mpirun's ranks)
    w.chosen = chosen;
    return "";
  }
  const WaitPolicyChoice c = choose_wait_policy(policy, spin);
  if (c.var.empty()) {
    w.origin = Origin::User;
    return "";
  }
  w.chosen = c.value;
  return c.value;
}

}  // namespace

// Note [OpenMP's wait policy on shared cores]
//
// A thread of libgomp's that reaches a barrier, or the end of a parallel region, waits for
// the others (or the next region) spinning, and sleeps in the kernel only after
// GOMP_SPINCOUNT spins: 300000 when OMP_WAIT_POLICY is unset, 0 when it is passive. A spin
// (a load and a pause instruction) took 44 ns on a 2-core AMD EPYC VM, so libgomp's
// default spins 13 ms, several of the scheduler's time slices. Alone on its cores, that
// catches the short gaps between a step's regions. Beside another busy program on the
// same cores, the spinning thread holds a core that the thread it waits for needs: a
// llama-tiny step at 2048 tokens on 2 cores took 9-13x its time alone beside a second
// busy sppo and 44x beside `sppo bench memory`.
//
// Measured there, each setting given to both programs (docs/figures-cpu.md, "Shared
// cores"; `sppo bench cores`), the step alone against libgomp's default and beside a
// second sppo against alone:
//   passive             alone 1.03-1.06x   beside 1.9x   (a wake-up at every region)
//   GOMP_SPINCOUNT=1000 alone 0.97-1.04x   beside 2.1x
//   3000                alone 0.98-1.02x   beside 2.4x
//   10000               alone 0.97-1.00x   beside 2.2-3.2x
//   libgomp's default   alone 1x           beside 2.7-6x (9-13x in other runs)
// 1000 spins (44 us there; shorter where a pause is quicker, and then nearer passive)
// keep the step alone as fast as libgomp's default and lose, beside a busy neighbour,
// about the core it takes. The user's OMP_WAIT_POLICY or GOMP_SPINCOUNT always wins.
WaitPolicyChoice choose_wait_policy(const char* omp_wait_policy, const char* gomp_spincount) {
  if (is_set(omp_wait_policy) || is_set(gomp_spincount)) return {};
  return {"GOMP_SPINCOUNT", kSppoSpinCount};
}

void select_library_settings(char** argv) {
  g_selected = true;
  const std::string core = plan_blas_core();
  const std::string spin = plan_wait_policy();
  if (core.empty() && spin.empty()) return;
  const std::string mark = core.empty() ? "" : core + "|" + g_selection.reason + "|" + g_selection.reported;
  const bool set = (core.empty() || (::setenv("OPENBLAS_CORETYPE", core.c_str(), 1) == 0 &&
                                     ::setenv(kChosenVar, mark.c_str(), 1) == 0)) &&
                   (spin.empty() || (::setenv("GOMP_SPINCOUNT", spin.c_str(), 1) == 0 &&
                                     ::setenv(kWaitChosenVar, spin.c_str(), 1) == 0));
  if (set) {
    std::fflush(nullptr);
    ::execv("/proc/self/exe", argv);
  }
  // Still here: run on with what the libraries found when they loaded, and say so.
  const std::string error = std::strerror(errno);
  if (!core.empty()) {
    g_selection.origin = Origin::ExecFailed;
    g_selection.exec_error = error;
    ::unsetenv("OPENBLAS_CORETYPE");
    ::unsetenv(kChosenVar);
  }
  if (!spin.empty()) {
    g_wait.origin = Origin::ExecFailed;
    g_wait.exec_error = error;
    ::unsetenv("GOMP_SPINCOUNT");
    ::unsetenv(kWaitChosenVar);
  }
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

std::string openmp_wait_description() {
  const std::string policy = env("OMP_WAIT_POLICY"), spin = env("GOMP_SPINCOUNT");
  std::string user;
  if (!policy.empty()) user = "OMP_WAIT_POLICY=" + policy;
  if (!spin.empty()) user += (user.empty() ? "" : " ") + ("GOMP_SPINCOUNT=" + spin);
  if (!g_selected) return user.empty() ? "libgomp's default" : user;
  const WaitSelection& w = g_wait;
  switch (w.origin) {
    case Origin::Detected:
    case Origin::ChosenButIgnored:
      return "libgomp's default";
    case Origin::User:
      return user + " (set by the user)";
    case Origin::Chosen:
      return "GOMP_SPINCOUNT=" + w.chosen +
             " (chosen: spinning shorter shares busy cores; set OMP_WAIT_POLICY or GOMP_SPINCOUNT to override)";
    case Origin::ExecFailed:
      return "libgomp's default (GOMP_SPINCOUNT=" + w.chosen + " would share busy cores, but re-executing with it failed: " +
             w.exec_error + ")";
  }
  return user;
}

}  // namespace sppo::cpu
