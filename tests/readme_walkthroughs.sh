#!/usr/bin/env bash
# The README's walk-throughs as a newcomer runs them. Every command of every ```sh block under
# "## Walk-throughs" runs as written, in order, one shell per walk-through, in a fresh folder
# laid out like the repository root (build/sppo, scripts/, profiles/). A line that only sets
# variables (SEQ=16K STEPS=20  # ...; SEQ=2K STEPS=4 takes seconds) runs, then the
# assignments in its comment: the small sizes the README gives. Inputs the README leaves to
# the reader are made here: the Hugging Face model at $HF (a random tiny Qwen2 model with a
# word-level tokenizer.json, written by transformers) and books/*.txt. Where build/hf3-venv
# (scripts/install-hf.sh --qwen3) is there, the Hugging Face walk-through runs again on a
# random tiny Qwen3 model, each line with a comment "# Qwen3: COMMAND" running COMMAND.
#
#   bash tests/readme_walkthroughs.sh [SPPO_BINARY]     (default: build/sppo)
#
# Exit 0 when every command succeeds, 1 naming each one that failed (with its output's last
# lines), 77 when the rest succeeded but the Hugging Face walk-through was skipped because
# build/hf-venv (scripts/install-hf.sh) lacks torch, transformers or tokenizers.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
sppo=$(readlink -f "${1:-$root/build/sppo}")
[ -x "$sppo" ] || { echo "readme_walkthroughs: no sppo binary at $sppo (bash scripts/build.sh)"; exit 1; }

