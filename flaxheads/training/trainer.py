"""What :func:`~flaxheads.training.loop.fit` runs: the loop's settings (:class:`TrainConfig`, and the
length of a run they give) and :class:`Trainer`, the compiled train and eval steps of one model,
optimizer, parallel mode and :class:`~flaxheads.tasks.task.Task`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np
import optax

from flaxheads.data.batching import predict_batches
from flaxheads.runtime.parallel import DATA_AXIS, Parallel
from flaxheads.tasks.task import Classification, Task
from flaxheads.training.flops import StepFlops, peak_flops
from flaxheads.training.optim import OptimConfig, make_optimizer
from flaxheads.training.programs import TraceCounter, make_eval_step
from flaxheads.training.steps import TrainState, create_state, make_train_step


@dataclasses.dataclass
class TrainConfig:
    """Loop settings. The defaults are a run's (``RunSpec()``, ``flaxheads train`` without flags)."""

    epochs: float = 2.0
    batch_size: int = 16  # global, per micro-step
    eval_batch_size: int = 64
    max_steps: int | None = None  # micro-steps; overrides epochs
    eval_every: int | None = None  # micro-steps between evaluations (None: once per epoch)
    log_every: int = 10
    seed: int = 0
    parallel: str = "single"
    mesh: str | None = None  # mesh shape, e.g. "data=2,fsdp=4" (implies parallel="mesh")
    loss_options: dict = dataclasses.field(default_factory=dict)
    threshold: float = 0.5  # multi-label decision threshold for metrics
    pack: bool = False  # pack short training texts into shared rows (see data/packing.py)


def steps_per_epoch(n: int, batch_size: int) -> int:
    """Batches in one pass over ``n`` examples (the last one padded; at least one)."""
    return max(math.ceil(n / batch_size), 1)


def total_steps(n: int, cfg: TrainConfig) -> int:
    """Micro-steps of a run on ``n`` training examples: ``max_steps``, else ``epochs`` passes."""
    spe = steps_per_epoch(n, cfg.batch_size)
    return int(cfg.max_steps) if cfg.max_steps else max(int(math.ceil(cfg.epochs * spe)), 1)


def abstract_state(model, tx: optax.GradientTransformation, optim: OptimConfig, cfg: TrainConfig) -> TrainState:
    """The shapes of a fresh train state (``jax.eval_shape``; works on abstract ``model.params``)."""
    return jax.eval_shape(
        lambda p: create_state(p, tx, freeze_backbone=optim.freeze_backbone, seed=cfg.seed), model.params
    )


@dataclasses.dataclass
class Trainer:
    """Compiled steps for one model/optimizer/parallel mode and one :class:`~flaxheads.tasks.task.Task`
    (build once, reuse)."""

    model: Any
    optim: OptimConfig
    cfg: TrainConfig
    parallel: Parallel
    tx: optax.GradientTransformation
    train_step: Callable
    eval_step: Callable
    train_traces: TraceCounter
    eval_traces: TraceCounter
    task: Task
    flops: StepFlops | None = None  # model FLOPs of a step (None: the backbone's config has no sizes to count)

    @classmethod
    def build(
        cls, model, optim: OptimConfig, cfg: TrainConfig, parallel: Parallel | None = None, *, task: Task | None = None
    ) -> Trainer:
        """Compile the steps. ``task`` defaults to the model's own classification task."""
        task = task if task is not None else Classification.of(model, cfg.threshold)
        task.check(model, pack=cfg.pack)
        parallel = (parallel or Parallel.from_config(cfg.parallel, cfg.mesh)).bind(model)
        tx = make_optimizer(optim, fold_reductions=model.plan.fold_reductions)
        axis = DATA_AXIS if parallel.mode == "pmap" else None
        tt, et = TraceCounter(), TraceCounter()
        step = make_train_step(
            model,
            tx,
            freeze_backbone=optim.freeze_backbone,
            loss_options=cfg.loss_options,
            axis_name=axis,
            loss=task.step_loss(model, cfg.loss_options),
        )
        like = abstract_state(model, tx, optim, cfg)
        return cls(
            model,
            optim,
            cfg,
            parallel,
            tx,
            parallel.compile(tt.wrap(step), like=like, options=model.plan.compiler_options(gradients=True)),
            parallel.compile(et.wrap(make_eval_step(model)), donate=False, like=like.params),
            tt,
            et,
            task,
            _step_flops(model, optim),
        )

    def peak_flops(self) -> float | None:
        """The dense peak FLOP/s of the devices the step runs on (None: unknown, e.g. CPUs)."""
        one = peak_flops(jax.devices()[0].device_kind, self.model.plan.precision.name)
        return None if one is None else one * self.parallel.width

    def init_state(self, params: dict | None = None) -> TrainState:
        return create_state(
            self.model.params if params is None else params,
            self.tx,
            freeze_backbone=self.optim.freeze_backbone,
            seed=self.cfg.seed,
        )

    def abstract_state(self) -> TrainState:
        """The shapes of :meth:`init_state` (``jax.eval_shape``; nothing allocated)."""
        return abstract_state(self.model, self.tx, self.optim, self.cfg)

    def step(self, state, batch: dict):
        """One placed step; blocks on its result (queued jit+mesh steps on CPU devices can
        deadlock in XLA's collectives, and the loop logs the loss anyway)."""
        state, metrics = self.train_step(state, self.parallel.put_rows(batch))
        return state, {k: float(v) for k, v in self.parallel.get(metrics).items()}

    def predict(self, params, batches: Iterable[dict]) -> tuple[np.ndarray, np.ndarray]:
        """Logits and labels of every real example (weight > 0), in order, each exactly once.
        ``params`` must be placed for the parallel mode (``parallel.put_state``)."""
        par = self.parallel
        logits, kept = predict_batches(
            lambda b: par.get_rows(self.eval_step(params, par.put_rows(b))), batches, keys=("labels",)
        )
        if logits is None:
            return np.zeros((0, self.model.num_labels), np.float32), np.zeros((0,))
        return logits, kept["labels"]

    def evaluate(self, params, split, *, buckets: Sequence[int], pad_id: int = 0) -> dict:
        """The task's metrics of ``params`` (placed) on every example of ``split``."""
        return self.task.evaluate(self, params, split, buckets=buckets, pad_id=pad_id)

    def final(self, params, split, *, buckets: Sequence[int], pad_id: int = 0) -> tuple[dict, dict]:
        """The task's metrics of ``split`` and the arrays behind them (predictions to keep)."""
        return self.task.final(self, params, split, buckets=buckets, pad_id=pad_id)


def _step_flops(model, optim: OptimConfig) -> StepFlops | None:
    try:
        return StepFlops.of(model, frozen=optim.freeze_backbone)
    except (KeyError, AttributeError, TypeError, ValueError):  # a config without the sizes: no MFU
        return None
