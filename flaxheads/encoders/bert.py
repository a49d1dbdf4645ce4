"""A BERT-family encoder of flaxheads' own, on HF ``FlaxBertModel``'s parameter tree.

Why it exists: on CPU, HF's Flax BERT spends more time in the glue around its matmuls
(separate q/k/v projections, 4-D reshapes per head, the mask broadcast, flax's LayerNorm)
than PyTorch does. This encoder computes the same function with

* one fused q/k/v matmul per layer on a 2-D ``[B*T, H]`` activation (the kernel is
  concatenated inside the jitted program, so the params keep HF's tree and names),
* the attention scale folded into ``q`` (``B*T*H`` multiplies instead of ``B*nh*T*T``),
* the additive mask built once per forward, reused by every layer and carried inside the
  score matmul; softmax normalisation applied to the context (see :func:`_attend`),
* a two-pass LayerNorm in the compute dtype,

and nothing else: parameters, their names and shapes, dropout placement and the outputs
are HF's (parity-tested against ``FlaxBertModel`` and PyTorch ``BertModel`` to 1e-4).

:class:`FastBertBackbone` has the calling convention of an HF Flax wrapper
(``backbone(input_ids, attention_mask=..., token_type_ids=..., params=..., dropout_rng=...,
train=...)[0]`` is the last hidden state), so :class:`flaxheads.SequenceModel` uses it
unchanged. Every other architecture keeps using the HF wrapper.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..activations import get_activation

#: ``model_type`` values whose encoder is BERT's (same tree, same math).
SUPPORTED_MODEL_TYPES = ("bert",)


def supports(config) -> tuple[bool, str]:
    """Whether :class:`FastBertBackbone` computes exactly what HF's model for ``config`` does.

    Returns ``(ok, reason)``; ``reason`` says what is unsupported when ``ok`` is False."""
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        return False, f"model_type {mt!r} is not one of {SUPPORTED_MODEL_TYPES}"
    pet = getattr(config, "position_embedding_type", "absolute")
    if pet != "absolute":
        return False, f"position_embedding_type {pet!r} (only 'absolute')"
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        return False, "decoder / cross-attention configs"
    if config.hidden_size % config.num_attention_heads:
        return False, "hidden_size not divisible by num_attention_heads"
    try:
        get_activation(config.hidden_act)
    except ValueError:
        return False, f"hidden_act {config.hidden_act!r}"
    return True, ""


@partial(jax.custom_jvp, nondiff_argnums=(3,))
def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis (two-pass variance, as accurate as PyTorch's).

    The explicit derivative keeps only the normalised ``x`` and ``1/std`` for the backward
    pass, where autodiff of the formula keeps more and runs more passes over the
    activation (~3% of a BERT train step on CPU). Forward and reverse mode both work."""
    return _layer_norm_parts(x, eps)[0] * scale + bias


def _layer_norm_parts(x, eps):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    xc = x - mean
    rstd = lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + eps)
    return xc * rstd, rstd


@layer_norm.defjvp
def _layer_norm_jvp(eps, primals, tangents):
    x, scale, bias = primals
    dx, dscale, dbias = tangents
    xh, rstd = _layer_norm_parts(x, eps)
    dxc = dx - jnp.mean(dx, axis=-1, keepdims=True)
    dxh = rstd * (dxc - xh * jnp.mean(xh * dxc, axis=-1, keepdims=True))
    return xh * scale + bias, dxh * scale + xh * dscale + dbias


def _layer_norm(x: jax.Array, p: dict, eps: float) -> jax.Array:
    return layer_norm(x, p["scale"].astype(x.dtype), p["bias"].astype(x.dtype), eps)


def _dense(x: jax.Array, p: dict) -> jax.Array:
    return x @ p["kernel"].astype(x.dtype) + p["bias"].astype(x.dtype)


