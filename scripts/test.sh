#!/usr/bin/env bash
# Builds sppo and runs the whole test suite (ctest). Extra arguments go to ctest,
# e.g. `-L numerics` for one label.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
cd build
ctest --output-on-failure -j"$(nproc)" "$@"
