"""`flaxheads train` on streamed tables (--stream, or a large file / glob): a run from shards, its
one-line refusals, and two processes, each reading only its rows of every batch, resuming a
single process's checkpoint mid-epoch and training on as that process did."""
import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

from cli_helpers import REPO, SMALL, assert_one_line_error, bert_folder, run_cli, write_csv  # noqa: F401
from flaxheads.cli.main import main


def _shards(tmp_path, n=3, rows=30):
    d = tmp_path / "shards"
    d.mkdir(exist_ok=True)
    for k in range(n):
        write_csv(d / f"part-{k}.csv", rows, seed=k)
    return str(d / "part-*.csv")


@pytest.mark.slow
def test_streamed_run_from_shards(bert_folder, tmp_path, capsys):
    glob = _shards(tmp_path)
    out = tmp_path / "run"
    code, stdout, err = run_cli(capsys, "train", "--model", bert_folder, "--data", glob, "--split", "0.6,0.2,0.2",
                                *SMALL, "--max-steps", "4", "--batch-size", "4", "--eval-limit", "5",
                                "--output-dir", out)
    assert code == 0, err
    assert "read from disk as it trains (streamed), evaluating on a sample of 5 validation examples" in stdout
    cfg = json.loads((out / "config.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    from flaxheads.training import data as D
    from flaxheads.training import streaming as S

    sd = S.open_stream(D.DataConfig(data=glob, split=(0.6, 0.2, 0.2), stream=True))
    counts = sd.counts
    assert cfg["sizes"] == {"train": counts["train"], "validation": 5, "test": counts["test"]}
    assert sum(counts.values()) == 90 and summary["steps"] == 4
    # the whole test split is predicted at the end, once per row
    pred = np.load(out / "predictions.npz")
    labels = [v for _, _, c in S.source_rows(sd.sources["test"]) for v in c.column("label").to_pylist()]
    assert len(pred["test_logits"]) == counts["test"]
    assert pred["test_labels"].tolist() == [cfg["labels"].index(v) for v in labels]

    # `evaluate --split test` rebuilds the run's own (hashed) test split: the run's test metrics again
    code, stdout, err = run_cli(capsys, "evaluate", out, "--split", "test", "--json")
    assert code == 0, err
    again = json.loads(stdout.strip().splitlines()[-1])["test"]
    assert again["accuracy"] == summary["metrics"]["test"]["accuracy"]
    assert again["macro_f1"] == pytest.approx(summary["metrics"]["test"]["macro_f1"])

    for extra, needle in ((["--pack"], "--pack needs the training split in memory"),
                          (["--limit", "10"], "--limit samples a table held in memory"),
                          (["--cache-features"], "streamed data cannot")):
        code, _, err = run_cli(capsys, "train", "--model", bert_folder, "--data", glob, *SMALL, "--max-steps", "1",
                               "--output-dir", tmp_path / "x", *extra)
        assert_one_line_error(code, err, needle)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(folder):
    return {e["step"]: e["loss"] for e in map(json.loads, open(os.path.join(folder, "metrics.jsonl"))) if "loss" in e}


@pytest.mark.slow
def test_two_processes_resume_a_streamed_run_mid_epoch(bert_folder, tmp_path):
    data = write_csv(tmp_path / "d.csv", 40, seed=4)
    run = ["train", "--model", bert_folder, "--data", data, "--stream", "--split", "0.6,0.2,0.2", *SMALL,
           "--max-steps", "9", "--batch-size", "4", "--eval-batch-size", "4", "--log-every", "1",
           "--checkpoint-every", "2", "--keep", "10", "--keep-best-by", "none", "--lr", "1e-3", "--head-lr", "1e-2"]
    single = tmp_path / "single"
    assert main([*run, "--output-dir", str(single)]) == 0
    # the same run on two processes, from the single process's checkpoint at step 4 (mid-epoch: 6 steps per epoch)
    multi = tmp_path / "multi"
    shutil.copytree(single, multi)
    for d in os.listdir(multi / "checkpoints"):
        if d.isdigit() and int(d) > 4:
            shutil.rmtree(multi / "checkpoints" / d)
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1 "
                        "--xla_cpu_collective_call_terminate_timeout_seconds=60"}
    procs = []
    try:
        for pid in range(2):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "flaxheads", *run, "--output-dir", str(multi), "--coordinator-address",
                 f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(pid)],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = [p.communicate(timeout=900)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    assert "resuming from step 4" in logs[0]
    cfg = json.loads((multi / "config.json").read_text())
    assert cfg["devices"]["processes"] == 2 and cfg["devices"]["width"] == 2
    a, b = _losses(single), _losses(multi)
    assert sorted(b) == list(range(1, 10))
    # steps 5..9 (the rest of epoch 0, then epoch 1): each process fed its half of the same batches
    np.testing.assert_allclose([b[s] for s in range(5, 10)], [a[s] for s in range(5, 10)], rtol=1e-5, atol=1e-6)
    assert [b[s] for s in range(1, 5)] == [a[s] for s in range(1, 5)]  # the resumed run kept the log before step 4
    got = np.load(multi / "predictions.npz")["test_logits"]
    want = np.load(single / "predictions.npz")["test_logits"]
    np.testing.assert_allclose(got, want, atol=1e-5)
