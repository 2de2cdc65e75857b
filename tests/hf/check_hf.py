#!/usr/bin/env python3
"""sppo's Llama-family block held to an independent implementation: Hugging Face transformers.

For small random LlamaForCausalLM models (grouped-query attention, every RoPE scaling type
HF's config.json names, an LM head tied to the embedding as Llama 3.2's), Qwen2ForCausalLM
models (q/k/v biases; tied as Qwen2.5's small ones) and Qwen3ForCausalLM models (q_norm and
k_norm on each head, a head_dim that is not hidden / heads, every RoPE scaling type, tied
and untied), saved with save_pretrained (one file, and sharded), `sppo grads --init HF_DIR`
must give transformers' loss and every parameter gradient in fp32: max |a - b| <= 1e-5
(1 + |b|) per element. Then `sppo import` and `sppo export --format hf` must give a
directory transformers loads with no missing, unexpected or mismatched weights, whose
logits are the original model's. Bad inputs (an unsupported architecture or field, a
missing shard, a tensor of the wrong shape; for Qwen3 a sliding window, a head_dim the
weights do not have) must exit 2 and write nothing.

Qwen3 needs transformers 4.51 or later (which needs PyTorch 2); with an older one its cases
are skipped, saying so, and the rest runs.

Usage: check_hf.py SPPO_BINARY WORK_DIR. Exits 77 (skipped) without torch and transformers.
"""
import json
import os
import shutil
import subprocess
import sys

try:
    import torch
    import transformers
    from hf_common import base_config, randomize, run_sppo
    from safetensors.torch import load_file
except ImportError as e:  # the test is skipped, saying why
    print(f"skipped: {e} (install python3-torch and transformers 4.46, see .ci/run)")
    sys.exit(77)

SPPO, WORK = sys.argv[1], sys.argv[2]
S = 48  # tokens a step: past max_position_embeddings below, so dynamic scaling scales
TOL = 1e-5
failures = []


def run(*args, expect=0):
    return run_sppo(SPPO, *args, expect=expect)


