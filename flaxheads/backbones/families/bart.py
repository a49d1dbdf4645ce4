"""BART (``model_type`` ``bart``): what ``BartForSequenceClassification`` feeds its head, as a pure function.

The classifier reads the *decoder*: the encoder runs on ``input_ids`` with the attention
mask; the decoder runs on ``input_ids`` shifted one place right (``decoder_start_token_id``
first, ``-100`` replaced by the pad id: transformers' ``shift_tokens_right``) with causal
self-attention and no padding mask of its own (PyTorch builds none when it is given no
``decoder_attention_mask``), and cross-attention over the encoder output under the encoder's
attention mask. :meth:`BartBackbone.encode` returns the decoder's last hidden state
``[B, T, H]``; the BART preset pools it at each row's last ``<eos>`` (:mod:`flaxheads.heads.presets`).

Both stacks: token embeddings (one table, ``shared``, times ``sqrt(d_model)`` when
``scale_embedding``) plus learned positions ``0..T-1`` read at offset 2, ``layernorm_embedding``,
dropout; post-LayerNorm layers (residual, then LayerNorm) with ``dropout`` after each
attention output and the second feed-forward matmul, ``activation_dropout`` after the
activation, ``attention_dropout`` on the attention weights. LayerDrop (``encoder_layerdrop`` /
``decoder_layerdrop``) is not implemented: training with either above 0 is refused.

The params tree is HF ``FlaxBartModel``'s (``shared``, ``encoder``, ``decoder``; PyTorch's
tied ``encoder.embed_tokens`` / ``decoder.embed_tokens`` are ``shared``). Attention, dropout,
dense and LayerNorm are :mod:`~flaxheads.layers`' (attention, dropout, dense, norms).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from flaxheads.backbones.base import Backbone, BackboneError, HFConfig, activation_problem
from flaxheads.backbones.families.bert_shared import dropout_keys
from flaxheads.backbones.weights import pick, torch_from_tree, tree_from_torch
from flaxheads.layers.activations import get_activation
from flaxheads.layers.attention import cross_attention, fused_qkv, self_attention
from flaxheads.layers.dense import dense, embedding_lookup
from flaxheads.layers.dropout import dropout
from flaxheads.layers.init import HFInit
from flaxheads.layers.masks import mask_bias
from flaxheads.layers.norms import layer_norm_p
from flaxheads.layers.remat import checkpointed, mlp_out
from flaxheads.runtime.plan import ComputePlan

#: nn.LayerNorm's default epsilon, which every BART LayerNorm uses.
LN_EPS = 1e-5
#: BART's learned positions are read at ``position + 2`` (the table has two extra rows).
POSITION_OFFSET = 2
#: PyTorch names of the one token table (``shared``) and its tied copies in older checkpoints.
TOKEN_TABLES = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
#: Keys of transformers 3.x configs for BART-like variants (pre-LayerNorm, a final LayerNorm, ...).
#: transformers' BartModel ignores them and computes plain BART; a value that asks for another
#: layout is refused rather than silently run as BART.
LEGACY_LAYOUT = {
    "normalize_before": False,
    "add_final_layer_norm": False,
    "normalize_embedding": True,
    "static_position_embeddings": False,
    "do_blenderbot_90_layernorm": False,
    "extra_pos_embeddings": 2,
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What :func:`encode` needs from the config besides the params."""

    encoder_heads: int
    decoder_heads: int
    act: str  # HF's name (``activation_function``); looked up with the compute plan's barrier where applied
    dropout: float
    attn_dropout: float
    act_dropout: float
    embed_scale: float
    pad_token_id: int
    decoder_start_token_id: int

    @classmethod
    def from_config(cls, config) -> Settings:
        return cls(
            int(config.encoder_attention_heads),
            int(config.decoder_attention_heads),
            config.activation_function,
            float(config.dropout or 0.0),
            float(config.attention_dropout or 0.0),
            float(config.activation_dropout or 0.0),
            math.sqrt(int(config.d_model)) if config.scale_embedding else 1.0,
            int(config.pad_token_id),
            int(config.decoder_start_token_id),
        )


def shift_tokens_right(input_ids: jax.Array, pad_token_id: int, decoder_start_token_id: int) -> jax.Array:
    """The decoder's input: ``decoder_start_token_id``, then ``input_ids[:, :-1]``; ``-100`` (the
    label padding) becomes ``pad_token_id``."""
    start = jnp.full((input_ids.shape[0], 1), decoder_start_token_id, input_ids.dtype)
    shifted = jnp.concatenate([start, input_ids[:, :-1]], axis=1)
    return jnp.where(shifted == -100, jnp.asarray(pad_token_id, input_ids.dtype), shifted)


