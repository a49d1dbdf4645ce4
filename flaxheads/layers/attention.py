"""Multi-head attention as pure functions: the arrangements (CPU-tuned, plain, fused, YNNPACK's),
one registry of them (:data:`IMPLEMENTATIONS`, picked by the compute plan), batch chunks and sequential
groups, the causal mask and the fused q/k/v projection.

Written for XLA:CPU first (each choice measured on MiniLM; see docs/performance.md) and equal in
value to the textbook form, which accelerators get where the CPU arrangement was never measured.
The key masks it takes come from :mod:`flaxheads.layers.masks`.
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from flaxheads.layers.dense import matmul
from flaxheads.layers.dropout import dropout
from flaxheads.layers.remat import attention_out
from flaxheads.runtime.plan import ComputePlan

#: ``jax.nn.dot_product_attention``'s kernels by name
Kernel = Literal["xla", "cudnn"]

#: Target size of one attention chunk's score tensor. Chunks that fit in cache cost less
#: CPU time in softmax/mask than one big ``[B, nh, T, T]`` tensor (measured on MiniLM).
_CHUNK_BYTES = 4 << 20
#: Most chunks "auto" picks: each chunk is its own copy of the attention ops in the compiled
#: program (and of their backward in a training program), so compile time grows with the count
#: while the step time barely moves past 2. MiniLM, 2-core AMD EPYC, jax 0.12: train step 32 x 128
#: with 8 chunks 11.6 s to compile, with 2 6.4 s, step time within 1%; forward 32 x 128 3.9 s vs
#: 1.8 s to compile, 8 chunks 1.8-3.5% faster per call; 32 x 256 1.4% faster with 8. Most
#: inference is one pass (evaluation, a feature cache, a predict run): encoding 500 BBC articles at
#: 256 tokens (4 lengths) took 26.8 s with 2 against 31.0 s with 8. A long-running server that
#: reuses one shape for minutes can ask for more (the plan's ``attention_chunks``).
_MAX_AUTO_CHUNKS = 2


def attention_chunks(batch: int, num_heads: int, seq: int, itemsize: int = 4, want: int | str = "auto") -> int:
    """How many batch chunks attention is split into: ``want``, or for ``"auto"`` the
    smallest count whose score chunk is <= 4 MiB, at most 2; always a divisor of ``batch``."""
    if want == "auto":
        want = min(-(-batch * num_heads * seq * seq * itemsize // _CHUNK_BYTES), _MAX_AUTO_CHUNKS)
    n = max(1, min(int(want), batch))
    while batch % n:
        n += 1
    return n


#: With oneDNN's dots, float32 attention of a large batch runs faster in sequential groups of
#: the batch (Intel Xeon with AMX, jax 0.12, MiniLM's 12 heads of 32, padded batch, one process
#: with flaxheads' heap settings): 32 x 256 (100 MB of scores) forward 39.3 -> 31.9 ms, gradient
#: 167 -> 148 ms; 16 x 256 (50 MB) 17.1 -> 14.6 and 78 -> 77 ms; 128 x 128 (100 MB) 50.8 -> 44.0
#: and 195 -> 186 ms. At 25 MB (8 x 256, 32 x 128) the forward still gains a little and the
#: gradient loses (33 -> 39 ms, 39 -> 48 ms), so groups start past ``_GROUPS_FROM_BYTES`` and
#: hold about ``_GROUP_BYTES`` of scores each. Not in bfloat16: the MiniLM forward at 32 x 256
#: every position took 276 ms in groups against 248 ms without (bf16 scores, float32 softmax).
_GROUPS_FROM_BYTES = 32 << 20
_GROUP_BYTES = 8 << 20


def attention_groups(batch: int, num_heads: int, seq_q: int, seq_k: int, dtype, plan: ComputePlan) -> int:
    """How many sequential batch groups :func:`attend_chunked` runs (``lax.map``): 1, except for
    float32 activations where ``plan`` runs oneDNN's dots (:attr:`~flaxheads.runtime.plan.ComputePlan.attention_groups`)
    when the layer's scores pass 32 MiB; then the smallest divisor of ``batch`` that brings a
    group's scores to about 8 MiB."""
    scores = batch * num_heads * seq_q * seq_k * 4
    if jnp.dtype(dtype) != jnp.float32 or scores <= _GROUPS_FROM_BYTES or not plan.attention_groups:
        return 1
    n = min(-(-scores // _GROUP_BYTES), batch)
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
    return jnp.einsum("bqhd,bkhd->bhqk", q1, k1, preferred_element_type=jnp.float32)


@_biased_scores.defjvp
def _biased_scores_jvp(primals, tangents):
    q, k, key_bias = primals
    dq, dk, _ = tangents  # the mask bias has no derivative
    return (
        _biased_scores(q, k, key_bias),
        jnp.einsum("bqhd,bkhd->bhqk", dq, k, preferred_element_type=jnp.float32)
        + jnp.einsum("bqhd,bkhd->bhqk", q, dk, preferred_element_type=jnp.float32),
    )


def fused_kernel(q: jax.Array, backend: str) -> Kernel:
    """``jax.nn.dot_product_attention``'s ``implementation`` on ``backend`` (the plan's): cuDNN's
    flash attention on GPU for 16-bit activations and head dims it takes (multiple of 8, at most 128),
    else XLA's (``implementation=None`` means XLA in JAX 0.12 too, so cuDNN is asked for by name)."""
    d = q.shape[-1]
    if backend == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16) and d % 8 == 0 and d <= 128:
        return "cudnn"
    return "xla"


def attend_fused(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array,
    causal: bool = False,
    implementation: Kernel | None = None,
) -> jax.Array:
    """:func:`attend` (no dropout) through ``jax.nn.dot_product_attention``: cuDNN's fused
    kernel where :func:`fused_kernel` says so (the registry asks it with the plan's backend), XLA's
    arrangement with ``implementation="xla"`` (the default).

    ``q`` is already scaled (:func:`fused_qkv`), so ``scale=1``. ``bias`` holds 0 (attend) or a
    large negative (hidden), as :func:`~.masks.mask_bias` ``[B, 1, 1, Tk]`` and :func:`~.masks.segment_bias`
    ``[B, 1, Tq, Tk]`` give; it becomes the boolean mask the kernels take. A query that sees
    no key gets the mean of ``v`` over all keys, which is what the additive bias gives
    (uniform softmax): finite whatever the kernel does with an empty row. Such a query is
    padding, whose output no loss reads; were one read, q and k would get no gradient from
    it here, where the additive form passes them a uniform softmax's derivative."""
    tq, tk = q.shape[1], k.shape[1]
    mask = lax.stop_gradient(bias) > jnp.asarray(jnp.finfo(bias.dtype).min / 2, bias.dtype)
    keep = mask
    if causal:  # queries are the last Tq of the Tk positions, as in causal_mask
        keep = mask & (
            lax.broadcasted_iota(jnp.int32, (tq, tk), 1) <= lax.broadcasted_iota(jnp.int32, (tq, tk), 0) + (tk - tq)
        )
    is_causal = causal and tq == tk  # the kernels' own causal mask is aligned at the first query
    kernel_mask = mask if is_causal else keep
    implementation = implementation or "xla"
    out = None
    if implementation == "cudnn":
        try:  # cuDNN takes a mask with the full [Tq, Tk] extent only; shapes it refuses fall back to XLA's
            out = jax.nn.dot_product_attention(
                q,
                k,
                v,
                mask=jnp.broadcast_to(kernel_mask, (*kernel_mask.shape[:2], tq, tk)),
                scale=1.0,
                is_causal=is_causal,
                implementation="cudnn",
            )
        except (ValueError, NotImplementedError, RuntimeError):
            implementation = "xla"
    if out is None:
        out = jax.nn.dot_product_attention(
            q, k, v, mask=kernel_mask, scale=1.0, is_causal=is_causal, implementation=implementation
        )
    # [B, Tq or 1, nh or 1, 1]: does the query see any key
    seen = jnp.any(keep, axis=-1).transpose(0, 2, 1)[..., None]
    return jnp.where(seen, out, jnp.mean(v, axis=1, keepdims=True).astype(out.dtype))


def attend_cpu(
    q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array, rate: float, rng: jax.Array | None, causal: bool = False
) -> jax.Array:
    """softmax(q k^T + bias) v for ``q, k, v [B, T, nh, d]``, ``bias [B, 1, 1, T]``: ``[B, T, nh, d]``.

    ``causal=True`` also hides every key after the query's position (decoder attention).

    Same function as HF's attention, arranged for XLA:CPU (each step measured in-process
    on MiniLM; forward at 32 x 256 ~1.25x the plain ``einsum``/``softmax``/``einsum``):

    * the mask bias is part of the score matmul (:func:`_biased_scores`);
    * the softmax normalisation is applied to the ``[B, nh, T, d]`` context instead of the
      ``[B, nh, T, T]`` probabilities (one pass fewer over the scores; dropout is a per-element
      scale, so dropping ``exp`` then dividing equals dropping the normalised probabilities);
    * ``probs @ v`` is a ``dot_general`` with a ``[B, nh, Tq, d]`` output: ``jnp.einsum`` puts
      ``v`` first and XLA:CPU then computes the transposed product, 3x slower per call."""
    if bias.shape[-2] != 1:
        # a per-query mask (packed rows, :func:`~.masks.segment_bias`) cannot ride in the score matmul
        return attend_plain(q, k, v, bias, rate, rng, causal)
    b, t, nh, _ = k.shape
    key_bias = jnp.broadcast_to(lax.stop_gradient(bias).reshape(b, t, 1, 1), (b, t, nh, 1)).astype(k.dtype)
    scores = _biased_scores(q, k, key_bias)
    if causal:
        scores = causal_mask(scores)
    # scores, exp and sums in float32 for any activation dtype; only the P.V operand is rounded
    e = jnp.exp(scores - lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True)))
    denom = jnp.sum(e, axis=-1)
    e = dropout(e, rate, rng).astype(v.dtype)
    ctx = lax.dot_general(e, v, (((3,), (1,)), ((0, 1), (0, 2))), preferred_element_type=jnp.float32)  # [B, nh, Tq, d]
    return (ctx / denom[..., None]).astype(v.dtype).transpose(0, 2, 1, 3)


