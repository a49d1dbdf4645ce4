"""LoRA's params key and its kernel beside a quantised one: ``x @ W + scaling * (x @ A) @ B``.

The adapters of a float kernel are merged into it (``W + s A B``, :func:`flaxheads.model.lora.merge_lora`);
a quantised kernel cannot hold that sum in its codes, so its adapters stay beside it in a
:class:`LoraKernel`, which :func:`flaxheads.layers.quantized.qmatmul` multiplies.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

#: the params key of the adapters (``{"backbone": ..., "lora": ..., "head": ...}``)
LORA = "lora"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraKernel:
    """A quantised kernel with LoRA adapters beside it: ``x @ W + scaling * (x @ A) @ B``."""

    base: Any
    a: jax.Array
    b: jax.Array
    scaling: float = dataclasses.field(metadata={"static": True}, default=1.0)
