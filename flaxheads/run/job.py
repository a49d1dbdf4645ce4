"""What a :class:`~flaxheads.run.spec.RunSpec` resolves to, once (:class:`Job`: the data, model, task
and the library's settings, made by :func:`flaxheads.run.program.prepare`), what a run returns
(:class:`Run`) and the ``config.json`` that records every resolved setting."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from flaxheads._version import __version__
from flaxheads.data.splits import SPLITS
from flaxheads.model.sequence import SequenceModel
from flaxheads.run.data import RunData
from flaxheads.run.report_data import label_counts
from flaxheads.run.spec import RunSpec
from flaxheads.runtime.precision import Precision
from flaxheads.tasks.task import Task
from flaxheads.training.optim import OptimConfig, count_params
from flaxheads.training.trainer import TrainConfig, Trainer


@dataclasses.dataclass
class Job:
    """What a spec resolves to: data, model, task and the settings the library takes. ``steps`` is
    the run's length in micro-steps (fit's, or the cached heads'), which ``optim``'s schedule spans."""

    spec: RunSpec
    model_path: str
    model: SequenceModel
    task: Task
    data: RunData
    splits: dict[str, Any]
    buckets: tuple[int, ...]
    max_length: int
    pad_id: int
    out: Path
    train: TrainConfig
    optim: OptimConfig
    steps: int
    best_metric: str | None
    precision: Precision
    report_to: tuple[str, ...]  # where the log goes (``run.reporters``)
    pack_share: float | None = None  # packed token slots over padded ones, where the run packs


@dataclasses.dataclass
class Run:
    """A finished run: its spec, summary (``summary.json``), trained model and folder."""

    spec: RunSpec
    summary: dict
    model: SequenceModel
    folder: Path

    @property
    def metrics(self) -> dict[str, dict]:
        """The final metrics per split (validation and test)."""
        return self.summary["metrics"]


def split_counts(splits: dict) -> str:
    """``"36 train / 6 validation / 0 test"``: every split, 0 for one the run does not have."""
    return " / ".join(f"{len(splits[n]) if n in splits else 0} {n}" for n in SPLITS)


def run_config(job: Job, trainer: Trainer | None = None, argv: Sequence[str] | None = None) -> dict:
    """Every resolved setting of the run (its ``config.json``), with the spec that made it;
    ``trainer`` None: heads on cached features, one device."""
    model, spec = job.model, job.spec
    width, mesh = (1, None) if trainer is None else (trainer.parallel.width, trainer.parallel.mesh)
    return {
        "model": job.model_path,
        **job.task.config_keys(job.splits),
        "pooler": spec.model.pooler,
        "head": spec.model.head,
        "head_config": model.head_config(),
        "problem_type": model.problem_type,
        "labels": None if job.data.space is None else job.data.space.names,
        "num_labels": model.num_labels,
        "bf16": job.precision.name == "bfloat16",
        "precision": dataclasses.asdict(job.precision),
        "compute_plan": model.plan.describe(),
        "max_length": job.max_length,
        "buckets": list(job.buckets),
        "data": job.data.config,
        "sizes": {n: len(s) for n, s in job.splits.items()},
        "label_counts": label_counts(job.data),
        "headline": job.task.headline,
        "train": dataclasses.asdict(job.train),
        "optimizer": dataclasses.asdict(job.optim),
        "checkpoints": {
            "keep": spec.checkpoints.keep,
            "best_metric": job.best_metric,
            "every": spec.checkpoints.checkpoint_every,
        },
        "devices": {
            "parallel": job.train.parallel,
            "count": jax.device_count(),
            "width": width,
            "processes": jax.process_count(),
            "platform": jax.devices()[0].platform,
            **({"mesh": dict(mesh.shape)} if mesh is not None else {}),
        },
        "lora": None if model.lora is None else model.lora.to_dict(),
        "params": {k: count_params(v) for k, v in model.params.items()},
        "spec": spec.replace(output_dir=str(job.out)).to_dict(),
        "argv": list(argv) if argv is not None else None,
        "flaxheads_version": __version__,
    }
