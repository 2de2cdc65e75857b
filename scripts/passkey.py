#!/usr/bin/env python3
"""Passkey retrieval, the standard long-context check: can the model repeat a number hidden in filler text?

    python3 scripts/passkey.py haystacks --lengths 1K,2K,4K --depths 0,0.25,0.5,0.75,1 --out DIR
        (--tokenizer HF_DIR | --vocab V) [--seed N]
    python3 scripts/passkey.py grid --sppo build/sppo --init CKPT_OR_HF_DIR --lengths ... --depths ...
        --out DIR [--tokenizer HF_DIR | --vocab V] [--seed N] [--title T] [-- SPPO_EVAL_ARGS...]

A haystack of length L is a token file of exactly L + 1 tokens, one `sppo eval --seq-len L` window: filler
("The grass is green. The sky is blue. ...") repeated, with the needle "The pass key is NNNNN. Remember it.
NNNNN is the pass key." at depth d (0: first, after the tokenizer's BOS; 1: just before the question; between,
at the filler sentence boundary nearest d of the way; the filler starts mid-sentence, as a window of a longer
text would, and ends with a whole sentence), ending with "What is the pass key? The pass key is
NNNNN", so that the last tokens are the answer. Beside it a labels file of the same length holds -100
everywhere but at the answer tokens, where the label is the token itself: sppo eval's accuracy is then the
fraction of answer tokens the model predicts (each one from the text before it). NNNNN is five random digits
per (length, depth), drawn from --seed, so a grid is reproducible and no two cells share a key.

train-data writes DIR/train.u32: --count haystacks of one length L at random depths, one window of `sppo train
           --seq-len L` each, for a model to learn the task, and DIR/train.i32, labels on what only retrieval
           predicts (the key where the needle repeats it, and the answer; -100 elsewhere).
haystacks  writes DIR/cell-L-d/haystack.u32 and haystack.i32 per cell (--samples haystacks of it, one window
           each, each with its own key) and DIR/haystacks.json, which lists
           every cell's files, passkey, answer token count and where the needle starts.
grid       writes the haystacks, runs `sppo eval --init CKPT --data haystack.u32 --labels haystack.i32
           --seq-len L --seqs SAMPLES --out DIR/cell-L-d` for each cell, shortest lengths first, with the arguments
           after `--` appended (e.g. -- --subseqs auto --kv-cache host --device-memory 70GiB), collects
           DIR/passkey.json, {"cells": [{"length", "depth", "accuracy", "loss", "peak_device_bytes", ...}]},
           and draws it with `sppo plot DIR/passkey.json --out DIR/passkey.svg` (accuracy by length and depth).

Tokens: with --tokenizer HF_DIR, the model's own tokenizer (transformers' AutoTokenizer, else the tokenizers
package on HF_DIR/tokenizer.json; scripts/install-hf.sh's build/hf-venv has both), with the special tokens it
puts before a text (BOS); without it, a built-in character tokenizer for the small models sppo trains from
scratch: --vocab V >= 256 takes each UTF-8 byte as its id, a smaller V (at least 39) the index in
"0123456789 .?abcdefghijklmnopqrstuvwxyz" of each character, case folded, so that digits never share an id with
letters. For grid, --vocab defaults to the --init model's vocabulary. Every id must fit that vocabulary.

Lengths take K and M suffixes (1K = 1024, as sppo's --seq-len); depths are fractions in [0, 1].
Exit status: 0 done; 2 bad input (this script's own arguments, or sppo eval's exit 2); 3 a cell's length does
not fit the device budget (sppo eval's exit 3): the grid stops there, prints sppo's message (which names the
options that would fit) and the lengths that ran, and still writes passkey.json and passkey.svg, the cells not
run as null ("n/a" in the plot).
"""
import argparse
import array
import json
import os
import random
import re
import subprocess
import sys

IGNORE = -100  # a label that takes no loss, as Hugging Face writes it
FILLER = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."]
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
SMALL_ALPHABET = "0123456789 .?abcdefghijklmnopqrstuvwxyz"
# sppo eval's own options that a grid sets per cell; given again after `--` they would contradict it.
GRID_SETS = ("--init", "--data", "--labels", "--seq-len", "--seqs", "--out", "--data-dtype")


def fail(message, status=2):
    print(f"passkey.py: {message}", file=sys.stderr)
    sys.exit(status)


