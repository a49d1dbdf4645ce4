"""GPT-2 (``model_type`` ``gpt2``): HF's ``GPT2Model`` (decoder-only, no cache), as a pure function.

Pre-LayerNorm blocks with causal self-attention and learned absolute positions, a final
``ln_f``. What the PyTorch model computes when it is given no ``position_ids``:

* position ids are ``0..T-1`` whatever the padding, in transformers 4.57 and 5.x alike: a
  left-padded row's first real token sits at position ``#pads``, so left and right padding
  give different hidden states (and classifier logits) for the same text, as in PyTorch;
* ``token_type_ids``, when given, are looked up in the *word* embedding ``wte`` and added;
* the attention mask hides padded keys on top of the causal mask.

Not reproduced: HF builds a block-diagonal "packed sequences" mask when ``position_ids`` are
given *without* an attention mask; flaxheads always has a mask (all ones when none is given),
so explicit ``position_ids`` only move the position embeddings here.

The params tree is HF ``FlaxGPT2Model``'s (``wte``, ``wpe``, ``h/<i>/...``, ``ln_f``): PyTorch's
``Conv1D`` weights are stored ``[in, out]`` and HF's PyTorch -> Flax rule transposes every
2-D ``weight``, so the Flax ``kernel`` of ``c_attn``/``c_proj``/``c_fc`` is ``[out, in]``
(:func:`conv1d`); the generic name maps in :mod:`~flaxheads.backbones.weights` carry it both ways.
"""

from __future__ import annotations

import math
from functools import partial
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from flaxheads.backbones.base import Backbone, BackboneError, HFConfig, activation_problem
from flaxheads.backbones.families.bert_shared import dropout_keys
from flaxheads.layers.activations import get_activation
from flaxheads.layers.attention import fused_qkv, self_attention
from flaxheads.layers.dropout import dropout
from flaxheads.layers.init import HFInit
from flaxheads.layers.masks import mask_bias
from flaxheads.layers.norms import layer_norm_p
from flaxheads.layers.remat import checkpointed, mlp_out
from flaxheads.runtime.plan import ComputePlan

#: The standard config names other code reads (``config.hidden_size``), as GPT2Config's attribute_map.
ALIASES = {
    "hidden_size": "n_embd",
    "num_attention_heads": "n_head",
    "num_hidden_layers": "n_layer",
    "max_position_embeddings": "n_positions",
}


def conv1d(x: jax.Array, p: dict) -> jax.Array:
    """GPT-2's ``Conv1D`` (a dense layer) with the Flax kernel ``[out, in]``."""
    return lax.dot_general(x, p["kernel"].astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ()))) + p["bias"].astype(
        x.dtype
    )


def block(
    p: dict,
    x: jax.Array,
    mask_bias: jax.Array,
    *,
    num_heads: int,
    eps: float,
    act,
    batch: int,
    scale: float,
    plan: ComputePlan,
    resid_dropout: float = 0.0,
    attn_dropout: float = 0.0,
    rng: jax.Array | None = None,
) -> jax.Array:
    """One GPT-2 block on the flattened activation ``x [B*T, H]``: ``x + attn(ln_1(x))``, then
    ``x + mlp(ln_2(x))``; ``scale`` multiplies the attention scores."""
    r_attn, r_out, r_mlp = jax.random.split(rng, 3) if rng is not None else (None, None, None)
    a = p["attn"]
    kq, kk, kv = jnp.split(a["c_attn"]["kernel"].T, 3, axis=1)
    bq, bk, bv = jnp.split(a["c_attn"]["bias"], 3)
    w, b = fused_qkv((kq, kk, kv), (bq, bk, bv), scale)
    ctx = self_attention(
        layer_norm_p(x, p["ln_1"], eps, plan),
        w,
        b,
        mask_bias,
        num_heads=num_heads,
        batch=batch,
        plan=plan,
        rate=attn_dropout,
        rng=r_attn,
        causal=True,
    )
    x = x + dropout(conv1d(ctx, a["c_proj"]), resid_dropout, r_out)
    m = p["mlp"]
    h = act(conv1d(layer_norm_p(x, p["ln_2"], eps, plan), m["c_fc"]))
    return x + dropout(mlp_out(conv1d(h, m["c_proj"])), resid_dropout, r_mlp)


def attention_scales(config) -> list[float]:
    """Each layer's score scale: ``1/sqrt(head_dim)`` (``scale_attn_weights``), divided by
    ``layer + 1`` under ``scale_attn_by_inverse_layer_idx``."""
    d = int(config.n_embd) // int(config.n_head)
    base = 1.0 / math.sqrt(d) if config.scale_attn_weights else 1.0
    return [base / (i + 1) if config.scale_attn_by_inverse_layer_idx else base for i in range(int(config.n_layer))]


