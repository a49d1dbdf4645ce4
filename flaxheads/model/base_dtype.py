"""The storage dtype of a frozen base: a backbone that does not train can be kept in bfloat16.

A frozen base (LoRA adapters, a frozen backbone, cached features) is only read: its kernels are
cast to the compute dtype inside every matmul anyway (:func:`flaxheads.layers.dense.matmul`), so
storing them in bfloat16 halves their device memory, and the forward in bfloat16 compute is the
same program. The head, the adapters and the optimizer state stay float32. A base that trains
keeps float32 master weights: AdamW's updates (``lr ~ 1e-4`` of a weight) are below bfloat16's
resolution (``2^-8`` relative) and would round away, so a bfloat16 base that would be trained is
refused (:func:`check_trainable_base`) rather than silently widened.

``auto`` follows what PEFT users get: bfloat16 only where the base is frozen and the compute
precision is bfloat16; elsewhere float32, which leaves the float32 programs bitwise unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from flaxheads.errors import TrainingError, UsageError

#: ``base_dtype`` settings (``flaxheads train --base-dtype``)
BASE_DTYPES = ("auto", "float32", "bfloat16")


def resolve_base_dtype(name: str, *, frozen: bool, compute_dtype: Any) -> jnp.dtype:
    """The storage dtype of the base for the setting ``name``: ``auto`` is bfloat16 when the base is
    ``frozen`` and ``compute_dtype`` is bfloat16, else float32."""
    if name not in BASE_DTYPES:
        raise UsageError(f"base_dtype {name!r} is not one of {', '.join(BASE_DTYPES)}")
    if name == "auto":
        return jnp.dtype(jnp.bfloat16 if frozen and jnp.dtype(compute_dtype) == jnp.bfloat16 else jnp.float32)
    return jnp.dtype(name)


def cast_tree(tree: Any, dtype: Any) -> Any:
    """``tree`` with every floating-point leaf in ``dtype`` (a leaf already in it is kept as is, so a
    float32 tree cast to float32 is the same arrays; shardings are kept)."""
    dtype = jnp.dtype(dtype)

    def cast(x):
        if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype:
            return x
        return x.astype(dtype)

    return jax.tree.map(cast, tree)


def base_dtype_of(backbone_params: Any) -> str | None:
    """The dtype name of the base's floating-point leaves (None: no such leaf; ``"mixed"``)."""
    # quantised kernels: not stored floats
    leaves = jax.tree.leaves(backbone_params, is_leaf=lambda x: hasattr(x, "qvalue"))
    names = {
        jnp.dtype(x.dtype).name
        for x in leaves
        if hasattr(x, "dtype") and not hasattr(x, "qvalue") and jnp.issubdtype(x.dtype, jnp.floating)
    }
    return None if not names else names.pop() if len(names) == 1 else "mixed"


def check_trainable_base(trained: Mapping) -> None:
    """Refuse a trainable subtree (:func:`flaxheads.training.optim.trainable`) whose backbone is stored
    below float32: its updates would be rounded away (see the module docstring)."""
    if "backbone" not in trained:
        return
    name = base_dtype_of(trained["backbone"])
    if name not in (None, "float32", "float64"):
        raise TrainingError(
            f"the backbone is stored in {name} and would be fine-tuned: AdamW's small updates round "
            "away in 16-bit weights. Freeze it (freeze_backbone / cache_features), train LoRA "
            "adapters on it, or load it with base_dtype=float32 for a full fine-tune"
        )
