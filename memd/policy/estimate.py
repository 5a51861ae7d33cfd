"""A-priori memory estimators: the seeds' calculators, done right (docs/policy.md, "Estimators").

Pure functions of their arguments (no I/O, no torch). Units: the seed calculators (unified,
accum: memd.policy.rules, re-exported here) work in decimal GB as the seeds do; the LLM and
transformer models work in bytes.
- ``unified``: seed 000's unified-memory budget (rules).
- ``seed_max_batch`` + ``accum``: seed 001's sizing with the divisor rule of ``split_batch`` (rules).
- ``llm``: seed 002's fixed + per-sample model, with bytes per parameter that are right.
- ``transformer``: seed 003's GPT-style estimate, rebuilt from the tensors a training step keeps.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

from memd.client.counts import whole
from memd.policy import archs
from memd.policy.fit import Prior
from memd.policy.inputs import EstimateError
from memd.policy.inputs import choice as _choice
from memd.policy.inputs import non_negative as _non_negative
from memd.policy.inputs import number as _number
from memd.policy.inputs import positive as _positive
from memd.policy.rules import accum, discrete_initial_batch, per_sample_gb, seed_max_batch, unified  # noqa: F401
from memd.units import GB, MiB

# accum, discrete_initial_batch, per_sample_gb, seed_max_batch and unified live in memd.policy.rules:
# imported above so that est.unified and the rest still answer, as tests and docs call them.

# -- llm (seed 002, corrected) -----------------------------------------------------------------

OPTIMIZER_STATES = {"sgd": 0, "sgd-momentum": 1, "adafactor": 0, "adamw": 2, "adamw-8bit": 2, "lamb": 2}
OPTIMIZER_ALIASES = {"adam": "adamw", "momentum": "sgd-momentum", "adamw8bit": "adamw-8bit", "adam8bit": "adamw-8bit"}
PRECISIONS = ("fp32", "mixed", "bf16", "fp16")
QUANTIZED_BASE_BYTES = {"none": None, "8bit": 1.0, "4bit": 0.5}  # frozen LoRA base (QLoRA)


@dataclass(frozen=True)
class ParamBytes:
    """Bytes per trainable parameter (ZeRO paper's accounting, Rajbhandari et al. 2020)."""
    weights: float  # the working copy the forward pass reads
    master: float  # fp32 master copy kept by mixed precision (an optimizer state to ZeRO)
    grads: float
    states: float

    @property
    def total(self) -> float:
        return self.weights + self.master + self.grads + self.states


def optimizer_name(name: str) -> str:
    key = str(name).lower().replace("_", "-")
    key = OPTIMIZER_ALIASES.get(key, key)
    if key not in OPTIMIZER_STATES:
        raise EstimateError("unknown optimizer %r (one of %s)" % (name, ", ".join(OPTIMIZER_STATES)))
    return key


def precision_name(name: str) -> str:
    lower = str(name).lower()
    key = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "amp": "mixed"}.get(lower, lower)
    if key not in PRECISIONS:
        raise EstimateError("unknown precision %r (one of %s)" % (name, ", ".join(PRECISIONS)))
    return key


def bytes_per_param(optimizer: str, precision: str) -> ParamBytes:
    """fp32: 4 + 4 + 4/state. mixed (bf16/fp16 compute, fp32 master): 2 + 4 + 2 + 4/state
    (16 for Adam, as torch autocast's 4 + 4 + 8). Pure bf16/fp16: 2 + 2 + 2/state (torch keeps
    states in the parameter dtype). 8-bit AdamW: 1 byte per state in every regime. Adafactor's
    factored second moment is O(rows + cols) per matrix, ~0 per parameter (not seed 002's 0.5x).
    """
    opt, prec = optimizer_name(optimizer), precision_name(precision)
    states = OPTIMIZER_STATES[opt]
    per_state = 1.0 if opt == "adamw-8bit" else (4.0 if prec in ("fp32", "mixed") else 2.0)
    if prec == "fp32":
        return ParamBytes(4.0, 0.0, 4.0, states * per_state)
    if prec == "mixed":
        return ParamBytes(2.0, 4.0, 2.0, states * per_state)
    return ParamBytes(2.0, 0.0, 2.0, states * per_state)


