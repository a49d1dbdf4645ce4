"""Params read from safetensors straight onto their shardings, one tensor slice at a time.

:func:`~flaxheads.backbones.weights.read_state_dict` reads every tensor into host memory before
anything is placed; for a model near the host's memory that is the whole model twice (numpy, then
the device copies). :func:`read_params_sharded` instead builds each param with
``jax.make_array_from_callback``: for every device shard this process holds it reads just that
slice of the tensor (``safetensors.safe_open(...).get_slice``), converts it to the target dtype
and hands it over, so the host holds about one slice at a time.

Which tensor becomes which param, and whether it is transposed, is not written down a second
time: the family's own :meth:`~flaxheads.backbones.base.Backbone.params_from_state` is run on
zero-byte stand-ins (``np.broadcast_to`` of one number per tensor, then of each row's index), and
each leaf says where it came from. A family whose conversion computes new values from several
tensors (concatenations, splits, arithmetic) is refused by name; it loads with the eager path.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from .base import Backbone, BackboneError, HFConfig, strip_prefix
from ..checksums import verify_file
from .weights import SAFE, SAFE_INDEX, WeightsNotFoundError

class NotLazyLoadable(BackboneError):
    """A family whose params are not each one stored tensor (or its transpose): it loads eagerly."""


#: ``shardings(path, shape) -> jax.sharding.Sharding`` for a backbone param (path without "backbone")
ShardingFn = Callable[[tuple[str, ...], tuple[int, ...]], jax.sharding.Sharding]


def safetensors_files(folder: str) -> list[str]:
    """The safetensors files of an HF folder (one, or the shards its index names)."""
    single, index = os.path.join(folder, SAFE), os.path.join(folder, SAFE_INDEX)
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        with open(index) as f:
            return [os.path.join(folder, s) for s in sorted(set(json.load(f)["weight_map"].values()))]
    raise WeightsNotFoundError(f"{folder!r} has no {SAFE} or {SAFE_INDEX}: the sharded loader reads safetensors "
                               "only; load it eagerly (from_pretrained) or re-save it with safe_serialization=True")


def tensor_shapes(files: list[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (file, shape)}`` from the files' headers (no tensor is read)."""
    from safetensors import safe_open

    out = {}
    for path in files:
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():
                out[name] = (path, tuple(f.get_slice(name).get_shape()))
    return out


def _stand_ins(shapes: dict[str, tuple[int, ...]], rows: bool) -> dict[str, np.ndarray]:
    """Zero-stride arrays of each tensor's shape: its number (``rows=False``) or its row index."""
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        if rows and len(shape) >= 1:
            col = np.arange(shape[0], dtype=np.float32).reshape((shape[0],) + (1,) * (len(shape) - 1))
            out[name] = np.broadcast_to(col, shape)
        else:
            out[name] = np.broadcast_to(np.float32(i), shape)
    return out


def param_sources(family: type[Backbone], config: HFConfig,
                  shapes: dict[str, tuple[int, ...]]) -> dict[tuple[str, ...], tuple[str, bool]]:
    """``{param path: (tensor name, transposed)}``: where the family's conversion puts each tensor."""
    base = strip_prefix(dict.fromkeys(shapes), family.base_model_prefix)  # names as the family sees them
    prefix = "" if set(base) == set(shapes) else family.base_model_prefix + "."
    names = list(base)
    local = {n: shapes[prefix + n] for n in names}
    by_number = flatten_dict(family.params_from_state(config, _stand_ins(local, rows=False)))
    by_row = flatten_dict(family.params_from_state(config, _stand_ins(local, rows=True)))
    out = {}
    for path, leaf in by_number.items():
        leaf = np.asarray(leaf)
        if leaf.size == 0 or any(leaf.strides):
            raise NotLazyLoadable(f"{family.__name__}: param {'/'.join(path)} is computed from several tensors; the "
                                "sharded loader reads params that are single tensors (or their transposes): load "
                                "this family eagerly")
        name = names[int(leaf.flat[0])]
        src, shape = local[name], tuple(leaf.shape)
        row = np.asarray(by_row[path])
        if shape == src and (len(shape) < 2 or shape[0] < 2 or row[(1,) + (0,) * (len(shape) - 1)] == 1):
            out[path] = (prefix + name, False)
        elif len(shape) == 2 and shape == src[::-1]:
            out[path] = (prefix + name, True)
        else:
            raise NotLazyLoadable(f"{family.__name__}: param {'/'.join(path)} {shape} is a reshaped {name} {src}; the "
                                "sharded loader reads tensors as they are or transposed: load this family eagerly")
    return out


def read_params_sharded(folder: str | os.PathLike, family: type[Backbone], config: HFConfig,
                        shardings: ShardingFn, dtype: Any = jnp.float32) -> dict:
    """The family's params tree of ``folder``, each param a ``jax.Array`` on ``shardings(path, shape)``
    in ``dtype``, read slice by slice (each process reads only the slices of its own devices)."""
    from safetensors import safe_open

    folder = os.fspath(folder)
    files = safetensors_files(folder)
    for file in files:  # the sampled checksum; verify=True hashes them whole
        verify_file(file)
    found = tensor_shapes(files)
    sources = param_sources(family, config, {n: s for n, (_, s) in found.items()})
    handles: dict[str, Any] = {}
    flat = {}
    try:
        for path, (name, transposed) in sources.items():
            file, shape = found[name]
            if file not in handles:
                handles[file] = safe_open(file, framework="numpy")
            tensor = handles[file].get_slice(name)
            want = shape[::-1] if transposed else shape

            def read(index, tensor=tensor, transposed=transposed, ndim=len(shape)):
                index = tuple(index) + (slice(None),) * (ndim - len(index))
                part = np.asarray(tensor[index[::-1] if transposed else index])
                part = part.T if transposed else part
                return part.astype(dtype, copy=False) if np.issubdtype(part.dtype, np.floating) else part

            flat[path] = jax.make_array_from_callback(want, shardings(path, want), read)
    finally:
        handles.clear()
    return unflatten_dict(flat)


def read_other_tensors(folder: str | os.PathLike, used: set[str]) -> dict[str, np.ndarray]:
    """Every tensor of the folder's safetensors not in ``used`` (the head's weights beside a lazily read
    backbone: small), as numpy."""
    from safetensors import safe_open

    out = {}
    for path in safetensors_files(os.fspath(folder)):
        with safe_open(path, framework="numpy") as f:
            out.update({n: f.get_tensor(n) for n in f.keys() if n not in used})
    return out


def load_sharded(folder: str | os.PathLike, family: type[Backbone], config: HFConfig, shardings: ShardingFn,
                 dtype: Any = jnp.float32) -> tuple[dict, dict[str, np.ndarray]]:
    """``(backbone params read slice by slice onto shardings, the folder's other tensors)``: what
    :func:`~flaxheads.model.from_pretrained` reads for a model placed on a mesh."""
    folder = os.fspath(folder)
    found = tensor_shapes(safetensors_files(folder))
    used = {name for name, _ in param_sources(family, config, {n: s for n, (_, s) in found.items()}).values()}
    return read_params_sharded(folder, family, config, shardings, dtype), read_other_tensors(folder, used)
