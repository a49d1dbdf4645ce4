"""The training loop: :func:`fit` runs compiled steps over bucketed batches, evaluates, and tells
its callbacks what happened; when it evaluates is decided here and nowhere else.

Per training step, in this order: the step, the evaluation when one is due (every
``eval_every`` steps and at the last step; callbacks' ``on_evaluate``), then every callback's
``on_step_end``. After the last step: ``on_end``. A callback that acts on evaluations (such as
:class:`FitCheckpointing`, which saves with the metrics, for keep-best) therefore never
re-derives the evaluation cadence: it is called when fit evaluates.

The steps fit runs are :mod:`~flaxheads.training.trainer`'s (``TrainConfig``, ``Trainer``), the
callbacks :mod:`~flaxheads.training.callbacks`' and the log of its steps
:mod:`~flaxheads.training.step_log`'s; their names are importable from here too.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import jax
import numpy as np

from flaxheads.data.packing import iterate_packed_batches, padding_fraction
from flaxheads.data.splits import Split, iterate_batches
from flaxheads.data.streaming import StreamSplit, stream_batches
from flaxheads.errors import TrainingError
from flaxheads.runtime.parallel import Parallel
from flaxheads.training.callbacks import Callback, FitCheckpointing, changed_settings, flat_metrics, hooks
from flaxheads.training.step_log import TIMED, StepLog
from flaxheads.training.steps import TrainState
from flaxheads.training.trainer import TrainConfig, Trainer, abstract_state, steps_per_epoch, total_steps

__all__ = [
    "Callback",
    "FitCheckpointing",
    "FitResult",
    "TIMED",
    "TrainConfig",
    "Trainer",
    "abstract_state",
    "changed_settings",
    "fit",
    "flat_metrics",
    "hooks",
    "steps_per_epoch",
    "total_steps",
    "train_batches",
]


@dataclasses.dataclass
class FitResult:
    state: Any  # placed for the parallel mode; ``trainer.parallel.get_state(state)`` for host arrays
    step: int
    history: list[dict]
    train_compiles: int
    eval_compiles: int
    seconds: float  # the whole loop: steps, evaluations, callbacks (checkpoint saves)
    first_step_seconds: float | None = None  # from the call to the end of its first step (compile included)
    eval_seconds: float = 0.0  # of ``seconds``, spent evaluating
    throughput: dict = dataclasses.field(default_factory=dict)  # of the steps after the first (``StepLog.summary``)
    #: the arrays behind the evaluation at ``step`` ({split: arrays}, as ``Trainer.final`` gives): the
    #: trained params' predictions, so the caller need not predict those splits once more
    final_arrays: dict = dataclasses.field(default_factory=dict)


def _check_batch_sizes(cfg: TrainConfig, par: Parallel) -> None:
    if cfg.batch_size % par.width or cfg.eval_batch_size % par.width:
        raise TrainingError(
            f"batch sizes ({cfg.batch_size}, eval {cfg.eval_batch_size}) must be multiples of the "
            f"{par.width} data-parallel devices; change --batch-size/--eval-batch-size"
        )


def train_batches(trainer: Trainer, train: Split | StreamSplit | None = None) -> Callable[..., Iterable[dict]]:
    """The training batch iterator: the task's own (grouped data: ``flaxheads.tasks.ranking``), a streamed
    split's (``training.streaming``), ordinary bucketed batches, or the same batches packed (``cfg.pack``)."""
    own = trainer.task.train_batches()
    if own is not None:
        return own
    streamed = isinstance(train, StreamSplit)
    if not trainer.cfg.pack:
        return stream_batches if streamed else iterate_batches
    backbone = trainer.model.backbone
    if "packing" not in getattr(backbone, "features", ()):
        raise TrainingError(
            f"packing needs a backbone that keeps packed texts apart; the "
            f"{trainer.model.model_type} backbone does not: train without packing"
        )
    packed = partial(stream_batches, pack=True) if streamed else iterate_packed_batches
    return partial(packed, first_position=backbone.first_position(), row_multiple=trainer.parallel.width)


