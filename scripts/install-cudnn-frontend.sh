#!/usr/bin/env bash
# Unpacks the headers of NVIDIA's cudnn-frontend (header-only C++ over cuDNN's graph API),
# one pinned version from PyPI's nvidia-cudnn-frontend wheel, into build/cudnn-frontend/:
# the CUDA backend's fused attention (src/backends/cuda/sdpa_cudnn.cpp) compiles against
# them. Only builds with CUDA need it; the CPU build never does. Idempotent: a folder that
# already holds this version is left alone.
#   bash scripts/install-cudnn-frontend.sh [DEST]   # DEST: default build/cudnn-frontend
set -euo pipefail
cd "$(dirname "$0")/.."

version=1.32.0
# The wheel pip picks for CPython 3.11 on manylinux_2_28 x86_64 (the headers are the same in
# every wheel of a version; one is pinned so that its hash can be).
sha256=c6006556017a4d1c914c52a556c71b1267f2d6a0500f742e7b4edef539878df0
dest=${1:-build/cudnn-frontend}

if [ -f "$dest/VERSION" ] && [ "$(cat "$dest/VERSION")" = "$version" ] && [ -f "$dest/include/cudnn_frontend.h" ]; then
  exit 0
fi
if ! python3 -m pip --version >/dev/null 2>&1; then
  source scripts/apt.sh
  apt_install python3-pip
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "nvidia-cudnn-frontend==$version --hash=sha256:$sha256" > "$tmp/requirements.txt"
python3 -m pip download --quiet --no-deps --require-hashes --only-binary=:all: --python-version 3.11 \
  --implementation cp --abi cp311 --platform manylinux_2_28_x86_64 -r "$tmp/requirements.txt" -d "$tmp/wheel"
python3 - "$tmp"/wheel/*.whl "$tmp/unpacked" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    names = [n for n in z.namelist() if n.startswith("include/")]
    if not any(n == "include/cudnn_frontend.h" for n in names):
        sys.exit("install-cudnn-frontend: the wheel has no include/cudnn_frontend.h")
    z.extractall(sys.argv[2], names)
EOF
rm -rf "$dest"
mkdir -p "$(dirname "$dest")"
mv "$tmp/unpacked" "$dest"
echo "$version" > "$dest/VERSION"
echo "install-cudnn-frontend: cudnn-frontend $version headers in $dest/include"
