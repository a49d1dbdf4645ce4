"""The training loop: :func:`fit` runs compiled steps over bucketed batches, evaluates, and tells
its callbacks what happened; when it evaluates is decided here and nowhere else.

Per training step, in this order: the step, the evaluation when one is due (every
``eval_every`` steps and at the last step; callbacks' ``on_evaluate``), then every callback's
``on_step_end``. After the last step: ``on_end``. A callback that acts on evaluations (such as
:class:`FitCheckpointing`, which saves with the metrics, for keep-best) therefore never
re-derives the evaluation cadence: it is called when fit evaluates.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import jax
import numpy as np
import optax
from tqdm.auto import tqdm

from flaxheads.data.batching import predict_batches
from flaxheads.errors import TrainingError
from flaxheads.runtime.parallel import DATA_AXIS, Parallel
from flaxheads.training.programs import TraceCounter, make_eval_step
from flaxheads.data.splits import Split, iterate_batches
from flaxheads.training.flops import StepFlops, peak_flops
from flaxheads.training.optim import OptimConfig, make_optimizer
from flaxheads.data.packing import iterate_packed_batches, padding_fraction
from flaxheads.training.steps import TrainState, create_state, make_train_step
from flaxheads.tasks.task import Classification, Task
from flaxheads.data.streaming import StreamSplit, stream_batches

if TYPE_CHECKING:  # annotation only: the checkpoint package does not depend on training
    from flaxheads.checkpoint import RunCheckpointer


@dataclasses.dataclass
class TrainConfig:
    """Loop settings (every field is a CLI flag of ``train``)."""

    epochs: float = 3.0
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
    pack: bool = False  # pack short training texts into shared rows (see training/packing.py)


def abstract_state(model, tx: optax.GradientTransformation, optim: OptimConfig, cfg: TrainConfig) -> TrainState:
    """The shapes of a fresh train state (``jax.eval_shape``; works on abstract ``model.params``)."""
    return jax.eval_shape(lambda p: create_state(p, tx, freeze_backbone=optim.freeze_backbone, seed=cfg.seed),
                          model.params)


def steps_per_epoch(n: int, batch_size: int) -> int:
    """Batches in one pass over ``n`` examples (the last one padded; at least one)."""
    return max(math.ceil(n / batch_size), 1)


def total_steps(n: int, cfg: TrainConfig) -> int:
    """Micro-steps of a run on ``n`` training examples: ``max_steps``, else ``epochs`` passes."""
    spe = steps_per_epoch(n, cfg.batch_size)
    return int(cfg.max_steps) if cfg.max_steps else max(int(math.ceil(cfg.epochs * spe)), 1)


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
    def build(cls, model, optim: OptimConfig, cfg: TrainConfig, parallel: Parallel | None = None, *,
              task: Task | None = None) -> "Trainer":
        """Compile the steps. ``task`` defaults to the model's own classification task."""
        task = task if task is not None else Classification.of(model, cfg.threshold)
        task.check(model, pack=cfg.pack)
        parallel = (parallel or Parallel.from_config(cfg.parallel, cfg.mesh)).bind(model)
        tx = make_optimizer(optim, fold_reductions=model.plan.fold_reductions)
        axis = DATA_AXIS if parallel.mode == "pmap" else None
        tt, et = TraceCounter(), TraceCounter()
        step = make_train_step(model, tx, freeze_backbone=optim.freeze_backbone, loss_options=cfg.loss_options,
                               axis_name=axis, loss=task.step_loss(model, cfg.loss_options))
        like = abstract_state(model, tx, optim, cfg)
        return cls(model, optim, cfg, parallel, tx, parallel.compile(tt.wrap(step), like=like,
                                                                     options=model.plan.compiler_options(gradients=True)),
                   parallel.compile(et.wrap(make_eval_step(model)), donate=False, like=like.params), tt, et, task,
                   _step_flops(model, optim))

    def peak_flops(self) -> float | None:
        """The dense peak FLOP/s of the devices the step runs on (None: unknown, e.g. CPUs)."""
        one = peak_flops(jax.devices()[0].device_kind, self.model.plan.precision.name)
        return None if one is None else one * self.parallel.width

    def init_state(self, params: dict | None = None) -> TrainState:
        return create_state(self.model.params if params is None else params, self.tx,
                            freeze_backbone=self.optim.freeze_backbone, seed=self.cfg.seed)

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
        logits, kept = predict_batches(lambda b: par.get_rows(self.eval_step(params, par.put_rows(b))), batches,
                                       keys=("labels",))
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


