"""One-token poolers on BERT-like, DeBERTa and decoder backbones: the last layer runs at the pooled token alone
(``only_at``). The logits must be what PyTorch's full encoder gives, the gradients what torch
autograd gives through it, and the compiled program must do less work."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hf_tiny import DECODERS, assert_grads_match, padded_batch, save_tiny  # noqa: E402

import flaxheads as fh  # noqa: E402
from flaxheads.backbones.base import BackboneError  # noqa: E402
from flaxheads.backbones.registry import load_backbone  # noqa: E402

pytestmark = pytest.mark.full

ONE_TOKEN = [
    ("cls", {}),
    ("first_non_pad", {}),
    ("last", {}),
    ("bert", {}),
    ("dense", {"source": "last"}),
    ("xlnet", {"summary_type": "first"}),
    ("xlnet", {"summary_type": "last"}),
]
EVERY_TOKEN = [
    ("mean", {}),
    ("max", {}),
    ("attention", {}),
    (["cls", "mean"], {}),
    (["cls", "last"], {}),
    ("xlnet", {"summary_type": "mean"}),
]


V3 = dict(
    relative_attention=True,
    position_buckets=8,
    pos_att_type=["p2c", "c2p"],
    share_att_key=True,
    norm_rel_ebd="layer_norm",
    position_biased_input=False,
)
DEBERTA = {  # the relative-attention arrangements whose scores are read at the query's diagonal offset
    "v3": V3,
    "v2": dict(relative_attention=True, pos_att_type=["p2c", "c2p"], share_att_key=False, max_relative_positions=6),
    "c2p": dict(relative_attention=True, pos_att_type=["c2p"], max_relative_positions=5),
    "p2c": dict(V3, pos_att_type=["p2c"]),
    "conv": dict(V3, conv_kernel_size=3, conv_groups=2, conv_act="gelu", layers=2),  # the first layer's alone
    "conv_one_layer": dict(V3, conv_kernel_size=3, conv_groups=2, conv_act="gelu", num_hidden_layers=1),
}


@pytest.fixture(scope="module")
def tiny(tiny_model):
    made = {arch: tiny_model(arch) for arch in ("bert", "roberta", "distilbert")}
    return made | {"deberta_" + name: tiny_model("deberta-v2", **over) for name, over in DEBERTA.items()}


def _model(path, pooler, options, **kw):
    return fh.from_pretrained(
        path,
        pooler=pooler,
        pooler_options=options or None,
        head="linear",
        num_labels=3,
        ignore_mismatched_sizes=True,
        **kw,
    )


def _torch_hidden(pt, ids, mask):
    with torch.no_grad():
        return pt.base_model(torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()


# Each test pads on the right and on the left: the shapes are the same, so one compiled program serves both.
SIDES = ("right", "left")


# Every one-token pooler on BERT; on the other encoders the first position and the last non-pad one
# (the backbone's one-query path is the same whichever pooler names the position).
ONE_TOKEN_CASES = [("bert", p, o) for p, o in ONE_TOKEN] + [
    (arch, p, o) for arch in ("roberta", "distilbert") for p, o in ONE_TOKEN if p in ("cls", "last")
]


@pytest.mark.parametrize("arch,pooler,options", ONE_TOKEN_CASES, ids=lambda v: str(v))
def test_one_token_poolers_give_the_full_encoders_logits(tiny, arch, pooler, options):
    """Reference: the pooler and head on PyTorch's whole last hidden state."""
    path, pt = tiny[arch]
    m = _model(path, pooler, options)
    forward = jax.jit(m.apply)
    for side in SIDES:
        ids, mask = padded_batch(arch, pt.config, side)
        hidden, pmask = m.pooler_inputs(m.params["backbone"], jnp.asarray(ids), jnp.asarray(mask))
        assert hidden.shape == (3, 1, m.hidden_size) and np.asarray(pmask).tolist() == [[1]] * 3
        ref = np.asarray(m.head_apply(m.params["head"], jnp.asarray(_torch_hidden(pt, ids, mask)), jnp.asarray(mask)))
        got = np.asarray(forward(m.params, ids, mask))
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0, err_msg=side)
        assert np.abs(ref).max() > 1e-2


# Every arrangement at the last non-pad token (an offset that moves with the padding side); the first
# token and the first non-pad one on v3 and the convolution layer.
DEBERTA_CASES = [(v, "last") for v in sorted(DEBERTA)] + [
    (v, p) for v in ("v3", "conv") for p in ("deberta", "first_non_pad")
]


@pytest.mark.parametrize("variant,pooler", DEBERTA_CASES)
def test_deberta_relative_attention_at_one_token(tiny, variant, pooler):
    path, pt = tiny["deberta_" + variant]
    m = _model(path, pooler, {})
    forward = jax.jit(m.apply)
    for side in SIDES:
        ids, mask = padded_batch("deberta-v2", pt.config, side)
        hidden, _ = m.pooler_inputs(m.params["backbone"], jnp.asarray(ids), jnp.asarray(mask))
        assert hidden.shape == (3, 1, m.hidden_size)
        ref = np.asarray(m.head_apply(m.params["head"], jnp.asarray(_torch_hidden(pt, ids, mask)), jnp.asarray(mask)))
        np.testing.assert_allclose(np.asarray(forward(m.params, ids, mask)), ref, atol=1e-5, rtol=0, err_msg=side)


