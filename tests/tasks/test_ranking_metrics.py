"""Ranking metrics against scikit-learn (ndcg_score, average_precision_score) and
sentence-transformers' CrossEncoderRerankingEvaluator's per-query metrics."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import average_precision_score, ndcg_score

from flaxheads.tasks.ranking.metrics import ranking_metrics

RNG = np.random.default_rng(3)


def _groups(n=12, graded=True, ties=False):
    sizes = RNG.integers(2, 9, n)
    scores, labels, groups = [], [], []
    for g, k in enumerate(sizes):
        s = RNG.normal(size=k)
        if ties:
            s = np.round(s)  # many tied scores
        y = RNG.integers(0, 4 if graded else 2, k).astype(float)
        y[RNG.integers(k)] = max(y.max(), 1.0)  # every group has a relevant candidate
        scores.append(s), labels.append(y), groups.append(np.full(k, g))
    perm = RNG.permutation(sum(sizes))  # rows of a group need not be adjacent
    cat = lambda xs: np.concatenate(xs)[perm]  # noqa: E731
    return cat(scores), cat(labels), cat(groups), list(zip(scores, labels))


@pytest.mark.parametrize("ties", [False, True])
def test_ndcg_and_map_equal_sklearn(ties):
    s, y, g, parts = _groups(ties=ties)
    m = ranking_metrics(s, y, g, ks=(3, 10))
    for k in (3, 10):
        ref = np.mean([ndcg_score([yy], [ss], k=k) for ss, yy in parts])
        assert abs(m[f"ndcg@{k}"] - ref) < 1e-12
    assert abs(m["map"] - np.mean([average_precision_score(yy > 0, ss) for ss, yy in parts])) < 1e-12


def test_mrr_ndcg_map_equal_sentence_transformers_reranking_evaluator():
    from sentence_transformers.cross_encoder.evaluation import CrossEncoderRerankingEvaluator

    s, y, g, parts = _groups(graded=False)
    ev = CrossEncoderRerankingEvaluator(samples=[{"query": "q", "positive": ["p"], "negative": ["n"]}], at_k=5)
    refs = np.asarray([ev.compute_metrics(yy.astype(int).tolist(), ss) for ss, yy in parts])
    m = ranking_metrics(s, y, g, ks=(5,))
    assert np.allclose([m["mrr@5"], m["ndcg@5"], m["map"]], refs.mean(0), atol=1e-12)


def test_pairwise_accuracy_counts_preference_pairs():
    """On (chosen, rejected) pairs: the share with chosen scored higher, as TRL's accuracy."""
    c, r = RNG.normal(size=50), RNG.normal(size=50)
    s = np.stack([c, r], 1).ravel()
    y = np.tile([1.0, 0.0], 50)
    g = np.repeat(np.arange(50), 2)
    m = ranking_metrics(s, y, g)
    assert m["pairwise_accuracy"] == pytest.approx(float((c > r).mean()), abs=0)
    assert m["pairs"] == 50 and m["groups"] == 50
