"""Additive attention masks: the key mask of padded rows and the block-diagonal mask of packed rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_bias(segment_ids: jax.Array, dtype) -> jax.Array:
    """Additive block-diagonal mask ``[B, 1, T, T]`` for rows that pack several texts:
    ``segment_ids [B, T]`` numbers each text's tokens ``1, 2, ...`` and padding ``0``; a token
    attends to the tokens of its own text only (a padding query sees nothing: finite, unused)."""
    same = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, None, :] > 0)
    return jnp.where(same[:, None], 0.0, jnp.finfo(dtype).min).astype(dtype)


def mask_bias(attention_mask: jax.Array, dtype) -> jax.Array:
    """Additive key mask ``[B, 1, 1, T]``: 0 where attended, the dtype's lowest value where masked.

    HF uses ``finfo(dtype).min``; any large negative gives the same softmax, and a fully
    masked row stays finite (uniform) instead of NaN."""
    return jnp.where(attention_mask[:, None, None, :] > 0, 0.0, jnp.finfo(dtype).min).astype(dtype)
