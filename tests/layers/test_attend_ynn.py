"""Attention arranged for YNNPACK's fusions beside oneDNN's dots (``layers.attention.attend_ynn``): chosen
only where the compute plan gives oneDNN the dots and YNNPACK the reductions, without dropout;
the values of the plain arrangement, and its derivatives exactly.

A plan built from other flags than the process's changes the arrangement traced, not the XLA
running it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxheads.layers.attention import attend_chunked, attend_plain, attend_ynn
from flaxheads.layers.masks import mask_bias, segment_bias
from flaxheads.runtime import ComputePlan
from flaxheads.runtime.xla_flags import CPU_FLAGS, ONEDNN_ALONE_FLAGS, ONEDNN_FLAGS

B, T, NH, D = 3, 24, 4, 8


@pytest.fixture
def qkv():
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=(B, T, NH, D)), jnp.float32) for _ in range(3))
    mask = np.ones((B, T), np.int32)
    mask[1, 15:] = 0
    mask[2, 5:] = 0
    return q, k, v, mask_bias(jnp.asarray(mask), jnp.float32)


def cpu_plan(flags, **kw) -> ComputePlan:
    return ComputePlan.for_host(xla_flags=" ".join(flags), backend="cpu", jax_version="0.12.0.1", **kw)


def test_chosen_with_onednn_dots_and_ynnpack_reductions_only(monkeypatch):
    monkeypatch.delenv("FLAXHEADS_ATTENTION", raising=False)
    plan = cpu_plan(ONEDNN_FLAGS)
    assert plan.attention_for(dropout=False) == "ynn"
    assert plan.attention_for(dropout=True) == "plain"  # dropout: the unfused arrangement
    assert cpu_plan(ONEDNN_ALONE_FLAGS).attention_for(dropout=False) == "plain"
    assert cpu_plan(CPU_FLAGS).attention_for(dropout=False) == "cpu"
    assert cpu_plan(CPU_FLAGS, attention="ynn").attention_for(dropout=False) == "ynn"  # asked for by name


@pytest.mark.parametrize("causal", [False, True])
def test_values_and_gradients_are_the_plain_arrangements(qkv, causal):
    q, k, v, bias = qkv
    got = jax.jit(lambda *a: attend_ynn(*a, causal))(q, k, v, bias)
    want = attend_plain(q, k, v, bias, 0.0, None, causal)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)

    def grads(fn):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v))), argnums=(0, 1, 2)))(q, k, v)

    for g, w in zip(
        grads(lambda q, k, v: attend_ynn(q, k, v, bias, causal)),
        grads(lambda q, k, v: attend_plain(q, k, v, bias, 0.0, None, causal)),
    ):
        np.testing.assert_array_equal(g, w)  # the derivative is the plain arrangement's


def test_packed_rows_and_bfloat16(qkv):
    q, k, v, _ = qkv
    seg = segment_bias(jnp.asarray([[1] * 10 + [2] * 10 + [0] * 4, [1] * 24, [3] * 12 + [4] * 12]), jnp.float32)
    np.testing.assert_allclose(attend_ynn(q, k, v, seg), attend_plain(q, k, v, seg, 0.0, None), atol=2e-6, rtol=1e-5)
    qb, kb, vb = (a.astype(jnp.bfloat16) for a in (q, k, v))
    got = attend_ynn(qb, kb, vb, qkv[3])
    assert got.dtype == jnp.bfloat16
    # float32 statistics: as close to the float32 result as the plain arrangement's bf16 is
    want = np.asarray(attend_plain(q, k, v, qkv[3], 0.0, None))
    plain_err = np.abs(np.asarray(attend_plain(qb, kb, vb, qkv[3], 0.0, None), np.float32) - want).max()
    assert np.abs(np.asarray(got, np.float32) - want).max() <= 1.5 * plain_err + 1e-3


def test_chunked_attention_takes_no_groups_with_it(monkeypatch):
    """Groups were measured for oneDNN's softmax; YNNPACK's fused attention ran faster without them."""
    monkeypatch.delenv("FLAXHEADS_ATTENTION", raising=False)
    big = jax.ShapeDtypeStruct((4, 768, 4, 8), jnp.float32)  # 37.7 MB of scores: past where groups start
    bias = jax.ShapeDtypeStruct((4, 1, 1, 768), jnp.float32)
    loops = {}
    for name, flags in (("ONEDNN_FLAGS", ONEDNN_FLAGS), ("ONEDNN_ALONE_FLAGS", ONEDNN_ALONE_FLAGS)):
        plan = cpu_plan(flags)
        loops[name] = "while" in jax.jit(lambda *a: attend_chunked(*a, plan=plan)).lower(big, big, big, bias).as_text()
    assert loops == {"ONEDNN_FLAGS": False, "ONEDNN_ALONE_FLAGS": True}


@pytest.mark.parametrize("causal", [False, True])
def test_values_equal_pytorch_sdpa(qkv, causal):
    """Against ``torch.nn.functional.scaled_dot_product_attention`` with the same additive mask
    (q is already scaled, as :func:`flaxheads.layers.attention.fused_qkv` leaves it, so ``scale=1``)."""
    torch = pytest.importorskip("torch")
    q, k, v, bias = qkv
    mask = np.broadcast_to(np.asarray(bias), (B, 1, T, T)).copy()
    if causal:
        mask[..., np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] = np.finfo(np.float32).min
    t = [torch.from_numpy(np.asarray(a).transpose(0, 2, 1, 3).copy()) for a in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*t, attn_mask=torch.from_numpy(mask), scale=1.0)
    got = attend_ynn(q, k, v, bias, causal)
    np.testing.assert_allclose(np.asarray(got), want.numpy().transpose(0, 2, 1, 3), atol=2e-6, rtol=1e-5)
