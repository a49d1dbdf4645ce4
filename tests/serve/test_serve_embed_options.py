"""TEI's /embed options against sentence-transformers on the same folder (all-MiniLM-L6-v2 with
prompts added to its config): ``prompt_name`` (and the config's default prompt), ``dimensions``
(Matryoshka truncation, re-normalised), ``encoding_format: "base64"`` (little-endian float32), and
``truncation_direction: "Left"``; each bad value a 422 naming its field. Then /embed_all against
sentence-transformers' token embeddings and /similarity against its cosine."""

from __future__ import annotations

import base64
import json
import os
import shutil

import numpy as np
import pytest
from serve_helpers import serving  # noqa: E402  (skips the module without the serve extra)

httpx = pytest.importorskip("httpx", reason="httpx (the test client) is not installed")
st = pytest.importorskip("sentence_transformers", reason="sentence-transformers (the reference) is not installed")

from predict_helpers import TEXTS, minilm_path  # noqa: E402

from flaxheads.interop.sentence_transformers import Prompts  # noqa: E402
from flaxheads.predict import Classifier  # noqa: E402
from flaxheads.serve import ServeSettings, create_app  # noqa: E402
from flaxheads.serve.payloads import PayloadError, prompt_field  # noqa: E402

pytestmark = pytest.mark.full
MAX_LENGTH = 16  # TEXTS[1], [3] and [6] are longer: truncation picks which end survives
PROMPTS = {"query": "query: ", "passage": "passage: "}
TOL = dict(atol=2e-5)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The server and sentence-transformers on one copy of MiniLM whose config names prompts
    (``passage`` the default)."""
    folder = str(tmp_path_factory.mktemp("st") / "minilm")
    shutil.copytree(minilm_path(), folder)
    path = os.path.join(folder, "config_sentence_transformers.json")
    with open(path) as f:
        cfg = json.load(f)
    with open(path, "w") as f:
        json.dump({**cfg, "prompts": PROMPTS, "default_prompt_name": "passage"}, f)
    ref = st.SentenceTransformer(folder, device="cpu")
    ref.max_seq_length = MAX_LENGTH
    clf = Classifier.from_pretrained(folder, max_length=MAX_LENGTH)
    with serving(create_app(clf, ServeSettings(max_batch_size=16, max_client_batch_size=16))) as url:
        yield url, ref


def _embed(url: str, **body) -> list:
    r = httpx.post(f"{url}/embed", json={"inputs": TEXTS, "truncate": True, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_prompt_name_and_the_default_prompt_equal_sentence_transformers(served):
    url, ref = served
    np.testing.assert_allclose(_embed(url, prompt_name="query"), ref.encode(TEXTS, prompt_name="query"), **TOL)
    default = ref.encode(TEXTS)  # sentence-transformers puts the default prompt ("passage: ") first
    np.testing.assert_allclose(_embed(url), default, **TOL)
    assert np.abs(default - ref.encode(TEXTS, prompt="")).max() > 1e-3  # the prompt changes the embedding


def test_dimensions_truncate_then_renormalise(served):
    url, ref = served
    full = ref.encode(TEXTS)
    np.testing.assert_allclose(
        _embed(url, dimensions=8), ref.encode(TEXTS, truncate_dim=8, normalize_embeddings=True), **TOL
    )
    # normalize=false: the model's own output is L2-normalised (its Normalize module), so is the truncated one
    want = full[:, :8] / np.linalg.norm(full[:, :8], axis=-1, keepdims=True)
    np.testing.assert_allclose(_embed(url, dimensions=8, normalize=False), want, **TOL)
    assert len(_embed(url, dimensions=384)[0]) == 384


def test_base64_is_little_endian_float32_of_the_floats(served):
    url, _ = served
    floats = np.asarray(_embed(url, dimensions=12), np.float32)
    coded = _embed(url, dimensions=12, encoding_format="base64")
    assert all(isinstance(c, str) for c in coded)
    np.testing.assert_array_equal(np.stack([np.frombuffer(base64.b64decode(c), "<f4") for c in coded]), floats)


def test_left_truncation_keeps_the_end_as_sentence_transformers(served):
    url, ref = served
    right = ref.encode(TEXTS)
    ref.tokenizer.truncation_side = "left"
    try:
        left = ref.encode(TEXTS)
    finally:
        ref.tokenizer.truncation_side = "right"
    assert np.abs(left[6] - right[6]).max() > 1e-3  # a long text: the two ends differ
    np.testing.assert_allclose(_embed(url, truncation_direction="Left"), left, **TOL)
    np.testing.assert_allclose(_embed(url, truncation_direction="right"), right, **TOL)


def test_embed_all_equals_sentence_transformers_token_embeddings(served):
    url, ref = served
    got = httpx.post(f"{url}/embed_all", json={"inputs": TEXTS, "truncate": True}, timeout=120).json()
    want = ref.encode(TEXTS, output_value="token_embeddings")  # with the default prompt, as the server
    assert [len(g) for g in got] == [len(w) for w in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.numpy(), **TOL)


def test_similarity_equals_sentence_transformers_cosine(served):
    url, ref = served
    body = {
        "inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]},
        "parameters": {"prompt_name": "query", "truncate": True, "truncation_direction": "Right"},
    }
    got = httpx.post(f"{url}/similarity", json=body, timeout=120).json()
    emb = ref.encode(TEXTS, prompt_name="query")
    np.testing.assert_allclose(got, np.asarray(ref.similarity(emb[:1], emb[1:]))[0], **TOL)


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"prompt_name": "document"}, "prompt_name"),
        ({"prompt_name": 3}, "prompt_name"),
        ({"dimensions": 0}, "dimensions"),
        ({"dimensions": 385}, "dimensions"),
        ({"dimensions": "8"}, "dimensions"),
        ({"dimensions": True}, "dimensions"),
        ({"encoding_format": "hex"}, "encoding_format"),
        ({"truncation_direction": "up"}, "truncation_direction"),
        ({"truncation_direction": 1}, "truncation_direction"),
    ],
)
def test_bad_option_values_are_422_naming_the_field(served, extra, field):
    r = httpx.post(f"{served[0]}/embed", json={"inputs": "a text", **extra})
    assert r.status_code == 422 and r.json()["error"].startswith(f"{field}:"), r.text


def test_a_pooling_without_the_prompt_refuses_prompt_name():
    with pytest.raises(PayloadError, match="^prompt_name: .*include_prompt") as e:
        prompt_field({"prompt_name": "query"}, Prompts(PROMPTS, None, include_prompt=False))
    assert e.value.status == 422
