"""Scores of (query, candidate) pairs and rankings of candidates, from a one-output model (a
reranker or reward model): the batched, bucketed forward of :class:`~flaxheads.predict.Classifier`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from flaxheads.data.tables import DataError
from flaxheads.errors import UsageError

if TYPE_CHECKING:
    from flaxheads.predict.classifier import Classifier


def check_scorer(clf: Classifier) -> None:
    """A scorer has one output that is a score (not an embedding, not class logits)."""
    if clf.is_embedding or clf.model.num_labels != 1:
        what = "an embedding head" if clf.is_embedding else f"{clf.model.num_labels} outputs ({clf.problem_type})"
        raise UsageError(
            f"{clf.source}: scoring pairs needs a one-output model (a reranker or reward model); "
            f"this one has {what}. Train one with `flaxheads train --objective ...`, or load a "
            "cross-encoder / XForSequenceClassification folder with num_labels=1"
        )


def split_pairs(pairs) -> tuple[list, list]:
    """``[(query, candidate), ...]`` -> (queries, candidates); a :class:`DataError` names a bad pair."""
    if isinstance(pairs, (str, bytes)) or (
        isinstance(pairs, Sequence) and len(pairs) == 2 and all(isinstance(x, str) for x in pairs)
    ):
        raise DataError("pairs: expected a list of (query, candidate) pairs, got one pair; wrap it in a list")
    queries: list[str] = []
    cands: list[str] = []
    for i, p in enumerate(pairs):
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or len(p) != 2:
            raise DataError(f"pairs[{i}]: expected a (query, candidate) pair of two texts, got {p!r}")
        queries.append(p[0])
        cands.append(p[1])
    return queries, cands


def score_pairs(
    clf: Classifier,
    pairs,
    *,
    batch_size: int = 32,
    truncate: bool = True,
    progress: bool | None = None,
    rows: Sequence[str] | None = None,
) -> np.ndarray:
    """One float32 score per (query, candidate) pair, in input order (the model's raw output)."""
    check_scorer(clf)
    queries, cands = split_pairs(pairs)
    if not queries:
        return np.zeros(0, np.float32)
    out, _ = clf.outputs(queries, cands, batch_size=batch_size, truncate=truncate, progress=progress, rows=rows)
    return np.asarray(out, np.float32)[:, 0]


def rank_candidates(
    clf: Classifier,
    query: str,
    candidates: Sequence[str],
    *,
    top_k: int | None = None,
    batch_size: int = 32,
    truncate: bool = True,
) -> list[dict]:
    """``candidates`` best first, as ``{"index", "score", "text"}`` dicts (``top_k`` of them); ties
    keep the input order."""
    if not isinstance(query, str):
        raise DataError(f"query: expected one text, got {type(query).__name__}")
    candidates = list(candidates)
    if top_k is not None and int(top_k) < 1:
        raise UsageError(f"top_k must be a positive integer, got {top_k}")
    scores = score_pairs(
        clf,
        [(query, c) for c in candidates],
        batch_size=batch_size,
        truncate=truncate,
        rows=[f"candidates[{i}]" for i in range(len(candidates))],
    )
    order = ranks_order(scores)[:top_k]
    return [{"index": int(i), "score": float(scores[i]), "text": candidates[i]} for i in order]


def ranks_order(scores: np.ndarray) -> np.ndarray:
    """Indices best first (stable: ties keep the input order)."""
    return np.argsort(-np.asarray(scores), kind="stable")


def ranks_within(scores: np.ndarray, groups: Sequence) -> np.ndarray:
    """1-based rank of each row among the rows of its group (1 = highest score)."""
    scores = np.asarray(scores)
    ranks = np.zeros(len(scores), np.int64)
    keys: dict[object, list[int]] = {}
    for i, g in enumerate(groups):
        keys.setdefault(g, []).append(i)
    for members in keys.values():
        rows = np.asarray(members)
        ranks[rows[ranks_order(scores[rows])]] = np.arange(1, len(rows) + 1)
    return ranks


def ranking_groups(source: str, *, split: str | None = None, input: str | None = None):  # noqa: A002
    """The groups to evaluate the ranking run that saved ``source`` on: its split ``split``, rebuilt
    from its recorded spec as it trained on them, or the table ``input`` (read as the run read its
    data); None when ``source`` is not a ranking run."""
    from flaxheads.checkpoint import is_checkpoint_folder
    from flaxheads.data.groups import load_groups
    from flaxheads.formats.sources import run_config
    from flaxheads.run.data import run_spec, run_split

    if not is_checkpoint_folder(source) or run_config(source).get("objective") in (None, "classification"):
        return None
    if bool(split) == bool(input):
        raise UsageError(
            "give --input (a ranking table: query, passage, label or prompt, chosen, rejected) or "
            "--split (the run's own split), one of them"
        )
    if input:
        return load_groups(input, query_column=run_spec(source).data.query_column)
    assert split, "one of input and split is given (checked above)"
    return run_split(source, split)


def evaluate_groups(
    clf: Classifier, table, *, batch_size: int = 32, truncate: bool = True, progress: bool | None = None
) -> tuple[dict, dict]:
    """Ranking metrics (:func:`~flaxheads.tasks.ranking.metrics.ranking_metrics`) of ``clf``'s scores on
    the groups of ``table`` (a :class:`~flaxheads.data.groups.GroupTable`), and the flat
    ``{"scores", "labels", "groups"}`` they were computed from."""
    from flaxheads.tasks.ranking.metrics import ranking_metrics

    check_scorer(clf)
    pairs, labels, groups, rows = [], [], [], []
    for g, (q, cands, ys) in enumerate(zip(table.queries, table.candidates, table.labels)):
        pairs += [(q, c) for c in cands]
        labels += list(ys)
        groups += [g] * len(cands)
        rows += [f"{table.source}: {table.rows[g]}"] * len(cands)
    scores = score_pairs(clf, pairs, batch_size=batch_size, truncate=truncate, progress=progress, rows=rows)
    flat = {"scores": scores, "labels": np.asarray(labels, np.float32), "groups": np.asarray(groups)}
    return ranking_metrics(scores, flat["labels"], flat["groups"]), flat


def format_ranking(metrics: dict, split: str | None = None, as_json: bool = False) -> str:
    """Ranking metrics one per line (``as_json``: followed by one JSON line ``{split: metrics}``)."""
    import json

    text = "\n".join(f"{k:<18} {v:.4f}" if isinstance(v, float) else f"{k:<18} {v}" for k, v in metrics.items())
    return text + ("\n" + json.dumps({split or "evaluation": metrics}) if as_json else "")
