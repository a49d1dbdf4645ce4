"""What a run asks its task: a classification task's description, metrics, largest batch and
records; a ranking task's refusals (its groups' answers are in test_ranking_train.py)."""

from __future__ import annotations

import numpy as np
import pytest
from train_helpers import random_split

from flaxheads.errors import UsageError
from flaxheads.tasks.metrics import compute_metrics
from flaxheads.tasks.ranking.task import Ranking, objective_options
from flaxheads.tasks.task import Classification


def test_classification_answers_the_run():
    task = Classification("single_label_classification", 3)
    assert (
        task.describe("8 train / 2 validation / 0 test", 6, 4)
        == "8 train / 2 validation / 0 test examples, 3 labels, 6 steps of 4"
    )
    assert task.packs and task.refuses == () and task.config_keys({}) == {} and task.summary_keys() == {}
    logits, labels = np.eye(3)[[0, 1, 2, 1]], np.array([0, 1, 2, 0])
    assert task.metrics(logits, labels) == compute_metrics("single_label_classification", logits, labels, 3)
    batch = task.largest_batch(random_split(10), 4, 32)
    assert batch["input_ids"].shape == (4, 32) and batch["weights"].sum() == 4
    task.check_devices(3, 2)  # rows split over devices however many there are


def test_ranking_refuses_what_a_grouped_scorer_cannot_train():
    task = Ranking("pairwise", group_size=2)
    assert not task.packs and {"pack", "sweep", "cache_features"} <= set(task.refuses)
    assert task.summary_keys() == {"objective": "pairwise"}
    with pytest.raises(UsageError, match="every group stays on one device"):
        task.check_devices(3, 2)
    task.check_devices(4, 2)
    assert objective_options("hinge", margin=0.5, scale=2.0) == {"margin": 0.5}
    assert objective_options("listnet", margin=0.5, scale=2.0) == {"scale": 2.0}
    assert objective_options("pointwise", margin=0.5, scale=2.0) == {}
