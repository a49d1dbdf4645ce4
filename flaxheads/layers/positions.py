"""Positions: absolute (RoBERTa's padding-aware ids), relative (DeBERTa's distances and
per-diagonal scores) and rotary (RoPE).

Pure functions of their arguments: families pick the ones their PyTorch model computes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


# ---- absolute -------------------------------------------------------------------------------------------
def roberta_position_ids(input_ids: jax.Array, padding_idx: int) -> jax.Array:
    """``padding_idx + 1 + (number of non-pad tokens before)`` at non-pad tokens, ``padding_idx`` at pads."""
    keep = (input_ids != padding_idx).astype(jnp.int32)
    return jnp.cumsum(keep, axis=1) * keep + padding_idx


# ---- relative -------------------------------------------------------------------------------------------
def log_bucket(rel: np.ndarray, buckets: int, max_position: int) -> np.ndarray:
    """Relative distances ``rel`` in DeBERTa-v3's log buckets: exact within ``buckets // 2``, then
    logarithmic up to ``max_position``. Evaluated in float32 as PyTorch evaluates transformers'
    ``make_log_bucket_position`` (the ceil of a float32 log decides the bucket)."""
    rel = np.asarray(rel, np.int64)
    mid = buckets // 2
    abs_pos = np.where((rel < mid) & (rel > -mid), mid - 1, np.abs(rel))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.log(abs_pos.astype(np.float32) / np.float32(mid)) / np.log(np.float32((max_position - 1) / mid))
        log_pos = np.ceil(ratio * np.float32(mid - 1)) + np.float32(mid)
        return np.where(abs_pos <= mid, rel, log_pos * np.sign(rel)).astype(np.int64)


def diagonals_to_keys(x: jax.Array) -> jax.Array:
    """``y[..., i, j] = x[..., i, j - i + T - 1]`` for per-diagonal scores ``x [..., T, 2T-1]``: ``[..., T, T]``.

    Row ``i`` of ``y`` is the length-``T`` window of row ``i`` of ``x`` starting at ``T - 1 - i``; in the
    flattened array those windows sit at a stride of ``2T - 2``, so a slice and two reshapes cut them out."""
    *lead, t, w = x.shape
    if t == 1:
        return x
    flat = x.reshape(*lead, t * w)[..., t - 1 : t - 1 + t * (w - 1)]
    return flat.reshape(*lead, t, w - 1)[..., :t]


# ---- rotary ---------------------------------------------------------------------------------------------
def rotary_cos_sin(positions: jax.Array, dim: int, theta: float, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """``cos, sin [..., T, dim]`` of rotary position embeddings (HF's ``"default"`` RoPE) for
    integer ``positions [..., T]``: frequencies ``theta ** (-2i / dim)``, each repeated for both
    halves of the head dim. Computed in float32 whatever ``dtype`` (as HF does), then cast."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    freqs = jnp.asarray(positions).astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x [B, T, nh, d]`` rotated by :func:`rotary_cos_sin`'s ``cos, sin [T, d]`` or ``[B, T, d]``:
    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]`` over the two halves of
    the head dim (HF's / GPT-NeoX's layout, not the interleaved pairs of the original RoPE)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos[..., None, :].astype(x.dtype) + rotated * sin[..., None, :].astype(x.dtype)
