"""Gradient checkpointing (remat) of a layer by policy name: what the backward pass keeps from the
forward and what it recomputes.

* ``none``: every intermediate is kept (fastest, most activation memory);
* ``full``: only each layer's input is kept and the whole layer is recomputed (least memory,
  about one more forward of compute);
* ``save-dots``: the outputs of matmuls without batch dimensions (the dense projections) are
  kept, the rest (norms, activations, softmax, the batched attention products) is recomputed
  (``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``);
* ``save-named``: only the tensors the layers name are kept: each attention's context
  (:data:`ATTENTION_OUT`) and each feed-forward's output (:data:`MLP_OUT`)
  (``jax.checkpoint_policies.save_only_these_names``).

``True`` / ``False`` mean ``full`` / ``none`` (the earlier boolean ``remat``). Every policy computes
the same values and gradients as ``none``; only memory and time differ.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

from flaxheads.errors import ConfigError

REMAT_POLICIES = ("none", "full", "save-dots", "save-named")
#: the names :func:`attention_out` and :func:`mlp_out` give their tensors (kept by ``save-named``)
ATTENTION_OUT, MLP_OUT = "attention_out", "mlp_out"


def remat_policy(remat: bool | str | None) -> str:
    """The policy name of a ``remat`` setting (``True``: ``full``; ``False``/None: ``none``)."""
    if remat is None or remat is False:
        return "none"
    if remat is True:
        return "full"
    if remat not in REMAT_POLICIES:
        raise ConfigError(f"remat {remat!r} is not one of {', '.join(REMAT_POLICIES)} (or True / False)")
    return remat


def _policy(name: str):
    if name == "save-dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if name == "save-named":
        return jax.checkpoint_policies.save_only_these_names(ATTENTION_OUT, MLP_OUT)
    return None  # full: jax.checkpoint's default keeps the inputs alone


def checkpointed(layer: Callable, remat: bool | str | None) -> Callable:
    """``layer`` under ``jax.checkpoint`` with the policy ``remat`` names (``layer`` itself for ``none``)."""
    name = remat_policy(remat)
    if name == "none":
        return layer
    return jax.checkpoint(layer, policy=_policy(name))


def attention_out(x: jax.Array) -> jax.Array:
    """``x`` (an attention context, before its output projection), named for ``save-named``."""
    return checkpoint_name(x, ATTENTION_OUT)


def mlp_out(x: jax.Array) -> jax.Array:
    """``x`` (a feed-forward block's output projection), named for ``save-named``."""
    return checkpoint_name(x, MLP_OUT)
