#!/usr/bin/env bash
# The tests under sanitizers, each in its own build directory:
#
#   bash scripts/sanitize.sh asan   # unit and fast numerics tests, AddressSanitizer + UBSan (build-asan/)
#   bash scripts/sanitize.sh tsan   # runtime tests (memory tiers, copy streams, real steps with
#                                   # offload), ThreadSanitizer (build-tsan/)
#   bash scripts/sanitize.sh        # both
#
# Every finding is a failure: ASan and TSan halt on the first report, UBSan is built with
# -fno-sanitize-recover, and leaks fail too. Extra arguments after the mode go to ctest.
# SANITIZE_BUILD_ONLY=1 builds what the mode's tests need and runs nothing (.ci/run builds
# ahead so).
# Both builds leave out the CUDA backend (-DSPPO_CUDA=OFF): its kernels run only on a GPU,
# and compiling them again would cost minutes of CI for nothing the tests here reach.
#
# ASan skips tests that are slow without adding anything a faster test does not reach
# (ASan makes the kernels several times slower), or that measure what ASan changes:
#   test_train_longrange, test_model_subseq  numerics that train or compare many steps of
#                                            the same kernels test_model_reference runs once
#   test_bench_profile_device                times every kernel shape of a hardware profile
#   test_train_resident                      measures the process's resident memory, which
#                                            ASan's shadow memory and quarantine inflate
#   fuzz_replay_*                            replay the fuzz corpus and past crashes, which
#                                            scripts/fuzz.sh runs first under ASan + UBSan
#   readme_walkthroughs                      runs the README's commands end to end, minutes
#                                            under ASan, through code bad_inputs reaches
#
# and, by a gtest filter (asan_skip_cases), the cases of the tests it runs that spend their
# time repeating what the cases kept run under ASan already; the plain test stage
# (scripts/test.sh) runs every case. They took 330 of the 630 s the ASan tests ran for on
# two cores (the last three, added later, 23 s of the rest):
#   Solver.ThePapersOrderOfOffloadAndMsp, Solver.PlacementsThatSaveMemoryAreWeighedWhenOthersFit,
#   Solver.TensorParallelFitsLongerSequences, Solver.RecomputingFitsWhatTheDeviceCacheCannot
#                          the planner's longest searches (gpt-13b and gpt-65b on 128 GPUs,
#                          gpt-7b at 1.5M and 4M on 32): the layout, placement and simulation
#                          loops that the kept solves run, over more candidates, 15-110 s
#                          each; Solver.Qwen3CountsItsHeadsWidth, LayerMajorBackward...,
#                          SaysWhyNothingFits and the small solves stay
#   Solver.SppoPlanFitsAndRoundTrips, Zero.ShardsTheOptimizerStateOfAPlan
#                          gpt-7b at 256K on 16 A100s, the search that PlanJson.ZeroAndRing...
#                          and test_cli_plan's plan commands (--zero 0 and 1 among them) run
#   Setup.AutoSubseqsIsTheFewestThatFitTheBudget,
#   Setup.AdaptiveOffload*  name no hardware profile, so the process first times this machine's
#                          kernels (a quick profile, 50-70 s under ASan), as test_bench_profile_device
#                          does; test_runtime_step makes the same auto and adaptive choices under
#                          ASan on a fixed profile, and bad_inputs runs train --plan on bad plans
#   ModelReferenceLlama.BackwardMatchesFiniteDifferences, ...Qwen3BackwardMatchesFiniteDifferences,
#   ModelReference.TinyGradsMatchFiniteDifferences
#                          the tests' own float64 model against finite differences, two forward
#                          passes a parameter through code that shares nothing with the engine
#                          (the last runs the engine once, as SmallGradsMatchFloat64Backward does);
#                          ...AtGivenPositionsWithTargets runs the same check once
#   AttentionBlocks.RepeatedRunsAreBitIdenticalAtAnyThreadCount, AttentionGqa.RepeatedRunsAreBitIdentical
#                          run the kernels that the other attention cases run, again and again to
#                          compare bits: nothing for ASan that one run does not reach (12 s of 45)
# Set GTEST_FILTER to run other cases instead.
#
# Both builds compile at -O1 with line tables only (-g1): GCC at -O2 -g with UBSan took
# 2.3x as long for the same findings, and a report still names file and line. Each builds
# only the targets its tests run, as a unity build (-DCMAKE_UNITY_BUILD=ON: a library's
# files compiled a handful at a time, their headers parsed once): the ASan build took 222 s
# against 317 s on two cores, the TSan build 52 s against 73 (scripts/fuzz.sh's clang build
# is one too). The plain build (scripts/build.sh) compiles each file alone, so that a file
# missing an include still fails there.
#
# ThreadSanitizer runs only tests whose threads are std::thread (the copy streams) with
# OMP_NUM_THREADS=1: GCC's libgomp is not instrumented, so its own synchronisation shows
# as false races. Kernels run single-threaded there; the copy streams still run beside them.
# It runs every case of those tests: each of test_runtime_step's runs steps whose copies go
# through the copy streams (offload, K/V, weights or optimizer state on the host), and its
# longest (MeasuredPeakEqualsTheSimulatorsPrediction, most of its 126 s) is the only case
# here that streams K/V, recomputes, or prefetches for the layer-major backward.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
source scripts/configure.sh
mode=${1:-all}
[ $# -gt 0 ] && shift
jobs=${SANITIZE_JOBS:-$(nproc)}

# Runs a build into a log, printing nothing; on failure, its errors and its last lines (the
# unity builds can fail where the plain build does not: two files' internal names meet).
quiet_build() {
  local log
  log=$(mktemp)
  if "$@" >"$log" 2>&1; then
    rm -f "$log"
    return 0
  fi
  grep -E 'error|Error' "$log" | head -n 40 || true
  tail -n 40 "$log"
  echo "build failed: $* (full log: $log)"
  return 1
}

# Runs ctest into a log; prints its summary, or on failure the failing tests' output.
show_ctest() {
  local name=$1
  shift
  if "$@" >ctest.log 2>&1; then
    grep -E '^[0-9]+% tests passed|^Total Test time' ctest.log | sed "s/^/$name: /"
  else
    tail -n 150 ctest.log
    echo "$name: FAILED (full log: $PWD/ctest.log)"
    return 1
  fi
}

asan_skip='^(test_train_longrange|test_model_subseq|test_bench_profile_device|test_train_resident|readme_walkthroughs|fuzz_replay_.*)$'
asan_skip_cases=(
  Solver.ThePapersOrderOfOffloadAndMsp Solver.PlacementsThatSaveMemoryAreWeighedWhenOthersFit
  Solver.TensorParallelFitsLongerSequences Solver.RecomputingFitsWhatTheDeviceCacheCannot
  Solver.SppoPlanFitsAndRoundTrips Zero.ShardsTheOptimizerStateOfAPlan
  Setup.AutoSubseqsIsTheFewestThatFitTheBudget 'Setup.AdaptiveOffload*'
  ModelReferenceLlama.BackwardMatchesFiniteDifferences ModelReferenceLlama.Qwen3BackwardMatchesFiniteDifferences
  ModelReference.TinyGradsMatchFiniteDifferences
  AttentionBlocks.RepeatedRunsAreBitIdenticalAtAnyThreadCount AttentionGqa.RepeatedRunsAreBitIdentical
)

# -O1 -g1: see above.
sanitizer_flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" -DSPPO_CUDA=OFF
  -DCMAKE_UNITY_BUILD=ON)

