"""Shared pieces of the command-line tests: a tiny random BERT folder, small data files, and
running ``flaxheads`` in-process or as a separate process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
from train_helpers import WORDS

from flaxheads.cli.main import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(REPO, "tests")
#: Three classes with their own words: a tiny model learns them in a few steps.
CLASSES = {"business": WORDS[32:38], "sport": WORDS[38:43], "politics": WORDS[48:53]}
#: Flags that keep a run small: short texts, one bucket, no progress bar.
SMALL = ["--max-length", "16", "--bucket-step", "16", "--no-progress"]


def write_csv(path, n: int, seed: int = 0, classes=CLASSES, pair: bool = False) -> str:
    """``n`` rows ``text[,pair],label`` cycling through the classes (words of the row's class)."""
    rng = np.random.default_rng(seed)
    lines = ["text,pair,label" if pair else "text,label"]
    for i in range(n):
        c = list(classes)[i % len(classes)]
        words = lambda: " ".join(rng.choice(classes[c], size=int(rng.integers(3, 9))))  # noqa: E731
        lines.append(f"{words()},{words()},{c}" if pair else f"{words()},{c}")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """``flaxheads ARGV`` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_process(*argv, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m flaxheads ARGV`` as a separate process (what a user's shell runs)."""
    return subprocess.run(
        [sys.executable, "-m", "flaxheads", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def error_lines(err: str) -> list[str]:
    """The lines of stderr that are not warnings."""
    return [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("warning:")]


def assert_one_line_error(code: int, err: str, *needles: str) -> str:
    """Exit 2 and exactly one ``error: ...`` line (no traceback) that contains every needle."""
    lines = error_lines(err)
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def train_args(model: str, data: str, out, *extra) -> list[str]:
    return ["train", "--model", model, "--data", data, "--output-dir", str(out), *SMALL, *map(str, extra)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_processes(argv, out) -> list[str]:
    """``flaxheads ARGV --output-dir OUT`` as two processes of one JAX job over loopback, one CPU device
    each: their logs (both must exit 0)."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1 --xla_cpu_collective_call_terminate_timeout_seconds=60",
    }
    port, procs = free_port(), []
    try:
        for pid in range(2):
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "flaxheads",
                        *map(str, argv),
                        "--output-dir",
                        str(out),
                        "--coordinator-address",
                        f"127.0.0.1:{port}",
                        "--num-processes",
                        "2",
                        "--process-id",
                        str(pid),
                    ],
                    cwd=REPO,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        logs = [p.communicate(timeout=900)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return logs
