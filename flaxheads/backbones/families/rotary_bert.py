"""Post-LayerNorm BERT encoders with rotary positions: transformers 5's ``JinaEmbeddingsV3Model`` and the
two classes built on it, ``NomicBertModel`` and ``GteModel``, as one pure function with per-family switches.

What the PyTorch models compute (eager and sdpa attention agree):

* word embeddings (``padding_idx``: the pad row gets no gradient) plus token-type embeddings where
  the model has them (``type_vocab_size > 0``; types default to zeros), no position embeddings,
  LayerNorm, ``hidden_dropout_prob`` dropout;
* per layer, post-LayerNorm as BERT: ``x = LN(x + drop(o_proj(attention(x))))``, then
  ``x = LN(x + drop(mlp(x)))``;
* attention: q, k, v projections (with biases where the family has them), rotary position
  embeddings on q and k (rotate-half layout, positions ``0..T-1`` whatever the padding, as
  PyTorch's ``arange``; ``position_ids`` override them), scores times ``head_dim ** -0.5``, the key
  padding mask, ``attention_probs_dropout_prob`` on the probabilities;
* the feed-forward: ``fc1 -> act -> fc2`` (Jina v3), or gated ``down(act(gate(x)) * up(x))``
  (nomic-bert's SwiGLU; GTE's GeGLU, whose gated product also goes through ``hidden_dropout_prob``
  and whose ``down_proj`` has a bias).

The params tree is the PyTorch module tree of transformers 5 (``embeddings/word_embeddings``,
``layers/<i>/self_attn/q_proj``, ``mlp/gate_proj``, ``post_attention_layernorm``, ...) with Flax leaves,
so LoRA targets and a PEFT export name the modules PEFT adapts. On disk the same weights are stored
fused, as the models' hub code wrote them and as transformers 5's ``save_pretrained`` still writes
them (``attn.Wqkv`` / ``attention.qkv_proj``, GTE's ``mlp.up_gate_proj``, ``emb_ln``, ``norm1``, ...):
:meth:`RotaryBertBackbone.params_from_state` reads both spellings (each family's
:attr:`~RotaryBertBackbone.hub_renames` and :attr:`~RotaryBertBackbone.hub_fused`, transformers'
conversion mapping written down once), and an export writes transformers 5's module names, which
it loads directly. The forward fuses again: one ``[H, 3H]`` product for q, k, v (the attention
scale folded into q's kernel) and one ``[H, 2F]`` product for gate and up.

RoPE: ``rope_parameters`` (or the older ``rope_theta`` / ``rope_scaling``), computed by the decoders'
:func:`~flaxheads.backbones.families.decoder_config.make_rope` (``default``, ``linear`` (GTE's static
NTK scaling is written as ``linear``), ``llama3``, ``yarn``, ``dynamic`` up to ``max_position_embeddings``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from functools import partial
from typing import Any, ClassVar, cast

import jax
import jax.numpy as jnp
import numpy as np

from flaxheads.backbones.base import Backbone, BackboneError, HFConfig, activation_problem
from flaxheads.backbones.families.bert_shared import dropout_keys
from flaxheads.backbones.families.decoder import linear, rope_cos_sin
from flaxheads.backbones.families.decoder_config import ROPE_TYPES, Rope, make_rope
from flaxheads.layers.activations import get_activation
from flaxheads.layers.attention import attend_chunked
from flaxheads.layers.dense import embedding_lookup, matmul
from flaxheads.layers.dropout import dropout
from flaxheads.layers.init import HFInit
from flaxheads.layers.masks import mask_bias
from flaxheads.layers.norms import layer_norm_p
from flaxheads.layers.positions import apply_rotary
from flaxheads.layers.remat import attention_out, checkpointed, mlp_out
from flaxheads.runtime.plan import ComputePlan

QKV = ("q_proj", "k_proj", "v_proj")
#: the tree's top-level modules (also the first part of the PyTorch names under the base prefix)
TOP_LEVEL = ("embeddings", "layers")
#: what a hub checkpoint of jina's LoRA code stores beside each adapted weight (``parametrize``)
_PARAMETRIZED = ".parametrizations.weight."


# ---- config -------------------------------------------------------------------------------------------------
def rope_parameters(config: Mapping, default_theta: float) -> dict:
    """The RoPE parameters as transformers 5 standardises them: ``rope_parameters``, else the older
    ``rope_scaling`` dict, with ``rope_type`` (or ``type``) and ``rope_theta`` (or the config's
    ``rope_theta``, or the class's default base)."""
    p = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    p["rope_type"] = p.get("rope_type", p.get("type", "default"))
    p.pop("type", None)
    p.setdefault("rope_theta", config.get("rope_theta") or default_theta)
    return p


def head_dim(config: Mapping) -> int:
    return int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))


