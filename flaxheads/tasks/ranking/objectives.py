"""Ranking and preference objectives: pure functions of group scores -> scalar.

A *group* is one query (or prompt) with its candidates: ``scores [G, k]`` (the model's one
output per (query, candidate) row), ``labels [G, k]`` (relevance, higher is better; a
preference pair is ``[1, 0]``: chosen first, rejected second), ``mask [G, k]`` (real
candidates; groups are padded to ``k``) and ``weights [G]`` (0 for padding groups). Every
objective is the weighted mean over groups of a per-group loss, so padded groups and padded
candidates change nothing, and a data-parallel step that sums ``loss * local weight`` over
devices gets the global mean.

* :func:`pairwise_logistic` (Bradley-Terry): ``-log sigmoid(s_i - s_j - margin)`` over the
  ordered pairs with ``label_i > label_j``, averaged per group. On preference pairs it is the
  reward-model loss of TRL's ``RewardTrainer`` (with its optional per-pair margin).
* :func:`pairwise_hinge`: ``max(0, margin - (s_i - s_j))`` over the same pairs
  (``torch.nn.MarginRankingLoss``).
* :func:`listwise_softmax`: cross-entropy of ``softmax(scale * s)`` against the relevance
  normalised to sum 1 (one positive: the softmax cross-entropy of sentence-transformers'
  ``MultipleNegativesRankingLoss`` on hard negatives); :func:`listnet` against ``softmax(labels)``
  (sentence-transformers' ``ListNetLoss``).
* :func:`pointwise_bce`: binary cross-entropy with logits on relevance in [0, 1], per candidate
  (sentence-transformers' ``BinaryCrossEntropyLoss``).

:func:`objective_loss` turns one of them into the ``f(logits, labels, weights)`` the train steps
call, on flat rows of ``k`` candidates per group (see :mod:`flaxheads.tasks.ranking.batches`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from flaxheads.errors import ConfigError

OBJECTIVES = ("pairwise", "hinge", "listwise", "listnet", "pointwise")


def _group_mean(per_group, weights) -> jax.Array:
    w = jnp.asarray(weights, jnp.float32)
    return jnp.sum(per_group * w) / jnp.maximum(jnp.sum(w), 1e-12)


def _ordered_pairs(labels, mask):
    """``[G, k, k]``: 1 where candidate i is more relevant than candidate j (both real)."""
    m = mask.astype(bool)
    better = labels[:, :, None] > labels[:, None, :]
    return (better & m[:, :, None] & m[:, None, :]).astype(jnp.float32)


def _pairwise(per_pair: Callable, scores, labels, mask, weights, margin):
    s = scores.astype(jnp.float32)
    diff = s[:, :, None] - s[:, None, :]  # s_i - s_j
    m = (
        jnp.zeros((s.shape[0],), jnp.float32)
        if margin is None
        else jnp.broadcast_to(jnp.asarray(margin, jnp.float32), (s.shape[0],))
    )
    pairs = _ordered_pairs(labels, mask)
    loss = per_pair(diff, m[:, None, None])
    per_group = jnp.sum(loss * pairs, axis=(1, 2)) / jnp.maximum(jnp.sum(pairs, axis=(1, 2)), 1.0)
    return _group_mean(per_group, weights)


def pairwise_logistic(scores, labels, mask, weights, *, margin=None) -> jax.Array:
    """Bradley-Terry: mean over groups of the mean ``-log sigmoid(s_i - s_j - margin)`` over
    pairs with ``label_i > label_j``. ``margin``: a scalar or one per group (TRL's ``margin``)."""
    return _pairwise(lambda d, m: -jax.nn.log_sigmoid(d - m), scores, labels, mask, weights, margin)


def pairwise_hinge(scores, labels, mask, weights, *, margin=1.0) -> jax.Array:
    """Mean over groups of the mean ``max(0, margin - (s_i - s_j))`` over pairs with ``label_i > label_j``."""
    return _pairwise(lambda d, m: jax.nn.relu(m - d), scores, labels, mask, weights, margin)


_MASKED = -1e30  # not -inf: a group with no real candidate (padding) must stay finite, gradients too


def _masked_log_softmax(scores, mask):
    s = jnp.where(mask.astype(bool), scores.astype(jnp.float32), _MASKED)
    return jnp.where(mask.astype(bool), jax.nn.log_softmax(s, axis=-1), 0.0)


def _listwise(target, scores, mask, weights, scale):
    logp = _masked_log_softmax(scores * scale, mask)
    return _group_mean(-jnp.sum(target * logp, axis=-1), weights)


def listwise_softmax(scores, labels, mask, weights, *, scale: float = 1.0) -> jax.Array:
    """Softmax cross-entropy over each group's candidates, against the relevance normalised to
    sum 1 (one positive and k negatives: ``-log softmax(scale * s)[positive]``)."""
    y = jnp.where(mask.astype(bool), labels.astype(jnp.float32), 0.0)
    target = y / jnp.maximum(jnp.sum(y, axis=-1, keepdims=True), 1e-12)
    return _listwise(target, scores, mask, weights, scale)


def listnet(scores, labels, mask, weights, *, scale: float = 1.0) -> jax.Array:
    """ListNet: cross-entropy of ``softmax(scale * s)`` against ``softmax(labels)`` over each group's candidates."""
    y = jnp.where(mask.astype(bool), labels.astype(jnp.float32), _MASKED)
    return _listwise(jax.nn.softmax(y, axis=-1), scores, mask, weights, scale)


def pointwise_bce(scores, labels, mask, weights, *, pos_weight=None) -> jax.Array:
    """Binary cross-entropy with logits on relevance in [0, 1], averaged over each group's real
    candidates, then over groups (equal-size groups: the mean over every candidate)."""
    s, y = scores.astype(jnp.float32), labels.astype(jnp.float32)
    pw = 1.0 if pos_weight is None else jnp.asarray(pos_weight, jnp.float32)
    per = -(pw * y * jax.nn.log_sigmoid(s) + (1.0 - y) * jax.nn.log_sigmoid(-s))
    m = mask.astype(jnp.float32)
    return _group_mean(jnp.sum(per * m, axis=-1) / jnp.maximum(jnp.sum(m, axis=-1), 1.0), weights)


_FUNCTIONS: dict[str, Callable[..., jax.Array]] = {
    "pairwise": pairwise_logistic,
    "hinge": pairwise_hinge,
    "listwise": listwise_softmax,
    "listnet": listnet,
    "pointwise": pointwise_bce,
}


def objective_fn(name: str, **options) -> Callable[..., jax.Array]:
    """``f(scores [G, k], labels [G, k], mask [G, k], weights [G]) -> scalar`` for an objective name."""
    if name not in _FUNCTIONS:
        raise ConfigError(f"unknown ranking objective {name!r}; valid: {', '.join(OBJECTIVES)}")
    fn = _FUNCTIONS[name]
    return lambda scores, labels, mask, weights: fn(scores, labels, mask, weights, **options)


#: Objectives that take a margin (an option, plus a per-group margin from the data).
MARGIN_OBJECTIVES = ("pairwise", "hinge")


def objective_loss(name: str, group_size: int, **options) -> Callable[..., jax.Array]:
    """The objective as the train steps' ``f(logits [G*k, 1], labels, weights [G*k])``.

    Rows come group by group, ``group_size`` rows each. A row's weight is its group's weight
    divided among the group's real candidates (0 for padded candidates), so the summed row weight
    of a batch is its summed group weight: the steps' normaliser of a global weighted mean.
    ``labels`` is the relevance ``[G*k]``, or ``[G*k, 2]``: relevance and the row's group margin,
    added to the ``margin`` option (pairwise objectives only)."""
    objective_fn(name)  # the name check
    fn, k = _FUNCTIONS[name], int(group_size)

    def f(logits, labels, weights=None):
        if logits.ndim != 2 or logits.shape[-1] != 1:
            raise ConfigError(f"ranking objectives score each row with one output; got logits of shape {logits.shape}")
        if logits.shape[0] % k:
            raise ConfigError(f"{logits.shape[0]} rows are not whole groups of {k}")
        w = jnp.ones((logits.shape[0],), jnp.float32) / k if weights is None else jnp.asarray(weights, jnp.float32)
        w = w.reshape(-1, k)
        labels = jnp.asarray(labels)
        opts = dict(options)
        if labels.ndim == 2:
            if name not in MARGIN_OBJECTIVES:
                raise ConfigError(
                    f"per-group margins apply to the {' and '.join(MARGIN_OBJECTIVES)} objectives, not {name}"
                )
            base = opts.get("margin")
            base = (1.0 if name == "hinge" else 0.0) if base is None else base
            opts["margin"] = base + labels[:, 1].reshape(-1, k)[:, 0]
            labels = labels[:, 0]
        return fn(logits.reshape(-1, k), labels.reshape(-1, k), w > 0, jnp.sum(w, axis=-1), **opts)

    return f
