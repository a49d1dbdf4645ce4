"""Exports of trained scorers, loaded by the tools their users ship them to: a reward model as a
transformers ``XForSequenceClassification`` with ``num_labels=1`` (a decoder family's last-token
``score`` head) and a reranker as a sentence-transformers ``CrossEncoder`` folder, each giving
the flaxheads scores."""

from __future__ import annotations

import numpy as np
import pytest
from hf_tiny import padded_batch, tiny_torch_model

pytestmark = pytest.mark.legacy

torch = pytest.importorskip("torch")


def perturbed(params, seed: int) -> dict:
    """``params`` with every weight moved, as training moves them: an export must write these, not
    the source folder's."""
    import jax

    leaves, tree = jax.tree.flatten(jax.device_get(params))
    rng = np.random.default_rng(seed)
    return jax.tree.unflatten(
        tree, [np.asarray(x) + 0.05 * rng.standard_normal(np.shape(x)).astype(np.float32) for x in leaves]
    )


def test_reward_model_exports_as_sequence_classification_with_one_label(tmp_path):
    """Qwen2 with its last-token ``score`` head and moved weights, exported and loaded by
    ``AutoModelForSequenceClassification``: the same rewards on a right-padded batch."""
    from transformers import AutoModelForSequenceClassification

    from flaxheads.interop.transformers import export_transformers
    from flaxheads.model.pretrained import from_pretrained

    src = tmp_path / "src"
    tiny_torch_model("qwen2", num_labels=1).save_pretrained(src)
    model = from_pretrained(str(src), num_labels=1, problem_type="regression")
    params = perturbed(model.params, 0)
    export_transformers(model, tmp_path / "out", params=params)
    pt = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    assert pt.config.num_labels == 1 and type(pt).__name__ == "Qwen2ForSequenceClassification"
    ids, mask = padded_batch("qwen2", pt.config)
    ours = np.asarray(model.apply(params, ids, mask))
    with torch.no_grad():
        ref = pt(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    assert ours.shape == ref.shape == (len(ids), 1)
    np.testing.assert_allclose(ours, ref, atol=1e-5)


PAIRS = [
    ("stock market falls", "the bank share profit fell"),
    ("goal match", "team player score goal match again"),
    ("film award", "vote"),
    ("phone", "computer software internet game phone music actor award song"),
]


@pytest.fixture(scope="module")
def bert_folder(tiny_model):
    from train_helpers import TINY_BERT

    return tiny_model("bert", num_labels=1, **TINY_BERT).path


@pytest.fixture(scope="module")
def reranker(bert_folder):
    """BERT's preset head (pooler + classifier) with one output, every weight moved."""
    from flaxheads.model.pretrained import from_pretrained

    model = from_pretrained(bert_folder, num_labels=1, problem_type="regression")
    return model, perturbed(model.params, 1)


@pytest.mark.parametrize("activation", ["identity", "sigmoid"])
def test_reranker_exports_as_cross_encoder(reranker, bert_folder, tmp_path, activation):
    """``CrossEncoder(folder).predict`` equals ``Classifier.score`` (identity) or its sigmoid, on
    pairs of different lengths."""
    from sentence_transformers import CrossEncoder

    from flaxheads.interop.cross_encoder import export_cross_encoder
    from flaxheads.predict import Classifier

    model, params = reranker
    out = export_cross_encoder(model, tmp_path / "ce", params=params, activation=activation, max_length=64)
    ours = Classifier.from_model(model, bert_folder, params=params).score(PAIRS)
    got = CrossEncoder(out, device="cpu").predict(PAIRS, convert_to_numpy=True)
    want = ours if activation == "identity" else 1 / (1 + np.exp(-ours))
    np.testing.assert_allclose(np.asarray(got, np.float64).reshape(-1), want, atol=1e-5)


def test_pair_classifier_exports_as_cross_encoder(bert_folder, tmp_path):
    """A 3-label pair classifier (an NLI-style CrossEncoder): predict gives its logits."""
    from sentence_transformers import CrossEncoder

    from flaxheads.interop.cross_encoder import export_cross_encoder
    from flaxheads.model.pretrained import from_pretrained
    from flaxheads.predict import Classifier

    model = from_pretrained(bert_folder, num_labels=3, ignore_mismatched_sizes=True)
    out = export_cross_encoder(model, tmp_path / "ce3")
    ours, _ = Classifier.from_model(model, bert_folder).outputs([q for q, _ in PAIRS], [p for _, p in PAIRS])
    got = CrossEncoder(out, device="cpu").predict(PAIRS, convert_to_numpy=True)
    np.testing.assert_allclose(np.asarray(got), ours, atol=1e-5)


def _st_major() -> int:
    import sentence_transformers

    return int(sentence_transformers.__version__.split(".")[0])


@pytest.mark.parametrize("pooler,head", [("mean", "linear"), ("max", "mlp")])
def test_non_preset_heads_export_as_modular_cross_encoder(bert_folder, tmp_path, pooler, head):
    """A pooler + head that is no HF preset (flaxheads train's default mean + linear): sentence-transformers
    6's modular CrossEncoder (Transformer -> Pooling -> Dense scores) predicts the same scores."""
    if _st_major() < 6:
        pytest.skip("the modular CrossEncoder (Transformer, Pooling, Dense scores) is sentence-transformers 6's")
    from sentence_transformers import CrossEncoder

    from flaxheads.interop.cross_encoder import export_cross_encoder, is_preset
    from flaxheads.model.pretrained import from_pretrained
    from flaxheads.predict import Classifier

    model = from_pretrained(
        bert_folder,
        pooler=pooler,
        head=head,
        num_labels=1,
        problem_type="regression",
        head_options={"hidden_dims": (8,)} if head == "mlp" else None,
    )
    assert not is_preset(model)
    out = export_cross_encoder(model, tmp_path / "ce")
    ours = Classifier.from_model(model, bert_folder).score(PAIRS)
    got = CrossEncoder(out, device="cpu").predict(PAIRS, convert_to_numpy=True)
    np.testing.assert_allclose(np.asarray(got, np.float64).reshape(-1), ours, atol=1e-5)
    # and flaxheads reads the folder back: the same head kind, the same scores
    import flaxheads as fh

    back = fh.load(out)
    assert type(back.head.head) is type(model.head.head) and back.num_labels == 1
    np.testing.assert_allclose(Classifier.from_model(back, out).score(PAIRS), ours, atol=1e-5)
