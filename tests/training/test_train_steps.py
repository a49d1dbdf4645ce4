"""train_step / eval_step on one device: frozen backbone, accumulation, padding weights,
resume, buckets and compile counts, optimizer options, bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from train_helpers import random_split, tiny_bert_folder

import flaxheads as fh
from flaxheads.data.batching import make_buckets
from flaxheads.data.splits import collate
from flaxheads.training.loop import TrainConfig, Trainer, fit
from flaxheads.training.optim import OptimConfig, decay_mask, make_optimizer, schedule
from flaxheads.training.programs import make_eval_step
from flaxheads.training.steps import create_state, make_head_train_step, make_train_step

pytestmark = pytest.mark.full


@pytest.fixture(scope="module")
def folder(tiny_bert):
    return tiny_bert


@pytest.fixture(scope="module")
def dropout_folder(tmp_path_factory):
    return tiny_bert_folder(tmp_path_factory.mktemp("tiny_bert_dropout"), dropout=0.2)


def _model(folder, dropout=0.0, **kw):
    return fh.from_pretrained(
        folder, pooler="mean", head="linear", num_labels=3, head_options={"dropout": dropout}, **kw
    )


def _batch(split, idx, size, buckets=(32,)):
    return {k: jnp.asarray(v) for k, v in collate(split, np.asarray(idx), size, buckets).items()}


def _close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol, rtol=tol)


def test_frozen_backbone_bitwise_unchanged_and_no_backbone_moments(folder):
    model = _model(folder)
    cfg = OptimConfig(learning_rate=1e-2, freeze_backbone=True, total_steps=10)
    tx = make_optimizer(cfg)
    state = create_state(model.params, tx, freeze_backbone=True)
    before = jax.tree.map(np.array, model.params)
    # The optimizer state holds moments for the head only (2 moments per head param).
    n_head = sum(x.size for x in jax.tree.leaves(model.params["head"]))
    n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state) if np.ndim(x) > 0)
    assert n_opt == 2 * n_head
    step = jax.jit(make_train_step(model, tx, freeze_backbone=True))
    split = random_split(16)
    for i in range(3):
        state, m = step(state, _batch(split, range(i * 5, i * 5 + 5), 8))
    for a, b in zip(jax.tree.leaves(before["backbone"]), jax.tree.leaves(state.params["backbone"])):
        assert np.array_equal(a, np.asarray(b))  # bitwise
    moved = [
        not np.allclose(a, np.asarray(b))
        for a, b in zip(jax.tree.leaves(before["head"]), jax.tree.leaves(state.params["head"]))
    ]
    assert all(moved)


def test_frozen_step_differentiates_head_only(folder):
    """No backbone gradient is computed: the jaxpr of the frozen step has no transpose of the
    backbone (its cost is one forward), i.e. it is much smaller than the full step's."""
    model = _model(folder)
    split = random_split(8)
    b = _batch(split, range(8), 8)
    sizes = {}
    for frozen in (True, False):
        tx = make_optimizer(OptimConfig(freeze_backbone=frozen))
        state = create_state(model.params, tx, freeze_backbone=frozen)
        jaxpr = jax.make_jaxpr(make_train_step(model, tx, freeze_backbone=frozen))(state, b)
        sizes[frozen] = len(str(jaxpr))
    assert sizes[True] < 0.7 * sizes[False]


def test_head_train_step_on_features_equals_frozen_step(folder):
    model = _model(folder, dropout=0.1)
    tx = make_optimizer(OptimConfig(learning_rate=1e-2, freeze_backbone=True))
    split = random_split(8)
    b = _batch(split, range(8), 8)
    s1 = create_state(model.params, tx, freeze_backbone=True)
    s2 = create_state(model.params, tx, freeze_backbone=True)
    s1, m1 = jax.jit(make_train_step(model, tx, freeze_backbone=True))(s1, b)
    hidden, pmask = model.features(model.params["backbone"], b["input_ids"], b["attention_mask"])
    fb = {"hidden": hidden, "pool_mask": pmask, "labels": b["labels"], "weights": b["weights"]}
    s2, m2 = jax.jit(make_head_train_step(model, tx))(s2, fb)
    np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-6)
    _close(s1.params["head"], s2.params["head"], 1e-6)


