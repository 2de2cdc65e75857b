#!/usr/bin/env bash
# ctest's entry to check_hf.py (with --chat: check_chat.py; --tensorboard:
# check_tensorboard.py; --eval: check_eval.py): the interpreter of
# build/hf-venv (scripts/install-hf.sh) when it is there, else python3; each exits 77
# (skipped) without what it compares against.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python=python3
[ -x "$here/../../build/hf-venv/bin/python" ] && python="$here/../../build/hf-venv/bin/python"
script=check_hf.py
[ "${1:-}" = "--chat" ] && script=check_chat.py && shift
[ "${1:-}" = "--tensorboard" ] && script=check_tensorboard.py && shift
[ "${1:-}" = "--eval" ] && script=check_eval.py && shift
# Qwen3's cases need transformers 4.51 or later: `scripts/install-hf.sh --qwen3` puts it here
# (TensorBoard is in build/hf-venv only).
[ -x "$here/../../build/hf3-venv/bin/python" ] && [ "$script" != check_tensorboard.py ] &&
  python="$here/../../build/hf3-venv/bin/python"
exec "$python" "$here/$script" "$@"
