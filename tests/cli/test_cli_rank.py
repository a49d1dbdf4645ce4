"""``flaxheads train --objective ...`` and ``flaxheads rank`` end to end on a tiny BERT: the run
folder (metrics.jsonl, summary, predictions), checkpoints and resume, LoRA on pmap, the scores
``rank`` and ``Classifier.score`` give against the training run's own test scores, and bad
ranking input as one line naming the row."""

from __future__ import annotations

import csv
import json
import os

import numpy as np
import pytest
from cli_helpers import SMALL, run_cli
from train_helpers import WORDS

pytestmark = pytest.mark.full

TOPICS = [WORDS[32:38], WORDS[38:43], WORDS[43:48], WORDS[48:53]]


def _preference_rows(n: int, seed: int) -> list[dict]:
    """Prompt: words of one topic; chosen: more words of it; rejected: words of another topic."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        a, b = rng.choice(len(TOPICS), 2, replace=False)
        words = lambda t, k: " ".join(rng.choice(TOPICS[t], k))  # noqa: E731
        rows.append(
            {"prompt": words(a, 3), "chosen": words(a, 5), "rejected": words(b, 5), "margin": float(rng.integers(0, 3))}
        )  # TRL's per-pair margin column
    return rows


def _write(path, rows) -> str:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return str(path)


@pytest.fixture(scope="module")
def preference_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("pref")
    return {
        name: _write(d / f"{name}.csv", _preference_rows(n, seed))
        for name, n, seed in (("train", 24, 0), ("validation", 8, 1), ("test", 8, 2))
    }


@pytest.fixture(scope="module")
def pairwise_run(bert_folder, preference_files, tmp_path_factory):
    from flaxheads.cli.main import main

    out = tmp_path_factory.mktemp("pairwise") / "run"
    argv = [
        "train",
        "--objective",
        "pairwise",
        "--model",
        bert_folder,
        "--train-file",
        preference_files["train"],
        "--validation-file",
        preference_files["validation"],
        "--test-file",
        preference_files["test"],
        "--batch-size",
        "4",
        "--max-steps",
        "4",
        "--eval-every",
        "2",
        "--lr",
        "1e-3",
        "--pooler",
        "preset",
        "--head",
        "preset",
        "--output-dir",
        str(out),
        *SMALL,
    ]
    assert main(argv) == 0
    return out, argv


def test_pairwise_run_folder_and_resume(pairwise_run, capsys):
    out, argv = pairwise_run
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [e["eval"]["validation"] for e in lines if "eval" in e]
    assert len(evals) == 2 and all(0 <= e["pairwise_accuracy"] <= 1 and e["pairs"] == 8 for e in evals)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["objective"] == "pairwise" and summary["steps"] == 4
    assert set(summary["metrics"]["test"]) >= {"pairwise_accuracy", "ndcg@10", "mrr@10", "map"}
    config = json.loads((out / "config.json").read_text())
    assert config["group_size"] == 2 and config["sizes"] == {"train": 24, "validation": 8, "test": 8}
    code, stdout, _ = run_cli(
        capsys, *[a if a != "4" or argv[i - 1] != "--max-steps" else "6" for i, a in enumerate(argv)]
    )
    assert code == 0 and "resuming from step 4" in stdout
    assert json.loads((out / "summary.json").read_text())["resumed_from"] == 4


def test_rank_and_score_reproduce_the_runs_test_scores(pairwise_run, preference_files, tmp_path, capsys):
    """The run's test scores (training's evaluation path) = ``flaxheads rank`` = ``Classifier.score``."""
    from flaxheads.predict import Classifier

    out, _ = pairwise_run
    saved = np.load(out / "predictions.npz")
    with open(preference_files["test"]) as f:
        prefs = list(csv.DictReader(f))
    pairs = [(r["prompt"], r[k]) for r in prefs for k in ("chosen", "rejected")]
    assert np.allclose(saved["test_labels"], np.tile([1.0, 0.0], len(prefs)))
    flat = _write(tmp_path / "pairs.csv", [{"query": q, "passage": p} for q, p in pairs])
    code, _, err = run_cli(capsys, "rank", out, "--input", flat, "--output", tmp_path / "ranked.csv", "--no-progress")
    assert code == 0, err
    with open(tmp_path / "ranked.csv") as f:
        ranked = list(csv.DictReader(f))
    scores = np.asarray([float(r["score"]) for r in ranked])
    # predictions.npz holds the test scores of the step the run ended on, its latest checkpoint
    np.testing.assert_allclose(scores, saved["test_scores"], atol=1e-5)
    clf = Classifier.from_pretrained(str(out))
    np.testing.assert_allclose(clf.score(pairs), scores, atol=1e-5)
    ranks = np.asarray([int(r["rank"]) for r in ranked])
    by_query = {}
    for (q, _), s, k in zip(pairs, scores, ranks):
        by_query.setdefault(q, []).append((s, k))
    for items in by_query.values():
        order = sorted(items, key=lambda x: -x[0])
        assert [k for _, k in order] == list(range(1, len(items) + 1))
    code, _, err = run_cli(
        capsys,
        "rank",
        out,
        "--input",
        preference_files["test"],
        "--preference",
        "--output",
        tmp_path / "prefs.jsonl",
        "--no-progress",
    )
    assert code == 0, err
    prefs_out = [json.loads(x) for x in (tmp_path / "prefs.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(
        [[r["chosen_score"], r["rejected_score"]] for r in prefs_out], saved["test_scores"].reshape(-1, 2), atol=1e-5
    )
    assert [r["prefers_chosen"] for r in prefs_out] == [r["chosen_score"] > r["rejected_score"] for r in prefs_out]
    top = clf.rank(pairs[0][0], [pairs[0][1], pairs[1][1]])
    assert [t["index"] for t in top] == ([0, 1] if scores[0] >= scores[1] else [1, 0])


def test_cross_encoder_export_of_the_run_predicts_its_test_scores(pairwise_run, preference_files, tmp_path, capsys):
    """BERT's preset head: ``flaxheads export --format cross-encoder`` of the run's latest checkpoint
    gives, through ``CrossEncoder.predict``, the test scores the run wrote (predictions.npz)."""
    from sentence_transformers import CrossEncoder

    out, _ = pairwise_run
    with open(preference_files["test"]) as f:
        pairs = [(r["prompt"], r[k]) for r in csv.DictReader(f) for k in ("chosen", "rejected")]
    code, _, err = run_cli(
        capsys, "export", "--from", out, "--format", "cross-encoder", "--out", tmp_path / "ce", "--max-seq-length", "16"
    )
    assert code == 0, err
    got = CrossEncoder(str(tmp_path / "ce"), device="cpu").predict(pairs, convert_to_numpy=True)
    np.testing.assert_allclose(np.asarray(got).reshape(-1), np.load(out / "predictions.npz")["test_scores"], atol=1e-5)


def test_listwise_with_lora_on_pmap_and_ragged_groups(bert_folder, tmp_path):
    """Rows layout (query, passage, label) with 2-4 candidates per query, LoRA adapters, 2 devices."""
    from flaxheads.cli.main import main

    rng = np.random.default_rng(5)
    rows = []
    for q in range(16):
        t, query = q % len(TOPICS), f"{' '.join(rng.choice(TOPICS[q % len(TOPICS)], 2))} w{q}"  # distinct queries
        rows.append({"query": query, "passage": " ".join(rng.choice(TOPICS[t], 4)), "label": 1})
        rows += [
            {"query": query, "passage": " ".join(rng.choice(TOPICS[(t + 1) % len(TOPICS)], 4)), "label": 0}
            for _ in range(int(rng.integers(1, 4)))
        ]
    data = _write(tmp_path / "rank.csv", rows)
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--objective",
                "listwise",
                "--model",
                bert_folder,
                "--data",
                data,
                "--split",
                "0.75,0.25,0",
                "--batch-size",
                "4",
                "--max-steps",
                "3",
                "--parallel",
                "pmap",
                "--lora-rank",
                "2",
                "--output-dir",
                str(out),
                *SMALL,
            ]
        )
        == 0
    )
    config = json.loads((out / "config.json").read_text())
    assert config["devices"]["width"] >= 2 and config["lora"]["rank"] == 2 and config["group_size"] == 4
    assert json.loads((out / "summary.json").read_text())["metrics"]["validation"]["groups"] == 4


@pytest.mark.parametrize(
    "rows,needle",
    [
        (
            [
                {"query": "a", "passage": "x", "label": 0},
                {"query": "a", "passage": "y", "label": 0},
                {"query": "b", "passage": "z", "label": 1},
                {"query": "b", "passage": "w", "label": 0},
            ],
            "rows 1, 2: the group of query 'a' has no relevant candidate",
        ),
        (
            [{"query": "a", "passage": "x", "label": 1}, {"query": "a", "passage": " ", "label": 0}],
            "row 2, column 'passage': text is empty",
        ),
        ([{"query": "a", "text": "x", "label": 1}], "no column 'passage'"),
        ([{"prompt": "a", "chosen": "x", "rejected": ""}], "row 1, column 'rejected': text is empty"),
        (
            [{"query": "a", "passage": "x", "label": "yes"}, {"query": "a", "passage": "y", "label": 0}],
            "row 1, column 'label': relevance 'yes' is not a finite number",
        ),
        (
            [{"prompt": p, "chosen": "x", "rejected": "y", "margin": 1} for p in "ab"],
            "has a margin column, which the pairwise and hinge objectives use, not --objective listwise",
        ),
        (
            [{"prompt": "a", "chosen": "x", "rejected": "y", "margin": "big"}],
            "row 1, column 'margin': 'big' is not a finite",
        ),
        (
            [{"query": "a", "passages": ["x", "y"], "labels": [3, 0]}],
            "row 1: relevance 3 is above 1; --objective pointwise",
        ),
    ],
)
def test_bad_ranking_input_is_one_line_naming_the_row(rows, needle, bert_folder, tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    objective = "pointwise" if "pointwise" in needle else "listwise"
    code, _, err = run_cli(
        capsys,
        "train",
        "--objective",
        objective,
        "--model",
        bert_folder,
        "--train-file",
        data,
        "--output-dir",
        tmp_path / "run",
        *SMALL,
    )
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and needle in err, err
    assert not os.path.exists(tmp_path / "run")


def test_evaluate_computes_a_ranking_runs_metrics_on_a_split_or_a_file(pairwise_run, preference_files, capsys):
    out, _ = pairwise_run
    summary = json.load(open(out / "summary.json"))["metrics"]["test"]
    code, text, err = run_cli(capsys, "evaluate", out, "--split", "test", "--json", "--no-progress")
    assert code == 0, err
    got = json.loads(text.strip().splitlines()[-1])["test"]
    assert set(summary) <= set(got) and "ndcg@10" in got and "pairwise_accuracy" in got
    for k, v in summary.items():  # the run's own test metrics, from the split rebuilt from its spec
        assert got[k] == pytest.approx(v, abs=1e-5), (k, got[k], v)
    code, text, err = run_cli(capsys, "evaluate", out, "--input", preference_files["test"], "--json", "--no-progress")
    assert code == 0 and json.loads(text.strip().splitlines()[-1])["evaluation"] == got, err


def test_rank_refuses_a_classifier(bert_folder, tmp_path, capsys):
    flat = _write(tmp_path / "pairs.csv", [{"query": "a", "passage": "b"}])
    code, _, err = run_cli(capsys, "rank", bert_folder, "--input", flat, "--no-progress")
    assert code == 2 and "needs a one-output model" in err and err.count("\n") == 1


def test_a_ranking_run_checks_its_run_folder_before_loading(preference_files, tmp_path, capsys, monkeypatch):
    import flaxheads.run.program as program

    def never(*a, **k):
        raise AssertionError("the model was loaded before the run folder was checked")

    monkeypatch.setattr(program, "from_pretrained", never)
    plain = tmp_path / "plain"
    plain.write_text("keep me")
    code, _, err = run_cli(
        capsys,
        "train",
        "--objective",
        "pairwise",
        "--model",
        tmp_path,
        "--train-file",
        preference_files["train"],
        "--output-dir",
        plain / "run",
        *SMALL,
    )
    assert code == 2 and err.count("\n") == 1 and "which is a file, not a folder" in err, err
    assert plain.read_text() == "keep me"
