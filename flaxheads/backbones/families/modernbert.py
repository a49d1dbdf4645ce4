"""ModernBERT (``model_type`` ``modernbert``): HF's ``ModernBertModel`` as a pure function.

What the PyTorch model computes with ``attn_implementation`` ``"eager"`` or ``"sdpa"``:

* token embeddings (``tok_embeddings``, no positions), LayerNorm, ``embedding_dropout``;
* pre-LayerNorm layers: ``x + Wo(attention(attn_norm(x)))``, then ``x + mlp(mlp_norm(x))``;
  layer 0 has no ``attn_norm`` (an identity in PyTorch, no weights);
* attention with rotary position embeddings (positions ``0..T-1`` whatever the padding)
  on q and k; *global* layers attend to every real token, *local* layers only to keys within
  ``local_attention // 2`` positions either side. Which layers are global: ``layer_types``
  (transformers 5) or every ``global_attn_every_n_layers``-th layer from layer 0 (4.x); each
  kind has its own RoPE base (``rope_parameters[kind]["rope_theta"]``, or 4.x's
  ``global_rope_theta`` / ``local_rope_theta``);
* ``attention_dropout`` on the attention probabilities and after ``Wo``;
* a GeGLU MLP: ``Wi`` to ``2 x intermediate_size``, split into input and gate,
  ``act(input) * gate``, ``mlp_dropout``, ``Wo``;
* ``final_norm``. LayerNorms have no bias unless ``norm_bias``; the attention and MLP linear
  layers none unless ``attention_bias`` / ``mlp_bias``.

Local attention costs O(T x window): above a few windows it runs on query blocks of
``window // 2`` positions against their three neighbouring key blocks with the exact band
mask (:func:`sliding_window_attention`). Global attention on long sequences runs in query
chunks, each recomputed in the backward pass, so its memory is O(chunk x T) instead of O(T^2).

PyTorch's flash-attention path (unpadded sequences) computes the same function on GPUs; it
is not a reference here. The params tree follows the PyTorch names (``embeddings``,
``layers/<i>/attn/Wqkv``, ..., ``final_norm``) with Flax leaves (HF never had a Flax ModernBERT).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from flaxheads.backbones.base import Backbone, BackboneError, HFConfig
from flaxheads.backbones.families.bert_shared import dropout_keys
from flaxheads.backbones.families.modernbert_config import LOCAL, TOP_LEVEL, Settings, _config_problem, _TruncatedInit
from flaxheads.layers.activations import get_activation
from flaxheads.layers.attention import attend, attend_chunked
from flaxheads.layers.dense import embedding_lookup, matmul
from flaxheads.layers.dropout import dropout
from flaxheads.layers.masks import mask_bias
from flaxheads.layers.norms import layer_norm
from flaxheads.layers.positions import apply_rotary, rotary_cos_sin
from flaxheads.layers.remat import attention_out, checkpointed, mlp_out
from flaxheads.runtime.plan import ComputePlan

#: Size of one global-attention score chunk before long sequences are split into query chunks.
_GLOBAL_CHUNK_BYTES = 64 << 20


# ---- pieces -----------------------------------------------------------------------------------------------
def norm(x: jax.Array, p: Mapping, eps: float, plan: ComputePlan) -> jax.Array:
    """LayerNorm with or without a bias (``norm_bias``), in the form ``plan`` chooses."""
    bias = p["bias"] if "bias" in p else jnp.zeros((x.shape[-1],), jnp.float32)
    return layer_norm(x, p["scale"], bias, eps, plan.layer_norm_products)


def linear(x: jax.Array, p: Mapping, plan: ComputePlan) -> jax.Array:
    """A linear layer with or without a bias (``attention_bias`` / ``mlp_bias``), through ``plan``'s :func:`matmul`."""
    y = matmul(x, p["kernel"], plan)
    return y + p["bias"].astype(x.dtype) if "bias" in p else y


