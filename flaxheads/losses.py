"""Losses: functions of (logits, labels, example weights) -> scalar.

Every loss takes per-example weights (0 for padding rows), so a padded batch neither
drops nor double-counts examples. Reductions match PyTorch's ``CrossEntropyLoss``,
``BCEWithLogitsLoss`` and ``MSELoss`` (``reduction="mean"``) when all weights are 1.

Value checks (label range, NaN targets) run when the labels are concrete arrays, i.e.
outside ``jit``; the data pipeline calls :func:`validate_labels` once per dataset so
jitted steps never see bad labels.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from flaxheads.errors import ConfigError

SINGLE_LABEL = "single_label_classification"
MULTI_LABEL = "multi_label_classification"
REGRESSION = "regression"
PROBLEM_TYPES = (SINGLE_LABEL, MULTI_LABEL, REGRESSION)

LOSS_NAMES = {
    SINGLE_LABEL: "softmax cross-entropy",
    MULTI_LABEL: "sigmoid binary cross-entropy (per label, mean)",
    REGRESSION: "mean squared error",
}


def check_problem_type(problem_type: str, num_labels: int) -> None:
    """Reject impossible (problem_type, num_labels) pairs with a message that says what to do."""
    if not isinstance(num_labels, (int, np.integer)) or num_labels < 1:
        raise ConfigError(f"num_labels must be a positive integer, got {num_labels!r}")
    if problem_type not in PROBLEM_TYPES:
        raise ConfigError(f"unknown problem_type {problem_type!r}; valid: {PROBLEM_TYPES}")
    if problem_type == SINGLE_LABEL and num_labels == 1:
        raise ConfigError(
            "single_label_classification with num_labels=1: softmax over one class gives a constant zero "
            "loss (Hugging Face trains nothing here, silently). Use num_labels=2 for a binary task, or "
            "problem_type='regression' / 'multi_label_classification' for one output."
        )


def infer_problem_type(num_labels: int, labels=None) -> str:
    """Hugging Face's rule: 1 label -> regression; integer labels -> single-label;
    otherwise multi-label. Without labels, >1 labels means single-label."""
    if num_labels == 1:
        return REGRESSION
    if labels is None:
        return SINGLE_LABEL
    dt = np.asarray(labels).dtype
    return SINGLE_LABEL if np.issubdtype(dt, np.integer) else MULTI_LABEL


def _concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def validate_labels(labels, problem_type: str, num_labels: int) -> None:
    """Shape/dtype checks always; value checks when ``labels`` is concrete."""
    check_problem_type(problem_type, num_labels)
    shape, dtype = jnp.shape(labels), jnp.result_type(labels)
    if problem_type == SINGLE_LABEL:
        if not jnp.issubdtype(dtype, jnp.integer):
            raise ConfigError(
                f"single_label_classification needs integer class ids of shape [batch], got dtype {dtype}. "
                "Cast class ids to int, or use problem_type='multi_label_classification' for 0/1 float targets "
                "of shape [batch, num_labels]."
            )
        if len(shape) != 1:
            raise ConfigError(f"single-label labels must have shape [batch], got {shape}")
        if _concrete(labels) and shape[0]:
            lab = np.asarray(labels)
            bad = (lab < 0) | (lab >= num_labels)
            if bad.any():
                i = int(np.argmax(bad))
                raise ConfigError(
                    f"label {int(lab[i])} at row {i} is outside [0, {num_labels}); "
                    f"check num_labels ({num_labels}) and the label mapping"
                )
        return
    want: tuple[int, ...] | None = (shape[0], num_labels) if shape else None
    if problem_type == REGRESSION and num_labels == 1 and len(shape) == 1:
        want = shape  # HF squeezes a single regression target
    if len(shape) not in (1, 2) or shape != want:
        raise ConfigError(
            f"{problem_type} targets must have shape [batch, num_labels] = [batch, {num_labels}]"
            f"{' (or [batch] for one regression target)' if problem_type == REGRESSION and num_labels == 1 else ''}"
            f", got {shape}"
        )
    if _concrete(labels):
        lab = np.asarray(labels, dtype=np.float64)
        if np.isnan(lab).any():
            nan_rows = np.unique(np.argwhere(np.isnan(lab))[:, 0])[:10].tolist()
            raise ConfigError(f"{problem_type} targets contain NaN at rows {nan_rows}")
        if problem_type == MULTI_LABEL and ((lab < 0) | (lab > 1)).any():
            raise ConfigError("multi-label targets must lie in [0, 1] (one 0/1 column per label)")


def _weights(weights, n: int) -> jax.Array:
    return jnp.ones((n,), jnp.float32) if weights is None else jnp.asarray(weights, jnp.float32)


def softmax_cross_entropy(logits, labels, weights=None, *, class_weights=None, label_smoothing: float = 0.0):
    """Single-label CE; equals ``torch.nn.CrossEntropyLoss(weight=class_weights,
    label_smoothing=...)`` when all example weights are 1 (PyTorch's weighted mean:
    divided by the summed class weight of the targets)."""
    logits = logits.astype(jnp.float32)
    k = logits.shape[-1]
    logp = jax.nn.log_softmax(logits, axis=-1)
    cw = jnp.ones((k,), jnp.float32) if class_weights is None else jnp.asarray(class_weights, jnp.float32)
    w = _weights(weights, logits.shape[0])
    nll = -jnp.take_along_axis(logp, labels[:, None].astype(jnp.int32), axis=-1)[:, 0] * cw[labels]
    if label_smoothing:
        smooth = -jnp.sum(logp * cw[None, :], axis=-1) / k
        per = (1.0 - label_smoothing) * nll + label_smoothing * smooth
    else:
        per = nll
    return jnp.sum(per * w) / jnp.maximum(jnp.sum(cw[labels] * w), 1e-12)


def sigmoid_binary_cross_entropy(logits, labels, weights=None, *, class_weights=None, pos_weight=None):
    """Multi-label BCE; equals ``torch.nn.BCEWithLogitsLoss(weight=class_weights,
    pos_weight=pos_weight)`` (mean over labels and examples) when example weights are 1."""
    logits = logits.astype(jnp.float32)
    y = labels.astype(jnp.float32)
    log_p, log_not_p = jax.nn.log_sigmoid(logits), jax.nn.log_sigmoid(-logits)
    pw = 1.0 if pos_weight is None else jnp.asarray(pos_weight, jnp.float32)
    per = -(pw * y * log_p + (1.0 - y) * log_not_p)
    if class_weights is not None:
        per = per * jnp.asarray(class_weights, jnp.float32)
    w = _weights(weights, logits.shape[0])
    return jnp.sum(jnp.mean(per, axis=-1) * w) / jnp.maximum(jnp.sum(w), 1e-12)


def mean_squared_error(logits, labels, weights=None):
    """MSE; equals ``torch.nn.MSELoss()`` on HF's squeezed logits/labels when weights are 1."""
    pred = logits.astype(jnp.float32)
    y = labels.astype(jnp.float32).reshape(pred.shape)
    w = _weights(weights, pred.shape[0])
    return jnp.sum(jnp.mean(jnp.square(pred - y).reshape(pred.shape[0], -1), axis=-1) * w) / jnp.maximum(
        jnp.sum(w), 1e-12
    )


