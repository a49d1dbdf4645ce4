"""What a run shows of itself: TensorBoard event files that TensorBoard's own reader reads back as
exactly the values of metrics.jsonl (classification and a ranking objective), throughput and the
model FLOPs per token in the summary, a profiler trace holding the requested steps only, and
report.html: its numbers are summary.json's, it names nothing on the network, ``flaxheads report``
rebuilds it, and headless Chromium (Debian's ``chromium``) renders it offline with no console error
for a single-label, a multi-label, a regression and a ranking run.

Four tiny runs on the shared ``tiny_bert`` folder, made once for the module."""

from __future__ import annotations

import csv
import gzip
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from train_helpers import WORDS, event_scalars

import flaxheads as fh
from flaxheads.cli.main import main

pytestmark = pytest.mark.full

TOPICS = [WORDS[32:38], WORDS[38:43], WORDS[43:48], WORDS[48:53]]
SMALL = {"max_length": 16, "bucket_step": 16, "batch_size": 4, "log_every": 1, "checkpoint_every": 0, "lr": 3e-3}


def _words(rng, topic, n):
    return " ".join(rng.choice(TOPICS[topic], n))


@pytest.fixture(scope="module")
def runs(tiny_bert, tmp_path_factory):
    """Four run folders: single-label (profiled at steps 2:3), ranking (pairwise), multi-label
    (``report_to`` jsonl only) and regression."""
    d = tmp_path_factory.mktemp("observed")
    rng = np.random.default_rng(0)
    with open(d / "news.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        w.writerows([[_words(rng, i % 3, int(rng.integers(3, 9))), f"c{i % 3}"] for i in range(40)])
    with open(d / "pref.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "chosen", "rejected"])
        for _ in range(24):
            a, b = rng.choice(len(TOPICS), 2, replace=False)
            w.writerow([_words(rng, a, 3), _words(rng, a, 5), _words(rng, b, 5)])
    with open(d / "tags.jsonl", "w") as f:
        for _ in range(30):
            f.write(
                json.dumps(
                    {
                        "text": _words(rng, int(rng.integers(3)), 5),
                        "label": [x for x in ("x", "y", "z") if rng.random() < 0.5],
                    }
                )
                + "\n"
            )
    with open(d / "score.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "score"])
        w.writerows([[_words(rng, int(rng.integers(3)), 5), f"{rng.normal():.3f}"] for _ in range(30)])
    specs = {
        "single": dict(data=str(d / "news.csv"), max_steps=4, eval_every=2, profile_steps="2:3"),
        "ranking": dict(data=str(d / "pref.csv"), objective="pairwise", max_steps=2, split=(0.5, 0.25, 0.25)),
        "multi": dict(data=str(d / "tags.jsonl"), max_steps=2, report_to="jsonl"),
        "regression": dict(data=str(d / "score.csv"), label_column="score", max_steps=2),
    }
    return {
        name: fh.train(model=tiny_bert, **SMALL, **s, output_dir=str(d / name), progress=False)
        for name, s in specs.items()
    }


def _log(run) -> list[dict]:
    return [json.loads(x) for x in (run.folder / "metrics.jsonl").read_text().splitlines()]


def _jsonl_scalars(log: list[dict]) -> set[tuple[str, int, float]]:
    """metrics.jsonl's values as float32 (what an event file stores), tagged as the docs say."""
    out = set()
    for e in log:
        if "eval" in e:
            pairs = [(f"{s}/{k}", v) for s, r in e["eval"].items() for k, v in r.items()]
        elif "final" in e:
            pairs = [(f"final/{s}/{k}", v) for s, r in e["final"].items() for k, v in r.items()]
        else:
            pairs = [(f"train/{k}", v) for k, v in e.items() if k != "step"]
        out |= {(re.sub(r"[^\w./-]", "_", tag), e["step"], float(np.float32(v))) for tag, v in pairs}
    return out


@pytest.mark.parametrize("name", ["single", "ranking", "regression"])
def test_tensorboard_reads_back_exactly_the_jsonl_values(runs, name):
    pytest.importorskip("tensorboard")  # the reader
    run = runs[name]
    log = _log(run)
    got, want = event_scalars(run.folder / "tensorboard"), _jsonl_scalars(log)
    assert got == want
    tags = {t for t, _, _ in got}
    assert {
        "train/loss",
        "train/grad_norm",
        "train/lr_head",
        "train/padding",
        "train/examples_per_s",
        "train/tokens_per_s",
        "train/step_seconds",
    } <= tags
    assert "train/lr_backbone" in tags  # a fine-tune: both parameter groups' rates
    assert any(t.startswith("validation/") for t in tags) and any(t.startswith("final/test/") for t in tags)


def test_report_to_jsonl_writes_no_event_files(runs):
    assert not (runs["multi"].folder / "tensorboard").exists()
    assert (runs["multi"].folder / "metrics.jsonl").is_file()
    assert fh.RunSpec.from_run(runs["multi"].folder).checkpoints.report_to == ("jsonl",)


def test_throughput_and_model_flops_in_the_summary_and_the_log(runs, tiny_bert):
    run = runs["single"]
    t = run.summary["throughput"]
    assert t["steps_timed"] == 3 and t["examples_per_s"] > 0
    # every row is padded to the one 16-token bucket: 16 token slots per row, 4 rows per step
    assert t["tokens_per_s"] == pytest.approx(16 * 4 / t["step_seconds"], rel=1e-3)
    cfg = json.loads((Path(tiny_bert) / "config.json").read_text())
    h, L, i, T, k = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], 16, 3
    head = sum(np.prod(v.shape) for v in __import__("jax").tree.leaves(run.model.params["head"]) if v.ndim == 2)
    assert head == h * k  # mean pooler, linear head: one matrix
    by_hand = 6 * L * (4 * h * h + 2 * h * i) + 12 * L * T * h + 6 * head / T
    assert t["model_flops_per_token"] == round(by_hand)
    assert t["model_tflops_per_s"] == pytest.approx(by_hand * t["tokens_per_s"] / 1e12, rel=1e-4)
    assert "mfu" not in t  # a CPU: no known peak
    steps = [e for e in _log(run) if "loss" in e and "eval" not in e]
    assert all(e["tokens_per_s"] > 0 and e["step_seconds"] > 0 for e in steps)


def test_the_profile_holds_the_requested_steps_only(runs):
    run = runs["single"]
    prof = run.summary["profile"]
    assert prof["steps"] == [2, 3]
    [trace] = [p for p in prof["files"] if p.endswith("perfetto_trace.json.gz")]
    data = json.load(gzip.open(trace))
    events = data["traceEvents"] if isinstance(data, dict) else data
    steps = sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train" and e.get("ph") == "X")
    assert steps == [2, 3]
    assert any(p.endswith(".xplane.pb") for p in prof["files"])  # TensorBoard's profile plugin reads this one


class _Page(HTMLParser):
    """data-key -> (data-value, shown text) of the page's numbers; every src/href; the body's attributes."""

    def __init__(self):
        super().__init__()
        self.values, self.links, self.body, self._key, self._text = {}, [], {}, None, ""

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.links += [a[k] for k in ("src", "href") if a.get(k)]
        if tag == "body":
            self.body = a
        if "data-key" in a:
            self._key, self._value, self._text = a["data-key"], a["data-value"], ""

    def handle_data(self, data):
        if self._key is not None:
            self._text += data

    def handle_endtag(self, tag):
        if self._key is not None and tag == "td":
            self.values[self._key] = (json.loads(self._value), self._text)
            self._key = None


def _page(html_text: str) -> _Page:
    p = _Page()
    p.feed(html_text)
    return p


def _shown(v) -> str:
    """How the page shows a number: integers in full, else 4 significant digits below 1000."""
    return f"{v:,}" if isinstance(v, int) else f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"


def _check_numbers(page: _Page, summary: dict) -> None:
    """Every final metric and throughput figure of summary.json is on the page, exactly and as shown."""
    want = {f"metrics/{s}/{k}": v for s, r in summary["metrics"].items() for k, v in r.items()}
    want |= {f"throughput/{k}": v for k, v in summary.get("throughput", {}).items()}
    assert want
    for key, v in want.items():
        assert key in page.values, key
        got, text = page.values[key]
        assert got == v, key
        assert text == _shown(v), key


@pytest.mark.parametrize("name", ["single", "ranking", "multi", "regression"])
def test_the_report_page_holds_the_summary_and_no_address(runs, name):
    run = runs[name]
    html_text = (run.folder / "report.html").read_text()
    page = _page(html_text)
    _check_numbers(page, run.summary)
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", html_text)  # nothing to fetch
    assert all(x.startswith("#") for x in page.links)
    if name == "single":
        assert "plugins/profile" in html_text and "confusion matrix" in html_text
        worst = json.loads((run.folder / "worst_examples.json").read_text())
        sizes = json.loads((run.folder / "config.json").read_text())["sizes"]
        assert worst["split"] == "validation" and len(worst["rows"]) == min(10, sizes["validation"])
        with open(run.spec.data.data) as f:
            labelled = {(r["text"], r["label"]) for r in csv.DictReader(f)}
        losses = [r["loss"] for r in worst["rows"]]
        assert losses == sorted(losses, reverse=True)
        for r in worst["rows"]:
            assert (r["text"], r["true"]) in labelled and r["text"] in html_text
            assert r["p(true)"] == pytest.approx(np.exp(-r["loss"]), rel=1e-9)
        # the trained model's own probabilities (the run takes them from its last evaluation)
        clf = fh.Classifier.from_model(run.model, run.spec.model.model, max_length=16)
        logits = clf.predict([r["text"] for r in worst["rows"]]).logits
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        ids = {v: k for k, v in run.model.id2label.items()}
        np.testing.assert_allclose(
            [r["p(true)"] for r in worst["rows"]],
            [p[i, ids[r["true"]]] for i, r in enumerate(worst["rows"])],
            rtol=1e-4,
        )


def test_flaxheads_report_rebuilds_the_page(runs, tmp_path, capsys):
    run = runs["ranking"]
    page = run.folder / "report.html"
    before = page.read_text()
    page.unlink()
    assert main(["report", str(run.folder)]) == 0
    assert page.read_text() == before and str(page) in capsys.readouterr().out
    assert main(["report", str(tmp_path)]) == 2
    assert "not a flaxheads run folder" in capsys.readouterr().err


# ---- a real browser ---------------------------------------------------------------------------------


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


#: No network at all: every host resolves to nothing, and a proxy nobody listens on.
OFFLINE = ["--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9", "--no-proxy-server=false"]


def _browse(page: Path, *extra: str) -> tuple[str, str]:
    """(stdout, stderr) of headless Chromium opening ``page`` from disk, offline, console on stderr."""
    cmd = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--enable-logging=stderr",
        "--v=0",
        *OFFLINE,
        "--virtual-time-budget=3000",
        f"--user-data-dir={page.parent / '.chromium'}",
        *extra,
        page.resolve().as_uri(),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return out.stdout, out.stderr


def _console_errors(stderr: str) -> list[str]:
    """The page's console errors and uncaught exceptions in Chromium's log."""
    return [ln for ln in stderr.splitlines() if "CONSOLE" in ln and re.search(r"Uncaught|Error|error", ln)]


@pytest.mark.slow
def test_chromium_renders_the_pages_offline_with_the_summary_numbers(runs, tmp_path):
    if _chromium() is None:
        pytest.skip("no headless Chromium (Debian's package `chromium`: apt-get install -y chromium)")
    # the detector itself: a page whose script throws is caught
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><p>x</p><script>throw new Error('boom')</script></body></html>")
    _, err = _browse(bad, "--dump-dom")
    assert any("boom" in ln for ln in _console_errors(err)), err[-2000:]
    from matplotlib.image import imread

    for name, run in runs.items():
        page = run.folder / "report.html"
        shot = tmp_path / f"{name}.png"
        dom, err = _browse(page, "--dump-dom", f"--screenshot={shot}", "--window-size=1200,1600")
        assert not _console_errors(err), (name, _console_errors(err))
        rendered = _page(dom)
        assert rendered.body.get("data-ready") == "1", name  # the page's script ran to its end
        _check_numbers(rendered, run.summary)
        pixels = imread(shot)
        assert pixels.shape[:2] == (1600, 1200), name
        assert pixels[:40].mean() < 0.3 < pixels[200:].mean(), name  # the dark header above a light page
        assert pixels.std() > 0.05, name  # not a blank page
