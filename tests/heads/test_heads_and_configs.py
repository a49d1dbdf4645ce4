"""Heads, JSON configs of every pooler/head/preset, and composition errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_tiny import head_specs, pooler_specs, tiny_config

import flaxheads as fh
from flaxheads.heads import linen
from flaxheads.heads.presets import PRESETS, preset_for

ALL_POOLERS, ALL_HEADS = pooler_specs(), head_specs()


def _presets():
    out = []
    for arch in PRESETS:
        pytest.importorskip("transformers")
        p = preset_for(tiny_config(arch), 3)
        out.append(fh.SequenceHead(p.pooler, p.head))
    return out


@pytest.mark.parametrize("pooler", ALL_POOLERS, ids=str)
@pytest.mark.parametrize("head", ALL_HEADS, ids=lambda h: type(h).__name__)
def test_every_combination_runs_and_round_trips(pooler, head):
    seq = fh.SequenceHead(fh.make_pooler(pooler), head)
    text = fh.config.to_json(seq)
    back = fh.config.from_json(text)
    assert back == seq and fh.config.to_json(back) == text
    json.loads(text)  # plain JSON
    h = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 8)), jnp.float32)
    m = jnp.array([[1, 1, 1, 0, 0], [1] * 5])
    params = linen.module(seq).init(jax.random.PRNGKey(0), h, m)
    out = linen.module(seq).apply(params, h, m)
    assert out.dtype == jnp.float32 and np.isfinite(np.asarray(out)).all()
    width = head.out_features() or seq.pooler.out_features(8)
    assert out.shape == (2, width)
    # dropout is active in training mode and needs an rng
    linen.module(seq).apply(params, h, m, deterministic=False, rngs={"dropout": jax.random.PRNGKey(1)})


def test_every_preset_round_trips():
    for seq in _presets():
        assert fh.config.from_json(fh.config.to_json(seq)) == seq


def test_projection_head_normalises():
    head = fh.ProjectionHead(features=4, normalize=True)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 8)), jnp.float32)
    params = linen.module(head).init(jax.random.PRNGKey(0), x)
    np.testing.assert_allclose(np.linalg.norm(np.asarray(linen.module(head).apply(params, x)), axis=-1), 1.0, rtol=1e-6)


def test_mlp_head_structure():
    head = fh.MLPHead(5, hidden_dims=(16, None), layer_norm=True)
    params = linen.module(head).init(jax.random.PRNGKey(0), jnp.ones((1, 8)))["params"]
    assert params["dense_0"]["kernel"].shape == (8, 16)
    assert params["dense_1"]["kernel"].shape == (16, 16)  # None = input width
    assert params["out_proj"]["kernel"].shape == (16, 5) and "norm_1" in params


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda: fh.LinearHead(0), "num_labels must be a positive integer"),
        (lambda: fh.MLPHead(3, dropout=1.5), r"dropout must be in \[0, 1\)"),
        (lambda: fh.MLPHead(3, activation="gelu_fancy"), "unknown activation"),
        (lambda: fh.ProjectionHead(features=()), "at least one output width"),
        (lambda: fh.make_head("svm"), "valid heads"),
        (lambda: fh.config.from_dict({"type": "linear", "num_labels": 2, "dropuot": 0.1}), "unknown fields"),
        (lambda: fh.config.from_dict({"type": "nope"}), "unknown config type"),
    ],
)
def test_bad_head_configs(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()
