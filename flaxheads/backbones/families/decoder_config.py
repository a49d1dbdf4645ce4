"""The per-family switches of the decoder-LLM backbone, read from a ``config.json`` once.

Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2 and Gemma 3 (text) are one computation with
switches; :func:`decoder_spec` is the one place that decides each switch from the config,
as transformers 5's PyTorch classes read it:

=============== ======== ========= ======== ============ ============================ ============
family          norm     emb scale q/k norm post-norms   sliding layers               attn scale
=============== ======== ========= ======== ============ ============================ ============
llama           x*w      -         -        -            none                         head_dim
mistral         x*w      -         -        -            all, when ``sliding_window``  head_dim
qwen2 / qwen3   x*w      -         qwen3    -            ``layer_types``              head_dim
gemma           x*(1+w)  sqrt(H)   -        -            none                         head_dim
gemma2          x*(1+w)  sqrt(H)   -        yes          ``layer_types``              query_pre_attn_scalar
gemma3_text     x*(1+w)  sqrt(H)   yes      yes          ``layer_types``              query_pre_attn_scalar
eurobert        x*w      -         -        -            none                         head_dim
=============== ======== ========= ======== ============ ============================ ============

Attention is causal, except EuroBERT's (an encoder: every layer sees every real token) and Gemma 3's
with ``use_bidirectional_attention`` (EmbeddingGemma): full layers see every real token, sliding
layers the keys within ``sliding_window // 2`` positions either side (transformers turns the
window of ``config.json`` into ``sliding_window // 2 + 1``, exclusive, and writes it back undone).

RoPE: ``rope_parameters`` (transformers 5; Gemma 3 one dict per layer type) or the older
``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq`` keys, with the types
``default``, ``linear``, ``llama3``, ``yarn`` and ``dynamic`` (inference-time NTK scaling:
equal to ``default`` up to ``max_position_embeddings`` tokens, refused past it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from flaxheads.backbones.base import BackboneError, HFConfig, activation_problem

MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
#: PyTorch sequence-classification class of each model type (all GenericForSequenceClassification)
HF_CLASSES = {
    "llama": "LlamaForSequenceClassification",
    "mistral": "MistralForSequenceClassification",
    "qwen2": "Qwen2ForSequenceClassification",
    "qwen3": "Qwen3ForSequenceClassification",
    "gemma": "GemmaForSequenceClassification",
    "gemma2": "Gemma2ForSequenceClassification",
    "gemma3_text": "Gemma3TextForSequenceClassification",
}
GEMMA = ("gemma", "gemma2", "gemma3_text")
SLIDING, FULL = "sliding_attention", "full_attention"
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")

_COMMON = {
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "tie_word_embeddings": False,
}
#: transformers 5's config-class defaults for the keys a config.json may omit (RoPE and layer
#: types are derived in :func:`decoder_spec`, never written back)
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        **_COMMON,
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "mlp_bias": False,
        "pad_token_id": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "mistral": {
        **_COMMON,
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_act": "silu",
        "max_position_embeddings": 4096 * 32,
        "sliding_window": 4096,
        "pad_token_id": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen2": {
        **_COMMON,
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "pad_token_id": None,
    },
    "qwen3": {
        **_COMMON,
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "pad_token_id": None,
    },
    "gemma": {
        **_COMMON,
        "vocab_size": 256000,
        "hidden_size": 3072,
        "intermediate_size": 24576,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "tie_word_embeddings": True,
    },
    "gemma2": {
        **_COMMON,
        "vocab_size": 256000,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    "gemma3_text": {
        **_COMMON,
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    },
    # EuroBertConfig (served by flaxheads.backbones.families.eurobert, a bidirectional Llama)
    "eurobert": {
        **_COMMON,
        "vocab_size": 128256,
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "mlp_bias": False,
        "pad_token_id": 128001,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "mask_token_id": 128002,
        "classifier_pooling": "late",
    },
}


@dataclasses.dataclass(frozen=True)
class Rope:
    """One rotary table: ``inv_freq`` (float32, as transformers computes it) and the factor
    on cos/sin (YaRN's attention factor; 1 otherwise); ``max_len``: longest sequence it is exact for."""

    inv_freq: tuple[float, ...]
    scaling: float = 1.0
    max_len: int | None = None


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    """Everything the forward pass needs from the config (hashable: a static argument)."""

    model_type: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    activation: str
    gemma_norm: bool  # RMSNorm x * (1 + w) computed in float32 (else Llama's: w * x.to(dtype))
    embed_scale: float | None  # Gemma: embeddings times sqrt(hidden), in the activation dtype
    qk_norm: bool  # RMSNorm over each head of q and k (Qwen3, Gemma 3)
    sandwich: bool  # Gemma 2/3: post-attention, pre- and post-feed-forward norms
    scaling: float
    softcap: float | None
    windows: tuple[int | None, ...]  # per layer: sliding window (keys within the last w positions) or None
    ropes: tuple[Rope, ...]  # per layer
    attention_dropout: float
    pad_token_id: int | None
    # False: no causal mask (EuroBERT, EmbeddingGemma); a sliding window is then ``|q - k| <= window``
    causal: bool = True


def _fail(config: Mapping, why: str) -> BackboneError:
    return BackboneError(
        f"flaxheads' decoder backbone cannot run this {config.get('model_type')} config: {why}. "
        "Use a checkpoint without it."
    )


def layer_types(config: Mapping) -> list[str]:
    """Each layer's attention kind as transformers 5 derives it when ``layer_types`` is absent."""
    mt, n = config["model_type"], int(config["num_hidden_layers"])
    if mt == "mistral":  # MistralModel ignores layer_types: one mask for every layer
        return [SLIDING if config.get("sliding_window") is not None else FULL] * n
    if mt in ("llama", "gemma", "eurobert"):
        return [FULL] * n
    given = config.get("layer_types")
    if given is not None:
        if len(given) != n or any(t not in (SLIDING, FULL) for t in given):
            raise _fail(config, f"layer_types {given!r} (expected {n} entries of {SLIDING!r} / {FULL!r})")
        return list(given)
    if mt in ("qwen2", "qwen3"):
        on = config.get("use_sliding_window") and config.get("sliding_window") is not None
        return [SLIDING if on and i >= int(config["max_window_layers"]) else FULL for i in range(n)]
    pattern = 2 if mt == "gemma2" else int(config.get("sliding_window_pattern") or 6)
    return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]


