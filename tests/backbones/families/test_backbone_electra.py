"""The native ELECTRA backbone against PyTorch transformers on the same tiny random weights:
hidden states (with and without ``embeddings_project``), logits, gradients, dropout, export, bf16, remat."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
from hf_tiny import (
    DROPOUT_SITES,
    H,
    check_bf16_and_remat,
    check_dropout_site,
    check_dropout_spread,  # noqa: E402
    check_export,
    check_gradients,
    check_hf_flax_tree,
    check_hidden_states,
    check_keep_rate,
    check_logits,
    check_train_needs_key,
    edited_copy,
    padded_batch,
    save_tiny,
)

from flaxheads.backbones import hf_flax  # noqa: E402
from flaxheads.backbones.base import BackboneError  # noqa: E402
from flaxheads.backbones.families.electra import ElectraBackbone  # noqa: E402
from flaxheads.backbones.registry import load_backbone  # noqa: E402

ATTN_OUT = r"attention\.output\.dense\."
FFN = r"layer\.\d+\.(intermediate|output)\.dense\."
FFN_OUT = r"layer\.\d+\.output\.dense\."


@pytest.fixture(scope="module")
def electra(tiny_model):
    """embedding_size 16 < hidden_size 32: the ``embeddings_project`` Linear is there."""
    return tiny_model("electra")


def test_hidden_states_match_pytorch(electra):
    path, pt = electra
    bb = check_hidden_states(path, pt, "electra")
    assert isinstance(bb, ElectraBackbone) and bb.params["embeddings_project"]["kernel"].shape == (16, H)
    tt = np.zeros((3, 9), np.int64)
    tt[:, 4:] = 1  # token types count (PyTorch's default is zeros, HF Flax's was ones)
    check_hidden_states(path, pt, "electra", token_type_ids=tt, position_ids=np.broadcast_to(np.arange(9), (3, 9)))


def test_equal_embedding_and_hidden_size_has_no_projection(tmp_path):
    path, pt = save_tiny(tmp_path, "electra", embedding_size=H)
    assert "embeddings_project" not in check_hidden_states(path, pt, "electra").params


def test_from_pretrained_logits_match_pytorch(electra):
    check_logits(*electra, "electra", ElectraBackbone)


def test_gradients_match_torch_autograd(electra):
    check_gradients(*electra, "electra", softmax_cancelled=lambda k: "attention.self.key.bias" in k)


def test_embedding_dropout_keep_rate(tmp_path):
    """Without layers and without the projection, the output is the embedding dropout itself."""
    path, pt = save_tiny(tmp_path, "electra", num_hidden_layers=0, embedding_size=H, hidden_dropout_prob=0.4)
    check_keep_rate(path, pt, "electra", 0.4)


def test_embedding_dropout_comes_before_the_projection(tmp_path):
    """PyTorch drops embedding entries, then projects: no entry of the output is exactly zero, and
    the spread matches (dropout after the projection would zero entries)."""
    path, pt = save_tiny(tmp_path, "electra", num_hidden_layers=0, hidden_dropout_prob=0.4)
    check_dropout_spread(path, pt, "electra")
    bb = load_backbone(path)
    ids, mask = padded_batch("electra", pt.config)
    out = np.asarray(bb(ids, mask, train=True, dropout_rng=jax.random.PRNGKey(0))[0])
    assert (out[mask.astype(bool)] != 0).all()


@pytest.mark.parametrize("site", DROPOUT_SITES)
def test_dropout_acts_where_pytorch_does(site, tmp_path):
    """One residual branch dominant, the other silenced: a missing or extra dropout site moves the
    spread ratio 3x or more (measured), the right ones keep it near 1."""
    check_dropout_site(tmp_path, "electra", site, attn_out=ATTN_OUT, ffn=FFN, ffn_out=FFN_OUT)


def test_train_needs_a_dropout_key(electra):
    check_train_needs_key(*electra, "electra")


def test_changed_weights_export_to_pytorch(electra, tmp_path):
    check_export(*electra, "electra", tmp_path / "out")


def test_bfloat16_and_remat(electra):
    check_bf16_and_remat(*electra, "electra", atol=0.05)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"position_embedding_type": "relative_key_query"}, "relative_key_query"),
        ({"add_cross_attention": True}, "cross-attention"),
        ({"hidden_act": "no_such_act"}, "no_such_act"),
    ],
)
def test_unsupported_configs_are_refused(electra, tmp_path, change, match):
    with pytest.raises(BackboneError, match=match):
        load_backbone(edited_copy(electra[0], tmp_path / "m", **change), implementation="native")


@pytest.mark.skipif(not hf_flax.available(), reason="HF Flax models need transformers < 5")
def test_params_tree_is_hf_flax(electra):
    check_hf_flax_tree(load_backbone(electra[0]), "FlaxElectraModel")
