#!/usr/bin/env python3
"""`sppo eval` held to an independent implementation: Hugging Face transformers.

For a tied and an untied small random LlamaForCausalLM (fp32, weights at unit scale as in
check_hf.py, RoPE unscaled with max_position_embeddings >= S), saved with save_pretrained,
`sppo eval --init HF_DIR` over two windows of S + 1 tokens (window k: tokens [kS, kS + S],
sharing one token with the next; position p predicts token p + 1) must give transformers'
loss: the mean over both windows' positions, and the mean of each per_position bin ([0, 16),
[16, 32), [32, 64), ... up to S), each within 1e-5 (1 + |b|), with the same token counts.
It runs whole (--subseqs 1), in 3 subsequences, and in 3 with the K/V cache on the host.
With --labels (an .i32 file, one per token, some -100: position p's target is the label of
token p + 1, and -100 takes no loss) the loss likewise and the accuracy (how often the most
likely token is the target) exactly. The tokens are text (the repository's README.md) run
through scripts/tokenize_text.py with a BPE tokenizer trained here, offline; without the
`tokenizers` package, pseudo-random ids. Bad inputs: fewer labels than tokens and data
shorter than one sequence exit 2, and a --device-memory far too small exits 3, each saying
why. Passkey: scripts/passkey.py grid (this interpreter, -- --backend cpu) over both models with the
tokenizer saved beside each (transformers' PreTrainedTokenizerFast of the BPE above; without
`tokenizers`, passkey.py's built-in character tokenizer), lengths PASSKEY_LENGTHS (within
max_position_embeddings) by depths 0, 0.5, 1: each cell of passkey.json must have transformers'
accuracy on its own haystack token and label files exactly, and its loss within 1e-5 (1 + |b|);
passkey.svg must exist. (The models are random, so the accuracies are mostly 0: the loss is what
holds the labels' alignment to account.)

Usage: check_eval.py SPPO_BINARY WORK_DIR. Exits 77 (skipped) without torch and transformers.
"""
import json
import os
import shutil
import subprocess
import sys

try:
    import numpy
    import torch
    import transformers
    import hf_common
    from hf_common import randomize, run_sppo
except ImportError as e:  # the test is skipped, saying why
    print(f"skipped: {e} (install python3-torch and transformers 4.46, see .ci/run)")
    sys.exit(77)

SPPO, WORK = sys.argv[1], sys.argv[2]
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
S = 96  # tokens a sequence: within max_position_embeddings below
SEQS = 2
TOL = 1e-5
IGNORE = -100
# The CPU backend: its default precision is fp32 (CUDA's is bf16).
COMMON = ("--backend", "cpu")
failures = []
worst = {"loss": 0.0, "bins": 0.0}


def run(*args, expect=0):
    return run_sppo(SPPO, *args, expect=expect)


def base_config(**kw):
    return hf_common.base_config(**{"max_position_embeddings": 128, **kw})


def write_raw(path, values, dtype):
    numpy.asarray(values, dtype=numpy.int64).astype(dtype).tofile(path)


def train_tokenizer():
    """A BPE tokenizer trained here on the README (offline), or None without `tokenizers`."""
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    except ImportError as e:
        print(f"no tokenizers package ({e}): pseudo-random token ids instead of text")
        return None, None
    text = os.path.join(ROOT, "README.md")
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "[EOS]"], show_progress=False))
    tok_file = os.path.join(WORK, "tokenizer.json")
    tok.save(tok_file)
    return tok_file, text


def tokenize(tok_file, text, hf_dir):
    """scripts/tokenize_text.py's raw tokens of the text, the first SEQS windows' worth as .u32."""
    prefix = os.path.join(WORK, "corpus")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "tokenize_text.py"), "--tokenizer", tok_file,
                        "--model", hf_dir, "--out", prefix, "--format", "raw", text], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"tokenize_text.py: exit {r.returncode}: {r.stderr}")
    raw = prefix + ".u16" if os.path.exists(prefix + ".u16") else prefix + ".u32"
    dtype = "<u2" if raw.endswith(".u16") else "<u4"
    ids = numpy.fromfile(raw, dtype=dtype).astype("int64").tolist()
    if len(ids) < SEQS * S + 1:
        raise SystemExit(f"{text} gives {len(ids)} tokens, fewer than {SEQS * S + 1}")
    print(f"tokenize_text.py: {r.stdout.strip()}; the first {SEQS * S + 1} of {len(ids)} tokens evaluated")
    return ids[:SEQS * S + 1]


