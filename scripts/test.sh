#!/usr/bin/env bash
# Builds sppo and runs the whole test suite (ctest), the Hugging Face checks included:
# their PyTorch and transformers are installed when they can be (scripts/install-hf.sh), and
# when they cannot (no network to PyPI, say) those tests say so and are skipped. Extra
# arguments go to ctest, e.g. `-L numerics` for one label.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
bash scripts/install-hf.sh --optional
cd build
ctest --output-on-failure -j"$(nproc)" "$@"
