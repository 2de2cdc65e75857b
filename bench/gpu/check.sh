#!/usr/bin/env bash
# The whole device check of the CUDA backend in one run (meant to take under 8 minutes on
# an H200): the kernels and a whole step against the CPU backend (GPT and Llama blocks),
# every SPPO mode against the GPU's own whole-sequence step (host and recomputed K/V, packed
# documents), the budget refusal, and the benchmarks beside PyTorch measured in the same run.
# Each section runs on its own (a failure is recorded, the rest go on) under its own time
# limit, cut to what is left of DEADLINE seconds for the whole check.
#
#   source .gpu-bundle/env.sh; OUT=... COMMIT=... bash bench/gpu/check.sh
#   SECTIONS='^(kernels|grads)' bash bench/gpu/check.sh   # only the sections this regex matches
#   bash bench/gpu/check.sh --smoke     # the same pipeline on the CPU backend, tiny shapes
#
# cuDNN's fused attention alone (about 6 minutes): its kernels' test, every mode through it,
# the attention and block benchmarks beside PyTorch. It needs sppo and tests/
# test_library_attention only; built for the H100/H200 alone (-DCMAKE_CUDA_ARCHITECTURES=90a-real)
# they travel in about 57 MiB with their libraries:
#   SECTIONS='^(kernels_cudnn|cudnn_|attention$|attention_own|layer_|torch)' DEADLINE=400 bash bench/gpu/check.sh
# Several ranks (about 2 minutes; also tests/test_nccl_comm and mpirun on the machine):
#   SECTIONS='^ranks_' DEADLINE=300 bash bench/gpu/check.sh
#
# Programs come from BIN (default build/; a bundle's bin/ holds them all in one folder).
# Writes $OUT/check.json with the keys of bench/results/<gpu>-<date>.json (the copy to
# commit) and every section's log, packed into $OUT/logs.tgz.
set -uo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-$PWD/check-out}
BIN=${BIN:-build}
SPPO=${SPPO:-$BIN/sppo}
tool() { [ -x "$BIN/$1" ] && echo "$BIN/$1" || echo "$BIN/tests/$1"; }
SECTIONS=${SECTIONS:-.}
DEADLINE=${DEADLINE:-540}
SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1
mkdir -p "$OUT/logs" "$OUT/parts" "$OUT/grads" "$OUT/cudnn"
PY=${PYTHON:-python3}
started=$(date +%s)

if [ $SMOKE = 1 ]; then
  BACKEND=(--backend cpu); FP32=(--backend cpu); BF16=(--backend cpu)
  SMALL=(--model tiny --seq-len 96 --threads 2)
  LLAMA=(--model llama-tiny --seq-len 96 --threads 2)
  CURVE=(--model tiny --seq-len 128 --steps 8 --threads 2)
  LCURVE=(--model llama-tiny --seq-len 128 --steps 8 --threads 2)
else
  BACKEND=(--backend cuda); FP32=(--backend cuda --precision fp32); BF16=(--backend cuda --precision bf16)
  SMALL=(--model small --seq-len 1024)
  # Grouped-query attention at the tensor cores' head size: 4 heads of 128 over 2 K/V heads.
  LLAMA=(--model llama-tiny --hidden 512 --heads 4 --seq-len 1024)
  CURVE=(--model medium --seq-len 4096 --steps 50)
  LCURVE=(--model llama-tiny --hidden 1024 --heads 8 --layers 4 --seq-len 4096 --steps 50)
fi

