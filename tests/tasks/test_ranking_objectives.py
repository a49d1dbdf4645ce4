"""Ranking objectives against the references on the same scores: TRL's reward loss (its
``RewardTrainer.compute_loss``), sentence-transformers' CrossEncoder losses (with a stub model
returning the given scores) and ``torch.nn.MarginRankingLoss``."""

from __future__ import annotations

import collections
import types

import jax.numpy as jnp
import numpy as np
import pytest

from flaxheads.tasks.ranking.objectives import (
    listnet,
    listwise_softmax,
    objective_loss,
    pairwise_hinge,
    pairwise_logistic,
    pointwise_bce,
)

torch = pytest.importorskip("torch")

RNG = np.random.default_rng(7)
G, K = 6, 4
SCORES = RNG.normal(0, 2, (G, K)).astype(np.float32)
ONES = np.ones(G, np.float32)


def _pairs():
    return SCORES[:, 0], SCORES[:, 1]


def trl_reward_loss(chosen, rejected, margin=None):
    """TRL's RewardTrainer.compute_loss on a model whose logits are the given rewards."""
    RewardTrainer = pytest.importorskip("trl.trainer.reward_trainer").RewardTrainer

    logits = torch.tensor(np.concatenate([chosen, rejected]))[:, None]
    model = lambda **kw: types.SimpleNamespace(logits=logits)  # noqa: E731
    ident = types.SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x)
    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        accelerator=ident,
        args=types.SimpleNamespace(center_rewards_coefficient=None),
        _total_train_tokens=0,
        _tp_size=1,
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
    )
    inputs = {"attention_mask": torch.ones(2 * len(chosen), 3, dtype=torch.long)}
    if margin is not None:
        inputs["margin"] = torch.tensor(margin)
    return float(RewardTrainer.compute_loss(trainer, model, inputs))


def _preference(chosen, rejected):
    return jnp.stack([chosen, rejected], 1), jnp.asarray([[1.0, 0.0]] * len(chosen)), jnp.ones((len(chosen), 2), bool)


@pytest.mark.parametrize("with_margin", [False, True])
def test_bradley_terry_equals_trl_reward_loss(with_margin):
    c, r = _pairs()
    margin = RNG.uniform(0, 1, G).astype(np.float32) if with_margin else None
    s, y, m = _preference(c, r)
    ours = float(pairwise_logistic(s, y, m, ONES, margin=margin))
    assert abs(ours - trl_reward_loss(c, r, margin)) < 1e-6


def test_hinge_equals_margin_ranking_loss():
    c, r = _pairs()
    ref = torch.nn.MarginRankingLoss(margin=0.5)(torch.tensor(c), torch.tensor(r), torch.ones(G))
    s, y, m = _preference(c, r)
    assert abs(float(pairwise_hinge(s, y, m, ONES, margin=0.5)) - float(ref)) < 1e-6


def _stub_cross_encoder(score_of: dict):
    """A sentence-transformers CrossEncoder whose score of a (query, doc) pair is ``score_of[pair]``."""
    from sentence_transformers.cross_encoder import CrossEncoder

    class Stub(CrossEncoder):
        def __init__(self):
            torch.nn.Module.__init__(self)

        num_labels = 1
        device = torch.device("cpu")

        def preprocess(self, pairs, **kw):
            return {"pairs": [tuple(p) for p in pairs]}

        def forward(self, features):
            return {"scores": torch.tensor([[score_of[p]] for p in features["pairs"]], dtype=torch.float32)}

    return Stub()


def _texts():
    queries = [f"q{g}" for g in range(G)]
    docs = [[f"d{g}-{j}" for j in range(K)] for g in range(G)]
    score_of = {(queries[g], docs[g][j]): float(SCORES[g, j]) for g in range(G) for j in range(K)}
    return queries, docs, score_of


def test_pointwise_bce_equals_binary_cross_entropy_loss():
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss

    queries, docs, score_of = _texts()
    labels = RNG.uniform(0, 1, (G, K)).astype(np.float32)  # graded relevance in [0, 1]
    loss = BinaryCrossEntropyLoss(_stub_cross_encoder(score_of))
    ref = loss([[q for q in queries for _ in range(K)], [d for ds in docs for d in ds]], torch.tensor(labels.ravel()))
    ours = pointwise_bce(jnp.asarray(SCORES), jnp.asarray(labels), jnp.ones((G, K), bool), ONES)
    assert abs(float(ours) - float(ref)) < 1e-6


