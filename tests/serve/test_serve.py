"""flaxheads serve: TEI's payloads through httpx against Classifier.predict / rank (themselves
tested against transformers), the error answers, batching without compiles, and, on a `flaxheads
serve` process, the full queue (429, as TEI's contract has it), a client that leaves, and
SIGTERM's drain. TEI's contract route by route: test_serve_contract.py; real clients:
test_serve_clients.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from serve_helpers import serving  # noqa: E402  (skips the module without the serve extra)

httpx = pytest.importorskip("httpx", reason="httpx (the test client) is not installed")

from predict_helpers import TEXTS, tiny_bert_classifier  # noqa: E402

from flaxheads.predict import Classifier  # noqa: E402
from flaxheads.serve import ServeSettings, create_app  # noqa: E402

MAX_LENGTH = 16  # two buckets (8, 16): TEXTS fill both, and the longer ones need truncation
SHORT = 8  # one bucket: one program to compile for the other models
pytestmark = [pytest.mark.full, pytest.mark.filterwarnings("ignore::flaxheads.predict.TruncationWarning")]
SETTINGS = ServeSettings(max_batch_size=4, max_wait_ms=50, max_client_batch_size=12, max_body_bytes=20_000)


@pytest.fixture(scope="module")
def cli_server(tmp_path_factory):
    """A `flaxheads serve` process: batches wait 3 s for company, the queue holds 6 texts, TEI's gRPC
    services on a free port too. Started first, so that it loads while the in-process servers' tests run."""
    folder = tiny_bert_classifier(tmp_path_factory.mktemp("cli"), num_labels=3)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flaxheads",
            "serve",
            folder,
            "--port",
            "0",
            "--max-length",
            str(SHORT),
            "--max-batch-size",
            "8",
            "--max-wait-ms",
            "3000",
            "--max-queue",
            "6",
            "--grpc-port",
            "0",
            "--auto-truncate",
        ],
        stderr=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    yield proc, lines
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, cli_server):
    clf = Classifier.from_pretrained(tiny_bert_classifier(tmp_path_factory.mktemp("cls"), 3), max_length=MAX_LENGTH)
    ref = clf.predict(TEXTS, batch_size=4)
    with serving(create_app(clf, SETTINGS)) as url:
        yield url, clf, ref


def _by_label(answer: list[dict]) -> dict:
    return {d["label"]: d["score"] for d in answer}


def test_predict_equals_classifier(classifier):
    url, clf, ref = classifier
    got = httpx.post(f"{url}/predict", json={"inputs": TEXTS, "truncate": True}).json()
    assert [a[0]["label"] for a in got] == ref.labels
    for answer, scores in zip(got, ref.scores):
        assert [d["score"] for d in answer] == sorted((d["score"] for d in answer), reverse=True)
        np.testing.assert_allclose([_by_label(answer)[n] for n in ref.label_names], scores, atol=1e-5)
    raw = httpx.post(f"{url}/predict", json={"inputs": TEXTS[0], "raw_scores": True}).json()  # one text: unwrapped
    np.testing.assert_allclose([_by_label(raw)[n] for n in ref.label_names], ref.logits[0], atol=1e-5)


def test_concurrent_requests_batch_keep_order_and_compile_nothing(classifier):
    url, clf, ref = classifier
    before = _metric(url, "flaxheads_batch_size_count")

    async def main():
        async with httpx.AsyncClient(base_url=url) as client:
            return await asyncio.gather(
                *(client.post("/predict", json={"inputs": t, "truncate": True}) for t in TEXTS * 2)
            )

    answers = asyncio.run(main())
    assert [r.status_code for r in answers] == [200] * len(answers)
    assert [r.json()[0]["label"] for r in answers] == ref.labels * 2  # each request got its own text's answer
    batches = _metric(url, "flaxheads_batch_size_count") - before
    assert batches < len(answers), "concurrent requests were not batched together"
    info = httpx.get(f"{url}/info").json()
    assert len(info["batch_shapes"]) == 2, info
    assert info["compiled_programs"] == info["compiled_at_warm_up"], info  # warm-up compiled every shape