def hf_loss_and_grads(model, tokens):
    model.zero_grad()
    ids = torch.tensor(tokens[:S]).unsqueeze(0)
    logits = model(input_ids=ids).logits[0]
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(tokens[1:S + 1]))
    loss.backward()
    return logits.detach(), loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def as_sppo(hf, layers):
    """HF tensors (by HF name) as sppo's parameters (io/hf.h's table); a tied model has no
    lm_head of its own (transformers' named_parameters() lists the shared tensor once)."""
    out = {"embed.weight": hf["model.embed_tokens.weight"], "ln_f.weight": hf["model.norm.weight"]}
    if "lm_head.weight" in hf:
        out["lm_head.weight"] = hf["lm_head.weight"]
    for l in range(layers):
        p, b = f"model.layers.{l}.", f"blocks.{l}."
        out[b + "ln1.weight"] = hf[p + "input_layernorm.weight"]
        out[b + "ln2.weight"] = hf[p + "post_attention_layernorm.weight"]
        out[b + "attn.qkv.weight"] = torch.cat([hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        if p + "self_attn.q_proj.bias" in hf:
            out[b + "attn.qkv.bias"] = torch.cat([hf[p + f"self_attn.{x}_proj.bias"] for x in "qkv"])
        for x in "qk":  # Qwen3's per-head norms
            if p + f"self_attn.{x}_norm.weight" in hf:
                out[b + f"attn.{x}_norm.weight"] = hf[p + f"self_attn.{x}_norm.weight"]
        out[b + "attn.out.weight"] = hf[p + "self_attn.o_proj.weight"]
        out[b + "mlp.fc.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
        out[b + "mlp.proj.weight"] = hf[p + "mlp.down_proj.weight"]
    return out


def check_close(what, got, want):
    err = (got - want).abs()
    bound = TOL * (1 + want.abs())
    worst = (err / bound).max().item()
    if worst > 1:
        failures.append(f"{what}: max |a - b| {err.max().item():.3e}, {worst:.2f}x the bound")
    return err.max().item()


def grads_case(name, cls, config, seed, sharded=False, sppo_flags=()):
    d = os.path.join(WORK, name)
    model = cls(config)
    randomize(model, seed)
    model.save_pretrained(d, safe_serialization=True, max_shard_size="20KB" if sharded else "5GB")
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, config.vocab_size, (S + 1,), generator=g).tolist()
    tok_file = os.path.join(WORK, name + ".u32")
    with open(tok_file, "wb") as f:
        f.write(torch.tensor(tokens, dtype=torch.int32).numpy().astype("<u4").tobytes())
    logits, loss, grads = hf_loss_and_grads(model, tokens)
    out = os.path.join(WORK, name + "-grads")
    run("grads", "--init", d, "--seq-len", str(S), "--data", tok_file, "--threads", "1", "--out", out, *sppo_flags)
    got_loss = json.load(open(os.path.join(out, "result.json")))["loss"]
    if abs(got_loss - loss) > TOL * (1 + abs(loss)):
        failures.append(f"{name}: loss {got_loss} vs transformers' {loss}")
    got = load_file(os.path.join(out, "grads.safetensors"))
    want = as_sppo(grads, config.num_hidden_layers)
    if set(got) != set(want):
        failures.append(f"{name}: gradient names {sorted(set(got) ^ set(want))} differ")
    worst = max(check_close(f"{name} d {k}", got[k].double(), want[k].double()) for k in want if k in got)
    print(f"{name}: loss {got_loss:.8f} vs {loss:.8f}, worst gradient |a - b| {worst:.2e}")
    return d, model, tokens, logits


def export_case(name, d, model, tokens, logits):
    ckpt, exp = os.path.join(WORK, name + "-ckpt"), os.path.join(WORK, name + "-hf")
    run("import", d, "--out", ckpt)
    for dtype, shard, tol in (("checkpoint", "5GB", 0.0), ("bf16", "20KB", 0.1)):
        shutil.rmtree(exp, ignore_errors=True)
        run("export", ckpt, "--format", "hf", "--out", exp, "--dtype", dtype, "--shard-size", shard)
        loaded, info = transformers.AutoModelForCausalLM.from_pretrained(exp, output_loading_info=True,
                                                                         torch_dtype=torch.float32)
        for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
            if info[k]:
                failures.append(f"{name} export {dtype}: {k} {info[k]}")
        if loaded.config.tie_word_embeddings != model.config.tie_word_embeddings:
            failures.append(f"{name} export {dtype}: tie_word_embeddings {loaded.config.tie_word_embeddings}, "
                            f"the original's {model.config.tie_word_embeddings}")
        with torch.no_grad():
            again = loaded(input_ids=torch.tensor(tokens[:S]).unsqueeze(0)).logits[0]
        err = (again - logits).abs().max().item()
        if err > tol:
            failures.append(f"{name} export {dtype}: logits differ by {err:.3e} (allowed {tol})")
        print(f"{name}: exported ({dtype}, shards of {shard}) and reloaded, logits within {err:.2e}")


def bad_inputs(good):
    """Each refused with exit 2 before anything is written."""
    def refused(label, hf_dir, needle):
        out = os.path.join(WORK, "refused")
        r = run("import", hf_dir, "--out", out, expect=2)
        if os.path.exists(out):
            failures.append(f"{label}: {out} was written")
        if needle not in r.stderr:
            failures.append(f"{label}: the message does not name '{needle}': {r.stderr.strip()}")
        print(f"refused ({label}): {r.stderr.strip()}")

    def copy(label):
        d = os.path.join(WORK, "bad-" + label)
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(good, d)
        return d

    d = copy("architecture")
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    refused("unsupported architecture", d, "GPT2LMHeadModel")
    d = copy("field")
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["hidden_act"] = "gelu"
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    refused("unsupported field", d, "hidden_act")
    d = copy("shard")
    shard = sorted(f for f in os.listdir(d) if f.startswith("model-"))[-1]
    os.remove(os.path.join(d, shard))
    refused("missing shard", d, shard)
    d = copy("shape")
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["intermediate_size"] += 8
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    refused("tensor of the wrong shape", d, "gate_proj.weight")


def qwen3_bad_inputs(good):
    """Qwen3's config fields sppo cannot honour, each refused with exit 2 naming the field."""
    def refused(label, change, needle):
        d = os.path.join(WORK, "bad-qwen3-" + label)
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(good, d)
        cfg = json.load(open(os.path.join(d, "config.json")))
        change(cfg)
        json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
        out = os.path.join(WORK, "refused")
        r = run("import", d, "--out", out, expect=2)
        if os.path.exists(out):
            failures.append(f"qwen3 {label}: {out} was written")
        if needle not in r.stderr:
            failures.append(f"qwen3 {label}: the message does not name '{needle}': {r.stderr.strip()}")
        print(f"refused (qwen3 {label}): {r.stderr.strip()}")

    refused("sliding window", lambda c: c.update(use_sliding_window=True), "use_sliding_window")
    refused("head_dim of other weights", lambda c: c.update(head_dim=16), "q_proj.weight")
    refused("odd head_dim", lambda c: c.update(head_dim=7), "head_dim")
    refused("unknown rope_scaling", lambda c: c.update(rope_scaling={"rope_type": "longrope", "factor": 2.0}),
            "rope_scaling")
    refused("attention_bias", lambda c: c.update(attention_bias=True), "attention_bias")


def qwen3_cases():
    """Qwen3ForCausalLM: heads of 12 on hidden 32 (not 32 / 4), q_norm and k_norm, G 2 of 4."""
    if not hasattr(transformers, "Qwen3ForCausalLM"):
        print(f"skipped Qwen3ForCausalLM: transformers {transformers.__version__} lacks it (4.51 or later has it, "
              "with PyTorch 2)")
        return
    Q = transformers.Qwen3Config
    scalings = [None, {"rope_type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0},
                {"rope_type": "yarn", "factor": 4.0},
                {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 16}]
    for k, scaling in enumerate(scalings):
        tied = k % 2 == 0
        name = f"qwen3-{(scaling or {}).get('rope_type', 'default')}-{'tied' if tied else 'untied'}"
        config = Q(**base_config(head_dim=12, rope_theta=1000.0, tie_word_embeddings=tied, rope_scaling=scaling,
                                 num_key_value_heads=1 if k == 1 else 2))
        flags = ("--subseqs", "3", "--offload", "0.5") if k == 3 else ()
        d, model, tokens, logits = grads_case(name, transformers.Qwen3ForCausalLM, config, 70 + k,
                                              sharded=k == 2, sppo_flags=flags)
        if k in (0, 1):
            export_case(name, d, model, tokens, logits)
        if k == 0:
            qwen3_bad_inputs(d)


def tokenizer_case(hf_dir, vocab):
    """scripts/tokenize_text.py: text and a tokenizer.json into files train --data reads."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "tokenize_text.py")
    docs = []
    for k, words in enumerate(("the cat sat on the mat " * 30, "a dog ran in the park " * 30)):
        docs.append(os.path.join(WORK, f"doc{k}.txt"))
        open(docs[-1], "w").write(words)
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train(docs, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[EOS]"]))
    tok_file = os.path.join(WORK, "tokenizer.json")
    tok.save(tok_file)
    for fmt, data in (("raw", "corpus.u16"), ("megatron", "corpus")):
        prefix = os.path.join(WORK, "corpus")
        r = subprocess.run([sys.executable, script, "--tokenizer", tok_file, "--model", hf_dir, "--out", prefix,
                            "--format", fmt, "--doc-sep", "1", *docs], capture_output=True, text=True)
        if r.returncode != 0:
            failures.append(f"tokenize_text.py --format {fmt}: exit {r.returncode}: {r.stderr}")
            continue
        run("train", "--init", hf_dir, "--data", os.path.join(WORK, data), "--seq-len", "32", "--steps", "1",
            "--quiet")
        print(f"tokenize_text.py --format {fmt}: {r.stdout.strip()}; sppo trained a step on it")
    small = os.path.join(WORK, "too-small")
    r = subprocess.run([sys.executable, script, "--tokenizer", tok_file, "--vocab-size", "4", "--out", small, *docs],
                       capture_output=True, text=True)
    if r.returncode != 2 or os.path.exists(small + ".u16") or "vocabulary is 4" not in r.stderr:
        failures.append(f"a tokenizer larger than the vocabulary: exit {r.returncode}, {r.stderr.strip()}")
    print(f"refused (tokenizer vocabulary): {r.stderr.strip()}")


def main():
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    torch.manual_seed(0)
    L = transformers.LlamaConfig
    cases = [
        ("llama-gqa", L(**base_config())),
        ("llama-mqa-linear", L(**base_config(num_key_value_heads=1, rope_scaling={"rope_type": "linear", "factor": 2.0}))),
        ("llama-dynamic", L(**base_config(num_key_value_heads=4, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))),
        ("llama-yarn", L(**base_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}))),
        ("llama-llama3", L(**base_config(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 16}))),
    ]
    for k, (name, config) in enumerate(cases):
        grads_case(name, transformers.LlamaForCausalLM, config, 10 + k)
    qwen = transformers.Qwen2Config(**base_config(rope_theta=1000.0))
    d, model, tokens, logits = grads_case("qwen2-sharded", transformers.Qwen2ForCausalLM, qwen, 30, sharded=True,
                                          sppo_flags=("--subseqs", "3"))
    export_case("qwen2", d, model, tokens, logits)
    d, model, tokens, logits = grads_case("llama-export", transformers.LlamaForCausalLM, cases[4][1], 40, sharded=True)
    export_case("llama", d, model, tokens, logits)
    # Tied heads: the gradient of the shared tensor is the embedding's plus the head's; the
    # export keeps them tied (no lm_head.weight, tie_word_embeddings true).
    tied_llama = L(**base_config(tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}))
    td, tmodel, ttokens, tlogits = grads_case("llama-tied", transformers.LlamaForCausalLM, tied_llama, 50,
                                              sppo_flags=("--subseqs", "3", "--offload", "0.5"))
    export_case("llama-tied", td, tmodel, ttokens, tlogits)
    tied_qwen = transformers.Qwen2Config(**base_config(rope_theta=1000.0, tie_word_embeddings=True))
    td, tmodel, ttokens, tlogits = grads_case("qwen2-tied", transformers.Qwen2ForCausalLM, tied_qwen, 60)
    export_case("qwen2-tied", td, tmodel, ttokens, tlogits)
    bad_inputs(d)
    qwen3_cases()
    tokenizer_case(d, cases[4][1].vocab_size)
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    main()
