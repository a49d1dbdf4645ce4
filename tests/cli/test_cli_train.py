"""`flaxheads train` end to end on a tiny random BERT folder and small files: the run folder, and
every flag whose effect is checked against a run without it (or against scikit-learn / scipy)."""

import json

import numpy as np
import pytest
from cli_helpers import CLASSES, SMALL, assert_one_line_error, run_cli, run_process, train_args, write_csv, write_jsonl
from train_helpers import WORDS

from flaxheads.cli.main import main
from flaxheads.runtime import ComputePlan
from flaxheads.runtime.precision import choose_precision

pytestmark = pytest.mark.full


def _run(*argv) -> None:
    assert main([str(a) for a in argv]) == 0


def _log(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _losses(run) -> list[float]:
    return [e["loss"] for e in _log(run) if "loss" in e]


def _predictions(run) -> tuple[np.ndarray, np.ndarray]:
    p = np.load(run / "predictions.npz")
    return p["test_logits"], p["test_labels"]


def _summary(run) -> dict:
    return json.loads((run / "summary.json").read_text())


def _config(run) -> dict:
    return json.loads((run / "config.json").read_text())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Train / validation / test CSV files (24 / 6 / 6 rows, three classes)."""
    d = tmp_path_factory.mktemp("files")
    return {
        "train": write_csv(d / "train.csv", 24, seed=1),
        "validation": write_csv(d / "val.csv", 6, seed=2),
        "test": write_csv(d / "test.csv", 6, seed=3),
    }


def _file_args(files, out, *extra):
    return [
        "train",
        "--train-file",
        files["train"],
        "--validation-file",
        files["validation"],
        "--test-file",
        files["test"],
        "--output-dir",
        out,
        *SMALL,
        "--max-steps",
        "4",
        "--batch-size",
        "4",
        "--log-every",
        "1",
        "--checkpoint-every",
        "0",
        "--lr",
        "1e-3",
        "--head-lr",
        "1e-2",
        *extra,
    ]


@pytest.fixture(scope="module")
def baseline(bert_folder, files, tmp_path_factory):
    """One run with the defaults the flag tests change one at a time."""
    out = tmp_path_factory.mktemp("baseline") / "run"
    _run(*_file_args(files, out, "--model", bert_folder))
    return out


def test_end_to_end_run_folder(bert_folder, tmp_path, capsys):
    data = write_csv(tmp_path / "d.csv", 45)
    out = tmp_path / "run"
    code, printed, _ = run_cli(
        capsys,
        *train_args(
            bert_folder,
            data,
            out,
            "--bucket-step",
            "8",
            "--epochs",
            "2",
            "--batch-size",
            "12",
            "--lr",
            "5e-3",
            "--head-lr",
            "1e-2",
            "--log-every",
            "2",
            "--checkpoint-every",
            "0",
        ),
    )
    assert code == 0
    for name in (
        "config.json",
        "metrics.jsonl",
        "curve.png",
        "confusion_matrix.png",
        "eval.txt",
        "summary.json",
        "predictions.npz",
    ):
        assert (out / name).is_file(), name
    # --checkpoint-every 0: nothing saved along the way, the last step saved (the run holds its model)
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["6"]
    cfg = _config(out)
    assert cfg["labels"] == ["business", "politics", "sport"] and cfg["num_labels"] == 3  # folder had 2: resized
    assert cfg["sizes"] == {"train": 36, "validation": 6, "test": 3}
    assert cfg["optimizer"]["learning_rate"] == 5e-3 and cfg["buckets"] == [8, 16]
    assert "36 train / 6 validation / 3 test examples" in printed
    lines = _log(out)
    train = [x for x in lines if "loss" in x]
    assert [x["step"] for x in train] == [2, 4, 6]
    assert all(np.isfinite(x["loss"]) and x["lr_backbone"] >= 0 for x in train)
    assert sum("eval" in x for x in lines) == 2  # one validation per epoch (the last one at the end)
    summary = _summary(out)
    assert summary["steps"] == 6 and 1 <= summary["train_compiles"] <= 2
    assert set(summary["metrics"]) == {"validation", "test"}
    assert "precision" in printed and "politics" in printed and "run folder" in printed
    logits, labels = _predictions(out)
    assert summary["metrics"]["test"]["accuracy"] == pytest.approx(float((logits.argmax(-1) == labels).mean()))
    assert summary["metrics"]["test"]["accuracy"] >= 0.6  # separable toy data: well above chance (1/3)


def test_frozen_backbone_and_pmap(bert_folder, tmp_path):
    out = tmp_path / "probe"
    _run(
        *train_args(
            bert_folder,
            write_csv(tmp_path / "d.csv", 30, seed=1),
            out,
            "--freeze-backbone",
            "--max-steps",
            "4",
            "--batch-size",
            "8",
            "--eval-batch-size",
            "8",
            "--parallel",
            "pmap",
            "--checkpoint-every",
            "0",
        )
    )
    cfg = _config(out)
    assert cfg["optimizer"]["freeze_backbone"] and cfg["optimizer"]["learning_rate"] == 5e-3
    assert cfg["devices"]["width"] == 4


def test_validation_file_is_evaluated(baseline):
    cfg = _config(baseline)
    assert cfg["sizes"] == {"train": 24, "validation": 6, "test": 6}
    evals = [e for e in _log(baseline) if "eval" in e]
    assert evals and all(set(e["eval"]) == {"validation"} for e in evals)


def test_mesh_equals_one_device(bert_folder, files, baseline, tmp_path):
    """Data parallel over the 4 test devices with jit + NamedSharding: the same run as on one device."""
    out = tmp_path / "mesh"
    _run(*_file_args(files, out, "--model", bert_folder, "--parallel", "mesh"))
    assert _config(out)["devices"]["width"] == 4 and _config(out)["devices"]["parallel"] == "mesh"
    np.testing.assert_allclose(_losses(out), _losses(baseline), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_predictions(out)[0], _predictions(baseline)[0], atol=1e-5)


def test_pack_trains_the_same_batches_with_less_padding(bert_folder, files, baseline, tmp_path):
    """--pack: the same examples per step in fewer padded slots. The head's dropout draws follow the
    slot layout, so losses agree to dropout noise here (tests/data/test_packing.py checks
    equality without dropout)."""
    out = tmp_path / "packed"
    _run(*_file_args(files, out, "--model", bert_folder, "--pack"))
    assert _config(out)["train"]["pack"] is True
    np.testing.assert_allclose(_losses(out), _losses(baseline), atol=0.02)
    padding = [[e["padding"] for e in _log(run) if "padding" in e] for run in (out, baseline)]
    # a batch whose texts do not fit two to a row packs as it was; the others lose padding
    assert len(padding[0]) == len(padding[1]) > 0 and all(p <= b for p, b in zip(*padding)), padding
    assert sum(padding[0]) < sum(padding[1]), padding


def test_short_texts_pack_unless_told_not_to(bert_folder, tmp_path, capsys):
    """Neither --pack nor --no-pack: texts of 2-5 tokens in 64-token buckets pack on their own
    (said on the first line, recorded in config.json); --no-pack keeps them padded."""
    words = ["good", "bad", "fine", "awful", "nice great", "poor sad"]
    data = tmp_path / "short.csv"
    data.write_text(
        "text,label\n" + "".join(f"{words[i % 6]},{'pos' if i % 6 in (0, 2, 4) else 'neg'}\n" for i in range(60))
    )
    common = (
        "train",
        "--data",
        str(data),
        "--model",
        bert_folder,
        "--max-length",
        "64",
        "--bucket-step",
        "64",
        "--max-steps",
        "2",
        "--batch-size",
        "8",
        "--checkpoint-every",
        "0",
        "--no-progress",
    )
    code, printed, _ = run_cli(capsys, *common, "--output-dir", str(tmp_path / "auto"))
    assert code == 0 and "short texts packed" in printed
    assert _config(tmp_path / "auto")["train"]["pack"] is True
    code, printed, _ = run_cli(capsys, *common, "--no-pack", "--output-dir", str(tmp_path / "off"))
    assert code == 0 and "packed" not in printed
    assert _config(tmp_path / "off")["train"]["pack"] is False


def test_bf16_runs_the_backbone_in_bfloat16(bert_folder, files, baseline, tmp_path):
    out = tmp_path / "bf16"
    _run(*_file_args(files, out, "--model", bert_folder, "--bf16"))
    got, want = np.asarray(_losses(out)), np.asarray(_losses(baseline))
    assert _config(out)["bf16"] is True and _config(out)["precision"] == {"name": "bfloat16", "reason": "asked for"}
    assert not np.array_equal(got, want)  # bfloat16 activations round differently
    np.testing.assert_allclose(got, want, atol=0.05)  # ... but compute the same function


def test_auto_precision_is_resolved_for_this_host_and_recorded(bert_folder, files, tmp_path):
    """--precision auto (the default outside the tests) records what it chose and why."""
    out = tmp_path / "auto"
    _run(*_file_args(files, out, "--model", bert_folder, "--precision", "auto", "--max-steps", "1"))
    want = choose_precision("auto")
    assert _config(out)["precision"] == {"name": want.name, "reason": want.reason}
    assert _config(out)["bf16"] is (want.name == "bfloat16")
    # the one plan of the run, in its report: this process's flags, the precision it chose
    assert _config(out)["compute_plan"] == ComputePlan.for_host(precision="auto").describe()


def test_label_smoothing_changes_the_loss(bert_folder, files, baseline, tmp_path):
    """Same params and batch at step 1: smoothing mixes in the mean -log p over classes, which for
    near-uniform predictions at init is about log(3), close to but not the plain cross-entropy."""
    out = tmp_path / "smooth"
    _run(*_file_args(files, out, "--model", bert_folder, "--label-smoothing", "0.3"))
    assert _config(out)["train"]["loss_options"] == {"label_smoothing": 0.3}
    got, want = _losses(out)[0], _losses(baseline)[0]
    assert got != want
    assert abs(got - want) < 0.3


def test_gradient_accumulation_equals_one_big_batch(bert_folder, tmp_path):
    """8 training rows: 2 micro-batches of 4 accumulated = 1 batch of 8; 2 plain steps of 4 differ.
    The preset head of the tiny BERT has no dropout, so nothing random tells the runs apart."""
    train = write_csv(tmp_path / "tr.csv", 8, seed=4)
    test = write_csv(tmp_path / "te.csv", 6, seed=5)

    def run(name, *extra):
        _run(
            "train",
            "--model",
            bert_folder,
            "--train-file",
            train,
            "--test-file",
            test,
            "--pooler",
            "preset",
            "--head",
            "preset",
            "--output-dir",
            tmp_path / name,
            *SMALL,
            "--checkpoint-every",
            "0",
            "--lr",
            "1e-2",
            *extra,
        )
        return _predictions(tmp_path / name)[0]

    one_big = run("big", "--batch-size", "8", "--max-steps", "1")
    accumulated = run("acc", "--batch-size", "4", "--accumulation-steps", "2", "--max-steps", "2")
    two_small = run("small", "--batch-size", "4", "--max-steps", "2")
    np.testing.assert_allclose(accumulated, one_big, atol=2e-5)
    assert np.abs(two_small - one_big).max() > 1e-3


def test_text_pair_column_is_read(bert_folder, tmp_path):
    """The label is in the second text only: a model that sees the pairs learns it, one that
    reads the first text alone stays at chance."""
    rng = np.random.default_rng(0)
    rows = ["text,pair,label"]
    for i in range(60):
        c = list(CLASSES)[i % 3]
        noise = " ".join(rng.choice(WORDS[:24], size=5))
        rows.append(f"{noise},{' '.join(rng.choice(CLASSES[c], size=5))},{c}")
    (tmp_path / "pairs.csv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "pairs"
    _run(
        *train_args(
            bert_folder,
            tmp_path / "pairs.csv",
            out,
            "--text-pair-column",
            "pair",
            "--split",
            "0.6,0.2,0.2",
            "--epochs",
            "4",
            "--batch-size",
            "12",
            "--lr",
            "5e-3",
            "--head-lr",
            "1e-2",
            "--checkpoint-every",
            "0",
        )
    )
    assert _config(out)["data"]["text_pair_column"] == "pair"
    assert _summary(out)["metrics"]["test"]["accuracy"] >= 0.8


def test_mlp_head_with_hidden_widths(bert_folder, files, tmp_path):
    out = tmp_path / "mlp"
    _run(*_file_args(files, out, "--model", bert_folder, "--head", "mlp", "--head-hidden", "24,12", "--max-steps", "1"))
    cfg = _config(out)
    h = 32  # hidden width of the tiny BERT; mean pooling has no params
    assert cfg["params"]["head"] == (h * 24 + 24) + (24 * 12 + 12) + (12 * 3 + 3)
    assert "24" in json.dumps(cfg["head_config"]) and "12" in json.dumps(cfg["head_config"])


def test_problem_type_overrides_the_guess(bert_folder, tmp_path):
    """Integer labels guess single-label; --problem-type regression trains one output on them."""
    rng = np.random.default_rng(0)
    (tmp_path / "ints.csv").write_text(
        "text,label\n" + "".join(f"{' '.join(rng.choice(WORDS, 5))},{i % 3}\n" for i in range(24))
    )
    out = tmp_path / "reg"
    _run(
        *train_args(
            bert_folder,
            tmp_path / "ints.csv",
            out,
            "--problem-type",
            "regression",
            "--max-steps",
            "2",
            "--checkpoint-every",
            "0",
        )
    )
    cfg = _config(out)
    assert cfg["problem_type"] == "regression" and cfg["num_labels"] == 1
    assert {"mse", "pearson", "spearman"} <= set(_summary(out)["metrics"]["test"])


def test_multi_label_metrics_match_scikit_learn(bert_folder, tmp_path):
    from sklearn.metrics import accuracy_score, f1_score

    rng = np.random.default_rng(0)
    rows = [
        {"text": " ".join(rng.choice(WORDS, 5)), "label": [x for x in ("x", "y", "z") if rng.random() < 0.5]}
        for _ in range(40)
    ]
    out = tmp_path / "ml"
    _run(
        *train_args(
            bert_folder,
            write_jsonl(tmp_path / "ml.jsonl", rows),
            out,
            "--max-steps",
            "3",
            "--checkpoint-every",
            "0",
            "--threshold",
            "0.45",
        )
    )
    assert _config(out)["problem_type"] == "multi_label_classification"
    logits, labels = _predictions(out)
    pred = 1 / (1 + np.exp(-logits.astype(np.float64))) >= 0.45
    got = _summary(out)["metrics"]["test"]
    y = labels.astype(bool)
    assert got["micro_f1"] == pytest.approx(f1_score(y, pred, average="micro", zero_division=0), abs=1e-6)
    assert got["macro_f1"] == pytest.approx(f1_score(y, pred, average="macro", zero_division=0), abs=1e-6)
    assert got["subset_accuracy"] == pytest.approx(accuracy_score(y, pred), abs=1e-6)


def test_regression_metrics_match_scipy(bert_folder, tmp_path):
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import mean_squared_error

    rng = np.random.default_rng(0)
    (tmp_path / "r.csv").write_text(
        "text,score\n" + "".join(f"{' '.join(rng.choice(WORDS, 5))},{rng.normal():.3f}\n" for _ in range(40))
    )
    out = tmp_path / "r"
    _run(
        *train_args(
            bert_folder,
            tmp_path / "r.csv",
            out,
            "--label-column",
            "score",
            "--max-steps",
            "3",
            "--checkpoint-every",
            "0",
        )
    )
    logits, labels = _predictions(out)
    pred = logits.reshape(-1).astype(np.float64)
    got = _summary(out)["metrics"]["test"]
    assert got["mse"] == pytest.approx(mean_squared_error(labels, pred), rel=1e-5)
    assert got["pearson"] == pytest.approx(pearsonr(pred, labels)[0], abs=1e-5)
    assert got["spearman"] == pytest.approx(spearmanr(pred, labels)[0], abs=1e-5)


def test_keep_best_by(bert_folder, tmp_path, capsys):
    """`none` keeps no best step; `validation/mse` keeps the step with the lowest validation MSE
    (lower is better for it); a metric the task does not have is refused before training."""
    from flaxheads.checkpoint import list_checkpoints

    rng = np.random.default_rng(1)
    data = tmp_path / "r.csv"
    data.write_text(
        "text,score\n" + "".join(f"{' '.join(rng.choice(WORDS, 5))},{rng.normal():.3f}\n" for _ in range(30))
    )
    common = [
        "--label-column",
        "score",
        "--max-steps",
        "5",
        "--eval-every",
        "1",
        "--batch-size",
        "4",
        "--lr",
        "3e-2",
        "--keep",
        "1",
    ]
    code, _, err = run_cli(
        capsys, *train_args(bert_folder, data, tmp_path / "bad", *common, "--keep-best-by", "validation/accuracy")
    )
    assert_one_line_error(code, err, "--keep-best-by 'validation/accuracy'", "mse, pearson, spearman")
    _run(*train_args(bert_folder, data, tmp_path / "none", *common, "--keep-best-by", "none"))
    rows = list_checkpoints(tmp_path / "none")
    assert [r["step"] for r in rows] == [5] and not any(r["best"] for r in rows)
    _run(*train_args(bert_folder, data, tmp_path / "mse", *common, "--keep-best-by", "validation/mse"))
    mse = {e["step"]: e["eval"]["validation"]["mse"] for e in _log(tmp_path / "mse") if "eval" in e}
    assert len(set(mse.values())) > 1  # the evaluations differ, so "lowest" picks one step
    best = min(mse, key=mse.get)
    rows = list_checkpoints(tmp_path / "mse")
    assert {r["step"] for r in rows} == {best, 5}  # the latest and the best
    assert [r["step"] for r in rows if r["best"]] == [best]


def test_label_only_in_test_file(bert_folder, tmp_path, capsys):
    train = write_csv(tmp_path / "train.csv", 12)
    test = tmp_path / "test.csv"
    test.write_text("text,label\nfilm music actor,entertainment\n")
    code, _, err = run_cli(
        capsys,
        "train",
        "--model",
        bert_folder,
        "--train-file",
        train,
        "--test-file",
        test,
        "--no-progress",
        "--output-dir",
        tmp_path / "r",
    )
    assert_one_line_error(
        code, err, "test.csv: row 1, column 'label': label 'entertainment' appears only in the test split"
    )


def test_module_and_help():
    """`python -m flaxheads train` is the same program; its help names the flags."""
    out = run_process("train", "--help", timeout=300)
    assert out.returncode == 0 and "bbc_news" in out.stdout
    for flag in (
        "--data",
        "--freeze-backbone",
        "--parallel",
        "--coordinator-address",
        "--max-length",
        "--bf16",
        "--accumulation-steps",
        "--output-dir",
        "--keep-best-by",
    ):
        assert flag in out.stdout


def test_star_ratings_train_as_their_classes_and_label_ids_keeps_ids(bert_folder, tmp_path):
    """Integer labels 1-3 are three classes named by value; --label-ids makes them ids 0..3."""
    rows = ["text,label"] + [f"{w} {w},{1 + i % 3}" for i, w in enumerate(["alpha", "beta", "gamma"] * 4)]
    data = tmp_path / "stars.csv"
    data.write_text("\n".join(rows) + "\n")
    for extra, names in (((), ["1", "2", "3"]), (("--label-ids",), ["0", "1", "2", "3"])):
        out = tmp_path / f"run{len(extra)}"
        _run(
            "train",
            "--model",
            bert_folder,
            "--train-file",
            data,
            "--output-dir",
            out,
            *SMALL,
            "--max-steps",
            "1",
            "--batch-size",
            "4",
            "--checkpoint-every",
            "0",
            *extra,
        )
        assert _config(out)["labels"] == names and _config(out)["num_labels"] == len(names)
