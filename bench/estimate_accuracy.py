"""How close is `memd estimate transformer` to the peak memory of real training steps?

Each configuration runs in a fresh child process (python bench/estimate_accuracy.py --child ...)
that trains a GPT-2-style model (nanoGPT layout: tied embeddings, pre-LayerNorm blocks, SDPA
attention, GELU MLP, no dropout) with AdamW on the CPU for a few steps.

Measurement (CPU): the child builds the model and the optimizer, runs one warm-up step on a tiny
batch of the same model (so kernels, thread pools and the optimizer's states exist), lets go of
it, reads VmRSS as the baseline, resets the kernel's high-water mark (writing 5 to
/proc/self/clear_refs) and runs the measured steps; the peak is VmHWM - baseline + the bytes of
the weights and optimizer states (which the baseline already holds). glibc's malloc is pinned to
M_MMAP_THRESHOLD=64 KiB (MALLOC_MMAP_THRESHOLD_), so every tensor of 64 KiB or more gets its own
mapping and is returned to the kernel when freed: the resident high-water mark then follows the
bytes of live tensors (as CUDA's max_memory_allocated does), not glibc's heap fragmentation.
`--allocator default` measures with glibc's adaptive threshold instead, for comparison.

Usage: python bench/estimate_accuracy.py [--steps 3] [--allocator pinned|default] [--precision fp32|mixed]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "client")]

# (layers, d_model, heads, vocab, positions, seq_len, batch)
CONFIGS = [
    (2, 128, 4, 8192, 256, 256, 8),
    (4, 256, 4, 8192, 512, 512, 4),
    (4, 256, 8, 16384, 256, 256, 16),
    (6, 384, 6, 50257, 512, 256, 4),
    (8, 256, 8, 4096, 1024, 1024, 4),
    (2, 512, 8, 32000, 512, 512, 2),
    (6, 192, 6, 4096, 512, 512, 16),
    (12, 256, 4, 50257, 128, 128, 2),
    (4, 512, 8, 50257, 64, 64, 1),  # little activation: gradients and the optimizer step dominate
    (2, 768, 12, 32000, 128, 32, 2),
]


def child(args: argparse.Namespace) -> None:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.ln_1 = nn.LayerNorm(d)
            self.c_attn = nn.Linear(d, 3 * d)
            self.c_proj = nn.Linear(d, d)
            self.ln_2 = nn.LayerNorm(d)
            self.c_fc = nn.Linear(d, 4 * d)
            self.mlp_proj = nn.Linear(4 * d, d)

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
            q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, s, d))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))

    class GPT(nn.Module):
        def __init__(self, layers, d, heads, vocab, positions):
            super().__init__()
            self.wte = nn.Embedding(vocab, d)
            self.wpe = nn.Embedding(positions, d)
            self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)
            self.lm_head = nn.Linear(d, vocab, bias=False)
            self.lm_head.weight = self.wte.weight  # tied, as GPT-2

        def forward(self, idx, targets):
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for block in self.h:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    layers, d, heads, vocab, positions, seq, batch = args.config
    torch.manual_seed(0)
    model = GPT(layers, d, heads, vocab, positions)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    autocast = args.precision == "mixed"

    def step(b):
        idx = torch.randint(vocab, (b, seq))
        tgt = torch.randint(vocab, (b, seq))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits, loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del logits, loss

    step(1)  # warm-up: kernels, thread pools, optimizer states
    numel = sum(p.numel() for p in model.parameters())
    held = numel * 4 * 3  # weights + exp_avg + exp_avg_sq, all fp32, inside the baseline
    baseline = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    started = time.perf_counter()
    for _ in range(args.steps):
        step(batch)
    peak = _status("VmHWM") - baseline + held
    print(json.dumps({"params": numel, "peak_bytes": peak, "baseline_bytes": baseline,
                      "step_seconds": (time.perf_counter() - started) / args.steps}))


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def measure(config, steps: int, precision: str, allocator: str, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if allocator == "pinned":
        env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--steps", str(steps), "--precision", precision,
           "--config"] + [str(v) for v in config]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", type=int, nargs=7, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3, help="measured training steps per configuration")
    parser.add_argument("--precision", choices=("fp32", "mixed"), default="fp32",
                        help="fp32, or mixed: bf16 autocast over fp32 parameters")
    parser.add_argument("--allocator", choices=("pinned", "default"), default="pinned",
                        help="pin glibc's mmap threshold (live-tensor peak) or leave glibc adaptive")
    parser.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    from memd.policy.estimate import transformer

    import torch
    print("machine: %s, %d CPUs, Python %s, torch %s, allocator %s, precision %s, %d steps" % (
        platform.processor() or platform.machine(), os.cpu_count(), platform.python_version(), torch.__version__,
        args.allocator, args.precision, args.steps))
    header = "%-34s %11s %9s %9s %7s %-18s" % ("layers/d/heads/vocab/pos/seq/batch", "params", "meas MB",
                                                "est MB", "err", "estimated peak at")
    print(header)
    print("-" * len(header))
    rows, errors = [], []
    for config in CONFIGS:
        layers, d, heads, vocab, positions, seq, batch = config
        got = measure(config, args.steps, args.precision, args.allocator, args.threads)
        est = transformer(layers=layers, d_model=d, heads=heads, vocab=vocab, positions=positions, seq_len=seq,
                          batch=batch, precision=args.precision, device="cpu")
        assert est.params == got["params"], (est.params, got["params"])
        err = (est.peak_bytes - got["peak_bytes"]) / got["peak_bytes"]
        errors.append(abs(err))
        rows.append(dict(config=config, params=est.params, measured_bytes=got["peak_bytes"],
                         estimated_bytes=est.peak_bytes, relative_error=err, phase=est.peak_phase))
        print("%-34s %11d %9.1f %9.1f %+6.1f%% %-18s" % ("/".join(map(str, config)), est.params,
                                                         got["peak_bytes"] / 1e6, est.peak_bytes / 1e6, err * 100,
                                                         est.peak_phase))
    print("median |relative error|: %.1f%% (max %.1f%%) over %d configurations" % (
        statistics.median(errors) * 100, max(errors) * 100, len(errors)))
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
