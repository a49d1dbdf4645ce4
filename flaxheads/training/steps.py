"""Pure-functional training: ``TrainState``, ``train_step``/``eval_step``, data parallel
via ``pmap`` or ``jit`` over a device ``Mesh`` (single- or multi-host), and ``fit``, the loop.

* ``train_step(state, batch) -> (state, metrics)`` is pure; the dropout key of step ``s`` is
  ``jax.random.fold_in(state.rng, s)``, so a run resumed at step k repeats an uninterrupted one.
* A batch is a dict of arrays: ``input_ids``, ``attention_mask`` [B, T], ``labels``,
  ``weights`` [B] (0 for padding rows), optionally ``token_type_ids``.
* The loss of a data-parallel step is the *global* weighted mean (sum of weighted losses over
  all devices / global weight), so 1, pmap-N and mesh-N devices give the same numbers even when
  the padded last batch puts all its padding on one device.
* A frozen backbone is never differentiated: its features are computed in inference mode and
  only the head params are arguments of ``jax.grad``; the optimizer state covers the head only.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..losses import REGRESSION, SINGLE_LABEL
from .optim import OptimConfig, make_optimizer, merge, trainable

DATA_AXIS = "data"
PARALLEL_MODES = ("single", "pmap", "mesh")


class TrainState(struct.PyTreeNode):
    """Everything a training run carries between steps (a pytree; checkpoint it as is).

    ``step``: number of ``train_step`` calls so far (micro-steps when accumulating);
    ``params``: ``{"backbone": ..., "head": ...}``; ``opt_state``: optax state of the trainable
    subtree (``{"head"}`` only with a frozen backbone); ``rng``: base dropout key."""

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array


def create_state(params: dict, tx: optax.GradientTransformation, *, freeze_backbone: bool = False,
                 seed: int = 0) -> TrainState:
    """A fresh state at step 0 (optimizer initialised on the trainable subtree only)."""
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=tx.init(trainable(params, freeze_backbone)), rng=jax.random.PRNGKey(seed))


def step_key(state: TrainState, axis_name: str | None = None) -> jax.Array:
    """Dropout key of this step: folded from the step number (and the device index under pmap)."""
    key = jax.random.fold_in(state.rng, state.step)
    if axis_name is not None:
        key = jax.random.fold_in(key, jax.lax.axis_index(axis_name))
    return key


def loss_denominator(problem_type: str, labels, weights, class_weights=None) -> jax.Array:
    """The normaliser of :mod:`flaxheads.losses` for this batch (summed example weight, or summed
    class weight of the targets for class-weighted cross-entropy)."""
    w = weights.astype(jnp.float32)
    if problem_type == SINGLE_LABEL and class_weights is not None:
        return jnp.sum(jnp.asarray(class_weights, jnp.float32)[labels] * w)
    return jnp.sum(w)


def _extra(batch: dict) -> dict:
    return {k: batch[k] for k in ("token_type_ids",) if k in batch}


def _apply_grads(state, tx, trained, objective, denom_local, axis_name):
    """Differentiate ``objective(trained)`` (a locally normalised loss), combine across devices
    as a globally weighted mean, update. Returns (new trained subtree, opt_state, metrics)."""
    if axis_name is None:
        loss, grads = jax.value_and_grad(objective)(trained)
        total = denom_local
    else:
        total = jax.lax.psum(denom_local, axis_name)
        scale = denom_local / jnp.maximum(total, 1e-12)
        loss, grads = jax.value_and_grad(lambda t: objective(t) * scale)(trained)
        loss, grads = jax.lax.psum((loss, grads), axis_name)
    updates, opt_state = tx.update(grads, state.opt_state, trained)
    trained = optax.apply_updates(trained, updates)
    return trained, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), "weight": total}


def make_train_step(model, tx: optax.GradientTransformation, *, freeze_backbone: bool = False,
                    loss_options: dict | None = None, axis_name: str | None = None) -> Callable:
    """``train_step(state, batch) -> (state, metrics)`` (not jitted; see :func:`jit_train_step`).

    ``axis_name`` is the pmap axis to reduce over (None for one device or for jit over a mesh,
    where the computation is written globally and XLA inserts the collectives)."""
    if freeze_backbone:
        # the backbone only runs forward, outside the differentiated function: the head step on its features
        head_step = make_head_train_step(model, tx, loss_options=loss_options, axis_name=axis_name)

        def frozen_step(state: TrainState, batch: dict):
            hidden, pmask = model.features(state.params["backbone"], batch["input_ids"], batch["attention_mask"],
                                           train=False, **_extra(batch))
            return head_step(state, {"hidden": jax.lax.stop_gradient(hidden), "pool_mask": pmask,
                                     "labels": batch["labels"], "weights": batch["weights"]})

        return frozen_step

    loss_options = dict(loss_options or {})
    lf = model.loss_fn(**loss_options)
    cw = loss_options.get("class_weights")

    def train_step(state: TrainState, batch: dict):
        key = step_key(state, axis_name)
        labels, weights = batch["labels"], batch["weights"]
        denom = loss_denominator(model.problem_type, labels, weights, cw)

        def objective(t):
            logits = model.apply(merge(state.params, t), batch["input_ids"], batch["attention_mask"],
                                 train=True, dropout_rng=key, **_extra(batch))
            return lf(logits, labels, weights)

        trained, opt_state, metrics = _apply_grads(state, tx, trainable(state.params, False), objective, denom,
                                                   axis_name)
        new = state.replace(step=state.step + 1, params=merge(state.params, trained), opt_state=opt_state)
        return new, metrics

    return train_step


def make_head_train_step(model, tx: optax.GradientTransformation, *, loss_options: dict | None = None,
                         axis_name: str | None = None) -> Callable:
    """``head_train_step(state, batch) -> (state, metrics)`` on precomputed backbone features.

    ``batch`` holds ``hidden`` [B, T, H] (or any features the pooler takes), ``pool_mask`` [B, T],
    ``labels``, ``weights``. The state's optimizer must be built with ``freeze_backbone=True``;
    ``params["backbone"]`` is carried along untouched (it may be an empty dict)."""
    loss_options = dict(loss_options or {})
    lf = model.loss_fn(**loss_options)
    cw = loss_options.get("class_weights")

    def head_train_step(state: TrainState, batch: dict):
        key = step_key(state, axis_name)
        labels, weights = batch["labels"], batch["weights"]
        denom = loss_denominator(model.problem_type, labels, weights, cw)

        def objective(t):
            return lf(model.head_apply(t["head"], batch["hidden"], batch["pool_mask"], train=True, dropout_rng=key),
                      labels, weights)

        trained, opt_state, metrics = _apply_grads(state, tx, {"head": state.params["head"]}, objective, denom,
                                                   axis_name)
        return state.replace(step=state.step + 1, params=merge(state.params, trained), opt_state=opt_state), metrics

    return head_train_step


def make_eval_step(model) -> Callable:
    """``eval_step(params, batch) -> logits`` [B, N] float32, inference mode."""
    def eval_step(params, batch):
        return model.apply(params, batch["input_ids"], batch["attention_mask"], train=False, **_extra(batch))
    return eval_step


class TraceCounter:
    """Counts how often a function is traced (= compiled, for a jitted function): one per new
    input shape. ``wrap(fn)`` returns the counting function to hand to ``jax.jit``."""

    def __init__(self) -> None:
        self.count = 0
        self.shapes: list[tuple] = []

    def wrap(self, fn: Callable) -> Callable:
        def counted(*args):
            self.count += 1
            self.shapes.append(tuple(np.shape(x) for x in jax.tree.leaves(args[-1])[:1]))
            return fn(*args)
        counted.__name__ = getattr(fn, "__name__", "step")
        return counted


# ---- data-parallel plumbing ------------------------------------------------------------------

def make_mesh(devices=None) -> Mesh:
    """A 1-D mesh over all (global) devices with axis ``data``."""
    devs = np.asarray(jax.devices() if devices is None else devices)
    return Mesh(devs.reshape(-1), (DATA_AXIS,))


def _host_leaf(x):
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
            raise ValueError(f"parallel mode must be one of {PARALLEL_MODES}, got {self.mode!r}")
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
            from flax.jax_utils import replicate
            return replicate(jax.tree.map(np.asarray, tree))
        rep = NamedSharding(self.mesh, P())
        return jax.tree.map(lambda x: _global_replicated(np.asarray(x), rep), tree)

    def get_state(self, tree):
        """One copy of a placed state as host numpy arrays (inverse of :meth:`put_state`)."""
        if self.mode == "pmap":
            tree = jax.tree.map(lambda x: x[0], tree)
        return jax.tree.map(_host_leaf, tree)

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

    def get(self, x):
        """Host value of a step output (metrics, logits): replicated outputs are read once."""
        if self.mode == "pmap":
            x = jax.tree.map(lambda a: a[0], x)
        return jax.tree.map(_host_leaf, x)


def _global_replicated(x: np.ndarray, sharding: NamedSharding):
    # Works multi-host: every process holds the same value and fills its addressable shards.
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def process_rows(batch: dict, process_index: int, process_count: int) -> dict:
    """This process's contiguous slice of a global batch (multi-host mesh input)."""
    if process_count == 1:
        return batch
    n = len(next(iter(batch.values())))
    if n % process_count:
        raise ValueError(f"global batch of {n} rows does not split over {process_count} processes")
    k = n // process_count
    return {key: v[process_index * k:(process_index + 1) * k] for key, v in batch.items()}


