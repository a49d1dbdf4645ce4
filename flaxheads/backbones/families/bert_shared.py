"""The pieces of flaxheads' BERT encoder that other families build on: the config check, where a
BERT-like layer keeps its weights (:class:`LayerLayout`), the layer stack's :class:`Settings`, the
embedding module and the dropout keys.

The BERT computation itself and :class:`~flaxheads.backbones.families.bert.BertBackbone` are in
:mod:`flaxheads.backbones.families.bert`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from flaxheads.backbones.base import BackboneError, activation_problem
from flaxheads.layers.dropout import dropout
from flaxheads.layers.init import HFInit
from flaxheads.layers.norms import layer_norm_p
from flaxheads.runtime.plan import ComputePlan


def check_bert_like(config, *, family: str) -> None:
    """Raise :class:`BackboneError` unless the BERT-like layers of
    :func:`~flaxheads.backbones.families.bert.encode` compute what HF's model for ``config`` computes
    (absolute positions, encoder only, a known activation)."""
    pet = getattr(config, "position_embedding_type", "absolute") or "absolute"
    why = None
    if pet != "absolute":
        why = f"position_embedding_type {pet!r}; only 'absolute' is implemented"
    elif getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        why = "a decoder / cross-attention config (is_decoder or add_cross_attention); only encoders are implemented"
    elif int(config.hidden_size) % int(config.num_attention_heads):
        why = f"hidden_size {config.hidden_size} is not divisible by num_attention_heads {config.num_attention_heads}"
    else:
        why = activation_problem(getattr(config, "hidden_act", "gelu"))
    if why:
        raise BackboneError(
            f"flaxheads' {family} backbone cannot run this config: {why}. Use a checkpoint "
            f"without it, or implementation='hf_flax' (transformers < 5) if HF's Flax model has it."
        )


@dataclasses.dataclass(frozen=True)
class LayerLayout:
    """Where a BERT-like (post-LayerNorm) layer keeps each weight: paths in one layer's params
    subtree, plus the path of the layer list in the whole tree. Families that name the same
    weights differently (DistilBERT's ``q_lin``, ``sa_layer_norm``, ...) give their own layout.

    ``attn_output_dropout``: whether dropout follows the attention output projection (BERT
    has it, DistilBERT does not); ``ffn_output_dropout``: whether it follows the feed-forward
    output projection (BERT has it, ALBERT does not)."""

    query: tuple[str, ...] = ("attention", "self", "query")
    key: tuple[str, ...] = ("attention", "self", "key")
    value: tuple[str, ...] = ("attention", "self", "value")
    attn_out: tuple[str, ...] = ("attention", "output", "dense")
    attn_norm: tuple[str, ...] = ("attention", "output", "LayerNorm")
    ffn_in: tuple[str, ...] = ("intermediate", "dense")
    ffn_out: tuple[str, ...] = ("output", "dense")
    ffn_norm: tuple[str, ...] = ("output", "LayerNorm")
    layers: tuple[str, ...] = ("encoder", "layer")
    attn_output_dropout: bool = True
    ffn_output_dropout: bool = True

    def __call__(self, tree: Mapping, part: str) -> Any:
        """The subtree at the path named ``part`` (a field name)."""
        for k in getattr(self, part):
            tree = tree[k]
        return tree

    def layer_list(self, params: Mapping) -> list:
        """The per-layer params subtrees, in order (``"0"``, ``"1"``, ...)."""
        try:
            node = self(params, "layers")
        except KeyError:  # a model with no layers has no weights there
            return []
        return [node[str(i)] for i in range(len(node))]

    def init_layer(self, init: HFInit, hidden: int, intermediate: int) -> dict:
        """One freshly initialised layer's params, in this layout."""
        out: dict = {}
        for part, leaf in (
            ("query", init.dense(hidden, hidden)),
            ("key", init.dense(hidden, hidden)),
            ("value", init.dense(hidden, hidden)),
            ("attn_out", init.dense(hidden, hidden)),
            ("attn_norm", init.norm(hidden)),
            ("ffn_in", init.dense(hidden, intermediate)),
            ("ffn_out", init.dense(intermediate, hidden)),
            ("ffn_norm", init.norm(hidden)),
        ):
            *parents, last = getattr(self, part)
            node = out
            for k in parents:
                node = node.setdefault(k, {})
            node[last] = leaf
        return out


BERT_LAYOUT = LayerLayout()


@dataclasses.dataclass(frozen=True)
class Settings:
    """The settings of a stack of BERT-like layers (what :func:`~flaxheads.backbones.families.bert.encode`
    needs beyond the params)."""

    num_layers: int
    num_heads: int
    eps: float
    activation: str  # HF's name (``hidden_act``); looked up with the compute plan's barrier
    hidden_dropout: float = 0.0
    attn_dropout: float = 0.0
    layout: LayerLayout = BERT_LAYOUT

    @classmethod
    def from_config(cls, config, layout: LayerLayout = BERT_LAYOUT) -> Settings:
        """BERT's config keys (``num_hidden_layers``, ``layer_norm_eps``, ``hidden_act``, ...)."""
        return cls(
            int(config.num_hidden_layers),
            int(config.num_attention_heads),
            float(config.layer_norm_eps),
            config.hidden_act,
            float(config.hidden_dropout_prob or 0.0),
            float(config.attention_probs_dropout_prob or 0.0),
            layout,
        )


def embed(params: dict, input_ids, token_type_ids, position_ids, *, eps: float, dtype, plan: ComputePlan) -> jax.Array:
    """Word + position + token-type embeddings, LayerNorm: ``[B, T, H]`` (families without
    ``token_type_embeddings``, e.g. DistilBERT, skip that term)."""
    e = params["embeddings"]
    x = jnp.take(e["word_embeddings"]["embedding"], input_ids, axis=0) + jnp.take(
        e["position_embeddings"]["embedding"], position_ids, axis=0
    )
    if "token_type_embeddings" in e:
        x = x + jnp.take(e["token_type_embeddings"]["embedding"], token_type_ids, axis=0)
    return layer_norm_p(x.astype(dtype), e["LayerNorm"], eps, plan)


def bert_embeddings(
    params: dict,
    input_ids,
    token_type_ids,
    position_ids,
    *,
    eps: float,
    dtype,
    rate: float,
    rng: jax.Array | None,
    plan: ComputePlan,
) -> jax.Array:
    """BERT's embedding module: :func:`embed`, then dropout (the default of
    :func:`~flaxheads.backbones.families.bert.encode`'s ``embeddings``)."""
    return dropout(embed(params, input_ids, token_type_ids, position_ids, eps=eps, dtype=dtype, plan=plan), rate, rng)


def dropout_keys(rng: jax.Array | None, num_layers: int, train: bool) -> tuple[jax.Array | None, list]:
    """The embedding dropout key and one key per layer; all None when not training."""
    if not train:
        return None, [None] * num_layers
    if rng is None:
        raise ValueError("train=True needs a dropout_rng (dropout is active in training)")
    keys = list(jax.random.split(rng, num_layers + 1))
    return keys[-1], keys[:-1]
