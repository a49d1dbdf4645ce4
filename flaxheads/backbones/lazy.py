"""Params read from safetensors straight onto their shardings, one tensor at a time.

:func:`~flaxheads.backbones.weights.read_state_dict` reads every tensor into host memory before
anything is placed; for a model near the host's memory that is the whole model twice (numpy, then
the device copies). :func:`read_params_sharded` instead reads each param's box, the part of the
stored tensor that this process's devices hold (the union of their shards' index boxes), with
``pread`` into a fresh buffer (:mod:`~flaxheads.backbones.safetensors_file`: nothing is memory-mapped),
converts it to the target dtype, hands every device its slice (``jax.make_array_from_callback``),
optionally transforms the placed param (``transform``: a quantised kernel) and drops the buffer before
the next tensor. The host holds about one tensor at a time; each process reads its own boxes only.

Which tensor becomes which param, and whether it is transposed, is not written down a second
time: the family's own :meth:`~flaxheads.backbones.base.Backbone.params_from_state` is run on
zero-byte stand-ins (``np.broadcast_to`` of one number per tensor, then of each row's index), and
each leaf says where it came from. A family whose conversion computes new values from several
tensors (concatenations, splits, arithmetic) is refused by name; it loads with the eager path.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from flaxheads.backbones.base import Backbone, BackboneError, HFConfig, strip_prefix
from flaxheads.backbones.safetensors_file import SafetensorsFile, TensorInfo
from flaxheads.backbones.weights import SAFE, SAFE_INDEX, WeightsNotFoundError
from flaxheads.runtime.malloc import release_free_memory


class NotLazyLoadable(BackboneError):
    """A family whose params are not each one stored tensor (or its transpose): it loads eagerly."""


#: ``shardings(path, shape) -> jax.sharding.Sharding`` for a backbone param (path without "backbone")
ShardingFn = Callable[[tuple[str, ...], tuple[int, ...]], jax.sharding.Sharding]
#: ``transform(path, param) -> leaf``: applied to each backbone param once it is placed (e.g. quantised)
Transform = Callable[[tuple[str, ...], jax.Array], Any]


def safetensors_files(folder: str) -> list[str]:
    """The safetensors files of an HF folder (one, or the shards its index names)."""
    single, index = os.path.join(folder, SAFE), os.path.join(folder, SAFE_INDEX)
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        with open(index) as f:
            return [os.path.join(folder, s) for s in sorted(set(json.load(f)["weight_map"].values()))]
    raise WeightsNotFoundError(
        f"{folder!r} has no {SAFE} or {SAFE_INDEX}: the sharded loader reads safetensors "
        "only; load it eagerly (from_pretrained) or re-save it with safe_serialization=True"
    )


def _family_names(family: type[Backbone], stored: Mapping[str, Any]) -> dict[str, str]:
    """``{family's name: name in the file}`` where a hub classifier's own code put the base model under another
    prefix (GTE's ``new.``): the eager loader renames those in the state dict, this reads them under the
    family's ``base_model_prefix`` (and so does the head's lookup of the other tensors); else empty."""
    base = family.base_model_prefix
    if any(n.startswith(base + ".") for n in stored):
        return {}
    for prefix in getattr(family, "custom_prefixes", ()):
        if any(n.startswith(prefix + ".") for n in stored):
            return {base + n[len(prefix) :]: n for n in stored if n.startswith(prefix + ".")}
    return {}


def _headers(files: list[str]) -> dict[str, tuple[str, TensorInfo]]:
    """``{name: (file, its header entry)}`` of every tensor of ``files`` (no tensor data is read)."""
    out: dict[str, tuple[str, TensorInfo]] = {}
    for path in files:
        with SafetensorsFile(path) as f:
            out.update((name, (path, t)) for name, t in f.tensors.items())
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


def param_sources(
    family: type[Backbone], config: HFConfig, shapes: dict[str, tuple[int, ...]]
) -> dict[tuple[str, ...], tuple[str, bool]]:
    """``{param path: (tensor name, transposed)}``: where the family's conversion puts each tensor."""
    names_only: dict[str, Any] = dict.fromkeys(shapes)
    base = strip_prefix(names_only, family.base_model_prefix)  # names as the family sees them
    prefix = "" if set(base) == set(shapes) else family.base_model_prefix + "."
    names = list(base)
    local = {n: shapes[prefix + n] for n in names}
    by_number = flatten_dict(family.params_from_state(config, _stand_ins(local, rows=False)))
    by_row = flatten_dict(family.params_from_state(config, _stand_ins(local, rows=True)))
    out = {}
    for path, leaf in by_number.items():
        leaf = np.asarray(leaf)
        if leaf.size == 0 or any(leaf.strides):
            raise NotLazyLoadable(
                f"{family.__name__}: param {'/'.join(path)} is computed from several tensors; the "
                "sharded loader reads params that are single tensors (or their transposes): load "
                "this family eagerly"
            )
        name = names[int(leaf.flat[0])]
        src, shape = local[name], tuple(leaf.shape)
        row = np.asarray(by_row[path])
        if shape == src and (len(shape) < 2 or shape[0] < 2 or row[(1,) + (0,) * (len(shape) - 1)] == 1):
            out[path] = (prefix + name, False)
        elif len(shape) == 2 and shape == src[::-1]:
            out[path] = (prefix + name, True)
        else:
            raise NotLazyLoadable(
                f"{family.__name__}: param {'/'.join(path)} {shape} is a reshaped {name} {src}; the "
                "sharded loader reads tensors as they are or transposed: load this family eagerly"
            )
    return out


@dataclasses.dataclass(frozen=True)
class _Index:
    """A folder's safetensors, read once from their headers: the files, every tensor's entry, and which
    tensor each backbone param is (and whether transposed)."""

    files: list[str]
    stored: dict[str, tuple[str, TensorInfo]]
    sources: dict[tuple[str, ...], tuple[str, bool]]
    #: the name in the file of a tensor ``stored`` names otherwise (:func:`_family_names`)
    in_file: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, folder: str | os.PathLike, family: type[Backbone], config: HFConfig) -> _Index:
        files = safetensors_files(os.fspath(folder))
        stored = _headers(files)
        in_file = _family_names(family, stored)
        renamed = {v: k for k, v in in_file.items()}
        stored = {renamed.get(n, n): entry for n, entry in stored.items()}
        sources = param_sources(family, config, {n: t.shape for n, (_, t) in stored.items()})
        return cls(files, stored, sources, in_file)

    def param_shapes(self) -> dict:
        shape = {n: t.shape for n, (_, t) in self.stored.items()}
        return unflatten_dict(
            {
                p: jax.ShapeDtypeStruct(shape[n][::-1] if tr else shape[n], self.stored[n][1].dtype)
                for p, (n, tr) in self.sources.items()
            }
        )

    def others(self) -> StoredTensors:
        """The tensors no backbone param is (the head's weights), each read only when looked up."""
        used = {name for name, _ in self.sources.values()}
        return StoredTensors({n: file for n, (file, _) in self.stored.items() if n not in used}, self.in_file)


