"""Quantised frozen bases: the matmul kernels of a base that does not train, stored in int8, int4 or
nf4 and dequantised inside the jitted matmul (weight-only quantisation; QLoRA with LoRA on top).

The arrays are Qwix's (``qwix.quantize`` -> ``qwix.QArray``: the values in ``int8`` / ``int4`` /
``uint4`` codes and a scale per block), so their device bytes are what XLA stores: int4
and nf4 codes are packed two to a byte (``on_device_size_in_bytes``). The schemes:

* ``int8``: symmetric absmax per output channel (one scale per column of a ``[in, out]`` kernel);
* ``int4``: symmetric absmax per block of :data:`BLOCK` consecutive inputs of each output channel;
* ``nf4``: QLoRA's NormalFloat4 (Dettmers et al. 2023, appendix E; bitsandbytes'
  ``create_normal_map``): each block of :data:`BLOCK` inputs of an output channel scaled by its
  absmax, every value replaced by the nearest of 16 code values. The blocks are bitsandbytes'
  blocks of its ``[out, in]`` weight (64 consecutive inputs of one output); its second
  quantisation of the scales (double quantisation, 8-bit scales) is not done: the scales are stored
  in the kernel's dtype where it is a 16-bit float (a base stored in bfloat16: 4.25 bits a weight
  against bitsandbytes' 4.13), else float32; the codes are computed in float32 either way.

A kernel whose input width is not a multiple of :data:`BLOCK` gets one block per output channel.

The forward (:mod:`flaxheads.layers.quantized`): :func:`~flaxheads.layers.quantized.qmatmul` multiplies by the
dequantised kernel in the activations' dtype, with a backward pass that dequantises again instead of keeping the
dequantised kernel as a residual, so a step holds the codes, not a float copy of the base. The codes get no
gradient (the base is frozen). LoRA on a quantised kernel is applied beside it (``x W + s (x A) B``,
:class:`~flaxheads.layers.lora.LoraKernel`), since ``W + s A B`` cannot be stored in the codes;
:func:`~flaxheads.layers.quantized.dequantize_tree` turns a quantised (and adapted) base back into float32 kernels
(merged exports).

Families whose every matmul kernel goes through :func:`flaxheads.layers.dense.matmul` can take a
quantised base (``"quantize"`` in their :attr:`~flaxheads.backbones.base.Backbone.features`: the
decoder LLMs); the others fuse or rescale kernels before multiplying and are refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import NamedSharding

from flaxheads.errors import UsageError
from flaxheads.layers.quantized import is_quantized
from flaxheads.runtime.sharding import path_names

#: ``quantize`` settings (``flaxheads train --quantize``)
QUANTIZATIONS = ("int8", "int4", "nf4")
#: inputs per scale of the 4-bit schemes (bitsandbytes' and QLoRA's block size)
BLOCK = 64
_QTYPES = {"int8": jnp.int8, "int4": jnp.int4, "nf4": "nf4"}


def _check_qtype(qtype: str) -> None:
    if qtype not in QUANTIZATIONS:
        raise UsageError(f"quantize {qtype!r} is not one of {', '.join(QUANTIZATIONS)}")


def _tiles(rows: int, qtype: str) -> dict[int, int] | None:
    """The input blocks of a kernel with ``rows`` inputs: :data:`BLOCK` rows (4-bit schemes, where they
    divide it), else None (one block per output channel)."""
    return {0: BLOCK} if qtype != "int8" and rows % BLOCK == 0 and rows > BLOCK else None


def _quantize(kernel: jax.Array, qtype: str, tiles: dict[int, int] | None):
    import qwix

    dtype = jnp.result_type(kernel)
    scale = dtype if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits == 16 else jnp.float32
    return qwix.quantize(
        jnp.asarray(kernel, jnp.float32), _QTYPES[qtype], channelwise_axes=(1,), tiled_axes=tiles, scale_dtype=scale
    )


def quantize_kernel(kernel: jax.Array, qtype: str):
    """A ``[in, out]`` kernel as a ``qwix.QArray`` of ``qtype`` (see the module docstring for the blocks)."""
    _check_qtype(qtype)
    return _quantize(kernel, qtype, _tiles(np.shape(kernel)[0], qtype))


def check_family(model_type: str | None) -> None:
    """Refuse a ``model_type`` whose family does not route its kernels through the shared matmul."""
    from flaxheads.backbones.registry import family_for

    fam = family_for(model_type)
    if fam is None or "quantize" not in fam.features:
        raise UsageError(
            f"a quantised base is not available for model_type {model_type!r}: its family fuses or "
            "rescales kernels outside the shared matmul; quantised bases serve the decoder LLMs "
            "(llama, mistral, qwen2, qwen3, gemma*). Load it in bfloat16 (--base-dtype bfloat16) instead"
        )


def quantizable(path: tuple[str, ...], shape: tuple[int, ...]) -> bool:
    """Whether the backbone param at ``path`` (without ``"backbone"``) of ``shape`` is quantised: a 2-D
    ``kernel`` of a transformer layer (not the embeddings, norms or biases)."""
    return path[-1:] == ("kernel",) and "layers" in path and len(shape) == 2


def quantize_params(backbone_params, qtype: str, model_type: str | None) -> dict:
    """``backbone_params`` with every :func:`quantizable` kernel quantised."""
    check_family(model_type)
    flat = flatten_dict(backbone_params)
    return unflatten_dict({k: quantize_kernel(v, qtype) if quantizable(k, np.shape(v)) else v for k, v in flat.items()})


@lru_cache(maxsize=64)
def _quantizer(qtype: str, tree: Any, out_shardings: tuple):
    # one jitted function per scheme and output placement: the layers' kernels of one shape share a compile
    return jax.jit(partial(quantize_kernel, qtype=qtype), out_shardings=jax.tree.unflatten(tree, out_shardings))


@lru_cache(maxsize=64)
def _blockwise(qtype: str, tree: Any, sharding: NamedSharding, tiles: tuple | None):
    from flaxheads.runtime.parallel import _per_device

    spec = sharding.spec  # a block's codes and scale lie on its device: both split like the kernel
    fn = _per_device(
        partial(_quantize, qtype=qtype, tiles=dict(tiles) if tiles else None),
        sharding.mesh,
        in_specs=spec,
        out_specs=jax.tree.unflatten(tree, (spec, spec)),
    )
    return jax.jit(fn)


def quantize_onto(kernel: jax.Array, qtype: str, shardings: Callable[[str, tuple[int, ...]], Any]):
    """:func:`quantize_kernel` of a placed ``kernel``, computed where it lies, with the codes and the scales
    on ``shardings(part, shape)`` (``part``: ``"qvalue"`` or ``"scale"``). The same values as the
    eager :func:`quantize_kernel`: a quantised base read onto a mesh tensor by tensor equals one
    quantised after loading.

    Where no block crosses a shard (the inputs whole on each device, or split in multiples of the
    block) each device quantises its own shard. One program over the whole array would do the same
    arithmetic, but nf4's code lookup flattens the kernel, which gathers a kernel split by columns
    onto every device (192 MiB of temporaries per device for an 8192 x 2048 kernel on 8)."""
    _check_qtype(qtype)
    shapes = jax.eval_shape(partial(quantize_kernel, qtype=qtype), kernel)
    leaves, tree = jax.tree_util.tree_flatten_with_path(shapes)
    outs = tuple(shardings(path_names(p)[-1], tuple(x.shape)) for p, x in leaves)
    sharding, tiles = kernel.sharding, _tiles(kernel.shape[0], qtype)
    block = tiles[0] if tiles else kernel.shape[0]  # the inputs one scale covers
    if isinstance(sharding, NamedSharding) and sharding.shard_shape(kernel.shape)[0] % block == 0:
        out = _blockwise(qtype, tree, sharding, tuple(tiles.items()) if tiles else None)(kernel)
        return jax.device_put(out, jax.tree.unflatten(tree, outs))  # nothing moves where the layout agrees
    return _quantizer(qtype, tree, outs)(kernel)


def quantization_of(backbone_params) -> str | None:
    """The scheme of a base's quantised kernels (None: none quantised)."""
    for leaf in jax.tree.leaves(backbone_params, is_leaf=is_quantized):
        if is_quantized(leaf):
            q = leaf.qtype
            return "nf4" if q == "nf4" else jnp.dtype(q).name
    return None


def device_bytes(tree) -> int:
    """Bytes the arrays of ``tree`` take on their devices (sub-byte codes packed, as XLA stores them)."""
    return int(
        sum(
            x.on_device_size_in_bytes()
            if hasattr(x, "on_device_size_in_bytes")
            else (np.dtype(x.dtype).itemsize * x.size)
            for x in jax.tree.leaves(tree)
        )
    )
