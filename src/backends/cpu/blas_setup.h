// What the CPU backend's libraries read once, when they load: OpenBLAS's kernel and
// OpenMP's wait policy. Both are read from the environment before main() runs, so the
// program sets them and runs itself again:
//
//   select_library_settings(argv), first thing in main(): decides both (below); when
//   either needs a variable set, it sets them and re-executes the program once (execv of
//   /proc/self/exe with the same argv: the same pid and environment, so it works under
//   mpirun, before MPI_Init). SPPO_BLAS_CORE_CHOSEN and SPPO_OMP_WAIT_CHOSEN mark what
//   it set, so the re-executed process never loops and the run can say where a value
//   came from. A user's own setting always wins.
//
// OpenBLAS's kernel. OpenBLAS (built with DYNAMIC_ARCH, as Debian's is) picks its kernels
// from the processor's model number. A processor newer than the library is not recognised
// and gets the generic "Prescott" kernels: on an AVX-512 machine SGEMM then runs at a
// fifth of its rate, and so does every step. The instruction set tells what the processor
// can run: when OPENBLAS_CORETYPE is unset and the core OpenBLAS reports is weaker than
// the instruction set supports (cpuid, with the OS saving the wider registers), it sets
// OPENBLAS_CORETYPE.
//
// OpenMP's wait policy: GOMP_SPINCOUNT, when neither it nor OMP_WAIT_POLICY is set; see
// Note [OpenMP's wait policy on shared cores] in blas_setup.cpp.
//
// blas_core_description() and openmp_wait_description() are the lines a benchmark prints:
// what runs and why.
#pragma once

#include <string>

namespace sppo::cpu {

// What the processor can run (each flag: cpuid says so and the OS saves the registers).
struct CpuFeatures {
  bool intel = false;  // GenuineIntel
  bool amd = false;    // AuthenticAMD or HygonGenuine (Zen cores)
  bool avx = false;
  bool avx2 = false;
  bool fma = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512dq = false;
  bool avx512vl = false;
};

// This processor's features (all false off x86-64).
CpuFeatures cpu_features();

// The OpenBLAS core (an OPENBLAS_CORETYPE value) to use instead of `reported`, or an
// empty `core` to keep it. Pure, so it is tested on any machine:
//   AVX-512 F/BW/DQ/VL          -> SkylakeX (also on AMD, as OpenBLAS does for Zen 4)
//   AVX2 + FMA, AMD             -> Zen
//   AVX2 + FMA, otherwise       -> Haswell
//   AVX                         -> Sandybridge
// It replaces only a core OpenBLAS names that is weaker than that; an unknown name (a
// newer library's) is kept.
struct BlasCoreChoice {
  std::string core;    // e.g. "SkylakeX"; empty: keep the reported core
  std::string reason;  // e.g. "CPU has AVX-512"
};
BlasCoreChoice choose_blas_core(const std::string& reported, const CpuFeatures& cpu);

// The OpenMP wait setting to add to the environment, or an empty `var` to keep it as it
// is: GOMP_SPINCOUNT=kSppoSpinCount when neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT is
// set (each argument: that variable's value, nullptr when unset). Pure, for tests.
struct WaitPolicyChoice {
  std::string var;    // "GOMP_SPINCOUNT"; empty: keep the environment's
  std::string value;  // e.g. "1000"
};
WaitPolicyChoice choose_wait_policy(const char* omp_wait_policy, const char* gomp_spincount);

// libgomp's spin count when OMP_WAIT_POLICY is unset (a benchmark sets it to run as an
// OpenMP program does by default), and sppo's: Note [OpenMP's wait policy on shared
// cores] in blas_setup.cpp.
constexpr const char* kLibgompSpinCount = "300000";
constexpr const char* kSppoSpinCount = "1000";

// See the note at the top. Returns only when no re-execution is needed or possible.
void select_library_settings(char** argv);

// One line: "OpenBLAS core SkylakeX (chosen: CPU has AVX-512, OpenBLAS detected Prescott;
// set OPENBLAS_CORETYPE to override)", "OpenBLAS core Zen (detected)", ...
std::string blas_core_description();

// The core OpenBLAS runs now ("Zen", "SkylakeX", ...).
std::string blas_core_name();

// One line: "GOMP_SPINCOUNT=1000 (chosen: spinning shorter shares busy cores; set
// OMP_WAIT_POLICY or GOMP_SPINCOUNT to override)", "OMP_WAIT_POLICY=passive (set by the
// user)", ...
std::string openmp_wait_description();

}  // namespace sppo::cpu