def attend_plain(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array,
    rate: float,
    rng: jax.Array | None,
    causal: bool = False,
    float32_products: bool = True,
) -> jax.Array:
    """HF's arrangement of :func:`attend` (same function, same dropout bits), used off CPU and with oneDNN's dots.

    ``float32_products=False`` (oneDNN's dots) keeps bf16 scores for bf16 activations, as PyTorch's
    autocast computes them.

    The ``d + 1``-wide score matmul is a CPU measurement; on GPUs XLA fuses bias + softmax
    itself and matmuls want aligned head dims, and nothing here was measured on one, so
    accelerators get the textbook form."""
    # head-major operands [B, nh, T, d]: with oneDNN's dots the forward at 32 x 128 took 8.2 ms
    # (bf16 5.3) against 10.2-10.9 (7.5-9.0) for einsums over [B, T, nh, d]; gradients equal
    q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
    batch_dims = ((0, 1), (0, 1))
    out = jnp.float32 if float32_products else None
    scores = lax.dot_general(q, k, (((3,), (3,)), batch_dims), preferred_element_type=out).astype(jnp.float32) + bias
    if causal:
        scores = causal_mask(scores)
    probs = dropout(jax.nn.softmax(scores, axis=-1), rate, rng).astype(v.dtype)  # float32 softmax, any dtype
    return lax.dot_general(probs, v, (((3,), (2,)), batch_dims)).transpose(0, 2, 1, 3)


@partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def attend_ynn(
    q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array, causal: bool = False, float32_products: bool = False
) -> jax.Array:
    """:func:`attend_plain` without dropout, arranged for XLA:CPU's YNNPACK reduction fusions to take
    each attention whole, both products included, when the dots are oneDNN's (the plan's
    ``"ynn"`` attention): the row max and the ``exp`` sums in float32, P.V on
    the unnormalised ``exp`` in the activation dtype, the division on the ``[B, nh, Tq, d]`` context.
    Products as :func:`attend_plain` computes them (bf16 scores for bf16 activations).

    Derivatives are :func:`attend_plain`'s (a differentiated program runs the plain arrangement
    whole): the train steps measured with them ran as fast as with YNNPACK off altogether."""
    q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
    batch_dims = ((0, 1), (0, 1))
    scores = lax.dot_general(q, k, (((3,), (3,)), batch_dims)).astype(jnp.float32) + bias
    if causal:
        scores = causal_mask(scores)
    e = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    denom = jnp.sum(e, axis=-1, keepdims=True)
    ctx = lax.dot_general(e.astype(v.dtype), v, (((3,), (2,)), batch_dims))
    return (ctx.astype(jnp.float32) / denom).astype(v.dtype).transpose(0, 2, 1, 3)


@attend_ynn.defjvp
def _attend_ynn_jvp(causal, float32_products, primals, tangents):
    return jax.jvp(
        lambda q, k, v, bias: attend_plain(q, k, v, bias, 0.0, None, causal, float32_products), primals, tangents
    )