def loss_fn(
    problem_type: str, num_labels: int, *, label_smoothing: float = 0.0, class_weights=None, pos_weight=None
) -> Callable[..., jax.Array]:
    """The loss for a problem type, as ``f(logits, labels, weights) -> scalar``.

    The returned function validates shapes (and values, outside ``jit``)."""
    check_problem_type(problem_type, num_labels)
    if not 0.0 <= label_smoothing < 1.0:
        raise ConfigError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if label_smoothing and problem_type != SINGLE_LABEL:
        raise ConfigError("label_smoothing applies to single_label_classification only")
    if class_weights is not None:
        if problem_type == REGRESSION:
            raise ConfigError("class_weights do not apply to regression")
        if np.shape(class_weights) != (num_labels,):
            raise ConfigError(f"class_weights must have shape [{num_labels}], got {np.shape(class_weights)}")
        if (np.asarray(class_weights) < 0).any():
            raise ConfigError("class_weights must be non-negative")
    if pos_weight is not None and problem_type != MULTI_LABEL:
        raise ConfigError("pos_weight applies to multi_label_classification only")

    def f(logits, labels, weights=None):
        if logits.ndim != 2 or logits.shape[-1] != num_labels:
            raise ConfigError(f"logits must have shape [batch, {num_labels}], got {logits.shape}")
        validate_labels(labels, problem_type, num_labels)
        if jnp.shape(labels)[0] != logits.shape[0]:
            raise ConfigError(f"labels have {jnp.shape(labels)[0]} rows but logits have {logits.shape[0]}")
        if weights is not None and jnp.shape(weights) != (logits.shape[0],):
            raise ConfigError(f"example weights must have shape [{logits.shape[0]}], got {jnp.shape(weights)}")
        if problem_type == SINGLE_LABEL:
            return softmax_cross_entropy(
                logits, labels, weights, class_weights=class_weights, label_smoothing=label_smoothing
            )
        if problem_type == MULTI_LABEL:
            return sigmoid_binary_cross_entropy(
                logits, labels, weights, class_weights=class_weights, pos_weight=pos_weight
            )
        return mean_squared_error(logits, labels, weights)

    return f
