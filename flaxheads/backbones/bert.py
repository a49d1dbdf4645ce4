"""A BERT-family encoder of flaxheads' own, on HF ``FlaxBertModel``'s parameter tree.

Why it exists: on CPU, HF's Flax BERT spends more time in the glue around its matmuls
(separate q/k/v projections, 4-D reshapes per head, the mask broadcast, flax's LayerNorm)
than PyTorch does. This encoder computes the same function with

* one fused q/k/v matmul per layer on a 2-D ``[B*T, H]`` activation (the kernel is
  concatenated inside the jitted program, so the params keep HF's tree and names),
* the attention scale folded into ``q`` (``B*T*H`` multiplies instead of ``B*nh*T*T``),
* the additive mask built once per forward, reused by every layer and carried inside the
  score matmul; softmax normalisation applied to the context (see :func:`~flaxheads.backbones.layers.attend`),
* a two-pass LayerNorm in the compute dtype,

and nothing else: parameters, their names and shapes, dropout placement and the outputs
are HF's (parity-tested against ``FlaxBertModel`` and PyTorch ``BertModel`` to 1e-4).

:class:`BertBackbone` is this module's implementation of the backbone contract
(:mod:`flaxheads.backbones.base`).
"""
from __future__ import annotations

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..nn.activations import get_activation
from .base import Backbone, BackboneError
from .layers import attend, attention_chunks, dense, dropout, layer_norm_p, mask_bias
from .weights import pick, torch_from_tree, tree_from_torch

#: ``model_type`` values whose encoder is BERT's (same tree, same math).
SUPPORTED_MODEL_TYPES = ("bert",)


def supports(config) -> tuple[bool, str]:
    """Whether :class:`BertBackbone` computes exactly what HF's model for ``config`` does.

    Returns ``(ok, reason)``; ``reason`` says what is unsupported when ``ok`` is False."""
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        return False, f"model_type {mt!r} is not one of {SUPPORTED_MODEL_TYPES}"
    pet = getattr(config, "position_embedding_type", "absolute")
    if pet != "absolute":
        return False, f"position_embedding_type {pet!r} (only 'absolute')"
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        return False, "decoder / cross-attention configs"
    if config.hidden_size % config.num_attention_heads:
        return False, "hidden_size not divisible by num_attention_heads"
    try:
        get_activation(config.hidden_act)
    except ValueError:
        return False, f"hidden_act {config.hidden_act!r}"
    return True, ""


def embed(params: dict, input_ids, token_type_ids, position_ids, *, eps: float, dtype) -> jax.Array:
    """Word + position + token-type embeddings, LayerNorm: ``[B, T, H]``."""
    e = params["embeddings"]
    x = (jnp.take(e["word_embeddings"]["embedding"], input_ids, axis=0)
         + jnp.take(e["position_embeddings"]["embedding"], position_ids, axis=0)
         + jnp.take(e["token_type_embeddings"]["embedding"], token_type_ids, axis=0))
    return layer_norm_p(x.astype(dtype), e["LayerNorm"], eps)


