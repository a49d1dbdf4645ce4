"""Optimizer factory on optax: AdamW with a weight-decay mask, warmup + decay schedules,
gradient clipping, gradient accumulation, a separate head learning rate, frozen backbone.

The optimizer always acts on the *trainable* subtree of the params (see :func:`trainable`):
``{"backbone": ..., "head": ...}`` for a full fine-tune, ``{"head": ...}`` with a frozen
backbone, ``{"lora": ..., "head": ...}`` with LoRA adapters, so a frozen backbone has no
gradients and no optimizer moments at all.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.traverse_util import flatten_dict, unflatten_dict

from flaxheads.errors import TrainingError
from flaxheads.model.base_dtype import check_trainable_base

SCHEDULES = ("linear", "cosine", "constant")
#: Peak learning rates: fine-tuning (``OptimConfig``'s default), the head of a fine-tune, a frozen
#: backbone (probe), LoRA adapters (they start at B = 0 and need a larger step). A run picks one when
#: its ``lr`` / ``head_lr`` are not given (``flaxheads.run.spec``).
DEFAULT_LR, DEFAULT_HEAD_LR, PROBE_LR, LORA_LR = 1e-4, 1e-3, 5e-3, 1e-3

# Parameter leaf names that are never weight-decayed: biases and normalisation scales/offsets.
_NO_DECAY_LEAVES = {"bias", "scale", "b"}
_NO_DECAY_PARENTS = ("layernorm", "layer_norm", "ln", "norm")


@dataclasses.dataclass
class OptimConfig:
    """Optimizer settings. The defaults are a fine-tuning run's (``RunSpec()``, ``flaxheads train``
    without flags), but for two a run derives: ``total_steps`` and ``warmup_steps`` from its length
    and ``warmup_ratio``, and the head's rate (``DEFAULT_HEAD_LR`` when it fine-tunes)."""

    learning_rate: float = DEFAULT_LR
    head_learning_rate: float | None = None  # None: same as learning_rate
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    schedule: str = "linear"  # linear | cosine | constant (after warmup)
    warmup_steps: int = 0
    total_steps: int = 1000  # optimizer steps (micro-steps / accumulation_steps)
    max_grad_norm: float | None = 1.0  # None or 0: no clipping
    accumulation_steps: int = 1
    freeze_backbone: bool = False

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise TrainingError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.accumulation_steps < 1:
            raise TrainingError(f"accumulation_steps must be >= 1 (1: no accumulation), got {self.accumulation_steps}")
        if self.learning_rate < 0 or (self.head_learning_rate or 0) < 0:
            raise TrainingError(
                f"learning rates must be >= 0, got learning_rate={self.learning_rate}, "
                f"head_learning_rate={self.head_learning_rate}"
            )


def trainable(params: dict, freeze_backbone: bool) -> dict:
    """The subtree the optimizer updates: ``{"head"}`` with a frozen backbone, ``{"lora", "head"}``
    when the params carry LoRA adapters (the base stays frozen), else ``{"backbone", "head"}``."""
    if freeze_backbone:
        return {"head": params["head"]}
    if "lora" in params:
        return {"lora": params["lora"], "head": params["head"]}
    out = {"backbone": params["backbone"], "head": params["head"]}
    check_trainable_base(out)  # a 16-bit base is only ever frozen
    return out


def merge(params: dict, trained: dict) -> dict:
    """``params`` with the trainable subtree replaced by ``trained``."""
    return {**params, **trained}


def decay_mask(params) -> Any:
    """True where weight decay applies: kernels and embeddings; not biases or LayerNorm params."""
    flat = flatten_dict(params)

    def decays(path) -> bool:
        leaf = str(path[-1]).lower()
        if leaf in _NO_DECAY_LEAVES:
            return False
        parent = str(path[-2]).lower() if len(path) > 1 else ""
        return not any(p in parent for p in _NO_DECAY_PARENTS)

    return unflatten_dict({k: decays(k) for k in flat})


def schedule(peak: float, cfg: OptimConfig) -> optax.Schedule:
    """Linear warmup from 0 to ``peak`` over ``warmup_steps``, then linear/cosine decay to 0
    at ``total_steps`` (or constant)."""
    warm = max(int(cfg.warmup_steps), 0)
    rest = max(int(cfg.total_steps) - warm, 1)
    if cfg.schedule == "constant":
        after = optax.constant_schedule(peak)
    elif cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, rest)
    else:
        after = optax.linear_schedule(peak, 0.0, rest)
    if warm == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warm), after], [warm])


def _head_lr(cfg: OptimConfig):
    return cfg.learning_rate if cfg.head_learning_rate is None else cfg.head_learning_rate


