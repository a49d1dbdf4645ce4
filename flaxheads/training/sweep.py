"""Head sweeps with ``jax.vmap``: K heads trained at once on the same cached features.

Every head of a sweep has the same parameter shapes; they differ in learning rate, weight
decay, init/dropout seed and the sequence reduction in front of the pooler's params
(``Pool`` mode or ``DensePooler`` source: ``mean``, ``max``, ``cls``, ...). Their params
and optimizer states are stacked on a leading axis of size K and one jitted, vmapped step
updates all of them on a shared batch: the batch is read once, the K small matmuls run as
one batched matmul, and there is one compile for the whole sweep.

Each head takes exactly the update of a separate run: the step is
:func:`flaxheads.training.steps.make_head_train_step` with
:func:`flaxheads.training.optim.make_optimizer` (``freeze_backbone=True``) at the head's learning
rate and weight decay, vmapped: clip by global norm, AdamW with the decay mask, the shared
schedule scaled to the head's peak learning rate, dropout key ``fold_in(PRNGKey(seed), step)``.
The best head on validation becomes a normal :class:`flaxheads.SequenceModel` head
(:meth:`SweepResult.best_model`), which ``flaxheads.checkpoint.save_head`` saves like any other.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from flaxheads.errors import TrainingError
from flaxheads.heads import linen
from flaxheads.heads.heads import SequenceHead
from flaxheads.heads.poolers import DensePooler, Pool
from flaxheads.runtime.parallel import Parallel
from flaxheads.tasks.metrics import compute_metrics, headline
from flaxheads.training.feature_cache import FeatureCache, predict_cache, reduction
from flaxheads.training.optim import OptimConfig, make_optimizer
from flaxheads.training.steps import TrainState, make_head_train_step
from flaxheads.training.trainer import steps_per_epoch as _batches_per_pass


@dataclasses.dataclass(frozen=True)
class Variant:
    """One head of a sweep. ``pooler``: a reduction name (None: the model's own)."""

    learning_rate: float
    weight_decay: float = 0.0
    seed: int = 0
    pooler: str | None = None

    def label(self) -> str:
        p = f" pool={self.pooler}" if self.pooler else ""
        return f"lr={self.learning_rate:g} wd={self.weight_decay:g} seed={self.seed}{p}"


def grid(
    learning_rates: Sequence[float],
    weight_decays: Sequence[float] = (0.0,),
    seeds: Sequence[int] = (0,),
    poolers: Sequence[str | None] = (None,),
) -> list[Variant]:
    """The full product of the given settings."""
    return [
        Variant(float(lr), float(wd), int(s), p)
        for lr, wd, s, p in itertools.product(learning_rates, weight_decays, seeds, poolers)
    ]


def head_with_reduction(head: SequenceHead, reduction: str | None) -> SequenceHead:
    """``head`` with its pooler's fixed reduction replaced (same params tree)."""
    if reduction is None:
        return head
    p = head.pooler
    if isinstance(p, Pool):
        return SequenceHead(Pool(reduction), head.head)
    if isinstance(p, DensePooler):
        return SequenceHead(dataclasses.replace(p, source=reduction), head.head)
    raise TrainingError(
        f"{type(p).__name__} has no fixed reduction to vary; sweep poolers only for Pool or DensePooler"
    )


def _reductions(model, variants: Sequence[Variant], cache: FeatureCache) -> np.ndarray:
    own = reduction(model.head.pooler)
    want = [v.pooler or own for v in variants]
    if cache.level != "pooled":
        if any(v.pooler for v in variants):
            raise TrainingError("varying the pooler needs a pooled cache built with reductions=(...)")
        return np.zeros(len(variants), np.int32)
    missing = sorted({w for w in want if w not in cache.reductions}, key=str)  # None: a pooler without one
    if missing:
        raise TrainingError(
            f"the cache holds reductions {cache.reductions}, the sweep needs {missing}: build it "
            f"with cache_features(..., reductions={tuple(sorted(set(want), key=str))})"
        )
    return np.asarray([cache.reductions.index(w) for w in want], np.int32)


def init_heads(model, variants: Sequence[Variant]) -> dict:
    """Stacked ``[K, ...]`` head params: fresh init from each variant's seed, except modules
    that came from the checkpoint (``model.report.pretrained``), which every head starts from."""
    h = model.hidden_size
    keep = [p for p, _ in model.report.pretrained]
    start = flatten_dict(jax.device_get(model.params["head"]), sep="/")
    heads = []
    for v in variants:
        fresh = flatten_dict(jax.device_get(linen.init_head(model.head, h, jax.random.PRNGKey(v.seed))), sep="/")
        heads.append({k: (start[k] if any(k.startswith(p + "/") for p in keep) else x) for k, x in fresh.items()})
    stacked = {k: np.stack([np.asarray(hd[k]) for hd in heads]) for k in heads[0]}
    return jax.tree.map(jnp.asarray, unflatten_dict(stacked, sep="/"))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SweepState:
    """K heads' state: ``params``/``opt_state`` stacked on axis 0; per-head ``lr``, ``wd``,
    ``rng`` and ``reduction`` (index into the cache's reductions)."""

    step: jax.Array
    params: Any
    opt_state: Any
    lr: jax.Array
    wd: jax.Array
    rng: jax.Array
    reduction: jax.Array


def init_state(model, variants: Sequence[Variant], cfg: OptimConfig, reductions: np.ndarray) -> SweepState:
    params = init_heads(model, variants)
    lr = jnp.asarray([v.learning_rate for v in variants], jnp.float32)
    wd = jnp.asarray([v.weight_decay for v in variants], jnp.float32)
    opt = jax.vmap(lambda p, a, b: _head_tx(cfg, a, b).init({"head": p}))(params, lr, wd)
    rng = jnp.stack([jax.random.PRNGKey(v.seed) for v in variants])
    return SweepState(jnp.zeros((), jnp.int32), params, opt, lr, wd, rng, jnp.asarray(reductions))


def _head_tx(cfg: OptimConfig, lr, wd, fold_reductions: bool = False):
    """The optimizer of one head: the run's, at this head's learning rate and weight decay."""
    return make_optimizer(cfg, head_learning_rate=lr, weight_decay=wd, fold_reductions=fold_reductions)


def _sweep_step(model, cfg: OptimConfig, level: str, loss_options: dict | None):
    """The pure ``step(state, batch) -> (state, losses [K])`` of :func:`make_sweep_step`."""

    def one(params, opt_state, lr, wd, rng, r, step, batch):
        hidden, mask = _select(batch, r, level)
        head_step = make_head_train_step(
            model, _head_tx(cfg, lr, wd, model.plan.fold_reductions), loss_options=loss_options
        )
        new, metrics = head_step(
            TrainState(step, {"head": params}, opt_state, rng),
            {"hidden": hidden, "pool_mask": mask, "labels": batch["labels"], "weights": batch["weights"]},
        )
        return new.params["head"], new.opt_state, metrics["loss"]

    def step(state: SweepState, batch: dict):
        p, o, loss = jax.vmap(one, in_axes=(0, 0, 0, 0, 0, 0, None, None))(
            state.params, state.opt_state, state.lr, state.wd, state.rng, state.reduction, state.step, batch
        )
        return dataclasses.replace(state, step=state.step + 1, params=p, opt_state=o), loss

    return step


def make_sweep_step(model, cfg: OptimConfig, *, level: str = "pooled", loss_options: dict | None = None):
    """``step(state, batch) -> (state, losses [K])``, jitted with the state donated.
    ``batch``: ``hidden [B, R, H]`` (pooled) or ``[B, T, H]`` (token), ``pool_mask``, ``labels``,
    ``weights``. Each head takes ``make_head_train_step``'s step (the weighted-mean loss)."""
    return Parallel().compile(
        _sweep_step(model, cfg, level, loss_options), options=model.plan.compiler_options(gradients=True)
    )


def make_sweep_scan(model, cfg: OptimConfig, *, level: str = "pooled", loss_options: dict | None = None):
    """``run(state, batches) -> (state, loss sum [K])``: :func:`make_sweep_step`'s step over ``S``
    stacked batches in one program (``jax.lax.scan``), jitted with the state donated; the
    losses of the valid steps come back summed.

    ``batches`` holds each batch key stacked on a leading axis ``S`` and ``valid [S]``: a step
    with ``valid`` False leaves the state as it was (it pads a run of batches to a length
    already compiled). A head's step on a cached batch is microseconds of work, so one dispatch
    per batch from Python cost more than the step; a whole epoch in one call does not."""
    step = _sweep_step(model, cfg, level, loss_options)

    def run(state: SweepState, batches: dict):
        def body(s, b):
            new, loss = step(s, {k: v for k, v in b.items() if k != "valid"})
            return jax.tree.map(lambda x, y: jnp.where(b["valid"], x, y), new, s), loss

        state, losses = jax.lax.scan(body, state, batches)
        return state, jnp.sum(jnp.where(batches["valid"][:, None], losses, 0.0), axis=0)

    return Parallel().compile(run, options=model.plan.compiler_options(gradients=True))


def _select(batch: dict, r, level: str):
    """The head's one-token view of a pooled batch (position ``r``), or the token batch as is."""
    hidden, mask = batch["hidden"], batch["pool_mask"]
    if level == "token":
        return hidden, mask
    return jax.lax.dynamic_slice_in_dim(hidden, r, 1, axis=1), mask[:, :1]


def make_sweep_predict(model, level: str = "pooled"):
    """``predict(params [K,...], reduction [K], batch) -> logits [K, B, N]`` (inference mode)."""

    def one(p, r, batch):
        hidden, mask = _select(batch, r, level)
        return model.head_apply(p, hidden, mask, train=False)

    return jax.jit(jax.vmap(one, in_axes=(0, 0, None)))


def _device_batch(b: dict) -> dict:
    return {k: b[k] for k in ("hidden", "pool_mask", "labels", "weights")}


#: host memory for one call's stacked batches (:func:`scan_length`)
MAX_SCAN_BYTES = 64 << 20


def scan_length(steps: int, batch_bytes: int, max_bytes: int = MAX_SCAN_BYTES) -> int:
    """Batches per scanned call: a whole epoch of ``steps`` when its stacked batches fit in
    ``max_bytes``, else the epoch in equal runs that do (the last one padded). One length per
    sweep, so one compile."""
    cap = max(1, max_bytes // max(batch_bytes, 1))
    runs = -(-steps // cap)
    return -(-steps // runs)


def _batch_bytes(cache: FeatureCache, batch_size: int) -> int:
    b = cache.buckets[0]
    return batch_size * (b.hidden.shape[1] * b.hidden.shape[2] * b.hidden.dtype.itemsize + 4 * b.mask.shape[1] + 16)


def _stacked_runs(batches, length: int):
    """Batches stacked ``length`` at a time (``valid [length]``; the last run repeats its final
    batch as invalid steps up to ``length``)."""
    run = []
    for b in itertools.chain(batches, [None]):
        if b is not None:
            run.append(_device_batch(b))
        if run and (len(run) == length or b is None):
            valid = np.arange(length) < len(run)
            run += [run[-1]] * (length - len(run))
            yield {**{k: np.stack([x[k] for x in run]) for k in run[0]}, "valid": valid}
            run = []


def predict_all(model, state_params, reductions, cache: FeatureCache, batch_size: int = 256) -> np.ndarray:
    """Logits ``[K, n, N]`` of every head on every cached example (example order)."""
    pred = make_sweep_predict(model, cache.level)
    return predict_cache(lambda b: pred(state_params, reductions, _device_batch(b)), cache, batch_size, axis=1)


@dataclasses.dataclass
class SweepResult:
    """A finished sweep: per-head final params (stacked, host), losses and validation scores."""

    variants: list[Variant]
    params: Any
    reductions: np.ndarray
    losses: np.ndarray  # [epochs, K] mean training loss per epoch
    scores: np.ndarray | None  # [K] validation metric (higher is better), None without validation
    metric: str | None
    best: int
    seconds: float
    steps: int

    def head_params(self, k: int) -> dict:
        return jax.tree.map(lambda x: jnp.asarray(x[k]), self.params)

    def best_model(self, model):
        """``model`` with the best head (params and, if the sweep varied it, the pooler)."""
        v = self.variants[self.best]
        head = head_with_reduction(model.head, v.pooler)
        same = v.pooler is None
        return dataclasses.replace(
            model,
            head=head,
            params={**model.params, "head": self.head_params(self.best)},
            arch=model.arch if same else None,
            hf_names=model.hf_names if same else (),
        )

    def table(self) -> str:
        rows = [f"| # | head | final train loss | {self.metric or 'val'} |", "| --- | --- | --- | --- |"]
        for k, v in enumerate(self.variants):
            sc = f"{self.scores[k]:.4f}" if self.scores is not None else "-"
            mark = " **best**" if k == self.best else ""
            rows.append(f"| {k} | {v.label()}{mark} | {self.losses[-1, k]:.4f} | {sc} |")
        return "\n".join(rows)


def steps_per_epoch(cache: FeatureCache | Sequence[int], batch_size: int) -> int:
    """Batches per epoch of ``cache.batches`` (or of a cache with buckets of these sizes:
    ``features.bucket_sizes``): each length bucket is cut into batches on its own."""
    sizes = [len(b.index) for b in cache.buckets] if isinstance(cache, FeatureCache) else cache
    return sum(_batches_per_pass(n, batch_size) for n in sizes)


def sweep(
    model,
    train: FeatureCache,
    variants: Sequence[Variant],
    *,
    optim: OptimConfig | None = None,
    epochs: int = 20,
    batch_size: int = 32,
    val: FeatureCache | None = None,
    seed: int = 0,
    loss_options: dict | None = None,
    metric: str | None = None,
    max_scan_bytes: int = MAX_SCAN_BYTES,
    max_steps: int | None = None,
) -> SweepResult:
    """Train ``len(variants)`` heads at once on cached features; pick the best on ``val``.

    ``optim`` supplies everything but the per-head learning rate and weight decay
    (schedule, warmup, clipping, Adam betas); its ``total_steps`` is set to the sweep's.
    ``max_steps`` stops after that many batches (within ``epochs``; the last epoch may be partial).
    Pooled caches train a whole epoch per call (:func:`make_sweep_scan`; ``max_scan_bytes``
    bounds its stacked batches), token-level ones a batch per call."""
    variants = list(variants)
    if not variants:
        raise TrainingError("sweep needs at least one variant")
    cfg = optim or OptimConfig(schedule="constant", max_grad_norm=None)
    if cfg.accumulation_steps != 1:
        raise TrainingError("sweeps do not accumulate gradients (accumulation_steps must be 1)")
    spe = steps_per_epoch(train, batch_size)
    steps = spe * epochs if max_steps is None else min(int(max_steps), spe * epochs)
    per_epoch = [min(spe, steps - e * spe) for e in range(epochs) if steps > e * spe]  # batches of each epoch run
    cfg = dataclasses.replace(cfg, total_steps=steps, freeze_backbone=True)
    reds = _reductions(model, variants, train)
    state = init_state(model, variants, cfg, reds)
    losses = []
    t0 = time.perf_counter()
    if train.level == "pooled":  # one batch shape: whole runs of batches per call
        run = make_sweep_scan(model, cfg, level=train.level, loss_options=loss_options)
        length = scan_length(spe, _batch_bytes(train, batch_size), max_scan_bytes)
        sums: list[list[Any]] = []  # device arrays, read once at the end: no eager op to compile, no wait per epoch
        for e, n in enumerate(per_epoch):
            sums.append([])
            for part in _stacked_runs(itertools.islice(train.batches(batch_size, seed=seed, epoch=e), n), length):
                state, loss = run(state, part)
                sums[-1].append(loss)
        sums = jax.device_get(sums)
        losses = [np.sum(np.asarray(parts).reshape(len(parts), -1), axis=0) / n for parts, n in zip(sums, per_epoch)]
    else:  # token level: one shape per length bucket, mixed within an epoch
        step = make_sweep_step(model, cfg, level=train.level, loss_options=loss_options)
        for e, n in enumerate(per_epoch):
            tot, cnt = 0.0, 0
            for b in itertools.islice(train.batches(batch_size, seed=seed, epoch=e), n):
                state, loss = step(state, _device_batch(b))
                tot, cnt = tot + loss, cnt + 1
            losses.append(np.asarray(tot) / max(cnt, 1))
    params = jax.device_get(state.params)
    seconds = time.perf_counter() - t0
    scores, best, name = None, 0, None
    if val is not None:
        if val.labels is None:
            raise TrainingError("the validation cache has no labels")
        name = metric or headline(model.problem_type)
        logits = predict_all(model, state.params, state.reduction, val)
        rows = np.sort(np.concatenate([b.index for b in val.buckets]))  # the cached examples only
        scores = np.asarray(
            [compute_metrics(model.problem_type, lg[rows], val.labels[rows], model.num_labels)[name] for lg in logits]
        )
        best = int(np.argmax(scores))
    return SweepResult(variants, params, reds, np.stack(losses), scores, name, best, seconds, steps)


# ---- the `train --cache-features / --sweep K` program path -----------------------------------


def sweep_variants(k: int, lr: float, weight_decay: float, seed: int) -> list[Variant]:
    """``k`` heads around ``lr``: learning rates log-spaced over [lr/10, lr*10], weight decay
    alternating ``weight_decay`` / 0, seeds ``seed + i``; ``k == 1`` is exactly the given settings."""
    if k < 1:
        raise TrainingError(f"--sweep needs K >= 1, got {k}")
    if k == 1:
        return [Variant(lr, weight_decay, seed)]
    return [
        Variant(float(lr * 10 ** (-1 + 2 * i / (k - 1))), weight_decay if i % 2 == 0 else 0.0, seed + i)
        for i in range(k)
    ]
