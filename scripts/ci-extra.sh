#!/usr/bin/env bash
# CI's checks beyond the test suite, run after `bash scripts/test.sh` (.ci/run):
#   1. unit and numerics tests under AddressSanitizer + UBSan (scripts/sanitize.sh asan)
#   2. runtime tests under ThreadSanitizer                   (scripts/sanitize.sh tsan)
#   3. every fuzz target for FUZZ_SECONDS (default 30 here)  (scripts/fuzz.sh)
# Prints each part's time; about 25 minutes on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."

export FUZZ_SECONDS=${FUZZ_SECONDS:-30}
start=$(date +%s)
part() {
  local name=$1
  shift
  local t0=$(date +%s)
  echo "== $name"
  "$@"
  echo "== $name: $(($(date +%s) - t0)) s"
}
part "sanitizers: asan+ubsan" bash scripts/sanitize.sh asan
part "sanitizers: tsan" bash scripts/sanitize.sh tsan
part "fuzzing: ${FUZZ_SECONDS} s per target" bash scripts/fuzz.sh
echo "== ci-extra: $(($(date +%s) - start)) s in all"
