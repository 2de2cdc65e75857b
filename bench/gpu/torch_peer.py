"""PyTorch's figures for the patterns bench/gpu/check.sh measures, in the same device call,
printed as one JSON object: SDPA (whole causal S 32K; 16K queries after a 112K prefix, by
PyTorch's faster path for it), one
bf16 GPT block (H 4096, 32 heads) at 16K / 64K / 128K (at 16K also its step split by
torch.profiler's kernel times, as sppo's `bench layer --breakdown`), and an 8-layer stack of those blocks
with activation checkpointing: its longest sequence on this GPU and its step time there
(with --memory; that step alone takes minutes).
FLOP counts as in shared/peers/h200/anchors.py: attention fwd 4 S^2 d Z / 2 (causal),
fwd+bwd 3.5x fwd."""
import json, sys, time
import torch, torch.nn.functional as F, torch.utils.checkpoint

dev = "cuda"
out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}


def timed(fn, iters=5, warmup=2):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / iters


def sdpa(q_len, k_len, path="mask"):
    """fwd+bwd TFLOP/s. q_len < k_len is bottom-right causal (query i sees keys [0, k_len - q_len
    + i]), by one of PyTorch's two paths: "mask", a boolean mask (its efficient/math kernels),
    or "lower_right", torch.nn.attention.bias.causal_lower_right (its flash/cuDNN kernels)."""
    Z, d = 32, 128
    q = torch.randn(1, Z, q_len, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, Z, k_len, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, Z, k_len, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    if q_len == k_len:
        f = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        flops = 4 * q_len * k_len * d * Z / 2
    else:
        if path == "lower_right":
            from torch.nn.attention.bias import causal_lower_right
            mask = causal_lower_right(q_len, k_len)
        else:
            mask = torch.ones(q_len, k_len, device=dev, dtype=torch.bool).tril(k_len - q_len)
        f = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        flops = 4 * d * Z * (q_len * (k_len - q_len) + q_len * (q_len + 1) / 2)
    g = torch.randn_like(f())
    t = timed(lambda: f().backward(g))
    return round(3.5 * flops / t / 1e12, 1)


def attention():
    """The whole causal 32K, and 16K queries after a 112K prefix by PyTorch's best path (the
    faster of a boolean mask and causal_lower_right, both recorded)."""
    paths = {}
    for path in ("mask", "lower_right"):
        try:
            paths[path] = sdpa(16384, 131072, path)
        except Exception as e:  # a path this PyTorch lacks
            paths[path] = {"error": repr(e)[:200]}
        torch.cuda.empty_cache()
    rates = [r for r in paths.values() if isinstance(r, float)]
    return {"whole_32k": sdpa(32768, 32768), "prefix_16k_after_112k": max(rates) if rates else None,
            "prefix_16k_after_112k_paths": paths}


class Block(torch.nn.Module):
    def __init__(self, H, Z):
        super().__init__()
        self.Z = Z
        self.ln1 = torch.nn.LayerNorm(H); self.qkv = torch.nn.Linear(H, 3 * H); self.out = torch.nn.Linear(H, H)
        self.ln2 = torch.nn.LayerNorm(H); self.fc = torch.nn.Linear(H, 4 * H); self.proj = torch.nn.Linear(4 * H, H)

    def forward(self, x):
        S, H = x.shape[1], x.shape[2]
        q, k, v = self.qkv(self.ln1(x)).view(1, S, 3, self.Z, H // self.Z).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(1, S, H))
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


def stack_step(blocks, S, ckpt, iters=2, warmup=1):
    x = torch.randn(1, S, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def step():
        y = x
        for b in blocks:
            y = torch.utils.checkpoint.checkpoint(b, y, use_reentrant=False) if ckpt else b(y)
        y.float().sum().backward()

    return timed(step, iters=iters, warmup=warmup)


def section(name, f):
    t0 = time.time()
    try:
        out[name] = f()
    except Exception as e:  # one failure does not end the others
        out[name] = {"error": repr(e)[:300]}
    out[name + "_wall_s"] = round(time.time() - t0, 1)
    torch.cuda.empty_cache()


section("attention", attention)


def layer():
    blk = Block(4096, 32).to(dev, torch.bfloat16)
    return {str(S): round(S / stack_step([blk], S, False, iters=3)) for S in (16384, 65536, 131072)}


section("layer_tokens_per_s", layer)


def kernel_part(name):
    """Which part of sppo's `bench layer --breakdown` a CUDA kernel of PyTorch's belongs to, by
    its name: attention (flash, cuDNN's SDPA, the memory-efficient kernels) forward or backward,
    GEMMs (cuBLAS, cuBLASLt, CUTLASS), or other."""
    n = name.lower()
    if any(k in n for k in ("flash", "fmha", "sdpa", "attention", "attn")):
        return "attention_backward_s" if any(k in n for k in ("bwd", "backward", "dq", "dkdv")) \
            else "attention_forward_s"
    if any(k in n for k in ("gemm", "cutlass", "nvjet", "xmma", "cublas")):
        return "gemm_s"
    return "other_s"


def layer_breakdown(S=16384):
    """The block's step at S split as sppo's --breakdown: torch.profiler's CUDA kernel times by
    part, and what the step's time (measured apart, unprofiled) leaves between them."""
    from torch.profiler import profile, ProfilerActivity
    blk = Block(4096, 32).to(dev, torch.bfloat16)
    step_s = stack_step([blk], S, False, iters=3)
    x = torch.randn(1, S, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
    blk(x).float().sum().backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        blk(x).float().sum().backward()
        torch.cuda.synchronize()
    parts = {"attention_forward_s": 0.0, "attention_backward_s": 0.0, "gemm_s": 0.0, "other_s": 0.0}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            parts[kernel_part(e.name)] += e.time_range.elapsed_us() * 1e-6
    kernels = sum(parts.values())
    parts = {k: round(v, 6) for k, v in parts.items()}
    parts.update(step_s=round(step_s, 6), between_s=round(max(0.0, step_s - kernels), 6),
                 outside_attention_gemm_fraction=round(
                     (step_s - parts["attention_forward_s"] - parts["attention_backward_s"] - parts["gemm_s"])
                     / step_s, 4))
    return parts


section("layer_breakdown_16384", layer_breakdown)


def memory():
    # The longest sequence the 8-layer stack trains with checkpointing, from its memory per
    # token at 32K and 64K (linear in S with flash attention), checked by one step there
    # (32K steps down on running out), and that step's time.
    blocks = [Block(4096, 32).to(dev, torch.bfloat16) for _ in range(8)]
    peak = {}
    for S in (32768, 65536):
        torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
        stack_step(blocks, S, True, iters=1)
        peak[S] = torch.cuda.max_memory_allocated()
    per_token = (peak[65536] - peak[32768]) / 32768
    fixed = peak[32768] - per_token * 32768
    total = torch.cuda.get_device_properties(0).total_memory
    S = int((0.97 * total - fixed) / per_token) // 32768 * 32768
    for _ in range(4):
        try:
            torch.cuda.empty_cache()
            return {"torch_ckpt_max_seq": S, "torch_ckpt_step_s": stack_step(blocks, S, True, iters=1, warmup=0),
                    "torch_ckpt_bytes_per_token": round(per_token)}
        except torch.OutOfMemoryError:
            S -= 32768
    return {"error": "no length near the estimate fits", "estimate": S}


if "--memory" in sys.argv:  # minutes on an H200: the check step at the longest length is long
    section("memory", memory)
print(json.dumps(out))
