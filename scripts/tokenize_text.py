#!/usr/bin/env python3
"""Text to the token files `sppo train --data` reads, with a Hugging Face tokenizer.json.

    python3 scripts/tokenize_text.py --tokenizer tokenizer.json --model HF_DIR \\
        --out corpus [--format raw|megatron] [--doc-sep ID] [--jsonl] FILE...

Each FILE is one document (with --jsonl: each line's "text" is one). Documents are
tokenized in order and written as
  raw       PREFIX.u16 or PREFIX.u32 (uint16 when every id fits), the documents one after
            another, each followed by --doc-sep ID when given;
  megatron  PREFIX.bin and PREFIX.idx (Megatron's MMIDIDX version 1, one sequence per
            document and its document index; --doc-sep appends the id to each document).
The tokenizer's vocabulary must fit the model's: --model (an HF directory's config.json, or
an sppo checkpoint's state.json) or --vocab-size gives its size, and a tokenizer with more
ids is refused (exit 2) before anything is written. Needs the `tokenizers` package from
PyPI (scripts/install-hf.sh's environment has it).
"""
import argparse
import json
import os
import struct
import sys


def fail(message):
    print(f"tokenize_text.py: {message}", file=sys.stderr)
    sys.exit(2)


def model_vocab(path):
    for name, key in (("config.json", "vocab_size"), ("state.json", None)):
        f = os.path.join(path, name)
        if os.path.exists(f):
            j = json.load(open(f))
            v = j.get(key) if key else j.get("config", {}).get("vocab")
            if isinstance(v, int):
                return v
    fail(f"--model {path}: no config.json with vocab_size (Hugging Face) or state.json with config.vocab (sppo)")


def documents(files, jsonl):
    for path in files:
        if not os.path.exists(path):
            fail(f"no input file {path}")
        if not jsonl:
            yield open(path, encoding="utf-8").read()
            continue
        for n, line in enumerate(open(path, encoding="utf-8"), 1):
            if line.strip():
                try:
                    yield json.loads(line)["text"]
                except (ValueError, KeyError, TypeError):
                    fail(f"{path} line {n} is not a JSON object with a \"text\" string")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer.json")
    p.add_argument("--model", help="HF model directory or sppo checkpoint whose vocabulary the ids must fit")
    p.add_argument("--vocab-size", type=int, help="the model's vocabulary size (instead of --model)")
    p.add_argument("--out", required=True, help="output prefix: PREFIX.u16/.u32, or PREFIX.bin/.idx")
    p.add_argument("--format", choices=("raw", "megatron"), default="raw")
    p.add_argument("--doc-sep", type=int, help="token id appended after every document (e.g. the EOS id)")
    p.add_argument("--jsonl", action="store_true", help="inputs are JSON lines with a \"text\" field")
    p.add_argument("files", nargs="+")
    a = p.parse_args()
    try:
        from tokenizers import Tokenizer
    except ImportError:
        fail("needs the tokenizers package (pip install tokenizers, or scripts/install-hf.sh's build/hf-venv)")
    if not os.path.exists(a.tokenizer):
        fail(f"no tokenizer file {a.tokenizer}")
    tok = Tokenizer.from_file(a.tokenizer)
    ids_needed = tok.get_vocab_size(with_added_tokens=True)
    vocab = model_vocab(a.model) if a.model else a.vocab_size
    if vocab is None:
        fail("give --model or --vocab-size, the vocabulary the token ids must fit")
    if ids_needed > vocab:
        fail(f"the tokenizer {a.tokenizer} has {ids_needed} ids but the model's vocabulary is {vocab}: "
             "its ids would not fit; use the tokenizer the model was trained with")
    if a.doc_sep is not None and not 0 <= a.doc_sep < vocab:
        fail(f"--doc-sep {a.doc_sep} is outside the vocabulary [0, {vocab})")
    docs = []
    for text in documents(a.files, a.jsonl):
        ids = tok.encode(text, add_special_tokens=False).ids
        if a.doc_sep is not None:
            ids.append(a.doc_sep)
        docs.append(ids)
    wide = vocab > 65536
    code, fmt, size = (4, "i", 4) if wide else (8, "H", 2)
    total = sum(len(d) for d in docs)
    if a.format == "raw":
        path = a.out + (".u32" if wide else ".u16")
        with open(path + ".tmp", "wb") as f:
            for d in docs:
                f.write(struct.pack(f"<{len(d)}{'I' if wide else 'H'}", *d))
        os.replace(path + ".tmp", path)
        print(f"wrote {path}: {len(docs)} documents, {total} tokens")
        return
    with open(a.out + ".bin.tmp", "wb") as f:
        for d in docs:
            f.write(struct.pack(f"<{len(d)}{fmt}", *d))
    with open(a.out + ".idx.tmp", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<QBQQ", 1, code, len(docs), len(docs) + 1))
        f.write(struct.pack(f"<{len(docs)}i", *[len(d) for d in docs]))
        pointers, at = [], 0
        for d in docs:
            pointers.append(at)
            at += len(d) * size
        f.write(struct.pack(f"<{len(docs)}q", *pointers))
        f.write(struct.pack(f"<{len(docs) + 1}q", *range(len(docs) + 1)))
    os.replace(a.out + ".bin.tmp", a.out + ".bin")
    os.replace(a.out + ".idx.tmp", a.out + ".idx")
    print(f"wrote {a.out}.bin and {a.out}.idx: {len(docs)} documents, {total} tokens")


if __name__ == "__main__":
    main()