def config_problem(config: Mapping, default_theta: float) -> str:
    """Why :func:`encode` would not compute what the PyTorch class computes for ``config`` ("" when it does)."""
    h, nh, d = int(config["hidden_size"]), int(config["num_attention_heads"]), head_dim(config)
    if h % nh:
        return f"hidden_size {h} is not divisible by num_attention_heads {nh}"
    if d * nh != h:
        return f"head_dim {d} x {nh} heads is not hidden_size {h}"
    if d % 2:
        return f"the head dim {d} is odd; rotary embeddings rotate pairs of dims"
    p = rope_parameters(config, default_theta)
    if p["rope_type"] not in ROPE_TYPES:
        return f"RoPE type {p['rope_type']!r} (supported: {', '.join(ROPE_TYPES)})"
    if float(p.get("partial_rotary_factor", 1.0)) != 1.0:
        return f"partial_rotary_factor {p['partial_rotary_factor']} (RoPE on part of each head)"
    if p["rope_type"] == "linear" and not p.get("factor"):
        return "a 'linear' RoPE without its 'factor'"
    return activation_problem(config.get("hidden_act"))


@dataclasses.dataclass(frozen=True)
class Settings:
    """What :func:`encode` needs from the config besides the params."""

    num_layers: int
    num_heads: int
    eps: float
    act: str  # HF's name (``hidden_act``), looked up with the compute plan's barrier
    rope: Rope
    pad_token_id: int | None
    hidden_dropout: float = 0.0
    attn_dropout: float = 0.0
    gated_dropout: bool = False  # GTE: dropout on act(gate) * up

    @classmethod
    def from_config(cls, config, *, default_theta: float, gated_dropout: bool = False) -> Settings:
        rope = make_rope(config, rope_parameters(config, default_theta), head_dim(config))
        pad = config.get("pad_token_id")
        return cls(
            int(config["num_hidden_layers"]),
            int(config["num_attention_heads"]),
            float(config["layer_norm_eps"]),
            config["hidden_act"],
            rope,
            None if pad is None else int(pad),
            float(config.get("hidden_dropout_prob") or 0.0),
            float(config.get("attention_probs_dropout_prob") or 0.0),
            gated_dropout,
        )


# ---- the model ----------------------------------------------------------------------------------------------
def embed(e: Mapping, input_ids, token_type_ids, *, s: Settings, dtype, plan: ComputePlan, rng) -> jax.Array:
    """Word (+ token-type) embeddings -> LayerNorm -> dropout: ``[B, T, H]``."""
    x = embedding_lookup(e["word_embeddings"]["embedding"], input_ids, s.pad_token_id)
    if "token_type_embeddings" in e:
        x = x + jnp.take(e["token_type_embeddings"]["embedding"], token_type_ids, axis=0)
    return dropout(layer_norm_p(x.astype(dtype), e["LayerNorm"], s.eps, plan), s.hidden_dropout, rng)