def layer(p: dict, x: jax.Array, mask_bias: jax.Array, *, num_heads: int, eps: float, act, batch: int,
          hidden_dropout: float = 0.0, attn_dropout: float = 0.0, rng: jax.Array | None = None,
          attn_chunks: int | str = "auto", ffn_chunks: int = 1) -> jax.Array:
    """One BERT layer on the flattened activation ``x [B*T, H]``; ``mask_bias [B, 1, 1, T]``."""
    bt, h = x.shape
    t, d = bt // batch, h // num_heads
    a = p["attention"]["self"]
    # One matmul for q, k and v; the 1/sqrt(d) scale goes on q's kernel and bias (H*H + H
    # multiplies) instead of on the [B, nh, T, T] scores.
    scale = 1.0 / math.sqrt(d)
    w = jnp.concatenate([a["query"]["kernel"] * scale, a["key"]["kernel"], a["value"]["kernel"]], axis=1)
    # The key bias adds q . b_k to every score of a query row, which softmax cancels: it has no
    # effect on the output and its exact gradient is 0. Autodiff returns rounding noise
    # instead, which Adam's g / (|g| + eps) turns into lr-sized steps that differ with the
    # batch shape; stop_gradient gives the exact 0.
    b = jnp.concatenate([a["query"]["bias"] * scale, lax.stop_gradient(a["key"]["bias"]), a["value"]["bias"]])
    qkv = (x @ w.astype(x.dtype) + b.astype(x.dtype)).reshape(batch, t, 3, num_heads, d)
    if rng is not None:
        r_attn, r_out, r_ffn = jax.random.split(rng, 3)
    else:
        r_attn = r_out = r_ffn = None
    n = attention_chunks(batch, num_heads, t, jnp.dtype(x.dtype).itemsize, attn_chunks)
    parts = []
    # Independent batch chunks: XLA's CPU runtime runs them concurrently, so the
    # (single-threaded) softmax/mask fusions of one chunk overlap the other's. Split (not
    # sliced) so the backward pass concatenates the chunks' gradients instead of adding
    # zero-padded full-size copies of them.
    chunks = jnp.split(qkv, n, axis=0) if n > 1 else [qkv]
    biases = jnp.split(mask_bias, n, axis=0) if n > 1 else [mask_bias]
    for c in range(n):
        q, k, v = (a.squeeze(2) for a in jnp.split(chunks[c], 3, axis=2))
        r = None if r_attn is None else jax.random.fold_in(r_attn, c)
        parts.append(attend(q, k, v, biases[c], attn_dropout, r))
    ctx = (parts[0] if n == 1 else jnp.concatenate(parts, axis=0)).reshape(bt, h)
    o = p["attention"]["output"]
    x = layer_norm_p(dropout(dense(ctx, o["dense"]), hidden_dropout, r_out) + x, o["LayerNorm"], eps)
    return _ffn(p, x, eps=eps, act=act, hidden_dropout=hidden_dropout, rng=r_ffn, chunks=ffn_chunks)


