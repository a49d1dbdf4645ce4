"""How steps run on devices: one device, ``pmap`` mode over the local devices (replicated state,
``lax.psum`` reductions inside the step: ``jit`` of ``jax.shard_map`` over a data-only mesh of the
local devices, as JAX recommends in place of ``jax.pmap``), or ``jit`` over a named device ``Mesh``
(``data`` x ``fsdp`` x ``tensor``, see :mod:`flaxheads.runtime.sharding`): the batch split over
``data`` x ``fsdp``, params and optimizer state sharded by their logical axis names (all
replicated on a data-only mesh). The mesh path spans hosts through ``jax.distributed``."""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from flaxheads.errors import TrainingError
from flaxheads.runtime.sharding import DATA as DATA_AXIS
from flaxheads.runtime.sharding import Layout, make_mesh, replicated_layout

if TYPE_CHECKING:  # a sharding's mesh may be abstract (newer jax)
    from jax.sharding import AbstractMesh

PARALLEL_MODES = ("single", "pmap", "mesh")
__all__ = ["DATA_AXIS", "PARALLEL_MODES", "Parallel", "host_leaf", "make_mesh", "process_rows"]


def _per_device(fn: Callable, mesh: Mesh | AbstractMesh, in_specs, out_specs) -> Callable:
    """``fn`` written per device, as under ``jax.pmap``: ``jax.shard_map`` without its replication
    checks, whose automatic sum of an invariant input's cotangent would add to the step's own
    ``psum`` of the gradients (``jax.experimental.shard_map`` on releases before it moved)."""
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:
        from jax.experimental.shard_map import shard_map as experimental_shard_map

        shard_map = experimental_shard_map
    # the checks' switch was renamed (check_rep -> check_vma)
    check = "check_vma" if "check_vma" in inspect.signature(shard_map).parameters else "check_rep"
    return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **{check: False})


def local_data_mesh() -> Mesh:
    """Every local device on one ``data`` axis (``pmap`` mode)."""
    return Mesh(np.array(jax.local_devices()), (DATA_AXIS,))