# section NAME SECONDS COMMAND...: runs the command with a time limit, its output in logs/NAME;
# skipped (rc 125) when SECTIONS does not match it or the deadline is too near.
section() {
  local name=$1 limit=$2
  shift 2
  [[ $name =~ $SECTIONS ]] || return 125
  local t0 left
  t0=$(date +%s)
  left=$(( DEADLINE - (t0 - started) - 15 ))
  (( left < limit )) && limit=$left
  if (( limit < 5 )); then
    echo "{\"section\": \"$name\", \"rc\": 125, \"seconds\": 0, \"skipped\": \"deadline\"}" >> "$OUT/parts/sections.jsonl"
    echo "$name: skipped, the deadline is near" >&2
    return 125
  fi
  timeout "$limit" "$@" > "$OUT/logs/$name.out" 2> "$OUT/logs/$name.err"
  local rc=$?
  echo "{\"section\": \"$name\", \"rc\": $rc, \"seconds\": $(( $(date +%s) - t0 ))}" >> "$OUT/parts/sections.jsonl"
  echo "$name: rc $rc, $(( $(date +%s) - t0 )) s" >&2
  return $rc
}

# cuDNN's fused attention: --attention cudnn (on the CPU smoke, auto: the CPU's own kernels).
if [ $SMOKE = 1 ]; then LIB=(--attention auto); else LIB=(--attention cudnn); fi
OWN=(--attention own)

# ---- correctness ----------------------------------------------------------------------------
if [ $SMOKE = 0 ]; then
  section kernels 90 "$(tool test_cuda_kernels)" --gtest_output=json:"$OUT/parts/kernels.json"
  # The backend's attention through cuDNN against the CPU's kernels, and cuDNN's verdicts.
  # (cuDNN's verdicts on the graphs' descriptions need no GPU: test_cudnn_graphs runs in CI.)
  section kernels_cudnn 90 "$(tool test_library_attention)" --gtest_output=json:"$OUT/parts/kernels_cudnn.json"
fi

# A whole step in fp32: the GPU against the CPU backend (relative 1e-4), then every SPPO
# mode on the GPU against the GPU's whole-sequence step (relative 1e-5); for the GPT block
# (grads/) and the Llama block (llama/: RMSNorm, SwiGLU, RoPE, grouped-query attention).
modes=("--subseqs 4 --offload 0.5" "--subseqs 5 --partition flops --offload full" "--subseqs 3 --offload adaptive"
       "--recompute" "--subseqs 4 --kv-cache host" "--subseqs 3 --kv-cache recompute --offload 0.5"
       "--subseqs 3 --recompute-tensors attention,fc_pre --mlp-tile-rows 128"
       "--subseqs 3 --offload 0.5 --kv-cache recompute --recompute-tensors all --rebuild-inputs odd")
for family in grads llama; do
  if [ $family = grads ]; then shape=("${SMALL[@]}"); else shape=("${LLAMA[@]}"); fi
  section "${family}_cpu" 120 "$SPPO" grads "${shape[@]}" --backend cpu --out "$OUT/$family/cpu"
  section "${family}_whole" 60 "$SPPO" grads "${shape[@]}" "${FP32[@]}" --out "$OUT/$family/whole"
  for k in "${!modes[@]}"; do
    # shellcheck disable=SC2086
    section "${family}_mode$k" 60 "$SPPO" grads "${shape[@]}" "${FP32[@]}" ${modes[$k]} --out "$OUT/$family/mode$k"
  done
done
# Packed documents (attention stops at each document's start): the GPU against the CPU.
$PY -c "import array, random, sys; random.seed(7)
ids = [0 if random.random() < 0.004 else random.randrange(1, 64) for _ in range(8192)]
open(sys.argv[1], 'wb').write(array.array('H', ids).tobytes())" "$OUT/docs.u16"
PACK=(--data "$OUT/docs.u16" --doc-sep 0 --pack)
section packed_cpu 120 "$SPPO" grads "${LLAMA[@]}" "${PACK[@]}" --subseqs 3 --offload 0.5 --backend cpu --out "$OUT/packed/cpu"
section packed_gpu 60 "$SPPO" grads "${LLAMA[@]}" "${PACK[@]}" --subseqs 3 --offload 0.5 "${FP32[@]}" --out "$OUT/packed/gpu"

