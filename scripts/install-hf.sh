#!/usr/bin/env bash
# Installs what tests/hf/check_hf.py holds sppo's Llama-family models to: PyTorch from
# Debian (python3-torch, CPU only) and Hugging Face transformers 4.46.3 from PyPI, in a
# virtual environment at build/hf-venv that sees Debian's packages. Idempotent. Without
# it the test is skipped, saying so.
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(python3-torch python3-venv python3-pip)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
venv=build/hf-venv
if ! "$venv/bin/python" -c "import torch, transformers" 2>/dev/null; then
  mkdir -p build
  /usr/bin/python3 -m venv --system-site-packages "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "transformers==4.46.3"
fi
"$venv/bin/python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