def embed(p: dict, table: jax.Array, ids: jax.Array, s: Settings, *, dtype, rng, plan: ComputePlan) -> jax.Array:
    """Scaled token embeddings + positions (offset 2), ``layernorm_embedding``, dropout: ``[B, T, H]``."""
    t = ids.shape[1]
    positions = p["embed_positions"]["embedding"]
    if t + POSITION_OFFSET > positions.shape[0]:
        raise BackboneError(
            f"sequence length {t} exceeds BART's max_position_embeddings "
            f"{positions.shape[0] - POSITION_OFFSET}; truncate the inputs"
        )
    x = embedding_lookup(table, ids, s.pad_token_id) * s.embed_scale + positions[POSITION_OFFSET : t + POSITION_OFFSET]
    return dropout(layer_norm_p(x.astype(dtype), p["layernorm_embedding"], LN_EPS, plan), s.dropout, rng)


def attention_block(
    p: dict,
    norm: dict,
    x: jax.Array,
    bias: jax.Array,
    s: Settings,
    *,
    num_heads: int,
    batch: int,
    plan: ComputePlan,
    memory: jax.Array | None = None,
    causal: bool = False,
    rng=None,
) -> jax.Array:
    """Self-attention (``memory`` None) or cross-attention over ``memory [B*S, H]``, ``out_proj``,
    dropout, residual, LayerNorm ``norm``; on the flattened ``x [B*T, H]``, as ``plan`` arranges them."""
    r_attn, r_out = jax.random.split(rng) if rng is not None else (None, None)
    d = x.shape[1] // num_heads
    w, b = fused_qkv(
        tuple(p[n]["kernel"] for n in ("q_proj", "k_proj", "v_proj")),
        tuple(p[n]["bias"] for n in ("q_proj", "k_proj", "v_proj")),
        1.0 / math.sqrt(d),
    )
    if memory is None:
        ctx = self_attention(
            x, w, b, bias, causal=causal, num_heads=num_heads, batch=batch, plan=plan, rate=s.attn_dropout, rng=r_attn
        )
    else:
        ctx = cross_attention(
            x, memory, w, b, bias, num_heads=num_heads, batch=batch, plan=plan, rate=s.attn_dropout, rng=r_attn
        )
    return layer_norm_p(x + dropout(dense(ctx, p["out_proj"], plan), s.dropout, r_out), norm, LN_EPS, plan)


def feed_forward(p: dict, x: jax.Array, s: Settings, plan: ComputePlan, rng=None) -> jax.Array:
    """fc1 -> act -> dropout(activation_dropout) -> fc2 -> dropout -> residual -> ``final_layer_norm``."""
    r_act, r_out = jax.random.split(rng) if rng is not None else (None, None)
    act = get_activation(s.act, barrier=plan.activation_barrier)
    inter = dropout(act(dense(x, p["fc1"], plan)), s.act_dropout, r_act)
    return layer_norm_p(
        x + dropout(mlp_out(dense(inter, p["fc2"], plan)), s.dropout, r_out), p["final_layer_norm"], LN_EPS, plan
    )


def encoder_layer(
    p: dict, x: jax.Array, bias: jax.Array, *, s: Settings, batch: int, plan: ComputePlan, rng=None
) -> jax.Array:
    r_attn, r_ffn = jax.random.split(rng) if rng is not None else (None, None)
    x = attention_block(
        p["self_attn"],
        p["self_attn_layer_norm"],
        x,
        bias,
        s,
        num_heads=s.encoder_heads,
        batch=batch,
        plan=plan,
        rng=r_attn,
    )
    return feed_forward(p, x, s, plan, r_ffn)


def decoder_layer(
    p: dict,
    x: jax.Array,
    memory: jax.Array,
    self_bias: jax.Array,
    cross_bias: jax.Array,
    *,
    s: Settings,
    batch: int,
    plan: ComputePlan,
    rng=None,
) -> jax.Array:
    r_self, r_cross, r_ffn = jax.random.split(rng, 3) if rng is not None else (None, None, None)
    x = attention_block(
        p["self_attn"],
        p["self_attn_layer_norm"],
        x,
        self_bias,
        s,
        num_heads=s.decoder_heads,
        batch=batch,
        plan=plan,
        causal=True,
        rng=r_self,
    )
    x = attention_block(
        p["encoder_attn"],
        p["encoder_attn_layer_norm"],
        x,
        cross_bias,
        s,
        num_heads=s.decoder_heads,
        batch=batch,
        plan=plan,
        memory=memory,
        rng=r_cross,
    )
    return feed_forward(p, x, s, plan, r_ffn)