@dataclass(frozen=True)
class LlmEstimate:
    params: int
    trainable_params: int
    bytes_per_param: ParamBytes  # per trainable parameter, before ZeRO partitioning
    weights_bytes: int  # per GPU, frozen and trainable
    master_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    overhead_bytes: int  # CUDA context, kernels, workspace
    margin_bytes: int
    fixed_bytes: int  # everything above: memory before the first sample
    per_sample_bytes: Optional[int]
    gpu_bytes: Optional[int]
    max_batch: Optional[int]  # None without a GPU size or per-sample memory; 0: nothing fits


def _count_text(n: float) -> str:
    return "%.2fB" % (n / 1e9) if n >= 1e9 else "%.0f" % n


def llm(params: float, optimizer: str = "adamw", precision: str = "mixed", trainable_params: Optional[float] = None,
        base_quantization: str = "none", zero_stage: int = 0, gpus: int = 1, overhead_bytes: float = 2 * GB,
        margin_bytes: float = 2 * GB, per_sample_bytes: Optional[float] = None,
        gpu_bytes: Optional[float] = None) -> LlmEstimate:
    """Seed 002's fixed + per-sample model per GPU, with ZeRO stage 1 (optimizer states and
    master weights), 2 (+ gradients) and 3 (+ weights) partitioned across ``gpus``, and LoRA:
    only ``trainable_params`` carry gradients and optimizer states; the frozen base holds
    weights only (2 bytes, or 1 / 0.5 when quantized to 8 / 4 bits)."""
    _positive("params", params)
    _positive("gpus", gpus)
    if zero_stage not in (0, 1, 2, 3):
        raise EstimateError("zero stage must be 0, 1, 2 or 3: %r" % (zero_stage,))
    trainable = params if trainable_params is None else trainable_params
    _positive("trainable_params", trainable)
    if trainable > params:
        raise EstimateError("trainable parameters (%s) cannot exceed the model's parameters (%s)" % (
            _count_text(trainable), _count_text(params)))
    per = bytes_per_param(optimizer, precision)
    base = _choice("base quantization", base_quantization, QUANTIZED_BASE_BYTES)
    frozen = 0.0 if trainable_params is None else params
    frozen_bytes = frozen * (base if base is not None else (4.0 if precision_name(precision) == "fp32" else 2.0))
    n = float(gpus)
    weights = (trainable * per.weights + frozen_bytes) / (n if zero_stage >= 3 else 1)
    master = trainable * per.master / (n if zero_stage >= 1 else 1)
    states = trainable * per.states / (n if zero_stage >= 1 else 1)
    grads = trainable * per.grads / (n if zero_stage >= 2 else 1)
    _non_negative("overhead", overhead_bytes)
    _non_negative("margin", margin_bytes)
    fixed = weights + master + grads + states + overhead_bytes + margin_bytes
    max_batch = None
    if per_sample_bytes is not None:
        _positive("per_sample", per_sample_bytes)
    if gpu_bytes is not None:
        _positive("gpu memory", gpu_bytes)
        if per_sample_bytes is not None:
            max_batch = max(0, int(math.floor((gpu_bytes - fixed) / per_sample_bytes + 1e-9)))
    return LlmEstimate(int(params), int(trainable), per, int(weights), int(master), int(grads), int(states),
                       int(overhead_bytes), int(margin_bytes), int(fixed),
                       None if per_sample_bytes is None else int(per_sample_bytes),
                       None if gpu_bytes is None else int(gpu_bytes), max_batch)


# -- transformer training peak (seed 003, rebuilt on measurements) ------------------------------

