"""PyTorch 2.x on the CPU, one GPT block forward + backward: the peer of
`sppo bench layer --hidden H --heads Z --seq-len S`.

The block is the one src/model/gpt.cpp runs, in fp32, batch 1:
    x_mid = x + out(attn(rope(qkv(LN1(x)))))       qkv, out: Linear with bias
    y     = x_mid + proj(gelu_tanh(fc(LN2(x_mid))))  fc: H -> 4H, proj: 4H -> H
LayerNorm eps 1e-5; RoPE on q and k (theta 10000, the two halves of each head rotated
together); causal attention through F.scaled_dot_product_attention pinned to its flash
kernel (PyTorch's CPU flash attention: no S x S tensor). Timed as `bench layer` times
it: the forward, then the backward of a random gradient from above into the parameters'
gradients (accumulated, +=) and x's; median of --reps after one warm-up.

    bash bench/peers/setup.sh            # once: bench/peers/.venv with torch 2.x
    bench/peers/.venv/bin/python bench/peers/torch_block.py --seq-len 4K [--profile] [--json]

With --json, stdout is one JSON object and the readable line goes to stderr. --profile
runs one more step under torch.profiler and reports where its time goes: attention
forward, attention backward, GEMMs, other (self CPU time of each op on the calling
threads), as a table and in the JSON's "breakdown".
"""
import argparse
import json
import os
import resource
import sys
import time

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's CUDA probing is noise on a CPU
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

LN_EPS = 1e-5
ROPE_THETA = 10000.0


def tokens(text):
    """4096, 4K, 16k, 1M -> an int (K = 1024, M = 1024 * 1024)."""
    t = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20}.get(t[-1:], 1)
    digits = t[:-1] if scale > 1 else t
    try:
        n = int(digits) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count (try 4096, 4K or 16K)")
    if n < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 2 tokens")
    return n


class Block(torch.nn.Module):
    def __init__(self, hidden, heads, seq_len):
        super().__init__()
        H, Z = hidden, heads
        self.Z, self.A = Z, H // Z
        self.ln1, self.ln2 = torch.nn.LayerNorm(H, eps=LN_EPS), torch.nn.LayerNorm(H, eps=LN_EPS)
        self.qkv, self.out = torch.nn.Linear(H, 3 * H), torch.nn.Linear(H, H)
        self.fc, self.proj = torch.nn.Linear(H, 4 * H), torch.nn.Linear(4 * H, H)
        for m in (self.qkv, self.out, self.fc, self.proj):  # as bench layer draws them
            torch.nn.init.normal_(m.weight, std=0.02)
            torch.nn.init.normal_(m.bias, std=0.02)
        # RoPE tables [S, A/2], made once (sppo makes its angles inside the kernel).
        half = self.A // 2
        inv_freq = ROPE_THETA ** (-2.0 * torch.arange(half, dtype=torch.float64) / self.A)
        angle = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", angle.cos().float(), persistent=False)
        self.register_buffer("sin", angle.sin().float(), persistent=False)

    def rope(self, t):  # t: [1, Z, S, A]; lo, hi = the head's two halves
        lo, hi = t.chunk(2, dim=-1)
        c, s = self.cos[: t.shape[2]], self.sin[: t.shape[2]]
        return torch.cat((lo * c - hi * s, hi * c + lo * s), dim=-1)

    def forward(self, x):  # x: [1, S, H]
        S, H = x.shape[1], x.shape[2]
        q, k, v = self.qkv(self.ln1(x)).view(1, S, 3, self.Z, self.A).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(1, S, H))
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


# Which profiler rows are which part of the block, by the op's name.
ATTENTION_BACKWARD = ("flash_attention_backward", "scaled_dot_product_flash_attention_for_cpu_backward",
                      "scaled_dot_product_attention_backward")
ATTENTION_FORWARD = ("flash_attention", "scaled_dot_product")
GEMM = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear")