def _window(config: Mapping) -> int | None:
    if config["model_type"] in ("qwen2", "qwen3") and not config.get("use_sliding_window"):
        return None  # Qwen2Config sets sliding_window = None unless use_sliding_window
    w = config.get("sliding_window")
    return None if w is None else int(w)


def rope_parameters(config: Mapping) -> dict[str, dict]:
    """``{layer type: RoPE parameters}`` from ``rope_parameters`` or the older keys, completed as
    transformers 5's ``standardize_rope_params`` does."""
    mt = config["model_type"]
    given = config.get("rope_parameters")
    if mt == "gemma3_text":
        if given is not None and (FULL in given or SLIDING in given):
            out = {t: dict(given.get(t) or {"rope_type": "default"}) for t in (FULL, SLIDING)}
        else:
            out = {
                FULL: {"rope_type": "default", **(given or config.get("rope_scaling") or {})},
                SLIDING: {"rope_type": "default"},
            }
        out[FULL].setdefault("rope_theta", config.get("rope_theta") or 1_000_000.0)
        out[SLIDING].setdefault("rope_theta", config.get("rope_local_base_freq") or 10_000.0)
    else:
        flat = dict(given or config.get("rope_scaling") or {})
        flat.setdefault("rope_theta", config.get("rope_theta") or 10_000.0)
        out = {FULL: flat, SLIDING: flat}
    for p in out.values():
        p.setdefault("rope_type", p.get("type", "default"))
        if p["rope_type"] in ("llama3", "yarn"):
            p.setdefault("original_max_position_embeddings", int(config["max_position_embeddings"]))
    return out


def _base_inv_freq(theta: float, dim: int, factor: float = 1.0) -> np.ndarray:
    # float32 throughout, as torch: 1 / (base ** (arange(0, dim, 2) / dim))
    exps = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / (np.float32(factor) * np.float32(theta) ** exps)).astype(np.float32)


def _llama3(p: dict, dim: int) -> np.ndarray:
    inv = _base_inv_freq(float(p["rope_theta"]), dim)
    factor, lo, hi = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(p: dict, dim: int, max_pos: int) -> tuple[np.ndarray, float]:
    base, orig = float(p["rope_theta"]), int(p["original_max_position_embeddings"])
    factor = p.get("factor") or max_pos / orig

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = p.get("attention_factor")
    if att is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        att = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)

    def corr_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(p.get("beta_fast") or 32), corr_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extra = 1 - ramp
    pos = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    inv = (1.0 / (factor * pos)) * (1 - extra) + (1.0 / pos) * extra
    return inv.astype(np.float32), float(att)


