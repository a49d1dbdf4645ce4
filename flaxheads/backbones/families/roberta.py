"""RoBERTa, XLM-RoBERTa and CamemBERT: BERT's encoder with RoBERTa's position ids.

The three share PyTorch's ``RobertaModel`` code and weight names (``roberta.embeddings...``,
``roberta.encoder.layer.<i>...``) and HF ``FlaxRobertaModel``'s params tree; only two
things differ from BERT, both in the inputs:

* position ids count the non-padding tokens from ``padding_idx + 1`` (``padding_idx`` is
  ``pad_token_id``); padding tokens get ``padding_idx`` itself. They come from ``input_ids``,
  not from the attention mask, as in PyTorch;
* token types default to zeros (released checkpoints have a token-type vocabulary of 1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flaxheads.backbones.base import BackboneError
from flaxheads.backbones.families.bert import BertBackbone
from flaxheads.layers.positions import roberta_position_ids


class RobertaBackbone(BertBackbone):
    """RoBERTa-family encoder (``roberta``, ``xlm-roberta``, ``camembert``): HF's ``RobertaModel``
    without its pooler, on ``FlaxRobertaModel``'s params tree."""

    model_types = ("roberta", "xlm-roberta", "camembert")
    base_model_prefix = "roberta"
    family = "RoBERTa"
    tokenizer_token_types = False
    defaults = {**BertBackbone.defaults, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        if getattr(config, "pad_token_id", None) is None:
            raise BackboneError(
                "a RoBERTa config needs pad_token_id (its position ids count from "
                "pad_token_id + 1); set it in config.json (1 in released checkpoints)"
            )

    def first_position(self) -> int:
        return int(self.config.pad_token_id) + 1  # positions count from pad_token_id + 1

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
        input_ids = jnp.asarray(input_ids)
        if position_ids is None:
            pad, t, n_pos = int(self.config.pad_token_id), input_ids.shape[1], int(self.config.max_position_embeddings)
            if pad + t >= n_pos:
                raise BackboneError(
                    f"sequences of {t} tokens need position ids up to {pad + t}, but this "
                    f"{self.model_type} model has {n_pos} position embeddings: truncate inputs "
                    f"to at most {n_pos - pad - 1} tokens"
                )
            position_ids = roberta_position_ids(input_ids, pad)
        return super().encode(
            params,
            input_ids,
            attention_mask,
            train=train,
            rng=rng,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            segment_ids=segment_ids,
            only_at=only_at,
        )
