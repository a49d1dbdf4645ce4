"""The native RoBERTa-family backbone (roberta, xlm-roberta, camembert) against PyTorch transformers
on the same tiny random weights: hidden states, logits, gradients, dropout, export, bf16, remat."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hf_tiny import (
    DROPOUT_SITES,
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
    save_tiny,
)

from flaxheads.backbones import hf_flax  # noqa: E402
from flaxheads.backbones.base import BackboneError  # noqa: E402
from flaxheads.backbones.families.roberta import RobertaBackbone  # noqa: E402
from flaxheads.backbones.registry import load_backbone  # noqa: E402

ATTN_OUT = r"attention\.output\.dense\."
FFN = r"layer\.\d+\.(intermediate|output)\.dense\."
FFN_OUT = r"layer\.\d+\.output\.dense\."


@pytest.fixture(scope="module")
def roberta(tiny_model):
    return tiny_model("roberta")


@pytest.mark.parametrize("arch", ["roberta", "xlm-roberta", "camembert"])
def test_hidden_states_match_pytorch(arch, tmp_path):
    assert isinstance(check_hidden_states(*save_tiny(tmp_path, arch), arch), RobertaBackbone)


@pytest.mark.parametrize("arch", ["roberta", "xlm-roberta"])
def test_from_pretrained_logits_match_pytorch(arch, tmp_path):
    check_logits(*save_tiny(tmp_path, arch), arch, RobertaBackbone)


def test_position_ids_count_non_pad_tokens(roberta):
    """Left padding: PyTorch numbers positions from pad_token_id + 1 at the first real token (not
    from 0 at the first column), so the real tokens' states equal the right-padded ones."""
    path, pt = roberta
    bb = check_hidden_states(path, pt, "roberta", side="left")
    left_ids, left_mask = padded_batch("roberta", pt.config, side="left")
    right_ids, right_mask = padded_batch("roberta", pt.config, side="right")
    np.testing.assert_allclose(
        np.asarray(bb(left_ids, left_mask)[0])[left_mask.astype(bool)],
        np.asarray(bb(right_ids, right_mask)[0])[right_mask.astype(bool)],
        atol=1e-5,
    )


def test_explicit_position_ids_and_token_types(roberta):
    path, pt = roberta
    tt = np.zeros((3, 9), np.int64)
    tt[:, 5:] = 1  # the tiny config has 2 token types
    check_hidden_states(
        path, pt, "roberta", position_ids=np.broadcast_to(np.arange(5, 14), (3, 9)).copy(), token_type_ids=tt
    )


def test_gradients_match_torch_autograd(roberta):
    check_gradients(*roberta, "roberta", softmax_cancelled=lambda k: "attention.self.key.bias" in k)


def test_embedding_dropout_keep_rate(tmp_path):
    path, pt = save_tiny(tmp_path, "roberta", num_hidden_layers=0, hidden_dropout_prob=0.4)
    check_keep_rate(path, pt, "roberta", 0.4)


@pytest.mark.parametrize("site", DROPOUT_SITES)
def test_dropout_acts_where_pytorch_does(site, tmp_path):
    """One residual branch dominant, the other silenced: a missing or extra dropout site moves the
    spread ratio 3x or more (measured), the right ones keep it near 1."""
    check_dropout_site(tmp_path, "roberta", site, attn_out=ATTN_OUT, ffn=FFN, ffn_out=FFN_OUT)


def test_train_needs_a_dropout_key(roberta):
    check_train_needs_key(*roberta, "roberta")


def test_changed_weights_export_to_pytorch(roberta, tmp_path):
    check_export(*roberta, "roberta", tmp_path / "out")


def test_bfloat16_and_remat(roberta):
    # bf16 keeps ~3 significant digits per op; over 2 layers the logits move by ~1e-2 of their scale
    check_bf16_and_remat(*roberta, "roberta", atol=0.05)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"position_embedding_type": "relative_key"}, "relative_key"),
        ({"is_decoder": True}, "decoder"),
        ({"pad_token_id": None}, "pad_token_id"),
    ],
)
def test_unsupported_configs_are_refused(roberta, tmp_path, change, match):
    with pytest.raises(BackboneError, match=match):
        load_backbone(edited_copy(roberta[0], tmp_path / "m", **change), implementation="native")


def test_too_long_input_is_a_clear_error(roberta):
    path, pt = roberta
    bb = load_backbone(path)
    n = pt.config.max_position_embeddings - pt.config.pad_token_id  # one token more than fits
    with pytest.raises(BackboneError, match="position embeddings"):
        bb(np.full((1, n), 5), np.ones((1, n)))
    assert bb(np.full((1, n - 1), 5), np.ones((1, n - 1)))[0].shape == (1, n - 1, bb.hidden_size)


@pytest.mark.skipif(not hf_flax.available(), reason="HF Flax models need transformers < 5")
def test_params_tree_is_hf_flax(roberta):
    check_hf_flax_tree(load_backbone(roberta[0]), "FlaxRobertaModel", add_pooling_layer=False)