class Callback:
    """What :func:`fit` calls; override any of these (the defaults do nothing). ``state`` is
    placed for the parallel mode (``trainer.parallel.get_state`` gives host arrays); ``step`` is
    the number of steps done."""

    def on_begin(self, state, step: int) -> None:
        """Before the first step this call of fit runs (``step`` steps are done already)."""

    def on_evaluate(self, state, step: int, results: dict[str, dict]) -> None:
        """After an evaluation: ``results`` is ``{split name: metrics}``."""

    def on_step_end(self, state, step: int, metrics: dict) -> None:
        """After every step, once that step's evaluation (if any) has been reported."""

    def on_end(self, state, step: int) -> None:
        """After the last step and its evaluation."""


class _Hooks(Callback):
    def __init__(self, on_step_end, on_evaluate, on_end):
        self._fns = {"on_step_end": on_step_end, "on_evaluate": on_evaluate, "on_end": on_end}

    def on_step_end(self, state, step, metrics):
        self._call("on_step_end", state, step, metrics)

    def on_evaluate(self, state, step, results):
        self._call("on_evaluate", state, step, results)

    def on_end(self, state, step):
        self._call("on_end", state, step)

    def _call(self, name, *args):
        if self._fns[name] is not None:
            self._fns[name](*args)


def hooks(*, on_step_end: Callable | None = None, on_evaluate: Callable | None = None,
          on_end: Callable | None = None) -> Callback:
    """A :class:`Callback` from plain functions with the methods' signatures."""
    return _Hooks(on_step_end, on_evaluate, on_end)


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
    throughput: dict = dataclasses.field(default_factory=dict)  # of the steps after the first (``_Log.summary``)
    #: the arrays behind the evaluation at ``step`` ({split: arrays}, as ``Trainer.final`` gives): the
    #: trained params' predictions, so the caller need not predict those splits once more
    final_arrays: dict = dataclasses.field(default_factory=dict)


