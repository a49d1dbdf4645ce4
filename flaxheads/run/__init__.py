"""A training run as one library call: ``fh.train(RunSpec(...))`` or ``fh.train(model=..., data=...)``.

:mod:`~flaxheads.run.spec` (the :class:`RunSpec`), :mod:`~flaxheads.run.checks` (conflicts refused
before any work), :mod:`~flaxheads.run.data` (in memory, streamed or grouped), the program
(:mod:`~flaxheads.run.program`: the spec resolved once into a :mod:`~flaxheads.run.job`, then run),
:mod:`~flaxheads.run.finetune` (the trainer, ``fit``), :mod:`~flaxheads.run.checkpoints` (resume,
keep-best), :mod:`~flaxheads.run.folder` (the run folder's files) and :mod:`~flaxheads.run.cached`
(heads on cached features, the sweep). The ``flaxheads train`` command parses its flags into a
spec and calls :func:`train`.
"""

from flaxheads.run.job import Run
from flaxheads.run.program import train
from flaxheads.run.spec import CheckpointSpec, DataSpec, DeviceSpec, ModelSpec, OptimSpec, RunSpec, TaskSpec

__all__ = ["Run", "RunSpec", "ModelSpec", "DataSpec", "TaskSpec", "OptimSpec", "CheckpointSpec", "DeviceSpec", "train"]