def encode(
    params: dict,
    input_ids,
    attention_mask=None,
    position_ids=None,
    token_type_ids=None,
    *,
    config,
    plan: ComputePlan,
    dtype=jnp.float32,
    dropout_rng: jax.Array | None = None,
    train: bool = False,
    remat: bool | str = False,
) -> jax.Array:
    """GPT-2 forward: last hidden state ``[B, T, H]`` (after ``ln_f``) in ``dtype``. Pure in ``params``;
    ``plan`` is how the layers compute on this host.

    ``remat=True`` recomputes each block in the backward pass (gradient checkpointing)."""
    input_ids = jnp.asarray(input_ids)
    bsz, t = input_ids.shape
    attention_mask = jnp.ones_like(input_ids) if attention_mask is None else jnp.asarray(attention_mask)
    if position_ids is None:
        position_ids = jnp.broadcast_to(jnp.arange(t), (bsz, t))
    n, eps = int(config.n_layer), float(config.layer_norm_epsilon)
    emb_rng, rngs = dropout_keys(dropout_rng, n, train)
    wte = params["wte"]["embedding"]
    x = jnp.take(wte, input_ids, axis=0) + jnp.take(params["wpe"]["embedding"], position_ids, axis=0)
    if token_type_ids is not None:
        x = x + jnp.take(wte, token_type_ids, axis=0)
    rate = (lambda key: float(config[key] or 0.0)) if train else (lambda key: 0.0)
    x = dropout(x.astype(dtype), rate("embd_pdrop"), emb_rng).reshape(bsz * t, -1)
    bias = mask_bias(attention_mask, dtype)
    act = get_activation(config.activation_function, barrier=plan.activation_barrier)
    step = partial(
        block,
        num_heads=int(config.n_head),
        eps=eps,
        act=act,
        batch=bsz,
        plan=plan,
        resid_dropout=rate("resid_pdrop"),
        attn_dropout=rate("attn_pdrop"),
    )
    for i, scale in enumerate(attention_scales(config)):
        f = partial(step, scale=scale)
        # remat: what the backward pass keeps of the block, by policy; the rest is recomputed
        x = checkpointed(f, remat)(params["h"][str(i)], x, bias, rng=rngs[i])
    return layer_norm_p(x, params["ln_f"], eps, plan).reshape(bsz, t, -1)


def _is_buffer(name: str) -> bool:
    # older checkpoints carry the causal-mask buffers h.<i>.attn.bias / .masked_bias (no weights)
    module, _, leaf = name.rpartition(".")
    return module.endswith(".attn") and leaf in ("bias", "masked_bias")


class GPT2Backbone(Backbone):
    """GPT-2 on the params tree of HF ``FlaxGPT2Model``; see the module docstring for what it computes."""

    model_types = ("gpt2",)
    family = "GPT-2"
    base_model_prefix = "transformer"
    lora_targets = ("c_attn",)
    kernels_out_in = True  # Conv1D kernels [out, in]
    tokenizer_token_types = False
    # transformers' GPT2Config defaults
    defaults = {
        "vocab_size": 50257,
        "n_positions": 1024,
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "n_inner": None,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.1,
        "embd_pdrop": 0.1,
        "attn_pdrop": 0.1,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
    }
    features = frozenset({"position_ids", "token_type_ids", "remat", "bf16", "causal"})
    # HF FlaxGPT2Model's positional order: (input_ids, attention_mask, position_ids)
    extra_inputs = ("position_ids", "token_type_ids")
    top_level: ClassVar[tuple[str, ...]] = ("wte", "wpe", "h", "ln_f")

    @classmethod
    def complete_config(cls, config: HFConfig) -> HFConfig:
        """Defaults, plus ``hidden_size`` & co. as aliases of ``n_embd`` & co. (GPT2Config accepts both)."""
        config = super().complete_config(config)
        missing = {k: config[v] for k, v in ALIASES.items() if k not in config}
        return config.replace(**missing) if missing else config

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        why = None
        if config.get("add_cross_attention"):
            why = "add_cross_attention=True (cross-attention blocks); only the decoder-only GPT-2 is implemented"
        elif int(config.n_embd) % int(config.n_head):
            why = f"n_embd {config.n_embd} is not divisible by n_head {config.n_head}"
        else:
            why = activation_problem(config.activation_function)
        if why:
            raise BackboneError(
                f"flaxheads' GPT-2 backbone cannot run this config: {why}. Use a checkpoint "
                "without it, or implementation='hf_flax' (transformers < 5) if HF's Flax model has it."
            )

    @classmethod
    def init_params(cls, config, rng) -> dict:
        """HF's GPT-2 init: normal(initializer_range), the residual projections' (``c_proj``)
        divided by ``sqrt(2 * n_layer)``; kernels ``[out, in]``."""
        init = HFInit(rng, float(config.initializer_range))
        h, n = int(config.n_embd), int(config.n_layer)
        inner = int(config.n_inner or 4 * h)

        def conv(n_in, n_out, factor=1.0):
            return {"kernel": init.normal((n_out, n_in)) * factor, "bias": jnp.zeros(n_out)}

        res = 1.0 / math.sqrt(2 * n)
        blocks = {
            str(i): {
                "ln_1": init.norm(h),
                "attn": {"c_attn": conv(h, 3 * h), "c_proj": conv(h, h, res)},
                "ln_2": init.norm(h),
                "mlp": {"c_fc": conv(h, inner), "c_proj": conv(inner, h, res)},
            }
            for i in range(n)
        }
        return {
            "wte": init.embedding(int(config.vocab_size), h),
            "wpe": init.embedding(int(config.n_positions), h),
            "h": blocks,
            "ln_f": init.norm(h),
        }

    @classmethod
    def is_buffer(cls, name: str) -> bool:
        return _is_buffer(name)

    def encode(
        self,
        params,
        input_ids,
        attention_mask,
        *,
        train: bool = False,
        rng=None,
        position_ids=None,
        token_type_ids=None,
    ) -> jax.Array:
        return encode(
            params,
            input_ids,
            attention_mask,
            position_ids,
            token_type_ids,
            config=self.config,
            plan=self.plan,
            dtype=self.dtype,
            dropout_rng=rng,
            train=train,
            remat=self.remat_policy,
        )
