#!/usr/bin/env bash
# The main job: builds sppo, then trains the default small model on the built-in
# long-range task on the CPU. Extra arguments go to `sppo train`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
exec ./build/sppo train "$@"
