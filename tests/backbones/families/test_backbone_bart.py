"""flaxheads' native BART against PyTorch transformers (``BartModel`` / ``BartForSequenceClassification``
on the same weights), on both stacks; the params tree against HF's Flax BART on transformers 4.x."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hf_tiny import (
    H,
    assert_grads_match,
    padded_batch,
    perturb_and_export,
    reweight,
    tiny_torch_model,  # noqa: E402
    torch_hidden_grads,
)

import flaxheads as fh  # noqa: E402
from flaxheads.backbones import hf_flax
from flaxheads.backbones.base import BackboneError  # noqa: E402
from flaxheads.backbones.families import bart
from flaxheads.backbones.families.bart import BartBackbone  # noqa: E402
from flaxheads.backbones.registry import load_backbone  # noqa: E402
from flaxheads.backbones.weights import read_state_dict  # noqa: E402


def _save(path, **over):
    tm = tiny_torch_model("bart", num_labels=3, seed=1, **over)
    tm.save_pretrained(path, safe_serialization=True)
    return str(path), tm


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("bart")


def _torch_hidden(tm, ids, mask):
    with torch.no_grad():
        out = tm.model(torch.tensor(ids), attention_mask=torch.tensor(mask))
    return out.encoder_last_hidden_state.numpy(), out.last_hidden_state.numpy()


@pytest.mark.parametrize("side", ["right", "left"])
def test_hidden_states_and_logits_match_pytorch(tiny, side):
    """Encoder output, decoder output (what the head reads) and the preset's logits, padded rows included."""
    path, tm = tiny
    model = fh.from_pretrained(path)
    assert isinstance(model.backbone, BartBackbone) and model.arch == "bart" and model.report.new == []
    ids, mask = padded_batch("bart", tm.config, side=side)
    ref_enc, ref_dec = _torch_hidden(tm, ids, mask)
    enc = bart.encode(
        model.params["backbone"],
        ids,
        mask,
        settings=model.backbone.settings,
        plan=model.backbone.plan,
        return_encoder=True,
    )
    np.testing.assert_allclose(np.asarray(enc), ref_enc, atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(model.backbone(ids, mask)[0]), ref_dec, atol=1e-4, rtol=0)
    with torch.no_grad():
        ref = tm(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model.apply(model.params, ids, mask)), ref, atol=1e-4, rtol=0)


def test_scaled_embeddings_and_another_start_token(tmp_path):
    """``scale_embedding`` (tokens times sqrt(d_model)) and a decoder start token other than <eos>."""
    path, tm = _save(tmp_path, scale_embedding=True, decoder_start_token_id=0, encoder_layers=1)
    ids, mask = padded_batch("bart", tm.config)
    got = np.asarray(load_backbone(path)(ids, mask)[0])
    np.testing.assert_allclose(got, _torch_hidden(tm, ids, mask)[1], atol=1e-4, rtol=0)


def test_shift_tokens_right_is_transformers():
    from transformers.models.bart.modeling_bart import shift_tokens_right

    ids = np.array([[0, 5, 7, 2, 1], [0, 9, -100, 2, -100]])
    ref = shift_tokens_right(torch.tensor(ids), 1, 2).numpy()
    np.testing.assert_array_equal(np.asarray(bart.shift_tokens_right(jnp.asarray(ids), 1, 2)), ref)


def test_gradients_match_pytorch(tiny):
    """Every parameter gradient of sum(hidden * w * mask), by PyTorch name, against torch autograd;
    the pad row of the token table gets none (nn.Embedding's padding_idx)."""
    path, tm = tiny
    ours = load_backbone(path)
    ids, mask = padded_batch("bart", tm.config)
    w = np.random.default_rng(0).normal(size=ids.shape + (H,)).astype(np.float32)
    _, ref = torch_hidden_grads(tm.model, ids, mask, w)
    loss = lambda p: jnp.sum(ours.encode(p, ids, mask) * w * mask[..., None])
    got = ours.state_from_params(jax.grad(loss)(ours.params))
    assert not got["shared.weight"][tm.config.pad_token_id].any()
    assert_grads_match(got, ref, softmax_cancelled=lambda name: name.endswith("k_proj.bias"))


# dropout kind -> probability, and which residual branch to amplify so its dropout site dominates
DROPOUT_CASES = {
    "embeddings": ("dropout", None),  # the embedding dropout dominates the unscaled tiny model
    "attention_outputs": ("dropout", r"attn\.out_proj"),  # self- and cross-attention output dropout
    "feed_forward_output": ("dropout", r"fc2"),
    "attention_weights": ("attention_dropout", None),
    "activation": ("activation_dropout", None),
}