ATTENTIONS = ("auto", "sdpa", "eager", "naive")  # auto: the model's default (sdpa); naive = eager
DEVICES = ("cpu", "cuda")

# Bytes autograd keeps per block, per (b*s*h, b*s*intermediate, b*s) element, in training mode with
# the config's dropout; counted with saved-tensor hooks on transformers 5.2 / torch 2.13 models
# (docs/results.md, "Estimator accuracy"). bf16/fp16 without autocast use the mixed row (not measured).
LAYER_BYTES = {
    ("gpt2", "fp32"): (40, 20, 16), ("gpt2", "mixed"): (30, 10, 16),
    ("llama", "fp32"): (36, 16, 16), ("llama", "mixed"): (32, 8, 11),
    ("bert", "fp32"): (40, 8, 16), ("bert", "mixed"): (34, 4, 16),
    ("vit", "fp32"): (32, 8, 16), ("vit", "mixed"): (24, 4, 16),
    ("nanogpt", "fp32"): (4, 15, 22), ("nanogpt", "mixed"): (2, 8.5, 16),
}
# Bytes per b*s*h outside the blocks: embeddings, final norm, LM-head input (BERT: the MLM transform)
REST_BYTES = {("gpt2", "fp32"): 12, ("gpt2", "mixed"): 10, ("llama", "fp32"): 13, ("llama", "mixed"): 11,
              ("bert", "fp32"): 24, ("bert", "mixed"): 16, ("vit", "fp32"): 8, ("vit", "mixed"): 8,
              ("nanogpt", "fp32"): 8, ("nanogpt", "mixed"): 6}
# Bytes per attention score (b * heads * s^2) when attention materialises them: eager always;
# sdpa on the CPU when attention dropout is on (its flash kernel has none: the math path runs).
SCORE_BYTES = {("eager", False, "fp32"): 4, ("eager", False, "mixed"): 6, ("eager", True, "fp32"): 12,
               ("eager", True, "mixed"): 8, ("sdpa", True, "fp32"): 12, ("sdpa", True, "mixed"): 12}
# Framework memory a fresh process adds in its first steps: kernels, thread pools, autograd's
# engine, oneDNN/cuBLAS workspaces. CPU: measured (tuning rows, bench/estimate_real.py). CUDA:
# documented, not measured here: the context with lazy module loading (~0.5 GiB on H100-class
# GPUs, outside torch's allocator) and cuBLAS workspaces.
FRAMEWORK_BYTES = {"cpu": 256 * MiB, "cuda": 640 * MiB}
# Allocator slack over the live-tensor peak. CPU (glibc's default malloc): the activations freed
# during backward stay in the heap (sizes below its mmap threshold) while the gradients are
# allocated, so the process holds both at the end of backward (measured, tuning rows). CUDA: the
# caching allocator's rounding to 2 MiB segments and block splitting, a documented 5 % of the peak.
PEAK_SLACK = {"cpu": 0.0, "cuda": 0.05}


def gpt2_params(layers: int, d_model: int, vocab: int, positions: int, tied: bool = True) -> int:
    """Exact parameter count of a GPT-2-style model (equal to torch's numel): 12h^2 + 13h per block,
    token and position embeddings, a final LayerNorm, an lm_head tied to the token embedding."""
    return archs.params(archs.Arch("gpt2", layers, d_model, 1, vocab, positions, tied=tied))


