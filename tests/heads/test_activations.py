"""flaxheads' activations (explicit derivatives) against transformers' ``ACT2FN`` in PyTorch: values,
reverse-mode and forward-mode derivatives, and the same values with oneDNN's dots, where the
derivatives read their pre-activation behind a barrier."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxheads.layers.activations import get_activation

NAMES = ("gelu", "gelu_new", "gelu_pytorch_tanh", "silu", "swish", "quick_gelu")


def _torch_reference(name, x, w):
    torch = pytest.importorskip("torch")
    from transformers.activations import ACT2FN

    tx = torch.tensor(np.asarray(x), requires_grad=True)
    y = ACT2FN[name](tx)
    y.backward(torch.tensor(np.asarray(w)))
    return y.detach().numpy(), tx.grad.numpy()


@pytest.mark.parametrize("onednn", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_activation_values_and_derivatives_equal_transformers(name, onednn):
    # with oneDNN's dots (the plan's activation_barrier) the derivative's barrier is in the program
    k = jax.random.split(jax.random.PRNGKey(0), 2)
    x = 3.0 * jax.random.normal(k[0], (5, 64))
    w = jax.random.normal(k[1], x.shape)
    ref_y, ref_grad = _torch_reference(name, x, w)
    act = get_activation(name, barrier=onednn)
    np.testing.assert_allclose(jax.jit(act)(x), ref_y, atol=2e-6, rtol=1e-6)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(act(x) * w)))(x)
    np.testing.assert_allclose(grad, ref_grad, atol=2e-5, rtol=1e-5)
    _, tangent = jax.jit(lambda x, t: jax.jvp(act, (x,), (t,)))(x, w)
    np.testing.assert_allclose(tangent, ref_grad, atol=2e-5, rtol=1e-5)  # elementwise: J w = w * f'(x)


@pytest.mark.parametrize("name", ["gelu", "gelu_new", "silu"])
def test_the_barrier_is_in_differentiated_programs_only_where_asked(name):
    x = jnp.ones((4, 8))
    for barrier in (False, True):
        act = get_activation(name, barrier=barrier)
        grad_text = jax.jit(jax.grad(lambda x: jnp.sum(act(x)))).lower(x).as_text()
        assert ("optimization_barrier" in grad_text) is barrier
        assert "optimization_barrier" not in jax.jit(act).lower(x).as_text()  # inference keeps the fusion