def test_gradient_accumulation_equals_one_big_step(folder):
    model = _model(folder)
    split = random_split(16, seed=3)
    big_cfg = OptimConfig(learning_rate=1e-3, total_steps=10, warmup_steps=2, max_grad_norm=0.5)
    acc_cfg = OptimConfig(learning_rate=1e-3, total_steps=10, warmup_steps=2, max_grad_norm=0.5, accumulation_steps=4)
    tx_big, tx_acc = make_optimizer(big_cfg), make_optimizer(acc_cfg)
    big = create_state(model.params, tx_big)
    acc = create_state(model.params, tx_acc)
    step_big, step_acc = jax.jit(make_train_step(model, tx_big)), jax.jit(make_train_step(model, tx_acc))
    for _ in range(2):  # two optimizer steps: moments and schedule count must agree too
        big, _ = step_big(big, _batch(split, range(16), 16))
        for k in range(4):
            acc, _ = step_acc(acc, _batch(split, range(4 * k, 4 * k + 4), 4))
    _close(big.params, acc.params, 1e-5)
    assert not np.allclose(
        np.asarray(big.params["head"]["head"]["classifier"]["kernel"]),
        np.asarray(model.params["head"]["head"]["classifier"]["kernel"]),
    )


def test_padding_rows_change_nothing(folder):
    """A batch padded with weight-0 rows gives the same loss and update as the unpadded one."""
    model = _model(folder)
    tx = make_optimizer(OptimConfig(learning_rate=1e-3))
    split = random_split(5)
    step = jax.jit(make_train_step(model, tx))
    a, ma = step(create_state(model.params, tx), _batch(split, range(5), 5))
    b, mb = step(create_state(model.params, tx), _batch(split, range(5), 8))
    np.testing.assert_allclose(ma["loss"], mb["loss"], rtol=1e-6)
    assert float(mb["weight"]) == 5.0
    _close(a.params, b.params, 1e-6)


def test_loss_is_models_loss_and_eval_step_is_apply(folder):
    model = _model(folder)
    tx = make_optimizer(OptimConfig(learning_rate=0.0, head_learning_rate=0.0))
    split = random_split(6)
    b = _batch(split, range(6), 8)
    _, m = jax.jit(make_train_step(model, tx))(create_state(model.params, tx), b)
    logits = make_eval_step(model)(model.params, b)
    np.testing.assert_allclose(logits, model.apply(model.params, b["input_ids"], b["attention_mask"]), atol=1e-6)
    # torch's CrossEntropyLoss over the 6 real rows (dropout is 0 here)
    import torch

    ref = torch.nn.functional.cross_entropy(torch.tensor(np.asarray(logits[:6])), torch.tensor(split.labels[:6]).long())
    np.testing.assert_allclose(float(m["loss"]), float(ref), rtol=1e-5)


def test_resume_repeats_uninterrupted_run(dropout_folder):
    """Dropout keys are folded from the step and data order is a function of (seed, epoch):
    4 steps == 2 steps, back to host, then 2 more (crossing an epoch boundary)."""
    model = _model(dropout_folder, dropout=0.3)
    split = random_split(11, seed=5)
    cfg = TrainConfig(batch_size=4, max_steps=5, seed=7, log_every=1)
    ocfg = OptimConfig(learning_rate=1e-3, total_steps=5)
    full = fit(Trainer.build(model, ocfg, cfg), split, buckets=(32,), progress=False)
    half_tr = Trainer.build(model, ocfg, TrainConfig(batch_size=4, max_steps=2, seed=7, log_every=1))
    half = fit(half_tr, split, buckets=(32,), progress=False)
    host = half_tr.parallel.get_state(half.state)
    rest = fit(Trainer.build(model, ocfg, cfg), split, buckets=(32,), state=host, progress=False)
    assert rest.step == full.step == 5
    _close(full.state.params, rest.state.params, 1e-6)
    losses_full = [h["loss"] for h in full.history if "loss" in h]
    losses_resumed = [h["loss"] for h in half.history + rest.history if "loss" in h]
    np.testing.assert_allclose(losses_full, losses_resumed, rtol=1e-6)
    # and dropout really is on: a different seed changes the loss of step 1
    other = fit(
        Trainer.build(model, ocfg, TrainConfig(batch_size=4, max_steps=1, seed=8)), split, buckets=(32,), progress=False
    )
    assert other.history[0]["loss"] != losses_full[0]


