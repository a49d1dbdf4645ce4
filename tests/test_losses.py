"""Losses equal PyTorch's CrossEntropyLoss / BCEWithLogitsLoss / MSELoss; bad input raises."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxheads as fh
from flaxheads.losses import MULTI_LABEL, REGRESSION, SINGLE_LABEL

torch = pytest.importorskip("torch")
F = torch.nn

RNG = np.random.default_rng(0)
LOGITS = RNG.normal(size=(6, 4)).astype(np.float32) * 2
INT_LABELS = np.array([0, 3, 1, 2, 3, 0])
MULTI = (RNG.random((6, 4)) > 0.5).astype(np.float32)
CW = np.array([1.0, 2.0, 0.5, 3.0], np.float32)


def _t(x):
    return torch.tensor(x)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("class_weights", [None, CW])
def test_cross_entropy_matches_torch(smoothing, class_weights):
    ref = F.CrossEntropyLoss(weight=None if class_weights is None else _t(class_weights), label_smoothing=smoothing)(
        _t(LOGITS), _t(INT_LABELS)
    ).item()
    f = fh.losses.loss_fn(SINGLE_LABEL, 4, label_smoothing=smoothing, class_weights=class_weights)
    assert abs(float(f(jnp.asarray(LOGITS), jnp.asarray(INT_LABELS))) - ref) < 1e-6


@pytest.mark.parametrize("class_weights,pos_weight", [(None, None), (CW, None), (None, CW[::-1].copy())])
def test_bce_matches_torch(class_weights, pos_weight):
    ref = F.BCEWithLogitsLoss(
        weight=None if class_weights is None else _t(class_weights),
        pos_weight=None if pos_weight is None else _t(pos_weight),
    )(_t(LOGITS), _t(MULTI)).item()
    f = fh.losses.loss_fn(MULTI_LABEL, 4, class_weights=class_weights, pos_weight=pos_weight)
    assert abs(float(f(jnp.asarray(LOGITS), jnp.asarray(MULTI))) - ref) < 1e-6


def test_mse_matches_torch_single_and_multi_output():
    y1 = RNG.normal(size=(6,)).astype(np.float32)
    ref = F.MSELoss()(_t(LOGITS[:, :1]).squeeze(), _t(y1)).item()  # HF squeezes for num_labels=1
    assert abs(float(fh.losses.loss_fn(REGRESSION, 1)(jnp.asarray(LOGITS[:, :1]), jnp.asarray(y1))) - ref) < 1e-6
    y4 = RNG.normal(size=(6, 4)).astype(np.float32)
    ref = F.MSELoss()(_t(LOGITS), _t(y4)).item()
    assert abs(float(fh.losses.loss_fn(REGRESSION, 4)(jnp.asarray(LOGITS), jnp.asarray(y4))) - ref) < 1e-6


@pytest.mark.parametrize(
    "ptype,labels",
    [(SINGLE_LABEL, INT_LABELS), (MULTI_LABEL, MULTI), (REGRESSION, RNG.normal(size=(6, 4)).astype(np.float32))],
)
def test_zero_weight_rows_count_as_absent(ptype, labels):
    """A padded batch with weight-0 rows gives the loss of the real rows alone (and zero grads for them)."""
    f = fh.losses.loss_fn(ptype, 4)
    w = np.array([1, 1, 1, 1, 0, 0], np.float32)
    padded = float(f(jnp.asarray(LOGITS), jnp.asarray(labels), jnp.asarray(w)))
    real = float(f(jnp.asarray(LOGITS[:4]), jnp.asarray(labels[:4])))
    assert abs(padded - real) < 1e-6
    g = jax.grad(lambda x: f(x, jnp.asarray(labels), jnp.asarray(w)))(jnp.asarray(LOGITS))
    assert np.all(np.asarray(g)[4:] == 0)


def test_infer_problem_type_like_hf():
    assert fh.losses.infer_problem_type(1) == REGRESSION
    assert fh.losses.infer_problem_type(3, np.array([0, 2])) == SINGLE_LABEL
    assert fh.losses.infer_problem_type(3, np.array([[0.0, 1.0, 1.0]])) == MULTI_LABEL


@pytest.mark.parametrize(
    "ptype,n,labels,match",
    [
        (SINGLE_LABEL, 4, np.array([0, 4, 1, 2, 3, 0]), r"label 4 at row 1 is outside \[0, 4\)"),
        (SINGLE_LABEL, 4, np.array([0, -1, 1, 2, 3, 0]), "outside"),
        (SINGLE_LABEL, 4, INT_LABELS.astype(np.float32), "integer class ids"),
        (MULTI_LABEL, 4, MULTI[:, :3], r"\[batch, 4\]"),
        (MULTI_LABEL, 4, np.where(MULTI > 0, np.nan, 0.0).astype(np.float32), "NaN"),
        (REGRESSION, 4, np.full((6, 4), np.nan, np.float32), "NaN"),
        (MULTI_LABEL, 2, INT_LABELS.astype(np.float32), r"\[batch, 2\]"),  # HF's float-labels, num_labels=2 trap
    ],
)
def test_bad_labels_raise(ptype, n, labels, match):
    with pytest.raises(ValueError, match=match):
        fh.losses.loss_fn(ptype, n)(jnp.asarray(LOGITS[:, :n]), jnp.asarray(labels))


def test_bad_configurations_raise():
    with pytest.raises(ValueError, match="constant zero"):
        fh.losses.loss_fn(SINGLE_LABEL, 1)
    for n in (0, -2):
        with pytest.raises(ValueError, match="positive integer"):
            fh.losses.loss_fn(SINGLE_LABEL, n)
    with pytest.raises(ValueError, match="problem_type"):
        fh.losses.loss_fn("classification", 3)
    with pytest.raises(ValueError, match="class_weights must have shape"):
        fh.losses.loss_fn(SINGLE_LABEL, 4, class_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="label_smoothing"):
        fh.losses.loss_fn(MULTI_LABEL, 4, label_smoothing=0.1)
    with pytest.raises(ValueError, match="logits must have shape"):
        fh.losses.loss_fn(SINGLE_LABEL, 3)(jnp.asarray(LOGITS), jnp.asarray(INT_LABELS))


def test_shape_checks_work_under_jit():
    f = fh.losses.loss_fn(SINGLE_LABEL, 4)
    out = jax.jit(f)(jnp.asarray(LOGITS), jnp.asarray(INT_LABELS), jnp.ones(6))
    assert np.isfinite(float(out))
    with pytest.raises(ValueError, match="integer class ids"):
        jax.jit(f)(jnp.asarray(LOGITS), jnp.asarray(INT_LABELS, jnp.float32))
