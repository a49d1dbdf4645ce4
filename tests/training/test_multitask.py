"""Multi-task heads on one backbone forward: each task's logits and loss are those of a separate
single-task model, the objective is their weighted sum, and training moves every task."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import flaxheads as fh
from flaxheads.losses import loss_fn
from flaxheads.training.multitask import init_multitask_state, make_multitask_train_step, multitask
from tests.feature_helpers import padded, tiny_bert_dir, toy_split

pytestmark = pytest.mark.full


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tiny_bert_dir(tmp_path_factory)
    model = fh.from_pretrained(d, num_labels=3)
    mt = multitask(
        model,
        [
            {"name": "topic", "num_labels": 3},  # the preset head
            {
                "name": "tags",
                "num_labels": 4,
                "problem_type": "multi_label_classification",
                "pooler": "mean",
                "head": "mlp",
                "weight": 0.5,
            },
            {"name": "score", "num_labels": 1, "pooler": "max", "head": "linear", "weight": 2.0},
        ],
    )
    split = toy_split(16)
    ids, mask = padded(split, range(16), 14)
    rng = np.random.default_rng(0)
    labels = {
        "topic": split.labels,
        "tags": (rng.random((16, 4)) < 0.4).astype(np.float32),
        "score": rng.normal(size=(16,)).astype(np.float32),
    }
    return d, model, mt, ids, mask, labels


def test_each_task_equals_its_single_task_model(setup):
    _, model, mt, ids, mask, _ = setup
    out = jax.jit(mt.apply)(mt.params, ids, mask)  # jitted: eagerly each operation compiles on its own
    assert set(out) == {"topic", "tags", "score"}
    assert out["tags"].shape == (16, 4) and out["score"].shape == (16, 1)
    np.testing.assert_allclose(
        np.asarray(out["topic"]), np.asarray(jax.jit(model.apply)(model.params, ids, mask)), atol=1e-6
    )
    for name in mt.names:
        single = mt.task_model(name)
        np.testing.assert_allclose(
            np.asarray(out[name]), np.asarray(jax.jit(single.apply)(single.params, ids, mask)), atol=1e-6
        )


def test_objective_is_the_weighted_sum_of_task_losses(setup):
    _, _, mt, ids, mask, labels = setup
    logits = jax.jit(mt.apply)(mt.params, ids, mask)  # the program of the test above, from the compile cache
    w = np.ones(16, np.float32)
    w_tags = w.copy()
    w_tags[:5] = 0  # five examples have no tag labels
    total, per = mt.loss(logits, labels, {"topic": w, "tags": w_tags, "score": w})
    ref = {
        "topic": loss_fn("single_label_classification", 3)(logits["topic"], labels["topic"], w),
        "tags": loss_fn("multi_label_classification", 4)(logits["tags"][5:], labels["tags"][5:], w[5:]),
        "score": loss_fn("regression", 1)(logits["score"], labels["score"], w),
    }
    for k in ref:
        np.testing.assert_allclose(float(per[k]), float(ref[k]), rtol=1e-6)
    np.testing.assert_allclose(float(total), float(ref["topic"] + 0.5 * ref["tags"] + 2.0 * ref["score"]), rtol=1e-6)
    # a batch without any label for a task adds nothing (not NaN)
    total0, per0 = mt.loss(logits, labels, {"topic": w, "tags": np.zeros(16, np.float32), "score": w})
    assert float(per0["tags"]) == 0.0 and np.isfinite(float(total0))


def test_training_step_moves_every_task_and_zero_weight_freezes_a_head(setup):
    _, model, _, ids, mask, labels = setup
    mt = multitask(
        model,
        [
            {"name": "topic", "num_labels": 3},
            {
                "name": "tags",
                "num_labels": 4,
                "problem_type": "multi_label_classification",
                "pooler": "mean",
                "head": "linear",
                "weight": 0.0,
            },
            {"name": "score", "num_labels": 1, "pooler": "max", "head": "linear"},
        ],
    )
    tx = optax.adam(1e-2)
    state = init_multitask_state(mt, tx, freeze_backbone=True)
    step = jax.jit(make_multitask_train_step(mt, tx, freeze_backbone=True))
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels, "weights": np.ones(16, np.float32)}
    first = None
    for _ in range(30):
        state, m = step(state, batch)
        first = first or {k: float(v) for k, v in m.items()}
    last = {k: float(v) for k, v in m.items()}
    assert last["loss/topic"] < first["loss/topic"] and last["loss/score"] < first["loss/score"]
    for a, b in zip(jax.tree.leaves(state["params"]["heads"]["tags"]), jax.tree.leaves(mt.params["heads"]["tags"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # weight 0: no gradient reaches it
    for a, b in zip(jax.tree.leaves(state["params"]["backbone"]), jax.tree.leaves(mt.params["backbone"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # frozen backbone


def test_full_finetune_gradients_flow_into_the_backbone_from_every_task(setup):
    _, _, mt, ids, mask, labels = setup
    w = np.ones(16, np.float32)

    def task_loss(name):
        def f(bp):
            logits = mt.apply({**mt.params, "backbone": bp}, ids, mask)
            return mt.loss(logits, labels, w)[1][name]

        return f

    # one compiled program for every task's gradient (eagerly: ~200 programs)
    grads = jax.jit(lambda bp: {name: jax.grad(task_loss(name))(bp) for name in mt.names})(mt.params["backbone"])
    for name in mt.names:
        assert float(optax.tree.norm(grads[name])) > 0, name


def test_bad_task_specs(setup):
    _, model, *_ = setup
    with pytest.raises(ValueError, match="unique 'name'"):
        multitask(model, [{"name": "a", "num_labels": 2}, {"name": "a", "num_labels": 2}])
    with pytest.raises(ValueError, match="unknown keys"):
        multitask(model, [{"name": "a", "num_labels": 2, "pooling": "mean"}])
    with pytest.raises(ValueError, match="weight"):
        multitask(model, [{"name": "a", "num_labels": 2, "weight": -1}])
