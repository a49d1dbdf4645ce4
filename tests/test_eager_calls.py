"""A model or a backbone called outside ``jit``/``grad``/``vmap`` runs as one compiled program per
input shape: the numbers of the traced function, gradients through the plain function, and a copy
(a bfloat16 base) computes with its own params without keeping the original alive."""
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxheads as fh
from flaxheads.programs import jit_count

IDS = np.array([[2, 10, 11, 12, 3, 0], [2, 13, 14, 3, 0, 0]], np.int32)
MASK = (IDS != 0).astype(np.int32)


@pytest.fixture(scope="module")
def model(tiny_bert):
    return fh.from_pretrained(tiny_bert, pooler="mean", head="linear", num_labels=3)


def test_eager_apply_is_one_program_per_shape_with_the_traced_numbers(model):
    got = np.asarray(model.apply(model.params, IDS, MASK))
    want = np.asarray(jax.jit(lambda p: model.apply(p, IDS, MASK))(model.params))
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    program = model.__dict__["_compiled__apply"].fn
    model(IDS, MASK)  # the same shape again: no new program
    assert jit_count(program) == 1
    model.apply(model.params, IDS[:, :4], MASK[:, :4])
    assert jit_count(program) == 2
    grads = jax.grad(lambda p: model.apply(p, IDS, MASK).sum())(model.params)  # inside grad: the plain function
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_eager_backbone_call_equals_its_encode(model):
    bb = model.backbone
    got = np.asarray(bb(IDS, MASK)[0])
    np.testing.assert_allclose(got, np.asarray(jax.jit(lambda p: bb.encode(p, IDS, MASK))(bb.params)), atol=1e-6)
    assert jit_count(bb.__dict__["_compiled_encode"].fn) == 1


def test_a_copy_computes_with_its_own_params_and_lets_the_original_go(tiny_bert):
    m = fh.from_pretrained(tiny_bert, pooler="mean", head="linear", num_labels=3)
    full = np.asarray(m.backbone(IDS, MASK)[0])
    half = m.with_base_dtype(jnp.bfloat16)  # a shallow copy of the backbone, bfloat16 params
    got = np.asarray(half.backbone(IDS, MASK)[0])
    want = np.asarray(jax.jit(lambda p: half.backbone.encode(p, IDS, MASK))(half.params["backbone"]))
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert np.abs(got - full).max() > 0  # bfloat16 params: not the original's program
    assert half.backbone.__dict__["_compiled_encode"].owner == id(half.backbone)
    original = weakref.ref(m.backbone)
    del m
    gc.collect()
    assert original() is None
