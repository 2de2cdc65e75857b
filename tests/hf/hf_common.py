"""What the checks against transformers share: running sppo, small random models."""
import subprocess

import torch


def run_sppo(sppo, *args, expect=0):
    """`sppo ARGS`, which must exit `expect` (else the check ends, showing its output)."""
    r = subprocess.run([sppo, *args], capture_output=True, text=True)
    if r.returncode != expect:
        raise SystemExit(f"sppo {' '.join(args)}: exit {r.returncode}, expected {expect}\n{r.stdout}{r.stderr}")
    return r


def base_config(**kw):
    """A small Llama-family config in fp32 (grouped-query attention), with `kw` over it."""
    c = dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, rope_theta=500.0, rms_norm_eps=1e-5,
             tie_word_embeddings=False, torch_dtype="float32")
    c.update(kw)
    return c


def randomize(model, seed):
    """Weights at unit scale (HF's 0.02 init leaves losses near log V and gradients tiny), norms and biases
    off 1 and 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
