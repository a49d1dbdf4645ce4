"""ELECTRA (the discriminator, as ``ElectraForSequenceClassification`` uses it): BERT's encoder
on embeddings of width ``embedding_size``, projected to ``hidden_size`` by ``embeddings_project``
when the two differ (small ELECTRA checkpoints).

PyTorch names: ``electra.embeddings...``, ``electra.embeddings_project``,
``electra.encoder.layer.<i>...``; the params tree is HF ``FlaxElectraModel``'s. Token types
default to zeros as in PyTorch (HF's Flax ELECTRA defaulted them to ones).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from flaxheads.backbones.families.bert import BertBackbone
from flaxheads.backbones.families.bert_shared import bert_embeddings
from flaxheads.layers.dense import dense
from flaxheads.layers.init import HFInit


def electra_embeddings(params: dict, *args, **kwargs) -> jax.Array:
    """BERT's embeddings (with their dropout) at ``embedding_size``, then ``embeddings_project`` if present."""
    x = bert_embeddings(params, *args, **kwargs)
    return dense(x, params["embeddings_project"], kwargs["plan"]) if "embeddings_project" in params else x


class ElectraBackbone(BertBackbone):
    """ELECTRA encoder (``model_type`` ``electra``): HF's ``ElectraModel``, as a pure function."""

    model_types = ("electra",)
    base_model_prefix = "electra"
    family = "ELECTRA"
    defaults = {**BertBackbone.defaults, "embedding_size": 128}
    top_level = ("embeddings", "embeddings_project", "encoder")

    @classmethod
    def init_embeddings(cls, config, init: HFInit) -> dict:
        e, h = int(config.embedding_size), int(config.hidden_size)
        out = super().init_embeddings(config.replace(hidden_size=e), init)
        if e != h:
            out["embeddings_project"] = init.dense(e, h)
        return out

    def embeddings(self) -> Callable[..., jax.Array]:
        return electra_embeddings