@dataclass(frozen=True)
class TransformerEstimate:
    params: int
    precision: str
    device: str
    attention: str  # what runs: "sdpa" (no scores kept), "sdpa (math)" or "eager" (scores kept)
    weights_bytes: int  # parameters (fp32 under autocast, which keeps fp32 parameters)
    grads_bytes: int
    optimizer_bytes: int
    cast_bytes: int  # autocast's 16-bit copies of the matmul weights, held for backward
    activation_bytes: int  # saved for backward at the end of the forward pass
    loss_bytes: int  # log-softmax output and the loss's gradients at the start of backward
    held_bytes: int  # what the caller keeps through the step (the logits nanoGPT returns)
    step_temp_bytes: int  # the optimizer step's temporaries
    live_peak_bytes: int  # the largest sum of live tensors
    framework_bytes: int  # kernels, thread pools, workspaces (CUDA: and the context)
    slack_bytes: int  # the allocator's: memory it holds that no tensor uses at the peak
    peak_bytes: int  # what the process grows by: live peak + framework + slack
    peak_phase: str  # "backward start", "backward", "backward end" or "optimizer step"

    @property
    def fixed_bytes(self) -> int:
        return self.weights_bytes + self.optimizer_bytes

    def parts(self) -> Dict[str, Any]:
        return asdict(self)


def attention_kind(arch: archs.Arch, attention: str, device: str) -> str:
    """What the attention implementation does in training: keep its scores or not."""
    impl = _choice("attention", attention, dict(zip(ATTENTIONS, ("sdpa", "sdpa", "eager", "eager"))))
    if impl == "eager":
        return "eager"
    return "sdpa (math)" if device == "cpu" and arch.attn_dropout > 0 else "sdpa"


def training_peak(arch: archs.Arch, seq_len: Optional[int], batch: int, precision: str = "fp32",
                  optimizer: str = "adamw", device: str = "cpu", attention: str = "auto",
                  checkpointing: bool = False) -> TransformerEstimate:
    """How much a fresh training process grows by through its second optimizer step (states
    exist, gradients set to None between steps, the loss computed inside the model).

    The live peak is the largest of the step's moments: the start of backward (weights, states,
    autocast's copies, every saved activation, the log-softmax and the loss's two gradients),
    each block's backward (activations below it, gradients made so far), the end of backward
    and the optimizer step (all gradients and the step's temporaries: per tensor on the CPU, one
    full copy with CUDA's foreach kernels). On top: the framework's own memory and the
    allocator's slack, both measured on the CPU (bench/estimate_real.py's tuning rows).
    """
    try:
        archs.check(arch)
    except archs.ArchError as exc:
        raise EstimateError(str(exc)) from None
    _positive("batch", batch)
    if arch.family != "vit":
        if seq_len is None:
            raise EstimateError("seq_len is required for a %s model" % arch.family)
        _positive("seq_len", seq_len)
        if arch.positions and arch.family != "llama" and seq_len > arch.positions:
            raise EstimateError("seq_len %d exceeds the model's %d positions" % (seq_len, arch.positions))
    prec, opt = precision_name(precision), optimizer_name(optimizer)
    dev = _choice("device", device, dict(zip(DEVICES, DEVICES)))
    kind = attention_kind(arch, attention, dev)
    key = "fp32" if prec == "fp32" else "mixed"
    L, h, i, a, b = arch.layers, arch.hidden, arch.inter, arch.heads, int(batch)
    s = arch.tokens(int(seq_len or 0))
    T, V = b * s, arch.vocab
    P = archs.params(arch)
    wb = 2 if prec in ("bf16", "fp16") else 4  # autocast keeps fp32 parameters
    W = G = P * wb
    S = int(P * bytes_per_param(opt, "bf16" if wb == 2 else "fp32").states)
    cast = 2 * archs.matmul_params(arch) if prec == "mixed" else 0

    ch, ci, ct = LAYER_BYTES[(arch.family, key)]
    score = 0 if kind == "sdpa" else SCORE_BYTES.get((kind.split()[0], arch.attn_dropout > 0, key), 12)
    layer = int(ch * T * h + ci * T * i + ct * T + score * b * a * s * s)
    saved = 4 * T * h if checkpointing else layer  # checkpointing keeps each block's input
    logits = b * V if arch.family == "vit" else T * V  # elements: per image or per token
    inputs = 4 * b * arch.channels * arch.image_size ** 2 if arch.family == "vit" else 16 * T
    rest = REST_BYTES[(arch.family, key)] * T * h + 4 * logits + inputs  # with the fp32 log-softmax
    activations = L * saved + rest
    held = (2 if prec != "fp32" else 4) * logits if arch.family == "nanogpt" else 0  # nanoGPT returns its logits
    loss = 4 * logits + 8 * logits  # log-softmax; its gradient and the logits' (fp32)
    grad_layer = (P - (V * h if arch.family != "vit" else 0)) * wb // max(L, 1)
    grad_head = (V * h + 2 * h) * wb
    base = W + S + held
    moments = [("backward start", base + cast + activations + 8 * logits)]
    transient = 4 * T * (2 * i + h)  # gradients inside one block's backward
    for k in sorted({L - 1, 0}, reverse=True):  # linear in k: the first or the last block's is largest
        below = inputs + k * saved + layer
        moments.append(("backward", base + cast + below + grad_head + (L - k) * grad_layer + transient))
    moments.append(("backward end", base + G + inputs + 4 * T * h + grad_head))
    step_temp = 0 if S == 0 else (P * 4 if dev == "cuda" else 2 * archs.largest_param(arch) * 4)
    moments.append(("optimizer step", base + G + step_temp))
    phase, live = max(moments, key=lambda m: m[1])
    framework = FRAMEWORK_BYTES[dev]
    heap = base + G + activations - 4 * logits if dev == "cpu" else 0  # freed activations kept, gradients made
    slack = int(max(0, heap - live) + PEAK_SLACK[dev] * live)
    return TransformerEstimate(P, prec, dev, kind, W, G, S, cast, activations, loss, held, step_temp, int(live),
                               framework, slack, int(live + framework + slack), phase)


