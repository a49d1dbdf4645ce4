"""Poolers: hand-computed values, left/right padding, all-padding rows, and sentence-transformers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxheads as fh
from flaxheads.heads import linen
from flaxheads.heads import poolers as P

# one row, T=4, H=2; positions 0..2 real, 3 padding
H1 = np.array([[[1.0, -2.0], [3.0, 0.0], [5.0, 4.0], [100.0, 100.0]]], np.float32)
M1 = np.array([[1, 1, 1, 0]])


@pytest.mark.parametrize(
    "name,expected",
    [
        ("cls", [1.0, -2.0]),
        ("first_non_pad", [1.0, -2.0]),
        ("last", [5.0, 4.0]),
        ("mean", [3.0, 2.0 / 3.0]),
        ("max", [5.0, 4.0]),
        ("mean_sqrt_len", [9.0 / np.sqrt(3), 2.0 / np.sqrt(3)]),
        ("weighted_mean", [(1 * 1 + 2 * 3 + 3 * 5) / 6.0, (1 * -2 + 0 + 3 * 4) / 6.0]),
    ],
)
def test_hand_computed_values(name, expected):
    out = P.POOL_FUNCTIONS[name](jnp.asarray(H1), jnp.asarray(M1))
    np.testing.assert_allclose(np.asarray(out)[0], expected, rtol=1e-6)


def _left(h, m):
    """The same rows, left-padded."""
    hl, ml = np.zeros_like(h), np.zeros_like(m)
    for i in range(h.shape[0]):
        n = int(m[i].sum())
        hl[i, h.shape[1] - n :], ml[i, h.shape[1] - n :] = h[i, :n], 1
        hl[i, : h.shape[1] - n] = 7.0  # junk in padding must not matter
    return hl, ml


@pytest.mark.parametrize("name", ["first_non_pad", "last", "mean", "max", "mean_sqrt_len"])
def test_left_and_right_padding_agree(name):
    rng = np.random.default_rng(0)
    h = rng.normal(size=(3, 6, 5)).astype(np.float32)
    m = np.array([[1] * 6, [1] * 3 + [0] * 3, [1] + [0] * 5])
    hl, ml = _left(h, m)
    f = P.POOL_FUNCTIONS[name]
    np.testing.assert_allclose(f(jnp.asarray(h), jnp.asarray(m)), f(jnp.asarray(hl), jnp.asarray(ml)), atol=1e-6)


@pytest.mark.parametrize("name", list(P.POOL_FUNCTIONS) + ["attention", "bert", "deberta"])
def test_all_padding_row_is_finite(name):
    pooler = fh.make_pooler(name)
    h = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 4)), jnp.float32)
    m = jnp.array([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
    params = linen.module(pooler).init(jax.random.PRNGKey(0), h, m)
    out = np.asarray(linen.module(pooler).apply(params, h, m))
    assert np.isfinite(out).all()
    if name in ("mean", "max", "mean_sqrt_len", "weighted_mean", "attention"):
        np.testing.assert_array_equal(out[1], 0.0)
    # the gradient through an all-padding row is finite too (no 0/0 inside)
    g = jax.grad(lambda x: linen.module(pooler).apply(params, x, m).sum())(h)
    assert np.isfinite(np.asarray(g)).all()


def test_gpt2_and_bart_rules_via_masks():
    ids = jnp.array([[5, 6, 7, 0, 0], [0, 0, 5, 6, 7], [0, 0, 0, 0, 0]])
    h = jnp.arange(5, dtype=jnp.float32)[None, :, None] * jnp.ones((3, 1, 2))
    # GPT-2: rightmost token != pad (HF: (arange * (ids != pad)).argmax(-1)), all-pad row -> 0
    ref = np.argmax(np.arange(5) * (np.asarray(ids) != 0), axis=-1)
    np.testing.assert_array_equal(np.asarray(P.last_non_pad(h, ids != 0))[:, 0], ref)
    # BART: hidden state at the last <eos>
    ids = jnp.array([[3, 2, 4, 2, 1], [3, 4, 4, 4, 2]])
    np.testing.assert_array_equal(np.asarray(P.last_non_pad(h[:2], ids == 2))[:, 0], [3, 4])


def test_attention_pool_starts_as_mean_and_learns_weights():
    pooler = fh.AttentionPool()
    h = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 4)), jnp.float32)
    m = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    params = linen.module(pooler).init(jax.random.PRNGKey(0), h, m)
    np.testing.assert_allclose(linen.module(pooler).apply(params, h, m), P.mean(h, m), atol=1e-6)
    q = jnp.array([10.0, 0, 0, 0])  # a strong query picks the unmasked token with the largest feature 0
    out = linen.module(pooler).apply({"params": {"query": q}}, h, m)
    for i in range(2):
        n = int(m[i].sum())
        best = int(np.argmax(np.asarray(h)[i, :n, 0]))
        assert np.allclose(out[i], h[i, best], atol=0.2)


def test_concat_order_and_width():
    pooler = fh.make_pooler(["max", "cls", "mean"])
    out = linen.module(pooler).apply({}, jnp.asarray(H1), jnp.asarray(M1))
    np.testing.assert_allclose(out[0], [5.0, 4.0, 1.0, -2.0, 3.0, 2.0 / 3.0], rtol=1e-6)
    assert pooler.out_features(2) == 6


def test_names_are_validated():
    with pytest.raises(ValueError, match="valid poolers: .*mean"):
        fh.make_pooler("avg")
    with pytest.raises(ValueError, match="valid values"):
        fh.Pool("avg")
    with pytest.raises(ValueError, match="unknown pooler"):
        fh.make_pooler(["mean", "avg"])
    with pytest.raises(ValueError, match="does not take options"):
        fh.make_pooler("mean", features=3)
    with pytest.raises(ValueError, match="attn"):
        fh.SequenceSummary(summary_type="attn")
    with pytest.raises(ValueError, match="activation"):
        fh.make_pooler("bert", activation="tanhh")


def test_dense_pooler_and_summary_shapes():
    h, m = jnp.ones((2, 3, 8)), jnp.ones((2, 3))
    for pooler, width in [
        (fh.make_pooler("bert"), 8),
        (fh.make_pooler("deberta", features=8, dropout=0.1), 8),
        (fh.make_pooler("dense", features=5, source="mean"), 5),
        (fh.SequenceSummary(proj_to_labels=True, num_labels=3), 3),
        (fh.SequenceSummary(use_proj=False), 8),
    ]:
        params = linen.module(pooler).init(jax.random.PRNGKey(0), h, m)
        assert linen.module(pooler).apply(params, h, m).shape == (2, width) and pooler.out_features(8) == width


# ---- sentence-transformers' Pooling as the reference --------------------------------------

# ST 5.7's "cls" is the first unmasked token (position 0 under right padding): our first_non_pad.
ST_MODES = {
    "first_non_pad": "cls",
    "mean": "mean",
    "max": "max",
    "mean_sqrt_len": "mean_sqrt_len_tokens",
    "weighted_mean": "weightedmean",
    "last": "lasttoken",
}


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", list(ST_MODES))
def test_matches_sentence_transformers_pooling(name, side):
    torch = pytest.importorskip("torch")
    import sentence_transformers

    try:
        from sentence_transformers.sentence_transformer.modules import Pooling
    except ImportError:
        from sentence_transformers.models import Pooling

    if name == "weighted_mean" and side == "left" and int(sentence_transformers.__version__.split(".")[0]) < 6:
        pytest.skip("sentence-transformers < 6 weights absolute positions under left padding; flaxheads follows 6")

    rng = np.random.default_rng(3)
    h = rng.normal(size=(4, 7, 6)).astype(np.float32)
    m = np.array([[1] * 7, [1] * 5 + [0] * 2, [1] * 2 + [0] * 5, [1] + [0] * 6])
    if side == "left":
        h, m = _left(h, m)
    st = Pooling(6, pooling_mode=ST_MODES[name])
    ref = st({"token_embeddings": torch.tensor(h), "attention_mask": torch.tensor(m)})["sentence_embedding"]
    got = P.POOL_FUNCTIONS[name](jnp.asarray(h), jnp.asarray(m))
    np.testing.assert_allclose(np.asarray(got), ref.numpy(), atol=1e-5)
    if name == "first_non_pad" and side == "right":  # HF's position-0 rule agrees under right padding
        np.testing.assert_allclose(np.asarray(P.first_token(jnp.asarray(h), jnp.asarray(m))), ref.numpy(), atol=1e-6)