def parse_lengths(text):
    lengths = []
    for word in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", word)
        if not m or int(m.group(1)) <= 0:
            raise argparse.ArgumentTypeError(f"{word!r} is not a token count; write e.g. 256,1K,64K (K = 1024)")
        lengths.append(int(m.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()])
    if len(set(lengths)) != len(lengths):
        raise argparse.ArgumentTypeError(f"{text!r} names a length twice")
    return sorted(lengths)  # shortest first: a length that does not fit stops the grid after those that do


def parse_depths(text):
    depths = []
    for word in text.split(","):
        try:
            d = float(word)
        except ValueError:
            d = float("nan")
        if not 0 <= d <= 1:
            raise argparse.ArgumentTypeError(f"{word!r} is not a depth in [0, 1]; write e.g. 0,0.25,0.5,0.75,1")
        depths.append(d)
    if len(set(depths)) != len(depths):
        raise argparse.ArgumentTypeError(f"{text!r} names a depth twice")
    return depths


class CharTokenizer:
    """The built-in character tokenizer of --vocab (see the module docstring)."""

    def __init__(self, vocab):
        if vocab < len(SMALL_ALPHABET):
            fail(f"--vocab {vocab}: the built-in tokenizer needs at least {len(SMALL_ALPHABET)} ids (digits, "
                 f"space, '.', '?' and a-z); give the model's tokenizer with --tokenizer HF_DIR")
        self.vocab = vocab
        self.prefix = []  # no BOS: the models it serves were trained on raw text
        self.name = f"bytes (vocab {vocab})" if vocab >= 256 else f"characters {SMALL_ALPHABET!r} (vocab {vocab})"

    def encode(self, text):
        if self.vocab >= 256:
            return list(text.encode("utf-8"))
        return [SMALL_ALPHABET.index(c) for c in text.lower()]


class HfTokenizer:
    """A model directory's own tokenizer, offline."""

    def __init__(self, path):
        if not os.path.isdir(path):
            fail(f"--tokenizer {path} is not a directory; give a Hugging Face model directory (tokenizer.json)")
        tok, why = None, "transformers is not installed"
        try:
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self._encode = lambda text, special: tok.encode(text, add_special_tokens=special)
            self.vocab = len(tok)
        except ImportError:
            pass
        except (OSError, ValueError) as e:  # e.g. a tokenizer.json without the config AutoTokenizer wants
            why = f"transformers cannot load it ({str(e).splitlines()[0][:200]})"
        if tok is None:
            try:
                from tokenizers import Tokenizer
            except ImportError:
                fail(f"--tokenizer {path}: {why}, and neither is tokenizers (scripts/install-hf.sh installs both "
                     "in build/hf-venv: run this script with build/hf-venv/bin/python)")
            if not os.path.exists(os.path.join(path, "tokenizer.json")):
                fail(f"--tokenizer {path}: {why}, and it has no tokenizer.json for the tokenizers package")
            tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
            self._encode = lambda text, special: tok.encode(text, add_special_tokens=special).ids
            self.vocab = tok.get_vocab_size(with_added_tokens=True)
        # What the tokenizer puts before a text of its own accord (a BOS), which the model saw in training.
        plain, special = self.encode("a"), self._encode("a", True)
        self.prefix = special[:special.index(plain[0])] if plain and plain[0] in special else []
        self.name = path

    def encode(self, text):
        return list(self._encode(text, False))


def model_vocab(path):
    """The vocabulary of --init: an sppo checkpoint's state.json or a Hugging Face config.json."""
    for name, get in (("state.json", lambda j: j.get("config", {}).get("vocab")),
                      ("config.json", lambda j: j.get("vocab_size"))):
        f = os.path.join(path, name)
        if os.path.exists(f):
            try:
                v = get(json.load(open(f)))
            except (ValueError, AttributeError):
                v = None
            if isinstance(v, int):
                return v
    fail(f"--init {path}: no state.json (sppo checkpoint) or config.json (Hugging Face) with the vocabulary size")


def cell_name(length, depth):
    return f"cell-{length}-{depth:g}"


