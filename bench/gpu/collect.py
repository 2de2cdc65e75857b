"""Turns what bench/gpu/check.sh left in OUT into OUT/check.json: the correctness verdicts
and the benchmark figures beside PyTorch's, with the keys bench/results/<gpu>-<date>.json
keeps. Standard library only (the GPU machine's python has no project packages)."""
import array, datetime, json, math, os, struct, subprocess, sys

out_dir, smoke, commit = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
logs = os.path.join(out_dir, "logs")


def read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def last_json(text):
    """The output's JSON object: the whole text when it is one (pretty-printed), else its last
    line that is an object (a log with progress lines before it)."""
    try:
        whole = json.loads(text)
        if isinstance(whole, dict):
            return whole
    except ValueError:
        pass
    for line in reversed(text.strip().splitlines()):
        try:
            j = json.loads(line)
        except ValueError:
            continue
        if isinstance(j, dict):
            return j
    return None


def safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        a = array.array("f")
        a.frombytes(data[b:e])
        tensors[name] = a
    return tensors


def grad_error(ref_dir, dir_):
    """Worst per-tensor relative L2 error of the gradients, and the loss's relative error."""
    try:
        a, b = safetensors(os.path.join(ref_dir, "grads.safetensors")), safetensors(os.path.join(dir_, "grads.safetensors"))
        worst, where = 0.0, ""
        for name, x in a.items():
            y = b[name]
            num = sum((p - q) ** 2 for p, q in zip(x, y))
            den = sum(p * p for p in x) or 1e-30
            e = math.sqrt(num / den)
            if e > worst:
                worst, where = e, name
        la = json.load(open(os.path.join(ref_dir, "result.json")))["loss"]
        lb = json.load(open(os.path.join(dir_, "result.json")))["loss"]
        return {"worst_grad_rel": worst, "worst_tensor": where, "loss_rel": abs(la - lb) / abs(la)}
    except Exception as e:  # a missing export is a failed check
        return {"error": repr(e)[:200]}


def curve(path):
    try:
        return [json.loads(l)["loss"] for l in open(path) if '"loss"' in l and '"summary"' not in l]
    except OSError:
        return []


