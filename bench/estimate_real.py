"""`memd estimate` against what a user measures, beside the estimators a user would reach for.

Each case runs in a FRESH child process (this script with --child): it imports torch (and
`transformers`), resets the kernel's resident high-water mark (5 > /proc/self/clear_refs), reads
VmRSS as the baseline, then builds the model from a config (no download, default attention
implementation, train mode with the config's dropout), makes the optimizer and runs two
training steps (forward with the loss, backward, optimizer step, zero_grad), and reads VmHWM
at the end of the second optimizer step. Measured = VmHWM - baseline: the growth of the whole
process's peak from before the model exists, glibc's default allocator, torch's default threads.
Nothing from the estimator enters that column.

Model classes: GPT2LMHeadModel, LlamaForCausalLM, BertForMaskedLM (15 % of tokens labelled),
ViTForImageClassification (224 px images), and the nanoGPT layout (tied embeddings, SDPA);
fp32 or mixed precision (CPU autocast to bf16); AdamW or SGD with momentum 0.9.

Peers, on the same rows: accelerate's `estimate-memory` "Training using Adam" figure (its own
estimate_training_usage on the model's parameter bytes, which is what the CLI prints; the CLI
itself needs the Hub), and DeepSpeed's ZeRO-2 and ZeRO-3 model-state estimators (one GPU, no
offload) when `deepspeed` imports.

Rows marked "tune" set the estimator's measured constants; "held" rows were never used to set
anything: the verdict (median and max |error|) is over them.

Usage: python bench/estimate_real.py [--only ID ...] [--out docs/results/estimate]
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

GPT2 = dict(vocab_size=50257, n_positions=1024)
LLAMA = dict(vocab_size=32000, max_position_embeddings=2048)
BERT = dict(vocab_size=30522, max_position_embeddings=512)
VIT = dict(image_size=224, patch_size=16, num_labels=1000)


def _case(cid, split, family, config, batch, seq, precision="fp32", optimizer="adamw"):
    return dict(id=cid, split=split, family=family, config=config, batch=batch, seq=seq, precision=precision,
                optimizer=optimizer)


def _gpt2(layers, h, heads):
    return dict(GPT2, n_layer=layers, n_embd=h, n_head=heads)


def _llama(layers, h, heads, kv, inter):
    return dict(LLAMA, num_hidden_layers=layers, hidden_size=h, num_attention_heads=heads,
                num_key_value_heads=kv, intermediate_size=inter)


def _bert(layers, h, heads):
    return dict(BERT, num_hidden_layers=layers, hidden_size=h, num_attention_heads=heads, intermediate_size=4 * h)


def _vit(layers, h, heads):
    return dict(VIT, num_hidden_layers=layers, hidden_size=h, num_attention_heads=heads, intermediate_size=4 * h)


def _nano(layers, h, heads):
    return dict(n_layer=layers, n_embd=h, n_head=heads, vocab_size=50304, block_size=1024)


# seq is tokens per sample (for ViT, ignored: 224 px / 16 px patches = 197 tokens)
CASES = [
    # tuning rows: these set the constants of memd/policy/estimate.py (docs/results.md says which)
    _case("t-gpt2-a", "tune", "gpt2", _gpt2(4, 256, 4), 8, 256),
    _case("t-gpt2-b", "tune", "gpt2", _gpt2(6, 512, 8), 4, 128, "mixed"),
    _case("t-llama-a", "tune", "llama", _llama(4, 512, 8, 4, 1376), 4, 256),
    _case("t-llama-b", "tune", "llama", _llama(2, 256, 4, 4, 688), 8, 512, "mixed", "sgd-momentum"),
    _case("t-bert-a", "tune", "bert", _bert(4, 512, 8), 8, 128),
    _case("t-bert-b", "tune", "bert", _bert(8, 768, 12), 4, 128),
    _case("t-vit-a", "tune", "vit", _vit(6, 384, 6), 8, 197),
    _case("t-vit-b", "tune", "vit", _vit(8, 512, 8), 16, 197, "mixed"),
    _case("t-nano-a", "tune", "nanogpt", _nano(6, 384, 6), 8, 256),
    _case("t-nano-b", "tune", "nanogpt", _nano(4, 512, 8), 2, 64, "fp32", "sgd-momentum"),
    # held-out rows: never used to set anything
    _case("gpt2-124m", "held", "gpt2", _gpt2(12, 768, 12), 2, 128),
    _case("gpt2-45m-mixed", "held", "gpt2", _gpt2(6, 512, 8), 8, 256, "mixed"),
    _case("gpt2-16m-sgd", "held", "gpt2", _gpt2(4, 256, 4), 16, 128, "fp32", "sgd-momentum"),
    _case("llama-106m", "held", "llama", _llama(8, 768, 12, 12, 2048), 2, 256),
    _case("llama-42m-mixed", "held", "llama", _llama(4, 512, 8, 4, 1376), 8, 512, "mixed"),
    _case("llama-18m-sgd", "held", "llama", _llama(2, 256, 4, 2, 688), 16, 256, "fp32", "sgd-momentum"),
    _case("bert-110m", "held", "bert", _bert(12, 768, 12), 4, 128),
    _case("bert-29m-mixed", "held", "bert", _bert(4, 512, 8), 16, 256, "mixed"),
    _case("bert-22m-sgd", "held", "bert", _bert(6, 384, 6), 16, 128, "fp32", "sgd-momentum"),
    _case("vit-86m", "held", "vit", _vit(12, 768, 12), 4, 197),
    _case("vit-22m-mixed", "held", "vit", _vit(12, 384, 6), 16, 197, "mixed"),
    _case("vit-22m-sgd", "held", "vit", _vit(12, 384, 6), 8, 197, "fp32", "sgd-momentum"),
    _case("nano-51m", "held", "nanogpt", _nano(8, 512, 8), 4, 256),
    _case("nano-30m-mixed", "held", "nanogpt", _nano(6, 384, 6), 16, 256, "mixed"),
    _case("nano-30m-sgd", "held", "nanogpt", _nano(6, 384, 6), 8, 512, "fp32", "sgd-momentum"),
]


# -- the child: one case, one fresh process ------------------------------------------------

def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _nanogpt(cfg):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

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
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(positions, d)
            self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)
            self.lm_head = nn.Linear(d, vocab, bias=False)
            self.lm_head.weight = self.wte.weight

        def forward(self, idx, labels):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for block in self.h:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))

    return GPT(cfg["n_layer"], cfg["n_embd"], cfg["n_head"], cfg["vocab_size"], cfg["block_size"])


def child(case: dict) -> None:
    import torch
    if case["family"] != "nanogpt":
        import transformers
        from transformers import logging as hf_logging
        hf_logging.set_verbosity_error()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark restarts from the current RSS
    baseline = _status("VmRSS")
    torch.manual_seed(0)
    family, cfg, b, s = case["family"], case["config"], case["batch"], case["seq"]
    config_dict = None
    if family == "nanogpt":
        model = _nanogpt(cfg)
    else:
        cls = {"gpt2": ("GPT2Config", "GPT2LMHeadModel"), "llama": ("LlamaConfig", "LlamaForCausalLM"),
               "bert": ("BertConfig", "BertForMaskedLM"), "vit": ("ViTConfig", "ViTForImageClassification")}[family]
        config = getattr(transformers, cls[0])(**cfg)
        model = getattr(transformers, cls[1])(config)
        config_dict = config.to_dict()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    if case["optimizer"] == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-4)
    else:
        opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    vocab = cfg.get("vocab_size", 0)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case["precision"] == "mixed"):
            if family == "vit":
                out = model(pixel_values=torch.randn(b, 3, 224, 224), labels=torch.randint(cfg["num_labels"], (b,)))
                loss = out.loss
            elif family == "nanogpt":
                ids = torch.randint(vocab, (b, s))
                _, loss = model(ids, torch.randint(vocab, (b, s)))
            elif family == "bert":
                ids = torch.randint(vocab, (b, s))
                labels = torch.where(torch.rand(b, s) < 0.15, ids, torch.full_like(ids, -100))
                loss = model(input_ids=ids, labels=labels).loss
            else:
                ids = torch.randint(vocab, (b, s))
                loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    started = time.perf_counter()
    losses = [step(), step()]
    seconds = time.perf_counter() - started
    peak = _status("VmHWM") - baseline  # read first: nothing below enters the measurement
    numel = sum(p.numel() for p in model.parameters())
    hf_count = model.num_parameters() if family != "nanogpt" else numel
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"params": numel, "hf_num_parameters": hf_count, "param_bytes": param_bytes,
                      "peak_bytes": peak, "baseline_bytes": baseline, "seconds": seconds, "losses": losses,
                      "config": config_dict, "torch": torch.__version__,
                      "transformers": None if family == "nanogpt" else transformers.__version__}))


# -- the parent: run every case, compare ---------------------------------------------------

def measure(case: dict) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(case)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc defaults
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit("case %s failed:\n%s" % (case["id"], out.stderr[-3000:]))
    return json.loads(out.stdout.strip().splitlines()[-1])


def memd_estimate(case: dict, got: dict):
    """The estimate as `memd estimate transformer --model-config config.json --device cpu` gives it."""
    from memd.policy import archs
    from memd.policy import estimate as est
    config = got["config"] or dict(case["config"], model_type="nanogpt")
    arch = archs.from_config(config, "bench case " + case["id"])
    seq = case["seq"] if case["family"] != "vit" else None
    return est.training_peak(arch, seq_len=seq, batch=case["batch"], precision=case["precision"],
                             optimizer=case["optimizer"], device="cpu")


def accelerate_estimate(case: dict, got: dict) -> int:
    """What `accelerate estimate-memory` prints as "Training using Adam" for the row's dtype:
    max of its model/gradients/optimizer/step sizes (weights x 4 in fp32, x 2 in bf16 mixed)."""
    from accelerate.commands.estimate import estimate_training_usage
    sizes = estimate_training_usage(got["param_bytes"], "float32" if case["precision"] == "fp32" else "bfloat16")
    return int(max(sizes.values()))


def deepspeed_estimates(got: dict):
    """DeepSpeed's ZeRO-2 and ZeRO-3 model-state estimates for one GPU, no offload (GPU bytes)."""
    try:
        import contextlib
        import io
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
            from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available", said in the output
        return None, None, "%s: %s" % (type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
    p = got["params"]
    z2 = estimate_zero2_model_states_mem_needs(p, num_gpus_per_node=1, num_nodes=1, cpu_offload=False)[1]
    # ZeRO-3 also needs the largest layer's parameters; the token embedding is the largest here
    largest = max(got["largest_layer_params"], 1)
    z3 = estimate_zero3_model_states_mem_needs(p, largest, num_gpus_per_node=1, num_nodes=1,
                                               cpu_offload=False)[1]
    return int(z2), int(z3), None


def _largest_layer(case: dict, got: dict) -> int:
    c = case["config"]
    if case["family"] == "vit":
        h = c["hidden_size"]
        return max(h * c.get("intermediate_size", 4 * h), h * c["num_labels"])
    h = c.get("hidden_size", c.get("n_embd"))
    return c["vocab_size"] * h


def _err(est_bytes, meas):
    return None if est_bytes is None else (est_bytes - meas) / meas


def _stats(errs):
    errs = [e for e in errs if e is not None]
    if not errs:
        return None
    return {"median_abs": statistics.median(abs(e) for e in errs), "max_abs": max(abs(e) for e in errs),
            "median": statistics.median(errs), "n": len(errs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="*", help="case ids to run (default: all)")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "estimate"),
                        help="folder for estimate_real.json and estimate_real.md")
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    import torch
    import transformers
    cases = [c for c in CASES if not args.only or c["id"] in args.only]
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.strip())
    machine = "%s, %d CPUs, Python %s, torch %s, transformers %s, glibc malloc defaults" % (
        platform.machine(), os.cpu_count() or 0, platform.python_version(), torch.__version__,
        transformers.__version__)
    print("machine: " + machine)
    rows = []
    ds_note = None
    started = time.time()
    for case in cases:
        got = measure(case)
        got["largest_layer_params"] = _largest_layer(case, got)
        e = memd_estimate(case, got)
        acc = accelerate_estimate(case, got)
        z2, z3, ds_note = deepspeed_estimates(got)
        meas = got["peak_bytes"]
        row = dict(case, params=got["params"], hf_num_parameters=got["hf_num_parameters"],
                   estimated_params=e.params, measured_bytes=meas, memd_bytes=e.peak_bytes, memd_phase=e.peak_phase,
                   memd_parts=e.parts(), accelerate_bytes=acc, deepspeed_zero2_bytes=z2,
                   deepspeed_zero3_bytes=z3, memd_error=_err(e.peak_bytes, meas),
                   accelerate_error=_err(acc, meas), deepspeed_zero2_error=_err(z2, meas),
                   deepspeed_zero3_error=_err(z3, meas), seconds=got["seconds"])
        rows.append(row)
        print("%-16s %-4s %6.1fM %-5s %-5s b%-3d s%-4d meas %7.1f MiB  memd %7.1f (%+5.1f%%)  accel %7.1f (%+5.1f%%)%s"
              % (case["id"], case["split"], got["params"] / 1e6, case["precision"], case["optimizer"], case["batch"],
                 case["seq"], meas / 2**20, e.peak_bytes / 2**20, row["memd_error"] * 100, acc / 2**20,
                 row["accelerate_error"] * 100,
                 "" if z2 is None else "  zero2 %+5.1f%%" % (row["deepspeed_zero2_error"] * 100)),
              flush=True)
    summary = {}
    for split in ("held", "tune"):
        part = [r for r in rows if r["split"] == split]
        summary[split] = {name: _stats([r[name + "_error"] for r in part])
                          for name in ("memd", "accelerate", "deepspeed_zero2", "deepspeed_zero3")}
    doc = {"command": "python bench/estimate_real.py", "commit": commit + ("-dirty" if dirty else ""),
           "machine": machine, "date": time.strftime("%Y-%m-%d", time.gmtime()), "seconds": time.time() - started,
           "deepspeed": ds_note or "imported", "rows": rows, "summary": summary}
    if not args.only:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "estimate_real.json"), "w") as f:
            json.dump(doc, f, indent=1)
        with open(os.path.join(args.out, "estimate_real.md"), "w") as f:
            f.write(markdown(doc))
    print(markdown(doc))


