"""Data parallelism for the steps of :mod:`flaxheads.training.steps`: one device, ``pmap`` over
the local devices (replicated state, ``lax.pmean``-style reductions inside the step), or ``jit``
over a device ``Mesh`` with ``NamedSharding`` (batch sharded on the ``data`` axis, state
replicated), the path that scales to multi-host pods through ``jax.distributed``."""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax.jax_utils import replicate
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .errors import TrainingError

DATA_AXIS = "data"
PARALLEL_MODES = ("single", "pmap", "mesh")


def make_mesh(devices=None) -> Mesh:
    """A 1-D mesh over all (global) devices with axis ``data``."""
    devs = np.asarray(jax.devices() if devices is None else devices)
    return Mesh(devs.reshape(-1), (DATA_AXIS,))


def host_leaf(x) -> np.ndarray:
    """A host copy of one array; a multi-host replicated array is read from its local shard."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0))  # replicated: every shard is the whole value
    return np.asarray(x)


@dataclasses.dataclass
class Parallel:
    """How steps run: ``single`` (one device), ``pmap`` (local devices, replicated state) or
    ``mesh`` (jit + NamedSharding over all global devices; works multi-host)."""

    mode: str = "single"
    mesh: Mesh | None = None

    def __post_init__(self):
        if self.mode not in PARALLEL_MODES:
            raise TrainingError(f"parallel mode must be one of {PARALLEL_MODES}, got {self.mode!r}")
        if self.mode == "mesh" and self.mesh is None:
            self.mesh = make_mesh()

    @property
    def width(self) -> int:
        """How many devices share a batch (its size must be a multiple of this)."""
        if self.mode == "pmap":
            return jax.local_device_count()
        if self.mode == "mesh":
            return self.mesh.devices.size
        return 1

    @property
    def local_rows_fraction(self) -> tuple[int, int]:
        """(index, count) of this process's slice of every global batch."""
        if self.mode == "mesh":
            return jax.process_index(), jax.process_count()
        return 0, 1

    def compile(self, step_fn: Callable, *, donate: bool = True) -> Callable:
        """Jit (single/mesh) or pmap a ``(state_or_params, batch) -> out`` function."""
        donate_argnums = (0,) if donate else ()
        if self.mode == "single":
            return jax.jit(step_fn, donate_argnums=donate_argnums)
        if self.mode == "pmap":
            return jax.pmap(step_fn, axis_name=DATA_AXIS, donate_argnums=donate_argnums)
        rep, data = NamedSharding(self.mesh, P()), NamedSharding(self.mesh, P(DATA_AXIS))
        return jax.jit(step_fn, in_shardings=(rep, data), out_shardings=rep, donate_argnums=donate_argnums)

    def put_state(self, tree):
        """Place a host/single-device pytree (state or params) for this mode (a copy)."""
        if self.mode == "single":
            return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)
        if self.mode == "pmap":
            return replicate(jax.tree.map(np.asarray, tree))
        rep = NamedSharding(self.mesh, P())
        return jax.tree.map(lambda x: _global_replicated(np.asarray(x), rep), tree)

    def get_state(self, tree):
        """One copy of a placed state as host numpy arrays (inverse of :meth:`put_state`)."""
        return self.get(tree)

    def put_batch(self, batch: dict) -> dict:
        """Place a batch. For ``mesh`` the argument is *this process's rows* of the global batch
        (see :func:`process_rows`); for pmap the rows are split over local devices."""
        if self.mode == "single":
            return batch
        if self.mode == "pmap":
            n = jax.local_device_count()
            return {k: np.asarray(v).reshape(n, -1, *np.shape(v)[1:]) for k, v in batch.items()}
        data = NamedSharding(self.mesh, P(DATA_AXIS))
        return {k: jax.make_array_from_process_local_data(data, np.asarray(v)) for k, v in batch.items()}

    def put_rows(self, batch: dict) -> dict:
        """Place a *global* batch: this process's rows of it (multi-host mesh), then :meth:`put_batch`."""
        return self.put_batch(process_rows(batch, *self.local_rows_fraction))

    def get(self, x):
        """Host value of a replicated step output (state, metrics): read once."""
        if self.mode == "pmap":
            x = jax.tree.map(lambda a: a[0], x)
        return jax.tree.map(host_leaf, x)

    def get_rows(self, x) -> np.ndarray:
        """Host value of a per-example output (logits) in global batch order."""
        if self.mode == "pmap":
            return pmap_eval_gather(np.asarray(x))
        return host_leaf(x)


def _global_replicated(x: np.ndarray, sharding: NamedSharding):
    # Works multi-host: every process holds the same value and fills its addressable shards.
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def process_rows(batch: dict, process_index: int, process_count: int) -> dict:
    """This process's contiguous slice of a global batch (multi-host mesh input)."""
    if process_count == 1:
        return batch
    n = len(next(iter(batch.values())))
    if n % process_count:
        raise TrainingError(f"global batch of {n} rows does not split over {process_count} processes; use a batch "
                            f"size that is a multiple of {process_count}")
    k = n // process_count
    return {key: v[process_index * k:(process_index + 1) * k] for key, v in batch.items()}


def pmap_eval_gather(logits):
    """Logits [D, B/D, N] from pmap back to [B, N]."""
    return logits.reshape(-1, *logits.shape[2:])
