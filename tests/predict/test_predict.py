"""Classifier.predict / embed against PyTorch transformers' pipeline and sentence-transformers,
on tiny random models with a real WordPiece tokenizer (all-MiniLM-L6-v2's)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from predict_helpers import TEXTS, minilm_path, tiny_bert_classifier

from flaxheads.errors import FlaxheadsError
from flaxheads.predict import Classifier, TruncationWarning

pytestmark = pytest.mark.full

PAIRS = [
    "a second text",
    "Profits",
    "match report",
    "film",
    "the vote was close",
    "new phone",
    "games",
    "sport",
    "colours",
    "markets",
]


def pipeline_scores(folder, texts, **kw) -> np.ndarray:
    """[N, K] scores of transformers' text-classification pipeline, in label-id order."""
    from transformers import AutoConfig, pipeline

    pipe = pipeline("text-classification", model=folder, tokenizer=folder, top_k=None, device="cpu", **kw)
    id2label = AutoConfig.from_pretrained(folder).id2label
    order = {v: k for k, v in id2label.items()}
    out = np.zeros((len(texts), len(id2label)))
    for i, row in enumerate(pipe(list(texts))):
        for d in row:
            out[i, order[d["label"]]] = d["score"]
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory):  # its own: MiniLM's 30522-token WordPiece vocabulary, for real texts
    return tiny_bert_classifier(tmp_path_factory.mktemp("single"), num_labels=3)


def test_single_label_equals_pipeline_softmax(single):
    clf = Classifier.from_pretrained(single)
    pred = clf.predict(TEXTS, batch_size=4)
    ref = pipeline_scores(single, TEXTS)
    np.testing.assert_allclose(pred.scores, ref, atol=1e-5)
    assert pred.labels == [clf.id2label[i] for i in ref.argmax(1)]
    assert [r["label"] for r in pred] == pred.labels
    assert pred[0]["score"] == pytest.approx(ref[0].max(), abs=1e-5)
    assert pred.logits.shape == (len(TEXTS), 3) and pred.logits.dtype == np.float32
    top = clf.predict(TEXTS[:3], top_k=2)
    for i, r in enumerate(top):
        best = np.argsort(-ref[i])[:2]
        assert r["top_labels"] == [clf.id2label[j] for j in best]
        np.testing.assert_allclose(r["top_scores"], ref[i][best], atol=1e-5)


def test_multi_label_equals_pipeline_sigmoid_and_threshold(tmp_path):
    folder = tiny_bert_classifier(tmp_path / "multi", num_labels=4, problem_type="multi_label_classification")
    clf = Classifier.from_pretrained(folder, threshold=0.4)
    pred = clf.predict(TEXTS, batch_size=3)
    ref = pipeline_scores(folder, TEXTS, function_to_apply="sigmoid")
    np.testing.assert_allclose(pred.scores, ref, atol=1e-5)
    for i, r in enumerate(pred):
        assert r["labels"] == [clf.id2label[j] for j in np.flatnonzero(ref[i] >= 0.4)]
        assert sorted(r["scores"]) == sorted(clf.id2label.values())


def test_regression_equals_pipeline_value(tmp_path):
    folder = tiny_bert_classifier(tmp_path / "reg", num_labels=1, problem_type="regression")
    clf = Classifier.from_pretrained(folder)
    pred = clf.predict(TEXTS, batch_size=8)
    ref = pipeline_scores(folder, TEXTS, function_to_apply="none")
    np.testing.assert_allclose(pred.scores, ref, atol=1e-5)
    assert [r["value"] for r in pred] == pytest.approx(ref[:, 0].tolist(), abs=1e-5)
    assert pred.labels is None


def test_text_pairs_equal_pytorch(single):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(single)
    pt = AutoModelForSequenceClassification.from_pretrained(single).eval()
    with torch.no_grad():
        ref = pt(**tok(TEXTS, PAIRS, padding=True, return_tensors="pt")).logits.numpy()
    got = Classifier.from_pretrained(single).predict(TEXTS, PAIRS, batch_size=3).logits
    np.testing.assert_allclose(got, ref, atol=1e-5)


