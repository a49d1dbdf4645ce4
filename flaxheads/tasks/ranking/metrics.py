"""Ranking metrics from every scored candidate of an evaluation (numpy, not per batch).

Inputs are flat: ``scores [N]``, ``labels [N]`` (relevance, higher is better) and ``groups [N]``
(the group id of each row; a group is one query or prompt). Every metric is a mean over groups:

* ``pairwise_accuracy``: over all ordered pairs ``label_i > label_j`` of a group, the share with
  ``score_i > score_j`` (on preference pairs: chosen scored above rejected, TRL's ``accuracy``);
  pooled over the pairs of every group.
* ``ndcg@k``: scikit-learn's ``ndcg_score`` (linear gain, log2 discount, tied scores averaged).
* ``mrr@k``: 1 / rank of the first relevant candidate (label > 0) in the top k, else 0 (a
  relevant candidate tied with others ranks after them).
* ``map``: scikit-learn's ``average_precision_score`` with relevance > 0 as positive, over the
  groups that have a positive.
"""

from __future__ import annotations

import numpy as np

#: The cut-offs of NDCG@k and MRR@k that training reports.
DEFAULT_KS = (1, 10)


def split_groups(scores, labels, groups) -> list[tuple[np.ndarray, np.ndarray]]:
    """``[(scores, labels)]`` per group, groups in order of first appearance."""
    s, y, g = (np.asarray(a).reshape(-1) for a in (scores, labels, groups))
    _, first, inv = np.unique(g, return_index=True, return_inverse=True)
    out = []
    for gi in np.argsort(first):
        rows = np.flatnonzero(inv == gi)
        out.append((s[rows].astype(np.float64), y[rows].astype(np.float64)))
    return out


def _dcg(scores: np.ndarray, gains: np.ndarray, k: int) -> float:
    """DCG@k with tied scores sharing the mean gain of their block (scikit-learn's tie handling)."""
    discount = 1.0 / np.log2(np.arange(len(scores)) + 2.0)
    discount[k:] = 0.0
    _, inv, counts = np.unique(-scores, return_inverse=True, return_counts=True)
    block_gain = np.zeros(len(counts))
    np.add.at(block_gain, inv, gains)
    block_gain /= counts
    cum = np.concatenate([[0], np.cumsum(counts)])
    discount_sums = np.cumsum(np.concatenate([[0.0], discount]))
    return float(np.sum(block_gain * (discount_sums[cum[1:]] - discount_sums[cum[:-1]])))


def ndcg_at(scores: np.ndarray, labels: np.ndarray, k: int) -> float:
    ideal = _dcg(labels, labels, k)
    return _dcg(scores, labels, k) / ideal if ideal > 0 else 0.0


def reciprocal_rank_at(scores: np.ndarray, labels: np.ndarray, k: int) -> float:
    """Among tied scores the relevant candidates rank last (no credit from the data's order)."""
    order = np.lexsort((labels > 0, -scores))[:k]
    hits = np.flatnonzero(labels[order] > 0)
    return 1.0 / (hits[0] + 1) if len(hits) else 0.0


def average_precision(scores: np.ndarray, labels: np.ndarray) -> float:
    """AP over the distinct score thresholds (precision at each threshold times the recall it adds)."""
    rel = labels > 0
    if not rel.any():
        return float("nan")
    order = np.argsort(-scores, kind="stable")
    s, r = scores[order], rel[order]
    ends = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1]  # last row of each threshold block
    tp = np.cumsum(r)[ends]
    precision, recall = tp / (ends + 1), tp / rel.sum()
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def pairwise_counts(scores: np.ndarray, labels: np.ndarray) -> tuple[int, int]:
    """(pairs with score_i > score_j, pairs) over the ordered pairs with label_i > label_j."""
    better = labels[:, None] > labels[None, :]
    return int((better & (scores[:, None] > scores[None, :])).sum()), int(better.sum())


def ranking_metrics(scores, labels, groups, *, ks=DEFAULT_KS) -> dict:
    """``pairwise_accuracy``, ``ndcg@k`` and ``mrr@k`` for each k, ``map``, and the counts."""
    parts = split_groups(scores, labels, groups)
    right = pairs = 0
    for s, y in parts:
        a, b = pairwise_counts(s, y)
        right, pairs = right + a, pairs + b
    out = {"pairwise_accuracy": right / pairs if pairs else 0.0}
    for k in ks:
        out[f"ndcg@{k}"] = float(np.mean([ndcg_at(s, y, k) for s, y in parts])) if parts else 0.0
        out[f"mrr@{k}"] = float(np.mean([reciprocal_rank_at(s, y, k) for s, y in parts])) if parts else 0.0
    aps = [average_precision(s, y) for s, y in parts]
    aps = [a for a in aps if not np.isnan(a)]
    out["map"] = float(np.mean(aps)) if aps else 0.0
    out["groups"], out["pairs"] = len(parts), pairs
    return out


def metric_names(ks=DEFAULT_KS) -> list[str]:
    """The scalar metrics :func:`ranking_metrics` reports for ``ks`` (what ``--keep-best-by`` may name)."""
    return ["pairwise_accuracy", *(f"{m}@{k}" for k in ks for m in ("ndcg", "mrr")), "map"]


def headline(kind: str) -> str:
    """The metric that names a ranking run's score (higher is better): pairwise accuracy for
    preference pairs, NDCG@10 for ranked groups."""
    return "pairwise_accuracy" if kind == "preference" else "ndcg@10"
