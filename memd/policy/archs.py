"""Model architectures the training-memory estimate knows: their exact parameter counts and how to
read them from a Hugging Face ``config.json`` (so a user gives the file, not a dozen flags).

Pure: no torch, no transformers; tests/test_estimate.py checks every count against
``transformers``' own ``num_parameters()``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

FAMILIES = ("nanogpt", "gpt2", "llama", "bert", "vit")
# Hugging Face model_type -> the family whose layout it has (same tensors, same count)
MODEL_TYPES = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "bert": "bert", "vit": "vit",
               "nanogpt": "nanogpt"}


class ArchError(ValueError):
    """A config that does not describe a model the estimate knows; the message names the key."""


@dataclass(frozen=True)
class Arch:
    """One decoder/encoder stack. ``intermediate`` 0 means 4 x hidden, ``kv_heads`` 0 means heads.
    ViT: ``vocab`` is the number of labels and the sequence is the patches plus the class token."""
    family: str
    layers: int
    hidden: int
    heads: int
    vocab: int = 0
    positions: int = 0
    intermediate: int = 0
    kv_heads: int = 0
    head_dim: int = 0  # 0: hidden // heads
    tied: bool = True
    attn_dropout: float = 0.0
    attention_bias: bool = False  # llama: q/k/v/o biases
    mlp_bias: bool = False  # llama: gate/up/down biases
    type_vocab: int = 2  # bert: token types
    image_size: int = 0  # vit
    patch_size: int = 0
    channels: int = 3
    qkv_bias: bool = True  # vit

    @property
    def inter(self) -> int:
        return self.intermediate or 4 * self.hidden

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2 if self.family == "vit" else 0

    def tokens(self, seq_len: int) -> int:
        """Tokens per sample: the sequence, or for a ViT its patches and the class token."""
        return self.patches + 1 if self.family == "vit" else seq_len


def check(arch: Arch) -> Arch:
    if arch.family not in FAMILIES:
        raise ArchError("unknown model family %r (one of %s)" % (arch.family, ", ".join(FAMILIES)))
    for name in ("layers", "hidden", "heads"):
        if getattr(arch, name) <= 0:
            raise ArchError("%s must be positive: %r" % (name, getattr(arch, name)))
    for name in ("intermediate", "kv_heads", "positions", "head_dim"):
        if getattr(arch, name) < 0:
            raise ArchError("%s must not be negative: %r" % (name, getattr(arch, name)))
    if arch.family == "vit":
        if arch.image_size <= 0 or arch.patch_size <= 0 or arch.image_size < arch.patch_size:
            raise ArchError("image_size and patch_size must be positive, the patch no larger than the image")
    elif arch.vocab <= 0:
        raise ArchError("vocab_size must be positive: %r" % (arch.vocab,))
    if arch.family != "llama" and arch.hidden % arch.heads:
        raise ArchError("hidden size %d is not divisible by heads %d" % (arch.hidden, arch.heads))
    if arch.family == "llama" and arch.heads % arch.kv:
        raise ArchError("attention heads %d are not a multiple of key/value heads %d" % (arch.heads, arch.kv))
    return arch


def params(arch: Arch) -> int:
    """Exact parameter count (torch's numel, shared weights once), as transformers builds them."""
    L, h, i, V = arch.layers, arch.hidden, arch.inter, arch.vocab
    head = 0 if arch.tied else V * h
    if arch.family in ("gpt2", "nanogpt"):
        # two LayerNorms, qkv, attention projection, MLP in and out (all with biases); ln_f
        block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h)
        return V * h + arch.positions * h + L * block + 2 * h + head
    if arch.family == "llama":
        q, kv = arch.heads * arch.hd, arch.kv * arch.hd
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv + h) if arch.attention_bias else 0)
        mlp = 3 * h * i + ((2 * i + h) if arch.mlp_bias else 0)
        return V * h + L * (attn + mlp + 2 * h) + h + head
    if arch.family == "bert":  # BertForMaskedLM: no pooler; the MLM head's transform and decoder bias
        emb = V * h + arch.positions * h + arch.type_vocab * h + 2 * h
        block = (4 * h * h + 4 * h) + 2 * h + (h * i + i) + (i * h + h) + 2 * h
        return emb + L * block + (h * h + h + 2 * h) + V + head
    # vit (ViTForImageClassification): patch projection, class token, positions; classifier
    emb = arch.channels * arch.patch_size ** 2 * h + h + h + (arch.patches + 1) * h
    block = 4 * h + (3 * h * h + (3 * h if arch.qkv_bias else 0)) + (h * h + h) + (h * i + i) + (i * h + h)
    return emb + L * block + 2 * h + h * V + V


def matmul_params(arch: Arch) -> int:
    """Parameters of the matrices autocast copies to 16 bits (linear layers and the LM head)."""
    L, h, i = arch.layers, arch.hidden, arch.inter
    if arch.family == "llama":
        q, kv = arch.heads * arch.hd, arch.kv * arch.hd
        return L * (2 * h * q + 2 * h * kv + 3 * h * i) + arch.vocab * h
    layer = 4 * h * h + 2 * h * i
    if arch.family == "vit":
        return L * layer + h * arch.vocab
    return L * layer + arch.vocab * h + (h * h if arch.family == "bert" else 0)