class _Log:
    """Throughput (examples, tokens, model FLOPs per second, MFU) and mean loss over the steps since
    the last log line, the whole run's throughput, and the progress bar. Evaluation time is left
    out of both; the run's totals also leave out the first step of the call (its compile)."""

    def __init__(self, every: int, total: int, start: int, progress: bool, peak: float | None = None):
        self.every, self.total, self.peak = every, total, peak
        self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, smoothing=0.1) \
            if progress and jax.process_index() == 0 else None
        self.last = time.perf_counter()
        self.window = self._zero()
        self.run, self.run_seconds = self._zero(), 0.0
        self.prev: float | None = None  # when the previous step ended (pauses added)
        self.losses: list[float] = []

    @staticmethod
    def _zero() -> dict:
        return {"examples": 0.0, "tokens": 0.0, "flops": 0.0, "steps": 0}

    def pause(self, seconds: float) -> None:
        """Leave ``seconds`` (an evaluation) out of the rates."""
        self.last += seconds
        if self.prev is not None:
            self.prev += seconds

    def rates(self, totals: dict, seconds: float) -> dict:
        """examples / tokens / model TFLOP/s, seconds per step and MFU (where the peak is known)."""
        s = max(seconds, 1e-9)
        out = {"examples_per_s": totals["examples"] / s, "tokens_per_s": totals["tokens"] / s,
               "step_seconds": s / max(totals["steps"], 1)}
        if totals["flops"]:
            out["model_tflops_per_s"] = totals["flops"] / s / 1e12
            if self.peak:
                out["mfu"] = totals["flops"] / s / self.peak
        return out

    def step(self, m: dict, step: int) -> dict | None:
        """Adds the window's rates and ``loss_avg`` to ``m`` on a log step; returns the history entry."""
        now = time.perf_counter()
        # the first step of the call (its compile) is left out of the run's rates
        for totals in (self.window, self.run) if self.prev is not None else (self.window,):
            totals["examples"] += m["weight"]
            totals["tokens"] += m.get("tokens", 0)
            totals["flops"] += m.get("flops", 0.0)
            totals["steps"] += 1
        if self.prev is not None:
            self.run_seconds += now - self.prev
        self.prev = now
        self.losses.append(m["loss"])
        entry = None
        if step % self.every == 0 or step == self.total:
            m.update(self.rates(self.window, now - self.last))
            m["loss_avg"] = float(np.mean(self.losses))
            self.last, self.window, self.losses = now, self._zero(), []
            entry = {"step": step, "epoch": m["epoch"], "loss": m["loss_avg"], "step_loss": m["loss"],
                     "grad_norm": m["grad_norm"], **{k: m[k] for k in TIMED if k in m}}
            if self.bar is not None:
                extra = {"tok_s": f"{m['tokens_per_s']:.0f}"} | ({"mfu": f"{m['mfu']:.1%}"} if "mfu" in m else {})
                self.bar.set_postfix(loss=f"{m['loss']:.4f}", ex_s=f"{m['examples_per_s']:.1f}", **extra,
                                     ep=f"{m['epoch']:.2f}")
        if self.bar is not None:
            self.bar.update(1)
        return entry

    def summary(self) -> dict:
        """The rates of the steps after the first of this call ({} when there were none)."""
        if not self.run["steps"]:
            return {}
        out = {k: float(f"{v:.6g}") for k, v in self.rates(self.run, self.run_seconds).items()}
        out["steps_timed"] = self.run["steps"]
        if self.run["flops"] and self.run["tokens"]:
            out["model_flops_per_token"] = round(self.run["flops"] / self.run["tokens"])
        if self.peak:
            out["peak_tflops"] = self.peak / 1e12
        return out

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


#: The wall-clock keys of a log entry (they differ between two runs of the same settings).
TIMED = ("examples_per_s", "tokens_per_s", "step_seconds", "model_tflops_per_s", "mfu")


def _check_batch_sizes(cfg: TrainConfig, par: Parallel) -> None:
    if cfg.batch_size % par.width or cfg.eval_batch_size % par.width:
        raise TrainingError(f"batch sizes ({cfg.batch_size}, eval {cfg.eval_batch_size}) must be multiples of the "
                            f"{par.width} data-parallel devices; change --batch-size/--eval-batch-size")


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
        raise TrainingError(f"packing needs a backbone that keeps packed texts apart; the "
                            f"{trainer.model.model_type} backbone does not: train without packing")
    packed = partial(stream_batches, pack=True) if streamed else iterate_packed_batches
    return partial(packed, first_position=backbone.first_position(), row_multiple=trainer.parallel.width)


