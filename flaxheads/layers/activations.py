"""Activations by their Hugging Face names (``ACT2FN`` keys), as JAX functions."""
from __future__ import annotations

from typing import Callable

import math

import jax
import jax.numpy as jnp
from jax import lax
from ..errors import ConfigError
from ..runtime import onednn_dots


def _identity(x):
    return x


def _pre_activation(x: jax.Array) -> jax.Array:
    """``x`` for a derivative to read, behind an optimization barrier with oneDNN's dots on CPU.

    XLA:CPU's oneDNN rewriter (jaxlib 0.12) fuses an activation into the matmul before it (GELU,
    swish, ...) and then hands the fused output to every other user of the pre-activation too,
    a derivative that reads it included: the gradients below each activation came out wrong
    (MiniLM's layer input gradient off by 25% of its scale, Qwen3's gate projection's by 26%)
    while the forward stayed exact. The barrier keeps the activation away from the matmul in
    differentiated programs only; inference keeps the fused activation."""
    if jax.default_backend() == "cpu" and onednn_dots():
        return lax.optimization_barrier(x)
    return x


def _normal_cdf(x: jax.Array) -> jax.Array:
    return 0.5 * (1.0 + lax.erf(x * (1.0 / math.sqrt(2.0))))


@jax.custom_jvp
def gelu_exact(x: jax.Array) -> jax.Array:
    """``x * Phi(x)`` with the exact normal CDF (HF's and PyTorch's ``gelu``).

    Same values as ``jax.nn.gelu(x, approximate=False)``; the explicit derivative
    ``Phi(x) + x * phi(x)`` makes reverse mode keep one array per call instead of the
    intermediates of ``erf`` (~6% of a BERT train step on CPU in one A/B run)."""
    return x * _normal_cdf(x)


@gelu_exact.defjvp
def _gelu_exact_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    x = _pre_activation(x)
    cdf = _normal_cdf(x)
    pdf = jnp.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi))
    return x * cdf, (cdf + x * pdf) * dx


_TANH_K = math.sqrt(2.0 / math.pi)


def _gelu_tanh_t(x: jax.Array) -> jax.Array:
    return jnp.tanh(_TANH_K * (x + 0.044715 * x * x * x))


@jax.custom_jvp
def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU's tanh approximation (HF's ``gelu_new`` / ``gelu_pytorch_tanh``)."""
    return 0.5 * x * (1.0 + _gelu_tanh_t(x))


@gelu_tanh.defjvp
def _gelu_tanh_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    x = _pre_activation(x)
    t = _gelu_tanh_t(x)
    d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _TANH_K * (1.0 + 3.0 * 0.044715 * x * x)
    return 0.5 * x * (1.0 + t), d * dx


@jax.custom_jvp
def silu(x: jax.Array) -> jax.Array:
    """``x * sigmoid(x)`` (HF's ``silu`` / ``swish``), the values of ``jax.nn.silu``."""
    return jax.nn.silu(x)


@silu.defjvp
def _silu_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    x = _pre_activation(x)
    s = jax.nn.sigmoid(x)
    return x * s, s * (1.0 + x * (1.0 - s)) * dx


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": gelu_exact,  # HF "gelu" is the exact erf form
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "quick_gelu": lambda x: silu(1.702 * x) / 1.702,
    "relu": jax.nn.relu,
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
    "silu": silu,
    "swish": silu,
    "linear": _identity,
    "identity": _identity,
}


def get_activation(name: str | None) -> Callable[[jax.Array], jax.Array]:
    """Look up an activation; ``None`` means identity."""
    if name is None:
        return _identity
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ConfigError(
            f"unknown activation {name!r}; valid names: {sorted(ACTIVATIONS)} (or None for identity)"
        ) from None
