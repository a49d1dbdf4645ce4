"""Sharding past data parallel: a named device mesh (``data`` x ``fsdp`` x ``tensor``), rules
that map the params' logical axis names onto it, and the resulting shardings of any tree
that holds params (the params themselves, a train state, optimizer moments).

* The logical names of a param come from its backbone family
  (:meth:`~flaxheads.backbones.base.Backbone.param_axes`, by default the generic rule of
  :mod:`flaxheads.runtime.axes`); the head uses the generic rule.
* :data:`DEFAULT_RULES` shard ``embed`` over ``fsdp`` (ZeRO-3 style: every param, gradient and
  optimizer moment is split, XLA gathers a weight where a step needs it) and ``heads``/``kv``/
  ``mlp``/``vocab`` over ``tensor`` (Megatron-style column/row splits); the batch is split over
  ``data`` x ``fsdp``.
* A dimension whose size the mesh axes do not divide stays whole (replicated on those axes)
  instead of failing; a name without a rule, or a param without names, is replicated.
* Any other tree is sharded like the params it holds: a leaf whose key path *ends with* a
  param's path (``opt_state/.../mu/backbone/.../kernel``) and has its shape gets its sharding.

The computation is written globally (``jax.jit`` with these shardings): the loss and the
updates equal the single-device ones up to float reassociation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from flaxheads.errors import TrainingError
from flaxheads.runtime.axes import EMBED, HEADS, KV, MLP, VOCAB, Axes, generic_param_axes

DATA, FSDP, TENSOR = "data", "fsdp", "tensor"
#: Mesh axis names, outermost first (the innermost axis varies fastest over a host's devices).
MESH_AXES = (DATA, FSDP, TENSOR)
#: The logical name of the batch dimension of every batch array.
BATCH = "batch"
#: Logical name -> mesh axis (or axes, outer first). Override per run with ``Parallel(rules=...)``.
DEFAULT_RULES: Mapping[str, str | tuple[str, ...]] = {
    BATCH: (DATA, FSDP),
    EMBED: FSDP,
    HEADS: TENSOR,
    KV: TENSOR,
    MLP: TENSOR,
    VOCAB: TENSOR,
}


def parse_mesh(text: str | Mapping[str, int]) -> dict[str, int]:
    """``"data=2,fsdp=4"`` -> ``{"data": 2, "fsdp": 4}`` (axes not named are 1; one may be -1 = the rest)."""
    if isinstance(text, Mapping):
        items = list(text.items())
    else:
        items = []
        for part in str(text).split(","):
            name, eq, count = part.strip().partition("=")
            try:
                items.append((name.strip(), int(count)))
            except ValueError:
                eq = ""
            if not eq:
                raise TrainingError(
                    f"mesh {text!r}: expected axis=size pairs joined by commas, e.g. data=2,fsdp=4 "
                    f"(axes: {', '.join(MESH_AXES)})"
                )
    shape = {}
    for name, size in items:
        if name not in MESH_AXES:
            raise TrainingError(f"mesh {text!r}: unknown axis {name!r}; the axes are {', '.join(MESH_AXES)}")
        if name in shape:
            raise TrainingError(f"mesh {text!r}: axis {name!r} is given twice")
        if size < 1 and size != -1:
            raise TrainingError(f"mesh {text!r}: axis {name}={size}; sizes are positive (or -1: the remaining devices)")
        shape[name] = int(size)
    return shape


def mesh_devices(devices=None) -> list:
    """Every (global) device, grouped by process: a host's devices are neighbours in the mesh,
    so the innermost axes stay inside a host and the outer ones span hosts."""
    devs = jax.devices() if devices is None else list(np.asarray(devices).reshape(-1))
    return sorted(devs, key=lambda d: (d.process_index, d.id))


def make_mesh(shape: str | Mapping[str, int] | None = None, devices=None) -> Mesh:
    """A mesh with axes ``data``, ``fsdp``, ``tensor`` over all global devices.

    ``shape``: sizes by name (``"data=2,fsdp=4"`` or a dict); missing axes are 1, except
    ``data``, which takes the devices left over; -1 on one axis does the same for that axis."""
    devs = mesh_devices(devices)
    sizes = parse_mesh(shape or {})
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise TrainingError(f"mesh {shape!r}: at most one axis may be -1")
    if not free and DATA not in sizes:
        sizes[DATA] = -1
        free = [DATA]
    fixed = math.prod(s for a, s in sizes.items() if s != -1)
    if free:
        if len(devs) % fixed:
            raise TrainingError(f"mesh {shape!r}: {len(devs)} devices do not split into groups of {fixed}")
        sizes[free[0]] = len(devs) // fixed
    dims = tuple(sizes.get(a, 1) for a in MESH_AXES)
    if math.prod(dims) != len(devs):
        raise TrainingError(
            f"mesh {dict(zip(MESH_AXES, dims))} needs {math.prod(dims)} devices but there are "
            f"{len(devs)}; make the sizes multiply to {len(devs)}"
        )
    return Mesh(np.asarray(devs, dtype=object).reshape(dims), MESH_AXES)


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    return {a: int(s) for a, s in mesh.shape.items()}


def key_name(k) -> str:
    """One key of a pytree path as a plain string (dict key, attribute, index)."""
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_names(path) -> tuple[str, ...]:
    return tuple(key_name(k) for k in path)


def spec_for(axes: Axes, shape: Sequence[int], mesh: Mesh, rules: Mapping[str, Any]) -> P:
    """The PartitionSpec of one array with logical ``axes``: each named dimension on its rule's
    mesh axes, leaving out axes of size 1, axes an earlier dimension took, and the whole
    dimension when its size is not a multiple of those axes' devices."""
    sizes = mesh_shape(mesh)
    used: set[str] = set()
    out: list[str | tuple[str, ...] | None] = []
    for name, n in zip(axes, shape):
        target = rules.get(name) if name is not None else None
        target = (target,) if isinstance(target, str) else tuple(target or ())
        target = tuple(a for a in target if sizes.get(a, 1) > 1 and a not in used)
        if not target or n % math.prod(sizes[a] for a in target):
            out.append(None)
            continue
        used.update(target)
        out.append(target[0] if len(target) == 1 else target)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def model_param_axes(model) -> dict[tuple[str, ...], Axes]:
    """``{param path: logical axes}`` of a :class:`~flaxheads.model.sequence.SequenceModel`'s params
    (concrete or ``jax.eval_shape`` leaves): the backbone family's rule under ``backbone``,
    the generic rule elsewhere."""
    fam = getattr(type(model.backbone), "param_axes", None)
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(model.params):
        names = path_names(path)
        rule = fam if names[:1] == ("backbone",) and fam is not None else generic_param_axes
        # a quantised kernel's codes and block scales (flaxheads.model.quantize) are split like the kernel
        of = names[1:-1] if names[-2:-1] == ("kernel",) and names[-1] in ("qvalue", "scale") else names[1:]
        out[names] = tuple(rule(of, tuple(np.shape(x))))
    return out


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where every param lives on ``mesh``: ``specs`` maps a param path to its PartitionSpec."""

    mesh: Mesh
    specs: Mapping[tuple[str, ...], tuple[tuple[int, ...], P]]
    rules: Mapping[str, Any] = dataclasses.field(default_factory=lambda: dict(DEFAULT_RULES))

    @classmethod
    def for_model(cls, mesh: Mesh, model, rules: Mapping[str, Any] | None = None) -> Layout:
        rules = dict(DEFAULT_RULES if rules is None else rules)
        shapes = {path_names(p): tuple(np.shape(x)) for p, x in jax.tree_util.tree_leaves_with_path(model.params)}
        specs = {p: (shapes[p], spec_for(a, shapes[p], mesh, rules)) for p, a in model_param_axes(model).items()}
        return cls(mesh, specs, rules)

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes (of this mesh) the batch dimension is split over."""
        target = self.rules.get(BATCH, (DATA,))
        target = (target,) if isinstance(target, str) else tuple(target)
        return tuple(a for a in target if a in self.mesh.axis_names)

    def batch(self) -> NamedSharding:
        """Batch arrays: rows split over :meth:`batch_axes`, the other dimensions whole."""
        return NamedSharding(self.mesh, P(self.batch_axes() or None))

    def spec_of(self, names: tuple[str, ...], shape: tuple[int, ...]) -> P:
        """The spec of the param whose path is the longest suffix of ``names`` with this shape."""
        for k in range(len(names)):
            hit = self.specs.get(names[k:])
            if hit is not None and hit[0] == shape:
                return hit[1]
        return P()

    def shardings(self, tree) -> Any:
        """NamedShardings for every leaf of ``tree`` (params, a train state, optimizer state)."""
        return jax.tree_util.tree_map_with_path(
            lambda p, x: NamedSharding(self.mesh, self.spec_of(path_names(p), tuple(np.shape(x)))), tree
        )


def replicated_layout(mesh: Mesh, rules: Mapping[str, Any] | None = None) -> Layout:
    """A layout that shards nothing but the batch (data parallel)."""
    return Layout(mesh, {}, dict(DEFAULT_RULES if rules is None else rules))


def shard_bytes(tree, shardings) -> int:
    """Bytes one device holds of ``tree`` (arrays or ShapeDtypeStructs) under ``shardings``."""
    leaves, shards = jax.tree.leaves(tree), jax.tree.leaves(shardings)
    # bits, so that 4-bit codes count half a byte (as XLA stores them)
    return int(
        sum(
            math.prod(s.shard_shape(tuple(np.shape(x)))) * jax.dtypes.itemsize_bits(x.dtype) // 8
            for x, s in zip(leaves, shards, strict=True)
        )
    )


def abstract(tree, shardings) -> Any:
    """ShapeDtypeStructs of ``tree`` with ``shardings`` (what ``jit(...).lower`` and Orbax restore take)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(tuple(np.shape(x)), x.dtype, sharding=s), tree, shardings)
