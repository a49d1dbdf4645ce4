"""Packed batches: several texts per row give the logits, losses and trained params of the same
texts unpacked (the unpacked model is the reference, itself parity-tested against PyTorch)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hf_tiny import save_tiny
from train_helpers import random_split

import flaxheads as fh
from flaxheads.data.packing import (
    AUTO_PACK_SHARE,
    first_fit,
    iterate_packed_batches,
    merge_rare_shapes,
    packed_batch,
    packed_shape,
    packed_slot_share,
)
from flaxheads.data.splits import Split, batch_plan, collate
from flaxheads.errors import FlaxheadsError, TrainingError
from flaxheads.training import loop
from flaxheads.training.optim import OptimConfig

pytestmark = pytest.mark.full

BUCKETS = (32, 64)  # the default bucket step: short texts pad to 32 unpacked
POOLERS = [
    "cls",
    "first_non_pad",
    "last",
    "mean",
    "max",
    "mean_sqrt_len",
    "weighted_mean",
    "attention",
    "bert",
    ["cls", "mean", "max"],
]


@pytest.fixture(scope="module")
def bert(tiny_bert):
    return tiny_bert


@pytest.fixture(scope="module")
def roberta(tiny_model):
    return tiny_model("roberta").path


def _split(n=11, seed=0, lengths=(3, 9), pad=0):
    s = random_split(n, lengths=lengths, seed=seed)
    if pad:  # RoBERTa's pad id is 1: keep it out of the texts
        s = Split(s.name, [np.where(x == pad, 7, x) for x in s.input_ids], s.labels)
    return s


def test_first_fit_and_layout():
    assert first_fit([5, 3, 4, 2, 6], 8) == [[0, 1], [2, 3], [4]]
    split = Split(
        "t",
        [np.arange(10, 10 + n) for n in (5, 3, 4)],
        np.array([0, 1, 2]),
        token_type_ids=[np.full(n, 1) for n in (5, 3, 4)],
    )
    b = packed_batch(split, [0, 1, 2], 4, (8,), pad_id=0, first_position=2)
    assert b["input_ids"].shape == (2, 8) and b["segment_index"].shape == (2, 2, 8)
    np.testing.assert_array_equal(b["segment_ids"][0], [1, 1, 1, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(b["position_ids"][0], [2, 3, 4, 5, 6, 2, 3, 4])
    np.testing.assert_array_equal(b["input_ids"][1, :4], [10, 11, 12, 13])
    np.testing.assert_array_equal(b["weights"], [[1, 1], [1, 0]])
    np.testing.assert_array_equal(b["labels"][:, 0], [0, 2])
    np.testing.assert_array_equal(b["segment_index"][0, 1, :3], [5, 6, 7])
    assert b["token_type_ids"][0].tolist() == [1] * 8 and b["token_type_ids"][1, 4:].tolist() == [0] * 4
    with pytest.raises(TrainingError, match="does not fit"):
        first_fit([9], 8)


def test_rare_shapes_merge_into_larger_ones_in_use():
    common, larger, rare, odd = (1, 64, 16, 32), (1, 128, 16, 32), (1, 32, 8, 32), (2, 32, 8, 32)
    shapes = [common] * 60 + [larger] * 20 + [rare] * 2 + [odd] * 3 + [(1, 96, 4, 32)]
    got = merge_rare_shapes(shapes, share=0.05)
    assert got[:80] == shapes[:80]  # held by >= 5% of the batches: kept
    assert got[80:82] == [common, common]  # the smallest larger shape in use
    assert got[82:85] == [odd] * 3  # no shape in use has 2 rows: kept
    assert got[85] == larger  # (1, 64) has fewer slots but a shorter row
    # a larger shape with more than max_growth times the slots is not worth it: keep the compile
    assert merge_rare_shapes([(1, 256, 16, 256)] * 40 + [(1, 32, 2, 32)], max_growth=4)[-1] == (1, 32, 2, 32)
    # nothing dominates it: kept
    assert merge_rare_shapes([(1, 64, 8, 32)] * 40 + [(1, 32, 16, 32)])[-1] == (1, 32, 16, 32)


def test_iterate_packed_batches_pads_rare_shapes():
    """One batch of very short texts among 24 of longer ones: its own shape (one 32-token row) is
    rare, and it is padded to the others' (one 64-token row); every batch keeps its examples."""
    split = _split(200, seed=5, lengths=(5, 8))
    for i in range(8):  # the first batch (no shuffling): 2-token texts
        split.input_ids[i] = split.input_ids[i][:2]
    own = [packed_shape(split, idx, 8, BUCKETS) for idx in batch_plan(split.lengths, 8, seed=0, epoch=0, shuffle=False)]
    assert own[0] == (1, 32, 8, 32) and set(own[1:]) == {(1, 64, 8, 32)}
    batches = list(iterate_packed_batches(split, 8, BUCKETS, seed=0, epoch=0, shuffle=False))
    assert {(b["input_ids"].shape[0], b["input_ids"].shape[1], *b["segment_index"].shape[1:]) for b in batches} == {
        (1, 64, 8, 32)
    }  # a compile fewer
    assert sum(int(b["weights"].sum()) for b in batches) == len(split)
    np.testing.assert_array_equal(batches[0]["input_ids"][0, :16], np.concatenate(split.input_ids[:8]))
    resumed = list(iterate_packed_batches(split, 8, BUCKETS, seed=0, epoch=0, shuffle=False, start=1))
    for a, b in zip(batches[1:], resumed):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="smaller than the batch's own"):
        packed_batch(split, np.arange(8, 16), 8, BUCKETS, shape=(1, 32, 8, 32))


