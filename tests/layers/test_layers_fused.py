"""The fused attention path (``jax.nn.dot_product_attention``, forced on CPU with XLA's
implementation) against the CPU-tuned and textbook arrangements, PyTorch's
``scaled_dot_product_attention`` and PyTorch BERT / GPT-2 (nobody here wrote those)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxheads.errors import ConfigError
from flaxheads.layers import attention
from flaxheads.layers.attention import attend, attend_chunked, attend_cpu, attend_fused, attend_plain
from flaxheads.layers.masks import mask_bias, segment_bias
from flaxheads.runtime import ComputePlan

pytestmark = pytest.mark.legacy

B, T, NH, D = 3, 8, 2, 8

PLAN = ComputePlan.for_host(backend="cpu", xla_flags="")  # XLA's defaults: the CPU-tuned attention


def _qkv(seed=0, dtype=jnp.float32, tq=T):
    r = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(r.normal(size=(B, n, NH, D)) * 0.7, dtype) for n in (tq, T, T))
    return q, k, v


def _key_mask():
    m = np.ones((B, T), np.int32)
    m[1, 5:] = 0  # right padding
    m[2, :3] = 0  # left padding (with causal: the first queries see no key)
    return jnp.asarray(m)


def _segments():
    s = np.array(
        [
            [1, 1, 1, 2, 2, 3, 3, 3],
            [1, 1, 2, 2, 2, 2, 0, 0],  # padding queries see nothing
            [1, 1, 1, 1, 1, 1, 1, 1],
        ]
    )
    return jnp.asarray(s)


CASES = {
    "key_mask": lambda dt: (mask_bias(_key_mask(), dt), False),
    "causal": lambda dt: (mask_bias(jnp.ones((B, T), jnp.int32), dt), True),
    "causal_key_mask": lambda dt: (mask_bias(_key_mask(), dt), True),
    "segments": lambda dt: (segment_bias(_segments(), dt), False),
    "segments_causal": lambda dt: (segment_bias(_segments(), dt), True),
}


def _seen(bias, causal):
    """[B, Tq, 1, 1]: which queries see at least one key."""
    keep = np.asarray(bias) == 0
    if causal:
        keep = keep & np.tril(np.ones((T, T), bool))
    return keep.any(-1).transpose(0, 2, 1)[..., None]


def _value_and_grads(fn, q, k, v, seen=True):
    """Output and the q/k/v gradients of a random projection of it, read only on the queries
    that see a key (a query that sees none is padding: no loss reads it, and there the additive
    bias passes a uniform softmax's derivative through the masked scores to q and k, the boolean
    mask none)."""
    w = jnp.asarray(np.random.default_rng(9).normal(size=q.shape) * seen, jnp.float32)

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * w)

    return fn(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_equals_cpu_and_plain_values_and_gradients(case):
    q, k, v = _qkv()
    bias, causal = CASES[case](jnp.float32)
    seen = _seen(bias, causal)
    fused = _value_and_grads(lambda q, k, v: attend_fused(q, k, v, bias, causal, implementation="xla"), q, k, v, seen)
    for ref_fn in (attend_cpu, attend_plain):
        ref = _value_and_grads(lambda q, k, v: ref_fn(q, k, v, bias, 0.0, None, causal), q, k, v, seen)
        np.testing.assert_allclose(fused[0], ref[0], atol=1e-5, rtol=1e-5)
        for g, gr in zip(fused[1], ref[1]):
            np.testing.assert_allclose(g, gr, atol=1e-5, rtol=1e-5)
    assert np.isfinite(np.asarray(fused[0])).all()
    assert all(np.isfinite(np.asarray(g)).all() for g in fused[1])


def test_matches_torch_sdpa_on_rows_that_see_keys():
    torch = pytest.importorskip("torch")
    q, k, v = _qkv(seed=3)
    keep = np.asarray(_segments())[:, :, None] == np.asarray(_segments())[:, None, :]
    keep &= np.asarray(_segments())[:, None, :] > 0
    keep &= np.tril(np.ones((T, T), bool))[None]
    ours = attend_fused(q, k, v, segment_bias(_segments(), jnp.float32), causal=True, implementation="xla")
    t = [torch.tensor(np.asarray(a)).permute(0, 2, 1, 3) for a in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*t, attn_mask=torch.tensor(keep)[:, None], scale=1.0)
    rows = keep.any(-1)
    np.testing.assert_allclose(np.asarray(ours)[rows], ref.permute(0, 2, 1, 3).numpy()[rows], atol=1e-5)


def test_query_seeing_no_key_is_the_mean_of_values_as_with_the_additive_bias():
    q, k, v = _qkv(seed=1)
    bias = mask_bias(jnp.zeros((B, T), jnp.int32).at[0].set(1), jnp.float32)  # rows 1 and 2 fully masked
    out = attend_fused(q, k, v, bias, implementation="xla")
    mean_v = np.broadcast_to(np.asarray(v).mean(axis=1, keepdims=True), out.shape)
    np.testing.assert_allclose(out[1:], mean_v[1:], atol=1e-6)
    np.testing.assert_allclose(out, attend(q, k, v, bias, 0.0, None, plan=PLAN), atol=1e-5)


@pytest.mark.parametrize("case", ["key_mask", "causal_key_mask", "segments"])
def test_bf16_within_tolerance_of_float32(case):
    """bf16 inputs: the fused path's error against the float32 result is within 2e-2 (values
    ~1) and no larger than the bf16 textbook path's (its scores and softmax stay in float32)."""
    q32, k32, v32 = _qkv(seed=2)
    bias32, causal = CASES[case](jnp.float32)
    ref = np.asarray(attend_plain(q32, k32, v32, bias32, 0.0, None, causal))
    q, k, v = (a.astype(jnp.bfloat16) for a in (q32, k32, v32))
    bias = CASES[case](jnp.bfloat16)[0]
    fused = np.asarray(attend_fused(q, k, v, bias, causal, implementation="xla").astype(jnp.float32))
    plain = np.asarray(attend_plain(q, k, v, bias, 0.0, None, causal).astype(jnp.float32))
    assert np.isfinite(fused).all()
    err, err_plain = np.abs(fused - ref).max(), np.abs(plain - ref).max()
    assert err < 2e-2 and err <= 1.5 * err_plain + 4e-3, (err, err_plain)
    seen = _seen(bias32, causal)
    _, g = _value_and_grads(lambda q, k, v: attend_fused(q, k, v, bias, causal, implementation="xla"), q, k, v, seen)
    _, g_ref = _value_and_grads(lambda q, k, v: attend_plain(q, k, v, bias32, 0.0, None, causal), q32, k32, v32, seen)
    for a, r in zip(g, g_ref):
        np.testing.assert_allclose(np.asarray(a.astype(jnp.float32)), r, atol=5e-2)