def host_leaf(x) -> np.ndarray:
    """A host copy of one array. Multi-host: a replicated array is read from its local shard, a
    sharded one is gathered from every process (a collective: every process must call it)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _process_block(sharding: NamedSharding, parts: int) -> tuple[int, int]:
    """(index, count): this process holds block ``index`` of ``count`` equal, contiguous blocks of
    the rows of an array with ``parts`` row shards (processes that share rows hold the same block)."""
    # an index of None: the device holds the whole array
    starts = sorted(
        {int(idx[0].start or 0) if idx else 0 for idx in sharding.addressable_devices_indices_map((parts,)).values()}
    )
    k = len(starts)
    if starts != list(range(starts[0], starts[0] + k)) or starts[0] % k:
        raise TrainingError(
            f"this process's devices hold batch shards {starts} of {parts}, not one contiguous "
            "block; order the mesh so each host's devices are neighbours on the batch axes"
        )
    return starts[0] // k, parts // k


@dataclasses.dataclass
class Parallel:
    """How steps run: ``single`` (one device), ``pmap`` (local devices, replicated state, the step
    written per device with collectives over ``data``: ``shard_map``) or ``mesh`` (jit over all
    global devices, the step written globally; works multi-host).

    ``mesh``: a :class:`~jax.sharding.Mesh` (default: every device on ``data``; see
    :func:`~flaxheads.runtime.sharding.make_mesh`, e.g. ``make_mesh("data=2,fsdp=4")``);
    ``rules``: logical axis name -> mesh axes (default
    :data:`~flaxheads.runtime.sharding.DEFAULT_RULES`); ``layout``: where each param lives,
    set by :meth:`bind` (unbound: everything replicated, data parallel)."""

    mode: str = "single"
    mesh: Mesh | None = None
    rules: Mapping[str, Any] | None = None
    layout: Layout | None = None

    def __post_init__(self):
        if self.mode not in PARALLEL_MODES:
            raise TrainingError(f"parallel mode must be one of {PARALLEL_MODES}, got {self.mode!r}")
        if self.mode != "mesh" and self.mesh is not None:
            raise TrainingError(f"a device mesh needs parallel mode 'mesh', not {self.mode!r}")
        if self.mode == "mesh" and self.mesh is None:
            self.mesh = make_mesh()
        if self.mode == "mesh" and self.layout is None:
            self.layout = replicated_layout(self.mesh, self.rules)

    @property
    def _mesh(self) -> Mesh:
        """Mesh mode's device mesh (``__post_init__`` sets it)."""
        if self.mesh is None:
            raise TrainingError(f"parallel mode {self.mode!r} has no device mesh; mode 'mesh' has one")
        return self.mesh

    @property
    def _layout(self) -> Layout:
        """Mesh mode's layout of the params (``__post_init__`` sets a replicated one, :meth:`bind` the model's)."""
        if self.layout is None:
            raise TrainingError(f"parallel mode {self.mode!r} places no params by layout; mode 'mesh' does")
        return self.layout

    @classmethod
    def from_config(cls, mode: str = "single", mesh: str | Mapping[str, int] | None = None) -> Parallel:
        """``mode``, or a mesh of the given shape (``"data=2,fsdp=4"``; implies mode ``mesh``)."""
        if mesh:
            if mode not in ("single", "mesh"):
                raise TrainingError(f"a mesh shape ({mesh}) runs in parallel mode 'mesh', not {mode!r}")
            return cls("mesh", make_mesh(mesh))
        return cls(mode)

    def bind(self, model) -> Parallel:
        """This mode with the params of ``model`` placed by their logical axes (mesh mode; the
        other modes are returned unchanged)."""
        if self.mode != "mesh":
            return self
        return dataclasses.replace(self, layout=Layout.for_model(self._mesh, model, self.rules))

    @property
    def width(self) -> int:
        """How many ways a batch is split (its size must be a multiple of this)."""
        if self.mode == "pmap":
            return jax.local_device_count()
        if self.mode == "mesh":
            return math.prod(self._mesh.shape[a] for a in self._layout.batch_axes())
        return 1

    @property
    def local_rows_fraction(self) -> tuple[int, int]:
        """(index, count): this process feeds block ``index`` of ``count`` equal blocks of every global batch."""
        if self.mode == "mesh":
            return _process_block(self._layout.batch(), self.width)
        return 0, 1

    def shardings(self, tree) -> Any:
        """Mesh mode: the NamedSharding of every leaf of ``tree`` (params, a state) by the layout."""
        return self._layout.shardings(tree)

    def compile(
        self,
        step_fn: Callable,
        *,
        donate: bool = True,
        like: Any = None,
        returns_state: bool | None = None,
        options: Mapping[str, str] | None = None,
    ) -> Callable:
        """Jit (single/mesh) or pmap a ``(state_or_params, batch) -> out`` function.

        Mesh mode: ``like`` is the first argument's tree (arrays or ``jax.eval_shape`` leaves);
        it is placed by the layout (None: replicated). ``returns_state`` (default ``donate``):
        the output is ``(new first argument, replicated metrics)`` with the same placement;
        otherwise the whole output is replicated (logits). ``options``: XLA's per-program
        ``compiler_options``, a train step's from its compute plan
        (``plan.compiler_options(gradients=True)``; ``jax.pmap`` takes none, so a pmapped step
        compiles with the process's settings)."""
        donate_argnums = (0,) if donate else ()
        options = dict(options or {})
        if self.mode == "single":
            return jax.jit(step_fn, donate_argnums=donate_argnums, compiler_options=options)
        if self.mode == "pmap":
            mesh = local_data_mesh()
            rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P(DATA_AXIS))
            state_out = donate if returns_state is None else returns_state
            per_device = _per_device(step_fn, mesh, (P(), P(DATA_AXIS)), (P(), P()) if state_out else P(DATA_AXIS))
            return jax.jit(
                per_device,
                in_shardings=(rep, rows),
                out_shardings=(rep, rep) if state_out else rows,
                donate_argnums=donate_argnums,
                compiler_options=options,
            )
        rep = self._layout.replicated()
        first = rep if like is None else self.shardings(like)
        out = (first, rep) if (donate if returns_state is None else returns_state) else rep
        return jax.jit(
            step_fn,
            in_shardings=(first, self._layout.batch()),
            out_shardings=out,
            donate_argnums=donate_argnums,
            compiler_options=options,
        )

    def put_state(self, tree, *, reuse: bool = False):
        """Place a pytree (state or params; host arrays, or arrays placed elsewhere, such as
        restored on another mesh) for this mode: a copy. ``reuse``: device arrays already where
        this mode puts them are taken as they are, not copied (the caller gives them up: a step
        that donates the state deletes them)."""
        seen: set[int] = set()  # an array in two places is copied for the second: a step cannot donate it twice

        def keep(x, where) -> bool:
            if not (reuse and _on(x, where)) or id(x) in seen:
                return False
            seen.add(id(x))
            return True

        if self.mode == "single":
            one = jax.devices()[0]
            return jax.tree.map(lambda x: x if keep(x, one) else jnp.array(x, copy=True), tree)
        if self.mode == "pmap":
            rep = NamedSharding(local_data_mesh(), P())
            return jax.tree.map(lambda x: x if keep(x, rep) else _place(x, rep), tree)
        return jax.tree.map(lambda x, s: x if keep(x, s) else _place(x, s), tree, self.shardings(tree))

    def get_state(self, tree):
        """One copy of a placed state as host numpy arrays (inverse of :meth:`put_state`)."""
        return self.get(tree)

    def put_batch(self, batch: dict) -> dict:
        """Place a batch. For ``mesh`` the argument is *this process's rows* of the global batch
        (see :func:`process_rows`); for pmap the rows are split over local devices."""
        if self.mode == "single":
            return batch
        if self.mode == "pmap":
            rows = NamedSharding(local_data_mesh(), P(DATA_AXIS))
            return {k: jax.device_put(np.asarray(v), rows) for k, v in batch.items()}
        data, count = self._layout.batch(), self.local_rows_fraction[1]
        return {
            k: jax.make_array_from_process_local_data(data, np.asarray(v), (len(v) * count, *np.shape(v)[1:]))
            for k, v in batch.items()
        }

    def put_rows(self, batch: dict) -> dict:
        """Place a *global* batch: this process's rows of it (multi-host mesh), then :meth:`put_batch`."""
        return self.put_batch(process_rows(batch, *self.local_rows_fraction))

    def get(self, x):
        """Host value of a step output (state, metrics): read once."""
        return jax.tree.map(host_leaf, x)

    def get_rows(self, x) -> np.ndarray:
        """Host value of a per-example output (logits) in global batch order."""
        return host_leaf(x)


def _on(x, where) -> bool:
    """Whether ``x`` is a live device array placed exactly as ``where`` (a device or a sharding) says."""
    if not isinstance(x, jax.Array) or x.is_deleted():
        return False
    if isinstance(where, jax.Device):
        return x.sharding.device_set == {where}
    return x.sharding.is_equivalent_to(where, x.ndim)


def _place(x, sharding: NamedSharding):
    """A copy of ``x`` on ``sharding``. Host values must be the same on every process (each fills
    its own shards); device arrays are copied or resharded by XLA."""
    if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1:
        return jax.jit(jnp.copy, out_shardings=sharding)(x)
    v = np.asarray(x)
    return jax.make_array_from_callback(v.shape, sharding, lambda idx: v[idx])


def process_rows(batch: dict, process_index: int, process_count: int) -> dict:
    """This process's contiguous slice of a global batch (multi-host mesh input)."""
    if process_count == 1:
        return batch
    n = len(next(iter(batch.values())))
    if n % process_count:
        raise TrainingError(
            f"global batch of {n} rows does not split over {process_count} processes; use a batch "
            f"size that is a multiple of {process_count}"
        )
    k = n // process_count
    return {key: v[process_index * k : (process_index + 1) * k] for key, v in batch.items()}
