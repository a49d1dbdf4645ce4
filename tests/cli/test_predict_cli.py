"""``flaxheads predict | embed | evaluate`` on a tiny run folder, and model sources by hub id
through a local hub cache (never the network)."""

from __future__ import annotations

import csv
import json
import os
import shutil

import numpy as np
import pytest
from cli_helpers import SMALL, assert_one_line_error, run_cli, write_csv

from flaxheads.predict import Classifier

pytestmark = pytest.mark.full


@pytest.fixture(scope="module")
def run(bert_folder, tmp_path_factory):
    """A tiny fine-tuning run with explicit train / validation / test files."""
    from flaxheads.cli.main import main

    d = tmp_path_factory.mktemp("predict_run")
    files = {
        n: write_csv(d / f"{n}.csv", k, seed=s) for n, k, s in (("train", 36, 0), ("validation", 9, 1), ("test", 15, 2))
    }
    out = d / "run"
    code = main(
        [
            "train",
            "--model",
            bert_folder,
            "--train-file",
            files["train"],
            "--validation-file",
            files["validation"],
            "--test-file",
            files["test"],
            "--output-dir",
            str(out),
            *SMALL,
            "--batch-size",
            "4",
            "--eval-batch-size",
            "8",
            "--max-steps",
            "12",
            "--lr",
            "3e-3",
        ]
    )
    assert code == 0
    return {"dir": str(out), **files}


def _summary_test_metrics(run_dir) -> dict:
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)["metrics"]["test"]


@pytest.mark.parametrize("how", ["input", "split"])
def test_evaluate_reproduces_the_runs_test_metrics(run, tmp_path, capsys, how):
    out = tmp_path / "eval"
    src = ["--input", run["test"]] if how == "input" else ["--split", "test"]
    code, stdout, _ = run_cli(capsys, "evaluate", run["dir"], *src, "--output-dir", out, "--json")
    assert code == 0
    name = "evaluation" if how == "input" else "test"
    got = json.loads(stdout.strip().splitlines()[-1])[name]
    assert got == _summary_test_metrics(run["dir"])  # exactly: same tokens, same bucket, same argmax
    # the same per-class table training wrote, and the same logits
    table = (out / "eval.txt").read_text().split("\n", 1)[1]
    run_table = open(os.path.join(run["dir"], "eval.txt")).read().split("== test ==\n", 1)[1]
    assert table.strip() == run_table.strip()
    ours, theirs = np.load(out / "predictions.npz"), np.load(os.path.join(run["dir"], "predictions.npz"))
    np.testing.assert_array_equal(ours[f"{name}_labels"], theirs["test_labels"])
    np.testing.assert_allclose(ours[f"{name}_logits"], theirs["test_logits"], atol=1e-5)
    assert (out / "confusion_matrix.png").stat().st_size > 0


def test_predict_csv_keeps_columns_and_order(run, tmp_path, capsys):
    out = tmp_path / "pred.csv"
    mask = os.umask(0o022)
    try:
        code, _, _ = run_cli(
            capsys, "predict", run["dir"], "--input", run["test"], "--output", out, "--top-k", "2", "--batch-size", "5"
        )
    finally:
        os.umask(mask)
    assert code == 0
    assert out.stat().st_mode & 0o777 == 0o644  # as the umask says, not the temporary file's 0600
    with open(run["test"]) as f:
        rows_in = list(csv.DictReader(f))
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert [r["text"] for r in rows] == [r["text"] for r in rows_in]
    assert [r["label"] for r in rows] == [r["label"] for r in rows_in]
    pred = Classifier.from_pretrained(run["dir"]).predict([r["text"] for r in rows_in], top_k=2)
    assert [r["prediction"] for r in rows] == pred.labels
    np.testing.assert_allclose([float(r["score"]) for r in rows], pred.scores.max(1), atol=1e-6)
    assert [json.loads(r["top_labels"]) for r in rows] == [r["top_labels"] for r in pred]


def test_evaluate_reads_a_labelled_table_from_stdin_or_in_the_format_named(run, tmp_path, capsys, monkeypatch):
    """``--input -`` with ``--input-format`` (and a file whose extension does not say) scores exactly
    as the file itself; stdin without a table format is a one-line error."""
    import io
    import sys

    want = _summary_test_metrics(run["dir"])
    data = open(run["test"], "rb").read()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    code, stdout, _ = run_cli(capsys, "evaluate", run["dir"], "--input", "-", "--input-format", "csv", "--json")
    assert code == 0 and json.loads(stdout.strip().splitlines()[-1])["evaluation"] == want
    odd = tmp_path / "test.data"
    odd.write_bytes(data)
    code, stdout, _ = run_cli(capsys, "evaluate", run["dir"], "--input", odd, "--input-format", "csv", "--json")
    assert code == 0 and json.loads(stdout.strip().splitlines()[-1])["evaluation"] == want
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    code, _, err = run_cli(capsys, "evaluate", run["dir"], "--input", "-")
    assert code == 2 and "needs --input-format" in err and len(err.strip().splitlines()) == 1