# bf16 through cuDNN: every mode against the GPU's whole-sequence step through cuDNN (the
# same kernels, so rounding apart the same gradients), the whole step against the own kernels'
# (bf16 rounding), packed documents; GPT (grads/) and Llama with grouped-query heads (llama/).
for family in grads llama; do
  if [ $family = grads ]; then shape=("${SMALL[@]}"); else shape=("${LLAMA[@]}"); fi
  section "cudnn_${family}_whole" 60 "$SPPO" grads "${shape[@]}" "${BF16[@]}" "${LIB[@]}" --out "$OUT/cudnn/$family/whole"
  section "cudnn_${family}_own" 60 "$SPPO" grads "${shape[@]}" "${BF16[@]}" "${OWN[@]}" --out "$OUT/cudnn/$family/own"
  for k in "${!modes[@]}"; do
    # shellcheck disable=SC2086
    section "cudnn_${family}_mode$k" 60 "$SPPO" grads "${shape[@]}" "${BF16[@]}" "${LIB[@]}" ${modes[$k]} \
      --out "$OUT/cudnn/$family/mode$k"
  done
done
section cudnn_packed 60 "$SPPO" grads "${LLAMA[@]}" "${PACK[@]}" --subseqs 3 --offload 0.5 "${BF16[@]}" "${LIB[@]}" \
  --out "$OUT/cudnn/packed/lib"
section cudnn_packed_own 60 "$SPPO" grads "${LLAMA[@]}" "${PACK[@]}" --subseqs 3 --offload 0.5 "${BF16[@]}" "${OWN[@]}" \
  --out "$OUT/cudnn/packed/own"
# The bf16 curve through cuDNN (SPPO, host K/V streamed) within 1% of the fp32 whole-sequence one.
section cudnn_curve_fp32 120 "$SPPO" train "${LCURVE[@]}" "${FP32[@]}" --quiet --metrics "$OUT/parts/cudnn_curve_fp32.jsonl"
section cudnn_curve 120 "$SPPO" train "${LCURVE[@]}" "${BF16[@]}" "${LIB[@]}" --subseqs 4 --offload 0.5 --kv-cache host \
  --quiet --metrics "$OUT/parts/cudnn_curve.jsonl"

# bf16: the loss curve of every mode within 1% of the whole-sequence bf16 curve.
section curve_whole 120 "$SPPO" train "${CURVE[@]}" "${BF16[@]}" --quiet --metrics "$OUT/parts/curve_whole.jsonl"
section curve_sppo 120 "$SPPO" train "${CURVE[@]}" "${BF16[@]}" --subseqs 4 --partition flops --offload 0.5 \
  --quiet --metrics "$OUT/parts/curve_sppo.jsonl"
section curve_llama_whole 120 "$SPPO" train "${LCURVE[@]}" "${BF16[@]}" --quiet --metrics "$OUT/parts/curve_llama_whole.jsonl"
section curve_llama_sppo 120 "$SPPO" train "${LCURVE[@]}" "${BF16[@]}" --subseqs 4 --offload 0.5 --kv-cache host \
  --quiet --metrics "$OUT/parts/curve_llama_sppo.jsonl"
# The layers' weights on the host (--weights host: each layer's fp32 weights brought for the
# forward and backward that run it, its bf16 working copy converted on the device): the curve
# within 1% of the same run with the weights on the device (both with the optimizer on the host).
WHOST=(--subseqs 4 --offload 0.5 --backward-order layer --optimizer-state host --quiet)
section curve_weights_device 120 "$SPPO" train "${LCURVE[@]}" "${BF16[@]}" "${WHOST[@]}" --weights device \
  --metrics "$OUT/parts/curve_weights_device.jsonl"
section curve_weights_host 120 "$SPPO" train "${LCURVE[@]}" "${BF16[@]}" "${WHOST[@]}" --weights host \
  --metrics "$OUT/parts/curve_weights_host.jsonl"