def pmap_eval_gather(logits):
    """Logits [D, B/D, N] from pmap back to [B, N]."""
    return logits.reshape(-1, *logits.shape[2:])


# ---- the loop -------------------------------------------------------------------------------

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
    loss_options: dict = dataclasses.field(default_factory=dict)
    threshold: float = 0.5  # multi-label decision threshold for metrics


def steps_per_epoch(n: int, batch_size: int) -> int:
    return max(math.ceil(n / batch_size), 1)


def total_steps(n: int, cfg: TrainConfig) -> int:
    spe = steps_per_epoch(n, cfg.batch_size)
    return int(cfg.max_steps) if cfg.max_steps else max(int(math.ceil(cfg.epochs * spe)), 1)


@dataclasses.dataclass
class Trainer:
    """Compiled steps for one model/optimizer/parallel mode (build once, reuse)."""

    model: Any
    optim: OptimConfig
    cfg: TrainConfig
    parallel: Parallel
    tx: optax.GradientTransformation
    train_step: Callable
    eval_step: Callable
    train_traces: TraceCounter
    eval_traces: TraceCounter

    @classmethod
    def build(cls, model, optim: OptimConfig, cfg: TrainConfig, parallel: Parallel | None = None) -> "Trainer":
        parallel = parallel or Parallel(cfg.parallel)
        tx = make_optimizer(optim)
        axis = DATA_AXIS if parallel.mode == "pmap" else None
        tt, et = TraceCounter(), TraceCounter()
        step = make_train_step(model, tx, freeze_backbone=optim.freeze_backbone, loss_options=cfg.loss_options,
                               axis_name=axis)
        return cls(model, optim, cfg, parallel, tx, parallel.compile(tt.wrap(step)),
                   parallel.compile(et.wrap(make_eval_step(model)), donate=False), tt, et)

    def init_state(self, params: dict | None = None) -> TrainState:
        return create_state(self.model.params if params is None else params, self.tx,
                            freeze_backbone=self.optim.freeze_backbone, seed=self.cfg.seed)

    def step(self, state, batch: dict):
        """One placed step; blocks on its result (queued jit+mesh steps on CPU devices can
        deadlock in XLA's collectives, and the loop logs the loss anyway)."""
        state, metrics = self.train_step(state, self.parallel.put_batch(self._local(batch)))
        return state, {k: float(v) for k, v in self.parallel.get(metrics).items()}

    def _local(self, batch):
        return process_rows(batch, *self.parallel.local_rows_fraction)

    def predict(self, params, batches: Iterable[dict]) -> tuple[np.ndarray, np.ndarray]:
        """Logits and labels of every real example (weight > 0), in order, each exactly once.
        ``params`` must be placed for the parallel mode (``parallel.put_state``)."""
        outs, labels = [], []
        for b in batches:
            keep = np.asarray(b["weights"]) > 0
            outs.append(np.asarray(self._eval_logits(params, b), np.float32)[keep])
            labels.append(np.asarray(b["labels"])[keep])
        if not outs:
            return np.zeros((0, self.model.num_labels), np.float32), np.zeros((0,))
        return np.concatenate(outs), np.concatenate(labels)

    def _eval_logits(self, params, b):
        out = self.eval_step(params, self.parallel.put_batch(self._local(b)))
        if self.parallel.mode == "pmap":
            return pmap_eval_gather(np.asarray(out))
        return _host_leaf(out)