#: Every arrangement of one attention, by the names a :class:`~flaxheads.runtime.plan.ComputePlan`
#: chooses among: each ``(q, k, v, bias, rate, rng, causal, plan) -> context``. ``fused`` and ``ynn``
#: have no dropout (the plan never picks them for attention with dropout).
IMPLEMENTATIONS = {
    "fused": lambda q, k, v, bias, rate, rng, causal, plan: attend_fused(
        q, k, v, bias, causal, fused_kernel(q, plan.backend)
    ),
    "cpu": lambda q, k, v, bias, rate, rng, causal, plan: attend_cpu(q, k, v, bias, rate, rng, causal),
    "plain": lambda q, k, v, bias, rate, rng, causal, plan: attend_plain(
        q, k, v, bias, rate, rng, causal, plan.float32_products
    ),
    "ynn": lambda q, k, v, bias, rate, rng, causal, plan: attend_ynn(q, k, v, bias, causal, plan.float32_products),
}


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array,
    rate: float,
    rng: jax.Array | None,
    causal: bool = False,
    *,
    plan: ComputePlan,
    impl: str | None = None,
) -> jax.Array:
    """softmax(q k^T + bias) v (``q, k, v [B, T, nh, d]``, ``bias [B, 1, 1, T]`` or ``[B, 1, Tq, Tk]``)
    in the arrangement ``plan`` picks (:meth:`~flaxheads.runtime.plan.ComputePlan.attention_for`;
    ``impl`` names one instead): :func:`attend_fused` on GPU, :func:`attend_cpu` or :func:`attend_ynn`
    on CPU, :func:`attend_plain` elsewhere; with attention dropout always an unfused one."""
    how = plan.attention_for(rate > 0.0 and rng is not None, impl)
    return IMPLEMENTATIONS[how](q, k, v, bias, rate, rng, causal, plan)