@pytest.mark.parametrize("scale", [1.0, 10.0])
def test_listwise_softmax_equals_multiple_negatives_ranking_loss(scale):
    """One positive and K-1 hard negatives per query; batches of one query (no in-batch negatives)."""
    from sentence_transformers.cross_encoder.losses import MultipleNegativesRankingLoss

    queries, docs, score_of = _texts()
    loss = MultipleNegativesRankingLoss(_stub_cross_encoder(score_of), scale=scale, activation_fn=None)
    ref = np.mean([float(loss([[queries[g]], *[[d] for d in docs[g]]], None)) for g in range(G)])
    y = np.zeros((G, K), np.float32)
    y[:, 0] = 1
    ours = listwise_softmax(jnp.asarray(SCORES), jnp.asarray(y), jnp.ones((G, K), bool), ONES, scale=scale)
    assert abs(float(ours) - ref) < 1e-6 * max(1.0, abs(ref))  # float32: relative for a loss of ~20


def test_listnet_equals_listnet_loss_on_ragged_groups():
    from sentence_transformers.cross_encoder.losses import ListNetLoss

    queries, docs, score_of = _texts()
    sizes = [K, 2, 3, K, 1 + 1, K]
    labels = RNG.integers(0, 4, (G, K)).astype(np.float32)
    loss = ListNetLoss(_stub_cross_encoder(score_of))
    ref = loss(
        [queries, [docs[g][:n] for g, n in enumerate(sizes)]],
        [torch.tensor(labels[g, :n]) for g, n in enumerate(sizes)],
    )
    mask = np.arange(K)[None, :] < np.asarray(sizes)[:, None]
    ours = listnet(jnp.asarray(SCORES), jnp.asarray(labels), jnp.asarray(mask), ONES)
    assert abs(float(ours) - float(ref)) < 1e-6


def test_padding_changes_nothing_and_gradients_stay_finite():
    """Padded candidates and weight-0 padded groups (whose rows are garbage) leave loss and gradients alone."""
    import jax

    labels = np.zeros((G, K), np.float32)
    labels[:, 1] = 1.0
    mask = np.ones((G, K), bool)
    mask[2, 3] = mask[4, 2:] = False
    s_pad = np.concatenate([SCORES, RNG.normal(0, 50, (2, K)).astype(np.float32)])
    y_pad = np.concatenate([labels, np.zeros((2, K), np.float32)])
    m_pad = np.concatenate([mask, np.zeros((2, K), bool)])
    w_pad = np.r_[ONES, 0.0, 0.0].astype(np.float32)
    for fn in (pairwise_logistic, pairwise_hinge, listwise_softmax, listnet, pointwise_bce):
        base = fn(jnp.asarray(SCORES), labels, mask, ONES)
        padded, grad = jax.value_and_grad(lambda s: fn(s, y_pad, m_pad, w_pad))(jnp.asarray(s_pad))
        assert abs(float(base) - float(padded)) < 1e-6, fn.__name__
        assert np.isfinite(np.asarray(grad)).all() and not np.asarray(grad)[G:].any(), fn.__name__
        assert not np.asarray(grad)[~m_pad].any(), fn.__name__


def test_objective_loss_on_flat_rows_equals_group_form():
    """The train steps' flat form: a row's weight is its group's weight shared among its real rows."""
    labels = np.zeros((G, K), np.float32)
    labels[:, 0] = 1.0
    mask = np.ones((G, K), bool)
    mask[1, 2:] = False
    gw = RNG.uniform(0.5, 2, G).astype(np.float32)
    rows = np.where(mask, gw[:, None] / mask.sum(1, keepdims=True), 0.0).astype(np.float32).ravel()
    for name, fn in (("pairwise", pairwise_logistic), ("listwise", listwise_softmax), ("pointwise", pointwise_bce)):
        flat = objective_loss(name, K)(jnp.asarray(SCORES.reshape(-1, 1)), labels.ravel(), rows)
        assert abs(float(flat) - float(fn(jnp.asarray(SCORES), labels, mask, gw))) < 1e-6


def test_margins_from_the_data_ride_in_a_second_label_column():
    """Preference rows with TRL's per-pair margin: ``labels [G*2, 2]`` = (relevance, the group's margin),
    added to the margin option; the loss is TRL's with that margin."""
    c, r = _pairs()
    margin = RNG.uniform(0, 1, G).astype(np.float32)
    rows = np.stack([np.tile([1.0, 0.0], G), np.repeat(margin, 2)], 1).astype(np.float32)
    flat = objective_loss("pairwise", 2)(
        jnp.asarray(np.stack([c, r], 1).reshape(-1, 1)), rows, np.full(2 * G, 0.5, np.float32)
    )
    assert abs(float(flat) - trl_reward_loss(c, r, margin)) < 1e-6
    hinge = objective_loss("hinge", 2, margin=0.5)(
        jnp.asarray(np.stack([c, r], 1).reshape(-1, 1)), rows, np.full(2 * G, 0.5, np.float32)
    )
    s, y, m = _preference(c, r)
    assert abs(float(hinge) - float(pairwise_hinge(s, y, m, ONES, margin=0.5 + margin))) < 1e-6
