#!/usr/bin/env python3
"""Text to the token files `sppo train --data` reads, with a Hugging Face tokenizer.json.

    python3 scripts/tokenize_text.py --tokenizer tokenizer.json --model HF_DIR \\
        --out corpus [--format raw|megatron] [--doc-sep ID] [--jsonl [--chat]] FILE...

Each FILE is one document (with --jsonl: each line's "text" is one). Documents are
tokenized in order and written as
  raw       PREFIX.u16 or PREFIX.u32 (uint16 when every id fits), the documents one after
            another, each followed by --doc-sep ID when given;
  megatron  PREFIX.bin and PREFIX.idx (Megatron's MMIDIDX version 1, one sequence per
            document and its document index; --doc-sep appends the id to each document).
With --chat each line is a conversation, {"messages": [{"role": ..., "content": ...}, ...]},
rendered by the chat template of the tokenizer's tokenizer_config.json (beside
tokenizer.json, or --tokenizer-config) as transformers' apply_chat_template renders it, and
labels are written beside the tokens: the token where it belongs to an assistant turn (its
content and the template's end of turn), -100 elsewhere (and on --doc-sep), one per token,
as PREFIX.labels.i32 or PREFIX.labels.bin/.idx (int32), for `sppo train --labels`.
The tokenizer's vocabulary must fit the model's: --model (an HF directory's config.json, or
an sppo checkpoint's state.json) or --vocab-size gives its size, and a tokenizer with more
ids is refused (exit 2) before anything is written; so is a conversation without messages.
Needs the `tokenizers` package from PyPI and, for --chat, jinja2 (scripts/install-hf.sh's
environment has both).
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


IGNORE = -100  # a label that takes no loss, as Hugging Face writes it


def special_text(value):
    """A special token of tokenizer_config.json: a string, or an object with "content"."""
    return value.get("content") if isinstance(value, dict) else value


class ChatTemplate:
    """tokenizer_config.json's chat_template, rendered as transformers renders it."""

    def __init__(self, path):
        if not os.path.exists(path):
            fail(f"--chat needs the tokenizer's chat template: no {path} (give --tokenizer-config)")
        try:
            cfg = json.load(open(path, encoding="utf-8"))
        except ValueError as e:
            fail(f"{path} is not JSON: {e}")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str) or not template:
            fail(f"{path} has no chat_template; --chat renders conversations with it")
        try:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            fail("--chat needs jinja2 (apt install python3-jinja2, or scripts/install-hf.sh's build/hf-venv)")

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: __import__("datetime").datetime.now().strftime(fmt)
        self.path = path
        self.template = env.from_string(template)
        self.specials = {k: special_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}

    def render(self, messages, add_generation_prompt):
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.specials)

    def assistant_spans(self, messages, where):
        """The text and, per assistant turn, its [begin, end) characters: from where the
        template would start the assistant's answer to the end of its turn."""
        text = self.render(messages, False)
        spans = []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            begin, upto = self.render(messages[:k], True), self.render(messages[:k + 1], False)
            if not (upto.startswith(begin) and text.startswith(upto)):
                fail(f"{where}: the chat template of {self.path} does not render the conversation up to turn {k} "
                     "as the start of the whole (it rewrites earlier turns), so the assistant's tokens cannot be "
                     "told apart")
            spans.append((len(begin), len(upto)))
        return text, spans


def conversations(files):
    for path in files:
        if not os.path.exists(path):
            fail(f"no input file {path}")
        for n, line in enumerate(open(path, encoding="utf-8"), 1):
            if not line.strip():
                continue
            where = f"{path} line {n}"
            try:
                record = json.loads(line)
            except ValueError:
                fail(f"{where} is not JSON")
            messages = record.get("messages") if isinstance(record, dict) else None
            if not isinstance(messages, list) or not messages:
                fail(f"{where}: a chat record needs \"messages\", a non-empty list of "
                     "{\"role\": ..., \"content\": ...}")
            for k, m in enumerate(messages):
                if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                    fail(f"{where}: message {k} needs a \"role\" and a \"content\" string")
            if not any(m["role"] == "assistant" for m in messages):
                fail(f"{where}: the conversation has no assistant turn, so no token of it would be trained on")
            yield where, messages


