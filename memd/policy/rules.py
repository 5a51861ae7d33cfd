"""The rule-of-thumb calculators memd grew from (docs/policy.md, "Estimators"), done right: a
unified machine's budget (architecture table, optimizer, EMA, DOP, workers, OS reserve, per-sample
memory ~ resolution^2, 10 % safety, caps per resolution), and a batch's sizing with accumulation
(the divisor rule of ``split_batch``). Pure; in decimal GB, as those calculators work.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

from memd.client.plan import split_batch
from memd.policy.inputs import EstimateError
from memd.policy.inputs import choice as _choice
from memd.policy.inputs import non_negative as _non_negative
from memd.policy.inputs import positive as _positive
from memd.policy.inputs import rounded as _r

# -- unified (seed 000) ------------------------------------------------------------------------

ARCH_WEIGHTS_GB = {  # seed 000, "Model Weights" table
    "sd1": 8, "sd2": 10, "sdxl": 14, "sd3": 16, "flux": 24, "flux-kontext": 24, "flex1": 20,
    "flex2": 20, "chroma": 20, "lumina2": 22, "hidream": 24, "omnigen2": 24, "qwen-image": 28,
}
QUANTIZATION_DIVISOR = {"none": 1, "8bit": 2, "4bit": 4}  # 28 GB -> 14 (8-bit) or 7 (4-bit)
UNIFIED_OPTIMIZER_FACTOR = {"adamw": 2.0, "lamb": 2.0, "adafactor": 0.5, "sgd": 0.0}  # x weights
EMA_LORA_GB = 1.0  # a shadow copy of the LoRA weights; a full fine-tune copies all weights
DOP_GB = 3.0  # differential output preservation
WORKER_GB = 8.0  # per dataloader worker for large models (seed: ~4 GB for small ones)
OS_RESERVE_GB = 8.0
SAFETY = 0.10
CHECKPOINT_SAVING = 0.30  # gradient checkpointing saves ~30 % of activation (= per-sample) memory
# resolution upper bound -> (max initial batch, max batch): seed 000, "Safety Caps by Resolution"
SAFETY_CAPS = ((512, 16, 32), (768, 8, 16), (1024, 4, 8), (1536, 4, 8), (math.inf, 2, 4))
# resolution upper bound -> (cap, floor, GB per sample): seed 000, discrete GPU rule
DISCRETE_RULE = ((512, 16, 4, 3), (768, 8, 2, 4), (1024, 4, 1, 6), (1536, 2, 1, 10), (math.inf, 2, 1, 12))


@dataclass(frozen=True)
class UnifiedEstimate:
    model: str
    resolution: int
    weights_gb: float
    optimizer_gb: float
    ema_gb: float
    dop_gb: float
    workers_gb: float
    os_reserve_gb: float
    reserved_gb: float
    available_gb: float  # (memory - reserved) x (1 - safety), never negative
    per_sample_gb: float
    fitting_batch: int  # floor(available / per_sample); 0 means not even one sample fits
    batch_size: int  # the largest batch: fitting, at least 1, at most the resolution's cap
    initial_batch_size: int  # what to start with: batch_size capped by the initial cap
    fits: bool


def per_sample_gb(resolution: int, checkpointing: bool = False) -> float:
    """Seed 000: 4 GB per sample at 1024 px, growing with resolution squared."""
    value = resolution * resolution / (1024 * 1024) * 4.0
    return value * (1.0 - CHECKPOINT_SAVING) if checkpointing else value


def safety_caps(resolution: int) -> Tuple[int, int]:
    for bound, initial, maximum in SAFETY_CAPS:
        if resolution <= bound:
            return initial, maximum
    raise AssertionError("unreachable")


def unified(memory_gb: float, model: str, resolution: int, workers: int = 0, ema: bool = False,
            quantization: str = "none", optimizer: str = "adamw", full_finetune: bool = False,
            diff_output_preservation: bool = False, checkpointing: bool = False,
            worker_gb: float = WORKER_GB, os_reserve_gb: float = OS_RESERVE_GB) -> UnifiedEstimate:
    """Seed 000's unified-memory budget; reproduces its worked examples exactly.

    Everything (weights, optimizer states, EMA, workers, the OS) draws on one pool, so each is
    reserved before any batch memory; 10 % of the rest is kept back for spikes.
    """
    _positive("memory_gb", memory_gb)
    _positive("resolution", resolution)
    _non_negative("workers", workers)
    _non_negative("worker_gb", worker_gb)
    _non_negative("os_reserve_gb", os_reserve_gb)
    weights = _choice("model", model, ARCH_WEIGHTS_GB) / _choice("quantization", quantization, QUANTIZATION_DIVISOR)
    optim = _choice("optimizer", optimizer, UNIFIED_OPTIMIZER_FACTOR) * weights
    ema_gb = (weights if full_finetune else EMA_LORA_GB) if ema else 0.0
    dop = DOP_GB if diff_output_preservation else 0.0
    workers_gb = workers * worker_gb
    reserved = weights + optim + ema_gb + dop + workers_gb + os_reserve_gb
    available = max(0.0, (memory_gb - reserved) * (1.0 - SAFETY))
    sample = per_sample_gb(resolution, checkpointing)
    fitting = int(math.floor(available / sample + 1e-9))
    initial_cap, max_cap = safety_caps(resolution)
    batch = min(max_cap, max(1, fitting))
    return UnifiedEstimate(model, int(resolution), _r(weights), _r(optim), _r(ema_gb), _r(dop), _r(workers_gb),
                           _r(os_reserve_gb), _r(reserved), _r(available), _r(sample), fitting, batch,
                           min(batch, initial_cap), fitting >= 1)


def discrete_initial_batch(vram_gb: float, resolution: int) -> int:
    """Seed 000's rule for a discrete GPU: min(cap, max(floor, floor(vram / GB per sample)))."""
    _positive("vram_gb", vram_gb)
    _positive("resolution", resolution)
    for bound, cap, low, per in DISCRETE_RULE:
        if resolution <= bound:
            return min(cap, max(low, int(vram_gb // per)))
    raise AssertionError("unreachable")


# -- accum (seed 001) --------------------------------------------------------------------------

@dataclass(frozen=True)
class AccumEstimate:
    max_batch: int
    target: Optional[int]
    batch_size: int
    grad_accum_steps: int
    effective_batch_size: int
    note: str  # empty unless the effective batch differs from the target


def seed_max_batch(gpu_gb: float, images_per_sample: int = 1, base_sample_gb: float = 0.8,
                   reserve: float = 0.2, extra_image_factor: float = 0.7) -> int:
    """Seed 001's sizing: 80 % of the GPU, 0.8 GB per one-image sample, +70 % per extra image."""
    _positive("gpu_gb", gpu_gb)
    _positive("images_per_sample", images_per_sample)
    _positive("base_sample_gb", base_sample_gb)
    if not 0 <= reserve < 1:
        raise EstimateError("reserve must be in [0, 1): %r" % (reserve,))
    sample = base_sample_gb * (1.0 + (images_per_sample - 1) * extra_image_factor)
    return max(1, int(math.floor(gpu_gb * (1.0 - reserve) / sample + 1e-9)))


def accum(max_batch: int, target: Optional[int] = None, min_batch: int = 1) -> AccumEstimate:
    """Batch and accumulation steps for a target effective batch, by ``split_batch``'s rule.

    Seed 001 used ``target // batch`` steps, which silently changes the effective batch (its
    own code gives 24 x 1 = 24 for target 16); a divisor of the target keeps it exact.
    """
    _positive("max_batch", max_batch)
    _positive("min_batch", min_batch)
    if target is not None:
        _positive("target", target)
    batch, steps, note = split_batch(int(max_batch), int(target) if target else None, int(min_batch))
    return AccumEstimate(int(max_batch), target, batch, steps, batch * steps, note)