@pytest.mark.parametrize(
    "body, status, field",
    [
        (b"{not json", 422, "body"),
        (b'["a"]', 422, "body"),
        (b'{"text": "a"}', 422, "inputs"),
        (b'{"inputs": ["a", 3, "b"]}', 422, "inputs[1]"),
        (b'{"inputs": ["a", ""]}', 422, "inputs[1]"),
        (b'{"inputs": "a", "truncate": "yes"}', 422, "truncate"),
        (json.dumps({"inputs": ["a", "b", TEXTS[6]]}).encode(), 413, "inputs[2]"),  # past max length, no truncate
        (json.dumps({"inputs": ["a", TEXTS[6]]}).encode(), 413, "inputs"),  # two texts are one pair, as TEI reads them
        (json.dumps({"inputs": ["a"] * 13}).encode(), 413, "inputs"),  # more texts than max_client_batch_size
        (json.dumps({"inputs": ["word " * 5000]}).encode(), 413, "body"),  # more bytes than max_body_bytes
    ],
)
def test_bad_requests_say_which_field(classifier, body, status, field):
    url = classifier[0]
    r = httpx.post(f"{url}/predict", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert r.json()["error"].startswith(f"{field}:"), r.json()


def test_health_info_metrics_and_routes(classifier):
    from prometheus_client.parser import text_string_to_metric_families

    url, clf, _ = classifier
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    info = httpx.get(f"{url}/info").json()
    assert info["model_type"] == {
        "classifier": {
            "id2label": {"0": "class_a", "1": "class_b", "2": "class_c"},
            "label2id": {"class_a": 0, "class_b": 1, "class_c": 2},
        }
    }
    assert info["max_input_length"] == MAX_LENGTH and info["plan"].startswith("compute plan")
    r = httpx.post(f"{url}/embed", json={"inputs": "a"})  # not an embedding model: TEI's 424
    assert r.status_code == 424 and r.json()["error_type"] == "Backend" and "/predict" in r.json()["error"]
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    assert {
        "flaxheads_requests",
        "flaxheads_request_duration_seconds",
        "flaxheads_batch_size",
        "flaxheads_queue_depth",
    } <= set(families)
    ok = [
        s.value
        for s in families["flaxheads_requests"].samples
        if s.name.endswith("_total") and s.labels == {"route": "/predict", "status": "200"}
    ]
    assert ok and ok[0] >= 1
    assert families["flaxheads_queue_depth"].samples[0].value == 0


def test_rerank_and_regression_equal_classifier(tmp_path_factory):
    clf = Classifier.from_pretrained(tiny_bert_classifier(tmp_path_factory.mktemp("rank"), 1), max_length=SHORT)
    query, cands = "stock market news", TEXTS[1:9]
    ranked = clf.rank(query, cands, batch_size=4)
    values = clf.predict(cands, batch_size=4, truncate=True)
    with serving(create_app(clf, SETTINGS)) as url:
        raw = httpx.post(
            f"{url}/rerank",
            json={"query": query, "texts": cands, "raw_scores": True, "return_text": True, "truncate": True},
        ).json()
        default = httpx.post(f"{url}/rerank", json={"query": query, "texts": cands, "truncate": True}).json()
        pred = httpx.post(f"{url}/predict", json={"inputs": cands, "truncate": True}).json()
    assert [(d["index"], d["text"]) for d in raw] == [(d["index"], d["text"]) for d in ranked]
    np.testing.assert_allclose([d["score"] for d in raw], [d["score"] for d in ranked], atol=1e-5)
    sig = 1 / (1 + np.exp(-np.asarray([d["score"] for d in ranked])))  # TEI's default: the sigmoid
    np.testing.assert_allclose([d["score"] for d in default], sig, atol=1e-5)
    np.testing.assert_allclose([a[0]["score"] for a in pred], np.asarray(values.scores)[:, 0], atol=1e-5)


def test_multi_label_scores_are_sigmoids(tmp_path_factory):
    folder = tiny_bert_classifier(tmp_path_factory.mktemp("multi"), 3, "multi_label_classification")
    clf = Classifier.from_pretrained(folder, max_length=SHORT)
    ref = clf.predict(TEXTS, batch_size=4, truncate=True)
    with serving(create_app(clf, SETTINGS)) as url:
        got = httpx.post(f"{url}/predict", json={"inputs": TEXTS, "truncate": True}).json()
    for answer, scores in zip(got, ref.scores):
        np.testing.assert_allclose([_by_label(answer)[n] for n in ref.label_names], scores, atol=1e-5)


def test_batch_shapes_stay_within_the_token_budget():
    from flaxheads.serve import Shapes

    shapes = Shapes((8, 16, 64), max_batch_tokens=256, max_batch_size=24)
    assert [shapes.cap(n) for n in (8, 16, 64)] == [16, 16, 4]  # 24 texts -> 16 (a power of two); 256 // 64
    assert shapes.sizes(8) == [1, 2, 4, 8, 12, 16] and shapes.sizes(64) == [1, 2, 4]  # 12: between 8 and 16
    assert shapes.rows(3, 16) == 4 and shapes.rows(9, 8) == 12 and shapes.rows(13, 8) == 16 and shapes.rows(1, 64) == 1
    assert shapes.all() == sorted(
        {(r, n) for n, cap in ((8, 16), (16, 16), (64, 4)) for r in (1, 2, 4, 8, 12, 16) if r <= cap}
    )
    assert Shapes((8, 16), 256, 8, width=4).all() == [(4, 8), (4, 16), (8, 8), (8, 16)]  # rows split over 4 devices


def test_cli_errors_are_one_line(capsys):
    from flaxheads.cli.main import main

    assert main(["serve", "some/folder", "--host", "192.0.2.1", "--port", "0"]) == 2  # not an address of this host
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot listen on 192.0.2.1")
    with socket.create_server(("127.0.0.1", 0)) as taken:  # a gRPC port in use: refused before the model loads
        port = taken.getsockname()[1]
        assert main(["serve", "some/folder", "--port", "0", "--grpc-port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: cannot listen on 127.0.0.1:{port}") and "--grpc-port" in err[0]


# ---- a `flaxheads serve` process ---------------------------------------------------------------
def _url(cli_server, timeout: float = 240.0) -> str:
    proc, lines = cli_server
    deadline = time.monotonic() + timeout
    while not any("serving" in x for x in lines):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.1)
    line = next(x for x in lines if "serving" in x)
    return "http://" + line.split("http://")[1].split()[0]


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def _until(check, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _post_in_thread(url: str, texts: list[str]) -> dict:
    out = {}
    t = threading.Thread(
        target=lambda: out.update(r=httpx.post(f"{url}/predict", json={"inputs": texts, "truncate": True}, timeout=60))
    )
    t.start()
    out["thread"] = t
    return out


def test_full_queue_answers_429_with_retry_after(cli_server):
    import tei_contract

    url = _url(cli_server)
    first = _post_in_thread(url, TEXTS[:4])  # waits up to 3 s in the queue for a fuller batch
    _until(lambda: _metric(url, "flaxheads_queue_depth") == 4)
    r = httpx.post(f"{url}/predict", json={"inputs": TEXTS[4:8], "truncate": True})  # 4 + 4 > 6 queued texts
    assert r.status_code == 429 and r.headers["Retry-After"] == "1", r.text
    assert r.json()["error_type"] == "Overloaded"
    tei_contract.check_response("/predict", r)  # TEI's "Model is overloaded" answer
    first["thread"].join(30)
    assert first["r"].status_code == 200 and len(first["r"].json()) == 4


def test_client_that_leaves_takes_its_texts_out_of_the_queue(cli_server):
    url = _url(cli_server)
    computed = _metric(url, "flaxheads_texts_total")
    body = json.dumps({"inputs": TEXTS[:5], "truncate": True}).encode()
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(
            b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        _until(lambda: _metric(url, "flaxheads_queue_depth") == 5)
    _until(lambda: _metric(url, "flaxheads_cancelled_texts_total") == 5, timeout=2.5)  # before the 3 s wait ends
    assert _metric(url, "flaxheads_queue_depth") == 0
    time.sleep(0.5)
    assert _metric(url, "flaxheads_texts_total") == computed  # none of its texts was computed


def test_cli_serves_grpc_beside_http_and_auto_truncates(cli_server):
    grpc = pytest.importorskip("grpc", reason="grpcio (the serve extra's gRPC server) is not installed")
    from flaxheads.serve.tei_grpc import messages

    url = _url(cli_server)
    line = next(x for x in cli_server[1] if "serving" in x)
    target = line.split("grpc://")[1].split()[0]
    m = messages()
    with grpc.insecure_channel(target) as channel:
        info = channel.unary_unary(
            "/tei.v1.Info/Info",
            request_serializer=m["InfoRequest"].SerializeToString,
            response_deserializer=m["InfoResponse"].FromString,
        )(m["InfoRequest"](), timeout=30)
    assert info.model_type == 1 and info.max_input_length == SHORT  # MODEL_TYPE_CLASSIFIER
    assert httpx.get(f"{url}/info").json()["auto_truncate"] is True
    r = httpx.post(f"{url}/predict", json={"inputs": TEXTS[6]}, timeout=60)  # past 8 tokens, no "truncate"
    assert r.status_code == 200, r.text


def test_sigterm_answers_requests_in_flight_then_exits_0(cli_server):
    proc, lines = cli_server
    url = _url(cli_server)
    pending = _post_in_thread(url, TEXTS[:3])
    _until(lambda: _metric(url, "flaxheads_queue_depth") == 3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, "".join(lines)
    pending["thread"].join(30)
    assert pending["r"].status_code == 200 and len(pending["r"].json()) == 3
    assert any("every request in flight was answered" in x for x in lines)


def test_load_bench_smoke(classifier):
    """bench/serve_load.py's client on the in-process server: every request answered once, each
    with its own text's answer."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from bench import serve_load

    url = classifier[0]
    alone = asyncio.run(serve_load.load(url, serve_load.TEXTS, 1, len(serve_load.TEXTS), 60))
    got = asyncio.run(serve_load.load(url, serve_load.TEXTS, 8, 48, 60, alone["answers"]))
    assert (got["sent"], got["answered"], got["failed"], got["duplicated"], got["wrong"]) == (48, 48, 0, 0, 0)
    assert got["rps"] > 0 and got["p99_ms"] >= got["p50_ms"]
