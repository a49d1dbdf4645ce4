"""fit's callbacks: when they are called, and checkpoints taken at exactly the steps fit evaluates
(the checkpoint callback has no schedule of its own), every N steps and at the end."""

import jax
import numpy as np
import pytest
from train_helpers import random_split

import flaxheads as fh
from flaxheads.checkpoint import list_checkpoints
from flaxheads.runtime.parallel import Parallel
from flaxheads.training.loop import (
    Callback,
    FitCheckpointing,
    TrainConfig,
    Trainer,
    changed_settings,
    fit,
    flat_metrics,
)
from flaxheads.training.optim import OptimConfig

pytestmark = pytest.mark.full

TOTAL = 10


@pytest.fixture(scope="module")
def model(tiny_bert):
    folder = tiny_bert
    return fh.from_pretrained(folder, pooler="mean", head="linear", num_labels=3, head_options={"dropout": 0.0})


@pytest.fixture(scope="module")
def trainer(model):
    # 12 examples in batches of 4: 3 steps per epoch, so fit evaluates at 3, 6, 9 and the last step 10
    return Trainer.build(
        model,
        OptimConfig(learning_rate=1e-3, total_steps=TOTAL),
        TrainConfig(batch_size=4, eval_batch_size=4, max_steps=TOTAL, log_every=5),
    )


class Recorder(Callback):
    def __init__(self):
        self.calls = []

    def on_evaluate(self, state, step, results):
        self.calls.append(("evaluate", step, sorted(results)))

    def on_step_end(self, state, step, metrics):
        self.calls.append(("step_end", step, metrics["step"]))

    def on_end(self, state, step):
        self.calls.append(("end", step))


def _fit(trainer, callbacks, evals=True, state=None):
    return fit(
        trainer,
        random_split(12, seed=1),
        evals={"validation": random_split(5, seed=2)} if evals else None,
        buckets=(24,),
        progress=False,
        callbacks=callbacks,
        state=state,
    )


def test_callbacks_are_called_at_each_step_after_its_evaluation(trainer):
    rec = Recorder()
    res = _fit(trainer, [rec])
    evaluated = [c[1] for c in rec.calls if c[0] == "evaluate"]
    assert evaluated == [3, 6, 9, 10] == [h["step"] for h in res.history if "eval" in h]
    assert [c[1] for c in rec.calls if c[0] == "step_end"] == list(range(1, TOTAL + 1))
    for s in evaluated:  # a step ends after its evaluation has been reported
        assert rec.calls.index(("evaluate", s, ["validation"])) + 1 == rec.calls.index(("step_end", s, s))
    assert rec.calls[-1] == ("end", TOTAL) and sum(c[0] == "end" for c in rec.calls) == 1
    # resumed at the last step: nothing to train, the restored state is evaluated once and the run ends
    again = Recorder()
    _fit(trainer, [again], state=trainer.parallel.get_state(res.state))
    assert again.calls == [("evaluate", TOTAL, ["validation"]), ("end", TOTAL)]


# every=0: no saves along the way, but the end is saved (with its evaluation): a run keeps its model
@pytest.mark.parametrize("every,want", [(None, [3, 6, 9, 10]), (4, [3, 4, 6, 8, 9, 10]), (0, [10])])
def test_checkpoints_follow_fits_evaluations(trainer, model, tmp_path, every, want):
    ckr = fh.RunCheckpointer(tmp_path, model, keep=None, best_metric="validation/accuracy")
    ckpt = FitCheckpointing(ckr, every=every)
    res = _fit(trainer, [ckpt])
    ckr.close()
    assert ckpt.saved == want and ckr.all_steps() == want
    # each evaluation's metrics were saved with its step (steps saved between evaluations have none)
    evals = {h["step"]: h["eval"]["validation"]["accuracy"] for h in res.history if "eval" in h}
    rows = {r["step"]: r for r in list_checkpoints(tmp_path)}
    for s in want:
        m = rows[s]["metrics"]
        assert (m is None) if s not in evals else m["validation/accuracy"] == pytest.approx(evals[s])
    best = max((acc, s) for s, acc in evals.items() if s in want)[1]  # ties: the latest, as Orbax
    assert ckr.best_step() == best and [s for s, r in rows.items() if r["best"]] == [best]


def test_checkpoints_without_evaluations_every_n_and_the_end(trainer, model, tmp_path):
    ckr = fh.RunCheckpointer(tmp_path, model, keep=None)
    _fit(trainer, [FitCheckpointing(ckr, every=4)], evals=False)
    ckr.close()
    assert ckr.all_steps() == [4, 8, 10]


def test_pmap_state_is_saved_through_host_state(model, tmp_path):
    par = Parallel("pmap")
    tr = Trainer.build(
        model,
        OptimConfig(learning_rate=1e-3, total_steps=2),
        TrainConfig(batch_size=4, eval_batch_size=4, max_steps=2, parallel="pmap"),
        par,
    )
    ckr = fh.RunCheckpointer(tmp_path, model, keep=None)
    res = _fit(tr, [FitCheckpointing(ckr, every=1, host_state=par.get_state)], evals=False)
    got = ckr.restore(target_state=tr.init_state())
    ckr.close()
    assert ckr.all_steps() == [1, 2] and int(got.step) == 2
    final = par.get_state(res.state)
    for x, y in zip(jax.tree.leaves(got.params), jax.tree.leaves(final.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_flat_metrics_and_changed_settings():
    res = {"validation": {"accuracy": 0.5, "per_class": {"f1": [0.1]}, "n": 3, "ok": True}}
    assert flat_metrics(res) == {"validation/accuracy": 0.5, "validation/n": 3.0}
    assert changed_settings({"train": {"lr": 1, "seed": 0}}, {"train": {"lr": 2, "seed": 0}, "x": 1}) == [
        "train.lr: 1 -> 2",
        "x: None -> 1",
    ]
