"""Pure-functional train steps on one device or inside ``pmap``.

* ``train_step(state, batch) -> (state, metrics)`` is pure; the dropout key of step ``s`` is
  ``jax.random.fold_in(state.rng, s)``, so a run resumed at step k repeats an uninterrupted one.
* A batch is a dict of arrays: ``input_ids``, ``attention_mask`` [B, T], ``labels``,
  ``weights`` [B] (0 for padding rows), optionally ``token_type_ids``.
* The loss of a data-parallel step is the *global* weighted mean (sum of weighted losses over
  all devices / global weight), so 1, pmap-N and mesh-N devices give the same numbers even when
  the padded last batch puts all its padding on one device.
* A frozen backbone is never differentiated: its features are computed in inference mode and
  only the head params are arguments of ``jax.grad``; the optimizer state covers the head only.

Data parallelism is in :mod:`flaxheads.runtime.parallel`, the loop in :mod:`flaxheads.training.loop`; the
inference-mode eval step, which prediction shares, is in :mod:`flaxheads.training.programs`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from flaxheads.data.batching import extra_inputs
from flaxheads.data.packing import PACKED_KEYS, example_targets, is_packed
from flaxheads.errors import TrainingError
from flaxheads.losses import SINGLE_LABEL
from flaxheads.training.optim import global_norm, merge, trainable


class TrainState(struct.PyTreeNode):
    """Everything a training run carries between steps (a pytree; checkpoint it as is).

    ``step``: number of ``train_step`` calls so far (micro-steps when accumulating);
    ``params``: ``{"backbone": ..., "head": ...}``; ``opt_state``: optax state of the trainable
    subtree (``{"head"}`` only with a frozen backbone); ``rng``: base dropout key."""

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array


def create_state(
    params: dict, tx: optax.GradientTransformation, *, freeze_backbone: bool = False, seed: int = 0
) -> TrainState:
    """A fresh state at step 0 (optimizer initialised on the trainable subtree only)."""
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(trainable(params, freeze_backbone)),
        rng=jax.random.PRNGKey(seed),
    )


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


def _apply_grads(state, tx, trained, objective, denom_local, axis_name, fold: bool = False):
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
    return trained, opt_state, {"loss": loss, "grad_norm": global_norm(grads, fold), "weight": total}


def _make_step(
    model,
    tx,
    logits_of: Callable,
    *,
    freeze_backbone: bool,
    loss_options: dict | None,
    axis_name: str | None,
    loss: tuple[Callable, str] | None = None,
) -> Callable:
    """The one train step: ``logits_of(state, trained, batch, key)`` is all that differs between
    training on token ids and training a head on precomputed features."""
    loss_options = dict(loss_options or {})
    lf, problem_type = loss if loss is not None else (model.loss_fn(**loss_options), model.problem_type)
    cw = loss_options.get("class_weights")

    def step(state: TrainState, batch: dict):
        key = step_key(state, axis_name)
        labels, weights = example_targets(batch)
        denom = loss_denominator(problem_type, labels, weights, cw)

        def objective(t):
            return lf(logits_of(state, t, batch, key), labels, weights)

        trained, opt_state, metrics = _apply_grads(
            state, tx, trainable(state.params, freeze_backbone), objective, denom, axis_name, model.plan.fold_reductions
        )
        return state.replace(step=state.step + 1, params=merge(state.params, trained), opt_state=opt_state), metrics

    return step


def make_train_step(
    model,
    tx: optax.GradientTransformation,
    *,
    freeze_backbone: bool = False,
    loss_options: dict | None = None,
    axis_name: str | None = None,
    loss: tuple[Callable, str] | None = None,
) -> Callable:
    """``train_step(state, batch) -> (state, metrics)`` (not jitted; ``Parallel.compile`` jits it).

    ``axis_name`` is the pmap axis to reduce over (None for one device or for jit over a mesh,
    where the computation is written globally and XLA inserts the collectives). ``loss``:
    ``(loss(logits, labels, weights), problem type of its normaliser)`` instead of the model's own
    (a :class:`~flaxheads.tasks.task.Task`'s ``step_loss``)."""
    if freeze_backbone and getattr(model, "lora", None) is not None:
        raise TrainingError(
            "freeze_backbone=True trains the head alone on the base backbone's features, but this "
            "model has LoRA adapters: train without freeze_backbone (the base stays frozen and "
            "only the adapters and the head train), or merge the adapters first"
        )
    if freeze_backbone:
        # the backbone only runs forward, outside the differentiated function: the head step on its features
        head_step = make_head_train_step(model, tx, loss_options=loss_options, axis_name=axis_name, loss=loss)

        def frozen_step(state: TrainState, batch: dict):
            if is_packed(batch):
                hidden, pmask = model.packed_features(
                    state.params["backbone"],
                    batch["input_ids"],
                    *(batch[k] for k in PACKED_KEYS),
                    **extra_inputs(batch),
                )
            else:
                hidden, pmask = model.pooler_inputs(
                    state.params["backbone"],
                    batch["input_ids"],
                    batch["attention_mask"],
                    train=False,
                    **extra_inputs(batch),
                )
            labels, weights = example_targets(batch)
            return head_step(
                state,
                {"hidden": jax.lax.stop_gradient(hidden), "pool_mask": pmask, "labels": labels, "weights": weights},
            )

        return frozen_step

    def logits_of(state, t, batch, key):
        if is_packed(batch):
            return model.apply_packed(
                merge(state.params, t),
                batch["input_ids"],
                *(batch[k] for k in PACKED_KEYS),
                train=True,
                dropout_rng=key,
                **extra_inputs(batch),
            )
        return model.apply(
            merge(state.params, t),
            batch["input_ids"],
            batch["attention_mask"],
            train=True,
            dropout_rng=key,
            **extra_inputs(batch),
        )

    return _make_step(
        model, tx, logits_of, freeze_backbone=False, loss_options=loss_options, axis_name=axis_name, loss=loss
    )


def make_head_train_step(
    model,
    tx: optax.GradientTransformation,
    *,
    loss_options: dict | None = None,
    axis_name: str | None = None,
    loss: tuple[Callable, str] | None = None,
) -> Callable:
    """``head_train_step(state, batch) -> (state, metrics)`` on precomputed backbone features.

    ``batch`` holds ``hidden`` [B, T, H] (or any features the pooler takes), ``pool_mask`` [B, T],
    ``labels``, ``weights``. The state's optimizer must be built with ``freeze_backbone=True``;
    ``params["backbone"]`` is carried along untouched (it may be an empty dict)."""

    def logits_of(state, t, batch, key):
        return model.head_apply(t["head"], batch["hidden"], batch["pool_mask"], train=True, dropout_rng=key)

    return _make_step(
        model, tx, logits_of, freeze_backbone=True, loss_options=loss_options, axis_name=axis_name, loss=loss
    )
