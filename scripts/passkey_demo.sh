#!/usr/bin/env bash
# Passkey retrieval on a model sppo trains, end to end on the CPU (about 10 minutes on 2
# cores): llama-tiny widened to H 128 and 3 layers learns the task at 256 tokens (haystacks
# of filler text with a five-digit key, the loss on what only retrieval predicts), its
# held-out accuracy logged as it trains, then scripts/passkey.py scores it by length and
# depth from 128 to 2048 tokens: retrieval where training reached, and (RoPE unscaled) how
# far it carries beyond.
# Usage: bash scripts/passkey_demo.sh [WORK_DIR] (default runs/passkey); STEPS=30000.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-runs/passkey}
steps=${STEPS:-30000}
[ -x build/sppo ] || bash scripts/build.sh
rm -rf "$work"
mkdir -p "$work"

echo "== 20000 haystacks of 256 tokens, labelled on the key's copy and the answer; 64 held out"
python3 scripts/passkey.py train-data --lengths 256 --count 20000 --vocab 64 --seed 5 --out "$work"
python3 scripts/passkey.py train-data --lengths 256 --count 64 --vocab 64 --seed 99 --out "$work/held"

echo "== sppo: train llama-tiny (H 128, 3 layers) at 256 tokens for $steps steps"
build/sppo train --model llama-tiny --hidden 128 --layers 3 --heads 4 --seq-len 256 --data "$work/train.u32" \
  --labels "$work/train.i32" --steps "$steps" --lr 1.5e-3 --warmup 500 --eval-data "$work/held/train.u32" \
  --eval-labels "$work/held/train.i32" --eval-every 2000 --eval-seqs 64 --metrics "$work/metrics.jsonl" \
  --save "$work/model" --quiet
build/sppo plot "$work/metrics.jsonl" --out "$work/loss.svg" --title "llama-tiny learning passkey retrieval at 256"

echo "== passkey retrieval by length and depth"
python3 scripts/passkey.py grid --sppo build/sppo --init "$work/model" --lengths 128,256,512,1K,2K --samples 8 \
  --depths 0,0.25,0.5,0.75,1 --out "$work/grid" --title "llama-tiny trained at 256 tokens"