#: Slices a large array is folded into before its reduction (:func:`sum_of_squares`).
FOLD = 8
#: Arrays smaller than this are reduced as they are (their reduction is cheap either way).
FOLD_MIN_SIZE = 16384


def sum_of_squares(x: jax.Array, fold: bool = False) -> jax.Array:
    """``sum(x ** 2)`` in float32.

    ``fold`` (the compute plan's ``fold_reductions``: on the CPU where YNNPACK does not take a train
    step's reductions) first adds :data:`FOLD` equal slices of the array elementwise, one loop
    fusion that XLA:CPU runs on every core at memory speed, and reduces what is left (8, 16 and 32
    slices ran alike; fewer trace and compile faster). XLA's own reduction of a large array is a
    tree of reduce-windows ~5x slower: MiniLM's gradient norm took 21 ms instead of 4.5 ms (AMD EPYC
    with AVX2); YNNPACK's reductions, where on, are faster than the fold (4.9 vs 12 ms there)."""
    x = jnp.ravel(x).astype(jnp.float32)
    n = x.size - x.size % FOLD
    if not fold or n < FOLD_MIN_SIZE:
        return jnp.sum(x * x)
    rows = x[:n].reshape(FOLD, -1)
    acc = rows[0] * rows[0]
    for i in range(1, FOLD):
        acc = acc + rows[i] * rows[i]
    return jnp.sum(acc) + jnp.sum(x[n:] * x[n:])


def global_norm(tree, fold: bool = False) -> jax.Array:
    """The L2 norm of every leaf of ``tree`` together (``optax.tree.norm`` of real arrays), through
    :func:`sum_of_squares` (``fold``: see there)."""
    return jnp.sqrt(sum((sum_of_squares(x, fold) for x in jax.tree.leaves(tree)), jnp.zeros((), jnp.float32)))


def clip_by_global_norm(max_norm: float, fold: bool = False) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm``'s function and (empty) state, so checkpoints keep their layout.

    The norm is :func:`global_norm`, and a clipped tree is scaled by one scalar,
    ``max_norm / norm``, instead of divided elementwise by the norm: XLA fuses a multiply into each
    consumer (Adam's moments read the gradient directly), where optax's divide was written out as
    a clipped copy of every gradient first. Values equal optax's to a rounding."""

    def update(updates, state, params=None):
        del params
        norm = global_norm(updates, fold)
        factor = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda t: t * factor.astype(t.dtype), updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def make_optimizer(
    cfg: OptimConfig, *, head_learning_rate=None, weight_decay=None, fold_reductions: bool = False
) -> optax.GradientTransformation:
    """The optax transformation for the trainable subtree (``{"backbone","head"}`` or ``{"head"}``).

    Clip by global norm (over everything trained) -> AdamW per group (head group may have
    its own learning rate) -> wrapped in ``optax.MultiSteps`` when ``accumulation_steps > 1``
    (gradients of k micro-batches are averaged, one update every k calls).
    ``head_learning_rate`` / ``weight_decay`` override the config's; they may be traced arrays
    (a head sweep vmaps one optimizer over per-head values). ``fold_reductions``: the compute plan's
    (``model.plan.fold_reductions``), how the gradient norm is reduced (:func:`sum_of_squares`)."""
    head_lr = _head_lr(cfg) if head_learning_rate is None else head_learning_rate
    wd = cfg.weight_decay if weight_decay is None else weight_decay

    def adamw(peak):
        return optax.adamw(schedule(peak, cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=wd, mask=decay_mask)

    groups = {"head": adamw(head_lr)}
    if not cfg.freeze_backbone:
        # LoRA adapters train at the backbone's rate; a group no param is labelled with holds no state
        groups["backbone"] = groups["lora"] = adamw(cfg.learning_rate)
    parts = [clip_by_global_norm(cfg.max_grad_norm, fold_reductions)] if cfg.max_grad_norm else []
    parts.append(optax.multi_transform(groups, lambda p: {k: k for k in p}))
    tx = optax.chain(*parts)
    if cfg.accumulation_steps > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=cfg.accumulation_steps)
    return tx


def learning_rates(cfg: OptimConfig, step: int) -> dict[str, float]:
    """The learning rates at optimizer step ``step`` (for logging)."""
    out = {"lr_head": float(schedule(_head_lr(cfg), cfg)(step))}
    if not cfg.freeze_backbone:
        out["lr_backbone"] = float(schedule(cfg.learning_rate, cfg)(step))
    return out


def count_params(tree) -> int:
    return int(sum(x.size for x in jax.tree.leaves(tree)))