@dataclasses.dataclass
class FitResult:
    state: Any  # placed for the parallel mode; ``trainer.parallel.get_state(state)`` for host arrays
    step: int
    history: list[dict]
    train_compiles: int
    eval_compiles: int
    seconds: float


def fit(trainer: Trainer, train: "Split", *, evals: dict | None = None, buckets: Sequence[int] = (128,),
        pad_id: int = 0, state: TrainState | None = None, start_step: int | None = None,
        on_step_end: Callable | None = None, on_eval: Callable | None = None, progress: bool = True,
        group_by_length: bool = True) -> FitResult:
    """Train ``trainer.model`` on ``train``; evaluate ``evals`` ({name: Split}) every
    ``cfg.eval_every`` steps (default: each epoch) and at the end.

    Resuming: pass the restored (host) ``state``; training continues at ``state.step`` (or
    ``start_step``) with exactly the batches and dropout keys an uninterrupted run would use.
    Hooks: ``on_step_end(state, step, metrics)`` after every step (``state`` placed for the
    parallel mode, ``step`` = steps done) and ``on_eval(state, step, {split: metrics})``."""
    from .data import iterate_batches
    from .metrics import compute_metrics

    cfg, par, model = trainer.cfg, trainer.parallel, trainer.model
    if cfg.batch_size % par.width or cfg.eval_batch_size % par.width:
        raise ValueError(f"batch sizes ({cfg.batch_size}, eval {cfg.eval_batch_size}) must be multiples of the "
                         f"{par.width} data-parallel devices")
    spe = steps_per_epoch(len(train), cfg.batch_size)
    total = total_steps(len(train), cfg)
    host_state = trainer.init_state() if state is None else state
    step = int(np.asarray(jax.device_get(host_state.step))) if start_step is None else int(start_step)
    placed = par.put_state(host_state)
    eval_every = cfg.eval_every or spe
    history: list[dict] = []
    bar = None
    if progress and jax.process_index() == 0:
        from tqdm.auto import tqdm
        bar = tqdm(total=total, initial=step, unit="step", dynamic_ncols=True, smoothing=0.1)

    def run_evals(s):
        results = {}
        for name, split in (evals or {}).items():
            batches = iterate_batches(split, cfg.eval_batch_size, buckets, shuffle=False, pad_id=pad_id)
            logits, labels = trainer.predict(placed.params, batches)
            results[name] = compute_metrics(model.problem_type, logits, labels, model.num_labels,
                                            threshold=cfg.threshold)
        if results:
            history.append({"step": s, "eval": results})
            if on_eval is not None:
                on_eval(placed, s, results)
        return results

    t0 = time.perf_counter()
    last = time.perf_counter()
    seen, window = 0.0, []
    while step < total:
        epoch, offset = divmod(step, spe)
        for batch in iterate_batches(train, cfg.batch_size, buckets, seed=cfg.seed, epoch=epoch, start=offset,
                                     pad_id=pad_id, group_by_length=group_by_length):
            placed, m = trainer.step(placed, batch)
            step += 1
            seen += m["weight"]
            window.append(m["loss"])
            m.update(step=step, epoch=epoch + (offset + 1) / spe)
            offset += 1
            if step % cfg.log_every == 0 or step == total:
                now = time.perf_counter()
                m["examples_per_s"] = seen / max(now - last, 1e-9)
                m["loss_avg"] = float(np.mean(window))  # mean over the steps since the last log line
                last, seen, window = now, 0.0, []
                history.append({"step": step, "epoch": m["epoch"], "loss": m["loss_avg"], "step_loss": m["loss"],
                                "grad_norm": m["grad_norm"], "examples_per_s": m["examples_per_s"]})
                if bar is not None:
                    bar.set_postfix(loss=f"{m['loss']:.4f}", ex_s=f"{m['examples_per_s']:.1f}", ep=f"{m['epoch']:.2f}")
            if bar is not None:
                bar.update(1)
            if on_step_end is not None:
                on_step_end(placed, step, m)
            if step % eval_every == 0 and step < total:
                run_evals(step)
            if step >= total:
                break
    if bar is not None:
        bar.close()
    if not history or "eval" not in history[-1] or history[-1]["step"] != step:
        run_evals(step)
    return FitResult(placed, step, history, trainer.train_traces.count, trainer.eval_traces.count,
                     time.perf_counter() - t0)