def masked_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, keep: jax.Array, rate: float = 0.0, rng: jax.Array | None = None
) -> jax.Array:
    """softmax over the keys ``keep`` allows (``[N | 1, 1, Tq, Tk]`` bool) of ``q k^T``, times ``v``:
    ``q [N, Tq, nh, d]``, ``k, v [N, Tk, nh, d]`` -> ``[N, Tq, nh, d]``. The softmax runs in
    float32 (as PyTorch's eager attention); hidden entries get exactly zero weight and gradient."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
    probs = jax.nn.softmax(jnp.where(keep, scores, jnp.finfo(jnp.float32).min), axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", dropout(probs, rate, rng), v)


def sliding_window_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key_valid: jax.Array,
    half: int,
    *,
    rate: float = 0.0,
    rng: jax.Array | None = None,
    impl: str = "auto",
    block: int | None = None,
) -> jax.Array:
    """Attention of each query to the valid keys within ``half`` positions either side (``|i - j| <= half``):
    ``q, k, v [B, T, nh, d]``, ``key_valid [B, T]`` -> ``[B, T, nh, d]``.

    ``impl="dense"`` masks the full ``T x T`` scores (O(T^2)); ``"blocked"`` splits the queries
    into blocks of ``block >= half`` positions (default ``half``) and each attends to the keys of
    its own and the two neighbouring blocks (``3 x block``) under the same band: O(T x block).
    ``"auto"`` takes the blocked form once ``T`` exceeds four half-windows. Without dropout both
    give the same values; their dropout bits differ."""
    b, t, nh, d = q.shape
    if impl == "auto":
        impl = "blocked" if t > 4 * max(half, 1) else "dense"
    if impl == "dense":
        pos = jnp.arange(t)
        band = jnp.abs(pos[:, None] - pos[None, :]) <= half
        return masked_attention(q, k, v, band[None, None] & key_valid[:, None, None, :], rate, rng)
    if impl != "blocked":
        raise ValueError(f"sliding-window attention impl must be 'auto', 'dense' or 'blocked', got {impl!r}")
    c = max(half, 1) if block is None else int(block)
    if c < half:
        raise ValueError(f"block {c} is smaller than the half window {half}: three blocks would not cover it")
    n = -(-t // c)

    def windows(a):  # [B, T, ...] -> [B * n, 3c, ...]: block i's keys are blocks i-1, i, i+1
        a = jnp.pad(a, [(0, 0), (c, n * c - t + c)] + [(0, 0)] * (a.ndim - 2))
        blocks = a.reshape(b, n + 2, c, *a.shape[2:])
        three = jnp.concatenate([blocks[:, :-2], blocks[:, 1:-1], blocks[:, 2:]], axis=2)
        return three.reshape(b * n, 3 * c, *a.shape[2:])

    queries = jnp.pad(q, [(0, 0), (0, n * c - t), (0, 0), (0, 0)]).reshape(b * n, c, nh, d)
    # query a of a block sits at key index c + a of its three-block window
    band = jnp.abs(jnp.arange(3 * c)[None, :] - c - jnp.arange(c)[:, None]) <= half
    keep = band[None, None] & windows(key_valid)[:, None, None, :]
    out = masked_attention(queries, windows(k), windows(v), keep, rate, rng)
    return out.reshape(b, n * c, nh, d)[:, :t]


def global_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array,
    *,
    plan: ComputePlan,
    rate: float = 0.0,
    rng: jax.Array | None = None,
) -> jax.Array:
    """Attention to every unmasked key (``bias [B, 1, 1, T]``, :func:`~flaxheads.layers.masks.mask_bias`) in the
    arrangement ``plan`` picks. Short sequences: :func:`~flaxheads.layers.attention.attend_chunked` (in the
    plan's ``attention_chunks``). When one ``[B, nh, T, T]`` score tensor would pass
    64 MiB, the queries go in chunks through ``lax.map``, each chunk recomputed in the backward pass
    (``jax.checkpoint``): memory O(chunk x T) in both passes, same values."""
    b, t, nh, d = q.shape
    n = -(-b * nh * t * t * jnp.dtype(q.dtype).itemsize // _GLOBAL_CHUNK_BYTES)
    if n <= 1:
        return attend_chunked(q, k, v, bias, plan=plan, rate=rate, rng=rng)
    size = -(-t // n)
    qs = jnp.pad(q, [(0, 0), (0, n * size - t), (0, 0), (0, 0)]).reshape(b, n, size, nh, d).swapaxes(0, 1)

    @jax.checkpoint
    def one(args):
        i, qc = args
        return attend(qc, k, v, bias, rate, None if rng is None else jax.random.fold_in(rng, i), plan=plan)

    out = lax.map(one, (jnp.arange(n), qs))  # [n, B, size, nh, d]
    return out.swapaxes(0, 1).reshape(b, n * size, nh, d)[:, :t]


# ---- the model --------------------------------------------------------------------------------------------
def attention(
    p: Mapping,
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    key_valid: jax.Array,
    bias: jax.Array,
    *,
    s: Settings,
    local: bool,
    rng,
    local_impl: str,
    plan: ComputePlan,
) -> jax.Array:
    """``Wqkv`` -> rotary q, k -> global or sliding-window attention -> ``Wo``, on ``x [B, T, H]``."""
    b, t, h = x.shape
    d = h // s.num_heads
    qkv = linear(x, p["Wqkv"], plan).reshape(b, t, 3, s.num_heads, d)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    q = apply_rotary(q, cos, sin) * jnp.asarray(1.0 / math.sqrt(d), x.dtype)
    k = apply_rotary(k, cos, sin)
    kw = dict(rate=s.attention_dropout, rng=rng)
    if local:
        ctx = sliding_window_attention(q, k, v, key_valid, s.window_half, impl=local_impl, **kw)
    else:
        ctx = global_attention(q, k, v, bias, plan=plan, **kw)
    return linear(attention_out(ctx).reshape(b, t, h), p["Wo"], plan)


def glu_mlp(p: Mapping, x: jax.Array, act: str, rate: float, rng, plan: ComputePlan) -> jax.Array:
    """GeGLU: ``Wi`` -> (input, gate) halves -> ``act(input) * gate`` -> dropout -> ``Wo`` (``act``: HF's name)."""
    inp, gate = jnp.split(linear(x, p["Wi"], plan), 2, axis=-1)
    act_fn = get_activation(act, barrier=plan.activation_barrier)
    return mlp_out(linear(dropout(act_fn(inp) * gate, rate, rng), p["Wo"], plan))


def layer(
    p: Mapping,
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    key_valid: jax.Array,
    bias: jax.Array,
    *,
    s: Settings,
    local: bool,
    plan: ComputePlan,
    rng=None,
    local_impl: str = "auto",
) -> jax.Array:
    """One pre-LayerNorm ModernBERT layer on ``x [B, T, H]`` (no ``attn_norm`` in ``p``: identity)."""
    r_attn, r_out, r_mlp = jax.random.split(rng, 3) if rng is not None else (None, None, None)
    h = norm(x, p["attn_norm"], s.eps, plan) if "attn_norm" in p else x
    a = attention(
        p["attn"], h, cos, sin, key_valid, bias, s=s, local=local, rng=r_attn, local_impl=local_impl, plan=plan
    )
    x = x + dropout(a, s.attention_dropout, r_out)
    return x + glu_mlp(p["mlp"], norm(x, p["mlp_norm"], s.eps, plan), s.act, s.mlp_dropout, r_mlp, plan)


def encode(
    params: Mapping,
    input_ids,
    attention_mask=None,
    position_ids=None,
    *,
    settings: Settings,
    plan: ComputePlan,
    dtype=jnp.float32,
    train: bool = False,
    rng: jax.Array | None = None,
    remat: bool | str = False,
    local_impl: str = "auto",
) -> jax.Array:
    """ModernBERT's last hidden state ``[B, T, H]`` (after ``final_norm``) in ``dtype``; pure in ``params``.

    ``plan`` (:class:`~flaxheads.runtime.plan.ComputePlan`) arranges the products, LayerNorms and global
    attention (its ``attention_chunks``: the batch chunks of short global attention). ``local_impl``
    picks the sliding-window arrangement (:func:`sliding_window_attention`): speed and memory only.
    ``remat=True`` recomputes each layer in the backward pass."""
    s = settings
    input_ids = jnp.asarray(input_ids)
    bsz, t = input_ids.shape
    attention_mask = jnp.ones_like(input_ids) if attention_mask is None else jnp.asarray(attention_mask)
    position_ids = jnp.arange(t) if position_ids is None else jnp.asarray(position_ids)
    emb_rng, rngs = dropout_keys(rng, len(s.kinds), train)
    e = params["embeddings"]
    x = embedding_lookup(e["tok_embeddings"]["embedding"], input_ids, s.pad_token_id).astype(dtype)
    x = dropout(norm(x, e["norm"], s.eps, plan), s.embedding_dropout, emb_rng)  # no key, no dropout
    d = x.shape[-1] // s.num_heads
    rotary = {kind: rotary_cos_sin(position_ids, d, theta, dtype) for kind, theta in s.thetas}
    key_valid = attention_mask > 0
    bias = mask_bias(attention_mask, dtype)
    for i, (kind, r) in enumerate(zip(s.kinds, rngs, strict=True)):
        # remat: what the backward pass keeps, by policy
        step = checkpointed(partial(layer, s=s, local=kind == LOCAL, local_impl=local_impl, plan=plan), remat)
        x = step(params["layers"][str(i)], x, *rotary[kind], key_valid, bias, rng=r)
    return norm(x, params["final_norm"], s.eps, plan)


class ModernBertBackbone(Backbone):
    """ModernBERT on a params tree named after PyTorch's modules (see the module docstring).

    ``local_impl`` (``"auto"``, ``"dense"``, ``"blocked"``) and the compute plan's ``attention_chunks``
    change speed and memory only, never the result."""

    model_types = ("modernbert",)
    family = "ModernBERT"
    base_model_prefix = "model"
    classifier_dropout_key = "classifier_dropout"
    lora_targets = ("Wqkv",)
    tokenizer_token_types = False
    top_level = TOP_LEVEL
    # transformers' ModernBertConfig defaults (the attention pattern and RoPE bases: layer_types / rope_theta)
    defaults = {
        "vocab_size": 50368,
        "hidden_size": 768,
        "intermediate_size": 1152,
        "num_hidden_layers": 22,
        "num_attention_heads": 12,
        "hidden_activation": "gelu",
        "max_position_embeddings": 8192,
        "initializer_range": 0.02,
        "initializer_cutoff_factor": 2.0,
        "norm_eps": 1e-5,
        "norm_bias": False,
        "pad_token_id": 50283,
        "eos_token_id": 50282,
        "bos_token_id": 50281,
        "cls_token_id": 50281,
        "sep_token_id": 50282,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "local_attention": 128,
        "embedding_dropout": 0.0,
        "mlp_bias": False,
        "mlp_dropout": 0.0,
        "classifier_pooling": "cls",
        "classifier_dropout": 0.0,
        "classifier_bias": False,
        "classifier_activation": "gelu",
    }
    features = frozenset({"position_ids", "remat", "bf16"})
    extra_inputs = ("position_ids",)
    settings_class = Settings
    settings: Settings

    def __init__(
        self,
        config,
        params: dict,
        dtype=jnp.float32,
        remat: bool = False,
        local_impl: str = "auto",
        plan: ComputePlan | None = None,
    ):
        super().__init__(config, params, dtype=dtype, remat=remat, plan=plan)
        self.local_impl = local_impl

    @classmethod
    def check_config(cls, config: HFConfig) -> None:
        super().check_config(config)
        why = _config_problem(config)
        if why:
            raise BackboneError(
                f"flaxheads' ModernBERT backbone cannot run this config: {why}. Use a checkpoint "
                "without it, or fix config.json if the value is wrong."
            )

    @classmethod
    def init_params(cls, config, rng) -> dict:
        std = float(config.initializer_range)
        cutoff = config.get("initializer_cutoff_factor")
        init = _TruncatedInit(rng, std, 3.0 if cutoff is None else cutoff)
        h, ff, n = int(config.hidden_size), int(config.intermediate_size), int(config.num_hidden_layers)
        out_std = std / math.sqrt(2.0 * n)
        nb, ab, mb = bool(config.norm_bias), bool(config.attention_bias), bool(config.mlp_bias)
        layers = {}
        for i in range(n):
            lp = {} if i == 0 else {"attn_norm": init.norm(h, nb)}
            lp["attn"] = {"Wqkv": init.linear(h, 3 * h, ab), "Wo": init.linear(h, h, ab, out_std)}
            lp["mlp_norm"] = init.norm(h, nb)
            lp["mlp"] = {"Wi": init.linear(h, 2 * ff, mb), "Wo": init.linear(ff, h, mb, out_std)}
            layers[str(i)] = lp
        return {
            "embeddings": {
                "tok_embeddings": {"embedding": init.normal((int(config.vocab_size), h))},
                "norm": init.norm(h, nb),
            },
            "layers": layers,
            "final_norm": init.norm(h, nb),
        }

    def encode(
        self, params, input_ids, attention_mask, *, train: bool = False, rng=None, position_ids=None
    ) -> jax.Array:
        return encode(
            params,
            input_ids,
            attention_mask,
            position_ids,
            settings=self.settings,
            plan=self.plan,
            dtype=self.dtype,
            train=train,
            rng=rng,
            remat=self.remat_policy,
            local_impl=self.local_impl,
        )
