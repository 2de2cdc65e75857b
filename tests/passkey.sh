#!/usr/bin/env bash
# Passkey retrieval end to end (scripts/passkey.py), with python3 alone: a tiny model trained
# for a few steps, a grid of haystacks in the built-in character tokenizer evaluated by
# `sppo eval` and drawn by `sppo plot`. The model is too small and too briefly trained to
# retrieve anything: this checks the plumbing (haystack lengths, the labels scoring exactly
# the answer, a cell per (length, depth) in the JSON and the heat map), not the accuracy.
# Also: a grid past the device budget exits 3 with sppo's message, bad input exits 2, and a
# malformed grid file is refused by `sppo plot` naming it.
# Prints "N passed, M failed" and exits 1 when any failed.
#
#   bash tests/passkey.sh [path/to/sppo]     (default: build/sppo; ctest passes it)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
sppo=$(realpath "${1:-$root/build/sppo}")
passkey="$root/scripts/passkey.py"
[ -x "$sppo" ] || { echo "no sppo at $sppo; build it first (bash scripts/build.sh)"; exit 2; }

work=$(mktemp -d "${TMPDIR:-/tmp}/sppo-passkey-XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"

passed=0
failed=0
check() {  # check NAME COMMAND...: the command must succeed
  local name=$1
  shift
  if "$@"; then
    passed=$((passed + 1))
  else
    echo "FAIL: $name"
    failed=$((failed + 1))
  fi
}
# expect_exit STATUS TEXT COMMAND...: the command must exit STATUS and print TEXT.
expect_exit() {
  local status=$1 text=$2
  shift 2
  "$@" >out.txt 2>&1
  local rc=$?
  if [ "$rc" -eq "$status" ] && grep -qF -- "$text" out.txt; then
    passed=$((passed + 1))
  else
    echo "FAIL: exit $rc (want $status) or no \"$text\" in the output of: $*"
    sed 's/^/  | /' out.txt | tail -20
    failed=$((failed + 1))
  fi
}

# tiny's vocabulary is 64 ids: the built-in tokenizer's small alphabet (39 symbols) fits it.
"$sppo" train --model tiny --seq-len 256 --steps 5 --save ckpt >train.txt 2>&1 ||
  { cat train.txt; echo "could not train the tiny model"; exit 1; }
vocab=$(python3 -c 'import json; print(json.load(open("ckpt/state.json"))["config"]["vocab"])')

check "grid runs" python3 "$passkey" grid --sppo "$sppo" --init ckpt --lengths 256,512 --depths 0,0.5,1 \
  --out grid --vocab "$vocab"

# Every cell: a haystack of length + 1 tokens, ids within the vocabulary, the answer last and
# labelled (the passkey's 5 digits, each its own character), everything else -100; accuracy in
# [0, 1]; and the cells' keys differ.
check_grid() {
  python3 - "$vocab" <<'EOF'
import array, json, sys
vocab = int(sys.argv[1])
alphabet = "0123456789 .?abcdefghijklmnopqrstuvwxyz"
cells = json.load(open("grid/passkey.json"))["cells"]
problems = []
if len(cells) != 6:
    problems.append(f"{len(cells)} cells, want 6")
if sorted((c["length"], c["depth"]) for c in cells) != [(n, d) for n in (256, 512) for d in (0, 0.5, 1)]:
    problems.append(f"cells {[(c['length'], c['depth']) for c in cells]}")
if len({c["passkey"] for c in cells}) != len(cells):
    problems.append("two cells share a passkey")
for c in cells:
    where = f"cell {c['length']} {c['depth']}"
    tokens = array.array("I", open(c["data"], "rb").read())
    labels = array.array("i", open(c["labels"], "rb").read())
    text = "".join(alphabet[t] for t in tokens)
    scored = [k for k, x in enumerate(labels) if x != -100]
    if not (isinstance(c["accuracy"], (int, float)) and 0 <= c["accuracy"] <= 1):
        problems.append(f"{where}: accuracy {c['accuracy']}")
    if len(tokens) != c["length"] + 1 or len(labels) != len(tokens):
        problems.append(f"{where}: {len(tokens)} tokens and {len(labels)} labels, want {c['length'] + 1}")
    if max(tokens) >= vocab:
        problems.append(f"{where}: id {max(tokens)} outside the vocabulary {vocab}")
    if len(scored) != c["answer_tokens"] or c["answer_tokens"] != len(c["passkey"]):
        problems.append(f"{where}: {len(scored)} scored labels, {c['answer_tokens']} answer tokens, "
                        f"passkey {c['passkey']}")
    if scored != list(range(len(tokens) - len(scored), len(tokens))) or any(labels[k] != tokens[k] for k in scored):
        problems.append(f"{where}: the scored labels are not the last tokens themselves")
    if not text.endswith("what is the pass key? the pass key is " + c["passkey"]):
        problems.append(f"{where}: the haystack ends {text[-60:]!r}")
    needle = f"the pass key is {c['passkey']}. remember it."
    if text.count(needle) != 1 or abs(text.index(needle) - c["needle_at"]) > 1:
        problems.append(f"{where}: the needle is not once at {c['needle_at']}")
for p in problems:
    print(p)
sys.exit(1 if problems else 0)
EOF
}
check "grid cells" check_grid
check "heat map has 6 cells" test "$(grep -o 'class="cell"' grid/passkey.svg 2>/dev/null | wc -l)" -eq 6
# Depth 0 puts the needle first, depth 1 right before the question.
check "depths 0 and 1" python3 -c '
import json
c = {(x["length"], x["depth"]): x for x in json.load(open("grid/passkey.json"))["cells"]}
assert c[(256, 0)]["needle_at"] == 0 and c[(256, 1)]["needle_at"] > c[(256, 0.5)]["needle_at"] > 0'

# Past the device budget: sppo eval's exit 3 and its message (naming what would fit).
expect_exit 3 "--subseqs auto" python3 "$passkey" grid --sppo "$sppo" --init ckpt --lengths 65536 --depths 0.5 \
  --out too_long --vocab "$vocab" -- --device-memory 1MiB
expect_exit 3 "Lengths that ran: none" python3 "$passkey" grid --sppo "$sppo" --init ckpt --lengths 65536 --depths 0.5 \
  --out too_long --vocab "$vocab" -- --device-memory 1MiB
# Bad input of the script's own: exit 2 naming it, before any sppo run.
expect_exit 2 "--lengths: 'abc' is not a token count" python3 "$passkey" grid --sppo "$sppo" --init ckpt \
  --lengths abc --depths 0.5 --out bad --vocab "$vocab"
expect_exit 2 "is not a depth in [0, 1]" python3 "$passkey" haystacks --lengths 1K --depths 1.5 --out bad --vocab 64
expect_exit 2 "use lengths of at least" python3 "$passkey" haystacks --lengths 16 --depths 0 --out bad --vocab 64
expect_exit 2 "larger than the --init model's vocabulary" python3 "$passkey" grid --sppo "$sppo" --init ckpt \
  --lengths 256 --depths 0 --out bad --vocab 1000
expect_exit 2 "the grid sets" python3 "$passkey" grid --sppo "$sppo" --init ckpt --lengths 256 --depths 0 \
  --out bad --vocab "$vocab" -- --seq-len 512
# sppo plot refuses a malformed grid, naming the file and the cell.
echo '{"cells": [{"length": 256, "depth": 0.5}]}' >no_accuracy.json
expect_exit 2 '[plot] no_accuracy.json cells[0]: "accuracy"' "$sppo" plot no_accuracy.json --out no_accuracy.svg

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