def fit(
    trainer: Trainer,
    train: Split,
    *,
    evals: Mapping[str, Split] | None = None,
    buckets: Sequence[int] = (128,),
    pad_id: int = 0,
    state: TrainState | None = None,
    start_step: int | None = None,
    callbacks: Sequence[Callback] = (),
    progress: bool = True,
    group_by_length: bool = True,
    consume_model: bool = False,
) -> FitResult:
    """Train ``trainer.model`` on ``train``; evaluate ``evals`` ({name: Split}) every
    ``cfg.eval_every`` steps (default: each epoch) and at the end.

    ``consume_model``: the state takes the model's device arrays as they are instead of a copy of
    them, so the devices hold the params once (a base near the device's size fits); the steps
    donate the state, so ``trainer.model.params`` are deleted by the first step: use the returned
    state's params.
    Resuming: pass the restored (host) ``state``; training continues at ``state.step`` (or
    ``start_step``) with exactly the batches and dropout keys an uninterrupted run would use.
    ``callbacks``: :class:`Callback` objects (see the module docstring for when each is called)."""
    entered = time.perf_counter()
    cfg, par = trainer.cfg, trainer.parallel
    _check_batch_sizes(cfg, par)
    batches = train_batches(trainer, train)
    spe = steps_per_epoch(len(train), cfg.batch_size)
    total = total_steps(len(train), cfg)
    eval_every = cfg.eval_every or spe
    host_state = trainer.init_state() if state is None else state
    step = int(np.asarray(jax.device_get(host_state.step))) if start_step is None else int(start_step)
    placed = par.put_state(host_state, reuse=consume_model)
    history: list[dict] = []
    log = StepLog(cfg.log_every, total, step, progress, trainer.peak_flops())

    eval_seconds = 0.0
    first_step_seconds: float | None = None
    arrays: dict = {}

    def evaluate(s: int) -> None:
        nonlocal eval_seconds
        t = time.perf_counter()
        if s == total:  # the last evaluation keeps its arrays (FitResult.final_arrays)
            both = {
                name: trainer.final(placed.params, split, buckets=buckets, pad_id=pad_id)
                for name, split in (evals or {}).items()
            }
            results = {name: r for name, (r, _) in both.items()}
            arrays.update({name: a for name, (_, a) in both.items()})
        else:
            results = {
                name: trainer.evaluate(placed.params, split, buckets=buckets, pad_id=pad_id)
                for name, split in (evals or {}).items()
            }
        eval_seconds += time.perf_counter() - t
        log.pause(time.perf_counter() - t)
        if results:
            history.append({"step": s, "eval": results})
            for cb in callbacks:
                cb.on_evaluate(placed, s, results)

    t0 = time.perf_counter()
    evaluated = None
    for cb in callbacks:
        cb.on_begin(placed, step)
    while step < total:
        epoch, offset = divmod(step, spe)
        for batch in batches(
            train,
            cfg.batch_size,
            buckets,
            seed=cfg.seed,
            epoch=epoch,
            start=offset,
            pad_id=pad_id,
            group_by_length=group_by_length,
        ):
            with jax.profiler.StepTraceAnnotation("train", step_num=step + 1):  # a profile's step markers
                placed, m = trainer.step(placed, batch)  # m holds host values: the step has finished
            if first_step_seconds is None:
                first_step_seconds = time.perf_counter() - entered
            step, offset = step + 1, offset + 1
            m.update(
                step=step,
                epoch=epoch + offset / spe,
                padding=padding_fraction(batch),
                tokens=int(np.size(batch["input_ids"])),
                flops=trainer.flops.of_batch(batch) if trainer.flops is not None else 0.0,
            )
            entry = log.step(m, step)
            if entry is not None:
                history.append(entry)
            if step % eval_every == 0 or step == total:
                evaluate(step)
                evaluated = step
            for cb in callbacks:
                cb.on_step_end(placed, step, m)
            if step >= total:
                break
    log.close()
    if evaluated != step:  # resumed at the last step: nothing ran, evaluate what was restored
        evaluate(step)
    for cb in callbacks:
        cb.on_end(placed, step)
    return FitResult(
        placed,
        step,
        history,
        trainer.train_traces.count,
        trainer.eval_traces.count,
        time.perf_counter() - t0,
        first_step_seconds,
        eval_seconds,
        log.summary(),
        arrays,
    )
