#!/usr/bin/env bash
# The whole device check of the CUDA backend in one run (meant to take under 8 minutes on
# an H200): the kernels and a whole step against the CPU backend, every SPPO mode against
# the GPU's own whole-sequence step, the budget refusal, and the benchmarks beside PyTorch
# measured in the same run. Each section runs on its own (a failure is recorded, the rest
# go on) under its own time limit.
#
#   source .gpu-bundle/env.sh; OUT=... COMMIT=... bash bench/gpu/check.sh
#   bash bench/gpu/check.sh --smoke     # the same pipeline on the CPU backend, tiny shapes
#
# Writes $OUT/check.json with the keys of bench/results/<gpu>-<date>.json (the copy to
# commit) and every section's log under $OUT/logs.
set -uo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-$PWD/check-out}
SPPO=${SPPO:-build/sppo}
SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1
mkdir -p "$OUT/logs" "$OUT/parts"
PY=${PYTHON:-python3}
started=$(date +%s)

if [ $SMOKE = 1 ]; then
  BACKEND=(--backend cpu); FP32=(--backend cpu); BF16=(--backend cpu)
  SMALL=(--model tiny --seq-len 96 --threads 2)
  CURVE=(--model tiny --seq-len 128 --steps 8 --threads 2)
else
  BACKEND=(--backend cuda); FP32=(--backend cuda --precision fp32); BF16=(--backend cuda --precision bf16)
  SMALL=(--model small --seq-len 1024)
  CURVE=(--model medium --seq-len 4096 --steps 50)
fi

# section NAME SECONDS COMMAND...: runs the command with a time limit, its output in logs/NAME.
section() {
  local name=$1 limit=$2
  shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/logs/$name.out" 2> "$OUT/logs/$name.err"
  local rc=$?
  echo "{\"section\": \"$name\", \"rc\": $rc, \"seconds\": $(( $(date +%s) - t0 ))}" >> "$OUT/parts/sections.jsonl"
  echo "$name: rc $rc, $(( $(date +%s) - t0 )) s" >&2
  return $rc
}

# ---- correctness ----------------------------------------------------------------------------
if [ $SMOKE = 0 ]; then
  section kernels 240 build/tests/test_cuda_kernels --gtest_output=json:"$OUT/parts/kernels.json"
fi

# A whole step in fp32: the GPU against the CPU backend (relative 1e-4), then every SPPO
# mode on the GPU against the GPU's whole-sequence step (relative 1e-5).
section grads_cpu 120 "$SPPO" grads "${SMALL[@]}" --backend cpu --out "$OUT/grads/cpu"
section grads_whole 60 "$SPPO" grads "${SMALL[@]}" "${FP32[@]}" --out "$OUT/grads/whole"
modes=("--subseqs 4 --offload 0.5" "--subseqs 5 --partition flops --offload full" "--subseqs 3 --offload adaptive"
       "--recompute")
for k in "${!modes[@]}"; do
  # shellcheck disable=SC2086
  section "grads_mode$k" 60 "$SPPO" grads "${SMALL[@]}" "${FP32[@]}" ${modes[$k]} --out "$OUT/grads/mode$k"
done

# bf16: the loss curve of every mode within 1% of the whole-sequence bf16 curve.
section curve_whole 120 "$SPPO" train "${CURVE[@]}" "${BF16[@]}" --quiet --metrics "$OUT/parts/curve_whole.jsonl"
section curve_sppo 120 "$SPPO" train "${CURVE[@]}" "${BF16[@]}" --subseqs 4 --partition flops --offload 0.5 \
  --quiet --metrics "$OUT/parts/curve_sppo.jsonl"

# The budget: a run at exactly the predicted peak fits; one byte less is refused (exit 3).
section budget_probe 60 "$SPPO" train "${SMALL[@]}" "${BACKEND[@]}" --subseqs 4 --offload 0.5 --steps 1 --quiet \
  --metrics "$OUT/parts/budget_probe.jsonl"
peak=$($PY -c "import json,sys; print([json.loads(l) for l in open(sys.argv[1])][-1]['predicted_peak_device_bytes'])" \
  "$OUT/parts/budget_probe.jsonl" 2>/dev/null || echo 0)
section budget_exact 60 "$SPPO" train "${SMALL[@]}" "${BACKEND[@]}" --subseqs 4 --offload 0.5 --steps 1 --quiet \
  --device-memory "${peak}B"
section budget_less 60 "$SPPO" train "${SMALL[@]}" "${BACKEND[@]}" --subseqs 4 --offload 0.5 --steps 1 --quiet \
  --device-memory "$((peak - 1))B"

# ---- benchmarks, beside PyTorch in the same run ------------------------------------------------
if [ $SMOKE = 0 ]; then
  section attention 180 "$SPPO" bench attention "${BF16[@]}" --json
  section attention_kernels 120 build/gpu_attention_bench  # each tile kernel against the SIMT one
  for S in 16384 65536 131072; do
    section "layer_$S" 120 "$SPPO" bench layer "${BF16[@]}" --hidden 4096 --heads 32 --seq-len $S --reps 3 --json
  done
  section offload 120 "$SPPO" bench offload "${BF16[@]}" --model medium --seq-len 32768 --subseqs 8 --json
  section profile 120 "$SPPO" profile "${BACKEND[@]}" --out "$OUT/parts/profile.json"
  # The simulator on the profile just measured, against three real one-GPU SPPO steps.
  section sim 240 "$SPPO" bench sim "${BF16[@]}" --hardware "$OUT/parts/profile.json" --reps 2 --json
  section torch 300 "$PY" bench/gpu/torch_peer.py
  torch_max=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['memory']['torch_ckpt_max_seq'])" \
    "$OUT/logs/torch.out" 2>/dev/null || echo 0)
  section memory 300 "$SPPO" bench memory "${BF16[@]}" --model gpt-7b --layers 8 --at-seq-len "$torch_max" --json
else
  section attention 60 "$SPPO" bench attention "${BACKEND[@]}" --seq-len 256 --queries 64 --prefix 192 --heads 2 \
    --reps 1 --json
  section layer_smoke 60 "$SPPO" bench layer "${BACKEND[@]}" --hidden 64 --heads 4 --seq-len 256 --reps 1 --json
  section offload 120 "$SPPO" bench offload "${BACKEND[@]}" --model tiny --seq-len 512 --subseqs 4 --reps 1 --json
fi

# ---- the results ----------------------------------------------------------------------------
$PY bench/gpu/collect.py "$OUT" "$SMOKE" "${COMMIT:-unknown}"
echo "check: $(( $(date +%s) - started )) s; results in $OUT/check.json" >&2
