#!/usr/bin/env bash
# Fine-tuning on long chat documents, end to end: a random Qwen3-style model (tied
# embeddings, a head size of its own, query/key norms) written by transformers with a
# trained context of 256 tokens; conversations whose assistant repeats a user message of 140
# words, tokenized through a chat template with labels on the assistant turns only; sppo
# imports the model, trains it at 8x its context (2048 tokens) on the conversations packed
# into sequences, with the loss on the answers alone; exports it back to Hugging Face's
# format, and transformers reloads it and measures the loss on the answers of conversations
# it has not seen, before and after.
# Usage: bash scripts/chat_extension.sh [WORK_DIR] (default runs/chat-extension); STEPS=600.
# Needs transformers 4.51 or later for Qwen3 (scripts/install-hf.sh --qwen3, about 5.6 GB).
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-runs/chat-extension}
steps=${STEPS:-600}
[ -x build/sppo ] || bash scripts/build.sh
bash scripts/install-hf.sh --qwen3 >/dev/null
py=build/hf3-venv/bin/python
rm -rf "$work"
mkdir -p "$work/tokenizer"

echo "== a chat tokenizer and conversations: the assistant repeats the user's 140 words"
"$py" - "$work" <<'PY'
import json, random, sys
from tokenizers import Tokenizer, models, pre_tokenizers
work = sys.argv[1]
words = ["[UNK]", "[EOS]", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "repeat", "after", "me"]
words += [f"w{i}" for i in range(128)]
tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.add_special_tokens(["[EOS]", "<|im_start|>", "<|im_end|>"])
tok.save(f"{work}/tokenizer/tokenizer.json")
template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
json.dump({"chat_template": template, "eos_token": "<|im_end|>"}, open(f"{work}/tokenizer/tokenizer_config.json", "w"))
rng = random.Random(1)
for name, n in (("train", 500), ("held-out", 40)):
    with open(f"{work}/{name}.jsonl", "w") as f:
        for _ in range(n):
            said = " ".join(f"w{rng.randrange(128)}" for _ in range(140))
            f.write(json.dumps({"messages": [{"role": "system", "content": "repeat after me"},
                                             {"role": "user", "content": said},
                                             {"role": "assistant", "content": said}]}) + "\n")
PY
"$py" scripts/tokenize_text.py --tokenizer "$work/tokenizer/tokenizer.json" --vocab-size 256 --format megatron \
  --jsonl --chat --out "$work/chats" "$work/train.jsonl"

echo "== a random Qwen3-style model from transformers: max_position_embeddings 256, tied embeddings"
"$py" - "$work/qwen3-hf" <<'PY'
import sys, torch, transformers
c = transformers.Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                             rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, torch_dtype="float32")
torch.manual_seed(0)
transformers.Qwen3ForCausalLM(c).save_pretrained(sys.argv[1], safe_serialization=True)
PY

echo "== sppo: import, then train at 2048 tokens (8x) on the packed conversations, the loss on the answers"
build/sppo import "$work/qwen3-hf" --out "$work/imported"
# A random model learns at a from-scratch rate: --lr overrides the fine-tuning default of --init.
build/sppo train --init "$work/imported" --data "$work/chats" --labels "$work/chats.labels" --pack \
  --seq-len 2048 --subseqs 4 --lr 3e-3 --warmup 20 --steps "$steps" --metrics "$work/metrics.jsonl" \
  --save "$work/trained" --quiet
build/sppo plot "$work/metrics.jsonl" --out "$work/loss.svg" --title "qwen3-style model: loss on the answers"

echo "== export to Hugging Face's format and measure with transformers on unseen conversations"
build/sppo export "$work/trained" --format hf --out "$work/qwen3-chat"
"$py" - "$work" <<'PY'
import json, sys, torch, transformers
work = sys.argv[1]
tok = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{work}/tokenizer/tokenizer.json")
tok.chat_template = json.load(open(f"{work}/tokenizer/tokenizer_config.json"))["chat_template"]
chats = [json.loads(line)["messages"] for line in open(f"{work}/held-out.jsonl")]
for label, path in (("before", f"{work}/qwen3-hf"), ("after", f"{work}/qwen3-chat")):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    total, count, tokens = 0.0, 0, 0
    for m in chats:
        ids = tok.apply_chat_template(m, tokenize=True)
        start = len(tok.apply_chat_template(m[:2], tokenize=True, add_generation_prompt=True))
        x = torch.tensor(ids).unsqueeze(0)
        with torch.no_grad():
            logits = model(input_ids=x).logits[0]
        losses = torch.nn.functional.cross_entropy(logits[:-1], x[0, 1:], reduction="none")
        total += losses[start - 1:].sum().item()
        count += len(ids) - start
        tokens = len(ids)
    print(f"transformers, {label} ({model.config.architectures[0]}, max_position_embeddings "
          f"{model.config.max_position_embeddings}): loss on the answers {total / count:.3f} "
          f"({len(chats)} conversations of {tokens} tokens)")
PY
