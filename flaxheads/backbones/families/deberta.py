"""DeBERTa-v2 and DeBERTa-v3 (``model_type`` ``deberta-v2``): HF's ``DebertaV2Model``, as a pure function.

What the PyTorch model computes (transformers 4.57 and 5.x alike), and so what this does:

* embeddings: word (+ absolute positions when ``position_biased_input``, + token types when
  ``type_vocab_size > 0``), through ``embed_proj`` when ``embedding_size != hidden_size``,
  LayerNorm, times the attention mask, dropout;
* post-LayerNorm layers with *disentangled* attention: besides the content scores ``q . k``,
  ``pos_att_type`` adds content->position (``c2p``: each query against the projected relative
  embedding of its distance to the key) and position->content (``p2c``: each key against the
  projected embedding of the opposite distance); every term is divided by
  ``sqrt(head_dim * (1 + number of c2p/p2c terms))``, even when ``relative_attention`` is off.
  The relative embedding table is LayerNorm'd once (``norm_rel_ebd="layer_norm"``), dropped out
  and projected in each layer by that layer's query/key projections (``share_att_key``, v3) or
  its own ``pos_query_proj``/``pos_key_proj``. Distances are clipped at ``max_relative_positions``
  (-1: ``max_position_embeddings``) or put in ``position_buckets`` log buckets (v3);
* the attention mask is the token mask's outer product with itself: a padded query attends
  uniformly to every position, as PyTorch's ``masked_fill`` + softmax (it matters: the DeBERTa
  head pools the first token, a pad under left padding);
* an optional convolution after the first layer (``conv_kernel_size``, ``conv_groups``,
  ``conv_act``) over the embedding output, added to that layer's output, LayerNorm, masked.

How: the relative attention is :func:`~flaxheads.backbones.families.deberta_attention.disentangled_attention`
(see :mod:`flaxheads.backbones.families.deberta_attention`).

transformers has no Flax DeBERTa; the params tree follows HF's PyTorch -> Flax naming rule
(``kernel [in, out]``, ``embedding``, ``scale``; the convolution's ``kernel`` is Flax's ``[k, in/groups, out]``).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flaxheads.backbones.base import Backbone, BackboneError, activation_problem
from flaxheads.backbones.families.bert_shared import LayerLayout, dropout_keys
from flaxheads.backbones.families.deberta_attention import Settings, diagonal_rows, disentangled_attention, rows_at
from flaxheads.backbones.weights import pick, torch_from_tree, tree_from_torch
from flaxheads.layers.activations import get_activation
from flaxheads.layers.dense import dense, embedding_lookup
from flaxheads.layers.dropout import dropout
from flaxheads.layers.init import HFInit
from flaxheads.layers.norms import layer_norm_p
from flaxheads.layers.remat import attention_out, checkpointed, mlp_out
from flaxheads.runtime.plan import ComputePlan

#: A DeBERTa layer is a BERT layer whose attention projections are named ``*_proj``.
LAYOUT = LayerLayout(
    query=("attention", "self", "query_proj"),
    key=("attention", "self", "key_proj"),
    value=("attention", "self", "value_proj"),
)
TOP_LEVEL = ("embeddings", "encoder")
#: PyTorch buffers some checkpoints carry (no weights)
BUFFERS = ("embeddings.position_ids",)


def layer(
    p: dict,
    x: jax.Array,
    keep: jax.Array,
    rel: jax.Array | None,
    *,
    rows,
    s: Settings,
    batch: int,
    plan: ComputePlan,
    rng: jax.Array | None = None,
    at: jax.Array | None = None,
) -> jax.Array:
    """One DeBERTa layer on the flattened activation ``x [B*T, H]`` (post-LayerNorm, as BERT's);
    ``at [B]``: its output at that one position per sequence alone, ``[B, H]``."""
    r_attn, r_out, r_ffn = jax.random.split(rng, 3) if rng is not None else (None, None, None)
    ctx = attention_out(disentangled_attention(p, x, keep, rel, rows, s, batch=batch, rng=r_attn, plan=plan, at=at))
    if at is not None:
        x = rows_at(x, at, x.shape[0] // batch)
    out = dropout(dense(ctx, LAYOUT(p, "attn_out"), plan), s.hidden_dropout, r_out)
    x = layer_norm_p(out + x, LAYOUT(p, "attn_norm"), s.eps, plan)
    # BERT's feed-forward: dense -> act -> dense -> dropout -> residual -> LayerNorm
    inter = get_activation(s.act, barrier=plan.activation_barrier)(dense(x, LAYOUT(p, "ffn_in"), plan))
    out = dropout(mlp_out(dense(inter, LAYOUT(p, "ffn_out"), plan)), s.hidden_dropout, r_ffn)
    return layer_norm_p(out + x, LAYOUT(p, "ffn_norm"), s.eps, plan)


def conv_layer(
    p: dict,
    embedded: jax.Array,
    hidden: jax.Array,
    mask: jax.Array,
    s: Settings,
    rng: jax.Array | None,
    plan: ComputePlan,
) -> jax.Array:
    """HF's ``ConvLayer``: ``LayerNorm(hidden + act(dropout(conv(embedded))))`` with padded positions
    zeroed before and after; ``embedded``/``hidden`` ``[B, T, H]``, ``mask [B, T, 1]`` (0/1)."""
    pad = (s.conv_kernel - 1) // 2
    c = p["conv"]
    y = lax.conv_general_dilated(
        embedded,
        c["kernel"].astype(embedded.dtype),
        (1,),
        [(pad, pad)],
        dimension_numbers=("NWC", "WIO", "NWC"),
        feature_group_count=s.conv_groups,
    )
    act = get_activation(s.conv_act, barrier=plan.activation_barrier)
    y = act(dropout((y + c["bias"].astype(y.dtype)) * mask, s.conv_dropout, rng))
    return layer_norm_p(hidden + y, p["LayerNorm"], s.eps, plan) * mask


def embed(e: dict, input_ids, token_type_ids, position_ids, s: Settings, dtype, plan: ComputePlan) -> jax.Array:
    """Word (+ position, + token type) embeddings, ``embed_proj``, LayerNorm: ``[B, T, H]`` before the mask."""
    x = embedding_lookup(e["word_embeddings"]["embedding"], input_ids, s.pad_token_id)
    if s.position_biased_input:
        x = x + jnp.take(e["position_embeddings"]["embedding"], position_ids, axis=0)
    if s.type_vocab_size > 0:
        x = x + jnp.take(e["token_type_embeddings"]["embedding"], token_type_ids, axis=0)
    x = x.astype(dtype)
    if "embed_proj" in e:
        x = x @ e["embed_proj"]["kernel"].astype(dtype)
    return layer_norm_p(x, e["LayerNorm"], s.eps, plan)


def encode(
    params: dict,
    input_ids,
    attention_mask,
    token_type_ids=None,
    position_ids=None,
    *,
    settings: Settings,
    plan: ComputePlan,
    dtype=jnp.float32,
    rng: jax.Array | None = None,
    train: bool = False,
    remat: bool | str = False,
    only_at: jax.Array | None = None,
) -> jax.Array:
    """The DeBERTa-v2 forward: last hidden state ``[B, T, H]`` in ``dtype``, computed as ``plan`` arranges
    it (:class:`~flaxheads.runtime.plan.ComputePlan`). Pure in ``params``.

    Token types default to zeros, positions to ``0..T-1``; ``remat=True`` recomputes each layer in
    the backward pass (gradient checkpointing). ``only_at [B]``: the last hidden state at that one
    position per sequence, ``[B, 1, H]``, with the last layer computed there alone."""
    s = settings
    input_ids = jnp.asarray(input_ids)
    bsz, t = input_ids.shape
    if s.position_biased_input and t > s.max_positions:
        raise BackboneError(
            f"sequence length {t} exceeds max_position_embeddings {s.max_positions} of this "
            "DeBERTa model (absolute positions): truncate the inputs"
        )
    token_type_ids = jnp.zeros_like(input_ids) if token_type_ids is None else token_type_ids
    position_ids = jnp.broadcast_to(jnp.arange(t), (bsz, t)) if position_ids is None else position_ids
    emb_rng, rngs = dropout_keys(rng, s.num_layers + 1, train)
    conv_rng = rngs.pop()
    valid = jnp.asarray(attention_mask) > 0
    mask = valid[..., None].astype(dtype)
    x = dropout(
        embed(params["embeddings"], input_ids, token_type_ids, position_ids, s, dtype, plan) * mask,
        s.hidden_dropout,
        emb_rng,
    )
    keep = valid[:, None, :, None] & valid[:, None, None, :]
    enc = params["encoder"]
    rel, rows = None, None
    if s.relative:
        rel = enc["rel_embeddings"]["embedding"].astype(dtype)
        if s.norm_rel:
            rel = layer_norm_p(rel, enc["LayerNorm"], s.eps, plan)
        rows = diagonal_rows(t, s)
    # remat: what the backward pass keeps, by policy
    step = checkpointed(partial(layer, rows=rows, s=s, batch=bsz, plan=plan), remat)
    layers = LAYOUT.layer_list(params)
    if len(layers) != s.num_layers:
        raise BackboneError(f"the params have {len(layers)} layers but the config has {s.num_layers}")
    h = x.reshape(bsz * t, -1)
    at = None if only_at is None else jnp.asarray(only_at, jnp.int32).reshape(bsz)
    # the convolution after layer 0 reads every position: a one-layer model with it runs in full
    last_at = at if at is not None and not (len(layers) == 1 and s.conv_kernel > 0) else None
    for i, (p, r) in enumerate(zip(layers, rngs)):
        h = step(p, h, keep, rel, rng=r, at=last_at if i == len(layers) - 1 else None)
        if i == 0 and s.conv_kernel > 0:
            h = conv_layer(enc["conv"], x, h.reshape(bsz, t, -1), mask, s, conv_rng, plan).reshape(bsz * t, -1)
    if at is None:
        return h.reshape(bsz, t, -1)
    return (h if last_at is not None else rows_at(h, at, t)).reshape(bsz, 1, -1)


def _prune(tree: Mapping, shapes: Mapping) -> dict:
    """``tree`` without the entries ``shapes`` lacks (weights PyTorch ignores too, e.g. the absolute
    position table of a v3 checkpoint that does not use it)."""
    return {
        k: (_prune(v, shapes[k]) if isinstance(v, Mapping) and isinstance(shapes[k], Mapping) else v)
        for k, v in tree.items()
        if k in shapes
    }


class DebertaV2Backbone(Backbone):
    """DeBERTa-v2/v3 (``model_type`` ``deberta-v2``); see the module docstring for what it computes."""

    model_types = ("deberta-v2",)
    family = "DeBERTa-v2"
    base_model_prefix = "deberta"
    classifier_dropout_key = "cls_dropout"
    lora_targets = ("query_proj", "value_proj")
    # transformers' DebertaV2Config defaults
    defaults = {
        "vocab_size": 128100,
        "hidden_size": 1536,
        "num_hidden_layers": 24,
        "num_attention_heads": 24,
        "intermediate_size": 6144,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        "max_position_embeddings": 512,
        "type_vocab_size": 0,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-7,
        "relative_attention": False,
        "max_relative_positions": -1,
        "pad_token_id": 0,
        "position_biased_input": True,
        "pos_att_type": None,
        "pooler_dropout": 0.0,
        "pooler_hidden_act": "gelu",
    }
    features = frozenset({"token_type_ids", "position_ids", "remat", "bf16", "only_at"})
    extra_inputs = ("token_type_ids", "position_ids", "only_at")
    settings_class = Settings
    settings: Settings

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        h, nh = int(config.hidden_size), int(config.num_attention_heads)
        buckets, kernel = int(config.get("position_buckets", -1)), int(config.get("conv_kernel_size", 0) or 0)
        max_rel = int(config.get("max_relative_positions", -1))
        max_rel = max_rel if max_rel >= 1 else int(config.max_position_embeddings)
        why = ""
        if h % nh:
            why = f"hidden_size {h} is not divisible by num_attention_heads {nh}"
        elif config.get("attention_head_size", h // nh) != h // nh:
            why = (
                f"attention_head_size {config.get('attention_head_size')} != hidden_size / num_attention_heads "
                f"({h // nh}); the attention output projection needs them equal"
            )
        elif buckets > 0 and not 1 <= buckets // 2 < max_rel - 1:
            why = (
                f"position_buckets {buckets} with max_relative_positions {max_rel}: log buckets need "
                "1 <= position_buckets // 2 < max_relative_positions - 1"
            )
        elif kernel > 0 and kernel % 2 == 0:
            why = f"an even conv_kernel_size ({kernel}): the convolution would not keep the sequence length"
        elif kernel > 0 and h % int(config.get("conv_groups", 1)):
            why = f"hidden_size {h} is not divisible by conv_groups {config.get('conv_groups')}"
        else:
            why = activation_problem(config.hidden_act) or (
                activation_problem(config.get("conv_act", "tanh")) if kernel > 0 else ""
            )
        if why:
            raise BackboneError(
                f"flaxheads' DeBERTa-v2 backbone cannot run this config: {why}. Use a checkpoint without it."
            )

    @classmethod
    def init_params(cls, config, rng) -> dict:
        """HF's init: normal(initializer_range) kernels, embeddings and convolution, zero biases and padding
        row, unit norm scales."""
        s = Settings.from_config(config)
        init = HFInit(rng, float(config.initializer_range))
        h = int(config.hidden_size)
        e = int(config.get("embedding_size", h))
        word = init.embedding(int(config.vocab_size), e)
        if s.pad_token_id is not None:
            word = {"embedding": word["embedding"].at[int(s.pad_token_id)].set(0.0)}
        emb = {"word_embeddings": word}
        if s.position_biased_input:
            emb["position_embeddings"] = init.embedding(s.max_positions, e)
        if s.type_vocab_size > 0:
            emb["token_type_embeddings"] = init.embedding(s.type_vocab_size, e)
        if e != h:
            emb["embed_proj"] = init.dense(e, h, bias=False)
        emb["LayerNorm"] = init.norm(h)
        layers = {}
        for i in range(s.num_layers):
            lp = LAYOUT.init_layer(init, h, int(config.intermediate_size))
            if s.relative and not s.share_att_key:
                for kind, name in (("c2p", "pos_key_proj"), ("p2c", "pos_query_proj")):
                    if getattr(s, kind):
                        lp["attention"]["self"][name] = init.dense(h, h)
            layers[str(i)] = lp
        enc: dict = {"layer": layers}
        if s.relative:
            enc["rel_embeddings"] = init.embedding(2 * s.span, h)
        if s.norm_rel:
            enc["LayerNorm"] = init.norm(h)
        if s.conv_kernel > 0:
            enc["conv"] = {
                "conv": {"kernel": init.normal((s.conv_kernel, h // s.conv_groups, h)), "bias": jnp.zeros(h)},
                "LayerNorm": init.norm(h),
            }
        return {"embeddings": emb, "encoder": enc}

    @classmethod
    def params_from_state(cls, config, state) -> dict:
        tree = tree_from_torch(pick(state, lambda k: k.partition(".")[0] in TOP_LEVEL and k not in BUFFERS))
        conv = tree.get("encoder", {}).get("conv", {}).get("conv", {})
        if "weight" in conv:  # nn.Conv1d [out, in/groups, k] -> Flax [k, in/groups, out]
            conv["kernel"] = np.asarray(conv.pop("weight")).T
        return _prune(tree, cls.param_shapes(config))

    def state_from_params(self, params) -> dict:
        # torch_from_tree transposes every kernel by reversing its axes: the convolution's comes back
        # [out, in/groups, k]
        return torch_from_tree({k: params[k] for k in TOP_LEVEL if k in params})

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
        only_at=None,
    ) -> jax.Array:
        return encode(
            params,
            input_ids,
            attention_mask,
            token_type_ids,
            position_ids,
            settings=self.settings,
            plan=self.plan,
            dtype=self.dtype,
            rng=rng,
            train=train,
            remat=self.remat_policy,
            only_at=only_at,
        )