def param_shapes(folder: str | os.PathLike, family: type[Backbone], config: HFConfig) -> dict:
    """The family's params tree of ``folder`` as ``jax.ShapeDtypeStruct`` leaves in the stored dtypes,
    from the files' headers alone (to check a folder against its config before anything is read)."""
    return _Index.of(folder, family, config).param_shapes()


def _box(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...] | None:
    """``(start, stop)`` per axis of the union of the index boxes of this process's devices (None: it holds
    no part); a box, not the exact union, so that it reads in few runs (a process's shards are neighbours)."""
    boxes = [tuple(index or ()) for index in sharding.addressable_devices_indices_map(shape).values()]
    if not boxes:
        return None
    out = []
    for axis, n in enumerate(shape):
        spans = [(index[axis].indices(n)[:2] if axis < len(index) else (0, n)) for index in boxes]
        out.append((min(a for a, _ in spans), max(b for _, b in spans)))
    return tuple(out)


def _read_param(
    file: SafetensorsFile,
    name: str,
    shape: tuple[int, ...],
    transposed: bool,
    sharding: jax.sharding.Sharding,
    dtype: Any,
) -> jax.Array:
    """One param on ``sharding``: this process's box of tensor ``name`` read (in the stored axes), converted
    to ``dtype`` when floating, and sliced for each device; the buffer goes when this returns."""
    box = _box(sharding, shape)
    if box is None:
        part, origin = np.empty((0,) * len(shape)), (0,) * len(shape)
    else:
        part = file.read(name, [slice(a, b) for a, b in (box[::-1] if transposed else box)])
        part, origin = (part.T if transposed else part), tuple(a for a, _ in box)
        if jnp.issubdtype(part.dtype, jnp.floating) and part.dtype != np.dtype(dtype):
            part = part.astype(dtype)  # rebinding drops the stored-dtype buffer before the devices copy

    def piece(index: tuple[slice, ...] | None) -> np.ndarray:
        given = tuple(index or ())
        full = given + (slice(None),) * (len(shape) - len(given))
        return part[tuple(slice(*(i - o for i in s.indices(n)[:2])) for s, n, o in zip(full, shape, origin))]

    return jax.make_array_from_callback(shape, sharding, piece)