# The README's Python lines activate build/hf-venv (build/hf3-venv for Qwen3); each sits
# beside the binary, or in the repository's build/.
find_venv() {  # $1: the folder's name; $2: Python that must run in it
  local v
  for v in "$(dirname "$sppo")/$1" "$root/build/$1"; do
    if [ -x "$v/bin/python" ] && "$v/bin/python" -c "$2" 2>/dev/null; then
      echo "$v"
      return
    fi
  done
}
venv=$(find_venv hf-venv "import torch, transformers, tokenizers")
venv3=$(find_venv hf3-venv "import torch, transformers, tokenizers; transformers.Qwen3ForCausalLM")

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
make_root() {  # a folder laid out like the repository root
  mkdir -p "$1/build" "$1/profiles"
  # A copy, not a link: sppo looks for profiles/ beside its own folder, as it does in a checkout.
  cp "$sppo" "$1/build/sppo"
  cp "$root"/profiles/*.json "$1/profiles/" 2>/dev/null || true
  ln -s "$root/scripts" "$1/scripts"
  [ -n "$venv" ] && ln -s "$venv" "$1/build/hf-venv"
  [ -n "$venv3" ] && ln -s "$venv3" "$1/build/hf3-venv"
}
make_root "$work"
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMPI_MCA_rmaps_base_oversubscribe=1

# The walk-throughs: "W<tab>title" and "C<tab>command" lines, continuations joined.
python3 - "$root/README.md" >"$work/walks.txt" <<'PY' || { echo "readme_walkthroughs: cannot read README.md"; exit 1; }
import re, sys
lines = open(sys.argv[1], encoding="utf-8").read().splitlines()
inside = block = False
title, command = "", ""
for line in lines:
    if line.startswith("## "):
        inside = line.strip() == "## Walk-throughs"
        continue
    if not inside:
        continue
    if line.startswith("### "):
        title = line[4:].strip()
        print(f"W\t{title}")
    elif line.strip() == "```sh":
        block = True
    elif line.strip().startswith("```"):
        block = False
    elif block and line.strip() and not line.strip().startswith("#"):
        command += line.rstrip()
        if command.endswith("\\"):
            command = command[:-1].rstrip() + " "
            continue
        print(f"C\t{re.sub(' +', ' ', command.strip())}")
        command = ""
PY
if ! grep -q '^C' "$work/walks.txt"; then
  echo "readme_walkthroughs: README.md has no \`\`\`sh blocks under '## Walk-throughs'"
  exit 1
fi

# Inputs of the Hugging Face walk-through: a model at $HF and books/*.txt.
make_hf_model() {  # $1: the folder; $2: qwen2 or qwen3
  local py=$venv/bin/python
  [ "$2" = qwen3 ] && py=$venv3/bin/python
  "$py" - "$1" "$2" <<'PY'
import os, sys, torch, transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
words = "the cat sat on the mat and the dog ran in the park while a bird sang in the old tree"
tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.train_from_iterator([words], trainers.WordLevelTrainer(special_tokens=["[UNK]", "[EOS]"]))
tok.save(os.path.join(out, "tokenizer.json"))
shape = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, torch_dtype="float32")
torch.manual_seed(0)
if sys.argv[2] == "qwen3":
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=32, **shape))
else:
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape))
model.save_pretrained(out, safe_serialization=True)
PY
}
make_books() {  # $1: the walk-through's folder
  mkdir -p "$1/books"
  python3 - "$1/books" <<'PY'
import os, random, sys
words = "the cat sat on the mat and the dog ran in the park while a bird sang in the old tree".split()
for k in range(3):
    random.seed(k)
    with open(os.path.join(sys.argv[1], f"book{k}.txt"), "w") as f:
        f.write(" ".join(random.choice(words) for _ in range(3000)) + "\n")
PY
}

failed=()
skipped=""
ran=0
run_walk() {  # $1: title; $2: the folder it runs in; $3: qwen3 for the Qwen3 pass; the commands in $work/cmds.txt
  local title=$1 dir=$2 family=${3:-qwen2} hf=false
  case $title in *"Hugging Face"*) hf=true ;; esac
  if $hf && [ -z "$venv" ]; then
    skipped=$title
    echo "== skipped: $title (no torch, transformers and tokenizers in build/hf-venv; bash scripts/install-hf.sh)"
    return
  fi
  $hf && make_books "$dir"
  # One shell per walk-through, so that its variables carry from line to line.
  (
    cd "$dir" || exit 1
    n=0
    while IFS= read -r cmd; do
      n=$((n + 1))
      if [ "$family" = qwen3 ] && [[ $cmd =~ \#\ Qwen3:\ (.*)$ ]]; then
        cmd=${BASH_REMATCH[1]}
      fi
      echo "== $title: $cmd"
      log="$work/log.$$.$n"
      if [[ $cmd =~ ^([A-Z_]+=[^[:space:]]+[[:space:]]*)+(#.*)?$ ]]; then
        eval "$cmd"
        small=$(sed -n 's/^[^#]*#//p' <<<"$cmd" | grep -oE '\b[A-Z_]+=[^[:space:];,]+' | tr '\n' ' ')
        if [ -n "$small" ]; then
          echo "   (the README's small sizes: $small)"
          eval "$small"
        fi
        if $hf && [ -n "${HF:-}" ] && [ ! -d "$HF" ]; then
          echo "   (a random tiny ${family^} model at $HF)"
          make_hf_model "$HF" "$family" >"$log" 2>&1 || { echo "FAILED	$title	making the model at $HF"; tail -n 20 "$log"; }
        fi
        continue
      fi
      if eval "$cmd" >"$log" 2>&1; then
        tail -n 2 "$log" | sed 's/^/   /'
      else
        echo "FAILED	$title	$cmd"
        tail -n 20 "$log" | sed 's/^/   /'
      fi
    done <"$work/cmds.txt"
  ) | tee -a "$work/out.txt"
}

qwen3_note=""
run_walks() {  # $1: title; the commands in $work/cmds.txt
  run_walk "$1" "$work"
  case $1 in *"Hugging Face"*) ;; *) return ;; esac
  if [ -z "$venv" ]; then return; fi
  if [ -z "$venv3" ]; then
    qwen3_note="the Qwen3 pass of '$1' did not run: no build/hf3-venv (bash scripts/install-hf.sh --qwen3)"
    return
  fi
  make_root "$work/qwen3"
  run_walk "$1 (Qwen3)" "$work/qwen3" qwen3
  ran=$((ran + $(wc -l <"$work/cmds.txt")))
}

title=""
: >"$work/cmds.txt"
while IFS=$'\t' read -r kind text; do
  if [ "$kind" = W ]; then
    [ -n "$title" ] && run_walks "$title"
    title=$text
    : >"$work/cmds.txt"
  else
    echo "$text" >>"$work/cmds.txt"
    ran=$((ran + 1))
  fi
done <"$work/walks.txt"
[ -n "$title" ] && run_walks "$title"
[ -n "$qwen3_note" ] && echo "readme_walkthroughs: $qwen3_note"

mapfile -t failed < <(grep '^FAILED' "$work/out.txt" | cut -f2-)
echo
if [ ${#failed[@]} -gt 0 ]; then
  echo "readme_walkthroughs: ${#failed[@]} command(s) of the README's walk-throughs failed:"
  printf '  %s\n' "${failed[@]}"
  exit 1
fi
if [ -n "$skipped" ]; then
  echo "readme_walkthroughs: every other command succeeded, but '$skipped' was skipped: build/hf-venv lacks torch, transformers or tokenizers (bash scripts/install-hf.sh installs them)"
  exit 77
fi
echo "readme_walkthroughs: all $ran commands of the README's walk-throughs succeeded"
