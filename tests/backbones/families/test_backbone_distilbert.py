"""The native DistilBERT backbone against PyTorch transformers on the same tiny random weights:
hidden states, logits, gradients, dropout (none after the attention output), export, bf16, remat,
and fixed sinusoidal position embeddings."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hf_tiny import (
    DROPOUT_SITES,
    H,
    check_bf16_and_remat,
    check_dropout_site,
    check_export,
    check_gradients,  # noqa: E402
    check_hf_flax_tree,
    check_hidden_states,
    check_keep_rate,
    check_logits,
    check_train_needs_key,
    edited_copy,
    padded_batch,
    restore_sinusoidal_positions,
    save_tiny,
)

from flaxheads.backbones import hf_flax  # noqa: E402
from flaxheads.backbones.base import BackboneError  # noqa: E402
from flaxheads.backbones.families.distilbert import DistilBertBackbone  # noqa: E402
from flaxheads.backbones.registry import load_backbone  # noqa: E402

ATTN_OUT = r"attention\.out_lin\."
FFN = r"ffn\.lin[12]\."
FFN_OUT = r"ffn\.lin2\."
POSITIONS = "embeddings.position_embeddings.weight"
needs_hf_flax = pytest.mark.skipif(not hf_flax.available(), reason="HF Flax models need transformers < 5")


@pytest.fixture(scope="module")
def distilbert(tiny_model):
    return tiny_model("distilbert")


@pytest.fixture(scope="module")
def sinusoidal(tmp_path_factory):  # its own: transformers' table written over the perturbed positions
    return save_tiny(
        tmp_path_factory.mktemp("sinusoidal"),
        "distilbert",
        edit=restore_sinusoidal_positions,
        sinusoidal_pos_embds=True,
    )


def test_hidden_states_match_pytorch(distilbert):
    path, pt = distilbert
    bb = check_hidden_states(path, pt, "distilbert")
    assert isinstance(bb, DistilBertBackbone) and bb.hidden_size == H
    if "position_ids" in inspect.signature(pt.base_model.forward).parameters:  # transformers 5 takes them
        check_hidden_states(path, pt, "distilbert", position_ids=np.broadcast_to(np.arange(3, 12), (3, 9)).copy())
    with pytest.raises(TypeError, match="token_type_ids"):  # DistilBERT has no token types
        bb(*padded_batch("distilbert", pt.config), token_type_ids=np.zeros((3, 9), np.int32))


def test_from_pretrained_logits_match_pytorch(distilbert):
    check_logits(*distilbert, "distilbert", DistilBertBackbone)


def test_gradients_match_torch_autograd(distilbert):
    check_gradients(*distilbert, "distilbert", softmax_cancelled=lambda k: "attention.k_lin.bias" in k)


def test_embedding_dropout_keep_rate(tmp_path):
    path, pt = save_tiny(tmp_path, "distilbert", n_layers=0, dropout=0.4)
    check_keep_rate(path, pt, "distilbert", 0.4)


@pytest.mark.parametrize("site", DROPOUT_SITES)
def test_dropout_acts_where_pytorch_does(site, tmp_path):
    """One residual branch dominant, the other silenced. DistilBERT has no dropout after the
    attention output projection: adding one there (as BERT has) moves the ratio ~3x (measured)."""
    check_dropout_site(
        tmp_path,
        "distilbert",
        site,
        attn_out=ATTN_OUT,
        ffn=FFN,
        ffn_out=FFN_OUT,
        hidden_rate="dropout",
        attn_rate="attention_dropout",
    )


def test_train_needs_a_dropout_key(distilbert):
    check_train_needs_key(*distilbert, "distilbert")


def test_changed_weights_export_to_pytorch(distilbert, tmp_path):
    check_export(*distilbert, "distilbert", tmp_path / "out")


def test_bfloat16_and_remat(distilbert):
    check_bf16_and_remat(*distilbert, "distilbert", atol=0.05)


def test_sinusoidal_positions_are_a_fixed_table(sinusoidal, tmp_path):
    """Not a weight (HF Flax's tree has none; PyTorch 4.x freezes it): same hidden states and
    gradients as PyTorch, and the export writes the table back so PyTorch loads it strictly."""
    path, pt = sinusoidal
    bb = check_hidden_states(path, pt, "distilbert")
    assert "position_embeddings" not in bb.params["embeddings"]
    check_gradients(path, pt, "distilbert", softmax_cancelled=lambda k: "attention.k_lin.bias" in k, skip=(POSITIONS,))
    np.testing.assert_allclose(
        bb.state_from_params(bb.params)[POSITIONS], pt.state_dict()[f"distilbert.{POSITIONS}"].numpy(), atol=1e-6
    )
    check_export(path, pt, "distilbert", tmp_path / "out")


def test_sinusoidal_config_with_a_trained_table_is_refused(tmp_path):
    path, _ = save_tiny(tmp_path, "distilbert", sinusoidal_pos_embds=True)  # the perturbed table stays
    with pytest.raises(BackboneError, match="sinusoidal"):
        load_backbone(path, implementation="native")


@needs_hf_flax
@pytest.mark.parametrize("fixture", ["distilbert", "sinusoidal"])
def test_params_tree_is_hf_flax(fixture, request):
    check_hf_flax_tree(load_backbone(request.getfixturevalue(fixture)[0]), "FlaxDistilBertModel")


@pytest.mark.parametrize(
    "change,match",
    [({"n_heads": 5}, "n_heads"), ({"activation": "no_such_act"}, "no_such_act"), ({"hidden_size": 48}, "hidden_size")],
)
def test_unsupported_configs_are_refused(distilbert, tmp_path, change, match):
    with pytest.raises(BackboneError, match=match):
        load_backbone(edited_copy(distilbert[0], tmp_path / "m", **change), implementation="native")
