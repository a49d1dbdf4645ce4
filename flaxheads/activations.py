"""Activations by their Hugging Face names (``ACT2FN`` keys), as JAX functions."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def _identity(x):
    return x


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # HF "gelu" is the exact erf form
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "relu": jax.nn.relu,
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
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
        raise ValueError(
            f"unknown activation {name!r}; valid names: {sorted(ACTIVATIONS)} (or None for identity)"
        ) from None
