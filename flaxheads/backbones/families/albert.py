"""ALBERT (``model_type`` ``albert``): HF's ``AlbertModel`` without its pooler, as a pure function.

ALBERT is BERT's post-LayerNorm layer with two changes, both carried as data into
:func:`flaxheads.backbones.families.bert.encode` (no second encoder):

* factorised embeddings: word/position/token-type embeddings of width ``embedding_size``,
  LayerNorm and dropout there, then ``encoder.embedding_hidden_mapping_in`` projects them
  to ``hidden_size``;
* shared layers: ``num_hidden_groups`` groups of ``inner_group_num`` layers each
  (``encoder.albert_layer_groups.<g>.albert_layers.<i>``). Each of the ``num_hidden_layers``
  steps runs every layer of group ``int(step / (num_hidden_layers / num_hidden_groups))``,
  as HF's ``AlbertTransformer`` does, so the same weights appear many times in the layer list.

Its layer also has no dropout after the feed-forward output (BERT has one). The params tree
is HF ``FlaxAlbertModel(add_pooling_layer=False)``'s; the pretrained ``albert.pooler`` belongs
to the ALBERT head preset, not to the backbone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import ClassVar

import jax

from flaxheads.backbones.base import BackboneError
from flaxheads.backbones.families.bert import BertBackbone
from flaxheads.backbones.families.bert_shared import LayerLayout, Settings, bert_embeddings
from flaxheads.layers.dense import dense
from flaxheads.layers.init import HFInit
from flaxheads.runtime.plan import ComputePlan


@dataclasses.dataclass(frozen=True)
class AlbertLayout(LayerLayout):
    """ALBERT's layer weight names; ``order`` lists the ``(group, layer)`` run at each depth."""

    query: tuple[str, ...] = ("attention", "query")
    key: tuple[str, ...] = ("attention", "key")
    value: tuple[str, ...] = ("attention", "value")
    attn_out: tuple[str, ...] = ("attention", "dense")
    attn_norm: tuple[str, ...] = ("attention", "LayerNorm")
    ffn_in: tuple[str, ...] = ("ffn",)
    ffn_out: tuple[str, ...] = ("ffn_output",)
    ffn_norm: tuple[str, ...] = ("full_layer_layer_norm",)
    layers: tuple[str, ...] = ("encoder", "albert_layer_groups")
    ffn_output_dropout: bool = False
    order: tuple[tuple[int, int], ...] = ()

    def layer_list(self, params: Mapping) -> list:
        groups = self(params, "layers")
        return [groups[str(g)]["albert_layers"][str(i)] for g, i in self.order]


def layer_order(config) -> tuple[tuple[int, int], ...]:
    """``(group, layer in group)`` of every layer application, in order (HF's group arithmetic)."""
    n, groups, inner = int(config.num_hidden_layers), int(config.num_hidden_groups), int(config.inner_group_num)
    return tuple((int(i / (n / groups)), j) for i in range(n) for j in range(inner))


def albert_embeddings(
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
    """BERT's embeddings at ``embedding_size`` (LayerNorm, dropout), projected to ``hidden_size``."""
    x = bert_embeddings(
        params, input_ids, token_type_ids, position_ids, eps=eps, dtype=dtype, rate=rate, rng=rng, plan=plan
    )
    return dense(x, params["encoder"]["embedding_hidden_mapping_in"], plan)


class AlbertBackbone(BertBackbone):
    """ALBERT on :func:`~flaxheads.backbones.families.bert.encode` with :class:`AlbertLayout` and factorised
    embeddings."""

    model_types = ("albert",)
    base_model_prefix = "albert"
    classifier_dropout_key = "classifier_dropout_prob"
    # transformers' AlbertConfig defaults (ALBERT-xxlarge sizes, no dropout)
    defaults = {
        "vocab_size": 30000,
        "embedding_size": 128,
        "hidden_size": 4096,
        "num_hidden_layers": 12,
        "num_hidden_groups": 1,
        "num_attention_heads": 64,
        "intermediate_size": 16384,
        "inner_group_num": 1,
        "hidden_act": "gelu_new",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "max_position_embeddings": 512,
        "type_vocab_size": 2,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-12,
        "classifier_dropout_prob": 0.1,
        "position_embedding_type": "absolute",
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 3,
    }
    family: ClassVar[str] = "ALBERT"
    layout: ClassVar[AlbertLayout] = AlbertLayout()

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        for key in ("num_hidden_groups", "inner_group_num", "embedding_size"):
            if int(config[key]) < 1:
                raise BackboneError(
                    f"flaxheads' ALBERT backbone cannot run this config: {key} is "
                    f"{config[key]}, expected a positive integer (fix config.json)"
                )

    @classmethod
    def stack(cls, config) -> Settings:
        order = layer_order(config)
        base = Settings.from_config(config, dataclasses.replace(cls.layout, order=order))
        return dataclasses.replace(base, num_layers=len(order))

    def embeddings(self) -> Callable[..., jax.Array]:
        return albert_embeddings

    @classmethod
    def init_params(cls, config, rng) -> dict:
        init = HFInit(rng, float(config.initializer_range))
        e, h, i = int(config.embedding_size), int(config.hidden_size), int(config.intermediate_size)
        groups = {
            str(g): {
                "albert_layers": {str(j): cls.layout.init_layer(init, h, i) for j in range(int(config.inner_group_num))}
            }
            for g in range(int(config.num_hidden_groups))
        }
        embeddings = {
            "word_embeddings": init.embedding(int(config.vocab_size), e),
            "position_embeddings": init.embedding(int(config.max_position_embeddings), e),
            "token_type_embeddings": init.embedding(int(config.type_vocab_size), e),
            "LayerNorm": init.norm(e),
        }
        return {
            "embeddings": embeddings,
            "encoder": {"embedding_hidden_mapping_in": init.dense(e, h), "albert_layer_groups": groups},
        }