def make_rope(config: Mapping, p: dict, head_dim: int) -> Rope:
    kind = p["rope_type"]
    if kind not in ROPE_TYPES:
        raise _fail(config, f"RoPE type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    if float(p.get("partial_rotary_factor", 1.0)) != 1.0:
        raise _fail(config, f"partial_rotary_factor {p['partial_rotary_factor']} (RoPE on part of each head)")
    theta, max_pos = float(p["rope_theta"]), int(config["max_position_embeddings"])
    if kind == "default":
        return Rope(tuple(_base_inv_freq(theta, head_dim).tolist()))
    if kind == "linear":
        inv = _base_inv_freq(theta, head_dim) / np.float32(p["factor"])
        return Rope(tuple(inv.astype(np.float32).tolist()))
    if kind == "llama3":
        return Rope(tuple(_llama3(p, head_dim).tolist()))
    if kind == "yarn":
        inv, att = _yarn(p, head_dim, max_pos)
        return Rope(tuple(inv.tolist()), att)
    # dynamic NTK: PyTorch rescales only once a sequence is longer than max_position_embeddings
    return Rope(tuple(_base_inv_freq(theta, head_dim).tolist()), max_len=max_pos)


def check_decoder_config(config: HFConfig) -> None:
    """Raise :class:`BackboneError` for settings the decoder backbone does not compute (a config of
    one of its :data:`MODEL_TYPES`: :meth:`~flaxheads.backbones.base.Backbone.check_config` refuses others)."""
    heads, kv = int(config.num_attention_heads), int(config.get("num_key_value_heads") or config.num_attention_heads)
    if heads % kv:
        raise _fail(config, f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    if config.get("use_bidirectional_attention") and config["model_type"] != "gemma3_text":
        raise _fail(
            config,
            "use_bidirectional_attention=True; flaxheads computes bidirectional attention for "
            "gemma3_text (EmbeddingGemma) and eurobert only, other decoders causally",
        )
    why = activation_problem(_activation(config))
    if why:
        raise _fail(config, why)
    decoder_spec(config)  # RoPE and layer types


def _activation(config: Mapping) -> str | None:
    if config["model_type"] in ("gemma2", "gemma3_text"):
        return config.get("hidden_activation") or "gelu_pytorch_tanh"
    act = config.get("hidden_act")
    # GemmaConfig reads the released checkpoints' "gelu" as the tanh approximation they were trained with
    return "gelu_pytorch_tanh" if config["model_type"] == "gemma" and act in ("gelu", None) else act


def decoder_spec(config: Mapping) -> DecoderSpec:
    """The :class:`DecoderSpec` of a completed config (see the module docstring's table)."""
    mt = config["model_type"]
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    types = layer_types(config)
    window = _window(config)
    ropes = {t: make_rope(config, p, head_dim) for t, p in rope_parameters(config).items()}
    gemma_scaled = mt in ("gemma2", "gemma3_text")
    bidirectional = mt == "gemma3_text" and bool(config.get("use_bidirectional_attention"))
    if bidirectional and window is not None:
        window //= 2  # keys within window // 2 positions either side (see the module docstring)
    softcap = config.get("attn_logit_softcapping") if gemma_scaled else None
    activation = _activation(config)
    if activation is None:  # check_decoder_config says so first
        raise _fail(config, activation_problem(activation))
    return DecoderSpec(
        model_type=mt,
        num_layers=int(config["num_hidden_layers"]),
        hidden=int(config["hidden_size"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        intermediate=int(config["intermediate_size"]),
        eps=float(config["rms_norm_eps"]),
        activation=activation,
        gemma_norm=mt in GEMMA,
        embed_scale=float(config["hidden_size"]) ** 0.5 if mt in GEMMA else None,
        qk_norm=mt in ("qwen3", "gemma3_text"),
        sandwich=gemma_scaled,
        scaling=float(config["query_pre_attn_scalar"]) ** -0.5 if gemma_scaled else head_dim**-0.5,
        softcap=None if softcap is None else float(softcap),
        windows=tuple(window if t == SLIDING else None for t in types),
        ropes=tuple(ropes[t] for t in types),
        attention_dropout=float(config.get("attention_dropout") or 0.0),
        pad_token_id=None if config.get("pad_token_id") is None else int(config["pad_token_id"]),
        causal=not bidirectional and mt != "eurobert",
    )
