"""Attention in sequential batch groups (``layers.attention.attention_groups``, with oneDNN's dots on CPU):
the same values and gradients as one pass over the batch.

A compute plan built from oneDNN's flags changes the arrangement traced (groups, plain attention),
not the XLA running it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxheads.layers import attention
from flaxheads.layers.attention import attend_chunked, attend_plain, attention_groups
from flaxheads.layers.masks import mask_bias, segment_bias
from flaxheads.runtime import ComputePlan
from flaxheads.runtime.xla_flags import ONEDNN_ALONE_FLAGS

B, T, NH, D = 4, 768, 4, 8  # 37.7 MB of float32 scores: past the 32 MiB where groups start


def _plan(flags: str) -> ComputePlan:
    return ComputePlan.for_host(xla_flags=flags, backend="cpu", attention="auto")


@pytest.fixture
def onednn(monkeypatch):
    monkeypatch.delenv("FLAXHEADS_ATTENTION", raising=False)
    return _plan(" ".join(ONEDNN_ALONE_FLAGS))


def test_groups_only_with_onednn_dots_and_large_scores(onednn):
    f32 = jnp.float32
    assert attention_groups(32, 12, 256, 256, f32, _plan("")) == 1
    assert attention_groups(32, 12, 256, 256, f32, onednn) == 16  # 100 MB: groups of 2 rows, ~6 MB each
    assert attention_groups(128, 12, 128, 128, f32, onednn) == 16  # 100 MB: 13 groups wanted, 16 divides the batch
    assert attention_groups(32, 12, 128, 128, f32, onednn) == 1  # 25 MB: one pass
    assert attention_groups(8, 12, 256, 256, f32, onednn) == 1
    assert attention_groups(30, 12, 256, 256, f32, onednn) == 15  # 94 MB: 12 wanted, the next divisor of 30
    assert attention_groups(31, 12, 256, 256, f32, onednn) == 31  # a prime batch: one row per group
    assert attention_groups(B, NH, T, T, f32, onednn) == B
    assert attention_groups(32, 12, 256, 256, jnp.bfloat16, onednn) == 1  # measured slower in bf16


def _inputs(seed=0, segments=False):
    r = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(r.normal(size=(B, T, NH, D)) * 0.7, jnp.float32) for _ in range(3))
    lengths = np.array([T, T - 100, 300, 1])
    mask = jnp.asarray((np.arange(T)[None] < lengths[:, None]).astype(np.int32))
    if segments:  # packed rows: a per-query bias [B, 1, T, T]
        seg = np.where(np.asarray(mask) > 0, 1 + np.arange(T)[None] // 200, 0)
        return q, k, v, segment_bias(jnp.asarray(seg), jnp.float32)
    return q, k, v, mask_bias(mask, jnp.float32)


@pytest.mark.parametrize("segments", [False, True])
def test_grouped_attention_equals_one_pass(onednn, segments):
    q, k, v, bias = _inputs(segments=segments)
    grouped = jax.jit(lambda q, k, v: attend_chunked(q, k, v, bias, plan=onednn))
    assert " scan[" in str(jax.make_jaxpr(grouped)(q, k, v))  # the groups are really there
    whole = jax.jit(lambda q, k, v: attend_plain(q, k, v, bias, 0.0, None))
    np.testing.assert_allclose(grouped(q, k, v), whole(q, k, v), atol=2e-6, rtol=1e-5)

    def loss(f):
        return lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))

    g1 = jax.jit(jax.grad(loss(grouped), argnums=(0, 1, 2)))(q, k, v)
    g2 = jax.jit(jax.grad(loss(whole), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, atol=1e-5 * float(np.abs(b).max()), rtol=1e-4)


def test_grouped_self_attention_equals_one_pass(onednn):
    r = np.random.default_rng(1)
    h = NH * D
    x = jnp.asarray(r.normal(size=(B * T, h)), jnp.float32)
    w = jnp.asarray(r.normal(size=(h, 3 * h)) * 0.2, jnp.float32)
    b = jnp.asarray(r.normal(size=3 * h) * 0.1, jnp.float32)
    _, _, _, bias = _inputs()

    def one_pass(x, w):
        qkv = (x @ w + b).reshape(B, T, 3, NH, D)
        return attend_plain(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], bias, 0.0, None).reshape(B * T, h)

    def grouped(x, w):
        return attention.self_attention(x, w, b, bias, num_heads=NH, batch=B, plan=onednn)

    assert " scan[" in str(jax.make_jaxpr(grouped)(x, w))
    np.testing.assert_allclose(jax.jit(grouped)(x, w), jax.jit(one_pass)(x, w), atol=2e-6, rtol=1e-5)
    gg = jax.jit(jax.grad(lambda x, w: jnp.sum(grouped(x, w) ** 2), argnums=(0, 1)))(x, w)
    gw = jax.jit(jax.grad(lambda x, w: jnp.sum(one_pass(x, w) ** 2), argnums=(0, 1)))(x, w)
    for a, c in zip(gg, gw):  # float32 rounding relative to each gradient's scale (jax 0.10: 4e-7 of it)
        np.testing.assert_allclose(a, c, atol=1e-5 * float(np.abs(c).max()), rtol=1e-4)


def test_grouped_dropout_is_deterministic_and_differs_per_group(onednn):
    r = np.random.default_rng(2)
    q, k = (jnp.asarray(np.repeat(r.normal(size=(1, T, NH, D)), B, axis=0), jnp.float32) for _ in range(2))
    v = jnp.ones_like(q)  # every output element is the kept probability mass of its row
    bias = mask_bias(jnp.ones((B, T), jnp.int32), jnp.float32)
    assert (
        attention_groups(B, NH, T, T, jnp.float32, onednn) == B
    )  # one row per group: the rows differ only by their group
    f = jax.jit(lambda rng: attend_chunked(q, k, v, bias, plan=onednn, rate=0.5, rng=rng))
    a = np.asarray(f(jax.random.key(0)))
    np.testing.assert_array_equal(a, f(jax.random.key(0)))
    assert not np.allclose(f(jax.random.key(1)), a)
    assert not np.allclose(a[0], a[1])  # each group folds in its index
    np.testing.assert_allclose(jax.jit(lambda: attend_chunked(q, k, v, bias, plan=onednn))(), 1.0, rtol=1e-5)
    # inverted dropout keeps each row's mass at 1 in expectation
    assert abs(float(a.mean()) - 1.0) < 0.02