@pytest.mark.parametrize("arch", DECODERS)
def test_decoder_classifiers_at_the_last_token(arch, tmp_path):
    """The HF preset (last non-pad token, ``input_ids != pad``): grouped-query attention, sliding
    windows, soft-capping and sandwich norms at one query, against PyTorch's whole last hidden state."""
    path, pt = save_tiny(tmp_path, arch)
    m = fh.from_pretrained(path)
    forward = jax.jit(m.apply)
    for side in SIDES:
        ids, mask = padded_batch(arch, pt.config, side)
        pmask = m.pooling_mask(jnp.asarray(ids), jnp.asarray(mask))
        hidden, _ = m.pooler_inputs(m.params["backbone"], jnp.asarray(ids), jnp.asarray(mask))
        assert hidden.shape == (3, 1, m.hidden_size)
        ref = np.asarray(m.head_apply(m.params["head"], jnp.asarray(_torch_hidden(pt, ids, mask)), pmask))
        np.testing.assert_allclose(np.asarray(forward(m.params, ids, mask)), ref, atol=2e-5, rtol=0, err_msg=side)
        assert np.abs(ref).max() > 1e-2


@pytest.mark.parametrize("pooler,options", EVERY_TOKEN, ids=lambda v: str(v))
def test_poolers_reading_more_tokens_get_every_position(tiny, pooler, options):
    path, pt = tiny["bert"]
    m = _model(path, pooler, options)
    ids, mask = padded_batch("bert", pt.config)
    hidden, _ = m.pooler_inputs(m.params["backbone"], jnp.asarray(ids), jnp.asarray(mask))
    assert hidden.shape == (3, 9, m.hidden_size)


def test_the_compiled_forward_does_less_work(tiny):
    path, pt = tiny["bert"]
    m = _model(path, "bert", {})
    ids, mask = padded_batch("bert", pt.config)

    def flops(model):
        cost = jax.jit(model.apply).lower(model.params, ids, mask).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    full = flops(dataclasses.replace(m, pooled_token_only=False))
    assert flops(m) < 0.85 * full  # 2 layers: the last one at 1 of 9 positions


@pytest.mark.parametrize(
    "name,cancelled",
    [("bert", "attention.self.key.bias"), ("deberta_v3", "pos_key_proj.bias"), ("deberta_c2p", "key_proj.bias")],
)
def test_gradients_match_torch_autograd_through_the_full_encoder(tiny, name, cancelled):
    """A train step's gradients (no dropout): d sum(logits * w) for every backbone weight, against
    PyTorch's XForSequenceClassification, which computes every position of the last layer."""
    path, pt = tiny[name]
    m = fh.from_pretrained(path)  # the HF preset: a dense pooler on [CLS], a linear classifier
    assert m.head.pooler.position(jnp.ones((1, 2))) is not None
    ids, mask = padded_batch(name.split("_")[0].replace("deberta", "deberta-v2"), pt.config)
    w = np.random.default_rng(0).normal(size=(3, 3)).astype(np.float32)
    pt.zero_grad()
    (pt(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits * torch.tensor(w)).sum().backward()
    prefix = pt.base_model_prefix + "."
    ref = {
        k[len(prefix) :]: p.grad.numpy().copy()
        for k, p in pt.named_parameters()
        if k.startswith(prefix)
        and p.grad is not None
        and not k.endswith("pooler.dense.weight")
        and not k.endswith("pooler.dense.bias")
    }
    g = jax.jit(jax.grad(lambda bp: jnp.sum(m.apply({**m.params, "backbone": bp}, ids, mask) * w)))(
        m.params["backbone"]
    )
    ours = m.backbone.state_from_params(g)
    assert_grads_match(ours, ref, softmax_cancelled=lambda k: k.endswith(cancelled))


def test_remat_and_training_mode(tiny):
    path, pt = tiny["bert"]
    ids, mask = padded_batch("bert", pt.config)
    plain, remat = _model(path, "cls", {}), _model(path, "cls", {}, remat=True)

    def grads(model):  # jitted: eagerly, each operation of the backward pass compiles on its own
        return jax.jit(jax.grad(lambda p: jnp.sum(model.apply(p, ids, mask) ** 2)))(model.params)

    for a, b in zip(jax.tree.leaves(grads(plain)), jax.tree.leaves(grads(remat))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
    train = jax.jit(lambda p, k: plain.apply(p, ids, mask, train=True, dropout_rng=k))(
        plain.params, jax.random.PRNGKey(0)
    )
    assert train.shape == (3, 3) and np.isfinite(np.asarray(train)).all()
    assert not np.allclose(np.asarray(train), np.asarray(plain.apply(plain.params, ids, mask)))


def test_only_at_refuses_packed_rows(tiny):
    bb = load_backbone(tiny["bert"][0], implementation="native")
    ids = jnp.ones((1, 4), jnp.int32)
    with pytest.raises(BackboneError, match="only_at and segment_ids"):
        bb.encode(bb.params, ids, ids, segment_ids=ids, only_at=jnp.zeros((1,), jnp.int32))


def test_backbones_without_it_compute_every_position(tmp_path):
    path, pt = save_tiny(tmp_path, "modernbert")
    m = _model(path, "cls", {})
    assert "only_at" not in m.backbone.features
    ids, mask = padded_batch("modernbert", pt.config)
    hidden, _ = m.pooler_inputs(m.params["backbone"], jnp.asarray(ids), jnp.asarray(mask))
    assert hidden.shape == (3, 9, m.hidden_size)
