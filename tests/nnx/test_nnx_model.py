"""The NNX model (``SequenceModel.to_nnx``) against the functional path: logits and gradients of
whole models (BERT with several heads, a left-padded Qwen3 with its preset), ``nnx.split`` /
``nnx.merge`` to and from the params tree, 20 ``nnx.Optimizer`` steps against ``make_train_step``
(LoRA, frozen base), the mesh, and head checkpoints / exports in both directions."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hf_tiny import padded_batch, save_tiny, tiny_config

import flaxheads as fh
from flaxheads import nnx as fnnx
from flaxheads.errors import ConfigError
from flaxheads.runtime.sharding import Layout, make_mesh, path_names
from flaxheads.training.steps import create_state, make_train_step

pytestmark = pytest.mark.full


@pytest.fixture(scope="module")
def bert(tiny_model):
    # its own: no dropout (the NNX and functional train steps agree) on seed 1's weights, where the mesh test's
    # 1e-6 loss tolerance holds (conftest's tiny_bert, seed 0, misses it by 2e-7)
    path, _ = tiny_model("bert", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids, mask = padded_batch("bert", tiny_config("bert"))
    return path, jnp.asarray(ids), jnp.asarray(mask)


def _perturb_head(model, seed=0):
    rng = np.random.default_rng(seed)
    head = jax.tree.map(lambda x: x + jnp.asarray(0.2 * rng.normal(size=x.shape), jnp.float32), model.params["head"])
    return {**model.params, "head": head}


def _assert_close(a, b, what):
    """Bitwise where the programs are the same; 1e-6 of the tensor's scale where XLA may reorder."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, what
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * max(1.0, float(np.abs(b).max())), err_msg=what)


def check_model(model, ids, mask):
    """Logits and gradients (every param, backbone included) of model.to_nnx() equal the functional ones."""
    params = _perturb_head(model)
    nm = model.to_nnx(params, freeze_backbone=False)
    want = model.apply(params, ids, mask)
    w = jnp.asarray(np.random.default_rng(1).normal(size=want.shape), jnp.float32)

    @nnx.jit  # both paths in one program: op-by-op backward passes of whole models compile hundreds
    def both(params, nm):
        functional = jax.value_and_grad(lambda p: jnp.sum(model.apply(p, ids, mask) * w))(params)
        return nm(ids, mask), functional, nnx.value_and_grad(lambda m: jnp.sum(m(ids, mask) * w))(nm)

    logits, (value, g_want), (n_value, g_got) = both(params, nm)
    reference = (want, value, g_want)
    _assert_close(logits, want, "logits")
    _assert_close(n_value, value, "loss")
    g_got = {
        "backbone": nnx.to_pure_dict(g_got["backbone"]),
        "head": fnnx.layers._drop_empty(nnx.to_pure_dict(g_got["head"])),
    }
    assert jax.tree.structure(g_got) == jax.tree.structure(g_want)
    for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(g_got), jax.tree.leaves(g_want)):
        _assert_close(a, b, jax.tree_util.keystr(p))
    return nm, w, reference


def test_bert_model_and_mesh(bert):
    """A pooler and a head with params on every position's hidden state (the preset, which reads one
    token, is the model of the train-step tests); then the same NNX model sharded on a 2 x 2 mesh."""
    path, ids, mask = bert
    model = fh.from_pretrained(path, pooler=["attention", "bert"], head="mlp")
    nm, w, (want, value, g_want) = check_model(model, ids, mask)
    mesh = make_mesh({"data": 1, "fsdp": 2, "tensor": 2})
    shardings = fnnx.shardings(nm, mesh)
    # every param is placed as the functional Layout places it (the logical axes of its family)
    placed = {
        path_names(p): s.spec
        for p, s in jax.tree_util.tree_leaves_with_path(Layout.for_model(mesh, model).shardings(model.params))
    }
    got = {path_names(p)[:-1]: s.spec for p, s in jax.tree_util.tree_leaves_with_path(shardings)}
    assert {k: got[k] for k in placed} == placed and any(len(s) for s in placed.values())
    kernel = nm.backbone["encoder"]["layer"]["0"]["attention"]["self"]["query"]["kernel"]
    assert kernel.get_metadata("out_sharding") == ("embed", "heads")
    nnx.update(nm, jax.device_put(nnx.state(nm), shardings))
    assert len(kernel[...].sharding.device_set) == 4

    @nnx.jit
    def forward_and_grad(m):
        return m(ids, mask), nnx.value_and_grad(lambda m: jnp.sum(m(ids, mask) * w))(m)

    with jax.set_mesh(mesh):
        logits, (n_value, grads) = forward_and_grad(nm)
    _assert_close(logits, want, "logits on the mesh")
    _assert_close(n_value, value, "loss on the mesh")
    grads = nnx.to_pure_dict(grads)
    for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(grads["backbone"]), jax.tree.leaves(g_want["backbone"])):
        _assert_close(a, b, "gradient on the mesh " + jax.tree_util.keystr(p))


def test_left_padded_qwen3_preset(tmp_path):
    path, _ = save_tiny(tmp_path / "qwen3", "qwen3")
    model = fh.from_pretrained(path)
    assert model.arch is not None and model.pool_mask == "non_pad_token"
    ids, mask = padded_batch("qwen3", tiny_config("qwen3"), side="left")
    check_model(model, jnp.asarray(ids), jnp.asarray(mask))


