"""What a run learns, behind one interface: :class:`Task`.

A task gives the train step its loss, :func:`~flaxheads.training.loop.fit` its batches (rows, or
whole groups), evaluation its metrics, and the run (``flaxheads.run``) its headline metric and
whether lower is better, a line that says what it trains, its largest batch, its keys of
``config.json`` and ``summary.json``, and the settings it refuses. :class:`Classification`
(single-label, multi-label, regression) is here; :class:`flaxheads.tasks.ranking.task.Ranking`
(each ranking objective) is the other one. One :class:`~flaxheads.training.loop.Trainer` and one
``fit`` serve both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from flaxheads.data.streaming import ordered_batches
from flaxheads.errors import UsageError
from flaxheads.losses import MULTI_LABEL, SINGLE_LABEL
from flaxheads.tasks.metrics import compute_metrics, headline

#: Metrics where lower is better (every other metric: higher is better).
LOWER_IS_BETTER = ("mse",)


class Task:
    """The interface; see the module docstring. ``unit`` is what a batch size counts."""

    name: str = "task"
    unit: str = "examples"
    headline: str = "accuracy"
    #: Run settings (``RunSpec`` field names) that mean nothing for this task: a run refuses them.
    refuses: tuple[str, ...] = ()
    #: Whether short training texts may be packed into shared rows.
    packs: bool = True

    def step_loss(self, model, loss_options: dict) -> tuple[Callable, str]:
        """``(loss(logits, labels, weights), problem type of the loss normaliser)`` for the train step."""
        raise NotImplementedError

    def check(self, model, *, pack: bool = False, cached: bool = False) -> None:
        """Refuse, in one line, a model or a setting this task cannot train."""

    def check_devices(self, batch_size: int, width: int) -> None:
        """Refuse, in one line, a batch that ``width`` data-parallel devices cannot share."""

    def train_batches(self) -> Callable[..., Iterable[dict]] | None:
        """The training batch iterator (``fit``'s signature), or None for the ordinary row batches."""
        return None

    def evaluate(self, trainer, params, split, *, buckets: Sequence[int], pad_id: int = 0) -> dict:
        """The metrics of ``params`` (placed) on every example of ``split``."""
        return self.final(trainer, params, split, buckets=buckets, pad_id=pad_id)[0]

    def final(self, trainer, params, split, *, buckets: Sequence[int], pad_id: int = 0) -> tuple[dict, dict]:
        """``(metrics, arrays)`` of ``split``: the arrays are what ``predictions.npz`` keeps."""
        raise NotImplementedError

    def metrics(self, outputs, labels) -> dict:
        """The metrics of the model's ``outputs`` for every example (a head trained on cached features)."""
        raise NotImplementedError

    def metric_names(self) -> list[str]:
        """The scalar metrics an evaluation reports (what ``keep_best_by`` may name)."""
        raise NotImplementedError

    def describe(self, splits: str, steps: int, batch_size: int) -> str:
        """What a run trains, in words: ``splits`` is ``"36 train / 6 validation / 0 test"``."""
        raise NotImplementedError

    def largest_batch(self, split, batch_size: int, bucket: int, pad_id: int = 0) -> dict:
        """A training batch of ``split`` padded to ``bucket`` tokens: the most memory a step takes."""
        raise NotImplementedError

    def config_keys(self, splits: Mapping) -> dict:
        """What a run's ``config.json`` records of this task (beside the model's problem type)."""
        return {}

    def summary_keys(self) -> dict:
        """What a run's ``summary.json`` records of this task."""
        return {}

    def lower_is_better(self, metric: str) -> bool:
        return metric.rpartition("/")[2] in LOWER_IS_BETTER

    def best_metric(self, flag: str, *, has_validation: bool) -> str | None:
        """``keep_best_by``: ``auto`` (the validation headline metric, if there is a validation
        split), ``none``, or ``validation/<metric>``, checked against this task's metrics."""
        if flag == "none" or (flag == "auto" and not has_validation):
            return None
        if flag == "auto":
            return f"validation/{self.headline}"
        split, _, name = flag.partition("/")
        valid = self.metric_names()
        if split != "validation" or name not in valid:
            raise UsageError(
                f"--keep-best-by {flag!r}: a {self.name} run evaluates validation/<metric> with metric "
                f"one of {', '.join(valid)} (or use `auto` / `none`)"
            )
        return flag


class Classification(Task):
    """Single-label, multi-label or regression on rows: the model's own loss and metrics."""

    unit = "examples"

    def __init__(self, problem_type: str, num_labels: int, *, threshold: float = 0.5):
        self.problem_type, self.num_labels, self.threshold = problem_type, int(num_labels), threshold
        self.name = problem_type
        self.headline = headline(problem_type)

    @classmethod
    def of(cls, model, threshold: float = 0.5) -> Classification:
        return cls(model.problem_type, model.num_labels, threshold=threshold)

    def step_loss(self, model, loss_options: dict) -> tuple[Callable, str]:
        return model.loss_fn(**loss_options), model.problem_type

    def final(self, trainer, params, split, *, buckets: Sequence[int], pad_id: int = 0) -> tuple[dict, dict]:
        batches = ordered_batches(split, trainer.cfg.eval_batch_size, buckets, pad_id=pad_id)
        logits, labels = trainer.predict(params, batches)
        return self.metrics(logits, labels), {"logits": np.asarray(logits), "labels": np.asarray(labels)}

    def metrics(self, outputs, labels) -> dict:
        return compute_metrics(self.problem_type, outputs, labels, self.num_labels, threshold=self.threshold)

    def metric_names(self) -> list[str]:
        n, k = 2, max(self.num_labels, 1)
        labels = (
            np.arange(n) % k
            if self.problem_type == SINGLE_LABEL
            else np.zeros((n, k))
            if self.problem_type == MULTI_LABEL
            else np.zeros((n, k) if k > 1 else n)
        )
        m = compute_metrics(self.problem_type, np.zeros((n, k)), labels, k)
        return sorted(name for name, v in m.items() if isinstance(v, float) and name != "threshold")

    def describe(self, splits: str, steps: int, batch_size: int) -> str:
        return f"{splits} examples, {self.num_labels} labels, {steps} steps of {batch_size}"

    def largest_batch(self, split, batch_size: int, bucket: int, pad_id: int = 0) -> dict:
        return next(iter(ordered_batches(split, batch_size, (bucket,), pad_id=pad_id)))
