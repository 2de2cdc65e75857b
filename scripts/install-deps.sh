#!/usr/bin/env bash
# Installs what sppo builds and tests with, from Debian's packages. Idempotent: packages
# already present are left alone, and nothing is asked when all are there.
set -euo pipefail

packages=(
  cmake g++ make ninja-build pkg-config
  libopenblas-openmp-dev     # SGEMM, on the same OpenMP thread pool as the kernels
  libomp-dev                 # OpenMP runtime headers (GCC's libgomp comes with g++)
  libopenmpi-dev openmpi-bin # ranks for the multi-process modes and their tests
  nlohmann-json3-dev         # JSON for plans, configs, metrics, safetensors headers
  libcli11-dev               # the command line
  libtomlplusplus-dev        # --config files (TOML)
  libgtest-dev               # tests
  libbenchmark-dev           # micro-benchmarks
  python3                    # the CUDA kernels' CPU emulation (tests/cuda/emulate) rewrites sources
)

cd "$(dirname "$0")/.."
source scripts/apt.sh
apt_install "${packages[@]}"
