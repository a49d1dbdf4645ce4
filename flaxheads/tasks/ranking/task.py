"""Ranking objectives as a :class:`~flaxheads.tasks.task.Task`: the train step minimises a
ranking objective, batches hold whole groups, and evaluation reports ranking metrics.

The model is an ordinary one-output :class:`~flaxheads.model.sequence.SequenceModel` (``num_labels=1``,
regression: Hugging Face's and sentence-transformers' layout of a reranker or reward model); only
its loss differs, so frozen backbones, LoRA, pmap and meshes train it as they train a classifier
(``Trainer.build(model, optim, cfg, task=Ranking("listwise", group_size=4))``).
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Iterable, Sequence

import numpy as np

from flaxheads.data.batching import predict_batches
from flaxheads.errors import TrainingError
from flaxheads.losses import REGRESSION
from flaxheads.tasks.task import Task
from flaxheads.data.groups import GroupedSplit, iterate_group_batches
from flaxheads.tasks.ranking.metrics import DEFAULT_KS, headline, metric_names, ranking_metrics
from flaxheads.tasks.ranking.objectives import OBJECTIVES, objective_loss


def check_scorer(model) -> None:
    if model.num_labels != 1:
        raise TrainingError(f"a ranking objective trains a one-output scorer; this model has {model.num_labels} "
                            "outputs (build it with num_labels=1)")


class Ranking(Task):
    """``objective`` (one of :data:`~flaxheads.tasks.ranking.objectives.OBJECTIVES`) on groups of
    ``group_size`` rows; batch sizes count groups. ``kind`` (``"preference"`` or ``"ranking"``,
    the table's layout) picks the headline metric."""

    name = "ranking"
    unit = "groups"

    def __init__(self, objective: str = "listwise", group_size: int = 2, *, options: dict | None = None,
                 kind: str = "ranking", ks: Sequence[int] = DEFAULT_KS):
        if objective not in OBJECTIVES:
            raise TrainingError(f"objective {objective!r} is not one of {', '.join(OBJECTIVES)}")
        self.objective, self.group_size, self.options = objective, int(group_size), dict(options or {})
        self.kind, self.ks = kind, tuple(ks)
        self.headline = headline(kind)

    def step_loss(self, model, loss_options: dict) -> tuple[Callable, str]:
        # REGRESSION: the steps normalise by the summed row weight = summed group weight
        return objective_loss(self.objective, self.group_size, **self.options), REGRESSION

    def check(self, model, *, pack: bool = False, cached: bool = False) -> None:
        check_scorer(model)
        if pack:
            raise TrainingError("packing is not available for ranking objectives (a batch holds whole groups)")

    def train_batches(self) -> Callable[..., Iterable[dict]]:
        return partial(iterate_group_batches, group_size=self.group_size)

    def batches(self, split: GroupedSplit, batch_size: int, *, buckets: Sequence[int], pad_id: int = 0):
        """Every group of ``split`` once, in order (evaluation)."""
        return iterate_group_batches(split, batch_size, buckets, group_size=self.group_size, shuffle=False,
                                     pad_id=pad_id)

    def scores(self, trainer, params, batches: Iterable[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(scores, labels, groups)`` of every real row, in order."""
        par = trainer.parallel
        out, kept = predict_batches(lambda b: par.get_rows(trainer.eval_step(params, par.put_rows(b))), batches,
                                    keys=("labels", "group"))
        if out is None:
            return np.zeros(0, np.float32), np.zeros(0, np.float32), np.zeros(0, np.int32)
        labels = kept["labels"]
        return out[:, 0], labels[:, 0] if labels.ndim == 2 else labels, kept["group"]  # (without the margins)

    def final(self, trainer, params, split, *, buckets: Sequence[int], pad_id: int = 0) -> tuple[dict, dict]:
        s, y, g = self.scores(trainer, params, self.batches(split, trainer.cfg.eval_batch_size, buckets=buckets,
                                                            pad_id=pad_id))
        return ranking_metrics(s, y, g, ks=self.ks), {"scores": s, "labels": y, "groups": g}

    def metric_names(self) -> list[str]:
        return metric_names(self.ks)
