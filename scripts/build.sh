#!/usr/bin/env bash
# Installs the dependencies and builds everything into build/ (the CLI is build/sppo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
source scripts/configure.sh
configure build -S . -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$(nproc)"