def hf_positions(model, tokens, labels=None):
    """Per window: each position's loss, whether it counts, and whether its argmax is the target."""
    out = []
    with torch.no_grad():
        for k in range(SEQS):
            window = tokens[k * S:k * S + S + 1]
            logits = model(input_ids=torch.tensor(window[:S]).unsqueeze(0)).logits[0].double()
            target = torch.tensor(window[1:] if labels is None else labels[k * S + 1:k * S + S + 1])
            counted = target != IGNORE
            safe = torch.where(counted, target, torch.zeros_like(target))
            loss = torch.nn.functional.cross_entropy(logits, safe, reduction="none")
            hits = logits.argmax(-1) == safe
            top2 = logits.topk(2, dim=-1).values
            out.append((loss, counted, hits, top2[:, 0] - top2[:, 1]))
    return out


def bins():
    b, e = 0, min(S, 16)
    while b < S:
        yield b, e
        b, e = e, min(S, 2 * e)


def close(got, want):
    return abs(got - want) <= TOL * (1 + abs(want))


def rel(got, want):
    return abs(got - want) / (1 + abs(want))


def compare(label, result, positions, labeled):
    loss_sum = sum(float(l[c].sum()) for l, c, *_ in positions)
    count = sum(int(c.sum()) for _, c, *_ in positions)
    want_loss = loss_sum / count
    if result["tokens"] != count:
        failures.append(f"{label}: tokens {result['tokens']}, transformers' {count}")
    if not close(result["loss"], want_loss):
        failures.append(f"{label}: loss {result['loss']!r} vs transformers' {want_loss!r}")
    worst["loss"] = max(worst["loss"], rel(result["loss"], want_loss))
    want_bins = list(bins())
    got_bins = [(b["begin"], b["end"]) for b in result["per_position"]]
    if got_bins != want_bins:
        failures.append(f"{label}: position bins {got_bins}, expected {want_bins}")
    bin_err = 0.0
    for b in result["per_position"]:
        lo, hi = b["begin"], b["end"]
        n = sum(int(c[lo:hi].sum()) for _, c, *_ in positions)
        s = sum(float(l[lo:hi][c[lo:hi]].sum()) for l, c, *_ in positions)
        if b["tokens"] != n:
            failures.append(f"{label}: bin [{lo}, {hi}) counts {b['tokens']} tokens, transformers' {n}")
        if n == 0:
            if b["loss"] is not None:
                failures.append(f"{label}: bin [{lo}, {hi}) has no counted token but loss {b['loss']}")
            continue
        want = s / n
        if b["loss"] is None or not close(b["loss"], want):
            failures.append(f"{label}: bin [{lo}, {hi}) loss {b['loss']!r} vs transformers' {want!r}")
        else:
            bin_err = max(bin_err, rel(b["loss"], want))
    worst["bins"] = max(worst["bins"], bin_err)
    text = f"{label}: loss {result['loss']:.8f} vs {want_loss:.8f}, worst bin rel. diff {bin_err:.2e}"
    if labeled:
        hits = sum(int(h[c].sum()) for _, c, h, _ in positions)
        want_acc = hits / count
        if "accuracy" not in result:
            failures.append(f"{label}: eval.json has no accuracy")
        elif result["accuracy"] != want_acc:
            failures.append(f"{label}: accuracy {result['accuracy']!r} vs transformers' {want_acc!r} "
                            f"({hits} of {count}; transformers' closest top-2 logits "
                            f"{min(float(m[c].min()) for _, c, _, m in positions):.2e} apart)")
        else:
            margin = min(float(m[c].min()) for _, c, _, m in positions)
            text += f", accuracy {result['accuracy']:.6f} ({hits} of {count}) as transformers' (top-2 gap >= {margin:.1e})"
    elif "accuracy" in result:
        failures.append(f"{label}: accuracy {result['accuracy']} without --labels")
    print(text)


PASSKEY_LENGTHS = (96, 128)  # both within max_position_embeddings (128)
PASSKEY_DEPTHS = (0, 0.5, 1)


def read_raw(path, dtype):
    return numpy.fromfile(path, dtype=dtype).astype("int64").tolist()


