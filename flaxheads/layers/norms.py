"""LayerNorm with an explicit derivative, as every encoder family normalises.

Written for XLA:CPU first (measured on MiniLM; see docs/performance.md) and equal in value to
the textbook form.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from flaxheads.runtime.plan import ComputePlan


@partial(jax.custom_jvp, nondiff_argnums=(3, 4))
def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float, products: bool = False) -> jax.Array:
    """LayerNorm over the last axis (two-pass variance, as accurate as PyTorch's), in ``x``'s dtype.

    bfloat16/float16 activations are normalised in float32 (mean, variance, scale and shift) and
    rounded once at the end, as PyTorch's autocast runs ``layer_norm``. The explicit derivative
    keeps only the normalised ``x`` and ``1/std`` for the backward pass, where autodiff of the
    formula keeps more and runs more passes over the activation (~3% of a BERT train step on
    CPU). Forward and reverse mode both work.

    Without derivatives and with ``products`` (where the compute plan says so,
    :attr:`~flaxheads.runtime.plan.ComputePlan.layer_norm`), the mean and variance are products with a
    ``1/n`` column instead of reductions (same values to rounding). The derivative keeps the reductions: the
    products made no difference to train steps (AMD EPYC with AVX2, 16 x 128: 0.99x the step time, packed
    1 x 64: 1.03x)."""
    xh, _ = _layer_norm_parts(x, eps, products)
    return (xh * scale + bias).astype(x.dtype)


def _layer_norm_parts(x, eps, products: bool = False):
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    if products:
        column = jnp.full((x.shape[-1], 1), 1.0 / x.shape[-1], x.dtype)
        mean = jnp.matmul(x, column, precision=lax.Precision.HIGHEST)
        xc = x - mean
        rstd = lax.rsqrt(jnp.matmul(xc * xc, column, precision=lax.Precision.HIGHEST) + eps)
        return xc * rstd, rstd
    mean = jnp.mean(x, axis=-1, keepdims=True)
    xc = x - mean
    rstd = lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + eps)
    return xc * rstd, rstd


@layer_norm.defjvp
def _layer_norm_jvp(eps, products, primals, tangents):
    x, scale, bias = primals
    dx, dscale, dbias = tangents
    xh, rstd = _layer_norm_parts(x, eps)
    dx = dx.astype(xh.dtype)
    dxc = dx - jnp.mean(dx, axis=-1, keepdims=True)
    dxh = rstd * (dxc - xh * jnp.mean(xh * dxc, axis=-1, keepdims=True))
    return (xh * scale + bias).astype(x.dtype), (dxh * scale + xh * dscale + dbias).astype(x.dtype)


def layer_norm_p(x: jax.Array, p: dict, eps: float, plan: ComputePlan) -> jax.Array:
    """:func:`layer_norm` with a params dict's ``scale`` and ``bias``, in the form ``plan`` chooses."""
    return layer_norm(x, p["scale"], p["bias"], eps, plan.layer_norm_products)
