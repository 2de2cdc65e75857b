#!/usr/bin/env bash
# Fuzzes the readers of untrusted input with libFuzzer (clang from Debian), each target for
# a bounded time, starting from the seed corpus in tests/fuzz/corpus/<target>/ and from
# every input that once crashed (tests/fuzz/regressions/<target>/).
#
#   bash scripts/fuzz.sh                 # every target, 60 s each
#   FUZZ_SECONDS=10 bash scripts/fuzz.sh plan tokens
#
# Builds into build-fuzz/ (its own directory: clang, -fsanitize=fuzzer,address,undefined).
# Prints each target's run count. A crash, leak, sanitizer report or timeout stops that
# target, leaves the input in build-fuzz/crashes/<target>/ and makes the script exit 1;
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
configure build-fuzz -S tests/fuzz -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_BUILD_TYPE=None
nice -n 10 cmake --build build-fuzz -j"$jobs" --target $(printf 'fuzz_%s ' "${targets[@]}") >/dev/null
echo "fuzz: built ${#targets[@]} targets in $(( $(date +%s) - t0 )) s; ${seconds} s each"

export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
failed=0
for t in "${targets[@]}"; do
  work=build-fuzz/corpus/$t crashes=build-fuzz/crashes/$t
  mkdir -p "$work" "$crashes"
  seeds=(tests/fuzz/corpus/"$t")
  [ -d tests/fuzz/regressions/"$t" ] && seeds+=(tests/fuzz/regressions/"$t")
  log=build-fuzz/$t.log
  # New inputs go to build-fuzz/corpus/<target> (the first directory); the seeds are read only.
  if ./build-fuzz/fuzz_"$t" "$work" "${seeds[@]}" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 -artifact_prefix="$crashes/" >"$log" 2>&1; then
    status=ok
  else
    status=FAILED
    failed=1
  fi
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo 0)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo 0)
  corpus=$(find "$work" -type f | wc -l)
  printf 'fuzz_%-12s %s: %s runs in %s s, coverage %s edges, corpus %s inputs\n' "$t" "$status" "$runs" "$seconds" \
    "$cov" "$corpus"
  if [ "$status" = FAILED ]; then
    grep -E 'ERROR|runtime error|SUMMARY|Test unit written|terminate called|what\(\)' "$log" | head -20
    echo "  full log: $log"
  fi
done
exit "$failed"
