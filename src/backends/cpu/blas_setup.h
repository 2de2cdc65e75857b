// Choosing OpenBLAS's kernel for this processor.
//
// OpenBLAS (built with DYNAMIC_ARCH, as Debian's is) picks its kernels once, when the
// library loads, from the processor's model number. A processor newer than the library
// is not recognised and gets the generic "Prescott" kernels: on an AVX-512 machine SGEMM
// then runs at a fifth of its rate, and so does every step. The instruction set tells
// what the processor can run, so:
//
//   select_blas_core(argv), first thing in main(): when OPENBLAS_CORETYPE is unset and
//   the core OpenBLAS reports is weaker than the instruction set supports (cpuid, with
//   the OS saving the wider registers), it sets OPENBLAS_CORETYPE and re-executes the
//   program once (execv of /proc/self/exe with the same argv). SPPO_BLAS_CORE_CHOSEN
//   marks the re-executed process, so it never loops. A user's own OPENBLAS_CORETYPE
//   always wins.
//
// blas_core_description() is the line a run's header prints: which core runs and why.
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

// See the note at the top. Returns only when no re-execution is needed or possible.
void select_blas_core(char** argv);

// One line: "OpenBLAS core SkylakeX (chosen: CPU has AVX-512, OpenBLAS detected Prescott;
// set OPENBLAS_CORETYPE to override)", "OpenBLAS core Zen (detected)", ...
std::string blas_core_description();

// The core OpenBLAS runs now ("Zen", "SkylakeX", ...).
std::string blas_core_name();

}  // namespace sppo::cpu
