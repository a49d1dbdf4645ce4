"""flaxheads' native GPT-2 against PyTorch transformers (``GPT2Model`` / ``GPT2ForSequenceClassification``
on the same weights), on both stacks; the params tree against HF's Flax GPT-2 on transformers 4.x.

Padding: given no ``position_ids``, transformers 4.57 and 5.x both number positions ``0..T-1``
whatever the attention mask says (``cache_position`` / ``arange``), so a left-padded text sits at
other positions than the same text right-padded, and gets other hidden states and logits. Each
test compares with the PyTorch model of the stack it runs on; both stacks agree."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hf_tiny import (
    check_bf16_and_remat,
    check_export,
    check_gradients,
    check_hf_flax_tree,  # noqa: E402
    check_hidden_states,
    check_logits,
    check_train_needs_key,
    dropout_spread_flax,
    dropout_spread_torch,
    edited_copy,
    padded_batch,
    save_tiny,
    scale_matrices,
)

import flaxheads as fh  # noqa: E402
from flaxheads.backbones import hf_flax  # noqa: E402
from flaxheads.backbones.base import BackboneError  # noqa: E402
from flaxheads.backbones.families.gpt2 import GPT2Backbone  # noqa: E402
from flaxheads.backbones.registry import load_backbone  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("gpt2")


@pytest.mark.parametrize("side", ["right", "left"])
def test_hidden_states_and_logits_match_pytorch(tiny, side):
    """Last non-pad token pooling (the rightmost id != pad_token_id) and a bias-free ``score``."""
    path, pt = tiny
    bb = check_hidden_states(path, pt, "gpt2", side=side)
    if side == "right":
        check_logits(path, pt, "gpt2", GPT2Backbone)
        return
    model = fh.from_pretrained(path)
    assert model.pool_mask == "non_pad_token" and "bias" not in model.params["head"]["head"]["classifier"]
    ids, mask = padded_batch("gpt2", pt.config, "left")
    with torch.no_grad():
        ref = pt(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model.apply(model.params, ids, mask)), ref, atol=1e-4, rtol=0)
    # positions 0..T-1 regardless of padding: the same 3 tokens right-padded sit at positions 0..2
    # instead of 6..8 and come out different (positions derived from the mask would make them equal)
    r_ids, r_mask = padded_batch("gpt2", pt.config, "right")
    np.testing.assert_array_equal(r_ids[2, :3], ids[2, 6:])
    left, right = np.asarray(bb(ids, mask)[0])[2, 6:], np.asarray(bb(r_ids, r_mask)[0])[2, :3]
    assert np.abs(left - right).max() > 1e-2


def test_position_and_token_type_inputs_match_pytorch(tiny):
    """Explicit position ids (counted over the real tokens, as generation does for left padding)
    move the position embeddings; token type ids are looked up in the word embedding ``wte``."""
    path, pt = tiny
    ids, mask = padded_batch("gpt2", pt.config, "left")
    pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    tt = np.zeros_like(ids)
    tt[:, 5:] = 7
    check_hidden_states(path, pt, "gpt2", side="left", position_ids=pos, token_type_ids=tt)


@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_causal_attention_both_arrangements(rate):
    """``attend_cpu(causal=True)`` (CPU arrangement) and ``attend_plain(causal=True)`` (other backends)
    agree in values and gradients, and without dropout equal a NumPy masked softmax."""
    from flaxheads.layers.attention import attend_cpu, attend_plain
    from flaxheads.layers.masks import mask_bias

    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v = (jax.random.normal(ks[i], (2, 6, 3, 4)) for i in range(3))
    mask = np.ones((2, 6), np.int32)
    mask[1, :2] = 0  # left padding
    bias, rng = mask_bias(jnp.asarray(mask), jnp.float32), ks[3] if rate else None
    out = {f.__name__: f(q, k, v, bias, rate, rng, True) for f in (attend_cpu, attend_plain)}
    np.testing.assert_allclose(out["attend_cpu"], out["attend_plain"], atol=1e-6, rtol=1e-6)
    w = jax.random.normal(ks[3], q.shape)
    g = [
        jax.grad(lambda *a: jnp.sum(f(*a, bias, rate, rng, True) * w), argnums=(0, 1, 2))(q, k, v)
        for f in (attend_cpu, attend_plain)
    ]
    for a, b in zip(*g):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    if rate:
        return
    s = np.einsum("bqhd,bkhd->bhqk", q, k)
    keep = np.tril(np.ones((6, 6), bool))[None, None] & (mask[:, None, None, :] > 0)
    p = np.where(keep, np.exp(s - s.max(-1, keepdims=True)), 0.0)
    ref = np.einsum("bhqk,bkhd->bqhd", p / np.maximum(p.sum(-1, keepdims=True), 1e-30), v)
    valid = mask.astype(bool)  # fully masked query rows (left pads) are free
    np.testing.assert_allclose(np.asarray(out["attend_cpu"])[valid], ref[valid], atol=1e-5)


def test_gradients_match_torch_autograd(tiny):
    """Pre-LN blocks, Conv1D weights compared in PyTorch's [in, out] layout. (The key third of
    ``c_attn.bias`` gets exactly 0 here, rounding noise in PyTorch: within the tolerance of the tensor.)"""
    check_gradients(*tiny, "gpt2", softmax_cancelled=lambda k: False)


@pytest.mark.parametrize(
    "rates",
    [
        dict(embd_pdrop=0.1, resid_pdrop=0.0, attn_pdrop=0.0),
        dict(embd_pdrop=0.0, resid_pdrop=0.1, attn_pdrop=0.0),
        dict(embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.1),
    ],
    ids=["embeddings", "residual", "attention"],
)
def test_dropout_matches_pytorch_statistically(rates, tmp_path):
    """Train-mode spread around the eval output, averaged over 32 copies of a 16 x 16 batch, one
    dropout kind at a time: PyTorch's within 8% (measured within 2%). With the matrices scaled up
    x4, leaving out the dropout after the MLP (``resid_pdrop`` acts after both the attention and the
    MLP projection) moved the residual spread to ~0.5x."""
    path, pt = save_tiny(tmp_path, "gpt2", edit=lambda m: scale_matrices(m, 4.0, skip="none"), **rates)
    bb = load_backbone(path, implementation="native")
    rng = np.random.default_rng(0)
    ids, mask = rng.integers(3, 99, size=(16, 16)), np.ones((16, 16), np.int64)
    ours, ref = dropout_spread_flax(bb, ids, mask), dropout_spread_torch(pt.transformer, ids, mask)
    assert ref > 1e-4
    assert abs(ours / ref - 1) < 0.08, (ours, ref)


def test_train_needs_a_dropout_key(tiny):
    check_train_needs_key(*tiny, "gpt2")


def test_export_of_changed_weights_loads_in_pytorch(tiny, tmp_path):
    check_export(*tiny, "gpt2", tmp_path / "out")


def test_bf16_logits_and_remat_gradients(tiny):
    check_bf16_and_remat(*tiny, "gpt2", atol=0.05)  # measured: 0.005 off, on logits up to 0.7


@pytest.mark.parametrize(
    "change,match",
    [
        ({"add_cross_attention": True}, "add_cross_attention"),
        ({"n_head": 5}, "not divisible"),
        ({"activation_function": "swoosh"}, "swoosh"),
    ],
)
def test_refused_config_is_a_clear_error(tiny, tmp_path, change, match):
    with pytest.raises(BackboneError, match=match):
        load_backbone(edited_copy(tiny[0], tmp_path / "bad", **change), implementation="native")


def test_config_aliases(tiny):
    """``hidden_size`` & co. read GPT-2's ``n_embd`` & co. (as GPT2Config's attribute_map does)."""
    bb = load_backbone(tiny[0], implementation="native")
    c = bb.config
    assert (c.hidden_size, c.num_attention_heads, c.num_hidden_layers, c.max_position_embeddings) == (
        c.n_embd,
        c.n_head,
        c.n_layer,
        c.n_positions,
    ) and bb.hidden_size == 32


@pytest.mark.skipif(not hf_flax.available(), reason="HF's Flax GPT-2 exists only in transformers < 5")
def test_params_tree_is_hf_flax_gpt2(tiny):
    """Checkpoints written through HF's FlaxGPT2Model (older flaxheads) load unchanged: same tree
    (Conv1D kernels [out, in]), same values as HF's own PyTorch -> Flax conversion of the same folder."""
    ours = load_backbone(tiny[0], implementation="native")
    check_hf_flax_tree(ours, "FlaxGPT2Model")
    theirs = load_backbone(tiny[0], implementation="hf_flax").params
    for (k, a), (k2, b) in zip(
        jax.tree_util.tree_leaves_with_path(ours.params), jax.tree_util.tree_leaves_with_path(theirs)
    ):
        assert k == k2
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(k))