# The budget: a run at exactly the predicted peak fits; one byte less is refused (exit 3).
# The placement is pinned: with --kv-cache and --recompute-tensors auto a smaller budget
# moves K/V or saved tensors off the device instead of refusing, and with --backward-order
# auto it runs the layer-major order.
PIN=(--kv-cache device --recompute-tensors none --backward-order subseq)
section budget_probe 60 "$SPPO" train "${SMALL[@]}" "${BACKEND[@]}" "${PIN[@]}" --subseqs 4 --offload 0.5 --steps 1 --quiet \
  --metrics "$OUT/parts/budget_probe.jsonl"
peak=$($PY -c "import json,sys; print([json.loads(l) for l in open(sys.argv[1])][-1]['predicted_peak_device_bytes'])" \
  "$OUT/parts/budget_probe.jsonl" 2>/dev/null || echo 0)
section budget_exact 60 "$SPPO" train "${SMALL[@]}" "${BACKEND[@]}" "${PIN[@]}" --subseqs 4 --offload 0.5 --steps 1 --quiet \
  --device-memory "${peak}B"
section budget_less 60 "$SPPO" train "${SMALL[@]}" "${BACKEND[@]}" "${PIN[@]}" --subseqs 4 --offload 0.5 --steps 1 --quiet \
  --device-memory "$((peak - 1))B"

# ---- several ranks ------------------------------------------------------------------------------
# Two ranks on the one GPU, their messages staged through pinned host memory (--comm mpi: NCCL
# refuses two ranks of a communicator on one device), for each parallelism with subsequences
# and offload, in fp32 against the one-rank GPU run (relative 1e-5); NCCL on one rank through
# every collective and messages to itself; and a plan for 2 GPUs run as planned. On the CPU
# smoke, the same on CPU ranks.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MPIRUN=(mpirun --oversubscribe --bind-to none -np 2)
if [ $SMOKE = 1 ]; then RANKS=(--backend cpu); else RANKS=(--backend cuda --precision fp32); fi
mkdir -p "$OUT/ranks"
section ranks_ref 60 "$SPPO" grads "${SMALL[@]}" "${RANKS[@]}" --out "$OUT/ranks/ref"
section ranks_ref2 60 "$SPPO" grads "${SMALL[@]}" "${RANKS[@]}" --batch 2 --out "$OUT/ranks/ref2"
layouts=("pp2:--pp 2 --subseqs 4 --offload 0.5" "cp2:--cp 2 --ring zigzag --subseqs 2 --offload 0.5"
         "tp2:--tp 2 --subseqs 3" "dp2:--dp 2 --zero 1 --subseqs 2 --offload 0.5")
