"""Decoder-only LLMs (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3 text) as one pure function.

What transformers 5's ``<Family>Model`` computes when given no cache (switches per family in
:mod:`~flaxheads.backbones.families.decoder_config`):

* token embeddings (``embed_tokens``; Gemma: times ``sqrt(hidden)`` in the activation dtype);
* per layer: RMSNorm -> self-attention -> (Gemma 2/3: RMSNorm) -> residual; RMSNorm -> gated MLP
  ``down(act(gate(x)) * up(x))`` -> (Gemma 2/3: RMSNorm) -> residual; a final RMSNorm ``norm``;
* attention: grouped-query (``num_key_value_heads``), explicit ``head_dim``, rotary position
  embeddings on q and k (after the per-head q/k RMSNorm of Qwen3 / Gemma 3), scores times
  ``head_dim ** -0.5`` (Gemma 2/3: ``query_pre_attn_scalar ** -0.5``), Gemma 2's tanh
  soft-capping, the causal mask, the key padding mask and, on sliding layers, a window of the
  last ``sliding_window`` positions (``kv > q - sliding_window``); softmax in float32. No causal
  mask for EuroBERT (:mod:`~flaxheads.backbones.families.eurobert`) and Gemma 3 with
  ``use_bidirectional_attention`` (EmbeddingGemma; windows of ``sliding_window // 2`` either side);
* position ids are ``0..T-1`` whatever the padding when none are given (``cache_position``), so
  a left-padded text gets other hidden states than the same text right-padded, as in PyTorch.

Dropout: only ``attention_dropout`` on the attention probabilities (the models have no other).
The params tree is the PyTorch module tree with Flax leaf names
(``layers/<i>/self_attn/q_proj/kernel [in, out]``, ``mlp/gate_proj``, ``input_layernorm/scale``,
``embed_tokens/embedding``), so weights map by name both ways.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from flaxheads.backbones.base import Backbone, BackboneError, HFConfig
from flaxheads.backbones.families.bert_shared import dropout_keys
from flaxheads.backbones.families.decoder_config import (
    DEFAULTS,
    MODEL_TYPES,
    DecoderSpec,
    Rope,
    check_decoder_config,
    decoder_spec,
)
from flaxheads.layers.activations import get_activation
from flaxheads.layers.attention import attend_chunked
from flaxheads.layers.dense import embedding_lookup, matmul
from flaxheads.layers.dropout import dropout
from flaxheads.layers.init import HFInit
from flaxheads.layers.masks import mask_bias
from flaxheads.layers.positions import apply_rotary
from flaxheads.layers.remat import attention_out, checkpointed, mlp_out
from flaxheads.runtime.plan import ComputePlan

TOP_LEVEL = ("embed_tokens", "layers", "norm")


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, gemma: bool) -> jax.Array:
    """RMSNorm over the last axis, statistics in float32. Llama's: ``w * normed.to(dtype)``;
    Gemma's: ``(normed * (1 + w)).to(dtype)`` with the product in float32."""
    xf = x.astype(jnp.float32)
    normed = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if gemma:
        return (normed * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
    return scale.astype(x.dtype) * normed.astype(x.dtype)


def linear(x: jax.Array, p: dict, plan: ComputePlan) -> jax.Array:
    """``nn.Linear`` with or without a bias (Flax kernel ``[in, out]``), through ``plan``'s :func:`matmul`."""
    y = matmul(x, p["kernel"], plan)
    return y + p["bias"].astype(x.dtype) if "bias" in p else y


def rope_cos_sin(rope: Rope, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """``cos, sin [B, T, head_dim]`` of ``rope`` at ``positions [B, T]``: float32, then ``dtype`` (as HF)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope.inv_freq, jnp.float32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return (jnp.cos(emb) * rope.scaling).astype(dtype), (jnp.sin(emb) * rope.scaling).astype(dtype)


def attention_mask_for(attention_mask: jax.Array, window: int | None, causal: bool = True) -> jax.Array:
    """Which keys each query sees, ``[B, 1, T, T]`` bool: causal, not padding, and with a window
    only the last ``window`` positions (key index > query index - window, as transformers 5).
    ``causal=False``: every real key, and with a window those within ``window`` positions either side."""
    t = attention_mask.shape[1]
    q, k = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    if causal:
        keep = k <= q if window is None else (k <= q) & (k > q - window)
    else:
        keep = jnp.ones((t, t), bool) if window is None else jnp.abs(q - k) <= window
    return keep[None, None] & (attention_mask[:, None, None, :] > 0)


def attend_textbook(q, k, v, keep, *, scaling: float, softcap: float | None, rate: float, rng) -> jax.Array:
    """Grouped-query attention for ``q [B, T, nh, d]``, ``k, v [B, T, nkv, d]`` and the key mask
    ``keep [B, 1, T, T]``, HF's eager order: scores times ``scaling``, soft-capping
    ``c * tanh(s / c)``, mask, float32 softmax, dropout, values. Returns ``[B, T, nh, d]``."""
    b, t, nh, d = q.shape
    nkv = k.shape[2]
    qg = q.reshape(b, t, nkv, nh // nkv, d)  # query head h reads key/value head h // (nh // nkv)
    s = jnp.einsum("bqgrd,bkgd->bgrqk", qg, k) * jnp.asarray(scaling, q.dtype)
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    s = jnp.where(keep[:, :, None], s, jnp.finfo(s.dtype).min)
    p = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(q.dtype)
    p = dropout(p, rate, rng)
    return jnp.einsum("bgrqk,bkgd->bqgrd", p, v).reshape(b, t, nh, d)


def _at(a: jax.Array, at: jax.Array) -> jax.Array:
    """Position ``at[b]`` of each sequence of ``a [B, T, ...]``: ``[B, 1, ...]``."""
    return jnp.take_along_axis(a, at.reshape((-1, 1) + (1,) * (a.ndim - 2)), axis=1)


def self_attention(
    p: dict,
    x: jax.Array,
    cos,
    sin,
    keep,
    bias,
    *,
    spec: DecoderSpec,
    window: int | None,
    rate: float,
    rng,
    plan: ComputePlan,
    at: jax.Array | None = None,
) -> jax.Array:
    """One layer's attention output ``[B, T, H]`` (after ``o_proj``) of the normed input ``x [B, T, H]``;
    ``at [B]``: the output at that one query position per sequence alone, ``[B, 1, H]``."""
    b, t, _ = x.shape
    xq, cq, sq = (x, cos, sin) if at is None else (_at(x, at), _at(cos, at), _at(sin, at))
    q = linear(xq, p["q_proj"], plan).reshape(b, xq.shape[1], spec.num_heads, spec.head_dim)
    k = linear(x, p["k_proj"], plan).reshape(b, t, spec.num_kv_heads, spec.head_dim)
    v = linear(x, p["v_proj"], plan).reshape(b, t, spec.num_kv_heads, spec.head_dim)
    if spec.qk_norm:
        q = rms_norm(q, p["q_norm"]["scale"], spec.eps, spec.gemma_norm)
        k = rms_norm(k, p["k_norm"]["scale"], spec.eps, spec.gemma_norm)
    q, k = apply_rotary(q, cq, sq), apply_rotary(k, cos, sin)
    if at is not None:  # one query: its row of the causal / window / padding mask, the textbook order
        ctx = attend_textbook(
            q,
            k,
            v,
            jnp.take_along_axis(keep, at.reshape(b, 1, 1, 1), axis=2),
            scaling=spec.scaling,
            softcap=spec.softcap,
            rate=rate,
            rng=rng,
        )
    elif window is None and spec.softcap is None:
        # the plain (causal or bidirectional) case: the shared CPU-tuned attention, key/value heads repeated
        rep = spec.num_heads // spec.num_kv_heads
        k, v = (jnp.repeat(a, rep, axis=2) if rep > 1 else a for a in (k, v))
        ctx = attend_chunked(
            q * jnp.asarray(spec.scaling, q.dtype), k, v, bias, plan=plan, rate=rate, rng=rng, causal=spec.causal
        )
    else:
        ctx = attend_textbook(q, k, v, keep, scaling=spec.scaling, softcap=spec.softcap, rate=rate, rng=rng)
    return linear(attention_out(ctx).reshape(b, q.shape[1], -1), p["o_proj"], plan)


def layer(
    p: dict,
    x: jax.Array,
    cos,
    sin,
    keep,
    bias,
    rng,
    *,
    spec: DecoderSpec,
    window: int | None,
    rate: float,
    plan: ComputePlan,
    at: jax.Array | None = None,
) -> jax.Array:
    """One decoder layer on ``x [B, T, H]``; ``at [B]``: its output at that one position alone, ``[B, 1, H]``."""
    norm = partial(rms_norm, eps=spec.eps, gemma=spec.gemma_norm)
    a = self_attention(
        p["self_attn"],
        norm(x, p["input_layernorm"]["scale"]),
        cos,
        sin,
        keep,
        bias,
        spec=spec,
        window=window,
        rate=rate,
        rng=rng,
        plan=plan,
        at=at,
    )
    if at is not None:
        x = _at(x, at)
    if spec.sandwich:
        a = norm(a, p["post_attention_layernorm"]["scale"])
    x = x + a
    pre = p["pre_feedforward_layernorm" if spec.sandwich else "post_attention_layernorm"]["scale"]
    m = p["mlp"]
    h = norm(x, pre)
    act = get_activation(spec.activation, barrier=plan.activation_barrier)
    h = mlp_out(linear(act(linear(h, m["gate_proj"], plan)) * linear(h, m["up_proj"], plan), m["down_proj"], plan))
    if spec.sandwich:
        h = norm(h, p["post_feedforward_layernorm"]["scale"])
    return x + h


def encode(
    params: dict,
    input_ids,
    attention_mask=None,
    position_ids=None,
    *,
    spec: DecoderSpec,
    plan: ComputePlan,
    dtype=jnp.float32,
    dropout_rng: jax.Array | None = None,
    train: bool = False,
    remat: bool | str = False,
    only_at: jax.Array | None = None,
) -> jax.Array:
    """Last hidden state ``[B, T, H]`` (after the final norm) in ``dtype``; pure in ``params``,
    computed as ``plan`` arranges it (:class:`~flaxheads.runtime.plan.ComputePlan`).

    ``remat=True`` recomputes each layer in the backward pass (gradient checkpointing).
    ``only_at [B]``: the last hidden state at that one position per sequence, ``[B, 1, H]``, with
    the last layer computed there alone."""
    input_ids = jnp.asarray(input_ids)
    b, t = input_ids.shape
    attention_mask = jnp.ones_like(input_ids) if attention_mask is None else jnp.asarray(attention_mask)
    for rope in set(spec.ropes):
        if rope.max_len is not None and t > rope.max_len:
            raise BackboneError(
                f"dynamic RoPE scaling rescales past max_position_embeddings={rope.max_len} tokens "
                f"depending on earlier calls; flaxheads computes it only up to there (got {t})"
            )
    positions = jnp.broadcast_to(jnp.arange(t), (b, t)) if position_ids is None else jnp.asarray(position_ids)
    x = embedding_lookup(params["embed_tokens"]["embedding"], input_ids, spec.pad_token_id).astype(dtype)
    if spec.embed_scale is not None:
        x = x * jnp.asarray(spec.embed_scale, dtype)
    tables = {rope: rope_cos_sin(rope, positions, dtype) for rope in set(spec.ropes)}
    keeps = {w: attention_mask_for(attention_mask, w, spec.causal) for w in set(spec.windows)}
    bias = mask_bias(attention_mask, dtype)
    _, rngs = dropout_keys(dropout_rng, spec.num_layers, train)
    rate = spec.attention_dropout if train else 0.0
    at = None if only_at is None else jnp.asarray(only_at, jnp.int32).reshape(b)
    for i in range(spec.num_layers):
        f = partial(layer, spec=spec, window=spec.windows[i], rate=rate, plan=plan)
        # remat: what the backward pass keeps of the layer, by policy; the rest is recomputed
        x = checkpointed(f, remat)(
            params["layers"][str(i)],
            x,
            *tables[spec.ropes[i]],
            keeps[spec.windows[i]],
            bias,
            rngs[i],
            at=at if i == spec.num_layers - 1 else None,
        )
    return rms_norm(x, params["norm"]["scale"], spec.eps, spec.gemma_norm)


class DecoderBackbone(Backbone):
    """Llama / Mistral / Qwen2 / Qwen3 / Gemma / Gemma 2 / Gemma 3 text; see the module docstring."""

    model_types = MODEL_TYPES
    family = "decoder"
    base_model_prefix = "model"
    lora_targets = ("q_proj", "v_proj")
    tokenizer_token_types = False
    top_level = TOP_LEVEL
    features = frozenset({"position_ids", "remat", "bf16", "causal", "only_at", "quantize"})
    extra_inputs = ("position_ids", "only_at")

    def __init__(self, config, params: dict, dtype=jnp.float32, remat: bool = False, plan: ComputePlan | None = None):
        super().__init__(config, params, dtype=dtype, remat=remat, plan=plan)
        self.spec = decoder_spec(self.config)

    @classmethod
    def complete_config(cls, config: HFConfig) -> HFConfig:
        """transformers 5's class defaults of the config's ``model_type`` for the keys it omits."""
        defaults = DEFAULTS.get(config.get("model_type") or "", {})
        missing = {k: v for k, v in defaults.items() if k not in config}
        return config.replace(**missing) if missing else config

    @classmethod
    def check_config(cls, config: HFConfig) -> None:
        super().check_config(config)
        check_decoder_config(config)

    @classmethod
    def init_params(cls, config, rng) -> dict:
        """HF's init: normal(initializer_range) kernels and embeddings (the ``pad_token_id`` row
        zero), zero biases; RMSNorm weights one (Gemma: zero, its norm multiplies by ``1 + w``)."""
        s = decoder_spec(config)
        init = HFInit(rng, float(config.initializer_range))
        h, q_out, kv_out = s.hidden, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        qkv_bias = bool(config.get("attention_bias")) or s.model_type == "qwen2"
        o_bias = bool(config.get("attention_bias")) and s.model_type != "qwen2"
        mlp_bias = bool(config.get("mlp_bias")) if s.model_type in ("llama", "eurobert") else False

        def norm(dim):
            return {"scale": jnp.zeros(dim) if s.gemma_norm else jnp.ones(dim)}

        def one_layer():
            attn = {
                "q_proj": init.dense(h, q_out, qkv_bias),
                "k_proj": init.dense(h, kv_out, qkv_bias),
                "v_proj": init.dense(h, kv_out, qkv_bias),
                "o_proj": init.dense(q_out, h, o_bias),
            }
            if s.qk_norm:
                attn.update(q_norm=norm(s.head_dim), k_norm=norm(s.head_dim))
            out = {
                "self_attn": attn,
                "input_layernorm": norm(h),
                "post_attention_layernorm": norm(h),
                "mlp": {
                    "gate_proj": init.dense(h, s.intermediate, mlp_bias),
                    "up_proj": init.dense(h, s.intermediate, mlp_bias),
                    "down_proj": init.dense(s.intermediate, h, mlp_bias),
                },
            }
            if s.sandwich:
                out.update(pre_feedforward_layernorm=norm(h), post_feedforward_layernorm=norm(h))
            return out

        table = init.embedding(int(config.vocab_size), h)["embedding"]
        if s.pad_token_id is not None:
            table = table.at[s.pad_token_id].set(0.0)
        return {
            "embed_tokens": {"embedding": table},
            "layers": {str(i): one_layer() for i in range(s.num_layers)},
            "norm": norm(h),
        }

    def encode(
        self, params, input_ids, attention_mask, *, train: bool = False, rng=None, position_ids=None, only_at=None
    ) -> jax.Array:
        return encode(
            params,
            input_ids,
            attention_mask,
            position_ids,
            spec=self.spec,
            plan=self.plan,
            dtype=self.dtype,
            dropout_rng=rng,
            train=train,
            remat=self.remat_policy,
            only_at=only_at,
        )
