#!/usr/bin/env bash
# The main job: builds sppo, then shows what it is for, on the CPU, in two runs.
#
#   1. Learning: the default small model trains on the built-in long-range task (a random
#      string, then its copy), where a target in the second half is predictable only by
#      attending back half a sequence. The far-position loss falls; sppo draws the curve.
#   2. Length: one sequence of SEQ_LEN tokens under a device budget that the
#      whole-sequence reference cannot fit (the planner's memory model says how much it
#      would need, before any work). sppo cuts the sequence into subsequences and offloads
#      activations to host memory, both chosen for the budget, and draws the step.
#
# Settings (environment): SEQ_LEN (16K), DEVICE_MEMORY (96MiB), LONG_STEPS (3), MODEL
# (small), LEARN_STEPS (200), THREADS (0: all cores), OUT (build/demo). A longer or bigger
# run: SEQ_LEN=64K DEVICE_MEMORY=256MiB, or MODEL=medium DEVICE_MEMORY=512MiB.
set -euo pipefail
cd "$(dirname "$0")/.."

SEQ_LEN=${SEQ_LEN:-16K}
DEVICE_MEMORY=${DEVICE_MEMORY:-96MiB}
LONG_STEPS=${LONG_STEPS:-3}
MODEL=${MODEL:-small}
LEARN_STEPS=${LEARN_STEPS:-200}
THREADS=${THREADS:-0}
OUT=${OUT:-build/demo}

bash scripts/build.sh
sppo=./build/sppo
mkdir -p "$OUT"
rm -f "$OUT"/learn.jsonl "$OUT"/long.jsonl

echo
echo "== 1/2 learning: $MODEL model, built-in long-range task, $LEARN_STEPS steps"
"$sppo" train --model "$MODEL" --steps "$LEARN_STEPS" --threads "$THREADS" --metrics "$OUT/learn.jsonl"
"$sppo" plot "$OUT/learn.jsonl" --out "$OUT/loss.svg" \
  --title "sppo train --model $MODEL: loss on the built-in long-range task" >/dev/null
python3 - "$OUT/learn.jsonl" <<'EOF' || true
import json, sys
steps = [r for r in map(json.loads, open(sys.argv[1])) if not r.get("summary") and "loss_second_half" in r]
first, last = steps[0]["loss_second_half"], steps[-1]["loss_second_half"]
print(f"far-position loss (second half) {first:.3f} -> {last:.3f}: {last / first:.2f}x its first value")
EOF

echo
echo "== 2/2 length: $SEQ_LEN tokens in one sequence under a $DEVICE_MEMORY device budget"
# The reference (the whole sequence at once, nothing offloaded) is refused before any
# work: exit 3 with what it would need.
set +e
reference=$("$sppo" train --model "$MODEL" --seq-len "$SEQ_LEN" --device-memory "$DEVICE_MEMORY" --steps 1 \
  --threads "$THREADS" --quiet 2>&1 >/dev/null)
rc=$?
set -e
if [ "$rc" -eq 3 ]; then
  need=$(sed -n 's/.*--offload none needs \([0-9.]* [KMGT]*i*B\).*/\1/p' <<<"$reference")
  echo "the whole-sequence reference needs ${need:-more than the budget} of device memory: over the $DEVICE_MEMORY budget"
elif [ "$rc" -eq 0 ]; then
  echo "(the whole-sequence reference fits $DEVICE_MEMORY at $SEQ_LEN; lower DEVICE_MEMORY to see sppo go past it)"
else
  echo "$reference" >&2
  exit "$rc"
fi
"$sppo" train --model "$MODEL" --seq-len "$SEQ_LEN" --device-memory "$DEVICE_MEMORY" --subseqs auto \
  --offload adaptive --steps "$LONG_STEPS" --threads "$THREADS" --metrics "$OUT/long.jsonl" --svg "$OUT/long-step.svg"

echo
echo "pictures:"
echo "  $OUT/loss.svg       the learning run's loss, near and far positions"
echo "  $OUT/long-step.svg  the long run's last step: compute and copy lanes, device memory"
