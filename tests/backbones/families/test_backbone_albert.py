"""flaxheads' native ALBERT against PyTorch transformers (``AlbertModel`` / ``AlbertForSequenceClassification``
on the same weights), on both stacks; the params tree against HF's Flax ALBERT on transformers 4.x."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
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

from flaxheads.backbones import hf_flax  # noqa: E402
from flaxheads.backbones.base import BackboneError  # noqa: E402
from flaxheads.backbones.families.albert import AlbertBackbone  # noqa: E402
from flaxheads.backbones.registry import load_backbone  # noqa: E402

# The tiny default (2 layers, 1 group of 1 layer) already runs one weight set twice. INNER: a
# group of 2 layers run twice (4 layer runs on 2 weight sets); UNEVEN: HF's group arithmetic with
# a remainder, step i runs group int(i / 1.5), i.e. groups 0, 0, 1. (Both at once, e.g. 3 layers
# in 2 groups of 2, makes transformers 4.57's AlbertTransformer fail on its head-mask slicing.
# Few layer runs: XLA:CPU compile time grows faster than linearly with the unrolled depth.)
INNER = dict(num_hidden_layers=2, num_hidden_groups=1, inner_group_num=2)
UNEVEN = dict(num_hidden_layers=3, num_hidden_groups=2)


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("albert")


@pytest.mark.parametrize("over", [INNER, UNEVEN], ids=["inner", "uneven"])
def test_hidden_states_and_logits_match_pytorch(over, tmp_path):
    path, pt = save_tiny(tmp_path, "albert", **over)
    ids, _ = padded_batch("albert", pt.config)
    tt = np.zeros_like(ids)
    tt[:, 4:] = 1  # a second segment: token type embeddings must be read
    check_hidden_states(path, pt, "albert", token_type_ids=tt)
    check_logits(path, pt, "albert", AlbertBackbone)  # albert.pooler and classifier from the checkpoint


def test_gradients_match_torch_autograd(tiny):
    """One layer used twice: its gradients sum both uses, in PyTorch and here alike."""
    check_gradients(*tiny, "albert", softmax_cancelled=lambda k: k.endswith("attention.key.bias"))


@pytest.mark.parametrize(
    "over", [dict(hidden_dropout_prob=0.1), dict(attention_probs_dropout_prob=0.1)], ids=["hidden", "attention"]
)
def test_dropout_matches_pytorch_statistically(over, tmp_path):
    """Train-mode spread around the eval output, averaged over 32 copies of a 16 x 16 batch: equal
    to PyTorch's within 8% (measured within 2%). ``hidden_dropout_prob`` acts on the embeddings and
    the attention output but, in ALBERT, not after the feed-forward layer; the matrices are scaled
    up x4 so that every sublayer moves the output: a dropout after the feed-forward layer moved the
    spread by +37%, a wrong keep rate moves it too."""
    path, pt = save_tiny(tmp_path, "albert", edit=lambda m: scale_matrices(m, 4.0), **over)
    bb = load_backbone(path, implementation="native")
    rng = np.random.default_rng(0)
    ids, mask = rng.integers(3, 99, size=(16, 16)), np.ones((16, 16), np.int64)
    ours, ref = dropout_spread_flax(bb, ids, mask), dropout_spread_torch(pt.albert, ids, mask)
    assert ref > 1e-4
    assert abs(ours / ref - 1) < 0.08, (ours, ref)


def test_train_needs_a_dropout_key(tiny):
    check_train_needs_key(*tiny, "albert")


def test_export_of_changed_weights_loads_in_pytorch(tiny, tmp_path):
    check_export(*tiny, "albert", tmp_path / "out")


def test_bf16_logits_and_remat_gradients(tiny):
    check_bf16_and_remat(*tiny, "albert", atol=0.05)  # measured: 0.003 off, on logits up to 0.18


@pytest.mark.parametrize(
    "change,match",
    [
        ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
        ({"num_hidden_groups": 0}, "num_hidden_groups"),
        ({"num_attention_heads": 5}, "not divisible"),
    ],
)
def test_refused_config_is_a_clear_error(tiny, tmp_path, change, match):
    with pytest.raises(BackboneError, match=match):
        load_backbone(edited_copy(tiny[0], tmp_path / "bad", **change), implementation="native")


@pytest.mark.skipif(not hf_flax.available(), reason="HF's Flax ALBERT exists only in transformers < 5")
def test_params_tree_is_hf_flax_albert(tiny):
    """Checkpoints written through HF's FlaxAlbertModel (older flaxheads) load unchanged: same tree,
    same values as HF's own PyTorch -> Flax conversion of the same folder."""
    ours = load_backbone(tiny[0], implementation="native")
    check_hf_flax_tree(ours, "FlaxAlbertModel", add_pooling_layer=False)
    theirs = load_backbone(tiny[0], implementation="hf_flax").params
    for (k, a), (k2, b) in zip(
        jax.tree_util.tree_leaves_with_path(ours.params), jax.tree_util.tree_leaves_with_path(theirs)
    ):
        assert k == k2
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(k))