def haystack(tok, length, depth, seed):
    """One cell's tokens (length + 1 of them), labels, and what a reader needs to know of it."""
    key = str(random.Random(f"{seed}/{length}/{depth!r}").randint(10000, 99999))
    sentences = [tok.encode(" " + s) for s in FILLER]
    needle = tok.encode(" " + NEEDLE.format(key=key))
    # The question and answer tokenized as one text, as the model reads them; the answer is what the question
    # alone does not tokenize to, less the space before the key where that is a token of its own (a tokenizer
    # may instead join the space to the first digit).
    tail = tok.encode(" " + QUESTION + " " + key)
    matches = []  # (whole question a prefix of tail, tokens shared)
    for asked in (tok.encode(" " + QUESTION), tok.encode(" " + QUESTION + " ")):
        n = 0
        while n < min(len(tail), len(asked)) and tail[n] == asked[n]:
            n += 1
        matches.append((n == len(asked), n))
    answer = len(tail) - max(matches)[1]
    other = "".join(str((int(c) + 1) % 10) for c in key)
    if tok.encode(" " + QUESTION + " " + other) == tail:
        fail(f"the {tok.name} tokenizer writes passkeys {key} and {other} as the same tokens (unknown digits?), "
             "so no model could retrieve one; use the tokenizer the model was trained with")
    assert answer > 0, "the answer tokenizes to nothing"
    filler = length + 1 - len(tok.prefix) - len(needle) - len(tail)
    if filler < 0:
        fail(f"--lengths {length}: the needle and question alone take {length + 1 - filler} tokens; "
             f"use lengths of at least {length - filler}")
    # The filler is a window of the repeated sentences that ends where a sentence does, so that the question
    # follows a whole sentence; it starts wherever that makes it `filler` tokens long (mid-sentence, as a
    # window of a longer text would). The needle goes at the sentence boundary nearest `depth` of the way.
    stream, boundaries = [], [0]
    while len(stream) < filler:
        stream += sentences[(len(boundaries) - 1) % len(sentences)]
        boundaries.append(len(stream))
    start = len(stream) - filler
    window = stream[start:]
    at = min([0] + [b - start for b in boundaries if b >= start], key=lambda b: abs(b - depth * filler))
    tokens = tok.prefix + window[:at] + needle + window[at:] + tail
    assert len(tokens) == length + 1
    labels = [IGNORE] * (len(tokens) - answer) + tokens[-answer:]
    info = {"length": length, "depth": depth, "passkey": key, "answer_tokens": answer,
            "needle_at": len(tok.prefix) + at}
    return tokens, labels, info


def write_ints(path, values, code):
    a = array.array(code, values)
    assert a.itemsize == 4
    if sys.byteorder == "big":
        a.byteswap()  # sppo reads little-endian files
    with open(path + ".tmp", "wb") as f:
        a.tofile(f)
    os.replace(path + ".tmp", path)


