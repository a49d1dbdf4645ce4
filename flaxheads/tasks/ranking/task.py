"""Ranking objectives as a :class:`~flaxheads.tasks.task.Task`: the train step minimises a
ranking objective, batches hold whole groups, and evaluation reports ranking metrics.

The model is an ordinary one-output :class:`~flaxheads.model.sequence.SequenceModel` (``num_labels=1``,
regression: Hugging Face's and sentence-transformers' layout of a reranker or reward model); only
its loss differs, so frozen backbones, LoRA, pmap and meshes train it as they train a classifier
(``Trainer.build(model, optim, cfg, task=Ranking("listwise", group_size=4))``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial

import numpy as np

from flaxheads.data.batching import predict_batches
from flaxheads.data.groups import GroupedSplit, collate_groups, iterate_group_batches
from flaxheads.errors import TrainingError, UsageError
from flaxheads.losses import REGRESSION
from flaxheads.tasks.ranking.metrics import DEFAULT_KS, headline, metric_names, ranking_metrics
from flaxheads.tasks.ranking.objectives import MARGIN_OBJECTIVES, OBJECTIVES, objective_loss
from flaxheads.tasks.task import Task

#: The objectives that take a ``scale`` (their softmax's temperature); ``MARGIN_OBJECTIVES`` take a ``margin``.
SCALE_OBJECTIVES = ("listwise", "listnet")


def objective_options(objective: str, *, margin: float | None = None, scale: float | None = None) -> dict:
    """The options of ``objective`` among ``margin`` and ``scale`` (None: the objective's default)."""
    if objective in MARGIN_OBJECTIVES and margin is not None:
        return {"margin": margin}
    return {"scale": scale} if objective in SCALE_OBJECTIVES and scale is not None else {}


def check_scorer(model) -> None:
    if model.num_labels != 1:
        raise TrainingError(
            f"a ranking objective trains a one-output scorer; this model has {model.num_labels} "
            "outputs (build it with num_labels=1)"
        )


class Ranking(Task):
    """``objective`` (one of :data:`~flaxheads.tasks.ranking.objectives.OBJECTIVES`) on groups of
    ``group_size`` rows; batch sizes count groups. ``kind`` (``"preference"`` or ``"ranking"``,
    the table's layout) picks the headline metric."""

    name = "ranking"
    unit = "groups"
    #: a one-score ranker trained on groups: no cached features or sweep, packing, label smoothing,
    #: text pairs (a group's query is the pair) or problem type
    refuses = ("cache_features", "sweep", "pack", "label_smoothing", "text_pair_column", "problem_type")
    packs = False

    def __init__(
        self,
        objective: str = "listwise",
        group_size: int = 2,
        *,
        options: dict | None = None,
        kind: str = "ranking",
        ks: Sequence[int] = DEFAULT_KS,
    ):
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

    def check_devices(self, batch_size: int, width: int) -> None:
        if batch_size % width:
            raise UsageError(
                f"--batch-size {batch_size} (groups) must be a multiple of the {width} data-parallel "
                "devices, so that every group stays on one device"
            )

    def train_batches(self) -> Callable[..., Iterable[dict]]:
        return partial(iterate_group_batches, group_size=self.group_size)

    def batches(self, split: GroupedSplit, batch_size: int, *, buckets: Sequence[int], pad_id: int = 0):
        """Every group of ``split`` once, in order (evaluation)."""
        return iterate_group_batches(
            split, batch_size, buckets, group_size=self.group_size, shuffle=False, pad_id=pad_id
        )

    def scores(self, trainer, params, batches: Iterable[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(scores, labels, groups)`` of every real row, in order."""
        par = trainer.parallel
        out, kept = predict_batches(
            lambda b: par.get_rows(trainer.eval_step(params, par.put_rows(b))), batches, keys=("labels", "group")
        )
        if out is None:
            return np.zeros(0, np.float32), np.zeros(0, np.float32), np.zeros(0, np.int32)
        labels = kept["labels"]
        return out[:, 0], labels[:, 0] if labels.ndim == 2 else labels, kept["group"]  # (without the margins)

    def final(self, trainer, params, split, *, buckets: Sequence[int], pad_id: int = 0) -> tuple[dict, dict]:
        s, y, g = self.scores(
            trainer, params, self.batches(split, trainer.cfg.eval_batch_size, buckets=buckets, pad_id=pad_id)
        )
        return ranking_metrics(s, y, g, ks=self.ks), {"scores": s, "labels": y, "groups": g}

    def metric_names(self) -> list[str]:
        return metric_names(self.ks)

    def describe(self, splits: str, steps: int, batch_size: int) -> str:
        return (
            f"{splits} groups of up to {self.group_size} candidates, objective {self.objective}, {steps} steps "
            f"of {batch_size} groups"
        )

    def largest_batch(self, split, batch_size: int, bucket: int, pad_id: int = 0) -> dict:
        groups = np.arange(min(batch_size, len(split)))
        return collate_groups(split, groups, batch_size, self.group_size, (bucket,), pad_id)

    def config_keys(self, splits: Mapping) -> dict:
        return {
            "objective": self.objective,
            "objective_options": self.options,
            "group_size": self.group_size,
            "rows": {n: int(s.offsets[-1]) for n, s in splits.items()},
        }

    def summary_keys(self) -> dict:
        return {"objective": self.objective}
