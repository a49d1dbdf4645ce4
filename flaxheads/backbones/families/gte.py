"""GTE (``model_type`` ``gte``: mGTE, gte-multilingual, gte-*-en-v1.5): transformers 5's ``GteModel``.

A post-LayerNorm BERT with rotary positions, q/k/v/o biases, a GeGLU feed-forward whose gated
product goes through ``hidden_dropout_prob`` and whose ``down_proj`` has a bias, and token-type
embeddings unless ``type_vocab_size`` is 0 (gte-base-en-v1.5)
(:mod:`~flaxheads.backbones.families.rotary_bert` computes it). Its classifier
(``GteForSequenceClassification``, the multilingual reranker) is BERT's: first token ->
``pooler.dense`` + tanh -> dropout -> ``classifier``.

Weights are stored packed (``encoder.layer.<i>.attention.qkv_proj``, ``mlp.up_gate_proj`` = up then
gate, ``attention.o_proj``, ``attn_ln``, ``mlp_ln``), by Alibaba's hub code (under ``new.`` in its
classifiers) and by transformers 5's ``save_pretrained`` alike.

RoPE scaling. The hub checkpoints scale RoPE statically by NTK (``rope_scaling: {type: ntk, factor:
f}`` in Alibaba's ``NewConfig``): frequencies ``(theta f) ** (-2i / d) / f ** (2 / d)``, for every
sequence length (the code builds its table for ``max_position_embeddings * f`` positions, past the
threshold at which it rescales). transformers writes that as a ``linear`` RoPE with base ``theta * f``
and factor ``f ** (2 / d)``; :meth:`GteBackbone.from_custom_config` maps a hub ``config.json`` (``model_type
new``, ``auto_map`` to ``NewConfig``) to that ``GteConfig``.
"""

from __future__ import annotations

from flaxheads.backbones.base import BackboneError, HFConfig
from flaxheads.backbones.families.rotary_bert import (
    COMMON_KEYS,
    LAYERS_RENAME,
    RotaryBertBackbone,
    custom_config_class,
    native_keys,
)

#: Alibaba's hub code: the ``model_type`` and ``AutoConfig`` class of its ``config.json``
HUB_MODEL_TYPE, HUB_CONFIG = "new", "configuration.NewConfig"
#: hub keys that must hold these values for transformers' class to compute the same function
_REQUIRED = {
    "position_embedding_type": "rope",
    "layer_norm_type": "layer_norm",
    "pack_qkv": True,
    "logn_attention_scale": False,
    "logn_attention_clip1": False,
}


def ntk_as_linear(theta: float, scaling, dim: int) -> dict:
    """``rope_parameters`` of the hub code's RoPE: ``rope_scaling`` None (plain RoPE) or ``{type: ntk,
    factor: f}`` (static NTK; no scaling for ``f <= 1``, where the code never rescales) as transformers' ``linear``."""
    if not scaling:
        return {"rope_type": "default", "rope_theta": float(theta)}
    f = float(scaling["factor"])
    if f <= 1.0:
        return {"rope_type": "default", "rope_theta": float(theta)}
    return {"rope_type": "linear", "rope_theta": float(theta) * f, "factor": f ** (2.0 / dim)}


class GteBackbone(RotaryBertBackbone):
    """GTE: see the module docstring."""

    model_types = ("gte",)
    family = "GTE"
    base_model_prefix = "gte"
    custom_prefixes = ("new",)
    default_theta = 160_000.0
    gated = True
    attention_bias = True
    down_bias = True
    gated_dropout = True
    tokenizer_token_types = False  # XLMRobertaTokenizer (gte-*-en-v1.5: BERT's, with no token-type table)
    # transformers' GteConfig defaults
    defaults = {
        "vocab_size": 250048,
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.0,
        "max_position_embeddings": 8192,
        "type_vocab_size": 1,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-12,
        "pad_token_id": 1,
        "classifier_dropout": None,
    }
    hub_renames = (
        LAYERS_RENAME,
        (r"\.attention\.o_proj\.", ".self_attn.o_proj."),
        (r"\.attn_ln\.", ".post_attention_layernorm."),
        (r"\.mlp_ln\.", ".post_mlp_layernorm."),
    )
    hub_fused = (
        (r"attention\.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        (r"mlp\.up_gate_proj", ("mlp.up_proj", "mlp.gate_proj")),
    )

    @classmethod
    def from_custom_config(cls, config: HFConfig) -> HFConfig | None:
        if config.get("model_type") != HUB_MODEL_TYPE or custom_config_class(config) not in ("", HUB_CONFIG):
            return None
        where = object.__getattribute__(config, "_source") or "config.json"
        bad = {k: config[k] for k, want in _REQUIRED.items() if config.get(k) is not None and config[k] != want}
        scaling = config.get("rope_scaling")
        if scaling and (scaling.get("type", scaling.get("rope_type")) != "ntk" or scaling.get("mixed_b") is not None):
            bad["rope_scaling"] = scaling
        if bad:
            raise BackboneError(
                f"{where}: a GTE config for Alibaba's own code with {bad}, which transformers' GteModel "
                "(and flaxheads' backbone, which computes it) does not compute. Use a gte-multilingual "
                "or gte-*-en-v1.5 style model (RoPE with static NTK scaling, LayerNorm, packed q/k/v)."
            )
        dim = int(config.get("hidden_size", 768)) // int(config.get("num_attention_heads", 12))
        archs = [a.replace("New", "Gte", 1) for a in config.get("architectures") or []] or None
        return native_keys(
            config,
            COMMON_KEYS,
            model_type="gte",
            architectures=archs,
            rope_parameters=ntk_as_linear(config.get("rope_theta") or 10_000.0, scaling, dim),
        )
