"""bfloat16 activations keep their statistics in float32, as PyTorch's autocast does: LayerNorm's
mean and variance, the attention softmax's max, exp and sum. Params stay float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxheads.layers.attention import attend
from flaxheads.layers.dense import matmul
from flaxheads.layers.masks import mask_bias
from flaxheads.layers.norms import layer_norm
from flaxheads.runtime import ComputePlan

H = 16


PLAN = ComputePlan.for_host(backend="cpu", xla_flags="")  # XLA's defaults: the CPU-tuned attention


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
        x.astype(jnp.float32), scale
    )
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
    found = _reductions(lambda q, k, v: attend(q, k, v, bias, 0.0, None, plan=PLAN, impl=impl), q, k, v)
    assert {name for name, _ in found} >= {"exp", "reduce_max", "reduce_sum"}, found
    assert all(dt == jnp.float32 for _, dt in found), found
    out = attend(q, k, v, bias, 0.0, None, plan=PLAN, impl=impl)
    want = attend(
        *(a.astype(jnp.float32) for a in (q, k, v)), bias.astype(jnp.float32), 0.0, None, plan=PLAN, impl=impl
    )
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
        want = torch.nn.functional.layer_norm(
            tx, (H,), torch.from_numpy(np.asarray(scale)), torch.from_numpy(np.asarray(bias)), 1e-12
        )
    got = np.asarray(layer_norm(x, scale, bias, 1e-12), np.float32)
    want = want.to(torch.bfloat16).float().numpy()
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-6)


def _matmul_operands():
    r = np.random.default_rng(2)
    x = jnp.asarray(r.normal(size=(3, 40, 24)), jnp.bfloat16)
    kernel = jnp.asarray(r.normal(size=(24, 56)) * 0.1, jnp.float32)
    ct = jnp.asarray(r.normal(size=(3, 40, 56)), jnp.bfloat16)
    return x, kernel, ct


def test_bf16_matmul_gradients_against_float32():
    """The CPU arrangement of a bf16 dense layer's backward: the input gradient is autodiff's bit for
    bit; the kernel gradient is the float32 product of the bf16 operands, rounded once to the
    float32 kernel's dtype (autodiff's rounds it to bf16 first)."""
    x, kernel, ct = _matmul_operands()
    y, vjp = jax.vjp(lambda x, k: matmul(x, k, PLAN), x, kernel)
    y_ref, vjp_ref = jax.vjp(lambda a, k: a @ k.astype(a.dtype), x, kernel)
    (dx, dk), (dx_ref, dk_ref) = vjp(ct), vjp_ref(ct)
    assert y.dtype == dx.dtype == jnp.bfloat16 and dk.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(dx_ref, np.float32))
    exact = np.einsum("btk,btn->kn", np.asarray(x, np.float64), np.asarray(ct, np.float64))
    np.testing.assert_allclose(np.asarray(dk), exact, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(dk_ref, np.float64) - exact).max() > 10 * np.abs(np.asarray(dk, np.float64) - exact).max()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the arrangement is XLA:CPU's")
def test_bf16_matmul_backward_dots_stay_bf16_with_untransposed_lhs():
    """XLA:CPU converts a bf16 dot to float32 when its left operand is transposed or it rounds its
    output to bf16: every dot of the backward pass takes bf16 operands, accumulates to float32
    and contracts the left operand's last axis (autodiff's kernel gradient contracts its first)."""
    x, kernel, ct = _matmul_operands()
    jaxpr = jax.make_jaxpr(lambda x, k, c: jax.vjp(lambda x, k: matmul(x, k, PLAN), x, k)[1](c))(x, kernel, ct)

    def eqns(j):  # every equation, inside custom-derivative and pjit sub-jaxprs too
        for e in j.eqns:
            yield e
            for v in e.params.values():
                sub = getattr(v, "jaxpr", v)
                if hasattr(sub, "eqns"):
                    yield from eqns(sub)

    # the backward's products: the input and the kernel gradients (the forward one is traced too)
    dots = [e for e in eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general" and e.outvars[0].aval.shape != ct.shape]
    assert sorted(e.outvars[0].aval.shape for e in dots) == [(24, 56), (120, 24)]
    for e in dots:
        (lhs_contract, _), _ = e.params["dimension_numbers"]
        assert [v.aval.dtype for v in e.invars] == [jnp.bfloat16, jnp.bfloat16]
        assert e.params["preferred_element_type"] == jnp.float32
        assert tuple(lhs_contract) == (e.invars[0].aval.ndim - 1,)


_ONEDNN_CHECK = """
import json
import numpy as np, jax, jax.numpy as jnp
from flaxheads.runtime import ComputePlan
from flaxheads.layers.attention import attend
from flaxheads.layers.dense import matmul
from flaxheads.layers.masks import mask_bias
r = np.random.default_rng(0)
x = jnp.asarray(r.normal(size=(256, 256)), jnp.bfloat16)  # above oneDNN's size threshold (2^24 flops)
kernel = jnp.asarray(r.normal(size=(256, 512)) * 0.05, jnp.float32)
q, k, v = (jnp.asarray(r.normal(size=(8, 64, 4, 32)) * s, jnp.bfloat16) for s in (32 ** -0.5, 1.0, 1.0))  # scaled q
bias = mask_bias(jnp.ones((8, 64), jnp.int32), jnp.float32)
plan = ComputePlan.for_host()  # this process's flags

