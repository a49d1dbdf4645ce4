"""The `train` program end to end on a tiny random BERT folder and small CSV files."""
import json
import subprocess
import sys

import numpy as np
import pytest

from flaxheads.cli.train import build_parser, main
from train_helpers import WORDS, tiny_bert_folder

CLASSES = {"business": WORDS[32:38], "sport": WORDS[38:43], "politics": WORDS[48:53]}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_bert_folder(tmp_path_factory.mktemp("cli_bert"), num_labels=2)


def _csv(path, n, seed=0, classes=CLASSES):
    rng = np.random.default_rng(seed)
    lines = ["text,label"]
    for i in range(n):
        c = list(classes)[i % len(classes)]
        lines.append(" ".join(rng.choice(classes[c], size=int(rng.integers(3, 12)))) + f",{c}")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_end_to_end_run_folder(folder, tmp_path, capsys):
    data = _csv(tmp_path / "d.csv", 45)
    out = tmp_path / "run"
    rc = main(["--model", folder, "--data", data, "--max-length", "16", "--bucket-step", "8", "--epochs", "2",
               "--batch-size", "12", "--lr", "5e-3", "--head-lr", "1e-2", "--output-dir", str(out),
               "--no-progress", "--log-every", "2", "--checkpoint-every", "0"])
    assert rc == 0
    printed = capsys.readouterr().out
    for name in ("config.json", "metrics.jsonl", "curve.png", "confusion_matrix.png", "eval.txt", "summary.json"):
        assert (out / name).is_file(), name
    assert not (out / "checkpoints").exists()  # --checkpoint-every 0 leaves no empty folder
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["labels"] == ["business", "politics", "sport"] and cfg["num_labels"] == 3  # folder had 2: resized
    assert cfg["sizes"] == {"train": 36, "validation": 6, "test": 3}
    assert cfg["optimizer"]["learning_rate"] == 5e-3 and cfg["buckets"] == [8, 16]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if "loss" in x]
    assert [x["step"] for x in train] == [2, 4, 6]
    assert all(np.isfinite(x["loss"]) and x["lr_backbone"] >= 0 for x in train)
    assert sum("eval" in x for x in lines) == 2  # one validation per epoch (the last one at the end)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and 1 <= summary["train_compiles"] <= 2
    assert set(summary["metrics"]) == {"validation", "test"}
    assert "precision" in printed and "politics" in printed and "run folder" in printed
    # separable toy data: well above chance (1/3) after 6 steps
    assert summary["metrics"]["test"]["accuracy"] >= 0.6


def test_frozen_backbone_mode_and_pmap(folder, tmp_path):
    data = _csv(tmp_path / "d.csv", 30, seed=1)
    out = tmp_path / "probe"
    rc = main(["--model", folder, "--data", data, "--max-length", "16", "--freeze-backbone", "--max-steps", "4",
               "--batch-size", "8", "--eval-batch-size", "8", "--parallel", "pmap", "--output-dir", str(out),
               "--no-progress", "--checkpoint-every", "0"])
    assert rc == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["optimizer"]["freeze_backbone"] and cfg["optimizer"]["learning_rate"] == 5e-3
    assert cfg["devices"]["width"] == 4


@pytest.mark.parametrize("make,args,match", [
    (lambda p: _csv(p / "d.csv", 12), ["--label-column", "category"], r"d\.csv: no column 'category'"),
    (lambda p: (p / "d.csv").write_text("text,label\nstock market,business\n,sport\n") and str(p / "d.csv"), [],
     r"d\.csv: row 2, column 'text': text is missing"),
    (lambda p: (p / "d.csv").write_text("text,label\n") and str(p / "d.csv"), [], r"no rows \(empty dataset\)"),
])
def test_bad_input_exits_2_with_clear_message(folder, tmp_path, capsys, make, args, match):
    import re

    data = make(tmp_path)
    rc = main(["--model", folder, "--data", data, "--output-dir", str(tmp_path / "r"), "--no-progress", *args])
    assert rc == 2
    assert re.search(match, capsys.readouterr().err)


def test_label_only_in_test_file(folder, tmp_path, capsys):
    train = _csv(tmp_path / "train.csv", 12)
    test = tmp_path / "test.csv"
    test.write_text("text,label\nfilm music actor,entertainment\n")
    rc = main(["--model", folder, "--train-file", train, "--test-file", str(test), "--no-progress",
               "--output-dir", str(tmp_path / "r")])
    assert rc == 2
    assert "test.csv: row 1, column 'label': label 'entertainment' appears only in the test split" in \
        capsys.readouterr().err


def test_bad_model_folder(tmp_path):
    with pytest.raises(SystemExit, match="is not a folder"):
        main(["--model", str(tmp_path / "nope"), "--data", "bbc_news"])


def test_help_is_usable():
    text = build_parser().format_help()
    for flag in ("--data", "--freeze-backbone", "--parallel", "--coordinator-address", "--max-length", "--bf16",
                 "--accumulation-steps", "--output-dir"):
        assert flag in text
    out = subprocess.run([sys.executable, "-m", "flaxheads", "train", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "bbc_news" in out.stdout


def test_multi_label_jsonl_and_regression_csv(folder, tmp_path):
    rng = np.random.default_rng(0)
    with open(tmp_path / "ml.jsonl", "w") as f:
        for _ in range(24):
            labels = [x for x in ("x", "y", "z") if rng.random() < 0.5]
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS, 5)), "label": labels}) + "\n")
    rc = main(["--model", folder, "--data", str(tmp_path / "ml.jsonl"), "--max-steps", "2", "--max-length", "16",
               "--no-progress", "--output-dir", str(tmp_path / "ml"), "--checkpoint-every", "0"])
    assert rc == 0
    s = json.loads((tmp_path / "ml" / "summary.json").read_text())
    assert json.loads((tmp_path / "ml" / "config.json").read_text())["problem_type"] == "multi_label_classification"
    assert {"micro_f1", "macro_f1"} <= set(s["metrics"]["test"])
    (tmp_path / "r.csv").write_text("text,score\n" + "".join(
        f"{' '.join(rng.choice(WORDS, 5))},{rng.normal():.3f}\n" for _ in range(24)))
    rc = main(["--model", folder, "--data", str(tmp_path / "r.csv"), "--label-column", "score", "--max-steps", "2",
               "--max-length", "16", "--no-progress", "--output-dir", str(tmp_path / "r"), "--checkpoint-every", "0"])
    assert rc == 0
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert {"mse", "pearson", "spearman"} <= set(s["metrics"]["test"])
