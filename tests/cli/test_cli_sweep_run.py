"""`train --cache-features --sweep K` stops at --max-steps and writes the run folder every run writes
(config.json, metrics.jsonl, the marker), so `evaluate RUN --split test` scores its saved head on
the run's own test split; stopping at exactly one epoch's steps gives the heads one epoch gives."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from flaxheads.cli.main import main

pytestmark = pytest.mark.full


def test_sweep_run_honours_max_steps_and_evaluates(tmp_path, capsys):
    from test_resume import _data_csv
    from train_helpers import tiny_bert_folder

    model = tiny_bert_folder(tmp_path / "bert")
    data = _data_csv(tmp_path / "data.csv")
    run = tmp_path / "run"
    common = [
        "--model",
        model,
        "--data",
        data,
        "--split",
        "0.6,0.2,0.2",
        "--cache-features",
        "--sweep",
        "2",
        "--batch-size",
        "4",
        "--max-length",
        "16",
        "--no-progress",
    ]
    assert main(["train", *common, "--max-steps", "4", "--output-dir", str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and (run / "checkpoints" / "4").is_dir()  # 6 batches an epoch: stopped inside it
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["max_steps"] == 4 and config["data"]["data"] == data and (run / ".flaxheads").is_file()
    log = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert log[0]["step"] == 4 and "loss" in log[0] and log[-1]["final"] == summary["metrics"]
    capsys.readouterr()
    assert main(["evaluate", str(run), "--split", "test", "--json"]) == 0
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    np.testing.assert_allclose(scored["test"]["accuracy"], summary["metrics"]["test"]["accuracy"])
    np.testing.assert_allclose(scored["test"]["macro_f1"], summary["metrics"]["test"]["macro_f1"])


def test_sweep_max_steps_of_one_epoch_is_that_epoch(tmp_path):
    from train_helpers import random_split, tiny_bert_folder

    from flaxheads import from_pretrained
    from flaxheads.training.features import cache_features
    from flaxheads.training.sweep import steps_per_epoch, sweep, sweep_variants

    model = from_pretrained(tiny_bert_folder(tmp_path / "bert"), num_labels=3)
    cache = cache_features(model, model.params["backbone"], random_split(20), batch_size=8, buckets=(16, 32))
    variants = sweep_variants(2, 1e-2, 0.01, 0)
    spe = steps_per_epoch(cache, 4)
    one = sweep(model, cache, variants, epochs=1, batch_size=4)
    cut = sweep(model, cache, variants, epochs=3, batch_size=4, max_steps=spe)
    assert cut.steps == one.steps == spe and cut.losses.shape == one.losses.shape
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(cut.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