def transformer(layers: int, d_model: int, heads: int, vocab: int, positions: int, seq_len: int, batch: int,
                precision: str = "fp32", optimizer: str = "adamw", checkpointing: bool = False,
                attention: str = "auto", tied: bool = True, device: str = "cpu") -> TransformerEstimate:
    """A nanoGPT-layout model (GPT-2's tensors, SDPA, no dropout) from its flags; training_peak."""
    for name, value in (("layers", layers), ("d_model", d_model), ("heads", heads), ("vocab", vocab),
                        ("positions", positions)):
        _positive(name, value)
    if d_model % heads:
        raise EstimateError("d_model %d is not divisible by heads %d" % (d_model, heads))
    arch = archs.Arch("nanogpt", int(layers), int(d_model), int(heads), int(vocab), int(positions), tied=tied)
    return training_peak(arch, seq_len, batch, precision, optimizer, device, attention, checkpointing)


# -- hints -> Prior ----------------------------------------------------------------------------

ARCH_KEYS = ("layers", "d_model", "heads", "vocab", "seq_len")


def prior_from_hints(hints: Any) -> Optional[Prior]:
    """A job's a-priori memory line, fixed + per_sample x batch, from its hints; None when the
    hints say nothing usable (invalid hints are ignored, never an error: the job still runs).

    Accepted, first match wins (docs/policy.md lists the keys):
    - {"fixed_bytes", "per_sample_bytes"}: the caller's own line;
    - a GPT-style architecture {"layers", "d_model", "heads", "vocab", "seq_len"} with optional
      "positions", "precision" (or "dtype"), "optimizer", "checkpointing", "attention",
      "device": the line through the transformer estimate's peak at batch 1 with its steepest
      growth per sample (transformer_line: an upper bound on its convex peak);
    - an LLM {"params"} with optional "optimizer", "precision", "trainable_params",
      "zero_stage", "gpus" and "per_sample_bytes" (else from the architecture keys).
    """
    if not isinstance(hints, Mapping):
        return None
    try:
        fixed, per_sample = hints.get("fixed_bytes"), hints.get("per_sample_bytes")
        if "params" not in hints and fixed is not None and per_sample is not None:
            _non_negative("fixed_bytes", fixed)
            _positive("per_sample_bytes", per_sample)
            return Prior(int(fixed), int(per_sample), "hints")
        if "params" in hints:
            return _llm_prior(hints)
        if all(key in hints for key in ARCH_KEYS):
            _, fixed, per = _arch_line(hints)
            return Prior(fixed, per, "transformer")
    except (EstimateError, TypeError, ValueError, OverflowError):
        return None
    return None


