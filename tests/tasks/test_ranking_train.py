"""Grouped batches and the ranking train step: a batch holds whole groups (padded groups and
candidates weigh nothing), the step's loss is the objective on the model's own scores, and two
devices (pmap, mesh) give the loss and update of one, which needs each group kept on one device."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from train_helpers import WORDS, tiny_bert_folder

from flaxheads.data.groups import GroupTable, check_groups, collate_groups, tokenize_groups
from flaxheads.tasks.ranking.objectives import objective_fn
from flaxheads.tasks.ranking.task import Ranking
from flaxheads.training import loop
from flaxheads.training.optim import OptimConfig

pytestmark = pytest.mark.full

SIZES = [2, 4, 3, 4, 2, 3]  # candidates per group: ragged, padded to 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from flaxheads.interop.tokenizers import load_tokenizer
    from flaxheads.model.pretrained import from_pretrained

    folder = tiny_bert_folder(tmp_path_factory.mktemp("rank_bert"), num_labels=1)
    rng = np.random.default_rng(0)
    table = check_groups(
        GroupTable(
            [" ".join(rng.choice(WORDS, 3)) for _ in SIZES],
            [[" ".join(rng.choice(WORDS, int(rng.integers(2, 9)))) for _ in range(k)] for k in SIZES],
            [[1.0] + rng.integers(0, 3, k - 1).astype(float).tolist() for k in SIZES],
            "synthetic",
            [f"row {i}" for i in range(len(SIZES))],
        )
    )
    split = tokenize_groups(table, load_tokenizer(folder), 16)
    model = from_pretrained(
        folder, pooler="mean", head="linear", num_labels=1, problem_type="regression", head_options={"dropout": 0.0}
    )  # the step computes what model.apply does
    return model, split


def test_batches_hold_whole_groups(setup):
    _, split = setup
    b = collate_groups(split, np.array([1, 0, 4]), 4, 4, (16,))
    w = b["weights"].reshape(4, 4)
    assert b["input_ids"].shape == (16, 16)
    np.testing.assert_allclose(w.sum(1), [1, 1, 1, 0])  # a group's weight is 1, the padding group's 0
    assert (w > 0).sum(1).tolist() == [4, 2, 2, 0]  # group 1 has 4 candidates, groups 0 and 4 have 2
    assert b["group"].reshape(4, 4)[:, 0].tolist() == [1, 0, 4, -1]
    lo = split.offsets[1]
    np.testing.assert_array_equal(b["labels"][:4], split.labels[lo : lo + 4])
    assert (b["attention_mask"].sum(1) >= 1).all()  # padding rows attend to one token (no NaN)


def test_the_task_answers_the_run(setup):
    """What the run asks a ranking task: a line of what it trains, its largest batch (whole groups)
    and its keys of config.json."""
    _, split = setup
    task = Ranking("listwise", group_size=4, kind="ranking")
    assert (
        task.describe("6 train / 0 validation / 0 test", 3, 4)
        == "6 train / 0 validation / 0 test groups of up to 4 candidates, objective listwise, 3 steps of 4 groups"
    )
    batch = task.largest_batch(split, 4, 32)
    assert batch["input_ids"].shape == (16, 32) and batch["weights"].reshape(4, 4).sum(1).tolist() == [1, 1, 1, 1]
    assert task.config_keys({"train": split}) == {
        "objective": "listwise",
        "objective_options": {},
        "group_size": 4,
        "rows": {"train": sum(SIZES)},
    }


def _one_step(model, split, mode: str, objective: str):
    cfg = loop.TrainConfig(batch_size=4, parallel=mode)
    optim = OptimConfig(learning_rate=1e-2, head_learning_rate=1e-2, total_steps=4, warmup_steps=0)
    t = loop.Trainer.build(model, optim, cfg, task=Ranking(objective, group_size=4))
    batch = collate_groups(split, np.array([3, 1, 5, 2]), 4, 4, (16,))
    state, m = t.step(t.parallel.put_state(t.init_state()), batch)
    return t.parallel.get_state(state) if mode == "pmap" else jax.device_get(state), m, batch


def test_step_loss_is_the_objective_and_devices_agree(setup, objective="listwise"):
    if jax.local_device_count() < 2:
        pytest.skip("needs 2 devices")
    model, split = setup
    _, m1, batch = _one_step(model, split, "single", objective)
    scores = np.asarray(
        model.apply(
            model.params, batch["input_ids"], batch["attention_mask"], token_type_ids=batch.get("token_type_ids")
        )
    )[:, 0].reshape(4, 4)
    w = batch["weights"].reshape(4, 4)
    ref = objective_fn(objective)(scores, batch["labels"].reshape(4, 4), w > 0, w.sum(1))
    assert abs(m1["loss"] - float(ref)) < 1e-5
    for mode in ("pmap", "mesh"):  # (Adam's first update is sign-like: the gradient norm is the finer check)
        _, m2, _ = _one_step(model, split, mode, objective)
        assert abs(m1["loss"] - m2["loss"]) < 1e-5 and abs(m1["grad_norm"] - m2["grad_norm"]) < 1e-5, mode
        assert abs(m2["weight"] - 4.0) < 1e-5 and abs(m1["weight"] - 4.0) < 1e-5  # four groups, whatever their sizes