def test_predict_text_lines_from_stdin_to_jsonl(run, tmp_path, capsys, monkeypatch):
    import io
    import sys

    lines = ["stock market bank", "goal match team player", "vote party"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(("\n".join(lines) + "\n").encode())))
    code, stdout, _ = run_cli(capsys, "predict", run["dir"], "--input", "-")
    assert code == 0
    got = [json.loads(x) for x in stdout.strip().splitlines()]
    assert [g["text"] for g in got] == lines
    assert [g["prediction"] for g in got] == Classifier.from_pretrained(run["dir"]).predict(lines).labels


def test_predict_text_pairs(run, bert_folder, tmp_path, capsys):
    data = write_csv(tmp_path / "pairs.csv", 7, pair=True)
    out = tmp_path / "p.jsonl"
    code, _, _ = run_cli(
        capsys,
        "predict",
        run["dir"],
        "--input",
        data,
        "--text-pair-column",
        "pair",
        "--output",
        out,
        "--batch-size",
        "3",
    )
    assert code == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    clf = Classifier.from_pretrained(run["dir"])
    pred = clf.predict([r["text"] for r in rows], [r["pair"] for r in rows])
    assert [r["prediction"] for r in rows] == pred.labels
    alone = clf.predict([r["text"] for r in rows])
    assert not np.allclose(pred.logits, alone.logits)  # the pair reached the model


@pytest.mark.parametrize(
    "content, needles",
    [
        ("text,label\nstock market,business\n,sport\n", ["row 2", "column 'text'", "empty"]),
        ("words,label\nstock market,business\n", ["no column 'text'", "--text-column"]),
    ],
)
def test_bad_input_files_exit_2_with_one_line(run, tmp_path, capsys, content, needles):
    bad = tmp_path / "bad.csv"
    bad.write_text(content)
    code, _, err = run_cli(capsys, "predict", run["dir"], "--input", bad, "--output", tmp_path / "o.csv")
    assert_one_line_error(code, err, *needles)
    assert not (tmp_path / "o.csv").exists()


def test_bad_arguments_exit_2_with_one_line(run, tmp_path, capsys):
    txt = tmp_path / "t.txt"
    txt.write_text("stock market\n\ngoal\n")
    code, _, err = run_cli(capsys, "predict", run["dir"], "--input", txt)
    assert_one_line_error(code, err, "line 2", "empty")
    txt.write_text("stock market\n")
    code, _, err = run_cli(capsys, "predict", run["dir"], "--input", txt, "--output", tmp_path / "o.xlsx")
    assert_one_line_error(code, err, "--output", ".csv or .jsonl")
    code, _, err = run_cli(capsys, "predict", tmp_path / "nowhere", "--input", txt)
    assert_one_line_error(code, err, "is not a folder", "local folder")
    code, _, err = run_cli(capsys, "predict", run["dir"], "--input", txt, "--top-k", "9")
    assert_one_line_error(code, err, "top_k")
    code, _, err = run_cli(capsys, "embed", run["dir"], "--input", txt, "--output", tmp_path / "e.npy")
    assert_one_line_error(code, err, "not embeddings", "predict")
    long = tmp_path / "long.txt"
    long.write_text("stock market\n" + " ".join(["goal"] * 40) + "\n")
    code, _, err = run_cli(capsys, "predict", run["dir"], "--input", long, "--no-truncate")
    assert_one_line_error(code, err, "line 2", "longer than the model's 16 tokens")
    code, out, err = run_cli(capsys, "predict", run["dir"], "--input", long)
    assert code == 0 and "warning: 1 of 2 texts were longer than 16 tokens" in err


@pytest.fixture(scope="module")
def st_folder(bert_folder, tmp_path_factory):
    import flaxheads as fh

    model = fh.from_pretrained(
        bert_folder, pooler="mean", head="projection", head_options={"features": (8,), "normalize": True}
    )
    return str(fh.interop.export_sentence_transformers(model, tmp_path_factory.mktemp("st") / "st"))


def test_embed_npy_and_parquet(st_folder, tmp_path, capsys):
    import pyarrow.parquet as pq
    from sentence_transformers import SentenceTransformer

    data = write_csv(tmp_path / "d.csv", 9)
    code, _, _ = run_cli(
        capsys, "embed", st_folder, "--input", data, "--output", tmp_path / "e.npy", "--batch-size", "4"
    )
    assert code == 0
    emb = np.load(tmp_path / "e.npy")
    texts = [r["text"] for r in csv.DictReader(open(data))]
    ref = SentenceTransformer(st_folder, device="cpu").encode(texts)
    cos = (emb * ref).sum(1) / np.linalg.norm(emb, axis=1) / np.linalg.norm(ref, axis=1)
    assert emb.shape == (9, 8) and cos.min() > 0.9999
    code, _, _ = run_cli(capsys, "embed", st_folder, "--input", data, "--output", tmp_path / "e.parquet")
    assert code == 0
    t = pq.read_table(tmp_path / "e.parquet").to_pydict()
    assert t["text"] == texts and np.allclose(np.asarray(t["embedding"]), emb, atol=1e-6)