def test_buckets_bound_compiles(folder):
    model = _model(folder)
    split = random_split(40, lengths=(3, 60), seed=1)
    buckets = make_buckets(64, 16)
    assert buckets == (16, 32, 48, 64)
    cfg = TrainConfig(batch_size=4, epochs=2, seed=0, log_every=100, eval_batch_size=8)
    trainer = Trainer.build(model, OptimConfig(total_steps=20), cfg)
    res = fit(
        trainer,
        split,
        evals={"validation": random_split(13, lengths=(3, 60), seed=2)},
        buckets=buckets,
        progress=False,
        group_by_length=False,
    )
    lengths_used = {s[0][1] for s in trainer.train_traces.shapes}
    assert res.step == 20
    assert res.train_compiles == len(lengths_used) <= len(buckets)
    assert len(lengths_used) >= 3  # the run really saw mixed lengths
    assert res.eval_compiles <= len(buckets)


def test_decay_mask_and_schedules(folder):
    model = _model(folder)
    mask = decay_mask(model.params)
    flat = {
        "/".join(k): v
        for k, v in jax.tree_util.tree_flatten_with_path(mask)[0]
        and {
            tuple(str(getattr(p, "key", p)) for p in path): v
            for path, v in jax.tree_util.tree_flatten_with_path(mask)[0]
        }.items()
    }
    assert flat["backbone/encoder/layer/0/attention/self/query/kernel"]
    assert flat["backbone/embeddings/word_embeddings/embedding"]
    assert not flat["backbone/encoder/layer/0/attention/self/query/bias"]
    assert not flat["backbone/embeddings/LayerNorm/scale"]
    assert not flat["backbone/encoder/layer/0/output/LayerNorm/bias"]
    cfg = OptimConfig(learning_rate=1.0, warmup_steps=10, total_steps=110, schedule="linear")
    s = schedule(1.0, cfg)
    np.testing.assert_allclose([s(0), s(5), s(10), s(60), s(110)], [0, 0.5, 1.0, 0.5, 0.0], atol=1e-6)
    c = schedule(1.0, OptimConfig(warmup_steps=10, total_steps=110, schedule="cosine"))
    np.testing.assert_allclose([c(10), c(60), c(110)], [1.0, 0.5, 0.0], atol=1e-6)


def test_weight_decay_matches_optax_adamw_masked(folder):
    """One group, no clipping: our factory == optax.adamw with the same mask (a reference)."""
    model = _model(folder)
    cfg = OptimConfig(learning_rate=1e-2, weight_decay=0.1, max_grad_norm=None, schedule="constant")
    ref = optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask)
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.01), model.params)
    u1, _ = make_optimizer(cfg).update(grads, make_optimizer(cfg).init(model.params), model.params)
    u2, _ = ref.update(grads, ref.init(model.params), model.params)
    _close(u1, u2, 1e-7)


def test_head_learning_rate_is_separate(folder):
    model = _model(folder)
    cfg = OptimConfig(learning_rate=0.0, head_learning_rate=1e-2, schedule="constant")
    tx = make_optimizer(cfg)
    state, _ = jax.jit(make_train_step(model, tx))(create_state(model.params, tx), _batch(random_split(8), range(8), 8))
    for a, b in zip(jax.tree.leaves(model.params["backbone"]), jax.tree.leaves(state.params["backbone"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.allclose(
        np.asarray(model.params["head"]["head"]["classifier"]["kernel"]),
        np.asarray(state.params["head"]["head"]["classifier"]["kernel"]),
    )


def test_bf16_backbone(folder):
    m32, m16 = _model(folder), _model(folder, dtype=jnp.bfloat16)
    split = random_split(8)
    b = _batch(split, range(8), 8)
    hidden, _ = m16.features(m16.params["backbone"], b["input_ids"], b["attention_mask"])
    assert hidden.dtype == jnp.bfloat16
    tx = make_optimizer(OptimConfig(learning_rate=1e-3))
    s16, m = jax.jit(make_train_step(m16, tx))(create_state(m16.params, tx), b)
    s32, m_ = jax.jit(make_train_step(m32, tx))(create_state(m32.params, tx), b)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(s16.params))
    assert m["loss"].dtype == jnp.float32
    np.testing.assert_allclose(float(m["loss"]), float(m_["loss"]), rtol=3e-2)
