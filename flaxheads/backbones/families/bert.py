"""A BERT-family encoder of flaxheads' own, on HF ``FlaxBertModel``'s parameter tree.

Why it exists: on CPU, HF's Flax BERT spends more time in the glue around its matmuls
(separate q/k/v projections, 4-D reshapes per head, the mask broadcast, flax's LayerNorm)
than PyTorch does. This encoder computes the same function with

* one fused q/k/v matmul per layer on a 2-D ``[B*T, H]`` activation (the kernel is
  concatenated inside the jitted program, so the params keep HF's tree and names),
* the attention scale folded into ``q`` (``B*T*H`` multiplies instead of ``B*nh*T*T``),
* the additive mask built once per forward, reused by every layer and carried inside the
  score matmul; softmax normalisation applied to the context (see :func:`~flaxheads.layers.attention.attend`),
* a two-pass LayerNorm in the compute dtype,

and nothing else: parameters, their names and shapes, dropout placement and the outputs
are HF's (parity-tested against ``FlaxBertModel`` and PyTorch ``BertModel`` to 1e-4).

:class:`BertBackbone` is this module's implementation of the backbone contract
(:mod:`flaxheads.backbones.base`).

The pieces other families share (:class:`~flaxheads.backbones.families.bert_shared.LayerLayout`,
:class:`~flaxheads.backbones.families.bert_shared.Settings`, the embeddings, the dropout keys) are in
:mod:`flaxheads.backbones.families.bert_shared`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import ClassVar

import jax
import jax.numpy as jnp

from flaxheads.backbones.base import Backbone, BackboneError
from flaxheads.backbones.families.bert_shared import (
    BERT_LAYOUT,
    LayerLayout,
    Settings,
    bert_embeddings,
    check_bert_like,
    dropout_keys,
)
from flaxheads.layers.activations import get_activation
from flaxheads.layers.attention import cross_attention, fused_qkv, self_attention
from flaxheads.layers.dense import dense
from flaxheads.layers.dropout import dropout
from flaxheads.layers.init import HFInit
from flaxheads.layers.masks import mask_bias, segment_bias
from flaxheads.layers.norms import layer_norm_p
from flaxheads.layers.remat import checkpointed, mlp_out
from flaxheads.runtime.plan import ComputePlan


def layer(
    p: dict,
    x: jax.Array,
    mask_bias: jax.Array,
    *,
    num_heads: int,
    eps: float,
    act,
    batch: int,
    plan: ComputePlan,
    hidden_dropout: float = 0.0,
    attn_dropout: float = 0.0,
    rng: jax.Array | None = None,
    ffn_chunks: int = 1,
    layout: LayerLayout = BERT_LAYOUT,
    queries: jax.Array | None = None,
) -> jax.Array:
    """One BERT-like layer on the flattened activation ``x [B*T, H]``; ``mask_bias [B, 1, 1, T]``.

    ``queries [B*Q, H]`` (rows of ``x``, ``Q`` per sequence): the layer's output at those rows
    only, ``[B*Q, H]``; keys and values still come from every row of ``x``."""
    d = x.shape[1] // num_heads
    qkv = [layout(p, part) for part in ("query", "key", "value")]
    w, b = fused_qkv(tuple(m["kernel"] for m in qkv), tuple(m["bias"] for m in qkv), 1.0 / math.sqrt(d))
    if rng is not None:
        r_attn, r_out, r_ffn = jax.random.split(rng, 3)
    else:
        r_attn = r_out = r_ffn = None
    if queries is None:
        ctx = self_attention(
            x, w, b, mask_bias, num_heads=num_heads, batch=batch, plan=plan, rate=attn_dropout, rng=r_attn
        )
    else:
        ctx = cross_attention(
            queries, x, w, b, mask_bias, num_heads=num_heads, batch=batch, plan=plan, rate=attn_dropout, rng=r_attn
        )
        x = queries
    out = dense(ctx, layout(p, "attn_out"), plan)
    if layout.attn_output_dropout:
        out = dropout(out, hidden_dropout, r_out)
    x = layer_norm_p(out + x, layout(p, "attn_norm"), eps, plan)
    return _ffn(
        p, x, eps=eps, act=act, hidden_dropout=hidden_dropout, rng=r_ffn, chunks=ffn_chunks, layout=layout, plan=plan
    )


def _ffn(
    p: dict,
    x: jax.Array,
    *,
    eps: float,
    act,
    hidden_dropout: float,
    rng,
    chunks: int,
    layout: LayerLayout = BERT_LAYOUT,
    plan: ComputePlan,
) -> jax.Array:
    """dense -> act -> dense -> dropout -> residual -> LayerNorm, in ``chunks`` independent row blocks."""
    rows = x.shape[0]
    n = chunks if chunks > 1 and rows % chunks == 0 else 1
    outs = []
    for c in range(n):
        xc = x[c * rows // n : (c + 1) * rows // n]
        inter = act(dense(xc, layout(p, "ffn_in"), plan))
        r = None if rng is None else (rng if n == 1 else jax.random.fold_in(rng, c))
        out = mlp_out(dense(inter, layout(p, "ffn_out"), plan))
        if layout.ffn_output_dropout:
            out = dropout(out, hidden_dropout, r)
        outs.append(layer_norm_p(out + xc, layout(p, "ffn_norm"), eps, plan))
    return outs[0] if n == 1 else jnp.concatenate(outs, axis=0)


def run_layers(
    layers: Sequence[dict],
    x: jax.Array,
    attention_mask: jax.Array,
    stack: Settings,
    *,
    rngs: Sequence[jax.Array | None],
    plan: ComputePlan,
    ffn_chunks: int = 1,
    remat: bool | str = False,
    segment_ids: jax.Array | None = None,
    only_at: jax.Array | None = None,
) -> jax.Array:
    """``stack``'s layers on the embeddings ``x [B, T, H]``: the last hidden state ``[B, T, H]``.

    ``layers[i]`` is layer ``i``'s params (the same dict repeated shares weights across depth);
    ``rngs[i]`` its dropout key or None. ``segment_ids`` (packed rows): attention stays within
    each text (:func:`~flaxheads.layers.masks.segment_bias`) instead of following ``attention_mask``.
    ``only_at [B]`` (a position per sequence): the last layer runs at that position alone
    (:func:`layer`'s ``queries``) and the result is ``[B, 1, H]``, what a one-token pooler reads."""
    bsz, t, _ = x.shape
    bias = mask_bias(attention_mask, x.dtype) if segment_ids is None else segment_bias(segment_ids, x.dtype)
    act = get_activation(stack.activation, barrier=plan.activation_barrier)
    step: Callable[..., jax.Array]  # a partial of layer, then (remat) its checkpointed form
    step = partial(
        layer,
        num_heads=stack.num_heads,
        eps=stack.eps,
        act=act,
        batch=bsz,
        plan=plan,
        hidden_dropout=stack.hidden_dropout,
        attn_dropout=stack.attn_dropout,
        ffn_chunks=ffn_chunks,
        layout=stack.layout,
    )
    # remat: keep less than every intermediate for the backward pass and recompute the rest (its
    # policy says what is kept): activation memory stops growing with the layer count
    step = checkpointed(step, remat)
    x = x.reshape(bsz * t, -1)
    last = len(layers) - 1 if only_at is not None else len(layers)
    for p, r in zip(layers[:last], rngs[:last], strict=True):
        x = step(p, x, bias, rng=r)
    if only_at is None:
        return x.reshape(bsz, t, -1)
    if segment_ids is not None:
        raise BackboneError(
            "only_at and segment_ids (packed rows) cannot be combined: pool packed texts from the full hidden states"
        )
    rows = jnp.asarray(only_at, jnp.int32).reshape(bsz) + jnp.arange(bsz, dtype=jnp.int32) * t
    return step(layers[last], x, bias, rng=rngs[last], queries=x[rows]).reshape(bsz, 1, -1)


def encode(
    params: dict,
    input_ids,
    attention_mask=None,
    token_type_ids=None,
    position_ids=None,
    *,
    config,
    plan: ComputePlan,
    dtype=jnp.float32,
    dropout_rng: jax.Array | None = None,
    train: bool = False,
    ffn_chunks: int = 1,
    remat: bool | str = False,
    stack: Settings | None = None,
    embeddings: Callable[..., jax.Array] = bert_embeddings,
    segment_ids=None,
    only_at: jax.Array | None = None,
) -> jax.Array:
    """A BERT-like encoder forward: last hidden state ``[B, T, H]`` in ``dtype``. Pure in ``params``.

    What differs between BERT-like families comes in as arguments: ``stack`` (layer count,
    sizes, dropout, the :class:`LayerLayout` of the weights; default BERT's from ``config``) and
    ``embeddings(params, input_ids, token_type_ids, position_ids, *, eps, dtype, rate, rng, plan)``
    (embedding module with its dropout; default :func:`bert_embeddings`). Token types default
    to zeros and position ids to ``0..T-1``.

    ``plan`` is how the layers compute on this host (its ``attention_chunks`` split attention into
    independent batch chunks: speed only, never the result). ``remat=True``
    recomputes each layer in the backward pass (gradient checkpointing): same values and
    gradients, less activation memory. ``segment_ids`` ``[B, T]`` (rows packing several texts,
    numbered ``1, 2, ...``, padding ``0``) keeps attention inside each text; the caller restarts
    ``position_ids`` at each text. ``only_at [B]``: the last hidden state at that one position of
    each sequence, ``[B, 1, H]``, with the last layer computed there alone (see :func:`run_layers`)."""
    stack = Settings.from_config(config) if stack is None else stack
    input_ids = jnp.asarray(input_ids)
    bsz, t = input_ids.shape
    if attention_mask is None:
        attention_mask = jnp.ones_like(input_ids)
    if token_type_ids is None:
        token_type_ids = jnp.zeros_like(input_ids)
    if position_ids is None:
        position_ids = jnp.broadcast_to(jnp.arange(t), (bsz, t))
    emb_rng, rngs = dropout_keys(dropout_rng, stack.num_layers, train)
    x = embeddings(
        params,
        input_ids,
        token_type_ids,
        position_ids,
        eps=stack.eps,
        dtype=dtype,
        rate=stack.hidden_dropout,
        rng=emb_rng,
        plan=plan,
    )
    layers = stack.layout.layer_list(params)
    if len(layers) != stack.num_layers:
        raise BackboneError(f"the params have {len(layers)} layers but the config has {stack.num_layers}")
    return run_layers(
        layers,
        x,
        attention_mask,
        stack,
        rngs=rngs,
        plan=plan,
        ffn_chunks=ffn_chunks,
        remat=remat,
        segment_ids=segment_ids,
        only_at=only_at,
    )


class BertBackbone(Backbone):
    """BERT (``model_type`` ``bert``): HF's ``BertModel`` without its pooler, as a pure function.

    The params tree is HF ``FlaxBertModel``'s (``embeddings``, ``encoder/layer/<i>/...``), so
    checkpoints written with HF's Flax BERT load unchanged.

    BERT-like families subclass it and change what differs: :attr:`layout` (the layer's
    weight names), :attr:`top_level` (the params tree's top-level modules, which are also
    the PyTorch name prefixes), :meth:`stack`, :meth:`embeddings` and :meth:`init_embeddings`."""

    model_types: ClassVar[tuple[str, ...]] = ("bert",)
    family = "BERT"
    base_model_prefix = "bert"
    classifier_dropout_key = "classifier_dropout"
    lora_targets = ("query", "value")
    defaults = {
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        "layer_norm_eps": 1e-12,
        "type_vocab_size": 2,
        "position_embedding_type": "absolute",
        "pad_token_id": 0,
        "initializer_range": 0.02,
        "max_position_embeddings": 512,
    }
    features = frozenset({"token_type_ids", "position_ids", "remat", "bf16", "packing", "only_at"})
    extra_inputs: ClassVar[tuple[str, ...]] = ("token_type_ids", "position_ids", "segment_ids", "only_at")
    layout: ClassVar[LayerLayout] = BERT_LAYOUT
    top_level: ClassVar[tuple[str, ...]] = ("embeddings", "encoder")
    #: PyTorch buffers (not weights) some checkpoints carry under the base model
    buffers: ClassVar[tuple[str, ...]] = ("position_ids", "token_type_ids")

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        check_bert_like(config, family=cls.family)

    @classmethod
    def init_embeddings(cls, config, init: HFInit) -> dict:
        """The top-level modules before the layers (BERT: ``{"embeddings": ...}``), freshly initialised."""
        h = int(config.hidden_size)
        return {
            "embeddings": {
                "word_embeddings": init.embedding(int(config.vocab_size), h),
                "position_embeddings": init.embedding(int(config.max_position_embeddings), h),
                "token_type_embeddings": init.embedding(int(config.type_vocab_size), h),
                "LayerNorm": init.norm(h),
            }
        }

    @classmethod
    def init_params(cls, config, rng) -> dict:
        init = HFInit(rng, float(config.initializer_range))
        n, h = cls.stack(config).num_layers, int(config.hidden_size)
        layers = {str(i): cls.layout.init_layer(init, h, int(cls.intermediate_size(config))) for i in range(n)}
        outer, inner = cls.layout.layers
        return {**cls.init_embeddings(config, init), outer: {inner: layers}}

    @classmethod
    def intermediate_size(cls, config) -> int:
        return int(config.intermediate_size)

    @classmethod
    def is_buffer(cls, name: str) -> bool:
        return name.rpartition(".")[2] in cls.buffers

    @classmethod
    def stack(cls, config) -> Settings:
        """The layer settings of ``config``."""
        return Settings.from_config(config, cls.layout)

    def embeddings(self) -> Callable[..., jax.Array]:
        """The embedding module for :func:`encode` (see its ``embeddings`` argument)."""
        return bert_embeddings

    def first_position(self) -> int:
        """The position id of a text's first token (packed rows restart positions here at each text)."""
        return 0

    def encode(
        self,
        params,
        input_ids,
        attention_mask,
        *,
        train: bool = False,
        rng=None,
        token_type_ids=None,
        position_ids=None,
        segment_ids=None,
        only_at=None,
    ) -> jax.Array:
        return encode(
            params,
            input_ids,
            attention_mask,
            token_type_ids,
            position_ids,
            config=self.config,
            plan=self.plan,
            dtype=self.dtype,
            dropout_rng=rng,
            train=train,
            remat=self.remat_policy,
            stack=self.stack(self.config),
            embeddings=self.embeddings(),
            segment_ids=segment_ids,
            only_at=only_at,
        )
