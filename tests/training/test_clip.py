"""Gradient clipping and the gradient norm (training.optim): the same values as optax's
``clip_by_global_norm`` / ``tree.norm``, the same (empty) optimizer state, and the folded
sum of squares equal to a float64 sum."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flaxheads.training import optim
from flaxheads.training.optim import OptimConfig, clip_by_global_norm, global_norm, make_optimizer, sum_of_squares


def _tree(scale: float, seed: int = 0) -> dict:
    rs = np.random.RandomState(seed)
    return {
        "emb": jnp.asarray(rs.randn(1000, 384) * scale, jnp.float32),  # folds
        "odd": jnp.asarray(rs.randn(4099 * 3 + 7) * scale, jnp.float32),  # folds, with a remainder
        "bias": jnp.asarray(rs.randn(384) * scale, jnp.float32),  # too small to fold
        "kernel": jnp.asarray(rs.randn(384, 2) * scale, jnp.float32),
    }


@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("size", [1, 384, 4095, 4096, 4096 * 5 + 31, 1_000_003])
def test_sum_of_squares_equals_a_float64_sum(fold, size):
    x = np.random.RandomState(size).randn(size).astype(np.float32)
    got = float(jax.jit(lambda a: sum_of_squares(a, fold))(jnp.asarray(x)))
    want = float(np.sum(x.astype(np.float64) ** 2))
    assert got == pytest.approx(want, rel=2e-6)


def test_sum_of_squares_reads_bfloat16_in_float32():
    x = jnp.asarray(np.random.RandomState(1).randn(64, 128), jnp.bfloat16)
    got = sum_of_squares(x, fold=True)
    assert got.dtype == jnp.float32
    assert float(got) == pytest.approx(float(np.sum(np.asarray(x, np.float64) ** 2)), rel=2e-6)


@pytest.mark.parametrize("fold", [True, False, None])
def test_global_norm_equals_optax(fold):
    t = _tree(1e-3)
    assert float(global_norm(t, fold)) == pytest.approx(float(optax.tree.norm(t)), rel=2e-6)


@pytest.mark.parametrize("scale, clipped", [(1e-4, False), (1.0, True)])
def test_clip_equals_optax(scale, clipped):
    t = _tree(scale)
    assert (float(optax.tree.norm(t)) > 1.0) is clipped
    ours, ours_state = jax.jit(clip_by_global_norm(1.0).update)(t, clip_by_global_norm(1.0).init(t))
    ref, ref_state = optax.clip_by_global_norm(1.0).update(t, optax.clip_by_global_norm(1.0).init(t))
    for k in t:
        if clipped:
            np.testing.assert_allclose(np.asarray(ours[k]), np.asarray(ref[k]), rtol=2e-6, atol=0)
        else:
            np.testing.assert_array_equal(np.asarray(ours[k]), np.asarray(t[k]))
    if clipped:
        assert float(optax.tree.norm(ours)) == pytest.approx(1.0, rel=1e-5)
    assert type(ours_state) is type(ref_state)


def test_optimizer_state_keeps_its_layout():
    """Checkpoints written with optax's clip restore into this optimizer: same state tree."""
    params = {"backbone": {"w": jnp.ones((4, 4))}, "head": {"head": {"kernel": jnp.ones((4, 2))}}}
    ours = make_optimizer(OptimConfig(max_grad_norm=1.0)).init(params)
    real = optim.clip_by_global_norm
    try:
        optim.clip_by_global_norm = lambda max_norm, fold=False: optax.clip_by_global_norm(max_norm)
        theirs = make_optimizer(OptimConfig(max_grad_norm=1.0)).init(params)
    finally:
        optim.clip_by_global_norm = real
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    assert [type(x) for x in ours] == [type(x) for x in theirs]


def test_clip_under_vmap():
    """A head sweep vmaps the optimizer: per-member norms, per-member clipping."""
    t = {"w": jnp.stack([jnp.full((8, 8), 0.01), jnp.full((8, 8), 1.0)])}
    clip = clip_by_global_norm(1.0)
    out, _ = jax.vmap(lambda g: clip.update(g, clip.init(g)))(t)
    np.testing.assert_array_equal(np.asarray(out["w"][0]), np.asarray(t["w"][0]))
    assert float(jnp.linalg.norm(out["w"][1])) == pytest.approx(1.0, rel=1e-6)