def attention(p: Mapping, x: jax.Array, cos, sin, bias, *, s: Settings, plan: ComputePlan, rng) -> jax.Array:
    """q/k/v in one product (the scale folded into q), rotary q and k, attention, ``o_proj``: ``[B, T, H]``."""
    b, t, h = x.shape
    d = h // s.num_heads
    scale = 1.0 / math.sqrt(d)
    w = jnp.concatenate([p["q_proj"]["kernel"] * scale, p["k_proj"]["kernel"], p["v_proj"]["kernel"]], axis=1)
    qkv = matmul(x, w, plan)
    if "bias" in p["q_proj"]:
        # unlike BERT's (layers.attention.fused_qkv), the key bias is not cancelled by the softmax here: the
        # rotation turns it into a different vector at each key position, so it keeps its gradient
        qkv = qkv + jnp.concatenate([p["q_proj"]["bias"] * scale, p["k_proj"]["bias"], p["v_proj"]["bias"]]).astype(
            x.dtype
        )
    qkv = qkv.reshape(b, t, 3, s.num_heads, d)
    # the rotation is linear, so the scale folded into q commutes with it
    q, k = apply_rotary(qkv[:, :, 0], cos, sin), apply_rotary(qkv[:, :, 1], cos, sin)
    ctx = attend_chunked(q, k, qkv[:, :, 2], bias, plan=plan, rate=s.attn_dropout, rng=rng)
    return linear(attention_out(ctx).reshape(b, t, h), p["o_proj"], plan)


def mlp(p: Mapping, x: jax.Array, *, s: Settings, plan: ComputePlan, rng) -> jax.Array:
    """``fc2(act(fc1(x)))``, or ``down(drop?(act(gate(x)) * up(x)))`` with gate and up in one product."""
    act = get_activation(s.act, barrier=plan.activation_barrier)
    if "fc1" in p:
        return mlp_out(linear(act(linear(x, p["fc1"], plan)), p["fc2"], plan))
    f = p["gate_proj"]["kernel"].shape[1]
    gate_up = matmul(x, jnp.concatenate([p["gate_proj"]["kernel"], p["up_proj"]["kernel"]], axis=1), plan)
    hidden = act(gate_up[..., :f]) * gate_up[..., f:]
    if s.gated_dropout:
        hidden = dropout(hidden, s.hidden_dropout, rng)
    return mlp_out(linear(hidden, p["down_proj"], plan))


def layer(p: Mapping, x: jax.Array, cos, sin, bias, *, s: Settings, plan: ComputePlan, rng=None) -> jax.Array:
    """One post-LayerNorm layer on ``x [B, T, H]``."""
    r_attn, r_out, r_mlp, r_mlp_out = jax.random.split(rng, 4) if rng is not None else (None,) * 4
    a = attention(p["self_attn"], x, cos, sin, bias, s=s, plan=plan, rng=r_attn)
    x = layer_norm_p(x + dropout(a, s.hidden_dropout, r_out), p["post_attention_layernorm"], s.eps, plan)
    m = mlp(p["mlp"], x, s=s, plan=plan, rng=r_mlp)
    return layer_norm_p(x + dropout(m, s.hidden_dropout, r_mlp_out), p["post_mlp_layernorm"], s.eps, plan)


def encode(
    params: Mapping,
    input_ids,
    attention_mask=None,
    token_type_ids=None,
    position_ids=None,
    *,
    settings: Settings,
    plan: ComputePlan,
    dtype=jnp.float32,
    train: bool = False,
    rng: jax.Array | None = None,
    remat: bool | str = False,
) -> jax.Array:
    """The last hidden state ``[B, T, H]`` in ``dtype``; pure in ``params``. ``remat``: each layer
    recomputed in the backward pass by that policy (:mod:`flaxheads.layers.remat`)."""
    s = settings
    input_ids = jnp.asarray(input_ids)
    b, t = input_ids.shape
    if s.rope.max_len is not None and t > s.rope.max_len:
        raise BackboneError(
            f"dynamic RoPE scaling rescales past max_position_embeddings={s.rope.max_len} tokens "
            f"depending on earlier calls; flaxheads computes it only up to there (got {t})"
        )
    attention_mask = jnp.ones_like(input_ids) if attention_mask is None else jnp.asarray(attention_mask)
    token_type_ids = jnp.zeros_like(input_ids) if token_type_ids is None else jnp.asarray(token_type_ids)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t)) if position_ids is None else jnp.asarray(position_ids)
    layers = params["layers"]
    if len(layers) != s.num_layers:
        raise BackboneError(f"the params have {len(layers)} layers but the config has {s.num_layers}")
    emb_rng, rngs = dropout_keys(rng, s.num_layers, train)
    x = embed(params["embeddings"], input_ids, token_type_ids, s=s, dtype=dtype, plan=plan, rng=emb_rng)
    cos, sin = rope_cos_sin(s.rope, positions, dtype)
    bias = mask_bias(attention_mask, dtype)
    step = checkpointed(partial(layer, s=s, plan=plan), remat)
    for i, r in enumerate(rngs):
        x = step(layers[str(i)], x, cos, sin, bias, rng=r)
    return x