result = {"date": datetime.date.today().isoformat(), "commit": commit, "smoke": smoke}
try:
    result["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True).stdout.strip() or "none"
except OSError:
    result["gpu"] = "none"
result["sections"] = [json.loads(l) for l in read(os.path.join(out_dir, "parts", "sections.jsonl")).splitlines() if l]

checks = {}
for name in ("kernels", "kernels_cudnn"):
    tests = last_json(read(os.path.join(out_dir, "parts", name + ".json")))
    if tests:
        checks[name] = {"tests": tests.get("tests"), "failures": tests.get("failures"),
                        "pass": tests.get("failures") == 0}
for family in ("grads", "llama"):
    g = os.path.join(out_dir, family)
    vs_cpu = grad_error(os.path.join(g, "cpu"), os.path.join(g, "whole"))
    vs_cpu["pass"] = vs_cpu.get("worst_grad_rel", 1) < 1e-4 and vs_cpu.get("loss_rel", 1) < 1e-4
    modes = {}
    for k in range(8):
        e = grad_error(os.path.join(g, "whole"), os.path.join(g, "mode%d" % k))
        e["pass"] = e.get("worst_grad_rel", 1) < 1e-5 and e.get("loss_rel", 1) < 1e-5
        modes["mode%d" % k] = e
    name = "" if family == "grads" else "llama_"
    checks[name + "fp32_step_vs_cpu"] = vs_cpu
    checks[name + "fp32_modes_vs_whole"] = modes
packed = grad_error(os.path.join(out_dir, "packed", "cpu"), os.path.join(out_dir, "packed", "gpu"))
packed["pass"] = packed.get("worst_grad_rel", 1) < 1e-4 and packed.get("loss_rel", 1) < 1e-4
checks["packed_vs_cpu"] = packed
def curve_check(ref_name, name):
    cw = curve(os.path.join(out_dir, "parts", ref_name + ".jsonl"))
    cs = curve(os.path.join(out_dir, "parts", name + ".jsonl"))
    dev = max((abs(a - b) / a for a, b in zip(cw, cs)), default=1.0) if cw and len(cw) == len(cs) else 1.0
    return {"steps": len(cw), "max_rel_diff": dev, "pass": dev < 0.01}


for name in ("", "llama_"):
    checks[name + "bf16_curve"] = curve_check("curve_%swhole" % name, "curve_%ssppo" % name)
checks["bf16_weights_host_curve"] = curve_check("curve_weights_device", "curve_weights_host")

# cuDNN's fused attention, bf16: every mode against the whole step through cuDNN, the whole step
# against the own kernels, packed documents against the own kernels (bf16 tolerances: the two
# differ by bf16 roundings of activations, relative 2^-8 each), the curve against fp32.
BF16_GRAD, BF16_LOSS = 5e-2, 2e-3
def bf16_check(ref, got):
    e = grad_error(ref, got)
    e["pass"] = e.get("worst_grad_rel", 1) < BF16_GRAD and e.get("loss_rel", 1) < BF16_LOSS
    return e


cudnn = {}
for family in ("grads", "llama"):
    g = os.path.join(out_dir, "cudnn", family)
    cudnn[family] = {"whole_vs_own": bf16_check(os.path.join(g, "own"), os.path.join(g, "whole"))}
    for k in range(8):
        cudnn[family]["mode%d" % k] = bf16_check(os.path.join(g, "whole"), os.path.join(g, "mode%d" % k))
cudnn["packed_vs_own"] = bf16_check(os.path.join(out_dir, "cudnn", "packed", "own"),
                                    os.path.join(out_dir, "cudnn", "packed", "lib"))
cudnn["bf16_curve_vs_fp32"] = curve_check("cudnn_curve_fp32", "cudnn_curve")
checks["cudnn"] = cudnn

# Several ranks: fp32 against the one-rank run on the same device (relative 1e-5), the fullest
# rank's device peak equal to its prediction; NCCL on one rank; a plan for 2 GPUs stepping.
ranks = {}
for name in ("pp2", "cp2", "tp2", "dp2"):
    ref = os.path.join(out_dir, "ranks", "ref2" if name == "dp2" else "ref")
    e = grad_error(ref, os.path.join(out_dir, "ranks", name))
    try:
        r = json.load(open(os.path.join(out_dir, "ranks", name, "result.json")))
        e["peak_device_bytes"], e["predicted_peak_device_bytes"] = r.get("peak_device_bytes"), r.get(
            "predicted_peak_device_bytes")
    except (OSError, ValueError):
        pass
    e["max_rel_err"] = max(e.get("worst_grad_rel", 1), e.get("loss_rel", 1))
    e["ok"] = e["max_rel_err"] < 1e-5 and e.get("peak_device_bytes") == e.get("predicted_peak_device_bytes")
    ranks[name] = e
tp_bf16 = bf16_check(os.path.join(out_dir, "ranks", "ref_bf16"), os.path.join(out_dir, "ranks", "tp2_bf16"))
tp_bf16["max_rel_err"] = max(tp_bf16.get("worst_grad_rel", 1), tp_bf16.get("loss_rel", 1))
tp_bf16["ok"] = tp_bf16["pass"]
ranks["tp2_bf16"] = tp_bf16
nccl_self = last_json(read(os.path.join(out_dir, "parts", "ranks_nccl_self.json")))
if nccl_self:
    ranks["nccl_self"] = {"tests": nccl_self.get("tests"), "failures": nccl_self.get("failures"),
                          "max_rel_err": 0.0 if nccl_self.get("failures") == 0 else None,
                          "ok": nccl_self.get("failures") == 0}
plan_steps = curve(os.path.join(out_dir, "parts", "ranks_plan.jsonl"))
if not smoke:
    ranks["plan"] = {"steps": len(plan_steps), "ok": len(plan_steps) == 2}
result["ranks"] = ranks
checks["ranks"] = {k: v.get("ok") for k, v in ranks.items()}
checks["ranks"]["pass"] = all(v.get("ok") for v in ranks.values())
rc = {s["section"]: s["rc"] for s in result["sections"]}
checks["budget"] = {"exact_fits": rc.get("budget_exact") == 0, "one_byte_less_refused": rc.get("budget_less") == 3}
checks["budget"]["pass"] = checks["budget"]["exact_fits"] and checks["budget"]["one_byte_less_refused"]
result["checks"] = checks

torch = last_json(read(os.path.join(logs, "torch.out"))) or {}
attn = last_json(read(os.path.join(logs, "attention.out"))) or {}
attn_own = last_json(read(os.path.join(logs, "attention_own.out"))) or {}
tattn = torch.get("attention", {})
if not isinstance(tattn, dict):
    tattn = {}


def ratio(a, b):
    return round(a / b, 3) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def shape_of(bench, kind):
    """The bench's figures for a kind of shape (whole, prefix, chunked), whatever its lengths
    (the smoke run's are short)."""
    for name, v in bench.items():
        if not isinstance(v, dict) or "sppo_tflops" not in v:
            continue
        chunked = name.endswith("_chunked")
        if (kind == "whole" and name.startswith("whole_")) or (kind == "chunked" and chunked) or \
                (kind == "prefix" and name.startswith("prefix_") and not chunked):
            return v
    return {}


result["attention"] = {"kernels": attn.get("attention"), "graphs": attn.get("attention_graphs")}
for k, kind in (("whole_32k", "whole"), ("prefix_16k_after_112k", "prefix"), ("prefix_16k_after_112k_chunked", "chunked")):
    mine = shape_of(attn, kind).get("sppo_tflops")
    theirs = tattn.get("prefix_16k_after_112k" if kind == "chunked" else k)
    result["attention"][k] = {"sppo_tflops": mine, "torch_tflops": theirs,
                              "sppo_own_tflops": shape_of(attn_own, kind).get("sppo_tflops"),
                              "over_torch": ratio(mine, theirs)}
chunked = result["attention"]["prefix_16k_after_112k_chunked"]
chunked["over_one_call"] = ratio(chunked["sppo_tflops"], result["attention"]["prefix_16k_after_112k"]["sppo_tflops"])
if "prefix_16k_after_112k_paths" in tattn:
    result["attention"]["torch_prefix_paths"] = tattn["prefix_16k_after_112k_paths"]
layers = {}
for S in (16384, 65536, 131072):
    j = last_json(read(os.path.join(logs, "layer_%d.out" % S))) or {}
    theirs = torch.get("layer_tokens_per_s", {})
    theirs = theirs.get(str(S)) if isinstance(theirs, dict) else None
    layers[str(S)] = {"sppo_tokens_per_s": j.get("tokens_per_s"), "torch_tokens_per_s": theirs,
                      "attention": j.get("attention"), "over_torch": ratio(j.get("tokens_per_s"), theirs),
                      "outside_attention_gemm_fraction": j.get("outside_attention_gemm_fraction"),
                      "breakdown": j.get("breakdown"), "torch_breakdown": torch.get("layer_breakdown_%d" % S)}
result["layer"] = layers
off = last_json(read(os.path.join(logs, "offload.out"))) or {}
result["offload"] = {"adaptive_over_none": off.get("adaptive_over_none_step_time")}
sim = last_json(read(os.path.join(logs, "sim.out"))) or {}
if sim.get("configs"):
    # The issue's bar for one GPU: step time within 10%, peak memory within 2%.
    checks["sim_vs_measured"] = {"configs": sim["configs"], "worst_step_time_error": sim["worst_step_time_error"],
                                 "worst_peak_error": sim["worst_peak_error"],
                                 "pass": sim["worst_step_time_error"] <= 0.10 and sim["worst_peak_error"] <= 0.02}
mem = last_json(read(os.path.join(logs, "memory.out"))) or {}
tmem = torch.get("memory", {})
speedup = None
if mem.get("step_time_at_seq_s") and tmem.get("torch_ckpt_step_s"):
    speedup = tmem["torch_ckpt_step_s"] / mem["step_time_at_seq_s"]
result["memory"] = {"sppo_max_seq": mem.get("longest_seq"), "torch_ckpt_max_seq": tmem.get("torch_ckpt_max_seq"),
                    "speedup_at_torch_max": speedup}
result["torch"] = torch

with open(os.path.join(out_dir, "check.json"), "w") as f:
    json.dump(result, f, indent=1)
def verdict(v):
    if isinstance(v, dict) and "pass" in v:
        return v["pass"]
    if isinstance(v, dict):  # the modes: each one's verdict
        return {k: verdict(x) for k, x in v.items()}
    return v


print(json.dumps({"checks": {k: verdict(v) for k, v in checks.items()}}))