def causal_mask(scores: jax.Array) -> jax.Array:
    """``scores [..., Tq, Tk]`` with every key after its query set to the dtype's lowest value
    (queries are the last ``Tq`` positions of the ``Tk`` keys, as in HF's causal mask).

    A ``where``, not an added bias: it fuses into the softmax's reads, and the hidden
    entries get exactly zero gradient."""
    tq, tk = scores.shape[-2:]
    keep = lax.broadcasted_iota(jnp.int32, (tq, tk), 1) <= lax.broadcasted_iota(jnp.int32, (tq, tk), 0) + (tk - tq)
    return jnp.where(keep, scores, jnp.finfo(scores.dtype).min)


def fused_qkv(
    kernels: tuple[jax.Array, jax.Array, jax.Array], biases: tuple[jax.Array, jax.Array, jax.Array], scale: float
) -> tuple[jax.Array, jax.Array]:
    """One ``[H, 3H]`` kernel and ``[3H]`` bias for the q, k, v projections (kernels ``[in, out]``).

    The attention scale goes on q's kernel and bias (``H*H + H`` multiplies instead of
    ``B*nh*T*T`` on the scores). The key bias adds ``q . b_k`` to every score of a query
    row, which softmax cancels: it has no effect on the output and its exact gradient is 0.
    Autodiff returns rounding noise instead, which Adam's ``g / (|g| + eps)`` turns into
    lr-sized steps that differ with the batch shape; ``stop_gradient`` gives the exact 0."""
    (wq, wk, wv), (bq, bk, bv) = kernels, biases
    w = jnp.concatenate([wq * scale, wk, wv], axis=1)
    b = jnp.concatenate([bq * scale, lax.stop_gradient(bk), bv])
    return w, b


def self_attention(
    x: jax.Array,
    w: jax.Array,
    b: jax.Array,
    bias: jax.Array,
    *,
    num_heads: int,
    batch: int,
    plan: ComputePlan,
    rate: float = 0.0,
    rng: jax.Array | None = None,
    causal: bool = False,
) -> jax.Array:
    """Multi-head self-attention context ``[B*T, H]`` of the flattened activation ``x [B*T, H]``:
    one matmul with the fused q/k/v kernel ``w [H, 3H]`` / bias ``b`` (see :func:`fused_qkv`),
    then :func:`attend_chunked` with the key mask ``bias [B, 1, 1, T]``, before the output projection."""
    bt, h = x.shape
    t, d = bt // batch, h // num_heads
    qkv = (matmul(x, w, plan) + b.astype(x.dtype)).reshape(batch, t, 3, num_heads, d)

    def attend_qkv(qkv, bias, rng):
        q, k, v = (a.squeeze(2) for a in jnp.split(qkv, 3, axis=2))
        return attend_chunked(q, k, v, bias, plan=plan, rate=rate, rng=rng, causal=causal)

    ungrouped = plan.attention_for(rate > 0.0 and rng is not None) in ("fused", "ynn")
    groups = 1 if ungrouped else attention_groups(batch, num_heads, t, t, x.dtype, plan)
    if groups == 1:
        return attention_out(attend_qkv(qkv, bias, rng).reshape(bt, h))
    # grouped here, not in attend_chunked: the groups slice the one q/k/v tensor (q, k and v
    # split before the loop are three copies of it)
    return attention_out(in_groups(attend_qkv, groups, rng, qkv, bias).reshape(bt, h))