for entry in "${layouts[@]}"; do
  name=${entry%%:*}
  # shellcheck disable=SC2086
  section "ranks_$name" 90 "${MPIRUN[@]}" "$SPPO" grads "${SMALL[@]}" "${RANKS[@]}" --comm mpi ${entry#*:} \
    --out "$OUT/ranks/$name"
done
# TP in bf16 (bf16 rows gathered, fp32 sums): against the one-rank bf16 run, bf16's rounding.
BRANKS=("${BF16[@]}")
section ranks_ref_bf16 60 "$SPPO" grads "${SMALL[@]}" "${BRANKS[@]}" --out "$OUT/ranks/ref_bf16"
section ranks_tp2_bf16 90 "${MPIRUN[@]}" "$SPPO" grads "${SMALL[@]}" "${BRANKS[@]}" --comm mpi --tp 2 --subseqs 3 \
  --out "$OUT/ranks/tp2_bf16"
if [ $SMOKE = 0 ]; then
  section ranks_nccl_self 60 "$(tool test_nccl_comm)" --gtest_output=json:"$OUT/parts/ranks_nccl_self.json"
  section ranks_plan_make 30 "$SPPO" plan --model small --seq-len 16K --gpus 2 --gpus-per-node 2 --hardware h100-sxm \
    --out "$OUT/ranks/plan2.json"
  section ranks_plan 120 "${MPIRUN[@]}" "$SPPO" train --plan "$OUT/ranks/plan2.json" --backend cuda --steps 2 --quiet \
    --metrics "$OUT/parts/ranks_plan.jsonl"
fi

# ---- benchmarks, beside PyTorch in the same run ------------------------------------------------
if [ $SMOKE = 0 ]; then
  # In the order of their worth, should the deadline cut the last ones.
  section attention 60 "$SPPO" bench attention "${BF16[@]}" "${LIB[@]}" --json
  section attention_own 90 "$SPPO" bench attention "${BF16[@]}" "${OWN[@]}" --json
  section attention_kernels 60 "$(tool gpu_attention_bench)"  # each tile kernel against the SIMT one
  for S in 16384 65536 131072; do
    section "layer_$S" 90 "$SPPO" bench layer "${BF16[@]}" "${LIB[@]}" --hidden 4096 --heads 32 --seq-len $S --reps 3 \
      --breakdown --json
  done
  section offload 60 "$SPPO" bench offload "${BF16[@]}" --model medium --seq-len 32768 --subseqs 8 --json
  # MEMORY=1: the longest sequence of PyTorch with checkpointing and of SPPO, and both step
  # times at PyTorch's (minutes each at a million tokens).
  if [ "${MEMORY:-0}" = 1 ]; then
    section torch 300 "$PY" bench/gpu/torch_peer.py --memory
    torch_max=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['memory']['torch_ckpt_max_seq'])" \
      "$OUT/logs/torch.out" 2>/dev/null || echo 0)
    section memory 300 "$SPPO" bench memory "${BF16[@]}" --model gpt-7b --layers 8 --at-seq-len "$torch_max" \
      --host-memory 96GiB --json
  else
    section torch 120 "$PY" bench/gpu/torch_peer.py
  fi
  # PROFILE=FILE: a profile measured before on this GPU (sppo profile takes 40 s).
  if [ -n "${PROFILE:-}" ]; then
    cp "$PROFILE" "$OUT/parts/profile.json"
  else
    section profile 60 "$SPPO" profile "${BACKEND[@]}" --out "$OUT/parts/profile.json"
  fi
  # The simulator on the profile just measured, against three real one-GPU SPPO steps.
  section sim 300 "$SPPO" bench sim "${BF16[@]}" --hardware "$OUT/parts/profile.json" --reps 2 --json
else
  section attention 60 "$SPPO" bench attention "${BACKEND[@]}" "${LIB[@]}" --seq-len 256 --queries 64 --prefix 192 \
    --heads 2 --chunk 64 --reps 1 --json
  section attention_own 60 "$SPPO" bench attention "${BACKEND[@]}" "${OWN[@]}" --seq-len 256 --queries 64 --prefix 192 \
    --heads 2 --chunk 64 --reps 1 --json
  section layer_smoke 60 "$SPPO" bench layer "${BACKEND[@]}" --hidden 64 --heads 4 --seq-len 256 --reps 1 --breakdown \
    --json
  section offload 120 "$SPPO" bench offload "${BACKEND[@]}" --model tiny --seq-len 512 --subseqs 4 --reps 1 --json
fi

# ---- the results ----------------------------------------------------------------------------
$PY bench/gpu/collect.py "$OUT" "$SMOKE" "${COMMIT:-unknown}"
# What comes back: check.json and one archive of the logs (the gradients stay behind).
tar czf "$OUT/logs.tgz" -C "$OUT" logs parts && rm -rf "$OUT/logs" "$OUT/parts" "$OUT/grads" "$OUT/llama" \
  "$OUT/packed" "$OUT/cudnn" "$OUT/ranks" "$OUT/docs.u16"
echo "check: $(( $(date +%s) - started )) s; results in $OUT/check.json" >&2
