#!/usr/bin/env bash
# Runs tests/cuda/test_cuda_kernels.cpp, test_library_attention.cpp and the far-offset tests
# beside this script (test_offsets64.cpp: tensors past 2^31 elements) on the CPU, with the CUDA
# kernels of src/backends/cuda compiled by the host compiler against emu.h (fibers for threads,
# warp collectives and the tensor-core instructions emulated from the PTX ISA's definitions),
# and cuDNN's fused attention replaced by a float64 stand-in with its semantics
# (sdpa_reference.cpp). It checks the kernels' index logic, masking, tiling, barriers and
# fragment layouts, and the library attention's pieces, merges and scratch, without a GPU; it
# cannot check timing, cuBLASLt, CUB or cuDNN itself (those tests are filtered out) or the real
# instructions' rounding.
#   bash tests/cuda/emulate/run.sh [BUILD_DIR] [--gtest_filter=...]
# BUILD_DIR (default build/) must hold libsppo_cpu.a, libsppo_backend.a and libsppo_core.a. The whole run takes
# 10 to 20 minutes on two cores, most of it in the attention tests; pass a --gtest_filter to
# run less.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
build=${1:-$root/build}
shift || true
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
mkdir -p "$out/backends/cuda"
src=$root/src/backends/cuda
for f in common.cuh check.h attention.h attention_impl.cuh ops.h; do cp "$src/$f" "$out/backends/cuda/"; done
cp "$here/ptx_emu.cuh" "$out/backends/cuda/ptx.cuh"
# EMU_OPT: the optimisation (default -O2 -g, for the long attention runs); ctest's short run
# passes -O1, where compiling is most of the time (14 s against 20 s on two cores).
read -r -a opt <<<"${EMU_OPT:--O2 -g}"
cxx=(g++ -std=c++20 "${opt[@]}" -fno-strict-aliasing -w -I"$out" -I"$here/include" -I"$root/src" -I"$root/tests")
objs=() pids=()
for f in ops attention attention_tc; do
  python3 "$here/rewrite.py" "$src/$f.cu" "$out/$f.cpp"
  "${cxx[@]}" -include "$here/emu.h" -c "$out/$f.cpp" -o "$out/$f.o" & pids+=($!)
  objs+=("$out/$f.o")
done
"${cxx[@]}" -c "$src/check.cpp" -o "$out/check.o" & pids+=($!)
"${cxx[@]}" -c "$here/stubs.cpp" -o "$out/stubs.o" & pids+=($!)
"${cxx[@]}" -c "$root/tests/cuda/test_cuda_kernels.cpp" -o "$out/test.o" & pids+=($!)
"${cxx[@]}" -c "$src/library_attention.cpp" -o "$out/library_attention.o" & pids+=($!)
"${cxx[@]}" -c "$here/sdpa_reference.cpp" -o "$out/sdpa_reference.o" & pids+=($!)
"${cxx[@]}" -c "$root/tests/cuda/test_library_attention.cpp" -o "$out/test_library.o" & pids+=($!)
"${cxx[@]}" -c "$here/test_offsets64.cpp" -o "$out/test_offsets64.o" & pids+=($!)
objs+=("$out/library_attention.o" "$out/sdpa_reference.o" "$out/test_library.o" "$out/test_offsets64.o")
for p in "${pids[@]}"; do wait "$p"; done
ompblas=/usr/lib/$(gcc -print-multiarch)/openblas-openmp
g++ -o "$out/test_cuda_kernels_emulated" "$out/test.o" "${objs[@]}" "$out/check.o" "$out/stubs.o" \
  "$build/libsppo_cpu.a" "$build/libsppo_backend.a" "$build/libsppo_core.a" -L"$ompblas" -Wl,-rpath,"$ompblas" -lopenblas \
  -lgtest -lgtest_main -fopenmp -pthread
"$out/test_cuda_kernels_emulated" --gtest_filter='-*Gemm*:*Linear*:*Embedding*' "$@"