def write_haystacks(a, tok, vocab):
    """Every cell's haystack files; returns the cells' info in grid order (lengths ascending)."""
    if a.samples < 1:
        fail(f"--samples {a.samples}: give 1 or more haystacks a cell")
    os.makedirs(a.out, exist_ok=True)
    cells = []
    for length in a.lengths:
        for depth in a.depths:
            tokens, labels, info = haystack(tok, length, depth, a.seed)
            # More haystacks of the cell, each with its own key, one window after another as sppo reads a token
            # file (each after the first drops its first token: the one before's last takes its place).
            info["samples"] = a.samples
            for j in range(1, a.samples):
                more_tokens, more_labels, more = haystack(tok, length, depth, f"{a.seed}/sample/{j}")
                tokens += more_tokens[1:]
                labels += more_labels[1:]
                info.setdefault("more_passkeys", []).append(more["passkey"])
            top = max(tokens)
            if top >= vocab:
                fail(f"token id {top} of the {tok.name} tokenizer is outside the model's vocabulary [0, {vocab}); "
                     "use the tokenizer the model was trained with")
            folder = os.path.join(a.out, cell_name(length, depth))
            os.makedirs(folder, exist_ok=True)
            info["data"], info["labels"] = os.path.join(folder, "haystack.u32"), os.path.join(folder, "haystack.i32")
            write_ints(info["data"], tokens, "I")
            write_ints(info["labels"], labels, "i")
            cells.append(info)
    manifest = {"tokenizer": tok.name, "seed": a.seed, "cells": cells}
    with open(os.path.join(a.out, "haystacks.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return cells


def make_tokenizer(a, vocab):
    return HfTokenizer(a.tokenizer) if a.tokenizer else CharTokenizer(a.vocab if a.vocab is not None else vocab)


def cmd_haystacks(a):
    if (a.tokenizer is None) == (a.vocab is None):
        fail("give one of --tokenizer HF_DIR (the model's tokenizer) or --vocab V (the built-in tokenizer)")
    tok = make_tokenizer(a, None)
    cells = write_haystacks(a, tok, a.vocab if a.vocab is not None else tok.vocab)
    print(f"wrote {len(cells)} haystacks ({tok.name} tokens) and {os.path.join(a.out, 'haystacks.json')}")


def cmd_train_data(a):
    """Haystacks of one length at random depths, one after another as sppo reads a token file: window k is
    tokens [k L, k L + L], so each haystack after the first drops its first token (the previous one's last
    takes its place), and the first's is the last one's last, for the file's next round."""
    if (a.tokenizer is None) == (a.vocab is None):
        fail("give one of --tokenizer HF_DIR (the model's tokenizer) or --vocab V (the built-in tokenizer)")
    if a.count < 1:
        fail(f"--count {a.count}: give 1 or more haystacks")
    if len(a.lengths) != 1:
        fail("train-data writes haystacks of one length: give --lengths L")
    tok = make_tokenizer(a, None)
    length, rng, stream, targets = a.lengths[0], random.Random(a.seed), [], []
    for k in range(a.count):
        tokens, labels, info = haystack(tok, length, rng.random(), f"{a.seed}/train/{k}")
        # Labels on what can only be retrieved: the key where the needle repeats it, and the answer.
        # The key as the text holds it: after a space, which a byte-level BPE joins to its first digit.
        for key in (tok.encode(" " + info["passkey"]), tok.encode(info["passkey"])):
            found = [at for at in range(info["needle_at"], len(tokens) - len(key) + 1)
                     if tokens[at:at + len(key)] == key]
            if len(found) >= 2:  # the needle's first mention is the key itself; its second is a copy
                if labels[found[1]] == IGNORE:
                    labels[found[1]:found[1] + len(key)] = key
                break
        stream += tokens if k == 0 else tokens[1:]
        targets += labels if k == 0 else labels[1:]
    # sppo reads a file round and round: window `count` starts again at token 0, which must then be the last
    # haystack's last token (and its label that token's), so that every epoch's windows are the haystacks.
    stream[0], targets[0] = stream.pop(), targets.pop()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "train.u32")
    write_ints(path, stream, "I")
    write_ints(os.path.join(a.out, "train.i32"), targets, "i")
    print(f"wrote {a.count} haystacks of {length} tokens ({tok.name} tokens) to {path}, labelled on the keys a "
          f"model can only retrieve in train.i32: train with --seq-len {length} --labels")


def run_eval(a, cell):
    out = os.path.join(a.out, cell_name(cell["length"], cell["depth"]))
    cmd = [a.sppo, "eval", "--init", a.init, "--data", cell["data"], "--labels", cell["labels"],
           "--seq-len", str(cell["length"]), "--seqs", str(cell["samples"]), "--out", out] + a.eval_args
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        fail(f"cannot run --sppo {a.sppo}: {e}")
    return r, os.path.join(out, "eval.json")


def cmd_grid(a, eval_args):
    a.eval_args = eval_args
    for arg in eval_args:
        if arg.split("=")[0] in GRID_SETS:
            fail(f"{arg} after --: the grid sets {', '.join(GRID_SETS)} for each cell itself")
    if a.tokenizer is not None and a.vocab is not None:
        fail("give --tokenizer HF_DIR or --vocab V, not both")
    if not (os.path.isfile(a.sppo) and os.access(a.sppo, os.X_OK)):
        fail(f"--sppo {a.sppo} is not an executable; build it first (bash scripts/build.sh)")
    if not os.path.isdir(a.init):
        fail(f"--init {a.init} is not a directory; give an sppo checkpoint (train --save) or a Hugging Face model")
    vocab = model_vocab(a.init)
    if a.vocab is not None and a.vocab > vocab:
        fail(f"--vocab {a.vocab} is larger than the --init model's vocabulary of {vocab}: its ids would not fit")
    tok = make_tokenizer(a, vocab)
    cells = write_haystacks(a, tok, vocab)
    for cell in cells:
        cell.update(accuracy=None, loss=None, peak_device_bytes=None)
    status, ran = 0, []
    for cell in cells:
        r, result = run_eval(a, cell)
        where = f"length {cell['length']} depth {cell['depth']:g}"
        if r.returncode == 3:
            sys.stderr.write(r.stderr)
            fits = ", ".join(str(n) for n in sorted(set(ran))) or "none"
            print(f"passkey.py: {where} does not fit (sppo eval exit 3, message above); the grid stops here. "
                  f"Lengths that ran: {fits}. Give sppo eval the options it names after `--`, or shorter --lengths",
                  file=sys.stderr)
            status = 3
            break
        if r.returncode != 0:
            sys.stderr.write(r.stdout + r.stderr)
            fail(f"{where}: sppo eval exited {r.returncode} (its output above)", 2 if r.returncode == 2 else 1)
        try:
            e = json.load(open(result))
            cell.update(accuracy=e["accuracy"], loss=e["loss"], peak_device_bytes=e["peak_device_bytes"])
        except (OSError, ValueError, KeyError) as err:
            fail(f"{where}: sppo eval wrote no usable {result} ({err!r})", 1)
        ran.append(cell["length"])
        print(f"{where}: accuracy {cell['accuracy']:.3f} of {cell['answer_tokens']} answer tokens x {cell['samples']}, "
              f"loss {cell['loss']:.4f}, peak device {cell['peak_device_bytes'] / 2**20:.2f} MiB", flush=True)
    summary = os.path.join(a.out, "passkey.json")
    with open(summary + ".tmp", "w") as f:
        json.dump({"init": a.init, "tokenizer": tok.name, "seed": a.seed, "eval_args": eval_args, "cells": cells},
                  f, indent=1)
    os.replace(summary + ".tmp", summary)
    svg = os.path.join(a.out, "passkey.svg")
    plot = [a.sppo, "plot", summary, "--out", svg] + (["--title", a.title] if a.title else [])
    r = subprocess.run(plot, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stdout + r.stderr)
        fail(f"sppo plot of {summary} exited {r.returncode} (its output above)", status or 1)
    print(f"wrote {summary} and {svg}")
    sys.exit(status)


def main():
    argv = sys.argv[1:]
    eval_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog="See the module docstring (head of scripts/passkey.py) for the file layout.")
    sub = p.add_subparsers(dest="command", required=True)
    h = sub.add_parser("haystacks", help="write the haystack token and label files of a grid")
    g = sub.add_parser("grid", help="write the haystacks, run sppo eval on each, collect and plot the accuracies",
                       epilog="Arguments after -- are appended to every sppo eval, e.g. "
                              "-- --subseqs auto --kv-cache host --device-memory 70GiB. Exit 3: a length does not fit.")
    for q in (h, g):
        q.add_argument("--lengths", type=parse_lengths, required=True,
                       help="comma-separated haystack lengths in tokens, e.g. 1K,2K,4K (K = 1024, M = 1024 * 1024)")
        q.add_argument("--depths", type=parse_depths, required=True,
                       help="comma-separated needle depths in [0, 1], e.g. 0,0.25,0.5,0.75,1 (0: start, 1: end)")
        q.add_argument("--out", required=True, help="directory for the cells, haystacks.json (and passkey.json/.svg)")
        q.add_argument("--tokenizer", help="Hugging Face model directory whose tokenizer makes the tokens")
        q.add_argument("--vocab", type=int, help="the built-in character tokenizer for a model of this vocabulary")
        q.add_argument("--seed", type=int, default=1234, help="seed of the passkeys (default 1234)")
        q.add_argument("--samples", type=int, default=1,
                       help="haystacks a cell holds, each with its own key, one window each (default 1)")
    t = sub.add_parser("train-data", help="write haystacks of one length at random depths as one training file")
    t.add_argument("--lengths", type=parse_lengths, required=True, help="the haystacks' length L, e.g. 512")
    t.add_argument("--count", type=int, default=1000, help="haystacks to write (default 1000)")
    t.add_argument("--out", required=True, help="directory for train.u32")
    t.add_argument("--tokenizer", help="Hugging Face model directory whose tokenizer makes the tokens")
    t.add_argument("--vocab", type=int, help="the built-in character tokenizer for a model of this vocabulary")
    t.add_argument("--seed", type=int, default=1234, help="seed of the passkeys and depths (default 1234)")
    g.add_argument("--sppo", default="build/sppo", help="the sppo binary (default build/sppo)")
    g.add_argument("--init", required=True, help="the model: an sppo checkpoint or a Hugging Face model directory")
    g.add_argument("--title", help="heading of passkey.svg (default: sppo plot's)")
    a = p.parse_args(argv)
    if eval_args and a.command != "grid":
        fail("arguments after -- are sppo eval's, for the grid subcommand")
    if a.command == "haystacks":
        cmd_haystacks(a)
    elif a.command == "train-data":
        cmd_train_data(a)
    else:
        cmd_grid(a, eval_args)


if __name__ == "__main__":
    main()
