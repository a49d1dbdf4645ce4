"""The quantised kernel as a layer: :func:`qmatmul` multiplies by a quantised (Qwix ``QArray``) or
adapted (:class:`~flaxheads.layers.lora.LoraKernel`) kernel, dequantising inside the program forward
and backward, so a step holds the codes rather than a float copy of the base. How kernels are quantised
(schemes, blocks, sharded quantisation) is :mod:`flaxheads.model.quantize`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxheads.layers.lora import LoraKernel


def is_quantized(x: Any) -> bool:
    """Whether ``x`` is a quantised kernel (a ``qwix.QArray``)."""
    return hasattr(x, "qvalue") and hasattr(x, "scale")


def dequantize(q, dtype=jnp.float32) -> jax.Array:
    """The float kernel a ``QArray`` stands for."""
    import qwix

    return qwix.dequantize(q).astype(dtype)


@jax.custom_vjp
def _qmatmul(x: jax.Array, q) -> jax.Array:
    return x @ dequantize(q, x.dtype)


def _qmatmul_fwd(x, q):
    return _qmatmul(x, q), q


def _zero_cotangent(a):
    if jnp.issubdtype(a.dtype, jnp.floating):
        return jnp.zeros_like(a)
    return np.zeros(a.shape, jax.dtypes.float0)


def _qmatmul_bwd(q, g):
    w = dequantize(q, g.dtype)
    return g @ w.T, jax.tree.map(_zero_cotangent, q)


_qmatmul.defvjp(_qmatmul_fwd, _qmatmul_bwd)


def qmatmul(x: jax.Array, kernel) -> jax.Array:
    """``x [..., in] @ kernel`` for a quantised (:func:`is_quantized`) or adapted (:class:`LoraKernel`)
    kernel, in ``x``'s dtype; the codes are dequantised inside the program, forward and backward."""
    if isinstance(kernel, LoraKernel):
        a, b = kernel.a.astype(x.dtype), kernel.b.astype(x.dtype)
        return qmatmul(x, kernel.base) + ((x @ a) @ b) * jnp.asarray(kernel.scaling, x.dtype)
    return _qmatmul(x, kernel)


def dequantize_tree(backbone_params, dtype=jnp.float32) -> dict:
    """``backbone_params`` with quantised kernels dequantised and adapted ones merged (``W + s A B``)."""

    def dense(x):
        if isinstance(x, LoraKernel):
            return dense(x.base) + x.scaling * jnp.matmul(x.a, x.b, precision=jax.lax.Precision.HIGHEST).astype(dtype)
        return dequantize(x, dtype) if is_quantized(x) else x

    return jax.tree.map(dense, backbone_params, is_leaf=lambda x: isinstance(x, LoraKernel) or is_quantized(x))
