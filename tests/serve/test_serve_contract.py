"""flaxheads serve against text-embeddings-inference's own contract (its published OpenAPI
description, v1.7.1, under tests/serve/data): every TEI route, on a model of each kind (classifier,
reranker, embedding; tiny BERTs on 127.0.0.1), for good and bad requests, answers with a status
the route documents and a body that fits its schema; a route the model's kind cannot serve is 424,
as TEI answers it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from serve_helpers import serving  # noqa: E402  (skips the module without the serve extra)

httpx = pytest.importorskip("httpx", reason="httpx (the test client) is not installed")
import tei_contract as tei  # noqa: E402  (skips the module without jsonschema)
from predict_helpers import TEXTS, tiny_bert_classifier  # noqa: E402

from flaxheads.interop.sentence_transformers import Prompts  # noqa: E402
from flaxheads.predict import Classifier  # noqa: E402
from flaxheads.serve import ServeSettings, create_app  # noqa: E402

pytestmark = [pytest.mark.full, pytest.mark.filterwarnings("ignore::flaxheads.predict.TruncationWarning")]
SETTINGS = ServeSettings(max_batch_size=4, max_wait_ms=5, max_client_batch_size=6)
LONG = TEXTS[6]  # past the 16 tokens of these servers
PAIR_BATCH = {"inputs": [["shares fell"], ["the team won", "a match"]]}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_bert_classifier(tmp_path_factory.mktemp("cls") / "cls", 3)


@pytest.fixture(scope="module")
def classifier(folder):
    with serving(create_app(Classifier.from_pretrained(folder, max_length=16), SETTINGS)) as url:
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    clf = Classifier.from_pretrained(tiny_bert_classifier(tmp_path_factory.mktemp("rank") / "rank", 1), max_length=16)
    with serving(create_app(clf, SETTINGS)) as url:
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client


@pytest.fixture(scope="module")
def embedder(folder):
    """Mean pooling and L2 normalisation on the tiny BERT: an embedding model, with a query prompt."""
    from flaxheads.model.pretrained import from_pretrained

    model = from_pretrained(folder, pooler="mean", head="identity", head_options={"normalize": True})
    clf = Classifier.from_model(model, folder, max_length=16, prompts=Prompts({"query": "query: "}))
    with serving(create_app(clf, SETTINGS)) as url:
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client


# ---- every kind: /info, /health, /metrics, /tokenize, /decode ------------------------------------
@pytest.mark.parametrize("server", ["classifier", "reranker", "embedder"])
def test_info_health_metrics_fit_the_contract(request, server):
    client = request.getfixturevalue(server)
    info = client.get("/info")
    tei.check_response("/info", info, "get")
    kind = {"classifier": "classifier", "reranker": "reranker", "embedder": "embedding"}[server]
    assert list(info.json()["model_type"]) == [kind]
    assert info.json()["auto_truncate"] is False and info.json()["tokenization_workers"] >= 1
    tei.check_response("/health", client.get("/health"), "get")
    assert client.get("/ping").status_code == 200 and client.get("/").status_code == 200
    metrics = client.get("/metrics")
    tei.check_response("/metrics", metrics, "get")
    assert "flaxheads_requests_total" in metrics.text


def test_health_before_warm_up_is_503_unhealthy(folder):
    app = create_app(Classifier.from_pretrained(folder, max_length=16), SETTINGS)

    async def main():  # no lifespan: the app never became ready
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as client:
            return await client.get("/health")

    r = asyncio.run(main())
    tei.check_response("/health", r, "get")
    assert r.status_code == 503 and r.json()["error_type"] == "Unhealthy"


@pytest.mark.parametrize(
    "body, status",
    [
        ({"inputs": "Shares fell after the results."}, 200),
        ({"inputs": ["Hi", "Shares fell."], "add_special_tokens": False}, 200),
        ({"inputs": 3}, 422),
        ({"inputs": ["a", ""]}, 422),
        ({"inputs": "a", "add_special_tokens": "no"}, 422),
        ({"inputs": ["a"] * 7}, 413),
    ],
)
def test_tokenize(classifier, body, status):
    r = tei.post(classifier, "/tokenize", body, valid=status == 200)
    assert r.status_code == status, r.text
    if status == 200:
        tokens = r.json()
        assert len(tokens) == (1 if isinstance(body["inputs"], str) else 2)
        text = body["inputs"] if isinstance(body["inputs"], str) else body["inputs"][1]
        for t in tokens[-1]:
            if not t["special"]:
                assert text.encode()[t["start"] : t["stop"]].decode() == t["text"]
        assert [t["special"] for t in tokens[0]][0] is (body.get("add_special_tokens", True))


@pytest.mark.parametrize(
    "body, status, want",
    [
        ({"ids": [101, 7592, 2088, 102]}, 200, ["hello world"]),
        ({"ids": [[101, 7592, 102], [2088]], "skip_special_tokens": False}, 200, ["[CLS] hello [SEP]", "world"]),
        ({"ids": [7592, 10**6]}, 422, None),
        ({"ids": "hello"}, 422, None),
        ({"ids": [-1]}, 422, None),
        ({"ids": [[1]] * 7}, 413, None),
    ],
)
def test_decode(classifier, body, status, want):
    r = tei.post(classifier, "/decode", body, valid=status == 200)
    assert r.status_code == status, r.text
    if want is not None:
        assert r.json() == want


# ---- a classifier ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, status",
    [
        ({"inputs": "shares fell"}, 200),
        ({"inputs": ["shares fell", "prices rose"]}, 200),  # a pair
        (PAIR_BATCH, 200),  # PredictInput's third form: a batch of [text] and [text, text] items
        ({"inputs": [["a"], ["b"], ["c", "d"]], "raw_scores": True, "truncation_direction": "Left"}, 200),
        ({"inputs": LONG, "truncate": True}, 200),
        ({"inputs": LONG}, 413),
        ({"inputs": [["a"]] * 7}, 413),
        ({"inputs": 3}, 422),
        ({"inputs": [["a", "b", "c"]]}, 422),
        ({"inputs": []}, 422),
        ({"text": "a"}, 422),
        ({"inputs": "a", "truncation_direction": "Up"}, 422),
    ],
)
def test_predict(classifier, body, status):
    r = tei.post(classifier, "/predict", body, valid=status == 200 or (status == 413 and "inputs" in body))
    assert r.status_code == status, r.text
    if status != 200:
        assert r.json()["error_type"] == "Validation"


def test_predict_batch_form_answers_each_item_as_alone(classifier):
    batch = classifier.post("/predict", json=PAIR_BATCH).json()
    alone = [
        classifier.post("/predict", json={"inputs": x if len(x) == 2 else x[0]}).json() for x in PAIR_BATCH["inputs"]
    ]
    for got, want in zip(batch, alone):
        assert [d["label"] for d in got] == [d["label"] for d in want]
        np.testing.assert_allclose([d["score"] for d in got], [d["score"] for d in want], atol=1e-6)
    one = classifier.post("/predict", json={"inputs": ["shares fell"]}).json()  # [text]: that text, unwrapped
    assert isinstance(one[0], dict) and one == classifier.post("/predict", json={"inputs": "shares fell"}).json()


@pytest.mark.parametrize(
    "route, body",
    [
        ("/rerank", {"query": "a", "texts": ["b"]}),
        ("/embed", {"inputs": "a"}),
        ("/embed_all", {"inputs": "a"}),
        ("/embed_sparse", {"inputs": "a"}),
        ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}}),
        ("/v1/embeddings", {"input": "a"}),
    ],
)
def test_routes_a_classifier_cannot_serve_are_424(classifier, route, body):
    r = tei.post(classifier, route, body)
    assert r.status_code == 424, r.text
    err = r.json()
    assert err.get("error_type") == "Backend" and "use /predict" in (err.get("error") or err.get("message"))


# ---- a reranker -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, status",
    [
        ({"query": "stock market", "texts": TEXTS[1:6], "truncate": True}, 200),
        ({"query": "stock market", "texts": ["shares fell", "a match"], "raw_scores": True, "return_text": True}, 200),
        ({"query": "stock market", "texts": TEXTS[:7], "truncate": True}, 413),
        ({"query": "stock market", "texts": [LONG]}, 413),
        ({"query": "stock market", "texts": []}, 422),
        ({"query": 3, "texts": ["a"]}, 422),
        ({"texts": ["a"]}, 422),
    ],
)
def test_rerank(reranker, body, status):
    r = tei.post(reranker, "/rerank", body, valid=status == 200)
    assert r.status_code == status, r.text
    if status == 200:
        ranks = r.json()
        assert sorted(x["index"] for x in ranks) == list(range(len(body["texts"])))
        assert [x["score"] for x in ranks] == sorted((x["score"] for x in ranks), reverse=True)
        assert all(("text" in x) is body.get("return_text", False) for x in ranks)


def test_a_reranker_predicts_and_refuses_embedding_routes(reranker):
    assert tei.post(reranker, "/predict", PAIR_BATCH).status_code == 200
    for route, body in [("/embed", {"inputs": "a"}), ("/v1/embeddings", {"input": "a"})]:
        r = tei.post(reranker, route, body)
        assert r.status_code == 424 and "/rerank or /predict" in r.text


# ---- an embedding model ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, status, error_type",
    [
        ({"inputs": "shares fell"}, 200, None),
        ({"inputs": ["shares fell", [101, 7592, 102]], "normalize": False}, 200, None),  # texts and token ids
        ({"inputs": [101, 7592, 102]}, 200, None),
        ({"inputs": "shares fell", "prompt_name": "query", "truncation_direction": "Left"}, 200, None),
        ({"inputs": LONG}, 413, "Validation"),
        ({"inputs": ["a"] * 7}, 413, "Validation"),
        ({"inputs": [101, 10**6]}, 422, "Tokenizer"),
        ({"inputs": "a", "prompt_name": "passage"}, 422, "Validation"),
        ({"inputs": [101, 7592], "prompt_name": "query"}, 422, "Validation"),
        ({"inputs": {}}, 422, "Validation"),
        ({"inputs": [[]]}, 422, "Validation"),
    ],
)
def test_embed(embedder, body, status, error_type):
    r = tei.post(embedder, "/embed", body, valid=status in (200, 413))
    assert r.status_code == status, r.text
    if status == 200:
        inputs = body["inputs"]
        n = 1 if isinstance(inputs, str) or isinstance(inputs[0], int) else len(inputs)
        assert np.asarray(r.json()).shape == (n, 32)
    else:
        assert r.json()["error_type"] == error_type


def test_token_ids_embed_as_their_text(embedder):
    ids = embedder.post("/tokenize", json={"inputs": "shares fell"}).json()[0]
    by_ids = embedder.post("/embed", json={"inputs": [t["id"] for t in ids]}).json()
    np.testing.assert_allclose(by_ids, embedder.post("/embed", json={"inputs": "shares fell"}).json(), atol=1e-6)


@pytest.mark.parametrize(
    "body, status",
    [
        ({"inputs": "shares fell"}, 200),
        ({"inputs": ["shares fell", "the team won a match"]}, 200),
        ({"inputs": LONG}, 413),
        ({"inputs": 3}, 422),
    ],
)
def test_embed_all(embedder, body, status):
    r = tei.post(embedder, "/embed_all", body, valid=status == 200)
    assert r.status_code == status, r.text
    if status == 200:
        texts = [body["inputs"]] if isinstance(body["inputs"], str) else body["inputs"]
        for text, tokens in zip(texts, r.json()):
            assert np.asarray(tokens).shape == (len(embedder.post("/tokenize", json={"inputs": text}).json()[0]), 32)


@pytest.mark.parametrize(
    "body, status",
    [
        ({"inputs": {"source_sentence": "shares fell", "sentences": ["prices dropped", "the team won"]}}, 200),
        (
            {
                "inputs": {"source_sentence": "shares fell", "sentences": [LONG]},
                "parameters": {"truncate": True, "truncation_direction": "Right", "prompt_name": "query"},
            },
            200,
        ),
        ({"inputs": {"source_sentence": "a", "sentences": ["b"] * 6}}, 413),  # with the source: 7 > 6
        ({"inputs": {"source_sentence": "a", "sentences": []}}, 422),
        ({"inputs": "a"}, 422),
        ({"inputs": {"source_sentence": "a", "sentences": ["b"]}, "parameters": {"truncate": 1}}, 422),
    ],
)
def test_similarity(embedder, body, status):
    r = tei.post(embedder, "/similarity", body, valid=status in (200, 413))
    assert r.status_code == status, r.text
    if status == 200:
        inputs = body["inputs"]
        params = body.get("parameters", {})
        emb = np.asarray(
            embedder.post("/embed", json={"inputs": [inputs["source_sentence"], *inputs["sentences"]], **params}).json()
        )
        np.testing.assert_allclose(r.json(), emb[1:] @ emb[0], atol=1e-5)


@pytest.mark.parametrize("path", ["/v1/embeddings", "/embeddings"])
@pytest.mark.parametrize(
    "body, status",
    [
        ({"input": "shares fell", "model": "any"}, 200),
        ({"input": ["shares fell", [101, 7592, 102]], "encoding_format": "base64", "user": "u"}, 200),
        ({"input": LONG}, 413),
        ({"input": 3}, 422),
        ({"input": "a", "encoding_format": "hex"}, 422),
    ],
)
def test_openai_embeddings(embedder, path, body, status):
    r = tei.post(embedder, "/v1/embeddings", body, valid=status in (200, 413), path=path)
    assert r.status_code == status, r.text
    if status == 200:
        got = r.json()
        assert got["object"] == "list" and [d["index"] for d in got["data"]] == list(range(len(got["data"])))
        assert got["usage"]["prompt_tokens"] == got["usage"]["total_tokens"] > 0
    else:
        assert r.json()["code"] == status and r.json()["type"] == "Validation"


@pytest.mark.parametrize(
    "route, body",
    [
        ("/predict", {"inputs": "a"}),
        ("/rerank", {"query": "a", "texts": ["b"]}),
        ("/embed_sparse", {"inputs": "a"}),
    ],
)
def test_routes_an_embedding_model_cannot_serve_are_424(embedder, route, body):
    r = tei.post(embedder, route, body)
    assert r.status_code == 424 and r.json()["error_type"] == "Backend", r.text
