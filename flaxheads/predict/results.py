"""What :meth:`Classifier.predict <flaxheads.predict.Classifier.predict>` returns: the raw logits
and, by problem type, the scores and decisions a user reads (softmax and the best label(s),
sigmoid and the labels over the threshold, or the regression value)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from flaxheads.losses import MULTI_LABEL, REGRESSION, SINGLE_LABEL


def softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    z = np.exp(z - z.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def sigmoid(logits: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(logits, np.float64)))


@dataclasses.dataclass(frozen=True)
class Predictions:
    """Predictions for N texts, in input order.

    ``logits`` [N, K] float32; ``scores``: softmax (single-label), sigmoid (multi-label) or
    the values themselves (regression); ``labels``: the best label per text (single-label),
    the list of labels with score >= ``threshold`` (multi-label), None (regression).
    Iterating (or indexing) gives one record per text, see :meth:`record`."""

    logits: np.ndarray
    problem_type: str
    id2label: dict[int, str]
    threshold: float = 0.5
    top_k: int | None = None
    truncated: int = 0  # how many inputs were cut to the model's maximum length

    @property
    def scores(self) -> np.ndarray:
        if self.problem_type == SINGLE_LABEL:
            return softmax(self.logits)
        if self.problem_type == MULTI_LABEL:
            return sigmoid(self.logits)
        return np.asarray(self.logits, np.float64)

    @property
    def label_names(self) -> list[str]:
        return [self.id2label[i] for i in range(self.logits.shape[-1])]

    @property
    def labels(self) -> list[Any] | None:
        names = self.label_names
        if self.problem_type == SINGLE_LABEL:
            return [names[i] for i in self.logits.argmax(-1)]
        if self.problem_type == MULTI_LABEL:
            return [[names[j] for j in np.flatnonzero(row >= self.threshold)] for row in self.scores]
        return None

    def top(self, k: int) -> tuple[list[list[str]], np.ndarray]:
        """The ``k`` best labels per text and their scores, best first."""
        s = self.scores
        idx = np.argsort(-s, axis=-1, kind="stable")[:, :k]
        names = self.label_names
        return [[names[j] for j in row] for row in idx], np.take_along_axis(s, idx, -1)

    def record(self, i: int) -> dict:
        """Text ``i``: single-label ``{"label", "score"}`` (+ ``top_labels``, ``top_scores`` with
        ``top_k``); multi-label ``{"labels", "scores": {label: score}}``; regression ``{"value"}``
        (a list for several outputs)."""
        s = self.scores[i]
        if self.problem_type == SINGLE_LABEL:
            j = int(np.argmax(self.logits[i]))
            out = {"label": self.label_names[j], "score": float(s[j])}
            if self.top_k:
                best = np.argsort(-s, kind="stable")[: self.top_k]
                out.update(top_labels=[self.label_names[j] for j in best], top_scores=[float(s[j]) for j in best])
            return out
        if self.problem_type == MULTI_LABEL:
            names = self.label_names
            return {
                "labels": [names[j] for j in np.flatnonzero(s >= self.threshold)],
                "scores": {names[j]: float(s[j]) for j in range(len(names))},
            }
        if self.problem_type == REGRESSION:
            return {"value": float(s[0]) if len(s) == 1 else [float(x) for x in s]}
        raise ValueError(f"unknown problem_type {self.problem_type!r}")

    def records(self) -> list[dict]:
        return [self.record(i) for i in range(len(self))]

    def __len__(self) -> int:
        return int(self.logits.shape[0])

    def __getitem__(self, i: int) -> dict:
        return self.record(i)

    def __iter__(self) -> Iterator[dict]:
        return (self.record(i) for i in range(len(self)))