def loss(x, kernel, q, k, v):
    y, a = matmul(x, kernel, plan), attend(q, k, v, bias, 0.0, None, plan=plan)
    # (a convert right after a dot becomes its output type)
    return (y * y).astype(jnp.float32).sum() + (a * a).astype(jnp.float32).sum()

def loss32(x, kernel, q, k, v):
    a = attend(q, k, v, bias.astype(jnp.float32), 0.0, None, plan=plan, impl="plain")
    return ((x @ kernel) ** 2).sum() + (a**2).sum()

args = (x, kernel, q, k, v)
grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
hlo = grad.lower(*args).compile().as_text()
calls = [l.split("=", 1)[1].strip()[:60] for l in hlo.splitlines() if "__onednn$matmul" in l and "custom-call(" in l]
dots = [l.split("=", 1)[1].strip()[:60] for l in hlo.splitlines() if " dot(" in l]
got = grad(*args)
want = jax.grad(loss32, argnums=(0, 1, 2))(*(a.astype(jnp.float32) for a in args))
err = [float(jnp.abs(g.astype(jnp.float32) - w).max() / jnp.abs(w).max()) for g, w in zip(got, want)]
print(json.dumps({"impl": plan.attention, "calls": calls, "dots": dots, "err": err}))
"""


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="oneDNN's dots are XLA:CPU's")
@pytest.mark.full  # a fresh process per flag set
@pytest.mark.parametrize("flags", ["ONEDNN_ALONE_FLAGS", "ONEDNN_FLAGS"])
def test_onednn_dots_keep_bf16_outputs_and_the_gradients(flags):
    """With oneDNN's dots every product of a bf16 dense layer's and attention's forward and backward
    that XLA does not fuse elsewhere reaches oneDNN with a bf16 output (bf16 x bf16 -> float32 ones
    run converted, ~10x slower), and the gradients stay those of the float32 model. With YNNPACK
    off (``ONEDNN_ALONE_FLAGS``) that is every product; with its reductions (``ONEDNN_FLAGS``, the
    choice on CPUs with AMX) a reduction fusion may take an attention product in too."""
    import json
    import os
    import subprocess
    import sys

    from flaxheads.runtime import xla_flags
    from flaxheads.runtime.cpu import CpuInfo

    env = {k: v for k, v in os.environ.items() if k not in (xla_flags.OPT_OUT_ENV, "FLAXHEADS_ATTENTION")}
    env["XLA_FLAGS"] = " ".join(getattr(xla_flags, flags))
    env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run([sys.executable, "-c", _ONEDNN_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if not out["calls"]:
        pytest.skip(
            "this jaxlib's XLA:CPU made no oneDNN matmul calls with these flags (jax 0.10, or a build without oneDNN)"
        )
    # the forward arrangement; a differentiated program runs the plain one's derivative either way
    assert out["impl"] == ("plain" if flags == "ONEDNN_ALONE_FLAGS" else "ynn")
    # forward, dx, dW of the dense layer; scores, P.V and their four gradients in attention
    assert len(out["calls"]) + len(out["dots"]) >= 7, out
    if flags == "ONEDNN_ALONE_FLAGS":
        assert not out["dots"], out
    if CpuInfo.read().bf16:  # without bf16 instructions oneDNN turns bf16 products into float32 ones itself
        assert all(c.lstrip("(").startswith("bf16[") for c in out["calls"] + out["dots"]), out
    assert max(out["err"]) < 3e-2, out["err"]
