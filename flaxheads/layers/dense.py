"""Dense layers: the one matmul every backbone's projections go through (with its backward pass
arranged for XLA:CPU's 16-bit dots), ``dense`` and the embedding lookup.

Written for XLA:CPU first (each choice measured; see docs/performance.md) and equal in value to
the plain product, which accelerators get.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from flaxheads.runtime.plan import ComputePlan


def _matmul(x: jax.Array, kernel: jax.Array) -> jax.Array:
    return x @ kernel.astype(x.dtype)


def _transposed(x2d: jax.Array) -> jax.Array:
    """``x2d.T`` as a row-major copy: written through a rank-3 transpose, which XLA does not fold
    into the consuming dot as a transposed operand (see :func:`_matmul_cpu16`)."""
    m, k = x2d.shape
    return x2d.reshape(m, k, 1).transpose(1, 2, 0).reshape(k, m)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_cpu16(x: jax.Array, kernel: jax.Array, f32_out: bool) -> jax.Array:
    """:func:`_matmul` with a backward pass laid out for XLA:CPU's 16-bit dots.

    The autodiff backward of ``x @ w`` has ``g @ w.T`` and ``x.T @ g``. XLA:CPU's YNNPACK runs a
    bf16 dot natively when its left operand is not transposed, and converted both to float32 at
    half the speed (AMD EPYC with AVX512-BF16, jax 0.12, 4096 x 384 x 1536: forward 5.7 ms,
    ``dx`` 11.4 ms, ``dW`` 12.2 ms). Asking for float32 outputs (as the accumulators are anyway)
    and giving ``dW`` a physically transposed ``x`` keeps them in bf16: ``dx`` 6.0 ms, ``dW``
    5.6 ms. With oneDNN's dots (``f32_out=False``,
    :attr:`~flaxheads.runtime.plan.ComputePlan.float32_products`) the products keep
    bf16 outputs and ``dW`` still gets the transposed copy (Intel Xeon with AMX: ``dW`` 4.6 ->
    3.0 ms). ``dW`` is returned in the kernel's own dtype (float32 master weights)."""
    return _matmul(x, kernel)


def _matmul_cpu16_fwd(x, kernel, f32_out):
    return _matmul(x, kernel), (x, kernel)


def _matmul_cpu16_bwd(f32_out, res, g):
    x, kernel = res
    k, n = kernel.shape
    x2, g2 = x.reshape(-1, k), g.reshape(-1, n)
    out = jnp.float32 if f32_out else None
    dx = lax.dot_general(g2, kernel.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=out)
    dk = lax.dot_general(_transposed(x2), g2, (((1,), (0,)), ((), ())), preferred_element_type=out)
    return dx.astype(x.dtype).reshape(x.shape), dk.astype(kernel.dtype)


_matmul_cpu16.defvjp(_matmul_cpu16_fwd, _matmul_cpu16_bwd)


def matmul(x: jax.Array, kernel: jax.Array, plan: ComputePlan) -> jax.Array:
    """``x [..., in] @ kernel [in, out]`` in ``x``'s dtype (the kernel is cast: float32 master
    weights, bf16 compute). The one place a backbone's dense layers multiply: where ``plan`` runs
    on the CPU, bfloat16 activations get the backward pass of :func:`_matmul_cpu16` (forward-mode
    differentiation, ``jax.jvp``, is not defined there); elsewhere it is the plain product. A
    quantised kernel (with or without LoRA beside it) is dequantised inside the product
    (:func:`flaxheads.layers.quantized.qmatmul`)."""
    if hasattr(kernel, "qvalue") or not hasattr(kernel, "dtype"):  # a qwix QArray or a quantize.LoraKernel
        from flaxheads.layers.quantized import qmatmul

        return qmatmul(x, kernel)
    if x.dtype == jnp.bfloat16 and plan.cpu_matmul:
        return _matmul_cpu16(x, kernel, plan.float32_products)
    return _matmul(x, kernel)


def dense(x: jax.Array, p: dict, plan: ComputePlan) -> jax.Array:
    """``x @ p["kernel"] + p["bias"]`` through :func:`matmul`."""
    return matmul(x, p["kernel"], plan) + p["bias"].astype(x.dtype)


def embedding_lookup(table: jax.Array, ids: jax.Array, padding_idx: int | None = None) -> jax.Array:
    """``table[ids]``; with ``padding_idx``, the rows looked up for that id get no gradient, as
    PyTorch's ``nn.Embedding(padding_idx=...)`` (the padding vector stays as trained, however
    many pad tokens a batch holds)."""
    x = jnp.take(table, ids, axis=0)
    if padding_idx is None:
        return x
    return jnp.where((ids == padding_idx)[..., None], lax.stop_gradient(x), x)