def markdown(doc: dict) -> str:
    def pct(v):
        return "n/a" if v is None else "%+.1f %%" % (v * 100)

    def mib(v):
        return "n/a" if v is None else "%.0f" % (v / 2**20)

    lines = ["`%s` at %s, %s, %s." % (doc["command"], doc["commit"], doc["date"], doc["machine"]),
             "DeepSpeed: %s." % doc["deepspeed"], "",
             "| case | set | model | params | prec | optim | batch x seq | measured MiB | memd MiB | memd err "
             "| accelerate MiB | accel err | ZeRO-2 err | ZeRO-3 err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append("| %s | %s | %s | %.1fM | %s | %s | %d x %d | %s | %s | %s | %s | %s | %s | %s |" % (
            r["id"], r["split"], r["family"], r["params"] / 1e6, r["precision"], r["optimizer"], r["batch"], r["seq"],
            mib(r["measured_bytes"]), mib(r["memd_bytes"]), pct(r["memd_error"]), mib(r["accelerate_bytes"]),
            pct(r["accelerate_error"]), pct(r["deepspeed_zero2_error"]), pct(r["deepspeed_zero3_error"])))
    lines.append("")
    for split in ("held", "tune"):
        for name, s in doc["summary"][split].items():
            if s:
                lines.append("- %s rows, %s: median |error| %.1f %%, max %.1f %%, median signed %+.1f %% (%d rows)" % (
                    split, name, s["median_abs"] * 100, s["max_abs"] * 100, s["median"] * 100, s["n"]))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
