"""bfloat16 activations keep their statistics in float32, as PyTorch's autocast does: LayerNorm's
mean and variance, the attention softmax's max, exp and sum. Params stay float32."""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from flaxheads.backbones.layers import attend, layer_norm, mask_bias

H = 16


def _x(dtype):
    r = np.random.default_rng(0)
    return jnp.asarray(r.normal(size=(4, H)) * 3 + 5, dtype)  # an offset mean: bf16 statistics would lose it


def _params():
    r = np.random.default_rng(1)
    return jnp.asarray(r.normal(size=H), jnp.float32), jnp.asarray(r.normal(size=H), jnp.float32)


def test_bf16_layer_norm_is_the_float32_one_rounded_once():
    scale, bias = _params()
    x = _x(jnp.bfloat16)
    got = layer_norm(x, scale, bias, 1e-12)
    want = layer_norm(x.astype(jnp.float32), scale, bias, 1e-12).astype(jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    # the gradient too: bf16 cotangent in, the float32 derivative, one rounding out
    ct = _x(jnp.bfloat16)[::-1]
    gx, gs = jax.grad(lambda x, s: jnp.vdot(layer_norm(x, s, bias, 1e-12).astype(jnp.float32), ct), (0, 1))(x, scale)
    wx, ws = jax.grad(lambda x, s: jnp.vdot(layer_norm(x, s, bias, 1e-12), ct.astype(jnp.float32)), (0, 1))(
        x.astype(jnp.float32), scale)
    assert gx.dtype == jnp.bfloat16 and gs.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(gx, np.float32), np.asarray(wx.astype(jnp.bfloat16), np.float32))
    np.testing.assert_allclose(gs, ws, rtol=1e-2, atol=1e-2)  # scale's gradient sums bf16-rounded products


def _reductions(fn, *args):
    """(primitive name, operand dtype) of every exp / max / sum in ``fn``'s program, nested ones too."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("exp", "reduce_max", "reduce_sum"):
                found.append((eqn.primitive.name, eqn.invars[0].aval.dtype))
            for value in eqn.params.values():  # custom_jvp / pjit bodies
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.parametrize("impl", ["cpu", "plain"])
def test_bf16_attention_softmax_runs_in_float32(impl):
    r = np.random.default_rng(2)
    q, k, v = (jnp.asarray(r.normal(size=(2, 8, 2, 4)), jnp.bfloat16) for _ in range(3))
    bias = mask_bias(jnp.ones((2, 8), jnp.int32), jnp.bfloat16)
    found = _reductions(lambda q, k, v: attend(q, k, v, bias, 0.0, None, impl=impl), q, k, v)
    assert {name for name, _ in found} >= {"exp", "reduce_max", "reduce_sum"}, found
    assert all(dt == jnp.float32 for _, dt in found), found
    out = attend(q, k, v, bias, 0.0, None, impl=impl)
    want = attend(*(a.astype(jnp.float32) for a in (q, k, v)), bias.astype(jnp.float32), 0.0, None, impl=impl)
    assert out.dtype == jnp.bfloat16
    # only the P.V operand and the output are rounded to bf16: within a few bf16 ulps of float32
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=2e-2)


def test_bf16_layer_norm_matches_pytorch_autocast():
    """PyTorch's CPU layer_norm on a bf16 activation with float32 weights under autocast (its
    statistics in float32, the output rounded to bf16) equals flaxheads' bf16 LayerNorm to within
    one bf16 rounding step."""
    torch = pytest.importorskip("torch")
    scale, bias = _params()
    x = _x(jnp.bfloat16)
    tx = torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.nn.functional.layer_norm(tx, (H,), torch.from_numpy(np.asarray(scale)),
                                              torch.from_numpy(np.asarray(bias)), 1e-12)
    got = np.asarray(layer_norm(x, scale, bias, 1e-12), np.float32)
    want = want.to(torch.bfloat16).float().numpy()
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6)