def test_packed_slot_share_counts_both_layouts():
    """The share is the packed batches' token slots over the padded batches' (rows x bucket)."""
    split = _split(200, seed=5, lengths=(5, 8))
    plan = batch_plan(split.lengths, 8, seed=0, epoch=0, group_by_length=True)
    padded = sum(b["input_ids"].size for b in (collate(split, idx, 8, BUCKETS) for idx in plan))
    packed = sum(
        b["input_ids"].size for b in iterate_packed_batches(split, 8, BUCKETS, seed=0, epoch=0, group_by_length=True)
    )
    share = packed_slot_share(split, 8, BUCKETS, seed=0)
    assert share == pytest.approx(packed / padded)
    assert share <= AUTO_PACK_SHARE  # 8 texts of 5-7 tokens: one 64-token row against 8 rows of 32
    long = _split(40, seed=5, lengths=(40, 60))
    assert packed_slot_share(long, 8, BUCKETS) > AUTO_PACK_SHARE  # one text per row: nothing to gain


def _packed_forward(model):
    """``model.apply_packed`` on a packed batch dict, jitted (eagerly each operation compiles on its own)."""
    return jax.jit(
        lambda p, b: model.apply_packed(
            p, b["input_ids"], b["segment_ids"], b["position_ids"], b["segment_index"], b["segment_mask"]
        )
    )


def test_padded_packed_batch_gives_the_same_logits(bert):
    model = fh.from_pretrained(bert, pooler="mean", head="mlp", num_labels=3)
    split = _split()
    idx = np.arange(len(split))
    own = packed_shape(split, idx, len(idx), BUCKETS)
    big = (own[0] * 2, 64, own[2] * 2, 64)

    forward = _packed_forward(model)

    def logits(b):
        return np.asarray(forward(model.params, b))

    small, padded = packed_batch(split, idx, len(idx), BUCKETS), packed_batch(split, idx, len(idx), BUCKETS, shape=big)
    s_slots, p_slots = small["weights"].reshape(-1) > 0, padded["weights"].reshape(-1) > 0
    np.testing.assert_allclose(logits(padded)[p_slots], logits(small)[s_slots], atol=1e-5, rtol=0)


