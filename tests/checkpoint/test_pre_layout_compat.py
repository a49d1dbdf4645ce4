"""Files written by flaxheads before its package was laid out by concept still load, and give the
logits that code computed (tests/fixtures/pre_layout: see its README.txt and make_pre_layout.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import optax
import pytest

import flaxheads as fh
from flaxheads.checkpoint import (
    RunCheckpointer,
    attach_head,
    list_checkpoints,
    load_backbone_params,
    load_head,
    read_meta,
    verify_checkpoint,
)
from flaxheads.training.steps import create_state

pytestmark = pytest.mark.legacy

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "pre_layout")
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def fix(tmp_path_factory):
    """A copy of the fixture (nothing a test does may write into the repository), and what the old code computed."""
    root = str(tmp_path_factory.mktemp("pre_layout") / "pre_layout")
    shutil.copytree(FIXTURE, root)
    with open(os.path.join(root, "expected.json")) as f:
        expected = json.load(f)
    return root, expected


@pytest.fixture(scope="module")
def batch(fix):
    _, expected = fix
    return np.asarray(expected["input_ids"], np.int32), np.asarray(expected["attention_mask"], np.int32)


def _backbone(root: str, **kw):
    return fh.from_pretrained(os.path.join(root, "backbone"), num_labels=3, ignore_mismatched_sizes=True, **kw)


def _logits(model, ids, mask, params=None) -> np.ndarray:
    # jitted: eagerly each operation compiles on its own (~100 programs a model)
    return np.asarray(jax.jit(model.apply)(model.params if params is None else params, ids, mask))


def test_head_checkpoint_attaches_with_old_logits(fix, batch):
    root, expected = fix
    ckpt = load_head(os.path.join(root, "head"))
    assert ckpt.step == 0 and ckpt.meta["library_version"] == expected["written_by"]["flaxheads"]
    assert ckpt.id2label == {0: "neg", 1: "neu", 2: "pos"}
    assert type(ckpt.head.pooler).__name__ == "Concat" and ckpt.head.head.layer_norm
    model = attach_head(_backbone(root), ckpt)
    assert model.arch is None and model.id2label == ckpt.id2label
    np.testing.assert_allclose(_logits(model, *batch), expected["head"]["logits"], **TOL)


def test_run_backbone_and_head_give_old_logits(fix, batch):
    root, expected = fix
    run = os.path.join(root, "run")
    ckpt = load_head(run)
    assert ckpt.step == expected["run"]["step"]
    model = attach_head(_backbone(root), ckpt)
    assert model.arch == "bert"  # the saved head is still recognised as BERT's preset
    fresh = _logits(model, *batch)
    trained = load_backbone_params(run, target=model.params["backbone"])
    got = _logits(model, *batch, params={"backbone": trained, "head": model.params["head"]})
    np.testing.assert_allclose(got, expected["run"]["logits"], **TOL)
    # the trained backbone matters: without it the logits are other ones
    assert np.abs(fresh - np.asarray(expected["run"]["logits"])).max() > 1e-2


def test_run_resumes_into_a_train_state(fix, batch):
    root, expected = fix
    model = _backbone(root, id2label=["neg", "neu", "pos"])
    model = attach_head(model, load_head(os.path.join(root, "run")))
    target = create_state(model.params, optax.adam(1e-2), seed=0)
    with RunCheckpointer(os.path.join(root, "run"), model, read_only=True) as ckr:
        assert ckr.all_steps() == [expected["run"]["step"]]
        state = ckr.restore(target_state=target)
    assert int(state.step) == expected["run"]["step"]
    np.testing.assert_array_equal(np.asarray(state.rng), expected["run"]["rng"])
    opt_sum = sum(float(np.abs(np.asarray(x, np.float64)).sum()) for x in jax.tree.leaves(state.opt_state))
    np.testing.assert_allclose(opt_sum, expected["run"]["opt_state_abs_sum"], rtol=1e-6)
    np.testing.assert_allclose(_logits(model, *batch, params=state.params), expected["run"]["logits"], **TOL)


def test_head_export_gives_old_logits(fix, batch):
    root, expected = fix
    head, params, cfg = fh.interop.load_head_export(os.path.join(root, "head_export"))
    assert cfg["flaxheads_version"] == expected["written_by"]["flaxheads"] and cfg["arch"] == "bert"
    base = _backbone(root)
    trained = load_backbone_params(os.path.join(root, "run"), target=base.params["backbone"])
    model = dataclasses.replace(base, head=head, params={"backbone": trained, "head": params})
    np.testing.assert_allclose(_logits(model, *batch), expected["head_export"]["logits"], **TOL)


@pytest.mark.parametrize("which", ["head", "run"])
def test_model_from_checkpoint_gives_old_logits(fix, batch, which):
    root, expected = fix
    model = fh.checkpoint.model_from_checkpoint(
        os.path.join(root, expected[which]["path"]), backbone=os.path.join(root, "backbone")
    )
    np.testing.assert_allclose(_logits(model, *batch), expected[which]["logits"], **TOL)


def test_old_checkpoints_list_and_verify(fix):
    root, expected = fix
    for which in ("head", "run"):
        where = os.path.join(root, expected[which]["path"])
        rows = list_checkpoints(where, verify=True)
        assert [(r["step"], r["status"]) for r in rows] == [(0 if which == "head" else 2, "ok")]
        assert verify_checkpoint(where) == rows[0]["step"]
        meta, _, _ = read_meta(where)
        assert meta["format"] == "flaxheads-checkpoint/1" and meta["backbone_name_or_path"] == "backbone"
