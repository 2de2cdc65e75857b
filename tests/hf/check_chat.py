#!/usr/bin/env python3
"""scripts/tokenize_text.py --jsonl --chat held to transformers' apply_chat_template.

Conversations rendered by a chat template (ChatML-style turns) with a small word-level
tokenizer: the token ids must be those transformers' apply_chat_template gives, followed by
--doc-sep; the labels must be -100 everywhere but on the assistant turns, where they are the
tokens of each answer and its end-of-turn marker, and nothing else. sppo must then train a
step on the tokens with --labels, packed, from the raw files and the Megatron pair. Bad
input (a record without messages, --chat without --jsonl) must exit 2 and write nothing.

Usage: check_chat.py SPPO_BINARY WORK_DIR. Exits 77 (skipped) without tokenizers, jinja2
or transformers.
"""
import json
import os
import shutil
import struct
import subprocess
import sys

try:
    import jinja2  # noqa: F401  (tokenize_text.py --chat renders with it)
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
except ImportError as e:
    print(f"skipped: {e} (scripts/install-hf.sh installs tokenizers, jinja2 and transformers)")
    sys.exit(77)

SPPO, WORK = sys.argv[1], sys.argv[2]
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "tokenize_text.py")
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHATS = [
    [{"role": "system", "content": "you answer briefly"},
     {"role": "user", "content": "what sat on the mat"},
     {"role": "assistant", "content": "the cat sat on the mat"}],
    [{"role": "user", "content": "where did the dog run"},
     {"role": "assistant", "content": "in the park"},
     {"role": "user", "content": "and then"},
     {"role": "assistant", "content": "it sat on the mat in the park"}],
]
SEP = 1  # the tokenizer's [EOS]
failures = []


def tokenize(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)


def read(path, fmt, size):
    data = open(path, "rb").read()
    return list(struct.unpack(f"<{len(data) // size}{fmt}", data))


def main():
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    words = " ".join(m["role"] + " " + m["content"] for chat in CHATS for m in chat)
    corpus = os.path.join(WORK, "words.txt")
    open(corpus, "w").write(words)
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([corpus], trainers.WordLevelTrainer(special_tokens=["[UNK]", "[EOS]", "<|im_start|>", "<|im_end|>"]))
    tok_file = os.path.join(WORK, "tokenizer.json")
    tok.save(tok_file)
    json.dump({"chat_template": TEMPLATE, "eos_token": "<|im_end|>"},
              open(os.path.join(WORK, "tokenizer_config.json"), "w"))
    chats = os.path.join(WORK, "chats.jsonl")
    with open(chats, "w") as f:
        for chat in CHATS:
            f.write(json.dumps({"messages": chat}) + "\n")

    # What transformers renders and tokenizes, and the tokens each assistant turn must count.
    hf = PreTrainedTokenizerFast(tokenizer_file=tok_file)
    hf.chat_template = TEMPLATE
    want_ids, want_counted = [], []
    end_of_turn = tok.token_to_id("<|im_end|>")
    for chat in CHATS:
        want_ids += list(hf.apply_chat_template(chat, tokenize=True)) + [SEP]
        for m in chat:
            if m["role"] == "assistant":
                want_counted += tok.encode(m["content"], add_special_tokens=False).ids + [end_of_turn]

    for fmt in ("raw", "megatron"):
        prefix = os.path.join(WORK, f"chat-{fmt}")
        r = tokenize("--tokenizer", tok_file, "--vocab-size", "64", "--out", prefix, "--format", fmt,
                     "--doc-sep", str(SEP), "--jsonl", "--chat", chats)
        if r.returncode != 0:
            failures.append(f"--chat --format {fmt}: exit {r.returncode}: {r.stderr.strip()}")
            continue
        print(f"--chat --format {fmt}: {r.stdout.strip()}")
        if fmt == "raw":
            ids, labels = read(prefix + ".u16", "H", 2), read(prefix + ".labels.i32", "i", 4)
            data, label_file = prefix + ".u16", prefix + ".labels.i32"
        else:  # the .bin files of one document after another
            ids, labels = read(prefix + ".bin", "H", 2), read(prefix + ".labels.bin", "i", 4)
            data, label_file = prefix, prefix + ".labels"
        if ids != want_ids:
            failures.append(f"--chat --format {fmt}: tokens {ids} are not transformers' {want_ids}")
        if len(labels) != len(ids):
            failures.append(f"--chat --format {fmt}: {len(labels)} labels for {len(ids)} tokens")
            continue
        wrong = [k for k, (t, l) in enumerate(zip(ids, labels)) if l not in (t, -100)]
        if wrong:
            failures.append(f"--chat --format {fmt}: labels at {wrong[:5]} are neither the token nor -100")
        counted = [l for l in labels if l != -100]
        if counted != want_counted:
            failures.append(f"--chat --format {fmt}: the counted labels {counted} are not the assistant turns' "
                            f"{want_counted}")
        r = subprocess.run([SPPO, "train", "--model", "llama-tiny", "--vocab", "64", "--seq-len", "32", "--steps", "2",
                            "--data", data, "--labels", label_file, "--doc-sep", str(SEP), "--pack", "--quiet",
                            "--metrics", os.path.join(WORK, f"{fmt}.jsonl")], capture_output=True, text=True)
        if r.returncode != 0:
            failures.append(f"sppo train --labels on the {fmt} files: exit {r.returncode}: {r.stderr.strip()}")
        else:
            steps = [s for s in map(json.loads, open(os.path.join(WORK, f"{fmt}.jsonl"))) if "loss" in s]
            print(f"sppo trained on them: loss_tokens per step {[s['loss_tokens'] for s in steps]}")

    # Bad input: exit 2, a message naming it, nothing written.
    bad = os.path.join(WORK, "bad.jsonl")
    open(bad, "w").write(json.dumps({"messages": CHATS[0]}) + "\n" + json.dumps({"text": "no messages"}) + "\n")
    for args, must in ((["--jsonl", "--chat", bad], "line 2: a chat record needs \"messages\""),
                       (["--chat", chats], "--chat reads conversations as JSON lines")):
        prefix = os.path.join(WORK, "refused")
        r = tokenize("--tokenizer", tok_file, "--vocab-size", "64", "--out", prefix, *args)
        written = [f for f in os.listdir(WORK) if f.startswith("refused")]
        if r.returncode != 2 or must not in r.stderr or written:
            failures.append(f"{' '.join(args)}: exit {r.returncode}, {r.stderr.strip()!r}, wrote {written}")
        else:
            print(f"refused: {r.stderr.strip()}")

    for f in failures:
        print("FAILED:", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