def _arch_line(hints: Mapping[str, Any]) -> Tuple[TransformerEstimate, int, int]:
    kwargs: Dict[str, Any] = {key: _int_hint(hints, key) for key in ARCH_KEYS}
    if "positions" in hints:
        kwargs["positions"] = _int_hint(hints, "positions")
    kwargs["precision"] = str(hints.get("precision", hints.get("dtype", "fp32")))
    for key in ("optimizer", "attention", "device"):
        if key in hints:
            kwargs[key] = str(hints[key])
    kwargs["checkpointing"] = hints.get("checkpointing") is True
    return transformer_line(**kwargs)


def transformer_line(layers: int, d_model: int, heads: int, vocab: int, seq_len: int, positions: Optional[int] = None,
                     precision: str = "fp32", optimizer: str = "adamw", checkpointing: bool = False,
                     attention: str = "sdpa", device: str = "cuda") -> Tuple[TransformerEstimate, int, int]:
    """(estimate at batch 1, fixed, per_sample) with fixed + per_sample x b >= the peak at every b >= 1.

    The peak is the largest of the step's moments, each a line in the batch, so it is convex and
    its slope grows to that of the steepest moment (the activations'). That slope, read far out
    where the steepest moment dominates, and the peak at batch 1 give the tightest line that
    bounds it from above: a slope read at small batches (where the optimizer step or the weights
    dominate) can be a fraction of the true growth and would promise batches that do not fit.
    """
    kwargs: Dict[str, Any] = dict(layers=layers, d_model=d_model, heads=heads, vocab=vocab, seq_len=seq_len,
                                  positions=positions or seq_len, precision=precision, optimizer=optimizer,
                                  checkpointing=checkpointing, attention=attention, device=device)
    one = transformer(batch=1, **kwargs)
    far = 1 << 20
    growth = transformer(batch=2 * far, **kwargs).peak_bytes - transformer(batch=far, **kwargs).peak_bytes
    per_sample = max(1, -(-growth // far))  # rounded up: the line must stay above the peak
    batch_free = one.weights_bytes + one.grads_bytes + one.optimizer_bytes + one.step_temp_bytes
    return one, max(batch_free, one.peak_bytes - per_sample), per_sample


def _llm_prior(hints: Mapping[str, Any]) -> Prior:
    kwargs: Dict[str, Any] = {"params": _number("params", hints["params"])}
    for key in ("optimizer", "precision"):
        if key in hints:
            kwargs[key] = str(hints[key])
    if "trainable_params" in hints:
        kwargs["trainable_params"] = _number("trainable_params", hints["trainable_params"])
    for key in ("zero_stage", "gpus"):
        if key in hints:
            kwargs[key] = _int_hint(hints, key)
    est = llm(overhead_bytes=0, margin_bytes=0, **kwargs)
    per_sample: Any = hints.get("per_sample_bytes")  # a hint: _positive checks it below
    if per_sample is None and all(key in hints for key in ARCH_KEYS):
        # The same precision as the fixed part: llm's default (mixed) unless the hints say.
        per_sample = _arch_line(dict(hints, precision=kwargs.get("precision", "mixed")))[2]
    _positive("per_sample_bytes", per_sample)
    return Prior(int(est.fixed_bytes), int(per_sample), "llm")


def _int_hint(hints: Mapping[str, Any], key: str) -> int:
    value = hints.get(key)
    if not whole(value):
        raise EstimateError("%s must be an integer: %r" % (key, value))
    return value
