"""nomic-bert (``model_type`` ``nomic_bert``: nomic-embed-text v1 / v1.5): transformers 5's ``NomicBertModel``.

A post-LayerNorm BERT with rotary positions (base 1000), a SwiGLU feed-forward
(``down(silu(gate(x)) * up(x))``), word + token-type embeddings and no biases in the attention and
feed-forward projections (:mod:`~flaxheads.backbones.families.rotary_bert` computes it). Its classifier
(``NomicBertForSequenceClassification``) is BERT's: the first token through ``pooler.dense`` + tanh,
dropout, ``classifier``.

Weights are stored fused (``encoder.layers.<i>.attn.Wqkv``, ``mlp.fc11`` = up, ``mlp.fc12`` = gate,
``mlp.fc2``, ``emb_ln``, ``norm1``, ``norm2``), by nomic's hub code and by transformers 5's
``save_pretrained`` alike. The hub folders' ``config.json`` is written for nomic's own code
(``auto_map``; GPT-2-style keys ``n_embd``, ``n_layer``, ``rotary_emb_base``, ...):
:meth:`NomicBertBackbone.from_custom_config` reads it as the ``NomicBertConfig`` it describes, and
refuses the settings transformers' class does not compute (prenorm, parallel blocks, biases, partial or
interleaved rotary, scaled rotary, RMSNorm, mixture-of-experts layers).
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

#: nomic's hub code's feed-forward activations -> the gate's activation in transformers' SwiGLU/GeGLU
_GATED_ACTS = {"swiglu": "silu", "geglu": "gelu"}
#: hub keys that must hold these values for transformers' class to compute the same function
_REQUIRED = {
    "prenorm": False,
    "parallel_block": False,
    "qkv_proj_bias": False,
    "mlp_fc1_bias": False,
    "mlp_fc2_bias": False,
    "use_rms_norm": False,
    "causal": False,
    "rotary_emb_interleaved": False,
    "rotary_emb_fraction": 1.0,
    "rotary_scaling_factor": None,
    "scale_attn_weights": True,
    "moe_every_n_layers": 0,
    "num_experts": 0,
}


class NomicBertBackbone(RotaryBertBackbone):
    """nomic-bert: see the module docstring."""

    model_types = ("nomic_bert",)
    family = "nomic-bert"
    base_model_prefix = "nomic_bert"
    default_theta = 1000.0
    gated = True
    attention_bias = False
    down_bias = False
    tokenizer_token_types = True  # BertTokenizer
    # transformers' NomicBertConfig defaults
    defaults = {
        "vocab_size": 30528,
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
        "hidden_act": "silu",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "max_position_embeddings": 2048,
        "type_vocab_size": 2,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-12,
        "pad_token_id": 0,
        "classifier_dropout": None,
    }
    hub_renames = (
        LAYERS_RENAME,
        (r"^emb_ln\.", "embeddings.LayerNorm."),
        (r"\.attn\.out_proj\.", ".self_attn.o_proj."),
        (r"\.mlp\.fc11\.", ".mlp.up_proj."),
        (r"\.mlp\.fc12\.", ".mlp.gate_proj."),
        (r"\.mlp\.fc2\.", ".mlp.down_proj."),
        (r"\.norm1\.", ".post_attention_layernorm."),
        (r"\.norm2\.", ".post_mlp_layernorm."),
    )
    hub_fused = ((r"attn\.Wqkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),)

    @classmethod
    def from_custom_config(cls, config: HFConfig) -> HFConfig | None:
        hub_keys = "n_embd" in config or custom_config_class(config).endswith("nomic_bert.NomicBertConfig")
        if config.get("model_type") != "nomic_bert" or not hub_keys:
            return None
        where = object.__getattribute__(config, "_source") or "config.json"
        bad = {k: config[k] for k, want in _REQUIRED.items() if config.get(k) is not None and config[k] != want}
        act = config.get("activation_function", "swiglu")
        if act not in _GATED_ACTS:
            bad["activation_function"] = act
        if config.get("n_inner") is None and "intermediate_size" not in config:
            bad["n_inner"] = None
        if bad:
            raise BackboneError(
                f"{where}: a nomic-bert config for nomic's own code with {bad}, which transformers' "
                "NomicBertModel (and flaxheads' backbone, which computes it) does not compute. Use a "
                "nomic-embed-text v1 / v1.5 style model (post-LayerNorm, SwiGLU, no biases, full "
                "rotary)."
            )
        dropout = config.get("resid_pdrop")
        return native_keys(
            config,
            COMMON_KEYS,
            model_type="nomic_bert",
            architectures=config.get("architectures"),
            hidden_size=config.get("n_embd"),
            num_hidden_layers=config.get("n_layer"),
            num_attention_heads=config.get("n_head"),
            intermediate_size=config.get("n_inner"),
            max_position_embeddings=config.get("n_positions"),
            layer_norm_eps=config.get("layer_norm_epsilon"),
            hidden_act=_GATED_ACTS[act],
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=config.get("attn_pdrop"),
            rope_parameters={"rope_type": "default", "rope_theta": float(config.get("rotary_emb_base") or 1000.0)},
        )