def write_raw(path, rows, code):
    with open(path + ".tmp", "wb") as f:
        for d in rows:
            f.write(struct.pack(f"<{len(d)}{code}", *d))
    os.replace(path + ".tmp", path)


def write_megatron(prefix, rows, dtype_code, fmt, size):
    with open(prefix + ".bin.tmp", "wb") as f:
        for d in rows:
            f.write(struct.pack(f"<{len(d)}{fmt}", *d))
    with open(prefix + ".idx.tmp", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<QBQQ", 1, dtype_code, len(rows), len(rows) + 1))
        f.write(struct.pack(f"<{len(rows)}i", *[len(d) for d in rows]))
        pointers, at = [], 0
        for d in rows:
            pointers.append(at)
            at += len(d) * size
        f.write(struct.pack(f"<{len(rows)}q", *pointers))
        f.write(struct.pack(f"<{len(rows) + 1}q", *range(len(rows) + 1)))
    os.replace(prefix + ".bin.tmp", prefix + ".bin")
    os.replace(prefix + ".idx.tmp", prefix + ".idx")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer.json")
    p.add_argument("--model", help="HF model directory or sppo checkpoint whose vocabulary the ids must fit")
    p.add_argument("--vocab-size", type=int, help="the model's vocabulary size (instead of --model)")
    p.add_argument("--out", required=True, help="output prefix: PREFIX.u16/.u32, or PREFIX.bin/.idx")
    p.add_argument("--format", choices=("raw", "megatron"), default="raw")
    p.add_argument("--doc-sep", type=int, help="token id appended after every document (e.g. the EOS id)")
    p.add_argument("--jsonl", action="store_true", help="inputs are JSON lines with a \"text\" field")
    p.add_argument("--chat", action="store_true",
                   help="with --jsonl: lines are {\"messages\": [...]} conversations; writes labels of the assistant turns")
    p.add_argument("--tokenizer-config", help="the tokenizer_config.json with the chat template (default: beside "
                                              "--tokenizer)")
    p.add_argument("files", nargs="+")
    a = p.parse_args()
    if a.chat and not a.jsonl:
        fail("--chat reads conversations as JSON lines: add --jsonl")
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
    docs, labels = [], []
    if a.chat:
        chat = ChatTemplate(a.tokenizer_config or os.path.join(os.path.dirname(os.path.abspath(a.tokenizer)),
                                                               "tokenizer_config.json"))
        for where, messages in conversations(a.files):
            text, spans = chat.assistant_spans(messages, where)
            enc = tok.encode(text, add_special_tokens=False)
            ids = list(enc.ids)
            counted = [any(b <= start < e for b, e in spans) for start, _ in enc.offsets]
            docs.append(ids + ([a.doc_sep] if a.doc_sep is not None else []))
            labels.append([t if c else IGNORE for t, c in zip(ids, counted)] + ([IGNORE] if a.doc_sep is not None else []))
    else:
        for text in documents(a.files, a.jsonl):
            ids = tok.encode(text, add_special_tokens=False).ids
            if a.doc_sep is not None:
                ids.append(a.doc_sep)
            docs.append(ids)
    wide = vocab > 65536
    code, fmt, size = (4, "i", 4) if wide else (8, "H", 2)
    total = sum(len(d) for d in docs)
    counted = sum(1 for d in labels for x in d if x != IGNORE)
    if a.format == "raw":
        path = a.out + (".u32" if wide else ".u16")
        write_raw(path, docs, "I" if wide else "H")
        written = path
        if a.chat:
            write_raw(a.out + ".labels.i32", labels, "i")
            written += f" and {a.out}.labels.i32"
    else:
        write_megatron(a.out, docs, code, fmt, size)
        written = f"{a.out}.bin and {a.out}.idx"
        if a.chat:
            write_megatron(a.out + ".labels", labels, 4, "i", 4)
            written += f", {a.out}.labels.bin and {a.out}.labels.idx"
    print(f"wrote {written}: {len(docs)} documents, {total} tokens"
          + (f", {counted} of them in assistant turns (labelled)" if a.chat else ""))


if __name__ == "__main__":
    main()