run_asan() {
  local t0=$(date +%s)
  configure build-asan -S . "${sanitizer_flags[@]}" -DSPPO_SANITIZE=ON
  # Most tests are executables of the same name; the rest are scripts that run sppo and
  # rewrite_state, built always.
  local targets
  targets=$(comm -12 \
    <(cd build-asan && ctest -N -L 'unit|numerics' -E "$asan_skip" | sed -n 's/^ *Test *#[0-9]*: //p' | sort) \
    <(cmake --build build-asan --target help | sed -n 's/^\([A-Za-z0-9_]*\): phony$/\1/p' | sort) | tr '\n' ' ')
  quiet_build nice -n 10 cmake --build build-asan -j"$jobs" --target sppo rewrite_state $targets
  local t1=$(date +%s)
  if [ "${SANITIZE_BUILD_ONLY:-0}" = 1 ]; then echo "asan+ubsan: built in $((t1 - t0)) s"; return; fi
  (
    cd build-asan
    export ASAN_OPTIONS=halt_on_error=1:detect_leaks=1:abort_on_error=0
    export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
    export GTEST_FILTER=${GTEST_FILTER:--$(IFS=:; echo "${asan_skip_cases[*]}")}
    show_ctest asan ctest -L 'unit|numerics' -E "$asan_skip" --output-on-failure -j"$jobs" "$@"
  )
  echo "asan+ubsan: built in $((t1 - t0)) s, tests ran in $(($(date +%s) - t1)) s"
}

run_tsan() {
  local t0=$(date +%s)
  local tests=(test_runtime_memory test_backend_copy_stream test_runtime_step)
  configure build-tsan -S . "${sanitizer_flags[@]}" -DSPPO_SANITIZE_THREAD=ON
  quiet_build nice -n 10 cmake --build build-tsan -j"$jobs" --target "${tests[@]}"
  local t1=$(date +%s)
  if [ "${SANITIZE_BUILD_ONLY:-0}" = 1 ]; then echo "tsan: built in $((t1 - t0)) s"; return; fi
  (
    cd build-tsan
    export OMP_NUM_THREADS=1
    export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
    show_ctest tsan ctest -R "^($(IFS='|'; echo "${tests[*]}"))\$" --output-on-failure -j"$jobs" "$@"
  )
  echo "tsan: built in $((t1 - t0)) s, tests ran in $(($(date +%s) - t1)) s"
}

case "$mode" in
  asan) run_asan "$@" ;;
  tsan) run_tsan "$@" ;;
  all) run_asan "$@" && run_tsan "$@" ;;
  *) echo "usage: $0 [asan|tsan|all] [ctest arguments]" >&2; exit 2 ;;
esac