# ---- hub names ----------------------------------------------------------------------------------------------
def hub_to_native(state: Mapping[str, np.ndarray], renames, fused) -> dict[str, np.ndarray]:
    """A base-model state dict in transformers 5's module names: each name through the regex
    ``renames`` in order, then each fused tensor (``fused``: ``(module regex, (target modules...))``)
    cut into equal row blocks, one per target (PyTorch ``[out, in]`` weights and their biases).
    Names already native pass through unchanged; jina's ``parametrize`` spelling
    (``<module>.parametrizations.weight.original``) is the weight itself, its LoRA tensors are left out."""
    out: dict[str, np.ndarray] = {}
    for name, value in state.items():
        if _PARAMETRIZED in name:
            if not name.endswith(_PARAMETRIZED + "original"):
                continue  # task adapters: read by the family that has them (jina_v3.task_adapters)
            name = name[: -len(_PARAMETRIZED + "original")] + ".weight"
        for pattern, repl in renames:
            name = re.sub(pattern, repl, name)
        for pattern, targets in fused:
            m = re.search(rf"(^|\.){pattern}\.(weight|bias)$", name)
            if m is None:
                continue
            head = name[: m.start()] + m.group(1)
            for target, part in zip(targets, np.split(np.asarray(value), len(targets), axis=0)):
                out[f"{head}{target}.{m.group(2)}"] = part
            break
        else:
            out[name] = value
    return out


#: the layer list: ``encoder.layers.<i>`` (nomic, Jina) or ``encoder.layer.<i>`` (GTE) -> ``layers.<i>``
LAYERS_RENAME = (r"(^|\.)encoder\.layers?\.(\d+)\.", r"\1layers.\2.")


