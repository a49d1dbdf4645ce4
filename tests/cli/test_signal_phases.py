"""Signals outside training: SIGTERM / SIGINT while the command loads a model, exports, or imports its
libraries end it in one line naming the phase, exit 143 / 130, and leave no partial output (an export
in progress leaves the previous export, or nothing). Each case is a `flaxheads` process that says
when it reached the phase and then waits there inside a call, as a long load or compile would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from cli_helpers import REPO

pytestmark = pytest.mark.full

# `flaxheads ARGV` whose function FUNC (module.attr) says "ready" and then sleeps, for the signal
_WAITER = textwrap.dedent("""
    import importlib, sys, time
    mod, attr = sys.argv[1].rsplit(".", 1)
    module = importlib.import_module(mod)
    real = getattr(module, attr)
    def wait(*a, **k):
        print("ready", flush=True)
        time.sleep(120)
        return real(*a, **k)
    setattr(module, attr, wait)
    from flaxheads.cli.main import main
    sys.argv = ["flaxheads", *sys.argv[2:]]
    sys.exit(main())
""")


def _signalled(func: str, argv: list[str], sig: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen(
        [sys.executable, "-c", _WAITER, func, *map(str, argv)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    try:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_a_signal_while_the_model_loads_is_one_line(tiny_bert, tmp_path, sig=signal.SIGTERM):
    out = tmp_path / "export"
    got = _signalled(
        "flaxheads.formats.import_model", ["export", "--from", tiny_bert, "--format", "head", "--out", out], sig
    )
    lines = got.stderr.strip().splitlines()
    assert got.returncode == 128 + sig and len(lines) == 1, got.stderr
    assert lines[0].startswith(f"interrupted ({signal.Signals(sig).name}) while loading {tiny_bert}"), lines
    assert os.listdir(tmp_path) == []


def test_a_signal_while_exporting_keeps_the_previous_export(tiny_bert, tmp_path):
    from flaxheads.cli.main import main

    out = tmp_path / "export"
    assert main(["export", "--from", tiny_bert, "--format", "transformers", "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    got = _signalled(
        "flaxheads.interop.files.write_manifest",
        ["export", "--from", tiny_bert, "--format", "transformers", "--out", out, "--overwrite"],
        signal.SIGTERM,
    )
    lines = got.stderr.strip().splitlines()
    assert got.returncode == 143 and len(lines) == 1 and f"while exporting to {out}" in lines[0], got.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert os.listdir(tmp_path) == ["export"]  # the half-written temporary folder is gone


#: How the command starts: its console script (``flaxheads = "flaxheads.cli:entry"``) and ``python -m flaxheads``.
_ENTRIES = {
    "console script": "from flaxheads.cli import entry; sys.exit(entry())",
    "python -m flaxheads": "import runpy; runpy.run_module('flaxheads', run_name='__main__', alter_sys=True)",
}


@pytest.mark.parametrize("entry", sorted(_ENTRIES))
def test_ctrl_c_while_the_command_imports_is_one_line(entry):
    # SIGINT lands while the command imports its libraries (jax, flax, orbax...): its entry guards them
    code = (
        textwrap.dedent("""
        import os, signal, sys, threading
        sys.argv = ["flaxheads", "--help"]
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
        timer.daemon = True
        timer.start()
    """)
        + _ENTRIES[entry]
    )
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    if got.returncode == 0 and "usage: flaxheads" in got.stdout:
        pytest.skip("the import finished before the signal (a warm, fast machine)")
    lines = got.stderr.strip().splitlines()
    assert got.returncode == 130 and len(lines) == 1, got.stderr
    assert (
        lines[0] == "interrupted (SIGINT) while starting (importing its libraries); nothing was written; rerun "
        "the same command"
    ), lines
