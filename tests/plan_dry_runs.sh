#!/usr/bin/env bash
# A plan is a run: every SPPO plan the README and docs/planning.md state is planned again and
# checked by `train --plan P --dry-run` on the plan's own machine (its precision, profile,
# ranks and budget: no GPU is needed). Each must exit 0 with the device and host peaks the
# plan predicted, to the byte. A plan whose length no longer fits fails here too: the docs
# then state a figure the planner does not reach.
#
#   bash tests/plan_dry_runs.sh [path/to/sppo]        (default: build/sppo)
#
# Exit 0 when every plan runs dry as planned, 1 naming each that did not. The baselines' plans
# (--system megatron or deepspeed, a fifth field) are schedules too and run the same way.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
sppo=$(realpath "${1:-$root/build/sppo}")
[ -x "$sppo" ] || { echo "no sppo at $sppo; build it first (bash scripts/build.sh)"; exit 2; }
work=$(mktemp -d "${TMPDIR:-/tmp}/sppo-dry-runs-XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"

# model, sequence length, GPUs, profile[, system]: the README's code blocks and figures
# table, then docs/planning.md's code blocks and tables (the longest sequences and the
# throughput columns), each plan once.
plans=(
  "llama-3-8b 1M 16 h100-sxm"
  "gpt-7b 1M 32 a100-80gb"
  "gpt-7b 8M 32 a100-80gb"
  "llama-3-8b 5888K 8 h100-sxm"
  "llama-3-8b 1M 8 h100-sxm"
  "qwen3-8b 5248K 8 h100-sxm"
  "qwen3-8b 1M 8 h100-sxm"
  "llama-3-8b 1232K 1 h200"
  "llama-3-8b 1M 1 h200"
  "llama-3-8b 512K 1 h200"
  "gpt-13b 512K 128 a100-80gb"
  "gpt-65b 640K 128 a100-80gb"
  "gpt-7b 1008K 1 h200"
  "gpt-7b 3968K 8 h200"
  "gpt-7b 1M 8 h200"
  "llama-3-8b 7168K 8 h200"
  "llama-3-8b 2M 8 h200"
  "llama-3-8b 2M 8 h100-sxm"
  "llama-3-8b 256K 1 h100-sxm"
  "llama-3-8b 4M 64 h100-sxm"
  "gpt-7b 2M 16 h200"
  "gpt-7b 4M 128 a100-80gb"
  "llama-3-8b 8M 16 h100-sxm"
  "llama-3-8b 16M 32 h100-sxm"
  "llama-3-8b 512K 8 h100-sxm"
  "gpt-7b 512K 8 h200"
  "gpt-7b 2M 8 h200"
  "llama-3-8b 512K 8 h200"
  "llama-3-8b 1M 8 h200"
  "gpt-7b 1M 32 a100-80gb megatron"
  "llama-3-8b 512K 8 h100-sxm megatron"
  "gpt-7b 512K 8 h200 megatron"
  "gpt-7b 56K 1 h200 megatron"
  "gpt-7b 1M 32 a100-80gb deepspeed"
  "llama-3-8b 512K 8 h100-sxm deepspeed"
)

failed=0
for spec in "${plans[@]}"; do
  read -r model seq gpus hw system <<<"$spec"
  system=${system:-sppo}
  name="$model-$seq-$gpus-$hw-$system"
  if ! "$sppo" plan --model "$model" --seq-len "$seq" --gpus "$gpus" --hardware "$hw" --system "$system" \
      --out "$name.json" >/dev/null 2>"$name.plan.err"; then
    echo "FAILED: sppo plan --model $model --seq-len $seq --gpus $gpus --hardware $hw --system $system"
    sed 's/^/  | /' "$name.plan.err" | tail -3
    failed=$((failed + 1))
    continue
  fi
  "$sppo" train --plan "$name.json" --dry-run >"$name.dry.json" 2>"$name.dry.err"
  status=$?
  verdict=$(python3 - "$name.json" "$name.dry.json" "$status" <<'EOF'
import json, sys
plan = json.load(open(sys.argv[1]))
status = int(sys.argv[3])
if status != 0:
    print(f"train --dry-run exited {status}")
    sys.exit()
dry = json.load(open(sys.argv[2]))
p = plan["predicted"]
if dry["peak_device_bytes"] != p["peak_device_bytes"] or dry["peak_host_bytes"] != p["peak_host_bytes"]:
    print(f"peaks {dry['peak_device_bytes']} / {dry['peak_host_bytes']} B, the plan's "
          f"{p['peak_device_bytes']} / {p['peak_host_bytes']} B")
elif dry["ranks"] != plan["gpus"] or len(dry["per_rank"]) != plan["gpus"]:
    print(f"{dry['ranks']} ranks for a plan of {plan['gpus']} GPUs")
elif max(r["peak_device_bytes"] for r in dry["per_rank"]) > dry["device_budget_bytes"]:
    print("a rank over its budget, and exit 0")
EOF
)
  if [ -n "$verdict" ]; then
    echo "FAILED: $spec: $verdict"
    sed 's/^/  | /' "$name.dry.err" | tail -3
    failed=$((failed + 1))
  else
    echo "ok: $spec ($(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['layout'] + ', peak ' + str(d['peak_device_bytes']))" "$name.dry.json"))"
  fi
done
echo "$((${#plans[@]} - failed)) passed, $failed failed"
[ "$failed" -eq 0 ]
