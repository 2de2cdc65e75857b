#!/usr/bin/env bash
# Planner and simulator figures of issue 4, from the `sppo` binary:
#  1. the sppo / megatron / deepspeed table on a100-80gb (sppo plan --table);
#  2. bubble ratio of the sequence pipeline without and with MSP against (P-1)/N;
#  3. the wall time of simulating a 128-GPU, 4M-token step.
# Usage: bench/plan_checks.sh [path/to/sppo]   (default: build/sppo)
set -euo pipefail
SPPO=${1:-build/sppo}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== table: a100-80gb, 8 GPUs per node, adaptive offload, MSP when it pays"
"$SPPO" plan --table

echo
echo "== bubbles: gpt-7b 256K, 8 stages (sp 1), FLOPs-balanced; simulated vs (P-1)/N"
"$SPPO" plan --model gpt-7b --seq-len 256K --gpus 8 --msp off --out "$work/base.json" > /dev/null || true
for n in 16 32 64; do
  for msp in false true; do
    python3 - "$work/base.json" "$work/p.json" "$n" "$msp" <<'PY'
import json, sys
src, dst, n, msp = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "true"
p = json.load(open(src))
S, L = p["seq_len"], p["model_config"]["layers"]
p.update(sp=1, pp=8, dp=1, subseqs=n, msp=msp, stage_layers=[L // 8] * 8)
# FLOPs-balanced lengths, as planner/partition.cpp: equal prefix-cost steps of
# G(x) = 2H x^2 + (g + 2H) x with g the GEMM FLOPs per token.
H, F = p["model_config"]["hidden"], p["model_config"]["hidden"] * p["model_config"]["ffn_mult"]
a, b = 2 * H, 8 * H * H + 4 * F * H + 2 * H
total = a * S * S + b * S
bounds = [0] + [round((-b + (b * b + 4 * a * total * k / n) ** 0.5) / (2 * a)) for k in range(1, n)] + [S]
p["lengths"] = [bounds[i + 1] - bounds[i] for i in range(n)]
p["alpha"] = [0.0] * n
json.dump(p, open(dst, "w"))
PY
    r=$("$SPPO" simulate "$work/p.json" --json)
    python3 -c "import json,sys; r=json.loads(sys.argv[1]); print(f'N {sys.argv[2]:>3} msp {sys.argv[3]:<5} bubble {r[\"bubble_ratio\"]:.4f}  (P-1)/N {7/int(sys.argv[2]):.4f}  step {r[\"step_time_s\"]:.3f} s  peak {r[\"peak_device_bytes\"]/2**30:.1f} GiB')" "$r" "$n" "$msp"
  done
done

echo
echo "== simulate: gpt-7b 4M tokens on 128 GPUs"
"$SPPO" plan --model gpt-7b --seq-len 4M --gpus 128 --out "$work/big.json" > /dev/null
"$SPPO" simulate "$work/big.json" --json | python3 -c "import json,sys; r=json.load(sys.stdin); print(f'step {r[\"step_time_s\"]:.1f} s, {r[\"tokens_per_gpu_per_s\"]:.1f} tokens/GPU/s, simulated in {r[\"simulate_wall_s\"]:.3f} s')"