def run_stack(p: dict, step: Callable, x: jax.Array, rngs, *, remat: bool | str) -> jax.Array:
    """``step(layer_params, x, rng=...)`` over the stack's layers on ``x [B, T, H]``, flattened to ``[B*T, H]``."""
    step = checkpointed(step, remat)  # remat: what the backward pass keeps, by policy
    bsz, t, h = x.shape
    x = x.reshape(bsz * t, h)
    layers = p["layers"]
    for i, r in enumerate(rngs):
        x = step(layers[str(i)], x, rng=r)
    return x.reshape(bsz, t, h)


def encode(
    params: Mapping,
    input_ids,
    attention_mask=None,
    *,
    settings: Settings,
    plan: ComputePlan,
    dtype=jnp.float32,
    train: bool = False,
    rng: jax.Array | None = None,
    remat: bool | str = False,
    return_encoder: bool = False,
) -> jax.Array:
    """BART's decoder last hidden state ``[B, T, H]`` in ``dtype`` (the encoder's with
    ``return_encoder=True``), computed as ``plan`` arranges it (:class:`~flaxheads.runtime.plan.ComputePlan`);
    a pure function of ``params``."""
    s = settings
    input_ids = jnp.asarray(input_ids)
    bsz, _ = input_ids.shape
    attention_mask = jnp.ones_like(input_ids) if attention_mask is None else jnp.asarray(attention_mask)
    enc_rng, dec_rng = jax.random.split(rng) if (train and rng is not None) else (rng, rng)
    table = params["shared"]["embedding"]
    key_bias = mask_bias(attention_mask, dtype)

    enc, dec = params["encoder"], params["decoder"]
    emb_rng, rngs = dropout_keys(enc_rng, len(enc["layers"]), train)
    x = embed(enc, table, input_ids, s, dtype=dtype, rng=emb_rng, plan=plan)
    step = partial(encoder_layer, bias=key_bias, s=s, batch=bsz, plan=plan)
    memory = run_stack(enc, step, x, rngs, remat=remat)
    if return_encoder:
        return memory

    emb_rng, rngs = dropout_keys(dec_rng, len(dec["layers"]), train)
    y = embed(
        dec,
        table,
        shift_tokens_right(input_ids, s.pad_token_id, s.decoder_start_token_id),
        s,
        dtype=dtype,
        rng=emb_rng,
        plan=plan,
    )
    step = partial(
        decoder_layer,
        memory=memory.reshape(-1, memory.shape[-1]),
        self_bias=jnp.zeros_like(key_bias),
        cross_bias=key_bias,
        s=s,
        batch=bsz,
        plan=plan,
    )
    return run_stack(dec, step, y, rngs, remat=remat)


def _is_weight(name: str) -> bool:
    # old checkpoints also carry "encoder.version" / "decoder.version" buffers
    return name.rpartition(".")[2] in ("weight", "bias") and name.partition(".")[0] in ("encoder", "decoder")


