"""DistilBERT: BERT's post-LayerNorm layers under other names, no token types, and optionally
fixed sinusoidal position embeddings.

PyTorch names (``distilbert.`` prefix in ``DistilBertForSequenceClassification``):
``embeddings.{word,position}_embeddings``, ``embeddings.LayerNorm``,
``transformer.layer.<i>.attention.{q,k,v,out}_lin``, ``.sa_layer_norm``, ``.ffn.lin1/lin2``,
``.output_layer_norm``; the params tree is HF ``FlaxDistilBertModel``'s. Two differences in
the computation: no dropout after the attention output projection, and LayerNorm eps is
fixed at 1e-12 (not a config key).

``sinusoidal_pos_embds=True``: the position table is the fixed sin/cos table, not a weight
(PyTorch 4.x freezes it, HF's Flax model computes it), so it is not in the params tree.
Loading checks that the checkpoint's table is that table (a trained table would give other
outputs); export writes it back for PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from flaxheads.backbones.base import BackboneError, activation_problem
from flaxheads.backbones.families.bert import BertBackbone
from flaxheads.backbones.families.bert_shared import LayerLayout, Settings, bert_embeddings
from flaxheads.layers.init import HFInit

DISTILBERT_LAYOUT = LayerLayout(
    query=("attention", "q_lin"),
    key=("attention", "k_lin"),
    value=("attention", "v_lin"),
    attn_out=("attention", "out_lin"),
    attn_norm=("sa_layer_norm",),
    ffn_in=("ffn", "lin1"),
    ffn_out=("ffn", "lin2"),
    ffn_norm=("output_layer_norm",),
    layers=("transformer", "layer"),
    attn_output_dropout=False,
)
#: DistilBERT's LayerNorms are built with this eps; no config key changes it.
LAYER_NORM_EPS = 1e-12
_POSITIONS = "embeddings.position_embeddings.weight"


def sinusoidal_table(num_positions: int, dim: int) -> np.ndarray:
    """``[num_positions, dim]``: ``sin(p / 10000**(2i/dim))`` at even columns ``2i``, ``cos`` at odd ``2i+1``."""
    angle = np.arange(num_positions)[:, None] / np.power(10000.0, 2 * (np.arange(dim)[None, :] // 2) / dim)
    table = np.empty((num_positions, dim), np.float32)
    table[:, 0::2], table[:, 1::2] = np.sin(angle[:, 0::2]), np.cos(angle[:, 1::2])
    return table


class DistilBertBackbone(BertBackbone):
    """DistilBERT encoder (``model_type`` ``distilbert``): HF's ``DistilBertModel``, as a pure function."""

    model_types = ("distilbert",)
    base_model_prefix = "distilbert"
    family = "DistilBERT"
    classifier_dropout_key = "seq_classif_dropout"
    lora_targets = ("q_lin", "v_lin")
    tokenizer_token_types = False
    defaults = {
        "vocab_size": 30522,
        "max_position_embeddings": 512,
        "sinusoidal_pos_embds": False,
        "n_layers": 6,
        "n_heads": 12,
        "dim": 768,
        "hidden_dim": 3072,
        "dropout": 0.1,
        "attention_dropout": 0.1,
        "activation": "gelu",
        "initializer_range": 0.02,
        "qa_dropout": 0.1,
        "seq_classif_dropout": 0.2,
        "pad_token_id": 0,
    }
    features = frozenset({"position_ids", "remat", "bf16", "only_at"})
    extra_inputs = ("position_ids", "only_at")
    layout = DISTILBERT_LAYOUT
    top_level = ("embeddings", "transformer")

    @classmethod
    def complete_config(cls, config):
        # DistilBERT's config.json says "dim"; the rest of flaxheads reads "hidden_size" (transformers
        # maps the one to the other), so the completed config carries both, equal.
        config = super().complete_config(config)
        return config if "hidden_size" in config else config.replace(hidden_size=config["dim"])

    @classmethod
    def check_config(cls, config) -> None:
        super(BertBackbone, cls).check_config(config)  # the base's model_type guard; BERT's key checks do not apply
        why = None
        if int(config.dim) % int(config.n_heads):
            why = f"dim {config.dim} is not divisible by n_heads {config.n_heads}"
        elif int(config.hidden_size) != int(config.dim):
            why = f"hidden_size {config.hidden_size} differs from dim {config.dim}"
        else:
            why = activation_problem(config.activation)
        if why:
            raise BackboneError(f"flaxheads' DistilBERT backbone cannot run this config: {why}")

    @classmethod
    def stack(cls, config) -> Settings:
        return Settings(
            int(config.n_layers),
            int(config.n_heads),
            LAYER_NORM_EPS,
            config.activation,
            float(config.dropout or 0.0),
            float(config.attention_dropout or 0.0),
            cls.layout,
        )

    @classmethod
    def intermediate_size(cls, config) -> int:
        return int(config.hidden_dim)

    @classmethod
    def init_embeddings(cls, config, init: HFInit) -> dict:
        d = int(config.dim)
        e = {"word_embeddings": init.embedding(int(config.vocab_size), d)}
        if not config.sinusoidal_pos_embds:
            e["position_embeddings"] = init.embedding(int(config.max_position_embeddings), d)
        return {"embeddings": {**e, "LayerNorm": init.norm(d)}}

    @classmethod
    def params_from_state(cls, config, state) -> dict:
        if config.sinusoidal_pos_embds:
            state = dict(state)
            table = state.pop(_POSITIONS, None)
            want = sinusoidal_table(int(config.max_position_embeddings), int(config.dim))
            if table is not None and (np.shape(table) != want.shape or not np.allclose(table, want, atol=1e-5)):
                raise BackboneError(
                    f"config.json sets sinusoidal_pos_embds but the checkpoint's {_POSITIONS} is not the "
                    "sinusoidal table (trained position embeddings?). flaxheads keeps that table fixed; set "
                    "sinusoidal_pos_embds to false in config.json to load them as learned embeddings."
                )
        return super().params_from_state(config, state)

    def state_from_params(self, params) -> dict:
        state = super().state_from_params(params)
        if self.config.sinusoidal_pos_embds:
            state[_POSITIONS] = sinusoidal_table(int(self.config.max_position_embeddings), int(self.config.dim))
        return state

    def embeddings(self) -> Callable[..., jax.Array]:
        if not self.config.sinusoidal_pos_embds:
            return bert_embeddings
        table = jnp.asarray(sinusoidal_table(int(self.config.max_position_embeddings), int(self.config.dim)))

        def fixed_positions(params, *args, **kwargs):
            # The table joins the params only inside this call: a constant, never a trained weight.
            e = {**params["embeddings"], "position_embeddings": {"embedding": table}}
            return bert_embeddings({**params, "embeddings": e}, *args, **kwargs)

        return fixed_positions

    # BERT's encode less its token types and packing (DistilBERT has neither): fewer inputs than the
    # BertBackbone it reuses the layers of, so not a substitute for it in mypy's sense (no caller needs one)
    def encode(  # type: ignore[override]
        self, params, input_ids, attention_mask, *, train: bool = False, rng=None, position_ids=None, only_at=None
    ) -> jax.Array:
        return super().encode(
            params, input_ids, attention_mask, train=train, rng=rng, position_ids=position_ids, only_at=only_at
        )
