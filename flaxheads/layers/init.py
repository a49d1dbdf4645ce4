"""Fresh params as Hugging Face initialises them."""

from __future__ import annotations

import jax
import jax.numpy as jnp


class HFInit:
    """Fresh params as Hugging Face initialises its models: ``normal(std)`` kernels and
    embeddings, zero biases, unit norm scales. Each draw has its own key (``fold_in`` of a
    counter), so the params are a pure function of ``rng``; under ``jax.eval_shape`` nothing
    is allocated (how backbones learn their params' shapes)."""

    def __init__(self, rng: jax.Array, std: float = 0.02):
        self.rng, self.std, self._n = rng, float(std), 0

    def normal(self, shape: tuple[int, ...]) -> jax.Array:
        self._n += 1
        return self.std * jax.random.normal(jax.random.fold_in(self.rng, self._n), shape)

    def dense(self, n_in: int, n_out: int, bias: bool = True) -> dict:
        """A Flax ``Dense``: ``kernel [in, out]`` (+ ``bias``)."""
        return {"kernel": self.normal((n_in, n_out)), **({"bias": jnp.zeros(n_out)} if bias else {})}

    def embedding(self, num: int, dim: int) -> dict:
        return {"embedding": self.normal((num, dim))}

    def norm(self, dim: int, bias: bool = True) -> dict:
        """A LayerNorm: ``scale`` ones (+ ``bias`` zeros)."""
        return {"scale": jnp.ones(dim), **({"bias": jnp.zeros(dim)} if bias else {})}