def read_params_sharded(
    folder: str | os.PathLike,
    family: type[Backbone],
    config: HFConfig,
    shardings: ShardingFn,
    dtype: Any = jnp.float32,
    transform: Transform | None = None,
) -> dict:
    """The family's params tree of ``folder``, each param a ``jax.Array`` on ``shardings(path, shape)``
    in ``dtype`` (floating params; others as stored), read tensor by tensor: each process reads only the
    box its devices hold. ``transform(path, param)``, when given, replaces each param right after it is
    placed (the untransformed param is dropped before the next tensor is read)."""
    return _read_params(_Index.of(folder, family, config), shardings, dtype, transform)


def _read_params(index: _Index, shardings: ShardingFn, dtype: Any, transform: Transform | None) -> dict:
    # a file flaxheads wrote is checked block by block as it is read (each process: the blocks of its boxes);
    # read in file order, so that the block two tensors share is read and checked once
    order = sorted(
        index.sources.items(), key=lambda item: (index.stored[item[1][0]][0], index.stored[item[1][0]][1].offset)
    )
    opened: dict[str, SafetensorsFile] = {}
    flat = {}
    try:
        for path, (name, transposed) in order:
            file, info = index.stored[name]
            if file not in opened:
                opened[file] = SafetensorsFile(file)
            want = info.shape[::-1] if transposed else info.shape
            leaf = _read_param(
                opened[file], index.in_file.get(name, name), want, transposed, shardings(path, want), dtype
            )
            if transform is not None:
                leaf = transform(path, leaf)
            # done before the next read: the host buffers and an untransformed param are freed one at a time
            flat[path] = jax.block_until_ready(leaf)
            del leaf
            if transform is not None:
                release_free_memory()
    finally:
        for f in opened.values():
            f.close()
    return unflatten_dict(flat)


class StoredTensors(Mapping[str, np.ndarray]):
    """Tensors of safetensors files by name, each read whole (as stored) when it is looked up, not kept."""

    def __init__(self, where: Mapping[str, str], in_file: Mapping[str, str] | None = None):
        self._where = dict(where)  # name -> file
        self._in_file = dict(in_file or {})  # name -> its name in the file, where the two differ

    def __getitem__(self, name: str) -> np.ndarray:
        with SafetensorsFile(self._where[name]) as f:
            return f.read(self._in_file.get(name, name))

    def __contains__(self, name: object) -> bool:  # Mapping's own would read the tensor to answer
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_sharded(
    folder: str | os.PathLike,
    family: type[Backbone],
    config: HFConfig,
    shardings: ShardingFn,
    dtype: Any = jnp.float32,
    transform: Transform | None = None,
    check: Callable[[dict], None] | None = None,
) -> tuple[dict, Mapping[str, np.ndarray]]:
    """``(backbone params read tensor by tensor onto shardings, the folder's other tensors)``: what
    :func:`~flaxheads.model.pretrained.from_pretrained` reads for a model placed on a mesh. ``check``, when given, sees
    the params' shapes and stored dtypes (:func:`param_shapes`) before any tensor is read."""
    index = _Index.of(folder, family, config)  # the headers, read once
    if check is not None:
        check(index.param_shapes())
    return _read_params(index, shardings, dtype, transform), index.others()
