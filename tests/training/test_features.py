"""Cached features: a head on the cache computes what it computes on a recomputed backbone."""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import pytest

import flaxheads as fh
from flaxheads.training.feature_cache import bucket_sizes, choose_level, encode_groups
from flaxheads.training.features import cache_features, predict_cached
from tests.feature_helpers import padded, tiny_bert_dir, toy_split

pytestmark = pytest.mark.full

BUCKETS = (4, 8, 16)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return tiny_bert_dir(tmp_path_factory)


def _recomputed_logits(model, split):
    """Every position of the last layer computed (``pooled_token_only=False``), the cache's reference."""
    t = max(len(x) for x in split.input_ids)
    ids, mask = padded(split, range(len(split.input_ids)), t)
    full = dataclasses.replace(model, pooled_token_only=False)
    return np.asarray(full.apply(full.params, ids, mask))


@pytest.mark.parametrize(
    "pooler,head,level",
    [
        (None, None, "pooled"),  # BERT preset: cls -> dense+tanh pooler (pretrained) -> classifier
        ("mean", "linear", "pooled"),
        ("last", "linear", "pooled"),  # one token: the encoder's last layer runs at that token alone
        ("max", "mlp", "pooled"),
        ("attention", "linear", "token"),  # learned token weights: full hidden states
        ("mean", "linear", "token"),  # token level forced for a pool that could be pooled
    ],
)
def test_cache_equals_recompute(bert_dir, pooler, head, level):
    model = fh.from_pretrained(bert_dir, pooler=pooler, head=head, num_labels=3)
    split = toy_split()
    cache = cache_features(
        model,
        model.params["backbone"],
        split,
        batch_size=8,
        buckets=BUCKETS,
        level="auto" if level == "pooled" else level,
    )
    assert cache.level == level and len(cache) == len(split.input_ids)
    if level == "token":
        assert sorted(b.length for b in cache.buckets) == [4, 8, 16]  # bucketed, not padded to the longest
    got = predict_cached(model, model.params["head"], cache, batch_size=8)
    np.testing.assert_allclose(got, _recomputed_logits(model, split), atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", range(6))
def test_encode_groups_pad_the_fewest_rows_and_no_new_lengths(seed):
    """Pooled features are encoded longest first: one partial batch in all, each batch at its
    longest text's bucket, never more padded tokens nor other lengths than a batch per bucket."""
    rng = np.random.default_rng(seed)
    buckets, bs = (16, 32, 64, 128), int(rng.choice([4, 8, 32]))
    lengths = rng.choice([3, 20, 31, 40, 64, 100, 150], size=int(rng.integers(1, 120)), p=rng.dirichlet(np.ones(7)))
    groups = encode_groups(lengths, bs, buckets)
    assert sorted(np.concatenate(list(groups.values())).tolist()) == list(range(len(lengths)))
    own = lambda n: min(b for b in buckets if b >= n) if n <= buckets[-1] else buckets[-1]
    batches = [(t, idx[s : s + bs]) for t, idx in groups.items() for s in range(0, len(idx), bs)]
    assert sum(len(b) < bs for _, b in batches) <= 1 and len(batches) == -(-len(lengths) // bs)
    assert all(t == own(max(lengths[b])) for t, b in batches)
    per_bucket = {t: sum(own(n) == t for n in lengths) for t in buckets}
    assert set(groups) <= {t for t, n in per_bucket.items() if n}
    assert sum(t * bs for t, _ in batches) <= sum(t * bs * -(-n // bs) for t, n in per_bucket.items())


def test_pad_to_longer_weighs_padding_against_a_compile():
    from flaxheads.training.features import pad_to_longer

    # 2 batches of 192 in a 256 program: 0.5 s of padding at 1 s a batch, against a compile
    assert pad_to_longer(2, 192, 256, 1.0, 0.6) and not pad_to_longer(2, 192, 256, 1.0, 0.4)
    assert not pad_to_longer(1, 16, 256, 0.01, 0.0)  # a program that was cached costs nothing to get


@pytest.mark.parametrize("merge", [True, False])
def test_short_groups_run_in_the_longest_program_when_padding_is_cheaper(bert_dir, monkeypatch, merge):
    """The decision forced either way: padded into the longest program (one compile) or each group in
    its own (three), the cached features are the same; a second split reuses what was compiled."""
    from flaxheads.training import features

    monkeypatch.setattr(features, "pad_to_longer", lambda *a: merge)
    model = fh.from_pretrained(bert_dir, pooler="mean", head="linear", num_labels=3)
    split = toy_split(60)
    assert len(encode_groups([len(x) for x in split.input_ids], 8, BUCKETS)) == 3
    enc = features.make_encoder(model, "pooled", ("mean",))
    cache = cache_features(model, model.params["backbone"], split, batch_size=8, buckets=BUCKETS, encoder=enc)
    assert sorted(t for _, t in enc.batch_seconds) == ([16] if merge else [4, 8, 16])
    assert enc.programs() == (1 if merge else 3)
    got = predict_cached(model, model.params["head"], cache, batch_size=8)
    np.testing.assert_allclose(got, _recomputed_logits(model, split), atol=1e-5, rtol=0)
    cache_features(model, model.params["backbone"], toy_split(60, seed=3), batch_size=8, buckets=BUCKETS, encoder=enc)
    assert enc.programs() == (1 if merge else 3)


_CONSTANTS = r"""
import json, sys
import jax
import numpy as np
import flaxheads as fh
from flaxheads.training.features import cache_features, make_encoder
from tests.feature_helpers import toy_split
from tests.onednn_helpers import weight_counts
model = fh.from_pretrained(sys.argv[1], pooler="mean", head="linear", num_labels=3)
split, p = toy_split(48), model.params["backbone"]
out = {}
for constants in (True, False):
    enc = make_encoder(model, "pooled", ("mean",), constants=constants)
    cache = cache_features(model, p, split, batch_size=16, buckets=(16,), encoder=enc)
    out[str(constants)] = np.asarray(cache.buckets[0].hidden).tolist()
batch = {"input_ids": np.ones((16, 16), np.int32), "attention_mask": np.ones((16, 16), np.int32)}
text = make_encoder(model, "pooled", ("mean",), constants=True).jitted(p).lower(batch).compile().as_text()
out.update(weight_counts(text))
out["auto"] = model.plan.constant_weights(sum(x.nbytes for x in jax.tree.leaves(p)))
print(json.dumps(out))
"""


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="oneDNN's dots are XLA:CPU's")
def test_constant_weights_are_prepacked_for_onednn_and_change_no_feature(tmp_path):
    """Under the AMX setting (oneDNN's dots, in its own process: XLA reads flags once) the encoder
    compiles the parameters in, XLA reorders every dense kernel for oneDNN at compile time, and the
    features equal those of the program that takes the parameters as arguments."""
    import json
    import subprocess
    import sys

    from flaxheads.runtime.xla_flags import ONEDNN_FLAGS
    from tests.hf_tiny import save_tiny

    path = save_tiny(tmp_path / "bert", "bert", layers=2, hidden_size=128, intermediate_size=512)[0]
    env = {**os.environ, "XLA_FLAGS": " ".join(ONEDNN_FLAGS), "FLAXHEADS_XLA_DEFAULTS": "0", "JAX_PLATFORMS": "cpu"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run(
        [sys.executable, "-c", _CONSTANTS, str(path)], env=env, capture_output=True, text=True, timeout=600, cwd=root
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if out["calls"] == 0:
        pytest.skip("this jaxlib's XLA:CPU made no oneDNN matmul calls (jax 0.10, or a build without oneDNN)")
    # every oneDNN product with a parameter for weights has them reordered once (the attention's
    # products multiply activations)
    assert out["prepacked"] == out["dense"] >= 4
    assert out["auto"]  # the AMX setting picks constants by itself
    np.testing.assert_allclose(np.asarray(out["True"]), np.asarray(out["False"]), atol=1e-6, rtol=0)


def test_memory_bound_spills_to_disk_or_refuses(bert_dir, tmp_path):
    model = fh.from_pretrained(bert_dir, pooler="attention", head="linear", num_labels=3)
    split = toy_split()
    with pytest.raises(ValueError, match="directory="):
        cache_features(model, model.params["backbone"], split, buckets=BUCKETS, max_bytes=1000)
    cache = cache_features(model, model.params["backbone"], split, buckets=BUCKETS, max_bytes=1000, directory=tmp_path)
    assert cache.directory == str(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted([f"{k}_{t}.npy" for k in ("hidden", "mask") for t in BUCKETS])
    assert isinstance(cache.buckets[0].hidden, np.memmap)
    np.testing.assert_allclose(
        predict_cached(model, model.params["head"], cache), _recomputed_logits(model, split), atol=1e-5, rtol=0
    )


def test_level_choice_is_checked(bert_dir):
    model = fh.from_pretrained(bert_dir, pooler="attention", head="linear", num_labels=3)
    assert choose_level(model.head.pooler) == "token"
    with pytest.raises(ValueError, match="cannot train on pooled"):
        choose_level(model.head.pooler, "pooled")
    with pytest.raises(ValueError, match="level must be"):
        choose_level(model.head.pooler, "tokens")


def test_batches_cover_every_example_once_and_are_reproducible(bert_dir):
    model = fh.from_pretrained(bert_dir, pooler="attention", head="linear", num_labels=3)
    split = toy_split()
    cache = cache_features(model, model.params["backbone"], split, buckets=BUCKETS)
    seen = []
    for b in cache.batches(8, seed=1, epoch=0):
        assert b["hidden"].shape[0] == 8
        keep = b["weights"] > 0
        seen += list(b["index"][keep])
        np.testing.assert_array_equal(b["labels"][keep], split.labels[b["index"][keep]])
    assert sorted(seen) == list(range(len(split.input_ids)))
    a = [b["index"] for b in cache.batches(8, seed=1, epoch=3)]
    b_ = [b["index"] for b in cache.batches(8, seed=1, epoch=3)]
    assert all((x == y).all() for x, y in zip(a, b_))


@pytest.mark.parametrize("pooler", ["attention", "mean"])
def test_the_cache_layout_is_known_before_encoding(bert_dir, pooler):
    """A run counts its heads' steps before it encodes: the buckets' sizes, from the texts' lengths."""
    model = fh.from_pretrained(bert_dir, pooler=pooler, head="linear", num_labels=3)
    split = toy_split()
    cache = cache_features(model, model.params["backbone"], split, batch_size=8, buckets=BUCKETS)
    sizes = bucket_sizes(model.head.pooler, [len(x) for x in split.input_ids], BUCKETS)
    assert sizes == [len(b.index) for b in cache.buckets] and len(sizes) == (1 if pooler == "mean" else 3)


def test_head_training_on_cache_equals_frozen_backbone_training(bert_dir):
    """Same rows, same step count: the head trained on cached features equals the head trained by
    flaxheads.training.steps with a frozen backbone recomputing features every step (dropout on)."""
    from flaxheads.training.optim import OptimConfig, make_optimizer
    from flaxheads.training.steps import create_state, make_head_train_step, make_train_step

    model = fh.from_pretrained(bert_dir, num_labels=3)  # BERT preset: dropout 0.1 in the head
    split = toy_split()
    cache = cache_features(model, model.params["backbone"], split, batch_size=8, buckets=BUCKETS)
    cfg = OptimConfig(learning_rate=1e-2, freeze_backbone=True, total_steps=20)
    tx = make_optimizer(cfg)
    s_cache = create_state(model.params, tx, freeze_backbone=True, seed=5)
    s_full = create_state(model.params, tx, freeze_backbone=True, seed=5)
    head_step = jax.jit(make_head_train_step(model, tx))
    full_step = jax.jit(make_train_step(model, tx, freeze_backbone=True))
    for b in list(cache.batches(8, seed=0, epoch=0))[:4]:
        keep = b["index"] >= 0
        ids, mask = padded(split, b["index"][keep], 16)
        full = {
            "input_ids": np.zeros((8, 16), np.int32),
            "attention_mask": np.zeros((8, 16), np.int32),
            "labels": b["labels"],
            "weights": b["weights"],
        }
        full["input_ids"][keep], full["attention_mask"][keep] = ids, mask
        full["attention_mask"][~keep, 0] = 1
        s_cache, m1 = head_step(s_cache, {k: b[k] for k in ("hidden", "pool_mask", "labels", "weights")})
        s_full, m2 = full_step(s_full, full)
        np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), atol=1e-5)
    for a, c in zip(jax.tree.leaves(s_cache.params["head"]), jax.tree.leaves(s_full.params["head"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), atol=1e-5, rtol=0)