def cross_attention(
    x: jax.Array,
    memory: jax.Array,
    w: jax.Array,
    b: jax.Array,
    bias: jax.Array,
    *,
    num_heads: int,
    batch: int,
    plan: ComputePlan,
    rate: float = 0.0,
    rng: jax.Array | None = None,
) -> jax.Array:
    """Multi-head attention context ``[B*Tq, H]`` of the queries of ``x [B*Tq, H]`` over the keys
    and values of another sequence ``memory [B*Tk, H]`` (an encoder-decoder's cross-attention),
    before the output projection. ``w``/``b`` are the same fused ``[H, 3H]`` q/k/v kernel and
    bias as :func:`self_attention`'s (:func:`fused_qkv`): q from ``x``, k and v from ``memory``;
    ``bias [B, 1, 1, Tk]`` masks ``memory``'s padding."""
    h = x.shape[1]
    d = h // num_heads
    q = (matmul(x, w[:, :h], plan) + b[:h].astype(x.dtype)).reshape(batch, -1, num_heads, d)
    kv = (matmul(memory, w[:, h:], plan) + b[h:].astype(x.dtype)).reshape(batch, -1, 2, num_heads, d)
    k, v = (a.squeeze(2) for a in jnp.split(kv, 2, axis=2))
    return attention_out(attend_chunked(q, k, v, bias, plan=plan, rate=rate, rng=rng).reshape(x.shape[0], h))


def attend_chunked(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array,
    *,
    plan: ComputePlan,
    rate: float = 0.0,
    rng: jax.Array | None = None,
    causal: bool = False,
    impl: str | None = None,
) -> jax.Array:
    """:func:`attend` (``q [B, Tq, nh, d]``, ``k, v [B, Tk, nh, d]``, ``bias [B, 1, 1, Tk]``) in
    independent batch chunks (:func:`attention_chunks`, the plan's ``attention_chunks``): XLA's CPU runtime runs them
    concurrently, so the (single-threaded) softmax/mask fusions of one chunk overlap the
    other's. They are split (not sliced) so the backward pass concatenates the chunks'
    gradients instead of adding zero-padded full-size copies of them. Chunk ``c``'s dropout
    key is ``fold_in(rng, c)``. The fused kernel is one call (``"auto"`` is 1 chunk there: it
    never holds the score tensor the chunks are sized by).

    Where :func:`attention_groups` says so, the batch first goes through in sequential groups
    (:func:`in_groups`), each split into chunks."""
    batch, tq, num_heads, _ = q.shape
    how = plan.attention_for(rate > 0.0 and rng is not None, impl)
    chunks = 1 if plan.attention_chunks == "auto" and how == "fused" else plan.attention_chunks
    groups = 1 if how in ("fused", "ynn") else attention_groups(batch, num_heads, tq, k.shape[1], q.dtype, plan)

    def chunked(q, k, v, bias, rng):
        n = attention_chunks(q.shape[0], num_heads, k.shape[1], jnp.dtype(q.dtype).itemsize, chunks)
        split = (lambda a: jnp.split(a, n, axis=0)) if n > 1 else (lambda a: [a])
        parts = [
            attend(
                qc, kc, vc, bc, rate, None if rng is None else jax.random.fold_in(rng, c), causal, plan=plan, impl=how
            )
            for c, (qc, kc, vc, bc) in enumerate(zip(split(q), split(k), split(v), split(bias)))
        ]
        return parts[0] if n == 1 else jnp.concatenate(parts, axis=0)

    if groups == 1:
        return chunked(q, k, v, bias, rng)
    return in_groups(chunked, groups, rng, q, k, v, bias)


def in_groups(fn, groups: int, rng: jax.Array | None, *arrays: jax.Array) -> jax.Array:
    """``fn(*arrays, rng)`` over ``groups`` sequential slices of the arrays' leading (batch) axis
    (``lax.map``), each recomputed in the backward pass (``jax.checkpoint``: the gradient of a
    32 x 256 MiniLM attention took 150 ms against 185-191 ms with each group's scores saved), with
    group ``g``'s key ``fold_in(rng, g)``; the outputs concatenated along the batch axis. See
    :func:`attention_groups`."""
    batch = arrays[0].shape[0]

    def group(args):
        i, *xs = args
        return fn(*xs, None if rng is None else jax.random.fold_in(rng, i))

    grouped = (a.reshape(groups, batch // groups, *a.shape[1:]) for a in arrays)
    out = lax.map(jax.checkpoint(group), (jnp.arange(groups), *grouped))
    return out.reshape(batch, *out.shape[2:])