@torch.no_grad()
def passkey_case(name, hf_dir, model, with_tokenizer):
    """scripts/passkey.py grid over the model; each cell's accuracy and loss against transformers'."""
    out = os.path.join(WORK, name + "-passkey")
    lengths = ",".join(str(n) for n in PASSKEY_LENGTHS)
    depths = ",".join(f"{d:g}" for d in PASSKEY_DEPTHS)
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "passkey.py"), "grid", "--sppo", SPPO, "--init", hf_dir,
           *(("--tokenizer", hf_dir) if with_tokenizer else ()), "--lengths", lengths, "--depths", depths,
           "--out", out, "--", *COMMON]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        failures.append(f"{name} passkey: passkey.py grid exit {r.returncode}\n{r.stdout}{r.stderr}")
        return
    if not os.path.isfile(os.path.join(out, "passkey.svg")):
        failures.append(f"{name} passkey: no passkey.svg in {out}")
    cells = json.load(open(os.path.join(out, "passkey.json")))["cells"]
    want_cells = [(n, float(d)) for n in PASSKEY_LENGTHS for d in PASSKEY_DEPTHS]
    got_cells = [(c.get("length"), c.get("depth")) for c in cells]
    if got_cells != want_cells:
        failures.append(f"{name} passkey: cells {got_cells}, expected {want_cells}")
    for c in cells:
        label = f"{name} passkey length {c['length']} depth {c['depth']:g}"
        L = c["length"]
        tokens, labels = read_raw(c["data"], "<u4"), read_raw(c["labels"], "<i4")
        if len(tokens) != L + 1 or len(labels) != L + 1:
            failures.append(f"{label}: {len(tokens)} tokens and {len(labels)} labels, expected {L + 1} each")
            continue
        logits = model(input_ids=torch.tensor(tokens[:L]).unsqueeze(0)).logits[0].double()
        target = torch.tensor(labels[1:])
        counted = target != IGNORE
        count = int(counted.sum())
        if count != c["answer_tokens"] or count == 0:
            failures.append(f"{label}: {count} labelled positions, passkey.json says {c['answer_tokens']} "
                            "answer tokens")
            continue
        safe = torch.where(counted, target, torch.zeros_like(target))
        want_loss = float(torch.nn.functional.cross_entropy(logits[counted], safe[counted]))
        hits = int((logits.argmax(-1) == safe)[counted].sum())
        want_acc = hits / count
        top2 = logits.topk(2, dim=-1).values
        margin = float((top2[:, 0] - top2[:, 1])[counted].min())
        if c["accuracy"] is None or c["accuracy"] != want_acc:
            failures.append(f"{label}: accuracy {c['accuracy']!r} vs transformers' {want_acc!r} ({hits} of {count}; "
                            f"transformers' closest top-2 logits {margin:.2e} apart)")
        if c["loss"] is None or not close(c["loss"], want_loss):
            failures.append(f"{label}: loss {c['loss']!r} vs transformers' {want_loss!r}")
        else:
            worst["loss"] = max(worst["loss"], rel(c["loss"], want_loss))
        print(f"{label} (key {c['passkey']}): accuracy {c['accuracy']!r} vs transformers' {want_acc!r} "
              f"({hits} of {count} answer tokens; top-2 gap >= {margin:.1e}), loss {c['loss']!r} vs {want_loss:.8f}")


FORMS = (("whole", ("--subseqs", "1")), ("subseqs3", ("--subseqs", "3")),
         ("subseqs3-host", ("--subseqs", "3", "--kv-cache", "host")))


@torch.no_grad()
def make_labels(model, tokens, vocab, seed):
    """One label per token: a third -100, a third the id transformers' model finds most likely
    at the position that predicts it (so the accuracy is neither 0 nor 1), the rest random ids.
    Label j is the target of window (j - 1) // S's position (j - 1) % S; label 0 is no one's."""
    g = torch.Generator().manual_seed(seed)
    best = torch.cat([model(input_ids=torch.tensor(tokens[k * S:k * S + S]).unsqueeze(0)).logits[0].argmax(-1)
                      for k in range(SEQS)]).tolist()
    labels = torch.randint(0, vocab, (len(tokens),), generator=g).tolist()
    pick = torch.randint(0, 3, (len(tokens),), generator=g).tolist()
    for j in range(len(tokens)):
        if pick[j] == 0:
            labels[j] = IGNORE
        elif pick[j] == 1 and j > 0:
            labels[j] = best[j - 1]
    return labels