def _packed_vs_plain(model, split, first_position, atol=1e-5):
    idx = np.arange(len(split))
    packed = packed_batch(split, idx, len(idx), BUCKETS, pad_id=model.pad_token_id or 0, first_position=first_position)
    plain = collate(split, idx, len(idx), BUCKETS, pad_id=model.pad_token_id or 0)
    assert packed["input_ids"].size < plain["input_ids"].size / 2  # the point of packing
    got = np.asarray(_packed_forward(model)(model.params, packed))
    want = np.asarray(jax.jit(model.apply)(model.params, plain["input_ids"], plain["attention_mask"]))
    slots = packed["weights"].reshape(-1) > 0
    # which example each real slot holds: read its tokens back through segment_index
    texts = {tuple(x.tolist()): i for i, x in enumerate(split.input_ids)}
    rows, segs, _ = packed["segment_index"].shape
    members = [
        texts[tuple(packed["input_ids"][r, packed["segment_index"][r, s][packed["segment_mask"][r, s] > 0]].tolist())]
        for r in range(rows)
        for s in range(segs)
        if packed["weights"][r, s] > 0
    ]
    assert sorted(members) == list(idx)
    np.testing.assert_allclose(got[slots], want[members], atol=atol, rtol=0)
    assert np.abs(want).max() > 1e-3


@pytest.mark.parametrize("pooler", POOLERS, ids=lambda p: p if isinstance(p, str) else "+".join(p))
def test_packed_logits_equal_unpacked_for_every_pooler(bert, pooler):
    model = fh.from_pretrained(bert, pooler=pooler, head="mlp", num_labels=3)
    _packed_vs_plain(model, _split(), first_position=0)


def test_packed_roberta_restarts_positions_after_pad(roberta):
    """RoBERTa numbers positions from pad_token_id + 1: each packed text restarts there."""
    model = fh.from_pretrained(roberta)
    assert model.backbone.first_position() == 2
    _packed_vs_plain(model, _split(pad=1), first_position=2)


def _fit(folder, pack: bool, parallel="single", freeze=False):
    model = fh.from_pretrained(folder, num_labels=3)
    cfg = loop.TrainConfig(batch_size=8, max_steps=4, log_every=1, eval_every=100, pack=pack, parallel=parallel)
    trainer = loop.Trainer.build(
        model, OptimConfig(learning_rate=3e-3, total_steps=4, schedule="constant", freeze_backbone=freeze), cfg
    )
    res = loop.fit(trainer, _split(20, seed=3, lengths=(3, 12)), buckets=BUCKETS, progress=False)
    losses = [h["loss"] for h in res.history if "loss" in h]
    return losses, trainer.parallel.get_state(res.state).params


@pytest.mark.parametrize("freeze", [False, True], ids=["fine-tune", "frozen-backbone"])
def test_packed_training_equals_unpacked(bert, freeze):
    """Same batch plan, same examples per step, same weighted mean loss: same run (no dropout)."""
    plain_loss, plain = _fit(bert, pack=False, freeze=freeze)
    packed_loss, packed = _fit(bert, pack=True, freeze=freeze)
    np.testing.assert_allclose(packed_loss, plain_loss, rtol=1e-5)
    assert plain_loss[0] != plain_loss[-1]
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(packed)):
        np.testing.assert_allclose(b, a, atol=2e-5, rtol=0)


def test_packed_pmap_equals_single(bert):
    loss1, p1 = _fit(bert, pack=True)
    loss4, p4 = _fit(bert, pack=True, parallel="pmap")
    np.testing.assert_allclose(loss4, loss1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p4)):
        np.testing.assert_allclose(b, a, atol=2e-5, rtol=0)


def test_packing_refused_where_texts_cannot_be_kept_apart(tmp_path):
    folder = save_tiny(tmp_path / "gpt2", "gpt2")[0]
    model = fh.from_pretrained(folder)
    cfg = loop.TrainConfig(batch_size=4, max_steps=1, pack=True)
    trainer = loop.Trainer.build(model, OptimConfig(total_steps=1), cfg)
    with pytest.raises(TrainingError, match="packing"):
        loop.fit(trainer, _split(4), buckets=BUCKETS, progress=False)
    with pytest.raises(FlaxheadsError, match="packed"):
        model.apply_packed(
            model.params,
            *(np.zeros((1, 8), np.int32),) * 3,
            np.zeros((1, 1, 8), np.int32),
            np.ones((1, 1, 8), np.int32),
        )
