"""`flaxheads train --coordinator-address/--num-processes/--process-id`: two processes with one
CPU device each, joined by jax.distributed over loopback, train one run together. It is the same
run as one process trains on one device (each process feeds its half of every global batch)."""

import importlib.util
import json
import os

import numpy as np
import pytest
from cli_helpers import SMALL, two_processes, write_csv

from flaxheads.cli.main import main

pytestmark = [pytest.mark.full, pytest.mark.serial]


@pytest.mark.slow
def test_two_processes_train_the_single_process_run(bert_folder, tmp_path):
    files = {
        "train": write_csv(tmp_path / "tr.csv", 20, seed=1),
        "validation": write_csv(tmp_path / "va.csv", 6, seed=2),
        "test": write_csv(tmp_path / "te.csv", 6, seed=3),
    }
    run = [
        "train",
        "--model",
        bert_folder,
        "--train-file",
        files["train"],
        "--validation-file",
        files["validation"],
        "--test-file",
        files["test"],
        *SMALL,
        "--max-steps",
        "3",
        "--batch-size",
        "4",
        "--eval-batch-size",
        "4",
        "--log-every",
        "1",
        "--checkpoint-every",
        "0",
        "--lr",
        "1e-3",
        "--head-lr",
        "1e-2",
    ]
    assert main([*run, "--output-dir", str(tmp_path / "single")]) == 0

    multi = str(tmp_path / "multi")
    logs = two_processes(run, multi)
    assert "run folder" in logs[0] and "run folder" not in logs[1]  # process 0 writes and reports

    cfg = json.loads(open(os.path.join(multi, "config.json")).read())
    assert cfg["devices"]["processes"] == 2 and cfg["devices"]["count"] == 2
    assert cfg["devices"]["parallel"] == "mesh" and cfg["devices"]["width"] == 2

    def losses(folder):
        return [json.loads(x)["loss"] for x in open(os.path.join(folder, "metrics.jsonl")) if '"loss"' in x]

    np.testing.assert_allclose(losses(multi), losses(tmp_path / "single"), rtol=1e-5, atol=1e-6)
    # process 0 alone writes the event files: one file, the log's losses
    assert len(os.listdir(os.path.join(multi, "tensorboard"))) == 1
    if importlib.util.find_spec("tensorboard") is not None:  # the reader (a dev dependency of the newest stack)
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(os.path.join(multi, "tensorboard"))
        acc.Reload()
        np.testing.assert_array_equal([e.value for e in acc.Scalars("train/loss")], np.float32(losses(multi)))
    got = np.load(os.path.join(multi, "predictions.npz"))["test_logits"]
    want = np.load(tmp_path / "single" / "predictions.npz")["test_logits"]
    np.testing.assert_allclose(got, want, atol=1e-5)