def fit(trainer: Trainer, train: Split, *, evals: Mapping[str, Split] | None = None,
        buckets: Sequence[int] = (128,), pad_id: int = 0, state: TrainState | None = None,
        start_step: int | None = None, callbacks: Sequence[Callback] = (), progress: bool = True,
        group_by_length: bool = True, consume_model: bool = False) -> FitResult:
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
    log = _Log(cfg.log_every, total, step, progress, trainer.peak_flops())

    timing = {"eval": 0.0, "first": None}
    arrays: dict = {}

    def evaluate(s: int) -> None:
        t = time.perf_counter()
        if s == total:  # the last evaluation keeps its arrays (FitResult.final_arrays)
            both = {name: trainer.final(placed.params, split, buckets=buckets, pad_id=pad_id)
                    for name, split in (evals or {}).items()}
            results = {name: r for name, (r, _) in both.items()}
            arrays.update({name: a for name, (_, a) in both.items()})
        else:
            results = {name: trainer.evaluate(placed.params, split, buckets=buckets, pad_id=pad_id)
                       for name, split in (evals or {}).items()}
        timing["eval"] += time.perf_counter() - t
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
        for batch in batches(train, cfg.batch_size, buckets, seed=cfg.seed, epoch=epoch, start=offset,
                             pad_id=pad_id, group_by_length=group_by_length):
            with jax.profiler.StepTraceAnnotation("train", step_num=step + 1):  # a profile's step markers
                placed, m = trainer.step(placed, batch)  # m holds host values: the step has finished
            if timing["first"] is None:
                timing["first"] = time.perf_counter() - entered
            step, offset = step + 1, offset + 1
            m.update(step=step, epoch=epoch + offset / spe, padding=padding_fraction(batch),
                     tokens=int(np.size(batch["input_ids"])),
                     flops=trainer.flops.of_batch(batch) if trainer.flops is not None else 0.0)
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
    return FitResult(placed, step, history, trainer.train_traces.count, trainer.eval_traces.count,
                     time.perf_counter() - t0, timing["first"], timing["eval"], log.summary(), arrays)


# ---- checkpoints during fit ------------------------------------------------------------------

def flat_metrics(results: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """``{"validation": {"accuracy": 0.9, ...}}`` -> ``{"validation/accuracy": 0.9, ...}`` (scalars only)."""
    return {f"{split}/{k}": float(v) for split, r in results.items() for k, v in r.items()
            if isinstance(v, (int, float, np.number)) and not isinstance(v, bool)}


class FitCheckpointing(Callback):
    """Saves a :func:`fit` run through a :class:`~flaxheads.checkpoint.RunCheckpointer`: at every
    evaluation fit makes (with its metrics, for keep-best), every ``every`` steps (None:
    evaluations and the end only; 0: never) and at the end. Each step is saved once.

    ``host_state`` turns the placed state into a saveable one (``parallel.get_state`` under
    pmap, whose state has a leading device axis); None saves it as placed (single device or
    mesh-replicated arrays, copied asynchronously)."""

    def __init__(self, ckr: RunCheckpointer, *, every: int | None = None,
                 host_state: Callable | None = None):
        self.ckr, self.every, self.host_state = ckr, every, host_state
        self.saved: list[int] = []

    def on_evaluate(self, state, step: int, results) -> None:
        if self.every != 0:
            m = flat_metrics(results)
            if self.ckr.best_metric is not None and self.ckr.best_metric not in m:
                raise KeyError(f"best metric {self.ckr.best_metric!r} is not among the evaluation metrics "
                               f"{sorted(m)}")
            self._save(state, step, m)

    def on_step_end(self, state, step: int, metrics=None) -> None:
        if self.every and step % self.every == 0:
            self._save(state, step)

    def on_end(self, state, step: int) -> None:
        if self.every != 0:
            self._save(state, step)

    def _save(self, state, step: int, metrics=None) -> None:
        # saved already: at this step's evaluation, or before a run resumed at this very step
        if step in self.saved or step in self.ckr.all_steps():
            return
        self.ckr.save(step, state if self.host_state is None else self.host_state(state), metrics=metrics)
        self.saved.append(step)


def changed_settings(saved: Mapping[str, Any] | None, current: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Keys whose values differ between a checkpoint's recorded run settings and the current ones."""
    out = []
    saved = saved or {}
    for k in sorted(set(saved) | set(current)):
        a, b = saved.get(k), current.get(k)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += changed_settings(a, b, f"{prefix}{k}.")
        elif json.dumps(a, default=str, sort_keys=True) != json.dumps(b, default=str, sort_keys=True):
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out
