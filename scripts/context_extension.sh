#!/usr/bin/env bash
# Context extension of a Hugging Face model, end to end: a random llama-tiny written by
# transformers (trained context 256 tokens), imported, trained at 8x its length (2048)
# with rope_theta raised, exported back to Hugging Face's format and reloaded by
# transformers, which measures the loss near and far (1024 tokens back) again. The held-out
# loss, near and far, is logged as it trains (loss.svg draws it), and sppo eval scores it by
# position at the trained length and at twice it.
# Usage: bash scripts/context_extension.sh [WORK_DIR] (default runs/context-extension);
# SPPO=path/to/sppo runs another build (tests/context_extension.sh passes ctest's).
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-runs/context-extension}
steps=${STEPS:-600}
sppo=${SPPO:-build/sppo}
[ -x "$sppo" ] || bash scripts/build.sh
bash scripts/install-hf.sh >/dev/null
py=build/hf-venv/bin/python
rm -rf "$work"
mkdir -p "$work"

echo "== a random llama-tiny from transformers, max_position_embeddings 256"
"$py" - "$work/llama-tiny-hf" <<'PY'
import sys, torch, transformers
c = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="float32")
torch.manual_seed(0)
transformers.LlamaForCausalLM(c).save_pretrained(sys.argv[1], safe_serialization=True)
PY

echo "== held-out sequences of the built-in task (a string, then itself), at 2048 and 4096 tokens"
"$py" - "$work" <<'PY'
import random, struct, sys
def windows(path, S, count, seed):
    # Windows of S + 1 tokens that share their last token with the next one's first, as
    # sppo reads a token file; each a random string over 32 symbols, then itself.
    rng, out = random.Random(seed), []
    for k in range(count):
        prefix = [rng.randrange(32) for _ in range(S // 2 + 1)]
        if out:
            prefix[0] = out[-1]
        window = (prefix + prefix)[: S + 1]
        out += window if not out else window[1:]
    open(path, "wb").write(struct.pack(f"<{len(out)}I", *out))
windows(sys.argv[1] + "/held-2k.u32", 2048, 2, 11)
windows(sys.argv[1] + "/held-4k.u32", 4096, 2, 12)
PY

echo "== sppo: import, then train at 2048 tokens (8x) with rope_theta 10000 -> 80000"
"$sppo" import "$work/llama-tiny-hf" --out "$work/imported"
# The imported model is random, so it learns the task from scratch: the from-scratch optimizer
# settings, not the fine-tuning ones --init takes by default (lr 2e-5 leaves it at chance).
"$sppo" train --init "$work/imported" --seq-len 2048 --subseqs 4 --rope-theta 80000 --steps "$steps" \
  --lr 5e-3 --warmup 20 --weight-decay 0.1 --eval-data "$work/held-2k.u32" --eval-every 50 --eval-seqs 2 \
  --metrics "$work/metrics.jsonl" --save "$work/trained" --quiet
tail -n 1 "$work/metrics.jsonl"
"$sppo" plot "$work/metrics.jsonl" --out "$work/loss.svg" --title "llama-tiny extended from 256 to 2048 tokens"

echo "== sppo eval: the held-out loss by position at the trained length, and at twice it"
"$sppo" eval --init "$work/trained" --data "$work/held-2k.u32" --seq-len 2048 --subseqs 4 --out "$work/eval-2k"
"$sppo" eval --init "$work/trained" --data "$work/held-4k.u32" --seq-len 4096 --subseqs 8 --out "$work/eval-4k"

echo "== export to Hugging Face's format and measure with transformers"
"$sppo" export "$work/trained" --format hf --out "$work/llama-tiny-2k"
"$py" - "$work/llama-tiny-hf" "$work/llama-tiny-2k" <<'PY'
import sys, torch, transformers
S, half = 2048, 1024
g = torch.Generator().manual_seed(7)
prefix = torch.randint(0, 32, (S // 2 + 1,), generator=g)  # the built-in task: a string, then itself again
tokens = torch.cat([prefix, prefix])[: S + 1]
for label, path in (("before", sys.argv[1]), ("after", sys.argv[2])):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        logits = model(input_ids=tokens[:S].unsqueeze(0)).logits[0]
    losses = torch.nn.functional.cross_entropy(logits, tokens[1:], reduction="none")
    print(f"transformers, {label} (max_position_embeddings {model.config.max_position_embeddings}, "
          f"rope_theta {model.config.rope_theta:g}): loss near {losses[:half].mean():.3f}, "
          f"far (copies 1024 back) {losses[half:].mean():.3f}")
PY