def test_cross_length_causal_aligns_queries_with_the_last_keys():
    q, k, v = _qkv(seed=4, tq=3)
    bias = mask_bias(_key_mask(), jnp.float32)
    np.testing.assert_allclose(
        attend_fused(q, k, v, bias, True, implementation="xla"), attend_plain(q, k, v, bias, 0.0, None, True), atol=1e-5
    )


def test_attention_impl_policy(monkeypatch):
    monkeypatch.delenv("FLAXHEADS_ATTENTION", raising=False)
    assert jax.default_backend() == "cpu"
    assert PLAN.attention_for(dropout=False) == "cpu"
    assert PLAN.attention_for(dropout=False, impl="fused") == "fused"
    # attention dropout has no fused kernel: the backend's unfused arrangement
    assert PLAN.attention_for(dropout=True, impl="fused") == "cpu"
    monkeypatch.setenv("FLAXHEADS_ATTENTION", "plain")
    plain = ComputePlan.for_host(backend="cpu", xla_flags="")  # the variable is read when a plan is built
    assert plain.attention_for(dropout=False) == "plain"
    assert plain.attention_for(dropout=False, impl="fused") == "fused"  # the argument wins over the variable
    assert ComputePlan.for_host(backend="cpu", xla_flags="", attention="fused").attention == "fused"
    monkeypatch.setenv("FLAXHEADS_ATTENTION", "flash")
    with pytest.raises(ConfigError, match="FLAXHEADS_ATTENTION"):
        ComputePlan.for_host(backend="cpu", xla_flags="")


def test_attend_dispatch_and_chunks(monkeypatch):
    calls = []
    real = attention.attend_fused
    monkeypatch.setattr(attention, "attend_fused", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = _qkv(seed=5)
    bias = mask_bias(_key_mask(), jnp.float32)
    want = attend_chunked(q, k, v, bias, plan=PLAN.replace(attention_chunks=3), impl="cpu")
    out = attend_chunked(q, k, v, bias, plan=PLAN, impl="fused")  # "auto" chunks: one fused call
    assert len(calls) == 1
    np.testing.assert_allclose(out, want, atol=1e-5)
    # attention dropout stays on the unfused path (same bits as the CPU arrangement)
    rng = jax.random.key(3)
    np.testing.assert_array_equal(
        attend(q, k, v, bias, 0.2, rng, plan=PLAN, impl="fused"), attend(q, k, v, bias, 0.2, rng, plan=PLAN)
    )
    assert len(calls) == 1


@pytest.mark.parametrize("arch,side", [("bert", "left"), ("gpt2", "right")])
def test_backbone_with_fused_attention_matches_pytorch(tmp_path, monkeypatch, arch, side):
    from tests.hf_tiny import check_hidden_states, save_tiny

    calls = []
    real = attention.attend_fused
    monkeypatch.setattr(attention, "attend_fused", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setenv("FLAXHEADS_ATTENTION", "fused")  # read when the backbone's plan is built
    path, pt = save_tiny(tmp_path, arch)
    check_hidden_states(path, pt, arch, side=side)
    assert calls, "the fused path did not run"


def test_cudnn_request_off_gpu_falls_back_to_xla():
    """What a GPU whose cuDNN refuses the shapes gets: XLA's kernel, same values."""
    q, k, v = _qkv(seed=6)
    bias = segment_bias(_segments(), jnp.float32)
    np.testing.assert_allclose(
        attend_fused(q, k, v, bias, True, implementation="cudnn"),
        attend_fused(q, k, v, bias, True, implementation="xla"),
        atol=1e-6,
    )


def test_cudnn_is_asked_for_only_where_the_plan_runs_on_a_gpu_and_cudnn_takes_the_shape():
    from flaxheads.layers.attention import fused_kernel

    bf16, f32 = jnp.zeros((1, 4, 2, 64), jnp.bfloat16), jnp.zeros((1, 4, 2, 64), jnp.float32)
    assert fused_kernel(bf16, "gpu") == "cudnn"
    assert fused_kernel(bf16, "cpu") == fused_kernel(f32, "gpu") == "xla"
    assert fused_kernel(jnp.zeros((1, 4, 2, 256), jnp.bfloat16), "gpu") == "xla"  # head dim past 128
    assert fused_kernel(jnp.zeros((1, 4, 2, 60), jnp.bfloat16), "gpu") == "xla"  # not a multiple of 8
