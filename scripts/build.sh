#!/usr/bin/env bash
# Installs the dependencies and builds everything into build/ (the CLI is build/sppo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)"
