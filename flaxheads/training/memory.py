"""What one device holds during a train step: params and optimizer state (from their
shardings), and XLA's own account of the compiled step (``compiled.memory_analysis()``:
arguments, outputs, temporaries = activations and workspace). Nothing is allocated: the step
is lowered on ``jax.eval_shape`` shapes, so a model too big for the machine can be sized."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import numpy as np

from flaxheads.errors import TrainingError
from flaxheads.runtime.sharding import abstract, mesh_shape, shard_bytes
from flaxheads.training.steps import make_train_step


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes per device. ``*_replicated``: the same with every param on every device (data
    parallel), for comparison. The ``xla_*`` fields are None when the backend reports nothing."""

    layout: str
    params: int
    opt_state: int
    params_replicated: int
    opt_state_replicated: int
    xla_arguments: int | None = None
    xla_outputs: int | None = None
    xla_temp: int | None = None
    xla_aliased: int | None = None

    @property
    def xla_total(self) -> int | None:
        """Peak estimate: arguments + outputs + temporaries, less outputs written over donated arguments."""
        if self.xla_arguments is None or self.xla_outputs is None or self.xla_temp is None or self.xla_aliased is None:
            return None  # no compiled memory analysis (the four are set together)
        return self.xla_arguments + self.xla_outputs + self.xla_temp - self.xla_aliased

    def lines(self) -> list[str]:
        out = [
            f"memory per device ({self.layout}): params {_gib(self.params)}, optimizer state "
            f"{_gib(self.opt_state)} (replicated: {_gib(self.params_replicated)} + "
            f"{_gib(self.opt_state_replicated)})"
        ]
        if self.xla_arguments is not None:
            out.append(
                f"  XLA train step: arguments {_gib(self.xla_arguments)}, activations and workspace "
                f"{_gib(self.xla_temp)}, outputs {_gib(self.xla_outputs)} ({_gib(self.xla_aliased)} "
                f"reusing donated arguments), total {_gib(self.xla_total)}"
            )
        return out


def _gib(n: int | None) -> str:
    return "not estimated" if n is None else f"{n / 2**30:.3f} GiB" if n >= 2**24 else f"{n / 2**20:.2f} MiB"


def memory_report(
    trainer, batch: Mapping[str, np.ndarray | jax.ShapeDtypeStruct], *, compile: bool = True
) -> MemoryReport:
    """The per-device memory of ``trainer``'s train step on batches shaped like ``batch`` (a global
    host batch, or ShapeDtypeStructs). ``compile=False``: params and optimizer state only."""
    par = trainer.parallel
    if par.mode == "pmap":
        raise TrainingError(
            "the memory report covers single-device and mesh runs; pmap replicates everything "
            "(use a data-only mesh for the same layout)"
        )
    state = trainer.abstract_state()
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = par.shardings(state) if par.mode == "mesh" else jax.tree.map(lambda _: one, state)
    replicated = jax.tree.map(lambda _: one, state)
    layout = "one device" if par.mode == "single" else ", ".join(f"{a}={s}" for a, s in mesh_shape(par.mesh).items())
    report = MemoryReport(
        layout,
        shard_bytes(state.params, shardings.params),
        shard_bytes(state.opt_state, shardings.opt_state),
        shard_bytes(state.params, replicated.params),
        shard_bytes(state.opt_state, replicated.opt_state),
    )
    if not compile:
        return report
    step = make_train_step(
        trainer.model, trainer.tx, freeze_backbone=trainer.optim.freeze_backbone, loss_options=trainer.cfg.loss_options
    )
    rows = par.layout.batch() if par.mode == "mesh" else one
    args = (
        abstract(state, shardings),
        {k: jax.ShapeDtypeStruct(np.shape(v), v.dtype, sharding=rows) for k, v in batch.items()},
    )
    try:
        m = (
            par.compile(step, like=state, options=trainer.model.plan.compiler_options(gradients=True))
            .lower(*args)
            .compile()
            .memory_analysis()
        )
    except NotImplementedError:  # memory analysis is optional per backend
        m = None
    if m is None:
        return report
    return dataclasses.replace(
        report,
        xla_arguments=int(m.argument_size_in_bytes),
        xla_outputs=int(m.output_size_in_bytes),
        xla_temp=int(m.temp_size_in_bytes),
        xla_aliased=int(m.alias_size_in_bytes),
    )
