"""`flaxheads train --coordinator-address/--num-processes/--process-id`: two processes with one
CPU device each, joined by jax.distributed over loopback, train one run together. It is the same
run as one process trains on one device (each process feeds its half of every global batch)."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from cli_helpers import REPO, SMALL, bert_folder, write_csv  # noqa: F401
from flaxheads.cli.main import main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_the_single_process_run(bert_folder, tmp_path):
    files = {"train": write_csv(tmp_path / "tr.csv", 20, seed=1), "validation": write_csv(tmp_path / "va.csv", 6, seed=2),
             "test": write_csv(tmp_path / "te.csv", 6, seed=3)}
    run = ["train", "--model", bert_folder, "--train-file", files["train"], "--validation-file", files["validation"],
           "--test-file", files["test"], *SMALL, "--max-steps", "3", "--batch-size", "4", "--eval-batch-size", "4",
           "--log-every", "1", "--checkpoint-every", "0", "--lr", "1e-3", "--head-lr", "1e-2"]
    assert main([*run, "--output-dir", str(tmp_path / "single")]) == 0

    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1 --xla_cpu_collective_call_terminate_timeout_seconds=60"}
    multi = str(tmp_path / "multi")
    procs = []
    try:
        for pid in range(2):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "flaxheads", *run, "--output-dir", multi, "--coordinator-address",
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
    assert "run folder" in logs[0] and "run folder" not in logs[1]  # process 0 writes and reports

    cfg = json.loads(open(os.path.join(multi, "config.json")).read())
    assert cfg["devices"]["processes"] == 2 and cfg["devices"]["count"] == 2
    assert cfg["devices"]["parallel"] == "mesh" and cfg["devices"]["width"] == 2

    def losses(folder):
        return [json.loads(x)["loss"] for x in open(os.path.join(folder, "metrics.jsonl")) if '"loss"' in x]

    np.testing.assert_allclose(losses(multi), losses(tmp_path / "single"), rtol=1e-5, atol=1e-6)
    got = np.load(os.path.join(multi, "predictions.npz"))["test_logits"]
    want = np.load(tmp_path / "single" / "predictions.npz")["test_logits"]
    np.testing.assert_allclose(got, want, atol=1e-5)