class BartBackbone(Backbone):
    """BART (``model_type`` ``bart``): the decoder output ``BartForSequenceClassification``
    classifies (see the module docstring), on HF ``FlaxBartModel``'s params tree. The compute
    plan's ``attention_chunks`` splits attention into independent batch chunks (speed only)."""

    model_types = ("bart",)
    family = "BART"
    base_model_prefix = "model"
    classifier_dropout_key = "classifier_dropout"
    lora_targets = ("q_proj", "v_proj")
    tokenizer_token_types = False
    defaults = {
        "vocab_size": 50265,
        "max_position_embeddings": 1024,
        "encoder_layers": 12,
        "encoder_ffn_dim": 4096,
        "encoder_attention_heads": 16,
        "decoder_layers": 12,
        "decoder_ffn_dim": 4096,
        "decoder_attention_heads": 16,
        "encoder_layerdrop": 0.0,
        "decoder_layerdrop": 0.0,
        "activation_function": "gelu",
        "d_model": 1024,
        "dropout": 0.1,
        "attention_dropout": 0.0,
        "activation_dropout": 0.0,
        "init_std": 0.02,
        "classifier_dropout": 0.0,
        "scale_embedding": False,
        "pad_token_id": 1,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "decoder_start_token_id": 2,
        "tie_word_embeddings": True,
    }
    features = frozenset({"remat", "bf16"})
    extra_inputs = ()
    settings_class = Settings
    settings: Settings

    @classmethod
    def complete_config(cls, config: HFConfig) -> HFConfig:
        """Defaults, plus ``hidden_size`` as an alias of ``d_model`` (BartConfig's attribute_map)."""
        config = super().complete_config(config)
        return config if "hidden_size" in config else config.replace(hidden_size=config["d_model"])

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        why = None
        legacy = {k: config[k] for k, ok in LEGACY_LAYOUT.items() if config.get(k, ok) != ok}
        if legacy:
            want = {k: LEGACY_LAYOUT[k] for k in legacy}
            why = (
                f"{legacy} asks for another layout than BART's {want} (transformers' BartModel ignores these "
                "keys and computes plain BART)"
            )
        elif int(config.hidden_size) != int(config.d_model):
            why = f"hidden_size {config.hidden_size} differs from d_model {config.d_model}"
        elif any(int(config.d_model) % int(config[k]) for k in ("encoder_attention_heads", "decoder_attention_heads")):
            why = (
                f"d_model {config.d_model} is not divisible by the attention heads "
                f"({config.encoder_attention_heads} / {config.decoder_attention_heads})"
            )
        elif not config.get("tie_word_embeddings", True):
            why = (
                "tie_word_embeddings=False (separate encoder/decoder token tables); only the shared table is "
                "implemented"
            )
        elif config.get("pad_token_id") is None or config.get("decoder_start_token_id") is None:
            why = "pad_token_id or decoder_start_token_id is None; the decoder input (shifted input_ids) needs both"
        else:
            why = activation_problem(config.activation_function)
        if why:
            raise BackboneError(
                f"flaxheads' BART backbone cannot run this config: {why}. Use a checkpoint "
                "without it, or fix config.json if the value is wrong."
            )

    @classmethod
    def init_params(cls, config, rng) -> dict:
        init = HFInit(rng, float(config.init_std))
        h = int(config.d_model)

        def attn():
            return {n: init.dense(h, h) for n in ("q_proj", "k_proj", "v_proj", "out_proj")}

        def stack(n: int, ffn: int, cross: bool) -> dict:
            layers = {}
            for i in range(n):
                lp = {"self_attn": attn(), "self_attn_layer_norm": init.norm(h)}
                if cross:
                    lp.update(encoder_attn=attn(), encoder_attn_layer_norm=init.norm(h))
                lp.update(fc1=init.dense(h, ffn), fc2=init.dense(ffn, h), final_layer_norm=init.norm(h))
                layers[str(i)] = lp
            return {
                "embed_positions": init.embedding(int(config.max_position_embeddings) + POSITION_OFFSET, h),
                "layernorm_embedding": init.norm(h),
                "layers": layers,
            }

        shared = init.embedding(int(config.vocab_size), h)["embedding"]
        shared = shared.at[int(config.pad_token_id)].set(0.0)  # PyTorch zeroes the padding_idx row
        return {
            "shared": {"embedding": shared},
            "encoder": stack(int(config.encoder_layers), int(config.encoder_ffn_dim), cross=False),
            "decoder": stack(int(config.decoder_layers), int(config.decoder_ffn_dim), cross=True),
        }

    @classmethod
    def params_from_state(cls, config, state) -> dict:
        tables = [np.asarray(state[k]) for k in TOKEN_TABLES if k in state]
        if not tables:
            raise KeyError(TOKEN_TABLES[0])
        if any(t.shape != tables[0].shape or not np.array_equal(t, tables[0]) for t in tables[1:]):
            raise BackboneError(
                f"the checkpoint's token tables {[k for k in TOKEN_TABLES if k in state]} differ; "
                "flaxheads' BART has one shared table (tie_word_embeddings=True)"
            )
        return {"shared": {"embedding": tables[0]}, **tree_from_torch(pick(state, _is_weight))}

    def state_from_params(self, params) -> dict:
        # only "shared.weight": what save_pretrained writes for the tied tables (transformers 4 and 5)
        return torch_from_tree({k: params[k] for k in ("shared", "encoder", "decoder")})

    def encode(self, params, input_ids, attention_mask, *, train: bool = False, rng=None) -> jax.Array:
        c = self.config
        if train and (float(c.encoder_layerdrop or 0.0) > 0 or float(c.decoder_layerdrop or 0.0) > 0):
            raise BackboneError(
                f"training with LayerDrop (encoder_layerdrop={c.encoder_layerdrop}, decoder_layerdrop="
                f"{c.decoder_layerdrop}) is not implemented in flaxheads' BART; set both to 0.0 in "
                "config.json to train with every layer"
            )
        return encode(
            params,
            input_ids,
            attention_mask,
            settings=self.settings,
            plan=self.plan,
            dtype=self.dtype,
            train=train,
            rng=rng,
            remat=self.remat_policy,
        )
