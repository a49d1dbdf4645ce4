"""NNX poolers and heads against the functional (Linen) path: every pooler x every head, and every
HF preset, on one tiny BERT's hidden states, with the same params: the same logits and the same
gradients (params and hidden states), bit for bit in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_tiny import H, head_specs, padded_batch, pooler_specs, tiny_config

import flaxheads as fh
from flaxheads import nnx as fnnx
from flaxheads.errors import ConfigError
from flaxheads.heads import linen
from flaxheads.heads.presets import PRESETS, preset_for

POOLERS, HEADS = pooler_specs(), head_specs()


@pytest.fixture(scope="module")
def bert_hidden(tiny_model):
    """One forward of a tiny BERT: hidden states [3, 9, H] of a right-padded batch and its mask."""
    path, _ = tiny_model("bert")
    model = fh.from_pretrained(path)
    ids, mask = padded_batch("bert", tiny_config("bert"))
    hidden, _ = jax.jit(model.features)(model.params["backbone"], jnp.asarray(ids), jnp.asarray(mask))
    return hidden, jnp.asarray(mask)


def _perturbed(seq, hidden, mask, seed=0):
    """Head params of Linen's shapes with random values (numpy: no per-shape init programs to compile)."""
    shapes = jax.eval_shape(linen.module(seq).init, jax.random.PRNGKey(seed), hidden, mask).get("params", {})
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(0.3 * rng.normal(size=x.shape), jnp.float32), shapes)


def _drop_empty(tree):
    return {
        k: _drop_empty(v) if isinstance(v, dict) else v
        for k, v in tree.items()
        if not (isinstance(v, dict) and not _drop_empty(v))
    }


def check_same(seq, hidden, mask):
    """The NNX head on the Linen head's params: identical outputs and gradients."""
    params = _perturbed(seq, hidden, mask)
    mod = nnx.eval_shape(lambda: fnnx.SequenceHead(seq, hidden.shape[-1]))  # deterministic: no rng state used
    fnnx.load_head_params(mod, params)
    assert jax.tree.all(jax.tree.map(np.array_equal, fnnx.head_params(mod), params))  # one tree serves both
    want = linen.module(seq).apply({"params": params}, hidden, mask)
    got = mod(hidden, mask)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    w = jnp.asarray(np.random.default_rng(0).normal(size=want.shape), jnp.float32)
    g_params, g_hidden = jax.grad(
        lambda p, h: jnp.sum(linen.module(seq).apply({"params": p}, h, mask) * w), argnums=(0, 1)
    )(params, hidden)
    n_params, n_hidden = nnx.grad(lambda m, h: jnp.sum(m(h, mask) * w), argnums=(0, 1))(mod, hidden)
    np.testing.assert_array_equal(np.asarray(n_hidden), np.asarray(g_hidden))
    n_params = _drop_empty(nnx.to_pure_dict(n_params))
    assert jax.tree.structure(n_params) == jax.tree.structure(g_params)
    for a, b in zip(jax.tree.leaves(n_params), jax.tree.leaves(g_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("pooler", POOLERS, ids=str)
def test_every_pooler_with_every_head(bert_hidden, pooler):
    for head in HEADS:
        check_same(fh.SequenceHead(fh.make_pooler(pooler), head), *bert_hidden)


def test_every_preset(bert_hidden):
    for arch in PRESETS:
        p = preset_for(tiny_config(arch), 3)
        check_same(fh.SequenceHead(p.pooler, p.head), *bert_hidden)


def test_dropout_draws_from_rngs(bert_hidden):
    hidden, mask = bert_hidden
    seq = fh.SequenceHead(fh.make_pooler("mean"), fh.MLPHead(3, dropout=0.5, input_dropout=0.5))
    mod = fnnx.SequenceHead(seq, H, rngs=nnx.Rngs(0))
    eval_out = mod(hidden, mask)
    a, b = mod(hidden, mask, deterministic=False), mod(hidden, mask, deterministic=False)
    assert not np.array_equal(a, eval_out) and not np.array_equal(a, b)  # active, a fresh mask per call
    np.testing.assert_array_equal(mod(hidden, mask), eval_out)


def test_params_must_fit(bert_hidden):
    seq = fh.SequenceHead(fh.make_pooler("bert"), fh.LinearHead(3))
    other = _perturbed(fh.SequenceHead(fh.make_pooler("bert"), fh.LinearHead(4)), *bert_hidden)
    with pytest.raises(ConfigError, match="do not fit"):
        fnnx.SequenceHead(seq, H, params=other)