@pytest.mark.parametrize("case", sorted(DROPOUT_CASES))
def test_dropout_acts_where_pytorch_does(case, tmp_path):
    """Mean squared change of the train-mode outputs against eval mode, encoder and decoder, over
    128 copies of the batch: each kind of dropout alone (the others 0), with one residual branch
    made dominant to tell its dropout site from the others. A missing, extra or misplaced site
    moves a spread by 20% or more (checked by breaking the code); seed noise is a few %."""
    kind, scale = DROPOUT_CASES[case]
    rates = {**dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0), kind: 0.3}
    tm = tiny_torch_model("bart", num_labels=3, seed=1, encoder_layers=1, decoder_layers=1, **rates)
    if scale:
        reweight(tm, zero="^$", scale=scale, factor=30.0)
    tm.save_pretrained(tmp_path, safe_serialization=True)
    ours = load_backbone(tmp_path)
    ids, mask = padded_batch("bart", tm.config)
    copies = 128
    rep_ids, rep_mask = np.tile(ids, (copies, 1)), np.tile(mask, (copies, 1))
    ref = _torch_hidden(tm, ids, mask)
    tm.train()
    torch.manual_seed(0)
    pt = _torch_hidden(tm, rep_ids, rep_mask)
    tm.eval()
    key = jax.random.PRNGKey(0)
    fx = (
        bart.encode(
            ours.params,
            rep_ids,
            rep_mask,
            settings=ours.settings,
            plan=ours.plan,
            train=True,
            rng=key,
            return_encoder=True,
        ),
        ours.encode(ours.params, rep_ids, rep_mask, train=True, rng=key),
    )
    valid = rep_mask.astype(bool)
    for name, r, a, b in zip(("encoder", "decoder"), ref, pt, fx):
        spread_pt, spread_fx = (
            float(((np.asarray(o) - np.tile(r, (copies, 1, 1))) ** 2)[valid].mean()) for o in (a, b)
        )
        assert spread_pt > 1e-5, (name, spread_pt)  # this dropout really acts in PyTorch
        assert abs(spread_fx / spread_pt - 1) < 0.12, (name, spread_fx, spread_pt)


def test_training_needs_a_dropout_key_and_refuses_layerdrop(tiny, tmp_path):
    path, tm = tiny
    ours = load_backbone(path)
    ids, mask = padded_batch("bart", tm.config)
    with pytest.raises(ValueError, match="dropout_rng"):
        ours(ids, mask, train=True)
    a = ours(ids, mask, train=True, dropout_rng=jax.random.PRNGKey(0))[0]
    assert not np.allclose(np.asarray(a), np.asarray(ours(ids, mask)[0]))
    drop_path, _ = _save(tmp_path, encoder_layerdrop=0.1)
    dropping = load_backbone(drop_path)  # inference is exact: LayerDrop only acts in training
    np.testing.assert_allclose(np.asarray(dropping(ids, mask)[0]), np.asarray(ours(ids, mask)[0]), atol=1e-6)
    with pytest.raises(BackboneError, match="LayerDrop"):
        dropping(ids, mask, train=True, dropout_rng=jax.random.PRNGKey(0))


def test_changed_weights_export_to_pytorch(tiny, tmp_path):
    """Every weight changed, then a PyTorch BartForSequenceClassification loads the export strictly
    and gives the same logits."""
    path, tm = tiny
    ids, mask = padded_batch("bart", tm.config)
    model, params, logits, pt_logits, info = perturb_and_export(path, tmp_path / "out", ids, mask)
    # lists in transformers 4, sets in 5
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    np.testing.assert_allclose(pt_logits, logits, atol=1e-4, rtol=0)
    before = model.params["backbone"]["decoder"]["layers"]["0"]["fc2"]["kernel"]
    assert np.abs(np.asarray(params["backbone"]["decoder"]["layers"]["0"]["fc2"]["kernel"] - before)).max() > 1e-4
    with torch.no_grad():
        before_logits = tm(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    assert np.abs(pt_logits - before_logits).max() > 1e-3  # the changed weights were exported


def test_bfloat16_close_to_float32(tiny):
    path, tm = tiny
    ids, mask = padded_batch("bart", tm.config)
    f32 = fh.from_pretrained(path)
    bf = fh.from_pretrained(path, dtype=jnp.bfloat16)
    assert bf.backbone(ids, mask)[0].dtype == jnp.bfloat16
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(bf.params))
    # logits of size ~0.3 moved ~2e-3 by bfloat16 activations (8-bit mantissa) when measured
    np.testing.assert_allclose(
        np.asarray(bf.apply(bf.params, ids, mask)), np.asarray(f32.apply(f32.params, ids, mask)), atol=1e-2, rtol=0
    )