def eval_case(name, hf_dir, model, tok_file, lab_file, tokens, labels):
    plain, labeled = hf_positions(model, tokens), hf_positions(model, tokens, labels)
    for form, flags in FORMS:
        for with_labels in (False, True):
            label = f"{name} {form}{' labels' if with_labels else ''}"
            out = os.path.join(WORK, f"{name}-{form}{'-labels' if with_labels else ''}")
            extra = ("--labels", lab_file) if with_labels else ()
            run("eval", "--init", hf_dir, "--data", tok_file, "--seq-len", str(S), "--seqs", str(SEQS), "--out", out,
                *COMMON, *flags, *extra)
            result = json.load(open(os.path.join(out, "eval.json")))
            if result.get("subseqs") != int(flags[1]):
                failures.append(f"{label}: {result.get('subseqs')} subsequences, asked for {flags[1]}")
            if "host" in flags and not result.get("kv_cache_host_layers"):
                failures.append(f"{label}: --kv-cache host put no layer's K/V on the host")
            compare(label, result, labeled if with_labels else plain, with_labels)


def bad_inputs(hf_dir, tok_file, vocab):
    def refused(label, expect, *args):
        r = run("eval", "--init", hf_dir, *COMMON, *args, expect=expect)
        message = (r.stderr + r.stdout).strip()
        if not message:
            failures.append(f"{label}: exit {expect} with nothing said")
        print(f"refused ({label}, exit {expect}): {r.stderr.strip()}")

    short_labels = os.path.join(WORK, "short.i32")
    write_raw(short_labels, [1] * (SEQS * S), "<i4")  # one fewer than the tokens
    refused("fewer labels than tokens", 2, "--data", tok_file, "--labels", short_labels, "--seq-len", str(S),
            "--seqs", str(SEQS))
    short = os.path.join(WORK, "short.u32")
    write_raw(short, [k % vocab for k in range(S)], "<u4")  # S tokens: one sequence needs S + 1
    refused("data shorter than a sequence", 2, "--data", short, "--seq-len", str(S), "--seqs", "1")
    long_len = 4096
    long_file = os.path.join(WORK, "long.u32")
    g = torch.Generator().manual_seed(7)
    write_raw(long_file, torch.randint(0, vocab, (long_len + 1,), generator=g).tolist(), "<u4")
    refused("--device-memory far too small", 3, "--data", long_file, "--seq-len", str(long_len), "--seqs", "1",
            "--device-memory", "1MiB", "--kv-cache", "device", "--subseqs", "1")


def main():
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    torch.manual_seed(0)
    tok_json, text = train_tokenizer()
    if tok_json:
        from tokenizers import Tokenizer
        vocab = Tokenizer.from_file(tok_json).get_vocab_size()
    else:
        vocab = 61
    L = transformers.LlamaConfig
    cases = []
    for k, tied in enumerate((False, True)):
        name = "llama-tied" if tied else "llama-untied"
        model = transformers.LlamaForCausalLM(L(**base_config(vocab_size=vocab, tie_word_embeddings=tied)))
        randomize(model, 10 + k)
        model.eval()
        d = os.path.join(WORK, name)
        model.save_pretrained(d, safe_serialization=True)
        if tok_json:  # the tokenizer beside the model, as passkey.py's --tokenizer HF_DIR loads it
            transformers.PreTrainedTokenizerFast(tokenizer_file=tok_json, unk_token="[UNK]",
                                                 eos_token="[EOS]").save_pretrained(d)
        cases.append((name, d, model))
    if tok_json:
        tokens = tokenize(tok_json, text, cases[0][1])
    else:
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, vocab, (SEQS * S + 1,), generator=g).tolist()
    tok_file = os.path.join(WORK, "tokens.u32")
    write_raw(tok_file, tokens, "<u4")
    for k, (name, d, model) in enumerate(cases):
        labels = make_labels(model, tokens, vocab, 20 + k)
        lab_file = os.path.join(WORK, name + "-labels.i32")
        write_raw(lab_file, labels, "<i4")
        eval_case(name, d, model, tok_file, lab_file, tokens, labels)
        passkey_case(name, d, model, tok_json is not None)
    bad_inputs(cases[0][1], tok_file, vocab)
    print(f"max relative difference (|a - b| / (1 + |b|)): loss {worst['loss']:.2e}, per-position bins "
          f"{worst['bins']:.2e} (allowed {TOL:.0e})")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    main()