def test_split_merge_and_params_tree(bert):
    path, ids, mask = bert
    model = fh.from_pretrained(path, pooler="attention", head="mlp").with_lora(rank=2)
    params = {**_perturb_head(model), "lora": jax.tree.map(lambda x: x + 0.1, model.params["lora"])}
    nm = model.to_nnx(params)
    graphdef, state = nnx.split(nm)
    # the state's paths are the params tree's: its Params are the trainable part, FrozenBase the base
    assert sorted(nnx.to_pure_dict(nnx.state(nm, nnx.Param))) == ["head", "lora"]
    assert jax.tree.all(
        jax.tree.map(np.array_equal, nnx.to_pure_dict(nnx.state(nm, fnnx.FrozenBase))["backbone"], params["backbone"])
    )
    assert jax.tree.all(jax.tree.map(np.array_equal, nm.params(), params))
    back = nnx.merge(graphdef, state)
    np.testing.assert_array_equal(np.asarray(back(ids, mask)), np.asarray(model.apply(params, ids, mask)))
    # a functional tree loads into the NNX model, and to_functional gives it back
    other = {**params, "head": jax.tree.map(lambda x: -x, params["head"])}
    back.load_params(other)
    np.testing.assert_array_equal(np.asarray(back(ids, mask)), np.asarray(model.apply(other, ids, mask)))
    fm = back.to_functional()
    assert fm.lora == model.lora and jax.tree.all(jax.tree.map(np.array_equal, fm.params, other))
    with pytest.raises(ConfigError, match="frozen base"):
        model.to_nnx(freeze_backbone=False)


def _batches(n, seed=0):
    ids, mask = padded_batch("bert", tiny_config("bert"))
    rng = np.random.default_rng(seed)
    for _ in range(n):
        yield {
            "input_ids": jnp.asarray(rng.permutation(ids)),
            "attention_mask": jnp.asarray(mask),
            "labels": jnp.asarray(rng.integers(0, 3, size=3)),
            "weights": jnp.ones(3, jnp.float32),
        }


@pytest.mark.parametrize("case", ["lora", "frozen"])
def test_nnx_optimizer_matches_make_train_step(bert, case):
    path, _, _ = bert
    model = fh.from_pretrained(path)
    freeze = case == "frozen"
    if case == "lora":
        model = model.with_lora(rank=2)
        model = type(model)(
            **{
                **model.__dict__,
                "params": {**model.params, "lora": jax.tree.map(lambda x: x + 0.05, model.params["lora"])},
            }
        )
    tx = optax.adamw(1e-2)
    step = jax.jit(make_train_step(model, tx, freeze_backbone=freeze))
    state = create_state(model.params, tx, freeze_backbone=freeze)
    nm = model.to_nnx(freeze_backbone=True if freeze else None)
    opt = nnx.Optimizer(nm, tx, wrt=nnx.Param)
    lf = model.loss_fn()

    @nnx.jit
    def nnx_step(nm, opt, batch):
        def loss(m):
            logits = m(batch["input_ids"], batch["attention_mask"], train=True)
            return lf(logits, batch["labels"], batch["weights"])

        value, grads = nnx.value_and_grad(loss)(nm)
        opt.update(nm, grads)
        return value

    want, got = [], []
    for batch in _batches(20):
        state, metrics = step(state, batch)
        want.append(float(metrics["loss"]))
        got.append(float(nnx_step(nm, opt, batch)))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert not jax.tree.all(jax.tree.map(np.array_equal, nm.params()["head"], model.params["head"]))  # it trained
    assert jax.tree.all(jax.tree.map(np.array_equal, nm.params()["backbone"], model.params["backbone"]))  # frozen
    for a, b in zip(jax.tree.leaves(nm.params()), jax.tree.leaves(state.params)):
        _assert_close(a, b, case)


def test_checkpoints_and_exports_both_ways(bert, tmp_path):
    path, ids, mask = bert
    base = fh.from_pretrained(path, pooler="attention", head="mlp")
    # NNX -> functional: a head changed in NNX saves and exports, and loads on the functional path
    nm = base.to_nnx()
    fnnx.load_head_params(nm.head, _perturb_head(base, seed=3)["head"])
    want = nm(ids, mask)
    fh.save_head(tmp_path / "ckpt", nm.to_functional())
    loaded = fh.attach_head(base, fh.load_head(tmp_path / "ckpt"))
    np.testing.assert_array_equal(np.asarray(loaded.apply(loaded.params, ids, mask)), np.asarray(want))
    fh.interop.export_head(nm.to_functional(), tmp_path / "export")
    seq, head_params, _ = fh.interop.load_head_export(tmp_path / "export")
    np.testing.assert_array_equal(
        np.asarray(base.head_apply(head_params, *base.features(base.params["backbone"], ids, mask))), np.asarray(want)
    )
    fh.interop.export_transformers(nm.to_functional(), tmp_path / "hf")
    back = fh.interop.load_transformers(tmp_path / "hf")
    np.testing.assert_array_equal(np.asarray(back.apply(back.params, ids, mask)), np.asarray(want))
    # functional -> NNX: a saved / exported head loads into an NNX model and an NNX head
    params = _perturb_head(base, seed=4)
    ref = base.apply(params, ids, mask)
    fh.save_head(tmp_path / "ckpt2", base, params)
    ckpt = fh.load_head(tmp_path / "ckpt2")
    np.testing.assert_array_equal(np.asarray(fh.attach_head(base, ckpt).to_nnx()(ids, mask)), np.asarray(ref))
    fh.interop.export_head(base, tmp_path / "export2", params=params["head"])
    seq, head_params, _ = fh.interop.load_head_export(tmp_path / "export2")
    hidden, pmask = base.features(base.params["backbone"], ids, mask)
    np.testing.assert_array_equal(
        np.asarray(fnnx.SequenceHead(seq, base.hidden_size, params=head_params)(hidden, pmask)), np.asarray(ref)
    )
