#!/usr/bin/env bash
# Fuzzes the readers of untrusted input with libFuzzer (clang from Debian), each target for
# a bounded time, starting from the seed corpus in tests/fuzz/corpus/<target>/ and from
# every input that once crashed (tests/fuzz/regressions/<target>/).
#
#   bash scripts/fuzz.sh                 # every target, 60 s each
#   FUZZ_SECONDS=10 bash scripts/fuzz.sh plan tokens
#   FUZZ_BUILD_ONLY=1 bash scripts/fuzz.sh   # builds the targets, fuzzes nothing
#
# Builds into build-fuzz/ (its own directory: clang, -fsanitize=fuzzer,address,undefined; a
# unity build, as scripts/sanitize.sh explains).
# The targets fuzz side by side, one a core (FUZZ_JOBS, default nproc, at a time), each for
# its own FUZZ_SECONDS: libFuzzer runs on one thread, so one after another left all cores
# but one idle (CI's six targets: 120 s against 60 s on two cores).
# Prints each target's run count, in the order the targets were named. A crash, leak,
# sanitizer report or timeout stops that target (the others go on), leaves the input in
# build-fuzz/crashes/<target>/ and makes the script exit 1;
# fix the bug, then copy the input to tests/fuzz/regressions/<target>/ so that ctest
# replays it (fuzz_replay_<target>).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${FUZZ_SECONDS:-60}
jobs=${FUZZ_BUILD_JOBS:-2}
all=(safetensors checkpoint plan tokens megatron parse)
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=("${all[@]}")

packages=(clang-14 libclang-rt-14-dev)
source scripts/apt.sh
apt_install "${packages[@]}"

source scripts/configure.sh
t0=$(date +%s)
configure build-fuzz -S tests/fuzz -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_BUILD_TYPE=None -DCMAKE_UNITY_BUILD=ON
if ! nice -n 10 cmake --build build-fuzz -j"$jobs" --target $(printf 'fuzz_%s ' "${targets[@]}") \
    >build-fuzz/build.log 2>&1; then
  echo "fuzz: the build failed; the end of build-fuzz/build.log:"
  grep -E 'error|undefined reference' build-fuzz/build.log | head -20
  tail -5 build-fuzz/build.log
  exit 1
fi
if [ "${FUZZ_BUILD_ONLY:-0}" = 1 ]; then
  echo "fuzz: built ${#targets[@]} targets in $(( $(date +%s) - t0 )) s"
  exit 0
fi
echo "fuzz: built ${#targets[@]} targets in $(( $(date +%s) - t0 )) s; ${seconds} s each"

export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
parallel=${FUZZ_JOBS:-$(nproc)}
[ "$parallel" -ge 1 ] 2>/dev/null || parallel=1

# Fuzzes one target into its log; its outcome (ok or FAILED) goes to build-fuzz/<target>.status.
fuzz_one() {
  local t=$1 work=build-fuzz/corpus/$1 crashes=build-fuzz/crashes/$1 log=build-fuzz/$1.log status=ok
  local seeds=(tests/fuzz/corpus/"$t")
  [ -d tests/fuzz/regressions/"$t" ] && seeds+=(tests/fuzz/regressions/"$t")
  # New inputs go to build-fuzz/corpus/<target> (the first directory); the seeds are read only.
  ./build-fuzz/fuzz_"$t" "$work" "${seeds[@]}" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$crashes/" >"$log" 2>&1 || status=FAILED
  echo "$status" >build-fuzz/"$t".status
}

# Prints one finished target's line (and on failure what its log says); 1 if it failed.
report() {
  local t=$1 work=build-fuzz/corpus/$1 log=build-fuzz/$1.log status runs cov corpus
  status=$(cat build-fuzz/"$t".status)
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo 0)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo 0)
  corpus=$(find "$work" -type f | wc -l)
  printf 'fuzz_%-12s %s: %s runs in %s s, coverage %s edges, corpus %s inputs\n' "$t" "$status" "$runs" "$seconds" \
    "$cov" "$corpus"
  if [ "$status" = FAILED ]; then
    grep -E 'ERROR|runtime error|SUMMARY|Test unit written|terminate called|what\(\)' "$log" | head -20
    echo "  full log: $log"
    return 1
  fi
}

for t in "${targets[@]}"; do
  mkdir -p build-fuzz/corpus/"$t" build-fuzz/crashes/"$t"
  rm -f build-fuzz/"$t".status
done
failed=0 printed=0 running=0
# Prints, in order, every target whose own line and all earlier ones are ready.
print_ready() {
  while [ "$printed" -lt ${#targets[@]} ] && [ -f build-fuzz/"${targets[$printed]}".status ]; do
    report "${targets[$printed]}" || failed=1
    printed=$((printed + 1))
  done
}
for t in "${targets[@]}"; do
  if [ "$running" -ge "$parallel" ]; then
    wait -n || true
    running=$((running - 1))
    print_ready
  fi
  fuzz_one "$t" &
  running=$((running + 1))
done
wait
# A target whose fuzzer was killed before it could say how it ended failed.
for t in "${targets[@]}"; do
  [ -f build-fuzz/"$t".status ] || echo FAILED >build-fuzz/"$t".status
done
print_ready
exit "$failed"