def test_input_order_kept_with_mixed_lengths_and_uneven_batches(single):
    """Sorted into length buckets internally; every batch size gives the one-at-a-time results."""
    clf = Classifier.from_pretrained(single, bucket_step=8)
    alone = np.concatenate([clf.predict([t]).logits for t in TEXTS])
    for bs in (3, 4, 7, 64):
        np.testing.assert_allclose(clf.predict(TEXTS, batch_size=bs).logits, alone, atol=2e-6)
    rev = clf.predict(TEXTS[::-1], batch_size=3).logits
    np.testing.assert_allclose(rev[::-1], alone, atol=2e-6)


def test_batches_are_split_over_all_local_devices(single):
    """conftest forces 4 CPU devices: the batch is sharded over a mesh of them, same results as one device."""
    import jax

    from flaxheads.predict.batches import Runner

    clf = Classifier.from_pretrained(single)
    assert clf.runner().width == len(jax.local_devices()) == 4
    mesh = clf.predict(TEXTS, batch_size=6).logits
    clf._runner = Runner(clf.model, clf.params, devices=jax.local_devices()[:1])
    assert clf.runner().width == 1
    np.testing.assert_allclose(clf.predict(TEXTS, batch_size=6).logits, mesh, atol=2e-6)


def test_truncation_counts_and_refusal(single):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(single)
    long = [i for i, t in enumerate(TEXTS) if len(tok(t)["input_ids"]) > 8]
    assert 0 < len(long) < len(TEXTS)
    clf = Classifier.from_pretrained(single, max_length=8)
    with pytest.warns(TruncationWarning, match=rf"{len(long)} of 10 texts were longer than 8 tokens"):
        pred = clf.predict(TEXTS)
    assert pred.truncated == len(long)
    # the cut texts are what the tokenizer gives at max_length 8 (checked against PyTorch on those ids)
    pt = AutoModelForSequenceClassification.from_pretrained(single).eval()
    with torch.no_grad():
        ref = pt(**tok(TEXTS, truncation=True, max_length=8, padding=True, return_tensors="pt")).logits.numpy()
    np.testing.assert_allclose(pred.logits, ref, atol=1e-5)
    with pytest.raises(FlaxheadsError, match=rf"{len(long)} input\(s\) are longer .* texts\[{long[0]}\]"):
        clf.predict(TEXTS, truncate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clf.predict(["short"])  # nothing cut, no warning


@pytest.mark.parametrize(
    "bad, where",
    [
        (["ok", ""], r"texts\[1\]: text is empty"),
        (["ok", "fine", None], r"texts\[2\]: text is missing"),
        (["ok", 3], r"texts\[1\]: text is not text \(int\)"),
        (["  "], r"texts\[0\]: text is empty"),
        ("one string", "one string"),
    ],
)
def test_bad_inputs_name_the_position(single, bad, where):
    clf = Classifier.from_pretrained(single)
    with pytest.raises(FlaxheadsError, match=where):
        clf.predict(bad)


def test_bad_pairs_and_options(single):
    clf = Classifier.from_pretrained(single)
    with pytest.raises(FlaxheadsError, match=r"text_pairs\[1\]: text is empty"):
        clf.predict(["a", "b"], ["x", ""])
    with pytest.raises(FlaxheadsError, match="2 texts but 1 text pairs"):
        clf.predict(["a", "b"], ["x"])
    with pytest.raises(FlaxheadsError, match="top_k"):
        clf.predict(["a"], top_k=4)
    with pytest.raises(FlaxheadsError, match="embed"):
        clf.embed(["a"])


def test_one_compile_per_bucket_and_batch_size(single):
    clf = Classifier.from_pretrained(single, bucket_step=16)
    lengths = [len(clf.tokenizer([t])["input_ids"][0]) for t in TEXTS]
    buckets = {next(b for b in clf.buckets if n <= b) for n in lengths}
    clf.predict(TEXTS, batch_size=2)
    first = clf.compiles
    assert first <= len(buckets) + 1  # sorted batches may mix two buckets at a boundary, padded to the larger
    clf.predict(TEXTS[::-1], batch_size=2)
    assert clf.compiles == first  # same shapes: nothing new to compile


@pytest.fixture(scope="module")
def tiny_st(tmp_path_factory, single):
    """A sentence-transformers folder (mean pooling, a tanh Dense layer, Normalize) written by export."""
    import flaxheads as fh

    model = fh.from_pretrained(
        single,
        pooler="mean",
        head="projection",
        head_options={"features": (16,), "activation": "tanh", "normalize": True},
    )
    out = tmp_path_factory.mktemp("st") / "st"
    return str(fh.interop.export_sentence_transformers(model, out))


def test_embed_equals_sentence_transformers(tiny_st):
    from sentence_transformers import SentenceTransformer

    ref = SentenceTransformer(tiny_st, device="cpu").encode(TEXTS, batch_size=4)
    clf = Classifier.from_pretrained(tiny_st)
    got = clf.embed(TEXTS, batch_size=3)
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() > 0.9999 and np.abs(got - ref).max() < 2e-5
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    with pytest.raises(FlaxheadsError, match="embedding head"):
        clf.predict(["a"])


@pytest.mark.slow
def test_embed_real_minilm_equals_sentence_transformers():
    """The packaged all-MiniLM-L6-v2 (max_seq_length 256: a long text is cut there, as ST does)."""
    from sentence_transformers import SentenceTransformer

    texts = TEXTS + [" ".join(TEXTS * 8)]
    ref = SentenceTransformer(minilm_path(), device="cpu").encode(texts)
    clf = Classifier.from_pretrained(minilm_path())
    assert clf.max_length == 256
    with pytest.warns(TruncationWarning, match="1 of 11"):
        got = clf.embed(texts, batch_size=4)
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() > 0.9999


def test_short_buckets_go_below_the_smallest_only():
    from flaxheads.predict.batches import short_buckets

    assert short_buckets((32, 64, 128)) == (8, 16, 32, 64, 128)
    assert short_buckets((16,)) == (8, 16) and short_buckets((12, 24)) == (8, 12, 24)
    assert short_buckets((8, 16)) == (8, 16) and short_buckets((4, 8)) == (4, 8)


_CONSTANTS = r"""
import json, sys
import numpy as np
from sentence_transformers import SentenceTransformer
from flaxheads.predict import Classifier
from predict_helpers import TEXTS, minilm_path
from tests.onednn_helpers import weight_counts
clf = Classifier.from_pretrained(minilm_path())
got = clf.embed(TEXTS, batch_size=4)
ref = SentenceTransformer(minilm_path(), device="cpu").encode(TEXTS)
cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
batch = {"input_ids": np.ones((4, 8), np.int32), "attention_mask": np.ones((4, 8), np.int32)}
program = clf.runner().program
text = program.lower(batch).compile().as_text() if clf.runner().width == 1 else ""
print(json.dumps({"cos": float(cos.min()), **weight_counts(text)}))
"""


@pytest.mark.slow
def test_prediction_with_constant_weights_equals_sentence_transformers():
    """Under the AMX setting (oneDNN's dots, one device) the Runner compiles the float32 weights in,
    XLA reorders them for oneDNN, and embeddings (short texts in the 8-token bucket among them)
    still equal sentence-transformers'."""
    import json
    import os
    import subprocess
    import sys

    from flaxheads.runtime.xla_flags import ONEDNN_FLAGS

    env = {
        **os.environ,
        "XLA_FLAGS": " ".join(ONEDNN_FLAGS),
        "FLAXHEADS_XLA_DEFAULTS": "0",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.path.dirname(os.path.abspath(__file__)),
    }
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run(
        [sys.executable, "-c", _CONSTANTS], env=env, capture_output=True, text=True, timeout=900, cwd=root
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if out["calls"] == 0:
        pytest.skip("this jaxlib's XLA:CPU made no oneDNN matmul calls (jax 0.10, or a build without oneDNN)")
    # every oneDNN product with a parameter for weights (at 4 x 8 tokens: q/k/v and both feed-forward
    # products of 6 layers; the rest are under oneDNN's size threshold) has them reordered once
    assert out["prepacked"] == out["dense"] >= 6 * 3, out
    assert out["cos"] > 0.9999, out