def largest_param(arch: Arch) -> int:
    return max(arch.vocab * arch.hidden, arch.positions * arch.hidden, arch.hidden * arch.inter,
               3 * arch.hidden * arch.hidden)


def _get(cfg: Mapping[str, Any], key: str, source: str, default: Any = None) -> Any:
    value = cfg.get(key, default)
    if value is None:
        raise ArchError("%s: missing %r" % (source, key))
    return value


def _int(cfg: Mapping[str, Any], key: str, source: str, default: Any = None) -> int:
    value = _get(cfg, key, source, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ArchError("%s: %r must be a non-negative integer, not %r" % (source, key, value))
    return value


def _float(cfg: Mapping[str, Any], key: str, source: str, default: float) -> float:
    value = cfg.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ArchError("%s: %r must be a probability in [0, 1), not %r" % (source, key, value))
    return float(value)


def from_config(cfg: Mapping[str, Any], source: str = "config") -> Arch:
    """The architecture a Hugging Face config (config.json as a dict) describes; nanoGPT's
    GPTConfig keys (n_layer, n_embd, n_head, vocab_size, block_size) are read as "nanogpt"."""
    if not isinstance(cfg, Mapping):
        raise ArchError("%s: not a JSON object" % source)
    model_type = cfg.get("model_type") or ("nanogpt" if "block_size" in cfg else None)
    if model_type is None:
        raise ArchError("%s: missing 'model_type' (one of %s)" % (source, ", ".join(MODEL_TYPES)))
    family = MODEL_TYPES.get(str(model_type))
    if family is None:
        raise ArchError("%s: model_type %r is not one the estimate knows (%s)" % (
            source, model_type, ", ".join(MODEL_TYPES)))
    tied = cfg.get("tie_word_embeddings", family != "llama")
    if not isinstance(tied, bool):
        raise ArchError("%s: 'tie_word_embeddings' must be true or false, not %r" % (source, tied))
    if family in ("gpt2", "nanogpt"):
        positions = "n_positions" if family == "gpt2" else "block_size"
        arch = Arch(family, _int(cfg, "n_layer", source), _int(cfg, "n_embd", source), _int(cfg, "n_head", source),
                    _int(cfg, "vocab_size", source), _int(cfg, positions, source),
                    intermediate=_int(cfg, "n_inner", source, 0) if cfg.get("n_inner") is not None else 0,
                    tied=tied if family == "gpt2" else True,
                    attn_dropout=_float(cfg, "attn_pdrop", source, 0.1 if family == "gpt2" else 0.0))
    elif family == "llama":
        heads = _int(cfg, "num_attention_heads", source)
        arch = Arch(family, _int(cfg, "num_hidden_layers", source), _int(cfg, "hidden_size", source), heads,
                    _int(cfg, "vocab_size", source), _int(cfg, "max_position_embeddings", source, 0),
                    intermediate=_int(cfg, "intermediate_size", source),
                    kv_heads=_int(cfg, "num_key_value_heads", source, heads) if cfg.get("num_key_value_heads")
                    is not None else heads,
                    head_dim=_int(cfg, "head_dim", source, 0) if cfg.get("head_dim") is not None else 0,
                    tied=tied, attn_dropout=_float(cfg, "attention_dropout", source, 0.0),
                    attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)))
    elif family == "bert":
        arch = Arch(family, _int(cfg, "num_hidden_layers", source), _int(cfg, "hidden_size", source),
                    _int(cfg, "num_attention_heads", source), _int(cfg, "vocab_size", source),
                    _int(cfg, "max_position_embeddings", source), intermediate=_int(cfg, "intermediate_size", source),
                    tied=tied, attn_dropout=_float(cfg, "attention_probs_dropout_prob", source, 0.1),
                    type_vocab=_int(cfg, "type_vocab_size", source, 2))
    else:
        labels = cfg.get("id2label")
        n_labels = len(labels) if isinstance(labels, Mapping) else _int(cfg, "num_labels", source, 2)
        arch = Arch(family, _int(cfg, "num_hidden_layers", source), _int(cfg, "hidden_size", source),
                    _int(cfg, "num_attention_heads", source), n_labels, intermediate=_int(cfg, "intermediate_size",
                                                                                          source),
                    attn_dropout=_float(cfg, "attention_probs_dropout_prob", source, 0.0),
                    image_size=_int(cfg, "image_size", source), patch_size=_int(cfg, "patch_size", source),
                    channels=_int(cfg, "num_channels", source, 3), qkv_bias=bool(cfg.get("qkv_bias", True)))
    try:
        return check(arch)
    except ArchError as exc:
        raise ArchError("%s: %s" % (source, exc)) from None


def with_overrides(arch: Arch, **changes: Any) -> Arch:
    """The architecture with some fields replaced (command-line flags over a config file)."""
    return check(replace(arch, **{k: v for k, v in changes.items() if v is not None}))
