"""Activations by their Hugging Face names (``ACT2FN`` keys), as JAX functions."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from flaxheads.errors import ConfigError


def _identity(x):
    return x


def _pre_activation(x: jax.Array, barrier: bool) -> jax.Array:
    """``x`` for a derivative to read, behind an optimization barrier where ``barrier`` (the compute
    plan's ``activation_barrier``: oneDNN's dots on CPU).

    XLA:CPU's oneDNN rewriter (jaxlib 0.12) fuses an activation into the matmul before it (GELU,
    swish, ...) and then hands the fused output to every other user of the pre-activation too,
    a derivative that reads it included: the gradients below each activation came out wrong
    (MiniLM's layer input gradient off by 25% of its scale, Qwen3's gate projection's by 26%)
    while the forward stayed exact. The barrier keeps the activation away from the matmul in
    differentiated programs only; inference keeps the fused activation."""
    if barrier:
        return lax.optimization_barrier(x)
    return x


def _normal_cdf(x: jax.Array) -> jax.Array:
    return 0.5 * (1.0 + lax.erf(x * (1.0 / math.sqrt(2.0))))


@partial(jax.custom_jvp, nondiff_argnums=(1,))
def gelu_exact(x: jax.Array, barrier: bool = False) -> jax.Array:
    """``x * Phi(x)`` with the exact normal CDF (HF's and PyTorch's ``gelu``).

    Same values as ``jax.nn.gelu(x, approximate=False)``; the explicit derivative
    ``Phi(x) + x * phi(x)`` makes reverse mode keep one array per call instead of the
    intermediates of ``erf`` (~6% of a BERT train step on CPU in one A/B run)."""
    return x * _normal_cdf(x)


@gelu_exact.defjvp
def _gelu_exact_jvp(barrier, primals, tangents):
    (x,), (dx,) = primals, tangents
    x = _pre_activation(x, barrier)
    cdf = _normal_cdf(x)
    pdf = jnp.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi))
    return x * cdf, (cdf + x * pdf) * dx


_TANH_K = math.sqrt(2.0 / math.pi)


def _gelu_tanh_t(x: jax.Array) -> jax.Array:
    return jnp.tanh(_TANH_K * (x + 0.044715 * x * x * x))


@partial(jax.custom_jvp, nondiff_argnums=(1,))
def gelu_tanh(x: jax.Array, barrier: bool = False) -> jax.Array:
    """GELU's tanh approximation (HF's ``gelu_new`` / ``gelu_pytorch_tanh``)."""
    return 0.5 * x * (1.0 + _gelu_tanh_t(x))


@gelu_tanh.defjvp
def _gelu_tanh_jvp(barrier, primals, tangents):
    (x,), (dx,) = primals, tangents
    x = _pre_activation(x, barrier)
    t = _gelu_tanh_t(x)
    d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _TANH_K * (1.0 + 3.0 * 0.044715 * x * x)
    return 0.5 * x * (1.0 + t), d * dx


@partial(jax.custom_jvp, nondiff_argnums=(1,))
def silu(x: jax.Array, barrier: bool = False) -> jax.Array:
    """``x * sigmoid(x)`` (HF's ``silu`` / ``swish``), the values of ``jax.nn.silu``."""
    return jax.nn.silu(x)


@silu.defjvp
def _silu_jvp(barrier, primals, tangents):
    (x,), (dx,) = primals, tangents
    x = _pre_activation(x, barrier)
    s = jax.nn.sigmoid(x)
    return x * s, s * (1.0 + x * (1.0 - s)) * dx


def _table(barrier: bool) -> dict[str, Callable[[jax.Array], jax.Array]]:
    return {
        "gelu": lambda x: gelu_exact(x, barrier),  # HF "gelu" is the exact erf form
        "gelu_new": lambda x: gelu_tanh(x, barrier),
        "gelu_pytorch_tanh": lambda x: gelu_tanh(x, barrier),
        "quick_gelu": lambda x: silu(1.702 * x, barrier) / 1.702,
        "relu": jax.nn.relu,
        "tanh": jnp.tanh,
        "sigmoid": jax.nn.sigmoid,
        "silu": lambda x: silu(x, barrier),
        "swish": lambda x: silu(x, barrier),
        "linear": _identity,
        "identity": _identity,
    }


#: HF's activation names (``ACT2FN`` keys) -> functions; ``_BARRIERED`` the same behind
#: :func:`_pre_activation`'s barrier.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = _table(False)
_BARRIERED: dict[str, Callable[[jax.Array], jax.Array]] = _table(True)


def get_activation(name: str | None, *, barrier: bool = False) -> Callable[[jax.Array], jax.Array]:
    """Look up an activation; ``None`` means identity. ``barrier`` (the compute plan's
    ``activation_barrier``) keeps the derivative's read of the pre-activation behind an
    optimization barrier."""
    if name is None:
        return _identity
    try:
        return (_BARRIERED if barrier else ACTIVATIONS)[name]
    except KeyError:
        raise ConfigError(
            f"unknown activation {name!r}; valid names: {sorted(ACTIVATIONS)} (or None for identity)"
        ) from None


def head_activation(name: str | None) -> Callable[[jax.Array], jax.Array]:
    """The activation of a pooler or head: with the derivative's barrier on every host. A module of
    a vector cannot see the backbone's compute plan; at a head's size the barrier costs nothing
    measurable, and under oneDNN's dots it keeps the activation's derivative exact."""
    return get_activation(name, barrier=True)
