"""ModernBERT's config, read once: which layers attend locally, each kind's RoPE base, what
:func:`~flaxheads.backbones.families.modernbert.encode` cannot compute, and HF's initialiser.

Shared by the encoder (:mod:`~flaxheads.backbones.families.modernbert`) and the decoder
(:mod:`~flaxheads.backbones.families.modernbert_decoder`), which reads the config as ModernBERT does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from flaxheads.backbones.base import activation_problem
from flaxheads.layers.init import HFInit

GLOBAL, LOCAL = "full_attention", "sliding_attention"
#: ModernBertConfig's RoPE bases when a config names none.
DEFAULT_THETA = {GLOBAL: 160_000.0, LOCAL: 10_000.0}
TOP_LEVEL = ("embeddings", "layers", "final_norm")


# ---- config -----------------------------------------------------------------------------------------------
def layer_types(config) -> tuple[str, ...]:
    """Each layer's attention kind (:data:`GLOBAL` or :data:`LOCAL`)."""
    n = int(config.num_hidden_layers)
    if config.get("layer_types") is not None:
        return tuple(config["layer_types"])
    every = int(config.get("global_attn_every_n_layers") or 3)
    return tuple(LOCAL if i % every else GLOBAL for i in range(n))


def rope_theta(config, kind: str) -> float:
    """The RoPE base of the layers of ``kind``: transformers 5's ``rope_parameters[kind]``, else
    4.x's ``global_rope_theta`` / ``local_rope_theta`` (a ``None`` local base is the global one)."""
    rp = config.get("rope_parameters")
    if isinstance(rp, Mapping) and isinstance(rp.get(kind), Mapping) and "rope_theta" in rp[kind]:
        return float(rp[kind]["rope_theta"])
    global_theta = config.get("global_rope_theta")
    global_theta = DEFAULT_THETA[GLOBAL] if global_theta is None else float(global_theta)
    if kind == GLOBAL:
        return global_theta
    local = config.get("local_rope_theta", DEFAULT_THETA[LOCAL])
    return global_theta if local is None else float(local)


def _config_problem(config) -> str:
    """Why :func:`encode` would not compute what PyTorch computes for ``config`` ("" when it does)."""
    h, nh, n = int(config.hidden_size), int(config.num_attention_heads), int(config.num_hidden_layers)
    kinds = layer_types(config)
    rp = config.get("rope_parameters")
    scaled = {
        k: v.get("rope_type", "default")
        for k, v in (rp or {}).items()
        if isinstance(v, Mapping) and v.get("rope_type", "default") != "default"
    }
    legacy = config.get("rope_scaling") or {}  # transformers 4.x's one scaling for both kinds
    if legacy.get("rope_type", legacy.get("type", "default")) != "default":
        scaled["rope_scaling"] = legacy.get("rope_type", legacy.get("type"))
    if h % nh:
        return f"hidden_size {h} is not divisible by num_attention_heads {nh}"
    if activation_problem(config.hidden_activation):
        return activation_problem(config.hidden_activation)
    if (h // nh) % 2:
        return f"the head dim {h // nh} is odd; rotary embeddings rotate pairs of dims"
    if len(kinds) != n or set(kinds) - {GLOBAL, LOCAL}:
        return f"layer_types {list(kinds)} is not {n} entries of {GLOBAL!r} / {LOCAL!r}"
    every = config.get("global_attn_every_n_layers")
    if config.get("layer_types") is not None and every and kinds != layer_types(config.replace(layer_types=None)):
        # transformers 5 reads layer_types, 4.x global_attn_every_n_layers: two different models
        return (
            f"layer_types {list(kinds)} disagree with global_attn_every_n_layers={every} (transformers 5 "
            "reads the first, 4.x the second, so the checkpoint means two different models)"
        )
    if scaled:
        return f"rope_type {scaled}; only the 'default' rotary embedding is implemented"
    if LOCAL in kinds and int(config.local_attention) < 0:
        return f"local_attention {config.local_attention} is negative"
    return ""


@dataclasses.dataclass(frozen=True)
class Settings:
    """What :func:`encode` needs from the config besides the params."""

    num_heads: int
    eps: float
    act: str  # HF's name (``hidden_activation``); looked up with the compute plan's barrier where applied
    kinds: tuple[str, ...]
    thetas: tuple[tuple[str, float], ...]
    window_half: int
    pad_token_id: int | None
    embedding_dropout: float = 0.0
    attention_dropout: float = 0.0
    mlp_dropout: float = 0.0

    @classmethod
    def from_config(cls, config) -> Settings:
        kinds = layer_types(config)
        return cls(
            int(config.num_attention_heads),
            float(config.norm_eps),
            config.hidden_activation,
            kinds,
            tuple((k, rope_theta(config, k)) for k in sorted(set(kinds))),
            int(config.local_attention) // 2,
            config.get("pad_token_id"),
            float(config.embedding_dropout or 0.0),
            float(config.attention_dropout or 0.0),
            float(config.mlp_dropout or 0.0),
        )


class _TruncatedInit(HFInit):
    """HF ModernBERT's initialiser: truncated normal within ``cutoff`` standard deviations, a
    smaller std for the output projections; zero biases, unit norm scales."""

    def __init__(self, rng, std: float, cutoff: float):
        super().__init__(rng, std)
        self.cutoff = float(cutoff)

    def normal(self, shape, std: float | None = None):
        self._n += 1
        key = jax.random.fold_in(self.rng, self._n)
        return (self.std if std is None else std) * jax.random.truncated_normal(key, -self.cutoff, self.cutoff, shape)

    def linear(self, n_in: int, n_out: int, bias: bool, std: float | None = None) -> dict:
        return {"kernel": self.normal((n_in, n_out), std), **({"bias": jnp.zeros(n_out)} if bias else {})}
