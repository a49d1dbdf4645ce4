"""Rerankers and reward models: one score per (query, candidate) row, trained on groups.

:mod:`.objectives` (pairwise Bradley-Terry and hinge, listwise softmax / ListNet, pointwise BCE),
:mod:`.metrics` (pairwise accuracy, NDCG@k, MRR@k, MAP), :mod:`.data` (preference and ranking
tables, grouped splits and batches), :mod:`.task` (``Ranking``: an objective as the task of the one ``Trainer``).
"""

from flaxheads.tasks.ranking.metrics import ranking_metrics
from flaxheads.tasks.ranking.objectives import OBJECTIVES, objective_fn, objective_loss

__all__ = ["OBJECTIVES", "objective_fn", "objective_loss", "ranking_metrics"]
