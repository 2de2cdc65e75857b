#!/usr/bin/env bash
# Installs what tests/hf/check_hf.py holds sppo's Llama-family models to: PyTorch from
# Debian (python3-torch, CPU only) and Hugging Face transformers 4.46.3 from PyPI, in a
# virtual environment at build/hf-venv that sees Debian's packages. Idempotent. Without
# it the test is skipped, saying so.
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(python3-torch python3-venv python3-pip)
source scripts/apt.sh
apt_install "${packages[@]}"
venv=build/hf-venv
if ! "$venv/bin/python" -c "import torch, transformers" 2>/dev/null; then
  mkdir -p build
  /usr/bin/python3 -m venv --system-site-packages "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "transformers==4.46.3"
fi
"$venv/bin/python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
