#!/usr/bin/env bash
# Installs what tests/hf/check_hf.py holds sppo's Llama-family models to: PyTorch from
# Debian (python3-torch, CPU only; python3-jinja2 for chat templates) and Hugging Face
# transformers 4.46.3 from PyPI (and TensorBoard 2.18.0, whose reader tests/hf/check_tensorboard.py
# holds train --tensorboard's event files to), in a virtual environment at build/hf-venv that sees
# Debian's packages. Idempotent. Without it the test is skipped, saying so; with --optional
# (CI) a failed install (no network to PyPI, say) is reported and the script succeeds, so
# that the rest still runs.
#
# --qwen3: Qwen3ForCausalLM needs transformers 4.51 or later, which needs PyTorch 2: PyPI's
# torch (with its CUDA libraries: about 5.6 GB, two minutes here) and transformers 4.57 in
# build/hf3-venv. tests/hf/run.sh prefers it when it is there; scripts/chat_extension.sh
# needs it.
set -euo pipefail
cd "$(dirname "$0")/.."
optional=false qwen3=false
for a in "$@"; do
  case "$a" in
    --optional) optional=true ;;
    --qwen3) qwen3=true ;;
    *) echo "usage: $0 [--optional] [--qwen3]" >&2; exit 2 ;;
  esac
done
install() {
  source scripts/apt.sh
  apt_install python3-torch python3-venv python3-pip python3-jinja2
  local venv=build/hf-venv
  if ! "$venv/bin/python" -c "import torch, transformers, tensorboard" 2>/dev/null; then
    mkdir -p build
    /usr/bin/python3 -m venv --system-site-packages "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check "transformers==4.46.3" "tensorboard==2.18.0"
  fi
  "$venv/bin/python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
}
install_qwen3() {
  source scripts/apt.sh
  apt_install python3-venv python3-pip
  local venv=build/hf3-venv
  if ! "$venv/bin/python" -c "import torch, transformers, tokenizers, jinja2; transformers.Qwen3ForCausalLM" 2>/dev/null; then
    mkdir -p build
    /usr/bin/python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check "torch==2.*" "transformers==4.57.*" safetensors jinja2
  fi
  "$venv/bin/python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
}
if $qwen3; then
  install_qwen3
elif $optional; then
  (install) || echo "install-hf: PyTorch or transformers could not be installed; tests/hf will be skipped"
else
  install
fi
