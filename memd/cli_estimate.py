"""`memd estimate unified|accum|llm|transformer`: the seeds' calculators, done right.

Human tables by default, in GiB as all of memd's human output; --json for machines. The
calculators' inputs (the --*-gb flags) and JSON's *_gb fields are decimal GB, as in the seeds;
byte fields end in _bytes. Bad input ends with one line on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict
from typing import Optional, Tuple

from memd.policy import archs, rules
from memd.policy import estimate as est
from memd.policy.inputs import EstimateError
from memd.units import GB, GiB

_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        self.exit(2, "%s: error: %s\n" % (self.prog, message))


def _count(text: str) -> float:
    """8030000000, 8.03e9, 8.03B, 125M, 4.2k."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*", str(text).lower())
    if not match:
        raise argparse.ArgumentTypeError("not a count: %r (e.g. 8.03e9, 8.03B, 125M)" % text)
    return float(round(float(match.group(1)) * _SUFFIX[match.group(2)]))  # 8.03B is 8,030,000,000 exactly


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("estimate", help="a-priori memory estimates, before a job has run")
    parser.error = _Parser.error.__get__(parser)
    sub = parser.add_subparsers(dest="estimator", metavar="ESTIMATOR", parser_class=_Parser)
    parser.set_defaults(run=lambda args: _usage(parser))

    p = sub.add_parser("unified", help="unified-memory batch size for image models (the AI Toolkit calculator's rules)")
    p.add_argument("--memory-gb", type=float, required=True, help="the pool: unified memory (or VRAM with --discrete)")
    p.add_argument("--model", required=True, help="architecture: " + ", ".join(rules.ARCH_WEIGHTS_GB))
    p.add_argument("--resolution", type=int, required=True, help="training resolution in pixels (square)")
    p.add_argument("--workers", type=int, default=0, help="dataloader workers (default 0)")
    p.add_argument("--worker-gb", type=float, default=rules.WORKER_GB,
                   help="GB per worker (default 8; ~4 for small models)")
    p.add_argument("--os-reserve-gb", type=float, default=rules.OS_RESERVE_GB, help="kept for the OS (default 8)")
    p.add_argument("--quantization", default="none", help="none, 8bit or 4bit base model")
    p.add_argument("--optimizer", default="adamw", help="adamw, lamb, adafactor or sgd")
    p.add_argument("--ema", action="store_true", help="keep an EMA copy of the trained weights")
    p.add_argument("--full-finetune", action="store_true", help="train all weights (EMA copies the whole model)")
    p.add_argument("--dop", "--diff-output-preservation", dest="dop", action="store_true",
                   help="differential output preservation (+3 GB)")
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (-30%% per sample)")
    p.add_argument("--discrete", action="store_true", help="a discrete GPU: the initial-batch rule only")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=_unified)

    p = sub.add_parser("accum", help="batch size and gradient accumulation for a target effective batch")
    p.add_argument("--gpu-gb", type=float,
                   help="GPU memory in GB: the largest batch is GPU GB / (sample GB x (1 + 0.7 per extra image))")
    p.add_argument("--max-batch", type=int, help="a known largest batch instead of --gpu-gb")
    p.add_argument("--images-per-sample", type=int, default=1, help="images per sample (+70%% memory each)")
    p.add_argument("--sample-gb", type=float, default=0.8, help="GB per one-image sample (default 0.8)")
    p.add_argument("--target", type=int, help="target effective batch size")
    p.add_argument("--min-batch", type=int, default=1, help="smallest acceptable batch (default 1)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=_accum)

    p = sub.add_parser("llm", help="fixed and per-sample memory of LLM training, largest batch")
    p.add_argument("--params", type=_count, required=True, help="parameters, e.g. 8.03B")
    p.add_argument("--optimizer", default="adamw", help=", ".join(est.OPTIMIZER_STATES))
    p.add_argument("--precision", default="mixed", help="fp32, mixed (16-bit compute, fp32 master), bf16, fp16")
    p.add_argument("--lora-params", "--trainable-params", dest="trainable", type=_count,
                   help="LoRA: trainable parameters (the base is frozen)")
    p.add_argument("--base-quantization", default="none", help="frozen LoRA base: none, 8bit, 4bit")
    p.add_argument("--zero-stage", type=int, default=0, help="ZeRO stage 0-3")
    p.add_argument("--gpus", type=int, default=1, help="data-parallel GPUs ZeRO partitions across")
    p.add_argument("--cuda-overhead-gb", type=float, default=2.0, help="CUDA context, kernels, workspace (default 2)")
    p.add_argument("--margin-gb", type=float, default=2.0, help="safety margin (default 2)")
    p.add_argument("--gpu-gb", type=float, help="GPU memory: report the largest batch")
    p.add_argument("--per-sample-gb", type=float, help="memory per sample (else from --layers ... if given)")
    _arch_args(p, required=False)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=_llm)

    p = sub.add_parser("transformer", help="transformer parameters and peak training memory (GPT-2, Llama, BERT, "
                                           "ViT, nanoGPT)")
    p.add_argument("--model-config", metavar="CONFIG_JSON",
                   help="a Hugging Face config.json (gpt2, llama, mistral, bert, vit) or nanoGPT's GPTConfig keys: "
                        "fills the architecture; flags given beside it override it")
    _arch_args(p, required=False)
    p.add_argument("--intermediate", type=int, help="MLP width (default: the config's, or 4 x --d-model)")
    p.add_argument("--kv-heads", type=int, help="key/value heads of a Llama-style model (default: the config's)")
    p.add_argument("--batch", type=int, required=True, help="batch size")
    p.add_argument("--precision", default="fp32", help="fp32, mixed (bf16 autocast), bf16 or fp16")
    p.add_argument("--optimizer", default="adamw", help=", ".join(est.OPTIMIZER_STATES))
    p.add_argument("--untied", action="store_true", help="an lm_head not tied to the token embedding")
    p.add_argument("--device", default="auto",
                   help="where the job runs: cuda or cpu (default: cuda if NVML sees a GPU here, else cpu)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=_transformer)


def _arch_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--layers", type=int, required=required, help="transformer blocks")
    p.add_argument("--d-model", type=int, required=required, help="embedding width")
    p.add_argument("--heads", type=int, required=required, help="attention heads")
    p.add_argument("--vocab", type=int, required=required, help="vocabulary size")
    p.add_argument("--positions", type=int, help="position embeddings (default: --seq-len)")
    p.add_argument("--seq-len", type=int, required=required, help="sequence length (not for ViT: its patches)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing per block")
    p.add_argument("--attention", default="auto",
                   help="auto (the model's default: sdpa), sdpa, or eager/naive (keeps the s^2 scores)")


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _fail(args: argparse.Namespace, exc: Exception) -> int:
    print("memd estimate %s: %s" % (args.estimator, exc), file=sys.stderr)
    return 2


def _emit(args: argparse.Namespace, data: dict, lines, fits: bool = True) -> int:
    """Print the estimate; exit 1 when what was asked does not fit (a script tests the code)."""
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print("\n".join(lines))
    return 0 if fits else 1


def _unified(args: argparse.Namespace) -> int:
    try:
        if args.discrete:
            batch = rules.discrete_initial_batch(args.memory_gb, args.resolution)
            data = {"memory_model": "discrete", "memory_gb": args.memory_gb, "resolution": args.resolution,
                    "batch_size": batch}
            return _emit(args, data, ["discrete GPU, %.2f GiB VRAM (--memory-gb %g), %d px: initial batch %d"
                                      % (_gib(args.memory_gb), args.memory_gb, args.resolution, batch)])
        r = rules.unified(args.memory_gb, args.model, args.resolution, args.workers, args.ema, args.quantization,
                        args.optimizer, args.full_finetune, args.dop, args.checkpointing, args.worker_gb,
                        args.os_reserve_gb)
    except EstimateError as exc:
        return _fail(args, exc)
    data = dict(asdict(r), memory_model="unified", memory_gb=args.memory_gb)
    lines = ["unified memory %.2f GiB (--memory-gb %g), %s at %d px" % (_gib(args.memory_gb), args.memory_gb,
                                                                         r.model, r.resolution)]
    for name, value in (("model weights", r.weights_gb), ("optimizer states", r.optimizer_gb), ("EMA", r.ema_gb),
                        ("diff. output preservation", r.dop_gb), ("dataloader workers", r.workers_gb),
                        ("OS reserve", r.os_reserve_gb)):
        lines.append("  %-28s %8.2f GiB" % (name, _gib(value)))
    lines += ["  %-28s %8.2f GiB" % ("total reserved", _gib(r.reserved_gb)),
              "  %-28s %8.2f GiB  ((%.2f - %.2f) x 0.9)" % ("available for batches", _gib(r.available_gb),
                                                             _gib(args.memory_gb), _gib(r.reserved_gb)),
              "  %-28s %8.2f GiB" % ("memory per sample", _gib(r.per_sample_gb)),
              "  %-28s %8d" % ("fitting batch", r.fitting_batch),
              "batch size %d (start at %d)%s" % (r.batch_size, r.initial_batch_size,
                                                 "" if r.fits else ": NOT ENOUGH MEMORY for one sample")]
    return _emit(args, data, lines, fits=r.fits)


def _accum(args: argparse.Namespace) -> int:
    try:
        if (args.gpu_gb is None) == (args.max_batch is None):
            raise EstimateError("give exactly one of --gpu-gb and --max-batch")
        limit = args.max_batch if args.max_batch is not None else rules.seed_max_batch(
            args.gpu_gb, args.images_per_sample, args.sample_gb)
        r = rules.accum(limit, args.target, args.min_batch)
    except EstimateError as exc:
        return _fail(args, exc)
    data = dict(asdict(r), fits=args.min_batch <= r.max_batch)
    if not data["fits"]:
        why = "--min-batch %d does not fit: the largest batch is %d" % (args.min_batch, r.max_batch)
        return _emit(args, data, [why], fits=False)
    line = "largest batch %d -> batch %d x %d accumulation steps = effective %d" % (
        r.max_batch, r.batch_size, r.grad_accum_steps, r.effective_batch_size)
    return _emit(args, data, [line] + (["note: " + r.note] if r.note else []))


def _llm(args: argparse.Namespace) -> int:
    try:
        per_sample = None if args.per_sample_gb is None else args.per_sample_gb * GB
        if per_sample is None and args.layers is not None:
            _, _, per_sample = est.transformer_line(args.layers, args.d_model, args.heads, args.vocab, args.seq_len,
                                                 args.positions, args.precision, args.optimizer,
                                                 args.checkpointing, args.attention)
        r = est.llm(args.params, args.optimizer, args.precision, args.trainable, args.base_quantization,
                    args.zero_stage, args.gpus, args.cuda_overhead_gb * GB, args.margin_gb * GB, per_sample,
                    None if args.gpu_gb is None else args.gpu_gb * GB)
    except (EstimateError, TypeError) as exc:
        return _fail(args, exc)
    data = asdict(r)
    data["bytes_per_param"]["total"] = r.bytes_per_param.total
    data.update({k.replace("_bytes", "_gb"): _gb(v) for k, v in asdict(r).items()
                 if k.endswith("_bytes") and isinstance(v, int)})
    bpp = r.bytes_per_param
    lines = ["%s parameters (%s trainable), %s, %s; bytes per trainable parameter: weights %g + master %g + "
             "gradients %g + optimizer %g = %g" % (_human(r.params), _human(r.trainable_params), args.optimizer,
                                                    args.precision, bpp.weights, bpp.master, bpp.grads, bpp.states,
                                                    bpp.total)]
    if args.zero_stage:
        lines.append("ZeRO stage %d across %d GPUs (per GPU below)" % (args.zero_stage, args.gpus))
    for name, value in (("weights", r.weights_bytes), ("fp32 master weights", r.master_bytes),
                        ("gradients", r.grads_bytes), ("optimizer states", r.optimizer_bytes),
                        ("CUDA overhead", r.overhead_bytes), ("safety margin", r.margin_bytes),
                        ("total fixed", r.fixed_bytes)):
        lines.append("  %-22s %9.2f GiB" % (name, value / GiB))
    if r.per_sample_bytes is not None:
        lines.append("  %-22s %9.2f GiB" % ("per sample", r.per_sample_bytes / GiB))
    if r.max_batch is not None:
        lines.append("largest batch on %.2f GiB (--gpu-gb %g): %d%s" % (
            _gib(args.gpu_gb), args.gpu_gb, r.max_batch,
            "" if r.max_batch else " (the fixed memory alone does not fit)"))
        return _emit(args, data, lines, fits=r.max_batch > 0)
    fits = args.gpu_gb is None or r.fixed_bytes <= args.gpu_gb * GB
    if not fits:
        lines.append("the fixed memory alone does not fit in %.2f GiB (--gpu-gb %g)" % (_gib(args.gpu_gb), args.gpu_gb))
    return _emit(args, data, lines, fits=fits)


def _gib(gb: float) -> float:
    """Decimal GB (the calculators' unit) as GiB (the tables')."""
    return gb * GB / GiB


def _device(arg: str) -> Tuple[str, str]:
    """The device the job will run on, and why: NVML seeing a GPU means cuda."""
    if arg != "auto":
        return arg, ""
    from memd.sampling.nvml import Nvml
    nvml = Nvml()
    try:
        count = nvml.status().device_count or 0
    finally:
        nvml.shutdown()
    return ("cuda", " (a GPU is visible)") if count else ("cpu", " (no GPU visible)")


def _architecture(args: argparse.Namespace) -> archs.Arch:
    flags = dict(layers=args.layers, hidden=args.d_model, heads=args.heads, vocab=args.vocab,
                 positions=args.positions, intermediate=args.intermediate, kv_heads=args.kv_heads)
    if args.model_config:
        try:
            with open(args.model_config) as f:
                config = json.load(f)
        except OSError as exc:
            raise EstimateError("--model-config %s: %s" % (args.model_config, exc.strerror or exc)) from None
        except ValueError as exc:
            raise EstimateError("--model-config %s: not JSON (%s)" % (args.model_config, exc)) from None
        base = archs.from_config(config, args.model_config)
        return archs.with_overrides(base, tied=False if args.untied else None, **flags)
    missing = [name for name, key in (("--layers", "layers"), ("--d-model", "hidden"), ("--heads", "heads"),
                                      ("--vocab", "vocab"), ("--seq-len", "seq")) if
               (args.seq_len if key == "seq" else flags[key]) is None]
    if missing:
        raise EstimateError("give --model-config CONFIG_JSON or %s" % ", ".join(missing))
    flags.update(positions=args.positions or args.seq_len, intermediate=args.intermediate or 0, kv_heads=0)
    return archs.check(archs.Arch("nanogpt", tied=not args.untied, **flags))


def _transformer(args: argparse.Namespace) -> int:
    try:
        device, why = _device(args.device)
        arch = _architecture(args)
        if arch.family != "vit" and args.seq_len is None:
            raise EstimateError("--seq-len is required for a %s model" % arch.family)
        kwargs = dict(seq_len=args.seq_len, batch=args.batch, optimizer=args.optimizer,
                      checkpointing=args.checkpointing, attention=args.attention, device=device)
        shown = ("fp32", "mixed") + (() if est.precision_name(args.precision) in ("fp32", "mixed")
                                     else (args.precision,))
        chosen = est.training_peak(arch, precision=args.precision, **kwargs)
        side = {p: est.training_peak(arch, precision=p, **kwargs) for p in shown}
    except (EstimateError, archs.ArchError) as exc:
        return _fail(args, exc)
    data = asdict(chosen)
    data.update(peak_gib=round(chosen.peak_bytes / GiB, 6), family=arch.family, architecture=asdict(arch),
                by_precision={p: asdict(r) for p, r in side.items()})
    tokens = arch.tokens(args.seq_len or 0)
    lines = ["%s %s parameters (%d layers, hidden %d, %d heads, %s %d); batch %d x %d %s, %s, %s%s, attention %s"
             % (_human(chosen.params), arch.family, arch.layers, arch.hidden, arch.heads,
                "labels" if arch.family == "vit" else "vocab", arch.vocab, args.batch, tokens,
                "patches+1" if arch.family == "vit" else "tokens", args.optimizer, device, why, chosen.attention),
             "  %-24s" % "GiB" + "".join(" %14s" % p for p in shown)]
    for name in ("weights_bytes", "grads_bytes", "optimizer_bytes", "cast_bytes", "activation_bytes", "loss_bytes",
                 "held_bytes", "step_temp_bytes", "live_peak_bytes", "framework_bytes", "slack_bytes", "peak_bytes"):
        lines.append("  %-24s" % name[:-6].replace("_", " ") + "".join(" %14.3f" % (getattr(side[p], name) / GiB)
                                                                       for p in shown))
    lines.append("  %-24s" % "live peak at" + "".join(" %14s" % side[p].peak_phase for p in shown))
    return _emit(args, data, lines)


def _gb(value: Optional[int]) -> Optional[float]:
    return None if value is None else round(value / GB, 6)


def _human(n: float) -> str:
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return "%.2f%s" % (n / div, suffix)
    return str(int(n))
