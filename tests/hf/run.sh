#!/usr/bin/env bash
# ctest's entry to check_hf.py: the interpreter of build/hf-venv (scripts/install-hf.sh)
# when it is there, else python3; check_hf.py exits 77 (skipped) without torch.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python=python3
[ -x "$here/../../build/hf-venv/bin/python" ] && python="$here/../../build/hf-venv/bin/python"
exec "$python" "$here/check_hf.py" "$@"
