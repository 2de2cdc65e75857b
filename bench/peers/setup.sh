#!/usr/bin/env bash
# One-line setup for the CPU peers: a virtual environment at bench/peers/.venv with the
# latest PyTorch 2.x from PyPI. PyPI's default torch wheel carries the CUDA libraries
# (gigabytes); the CPU kernels are the same. Not run by CI.
#   bash bench/peers/setup.sh
#   bench/peers/.venv/bin/python bench/peers/torch_block.py --seq-len 4K
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python3 -m venv "$here/.venv"
"$here/.venv/bin/python" -m pip install --upgrade pip
"$here/.venv/bin/python" -m pip install 'torch>=2,<3' numpy  # numpy: torch warns without it
"$here/.venv/bin/python" -c 'import torch; print("torch", torch.__version__, "threads", torch.get_num_threads())'