def _ffn(p: dict, x: jax.Array, *, eps: float, act, hidden_dropout: float, rng, chunks: int) -> jax.Array:
    """dense -> act -> dense -> dropout -> residual -> LayerNorm, in ``chunks`` independent row blocks."""
    rows = x.shape[0]
    n = chunks if chunks > 1 and rows % chunks == 0 else 1
    outs = []
    for c in range(n):
        xc = x[c * rows // n:(c + 1) * rows // n]
        inter = act(dense(xc, p["intermediate"]["dense"]))
        r = None if rng is None else (rng if n == 1 else jax.random.fold_in(rng, c))
        out = dropout(dense(inter, p["output"]["dense"]), hidden_dropout, r)
        outs.append(layer_norm_p(out + xc, p["output"]["LayerNorm"], eps))
    return outs[0] if n == 1 else jnp.concatenate(outs, axis=0)


def encode(params: dict, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, *, config,
           dtype=jnp.float32, dropout_rng: jax.Array | None = None, train: bool = False,
           attn_chunks: int | str = "auto", ffn_chunks: int = 1, remat: bool = False) -> jax.Array:
    """BERT encoder forward: last hidden state ``[B, T, H]`` in ``dtype``. Pure in ``params``.

    ``attn_chunks`` splits attention into independent batch chunks (see
    :func:`attention_chunks`); it changes speed only, never the result. ``remat=True``
    recomputes each layer in the backward pass (gradient checkpointing): same values and
    gradients, less activation memory."""
    input_ids = jnp.asarray(input_ids)
    bsz, t = input_ids.shape
    if attention_mask is None:
        attention_mask = jnp.ones_like(input_ids)
    if token_type_ids is None:
        token_type_ids = jnp.zeros_like(input_ids)
    if position_ids is None:
        position_ids = jnp.broadcast_to(jnp.arange(t), (bsz, t))
    if train and dropout_rng is None:
        raise ValueError("train=True needs a dropout_rng (dropout is active in training)")
    eps = float(config.layer_norm_eps)
    x = embed(params, input_ids, token_type_ids, position_ids, eps=eps, dtype=dtype)
    hd = float(config.hidden_dropout_prob or 0.0) if train else 0.0
    ad = float(config.attention_probs_dropout_prob or 0.0) if train else 0.0
    rngs = list(jax.random.split(dropout_rng, config.num_hidden_layers + 1)) if train else [None] * (
        config.num_hidden_layers + 1)
    x = dropout(x, hd, rngs[-1])
    bias = mask_bias(attention_mask, dtype)
    act = get_activation(config.hidden_act)
    x = x.reshape(bsz * t, -1)
    layers = params["encoder"]["layer"]
    step = partial(layer, num_heads=config.num_attention_heads, eps=eps, act=act, batch=bsz, hidden_dropout=hd,
                   attn_dropout=ad, attn_chunks=attn_chunks, ffn_chunks=ffn_chunks)
    if remat:
        # Keep only each layer's input for the backward pass and recompute the rest: activation
        # memory stops growing with the layer count (long sequences), ~1 extra forward of compute.
        step = jax.checkpoint(step)
    for i in range(config.num_hidden_layers):
        x = step(layers[str(i)], x, bias, rng=rngs[i])
    return x.reshape(bsz, t, -1)


class BertBackbone(Backbone):
    """BERT (``model_type`` ``bert``): HF's ``BertModel`` without its pooler, as a pure function.

    The params tree is HF ``FlaxBertModel``'s (``embeddings``, ``encoder/layer/<i>/...``), so
    checkpoints written with HF's Flax BERT load unchanged. ``attn_chunks`` splits attention
    into independent batch chunks (speed only; see :func:`~flaxheads.backbones.layers.attention_chunks`)."""

    model_types = SUPPORTED_MODEL_TYPES
    base_model_prefix = "bert"
    defaults = {"hidden_act": "gelu", "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
                "layer_norm_eps": 1e-12, "type_vocab_size": 2, "position_embedding_type": "absolute",
                "pad_token_id": 0, "initializer_range": 0.02, "max_position_embeddings": 512}
    features = frozenset({"token_type_ids", "position_ids", "remat", "bf16"})
    extra_inputs = ("token_type_ids", "position_ids")

    def __init__(self, config, params: dict, dtype=jnp.float32, remat: bool = False,
                 attn_chunks: int | str = "auto"):
        super().__init__(config, params, dtype=dtype, remat=remat)
        self.attn_chunks = attn_chunks

    @classmethod
    def check_config(cls, config) -> None:
        ok, why = supports(config)
        if not ok:
            raise BackboneError(f"flaxheads' BERT backbone cannot run this config: {why}")

    @classmethod
    def init_params(cls, config, rng) -> dict:
        h, i, std = int(config.hidden_size), int(config.intermediate_size), float(config.initializer_range)
        keys = iter(jax.random.split(rng, 4 + 6 * int(config.num_hidden_layers)))

        def lin(n_in, n_out):
            return {"kernel": std * jax.random.normal(next(keys), (n_in, n_out)), "bias": jnp.zeros(n_out)}

        def emb(n):
            return {"embedding": std * jax.random.normal(next(keys), (n, h))}

        def ln():
            return {"scale": jnp.ones(h), "bias": jnp.zeros(h)}

        layers = {str(n): {"attention": {"self": {"query": lin(h, h), "key": lin(h, h), "value": lin(h, h)},
                                         "output": {"dense": lin(h, h), "LayerNorm": ln()}},
                           "intermediate": {"dense": lin(h, i)}, "output": {"dense": lin(i, h), "LayerNorm": ln()}}
                  for n in range(int(config.num_hidden_layers))}
        return {"embeddings": {"word_embeddings": emb(int(config.vocab_size)),
                               "position_embeddings": emb(int(config.max_position_embeddings)),
                               "token_type_embeddings": emb(int(config.type_vocab_size)), "LayerNorm": ln()},
                "encoder": {"layer": layers}}

    @classmethod
    def params_from_state(cls, config, state) -> dict:
        return tree_from_torch(pick(state, lambda k: k.startswith(("embeddings.", "encoder."))
                                    and not k.endswith("position_ids")))

    def state_from_params(self, params) -> dict:
        return torch_from_tree({k: params[k] for k in ("embeddings", "encoder")})

    def encode(self, params, input_ids, attention_mask, *, train: bool = False, rng=None, token_type_ids=None,
               position_ids=None) -> jax.Array:
        return encode(params, input_ids, attention_mask, token_type_ids, position_ids, config=self.config,
                      dtype=self.dtype, dropout_rng=rng, train=train, attn_chunks=self.attn_chunks, remat=self.remat)