def _random_bits(rng: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniform uint32 bits for a dropout mask: a SplitMix32-style counter hash keyed by ``rng``.

    Why not ``jax.random.bernoulli``: threefry's 20 rounds per word cost ~10% of a MiniLM
    train step on CPU, and XLA's own Philox (``lax.rng_bit_generator``) is slower still
    there. This is a Weyl sequence over the element index, offset by the 64-bit key and
    finished with two rounds of murmur3's fmix32 avalanche: a handful of integer ops that
    XLA fuses into the dropout multiply, so the bits are never stored. Keys still come from
    ``jax.random`` (one per layer), and the bits are a pure function of ``rng``, so a
    resumed run reproduces an uninterrupted one. Statistical checks live in the tests."""
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)
    key = rng.reshape(-1).astype(jnp.uint32)
    k0, k1 = key[0], key[-1]
    size = math.prod(shape)
    if size >= 2 ** 32:
        raise ValueError(f"dropout on {size} elements at once is not supported (at most 2**32 - 1)")
    idx = lax.iota(jnp.uint32, size).reshape(shape) if shape else jnp.uint32(0)

    def fmix(h):
        h = h ^ (h >> 16)
        h = h * jnp.uint32(0x85EBCA6B)
        h = h ^ (h >> 13)
        h = h * jnp.uint32(0xC2B2AE35)
        return h ^ (h >> 16)

    h = fmix(idx * jnp.uint32(0x9E3779B9) + k0)
    return fmix(h ^ k1)


def _dropout(x: jax.Array, rate: float, rng: jax.Array | None) -> jax.Array:
    if rng is None or rate == 0.0:
        return x
    # keep with probability 1 - rate (to 2**-32), inverted scaling as in HF / PyTorch.
    threshold = jnp.uint32(min(int(round((1.0 - rate) * 2.0 ** 32)), 2 ** 32 - 1))
    keep = _random_bits(rng, x.shape) < threshold
    return x * (keep.astype(x.dtype) * jnp.asarray(1.0 / (1.0 - rate), x.dtype))


def embed(params: dict, input_ids, token_type_ids, position_ids, *, eps: float, dtype) -> jax.Array:
    """Word + position + token-type embeddings, LayerNorm: ``[B, T, H]``."""
    e = params["embeddings"]
    x = (jnp.take(e["word_embeddings"]["embedding"], input_ids, axis=0)
         + jnp.take(e["position_embeddings"]["embedding"], position_ids, axis=0)
         + jnp.take(e["token_type_embeddings"]["embedding"], token_type_ids, axis=0))
    return _layer_norm(x.astype(dtype), e["LayerNorm"], eps)


#: Target size of one attention chunk's score tensor. Chunks that fit in cache cost less
#: CPU time in softmax/mask than one big ``[B, nh, T, T]`` tensor (measured on MiniLM).
_CHUNK_BYTES = 4 << 20
#: Most chunks "auto" picks: each chunk is its own copy of the attention ops in the
#: compiled program, and past 8 the compile time grows faster than the step time falls
#: (MiniLM forward at 32 x 128: 32 chunks ~7% faster but ~6 s to compile vs ~1.7 s; at
#: 32 x 256: 32 chunks ~5.7 s to compile, no faster).
_MAX_AUTO_CHUNKS = 8


def attention_chunks(batch: int, num_heads: int, seq: int, itemsize: int = 4,
                     want: int | str = "auto") -> int:
    """How many batch chunks attention is split into: ``want``, or for ``"auto"`` the
    smallest count whose score chunk is <= 4 MiB, at most 8; always a divisor of ``batch``."""
    if want == "auto":
        want = min(-(-batch * num_heads * seq * seq * itemsize // _CHUNK_BYTES), _MAX_AUTO_CHUNKS)
    n = max(1, min(int(want), batch))
    while batch % n:
        n += 1
    return n


@jax.custom_jvp
def _biased_scores(q: jax.Array, k: jax.Array, key_bias: jax.Array) -> jax.Array:
    """``q k^T + bias`` as one product: ``[q, 1] . [k, key_bias]`` (head dim ``d + 1``).

    The mask bias rides in the matmul, so XLA:CPU reads the scores once for the softmax
    max instead of first writing ``scores + bias`` to memory (the add does not fuse into the
    reduction): attention ~20-30% faster, bit-identical scores. The derivative is written
    on the ``d``-wide operands so the backward pass has no ``d + 1``-wide products."""
    q1 = jnp.concatenate([q, jnp.ones((*q.shape[:-1], 1), q.dtype)], axis=-1)
    k1 = jnp.concatenate([k, key_bias], axis=-1)
    return jnp.einsum("bqhd,bkhd->bhqk", q1, k1)


@_biased_scores.defjvp
def _biased_scores_jvp(primals, tangents):
    q, k, key_bias = primals
    dq, dk, _ = tangents  # the mask bias has no derivative
    return (_biased_scores(q, k, key_bias),
            jnp.einsum("bqhd,bkhd->bhqk", dq, k) + jnp.einsum("bqhd,bkhd->bhqk", q, dk))


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array, rate: float,
            rng: jax.Array | None) -> jax.Array:
    """softmax(q k^T + bias) v for ``q, k, v [B, T, nh, d]``, ``bias [B, 1, 1, T]``: ``[B, T, nh, d]``.

    Same function as HF's attention, arranged for XLA:CPU (each step measured in-process
    on MiniLM; forward at 32 x 256 ~1.25x the plain ``einsum``/``softmax``/``einsum``):

    * the mask bias is part of the score matmul (:func:`_biased_scores`);
    * the softmax normalisation is applied to the ``[B, nh, T, d]`` context instead of the
      ``[B, nh, T, T]`` probabilities (one pass fewer over the scores; dropout is a per-element
      scale, so dropping ``exp`` then dividing equals dropping the normalised probabilities);
    * ``probs @ v`` is a ``dot_general`` with a ``[B, nh, Tq, d]`` output: ``jnp.einsum`` puts
      ``v`` first and XLA:CPU then computes the transposed product, 3x slower per call.

    On other backends it is :func:`_attend_plain` (see there)."""
    if jax.default_backend() != "cpu":
        return _attend_plain(q, k, v, bias, rate, rng)
    b, t, nh, _ = k.shape
    key_bias = jnp.broadcast_to(lax.stop_gradient(bias).reshape(b, t, 1, 1), (b, t, nh, 1)).astype(k.dtype)
    scores = _biased_scores(q, k, key_bias)
    e = jnp.exp(scores - lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True)))
    denom = jnp.sum(e, axis=-1, dtype=jnp.float32)  # f32 even for bf16 activations
    e = _dropout(e, rate, rng)
    ctx = lax.dot_general(e, v, (((3,), (1,)), ((0, 1), (0, 2))))  # [B, nh, Tq, d]
    return (ctx / denom[..., None].astype(ctx.dtype)).transpose(0, 2, 1, 3)


def _attend_plain(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array, rate: float,
                  rng: jax.Array | None) -> jax.Array:
    """HF's arrangement of :func:`_attend` (same function, same dropout bits), used off CPU.

    The ``d + 1``-wide score matmul is a CPU measurement; on GPUs XLA fuses bias + softmax
    itself and matmuls want aligned head dims, and nothing here was measured on one, so
    accelerators get the textbook form."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) + bias
    probs = _dropout(jax.nn.softmax(scores, axis=-1), rate, rng)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def layer(p: dict, x: jax.Array, mask_bias: jax.Array, *, num_heads: int, eps: float, act, batch: int,
          hidden_dropout: float = 0.0, attn_dropout: float = 0.0, rng: jax.Array | None = None,
          attn_chunks: int | str = "auto", ffn_chunks: int = 1) -> jax.Array:
    """One BERT layer on the flattened activation ``x [B*T, H]``; ``mask_bias [B, 1, 1, T]``."""
    bt, h = x.shape
    t, d = bt // batch, h // num_heads
    a = p["attention"]["self"]
    # One matmul for q, k and v; the 1/sqrt(d) scale goes on q's kernel and bias (H*H + H
    # multiplies) instead of on the [B, nh, T, T] scores.
    scale = 1.0 / math.sqrt(d)
    w = jnp.concatenate([a["query"]["kernel"] * scale, a["key"]["kernel"], a["value"]["kernel"]], axis=1)
    # The key bias adds q . b_k to every score of a query row, which softmax cancels: it has no
    # effect on the output and its exact gradient is 0. Autodiff returns rounding noise
    # instead, which Adam's g / (|g| + eps) turns into lr-sized steps that differ with the
    # batch shape; stop_gradient gives the exact 0.
    b = jnp.concatenate([a["query"]["bias"] * scale, lax.stop_gradient(a["key"]["bias"]), a["value"]["bias"]])
    qkv = (x @ w.astype(x.dtype) + b.astype(x.dtype)).reshape(batch, t, 3, num_heads, d)
    if rng is not None:
        r_attn, r_out, r_ffn = jax.random.split(rng, 3)
    else:
        r_attn = r_out = r_ffn = None
    n = attention_chunks(batch, num_heads, t, jnp.dtype(x.dtype).itemsize, attn_chunks)
    parts = []
    # Independent batch chunks: XLA's CPU runtime runs them concurrently, so the
    # (single-threaded) softmax/mask fusions of one chunk overlap the other's. Split (not
    # sliced) so the backward pass concatenates the chunks' gradients instead of adding
    # zero-padded full-size copies of them.
    chunks = jnp.split(qkv, n, axis=0) if n > 1 else [qkv]
    biases = jnp.split(mask_bias, n, axis=0) if n > 1 else [mask_bias]
    for c in range(n):
        q, k, v = (a.squeeze(2) for a in jnp.split(chunks[c], 3, axis=2))
        r = None if r_attn is None else jax.random.fold_in(r_attn, c)
        parts.append(_attend(q, k, v, biases[c], attn_dropout, r))
    ctx = (parts[0] if n == 1 else jnp.concatenate(parts, axis=0)).reshape(bt, h)
    o = p["attention"]["output"]
    x = _layer_norm(_dropout(_dense(ctx, o["dense"]), hidden_dropout, r_out) + x, o["LayerNorm"], eps)
    return _ffn(p, x, eps=eps, act=act, hidden_dropout=hidden_dropout, rng=r_ffn, chunks=ffn_chunks)