class RotaryBertBackbone(Backbone):
    """The shared family class (see the module docstring); each family sets the class attributes."""

    top_level = TOP_LEVEL
    classifier_dropout_key = "classifier_dropout"
    lora_targets = ("q_proj", "v_proj")
    features = frozenset({"token_type_ids", "position_ids", "remat", "bf16"})
    extra_inputs = ("token_type_ids", "position_ids")
    #: transformers' default RoPE base of the family's config class (``default_theta``)
    default_theta: ClassVar[float] = 10_000.0
    #: whether the feed-forward is gated (``gate_proj``, ``up_proj``, ``down_proj``) rather than ``fc1``/``fc2``
    gated: ClassVar[bool] = False
    #: biases: on q/k/v/o, and on ``down_proj`` (a plain feed-forward always has them)
    attention_bias: ClassVar[bool] = True
    down_bias: ClassVar[bool] = False
    #: dropout on the gated product ``act(gate) * up`` (GTE)
    gated_dropout: ClassVar[bool] = False
    #: the hub checkpoints' names -> transformers 5's (regex, replacement), then fused tensors to cut
    hub_renames: ClassVar[tuple[tuple[str, str], ...]] = (LAYERS_RENAME,)
    hub_fused: ClassVar[tuple[tuple[str, tuple[str, ...]], ...]] = ()
    #: the state-dict prefixes the hub's custom code put its base model under, besides ``base_model_prefix``
    custom_prefixes: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def settings_for(cls, config) -> Settings:
        return Settings.from_config(config, default_theta=cls.default_theta, gated_dropout=cls.gated_dropout)

    def __init__(
        self, config, params: dict, dtype=jnp.float32, remat: bool | str = False, plan: ComputePlan | None = None
    ):
        super().__init__(config, params, dtype=dtype, remat=remat, plan=plan)
        self.settings = self.settings_for(self.config)

    @classmethod
    def check_config(cls, config: HFConfig) -> None:
        super().check_config(config)
        why = config_problem(config, cls.default_theta)
        if why:
            raise BackboneError(
                f"flaxheads' {cls.family} backbone cannot run this config: {why}. Use a checkpoint "
                "without it, or fix config.json if the value is wrong."
            )

    @classmethod
    def from_custom_config(cls, config: HFConfig) -> HFConfig | None:
        """The config of the native transformers class for a hub folder whose ``config.json`` is written for
        the model's own ``auto_map`` code, or None when ``config`` is not that family's custom config."""
        return None

    @classmethod
    def is_buffer(cls, name: str) -> bool:
        return name.rpartition(".")[2] in ("position_ids", "token_type_ids", "inv_freq", "original_inv_freq")

    @classmethod
    def params_from_state(cls, config: HFConfig, state: Mapping[str, np.ndarray]) -> dict:
        return super().params_from_state(config, hub_to_native(state, cls.hub_renames, cls.hub_fused))

    @classmethod
    def init_params(cls, config, rng) -> dict:
        init = HFInit(rng, float(config.initializer_range))
        h, f, n = int(config.hidden_size), int(config.intermediate_size), int(config.num_hidden_layers)
        emb = {"word_embeddings": init.embedding(int(config.vocab_size), h)}
        if int(config.get("type_vocab_size") or 0) > 0:
            emb["token_type_embeddings"] = init.embedding(int(config.type_vocab_size), h)
        emb["LayerNorm"] = init.norm(h)

        def one_layer():
            attn = {m: init.dense(h, h, cls.attention_bias) for m in (*QKV, "o_proj")}
            if cls.gated:
                ff = {
                    "gate_proj": init.dense(h, f, False),
                    "up_proj": init.dense(h, f, False),
                    "down_proj": init.dense(f, h, cls.down_bias),
                }
            else:
                ff = {"fc1": init.dense(h, f), "fc2": init.dense(f, h)}
            return {
                "self_attn": attn,
                "post_attention_layernorm": init.norm(h),
                "mlp": ff,
                "post_mlp_layernorm": init.norm(h),
            }

        return {"embeddings": emb, "layers": {str(i): one_layer() for i in range(n)}}

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
    ) -> jax.Array:
        return encode(
            params,
            input_ids,
            attention_mask,
            token_type_ids,
            position_ids,
            settings=cast(Settings, self.settings),
            plan=self.plan,
            dtype=self.dtype,
            train=train,
            rng=rng,
            remat=self.remat_policy,
        )


def custom_config_class(config: Mapping) -> str:
    """The ``auto_map`` ``AutoConfig`` of a hub config written for the model's own code, without the repository
    (``"Alibaba-NLP/new-impl--configuration.NewConfig"`` -> ``"configuration.NewConfig"``); "" when none."""
    auto = config.get("auto_map") or {}
    ref = auto.get("AutoConfig") if isinstance(auto, Mapping) else None
    return str(ref).rpartition("--")[2] if ref else ""


def native_keys(config: Mapping, keep: tuple[str, ...], **values: Any) -> HFConfig:
    """A native config from a hub one: the keys ``keep`` that it has, then ``values``; the hub's ``auto_map``
    and everything else are left out (the source file is kept for error messages)."""
    out = {k: config[k] for k in keep if k in config}
    out.update({k: v for k, v in values.items() if v is not None})
    return HFConfig(out, source=object.__getattribute__(config, "_source") if isinstance(config, HFConfig) else None)


#: keys a hub config shares with transformers' BERT-like configs, carried over unchanged
COMMON_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "hidden_act",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "max_position_embeddings",
    "type_vocab_size",
    "initializer_range",
    "layer_norm_eps",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "classifier_dropout",
    "id2label",
    "label2id",
    "problem_type",
    "num_labels",
    "torch_dtype",
    "dtype",
    "transformers_version",
)
