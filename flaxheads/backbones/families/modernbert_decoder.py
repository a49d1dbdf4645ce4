"""The ModernBERT decoder (``model_type`` ``modernbert-decoder``, the Ettin decoders) as a pure function.

What transformers 5's ``ModernBertDecoderModel`` computes with ``attn_implementation`` ``"eager"``
or ``"sdpa"`` and no cache: ModernBERT (:mod:`~flaxheads.backbones.families.modernbert`) made causal,

* token embeddings (``tok_embeddings``), LayerNorm, ``embedding_dropout``;
* pre-LayerNorm layers (layer 0 without ``attn_norm``): ``x + dropout(Wo(attention(attn_norm(x))))``,
  then ``x + mlp(mlp_norm(x))`` with ModernBERT's GeGLU MLP (``Wi`` -> input, gate halves);
* attention with separate ``q_proj`` / ``k_proj`` / ``v_proj`` (no fused ``Wqkv``), rotary
  embeddings on positions ``0..T-1`` whatever the padding (rotated in float32), the causal mask and
  the key padding mask; *sliding* layers also only see the last ``local_attention // 2`` positions
  (``kv > q - local_attention // 2``, the window transformers stores as ``sliding_window``), *full*
  layers every earlier one. ``layer_types`` (or every ``global_attn_every_n_layers``-th layer from
  layer 0) and one RoPE base per kind, read as ModernBERT reads them (transformers 5: the sliding
  layers' own base; transformers 4.57 rotated both kinds with the global base, so a checkpoint
  whose two bases differ gives other outputs there);
* ``attention_dropout`` on the probabilities and after ``Wo``; ``final_norm``.

The params tree follows the PyTorch names (``embeddings/tok_embeddings``, ``layers/<i>/attn/q_proj``,
``attn/Wo``, ``mlp/Wi``, ``mlp/Wo``, ``attn_norm``, ``mlp_norm``, ``final_norm``) with Flax leaves.
Its classifier (preset ``modernbert-decoder``) runs ModernBERT's head on the last non-pad token.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from functools import partial

import jax
import jax.numpy as jnp

from flaxheads.backbones.base import Backbone, BackboneError, HFConfig
from flaxheads.backbones.families import modernbert as mb
from flaxheads.backbones.families import modernbert_config as mbc
from flaxheads.backbones.families.bert_shared import dropout_keys
from flaxheads.backbones.families.decoder import attend_textbook, attention_mask_for
from flaxheads.layers.attention import attend_chunked
from flaxheads.layers.dense import embedding_lookup
from flaxheads.layers.dropout import dropout
from flaxheads.layers.masks import mask_bias
from flaxheads.layers.positions import apply_rotary, rotary_cos_sin
from flaxheads.layers.remat import attention_out, checkpointed
from flaxheads.runtime.plan import ComputePlan

TOP_LEVEL = mbc.TOP_LEVEL


def _config_problem(config) -> str:
    """Why :func:`encode` would not compute what PyTorch computes for ``config`` ("" when it does)."""
    local = config.get("local_attention")
    if mbc.LOCAL in mbc.layer_types(config) and (not isinstance(local, int) or local < 2):
        return (
            f"local_attention {local!r} with sliding-attention layers (their window is local_attention // 2 "
            "positions: give a positive even number)"
        )
    return mbc._config_problem(config.replace(local_attention=local or 0))


@dataclasses.dataclass(frozen=True)
class Settings:
    """What :func:`encode` needs from the config besides the params."""

    num_heads: int
    eps: float
    act: str
    kinds: tuple[str, ...]
    thetas: tuple[tuple[str, float], ...]
    window: int  # a sliding layer's query sees the keys q - window < k <= q
    pad_token_id: int | None
    embedding_dropout: float = 0.0
    attention_dropout: float = 0.0
    mlp_dropout: float = 0.0

    @classmethod
    def from_config(cls, config) -> Settings:
        kinds = mbc.layer_types(config)
        return cls(
            int(config.num_attention_heads),
            float(config.norm_eps),
            config.hidden_activation,
            kinds,
            tuple((k, mbc.rope_theta(config, k)) for k in sorted(set(kinds))),
            int(config.get("local_attention") or 0) // 2,
            config.get("pad_token_id"),
            float(config.embedding_dropout or 0.0),
            float(config.attention_dropout or 0.0),
            float(config.mlp_dropout or 0.0),
        )


def attention(
    p: Mapping,
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    keep: jax.Array | None,
    bias: jax.Array,
    *,
    s: Settings,
    rate: float,
    rng,
    plan: ComputePlan,
) -> jax.Array:
    """q/k/v projections -> rotary q, k (in float32) -> causal attention (``keep``: a sliding layer's
    ``[B, 1, T, T]`` mask; None: a full layer) -> ``Wo``, on ``x [B, T, H]``."""
    b, t, h = x.shape
    d = h // s.num_heads
    q, k, v = (mb.linear(x, p[n], plan).reshape(b, t, s.num_heads, d) for n in ("q_proj", "k_proj", "v_proj"))
    c32, s32 = cos.astype(jnp.float32), sin.astype(jnp.float32)
    q, k = (apply_rotary(a.astype(jnp.float32), c32, s32).astype(x.dtype) for a in (q, k))
    if keep is None:
        ctx = attend_chunked(
            q * jnp.asarray(1.0 / math.sqrt(d), q.dtype), k, v, bias, plan=plan, rate=rate, rng=rng, causal=True
        )
    else:
        ctx = attend_textbook(q, k, v, keep, scaling=1.0 / math.sqrt(d), softcap=None, rate=rate, rng=rng)
    return mb.linear(attention_out(ctx).reshape(b, t, h), p["Wo"], plan)


def layer(
    p: Mapping,
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    keep,
    bias: jax.Array,
    rng=None,
    *,
    s: Settings,
    plan: ComputePlan,
) -> jax.Array:
    """One pre-LayerNorm decoder layer on ``x [B, T, H]`` (no ``attn_norm`` in ``p``: identity)."""
    r_attn, r_out, r_mlp = jax.random.split(rng, 3) if rng is not None else (None, None, None)
    rate = s.attention_dropout if rng is not None else 0.0
    h = mb.norm(x, p["attn_norm"], s.eps, plan) if "attn_norm" in p else x
    a = attention(p["attn"], h, cos, sin, keep, bias, s=s, rate=rate, rng=r_attn, plan=plan)
    x = x + dropout(a, s.attention_dropout, r_out)
    return x + mb.glu_mlp(p["mlp"], mb.norm(x, p["mlp_norm"], s.eps, plan), s.act, s.mlp_dropout, r_mlp, plan)


def encode(
    params: Mapping,
    input_ids,
    attention_mask=None,
    position_ids=None,
    *,
    settings: Settings,
    plan: ComputePlan,
    dtype=jnp.float32,
    train: bool = False,
    rng: jax.Array | None = None,
    remat: bool | str = False,
) -> jax.Array:
    """The last hidden state ``[B, T, H]`` (after ``final_norm``) in ``dtype``; pure in ``params``.
    ``remat=True`` recomputes each layer in the backward pass."""
    s = settings
    input_ids = jnp.asarray(input_ids)
    t = input_ids.shape[1]
    attention_mask = jnp.ones_like(input_ids) if attention_mask is None else jnp.asarray(attention_mask)
    position_ids = jnp.arange(t) if position_ids is None else jnp.asarray(position_ids)
    emb_rng, rngs = dropout_keys(rng, len(s.kinds), train)
    e = params["embeddings"]
    x = embedding_lookup(e["tok_embeddings"]["embedding"], input_ids, s.pad_token_id).astype(dtype)
    x = dropout(mb.norm(x, e["norm"], s.eps, plan), s.embedding_dropout, emb_rng)
    d = x.shape[-1] // s.num_heads
    rotary = {kind: rotary_cos_sin(position_ids, d, theta, dtype) for kind, theta in s.thetas}
    keep = attention_mask_for(attention_mask, s.window) if mbc.LOCAL in s.kinds else None
    bias = mask_bias(attention_mask, dtype)
    step = checkpointed(partial(layer, s=s, plan=plan), remat)
    for i, (kind, r) in enumerate(zip(s.kinds, rngs, strict=True)):
        x = step(params["layers"][str(i)], x, *rotary[kind], keep if kind == mbc.LOCAL else None, bias, r)
    return mb.norm(x, params["final_norm"], s.eps, plan)


class ModernBertDecoderBackbone(Backbone):
    """The ModernBERT decoder on a params tree named after PyTorch's modules (see the module docstring)."""

    model_types = ("modernbert-decoder",)
    family = "ModernBERT decoder"
    base_model_prefix = "model"
    classifier_dropout_key = "classifier_dropout"
    lora_targets = ("q_proj", "v_proj")
    tokenizer_token_types = False
    top_level = TOP_LEVEL
    # transformers' ModernBertDecoderConfig defaults (the attention pattern and RoPE bases: layer_types / rope_theta)
    defaults = {
        **{k: v for k, v in mb.ModernBertBackbone.defaults.items() if k != "classifier_pooling"},
        "decoder_bias": True,
        "tie_word_embeddings": True,
    }
    features = frozenset({"position_ids", "remat", "bf16", "causal"})
    extra_inputs = ("position_ids",)
    settings_class = Settings

    @classmethod
    def check_config(cls, config: HFConfig) -> None:
        super().check_config(config)
        why = _config_problem(config)
        if why:
            raise BackboneError(
                f"flaxheads' ModernBERT decoder backbone cannot run this config: {why}. Use a "
                "checkpoint without it, or fix config.json if the value is wrong."
            )

    @classmethod
    def init_params(cls, config, rng) -> dict:
        """HF's init: truncated normal (``initializer_cutoff_factor`` std), a smaller std for ``Wo``s."""
        std = float(config.initializer_range)
        cutoff = config.get("initializer_cutoff_factor")
        init = mbc._TruncatedInit(rng, std, 3.0 if cutoff is None else cutoff)
        h, ff, n = int(config.hidden_size), int(config.intermediate_size), int(config.num_hidden_layers)
        out_std = std / math.sqrt(2.0 * n)
        nb, ab, mlp_b = bool(config.norm_bias), bool(config.attention_bias), bool(config.mlp_bias)
        layers = {}
        for i in range(n):
            lp = {} if i == 0 else {"attn_norm": init.norm(h, nb)}
            lp["attn"] = {
                **{k: init.linear(h, h, ab) for k in ("q_proj", "k_proj", "v_proj")},
                "Wo": init.linear(h, h, ab, out_std),
            }
            lp["mlp_norm"] = init.norm(h, nb)
            lp["mlp"] = {"Wi": init.linear(h, 2 * ff, mlp_b), "Wo": init.linear(ff, h, mlp_b, out_std)}
            layers[str(i)] = lp
        return {
            "embeddings": {
                "tok_embeddings": {"embedding": init.normal((int(config.vocab_size), h))},
                "norm": init.norm(h, nb),
            },
            "layers": layers,
            "final_norm": init.norm(h, nb),
        }

    def encode(
        self, params, input_ids, attention_mask, *, train: bool = False, rng=None, position_ids=None
    ) -> jax.Array:
        return encode(
            params,
            input_ids,
            attention_mask,
            position_ids,
            settings=self.settings,
            plan=self.plan,
            dtype=self.dtype,
            train=train,
            rng=rng,
            remat=self.remat_policy,
        )