# ---- hub ids through a local hub cache ----------------------------------------------------------------------


def hub_cache(root, repo: str, folder: str, rev: str = "0123456789abcdef0123456789abcdef01234567") -> str:
    """``folder``'s files laid out as the hub cache does: models--org--name/snapshots/<rev>/, refs/main."""
    base = os.path.join(root, "models--" + repo.replace("/", "--"))
    shutil.copytree(folder, os.path.join(base, "snapshots", rev))
    os.makedirs(os.path.join(base, "refs"))
    with open(os.path.join(base, "refs", "main"), "w") as f:
        f.write(rev)
    os.makedirs(os.path.join(base, "blobs"))
    return os.path.join(base, "snapshots", rev)


def test_hub_id_from_the_local_cache_offline(run, bert_folder, tmp_path, capsys, monkeypatch):
    from flaxheads.model.hub import resolve_model_source

    cache = tmp_path / "hub"
    snap = hub_cache(cache, "acme/tiny-bert", bert_folder)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert os.path.samefile(resolve_model_source("acme/tiny-bert"), snap)
    ref = Classifier.from_pretrained(bert_folder).predict(["stock market"]).logits
    np.testing.assert_array_equal(Classifier.from_pretrained("acme/tiny-bert").predict(["stock market"]).logits, ref)
    txt = tmp_path / "t.txt"
    txt.write_text("stock market\n")
    code, stdout, _ = run_cli(capsys, "predict", "acme/tiny-bert", "--input", txt)
    assert code == 0 and json.loads(stdout)["text"] == "stock market"
    code, _, err = run_cli(capsys, "predict", "acme/missing", "--input", txt)
    assert_one_line_error(code, err, "'acme/missing'", "not in the local hub cache", "HF_HUB_OFFLINE=1", "local folder")


def test_hub_id_without_network_is_a_clear_error(tmp_path):
    """Online mode, an unreachable endpoint (a closed local port) and an empty cache."""
    from cli_helpers import run_process

    (tmp_path / "t.txt").write_text("hello\n")
    proc = run_process(
        "predict",
        "acme/nothing-here",
        "--input",
        tmp_path / "t.txt",
        timeout=120,
        env={
            "HF_HUB_OFFLINE": "0",
            "HF_ENDPOINT": "http://127.0.0.1:9",
            "HF_HUB_CACHE": str(tmp_path / "hub"),
            "HF_HUB_ETAG_TIMEOUT": "2",
        },
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "could not be downloaded" in lines[0] and "local folder" in lines[0]


def _apply_one(model, folder, text):
    """Logits of one unpadded text straight through ``model.apply`` (no batching, no buckets)."""
    import flaxheads as fh

    b = fh.load_tokenizer(folder)([text], max_length=16)
    return np.asarray(model.apply(model.params, b["input_ids"], b["attention_mask"]))[0]


def test_sources_run_steps_checkpoint_and_head_export(run, bert_folder, tmp_path):
    import flaxheads as fh

    text = "stock market bank profit"
    for step in (None, "best"):
        clf = Classifier.from_pretrained(run["dir"], step=step)
        assert clf.max_length == 16 and clf.buckets == (8, 16)  # the run's own settings, a short bucket below
        ref = _apply_one(fh.checkpoint.model_from_checkpoint(run["dir"], step), bert_folder, text)
        np.testing.assert_allclose(clf.predict([text]).logits[0], ref, atol=1e-5)
    steps = sorted(int(s) for s in os.listdir(os.path.join(run["dir"], "checkpoints")) if s.isdigit())
    one = os.path.join(run["dir"], "checkpoints", str(steps[0]))
    ref = _apply_one(fh.checkpoint.model_from_checkpoint(one), bert_folder, text)
    np.testing.assert_allclose(Classifier.from_pretrained(one).predict([text]).logits[0], ref, atol=1e-5)
    # a head export sits on the backbone folder given (here the untrained one, as attach_head does)
    head = fh.interop.export_head(fh.checkpoint.model_from_checkpoint(run["dir"], head_only=True), tmp_path / "head")
    clf = Classifier.from_pretrained(head, backbone=bert_folder, max_length=16)
    ref = _apply_one(
        fh.attach_head(
            fh.from_pretrained(bert_folder, num_labels=3, ignore_mismatched_sizes=True), fh.load_head(run["dir"])
        ),
        bert_folder,
        text,
    )
    np.testing.assert_allclose(clf.predict([text]).logits[0], ref, atol=1e-5)
    assert clf.id2label == {0: "business", 1: "politics", 2: "sport"}