def test_remat_same_gradients(tiny):
    """Gradient checkpointing per layer (both stacks): identical gradients, dropout on."""
    path, tm = tiny
    ids, mask = padded_batch("bart", tm.config)
    w = jax.random.normal(jax.random.PRNGKey(0), ids.shape + (H,))

    def grad_fn(remat):
        bb = load_backbone(path, remat=remat)
        return jax.grad(lambda p: jnp.sum(bb.encode(p, ids, mask, train=True, rng=jax.random.PRNGKey(3)) * w))

    plain, ckpt = grad_fn(False), grad_fn(True)
    params = load_backbone(path).params
    for a, b in zip(jax.tree_util.tree_leaves(plain(params)), jax.tree_util.tree_leaves(ckpt(params))):
        # float32 rounding only: the recomputed forward may be fused differently
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    jaxpr = str(jax.make_jaxpr(ckpt)(params))
    assert jaxpr.count("checkpoint") + jaxpr.count("remat") >= 2  # one per layer (an encoder and a decoder layer)


def test_old_checkpoints_with_tied_copies_load(tiny):
    """Checkpoints from older transformers also store encoder/decoder.embed_tokens (equal to shared);
    different tables cannot be one shared table and are refused."""
    path, tm = tiny
    state = read_state_dict(path)
    table = state["model.shared.weight"]
    old = {
        **state,
        "model.encoder.embed_tokens.weight": table,
        "model.decoder.embed_tokens.weight": table,
        "model.encoder.version": np.array([2.0], np.float32),
    }
    old.pop("model.shared.weight")
    ours = BartBackbone.from_state(load_backbone(path).config, old)
    ids, mask = padded_batch("bart", tm.config)
    np.testing.assert_allclose(np.asarray(ours(ids, mask)[0]), _torch_hidden(tm, ids, mask)[1], atol=1e-4, rtol=0)
    with pytest.raises(BackboneError, match="token tables"):
        BartBackbone.from_state(ours.config, {**old, "model.decoder.embed_tokens.weight": table + 1.0})


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(tie_word_embeddings=False), "tie_word_embeddings"),
        (dict(normalize_before=True), "normalize_before"),
        (dict(add_final_layer_norm=True), "add_final_layer_norm"),
        (dict(activation_function="nope"), "unknown activation"),
        (dict(decoder_attention_heads=5), "not divisible"),
        (dict(model_type="mbart"), "model_type"),
    ],
)
def test_refused_configs(tiny, over, match):
    path, _ = tiny
    cfg = load_backbone(path).config.replace(**over)
    with pytest.raises(BackboneError, match=match):
        BartBackbone.from_state(cfg, read_state_dict(path))


def test_too_long_input_is_an_error(tiny):
    path, tm = tiny
    ours = load_backbone(path)
    t = tm.config.max_position_embeddings + 1
    with pytest.raises(BackboneError, match="max_position_embeddings"):
        ours(np.full((1, t), 5), np.ones((1, t), np.int32))


@pytest.mark.skipif(not hf_flax.available(), reason="HF Flax models need transformers < 5")
def test_params_tree_is_hf_flax_bart(tiny):
    """Same tree, names, shapes and values as HF's FlaxBartModel on the same safetensors, and the same
    output: params written through HF's Flax wrapper load unchanged."""
    path, tm = tiny
    ours, hf = load_backbone(path, implementation="native"), load_backbone(path, implementation="hf_flax")
    a = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(ours.params)}
    b = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(hf.params)}
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    shapes = jax.tree.map(lambda x: x.shape, BartBackbone.param_shapes(ours.config))
    assert shapes == jax.tree.map(np.shape, ours.params)
    ids, mask = padded_batch("bart", tm.config)
    np.testing.assert_allclose(
        np.asarray(ours(ids, mask)[0]), np.asarray(hf(ids, mask, params=ours.params)[0]), atol=1e-4, rtol=0
    )