def part_of(name):
    n = name.lower()
    if any(k in n for k in ATTENTION_BACKWARD):
        return "attention_backward"
    if any(k in n for k in ATTENTION_FORWARD):
        return "attention_forward"
    if any(n == k or n.startswith(k + "_") for k in GEMM):
        return "gemm"
    return "other"


def profile_step(step):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step()
        wall = time.perf_counter() - t0
    rows = prof.key_averages()
    parts = {"attention_forward": 0.0, "attention_backward": 0.0, "gemm": 0.0, "other": 0.0}
    for r in rows:
        parts[part_of(r.key)] += r.self_cpu_time_total / 1e6
    # Self times of ops that ran on the calling threads; what is left of the wall time is
    # the Python and autograd engine around them.
    breakdown = {k + "_s": v for k, v in parts.items()}
    breakdown["profiled_step_s"] = wall
    table = rows.table(sort_by="self_cpu_time_total", row_limit=20)
    return breakdown, table


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=tokens, default=4096, help="S: 4096, 4K, 16K (default 4K)")
    ap.add_argument("--hidden", type=int, default=1024, help="H (default 1024)")
    ap.add_argument("--heads", type=int, default=16, help="Z (default 16)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="intra-op threads (default: every core this process may run on)")
    ap.add_argument("--reps", type=int, default=3, help="timed steps after one warm-up; the median counts")
    ap.add_argument("--json", action="store_true", help="stdout: one JSON object")
    ap.add_argument("--profile", action="store_true", help="one more step under torch.profiler: where the time goes")
    a = ap.parse_args()
    if a.hidden % a.heads or (a.hidden // a.heads) % 2:
        ap.error(f"--hidden {a.hidden} must be --heads {a.heads} times an even head size")
    if a.reps < 1 or a.threads < 1:
        ap.error("--reps and --threads must be at least 1")

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    S, H = a.seq_len, a.hidden
    block = Block(H, a.heads, S)
    x = torch.randn(1, S, H, requires_grad=True)
    dy = torch.randn(1, S, H)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def step():
        x.grad = None  # x's gradient is written (=); the parameters' accumulate (+=)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            y = block(x)
        y.backward(dy)

    step()  # warm-up: allocations, thread pool, the parameters' gradients
    times = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    t = sorted(times)[len(times) // 2]
    # The FLOP count bench layer uses: 24 S H^2 for the four linear layers and 4 S H (S+1)/2
    # for causal attention, forward; forward + backward is three times that.
    model_flops = 3.0 * (24.0 * S * H * H + 4.0 * S * H * (S + 1) / 2.0)
    out = {"peer": "pytorch", "torch": torch.__version__, "device": "cpu", "precision": "fp32",
           "attention": "scaled_dot_product_attention (flash, causal)",
           "threads": torch.get_num_threads(), "seq_len": S, "hidden": H, "heads": a.heads, "reps": a.reps,
           "step_time_s": t, "step_times_s": times, "tokens_per_s": S / t, "model_flops": model_flops,
           "model_flops_per_s": model_flops / t, "rss_before_block_bytes": rss_before}
    table = None
    if a.profile:
        out["breakdown"], table = profile_step(step)
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    line = (f"torch {torch.__version__} cpu, {out['threads']} threads: one block, S {S}, H {H}, Z {a.heads}: "
            f"{t:.3f} s per forward + backward, {S / t:.0f} tokens/s, {model_flops / t / 1e9:.1f} GFLOP/s, "
            f"peak RSS {out['peak_rss_bytes'] / 2**30:.2f} GiB")
    if a.profile:
        b = out["breakdown"]
        line += "\n  profiled step {:.3f} s: attention forward {:.3f} s, attention backward {:.3f} s, " \
                "GEMMs {:.3f} s, other {:.3f} s".format(b["profiled_step_s"], b["attention_forward_s"],
                                                        b["attention_backward_s"], b["gemm_s"], b["other_s"])
    if a.json:
        print(json.dumps(out))
        print(line, file=sys.stderr)
    else:
        if table:
            print(table)
        print(line)


if __name__ == "__main__":
    main()