def _ffn(p: dict, x: jax.Array, *, eps: float, act, hidden_dropout: float, rng, chunks: int) -> jax.Array:
    """dense -> act -> dense -> dropout -> residual -> LayerNorm, in ``chunks`` independent row blocks."""
    rows = x.shape[0]
    n = chunks if chunks > 1 and rows % chunks == 0 else 1
    outs = []
    for c in range(n):
        xc = x[c * rows // n:(c + 1) * rows // n]
        inter = act(_dense(xc, p["intermediate"]["dense"]))
        r = None if rng is None else (rng if n == 1 else jax.random.fold_in(rng, c))
        out = _dropout(_dense(inter, p["output"]["dense"]), hidden_dropout, r)
        outs.append(_layer_norm(out + xc, p["output"]["LayerNorm"], eps))
    return outs[0] if n == 1 else jnp.concatenate(outs, axis=0)


def encode(params: dict, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, *, config,
           dtype=jnp.float32, dropout_rng: jax.Array | None = None, train: bool = False,
           attn_chunks: int | str = "auto", ffn_chunks: int = 1, remat: bool = False) -> jax.Array:
    """BERT encoder forward: last hidden state ``[B, T, H]`` in ``dtype``. Pure in ``params``.

    ``attn_chunks`` splits attention into independent batch chunks (see
    :func:`attention_chunks`); it changes speed only, never the result. ``remat=True``
    recomputes each layer in the backward pass (gradient checkpointing): same values and
    gradients, less activation memory."""
    input_ids = jnp.asarray(input_ids)
    bsz, t = input_ids.shape
    if attention_mask is None:
        attention_mask = jnp.ones_like(input_ids)
    if token_type_ids is None:
        token_type_ids = jnp.zeros_like(input_ids)
    if position_ids is None:
        position_ids = jnp.broadcast_to(jnp.arange(t), (bsz, t))
    if train and dropout_rng is None:
        raise ValueError("train=True needs a dropout_rng (dropout is active in training)")
    eps = float(config.layer_norm_eps)
    x = embed(params, input_ids, token_type_ids, position_ids, eps=eps, dtype=dtype)
    hd = float(config.hidden_dropout_prob or 0.0) if train else 0.0
    ad = float(config.attention_probs_dropout_prob or 0.0) if train else 0.0
    rngs = list(jax.random.split(dropout_rng, config.num_hidden_layers + 1)) if train else [None] * (
        config.num_hidden_layers + 1)
    x = _dropout(x, hd, rngs[-1])
    # HF uses finfo(dtype).min for masked keys; any large negative gives the same softmax.
    mask_bias = jnp.where(attention_mask[:, None, None, :] > 0, 0.0, jnp.finfo(dtype).min).astype(dtype)
    act = get_activation(config.hidden_act)
    x = x.reshape(bsz * t, -1)
    layers = params["encoder"]["layer"]
    step = partial(layer, num_heads=config.num_attention_heads, eps=eps, act=act, batch=bsz, hidden_dropout=hd,
                   attn_dropout=ad, attn_chunks=attn_chunks, ffn_chunks=ffn_chunks)
    if remat:
        # Keep only each layer's input for the backward pass and recompute the rest: activation
        # memory stops growing with the layer count (long sequences), ~1 extra forward of compute.
        step = jax.checkpoint(step)
    for i in range(config.num_hidden_layers):
        x = step(layers[str(i)], x, mask_bias, rng=rngs[i])
    return x.reshape(bsz, t, -1)


def maybe_fast(backbone: Any, fast_encoder: bool | str = "auto") -> Any:
    """``backbone`` (an HF Flax model) or its :class:`FastBertBackbone` equivalent.

    ``fast_encoder``: ``"auto"`` swaps when :func:`supports` the config, ``True`` requires it
    (raises otherwise), ``False`` keeps the HF wrapper."""
    if fast_encoder not in (True, False, "auto"):
        raise ValueError(f"fast_encoder must be True, False or 'auto', got {fast_encoder!r}")
    if fast_encoder is False or isinstance(backbone, FastBertBackbone):
        return backbone
    ok, why = supports(backbone.config)
    if not ok:
        if fast_encoder is True:
            raise ValueError(f"fast_encoder=True but flaxheads' own encoder does not cover this model: {why}. "
                             "Pass fast_encoder='auto' or False to use the HF Flax wrapper.")
        return backbone
    return FastBertBackbone.from_hf(backbone)


class FastBertBackbone:
    """HF-wrapper-compatible BERT encoder: ``self(input_ids, attention_mask, ..., params=p)[0]``.

    Holds ``config``, ``params`` (HF ``FlaxBertModel`` tree without the pooler) and
    ``dtype``. Build it with :meth:`from_hf` from a loaded HF Flax model."""

    base_model_prefix = "bert"

    def __init__(self, config, params: dict, dtype=jnp.float32, attn_chunks: int | str = "auto",
                 remat: bool = False):
        ok, why = supports(config)
        if not ok:
            raise ValueError(f"FastBertBackbone cannot run this config: {why}. Use the HF Flax wrapper "
                             "(flaxheads.from_pretrained(..., fast_encoder=False)).")
        self.config = config
        self.params = params
        self.dtype = dtype
        self.attn_chunks = attn_chunks
        self.remat = bool(remat)

    @classmethod
    def from_hf(cls, model: Any) -> "FastBertBackbone":
        """Wrap a loaded HF ``FlaxBertModel`` (its params are shared, not copied)."""
        params = {k: v for k, v in model.params.items() if k in ("embeddings", "encoder")}
        return cls(model.config, params, dtype=getattr(model, "dtype", jnp.float32))

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                 params: dict | None = None, dropout_rng: jax.Array | None = None, train: bool = False,
                 **unused) -> tuple[jax.Array]:
        bad = {k for k, v in unused.items() if v is not None and k not in ("return_dict",)}
        if bad:
            raise TypeError(f"FastBertBackbone does not support {sorted(bad)}; use the HF Flax wrapper")
        hidden = encode(self.params if params is None else params, input_ids, attention_mask, token_type_ids,
                        position_ids, config=self.config, dtype=self.dtype, dropout_rng=dropout_rng,
                        train=train, attn_chunks=self.attn_chunks, remat=self.remat)
        return (hidden,)

    def save_pretrained(self, *args, **kwargs):
        raise NotImplementedError("FastBertBackbone has no save_pretrained; export through flaxheads' export "
                                  "functions (the params are HF's FlaxBertModel tree)")

    def __repr__(self):
        c = self.config
        return (f"FastBertBackbone(layers={c.num_hidden_layers}, hidden={c.hidden_size}, "
                f"heads={c.num_attention_heads}, dtype={jnp.dtype(self.dtype).name})")
