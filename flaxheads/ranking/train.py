"""Training a scorer on groups with the library's ``fit``: :class:`RankingTrainer` is a
:class:`~flaxheads.training.loop.Trainer` whose train step minimises a ranking objective, whose
batches hold whole groups, and whose evaluation reports ranking metrics.

The model is an ordinary one-output :class:`~flaxheads.model.SequenceModel` (``num_labels=1``,
regression: Hugging Face's and sentence-transformers' layout of a reranker or reward model); only
its loss is replaced, so frozen backbones, LoRA, pmap and meshes train it as they train a classifier.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import numpy as np

from ..batching import predict_batches
from ..errors import TrainingError
from ..losses import REGRESSION
from ..parallel import DATA_AXIS, Parallel
from ..programs import TraceCounter, make_eval_step
from ..training import loop
from ..training.optim import OptimConfig, make_optimizer
from ..training.steps import make_train_step
from .data import GroupedSplit, iterate_group_batches
from .metrics import DEFAULT_KS, ranking_metrics
from .objectives import objective_loss


class _ObjectiveModel:
    """``model`` with its loss replaced by ``loss`` (what the train steps ask a model for);
    every other attribute is the model's own."""

    problem_type = REGRESSION  # the steps normalise by the summed row weight = summed group weight

    def __init__(self, model, loss):
        self._model, self._loss = model, loss

    def __getattr__(self, name):
        return getattr(self._model, name)

    def loss_fn(self, **options):
        return self._loss


def check_scorer(model) -> None:
    if model.num_labels != 1:
        raise TrainingError(f"a ranking objective trains a one-output scorer; this model has {model.num_labels} "
                            "outputs (build it with num_labels=1)")


@dataclasses.dataclass
class RankingTrainer(loop.Trainer):
    """A :class:`~flaxheads.training.loop.Trainer` for ``objective`` on groups of ``group_size``
    rows (``cfg.batch_size`` and ``cfg.eval_batch_size`` count groups)."""

    objective: str = "listwise"
    group_size: int = 2
    ks: tuple[int, ...] = DEFAULT_KS

    @classmethod
    def build(cls, model, optim: OptimConfig, cfg: loop.TrainConfig, parallel: Parallel | None = None, *,
              objective: str = "listwise", group_size: int = 2, objective_options: dict | None = None,
              ks: Sequence[int] = DEFAULT_KS) -> "RankingTrainer":
        check_scorer(model)
        if cfg.pack:
            raise TrainingError("packing is not available for ranking objectives (a batch holds whole groups)")
        parallel = (parallel or Parallel.from_config(cfg.parallel, cfg.mesh)).bind(model)
        tx = make_optimizer(optim, fold_reductions=model.plan.fold_reductions)
        axis = DATA_AXIS if parallel.mode == "pmap" else None
        scorer = _ObjectiveModel(model, objective_loss(objective, group_size, **(objective_options or {})))
        step = make_train_step(scorer, tx, freeze_backbone=optim.freeze_backbone, axis_name=axis)
        tt, et = TraceCounter(), TraceCounter()
        like = loop.abstract_state(model, tx, optim, cfg)
        return cls(model, optim, cfg, parallel, tx,
                   parallel.compile(tt.wrap(step), like=like, options=model.plan.compiler_options(gradients=True)),
                   parallel.compile(et.wrap(make_eval_step(model)), donate=False, like=like.params), tt, et,
                   objective=objective, group_size=int(group_size), ks=tuple(ks))

    def iterate_batches(self, split: GroupedSplit, batch_size: int, buckets: Sequence[int], **kw) -> Iterable[dict]:
        """``fit``'s batches: whole groups, ``batch_size`` of them per step."""
        return iterate_group_batches(split, batch_size, buckets, group_size=self.group_size, **kw)

    def batches(self, split: GroupedSplit, *, buckets: Sequence[int], pad_id: int = 0) -> Iterable[dict]:
        """Every group of ``split`` once, in order (evaluation)."""
        return iterate_group_batches(split, self.cfg.eval_batch_size, buckets, group_size=self.group_size,
                                     shuffle=False, pad_id=pad_id)

    def scores(self, params, batches: Iterable[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(scores, labels, groups)`` of every real row, in order."""
        par = self.parallel
        out, kept = predict_batches(lambda b: par.get_rows(self.eval_step(params, par.put_rows(b))), batches,
                                    keys=("labels", "group"))
        if out is None:
            return np.zeros(0, np.float32), np.zeros(0, np.float32), np.zeros(0, np.int32)
        labels = kept["labels"]
        return out[:, 0], labels[:, 0] if labels.ndim == 2 else labels, kept["group"]  # (without the margins)

    def evaluate(self, params, split: GroupedSplit, *, buckets: Sequence[int], pad_id: int = 0) -> dict:
        """Ranking metrics of ``params`` (placed) on every group of ``split``."""
        s, y, g = self.scores(params, self.batches(split, buckets=buckets, pad_id=pad_id))
        return ranking_metrics(s, y, g, ks=self.ks)
