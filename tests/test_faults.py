"""Faults during `python -m flaxheads train`, and that rerunning the same command ends bitwise where an
uninterrupted run ends.

Preemption: SIGTERM / SIGINT finish the step in flight, checkpoint it, print one line and exit 143 / 130;
a second signal during that save stops at once with the previous checkpoint intact. A disk that stops
taking the checkpoints (a file size limit: EFBIG, as a full disk gives ENOSPC) ends the run with one
line and exit 1, the previous checkpoint intact and still the latest."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from test_resume import REPO, _assert_bitwise, _data_csv, _env, _items, _log, _train_args

pytestmark = pytest.mark.full

#: The signal is sent once the run has finished this step (steps of 4 of 24 examples; evaluations
#: and their checkpoints at steps 4, 8, ...), so the run stops after step WAIT_AT + 1 = 6.
WAIT_AT = 5

# `flaxheads train` that says when it reached a step (and, with SAVE_WAIT, a preemption save) and
# then waits there for the test's signal: the signal lands at a known point, no sleeps in the test.
_WAITER = textwrap.dedent("""
    import os, resource, signal, sys, time
    import flaxheads.training.loop as T
    import flaxheads.cli.train as C
    from flaxheads.checkpoint import RunCheckpointer

    def wait_for_signal(label):
        got, prev = [], {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        def note(s, f):
            got.append(s)
            for k, h in prev.items():
                signal.signal(k, h)
            prev[s](s, f)
        for s in prev:
            signal.signal(s, note)
        print(label, flush=True)
        deadline = time.monotonic() + 120
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)

    K = int(os.environ["WAIT_AT"])
    OUT = sys.argv[sys.argv.index("--output-dir") + 1]
    real_fit, real_save = T.fit, RunCheckpointer.save

    def fit(*a, callbacks=(), **kw):
        def reached(state, step, m):
            if step == K:
                wait_for_signal(f"REACHED {K}")
        hook = limit if os.environ.get("LIMIT") else reached
        return real_fit(*a, callbacks=[*callbacks, T.hooks(on_step_end=hook)], **kw)

    def limit(state, step, m):
        if step == K:  # from here on files stop growing past LIMIT bytes (step 4's save complete first)
            while not os.path.isdir(os.path.join(OUT, "checkpoints", "4")):
                time.sleep(0.01)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
            lim = int(os.environ["LIMIT"])
            resource.setrlimit(resource.RLIMIT_FSIZE, (lim, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    def save(self, step, *a, **kw):
        if os.environ.get("SAVE_WAIT") and step == K + 1:
            wait_for_signal(f"SAVING {step}")
        return real_save(self, step, *a, **kw)

    T.fit, RunCheckpointer.save = fit, save
    sys.exit(C.main(sys.argv[1:]))
""")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from train_helpers import tiny_bert_folder

    root = tmp_path_factory.mktemp("preempt")
    model = tiny_bert_folder(root / "bert", dropout=0.1)  # dropout on: the resumed keys must match too
    data = _data_csv(root / "data.csv")
    script = root / "waiter.py"
    script.write_text(_WAITER)
    return root, model, data, str(script), _env(root / "jax-cache")


def _signalled(setup, name, signals, *, save_wait=False, limit=None):
    """Runs the waiter into run folder ``name``; sends ``signals[i]`` at the i-th waiting line."""
    root, model, data, script, env = setup
    out = str(root / name)
    env = {
        **env,
        "WAIT_AT": str(WAIT_AT),
        **({"SAVE_WAIT": "1"} if save_wait else {}),
        **({"LIMIT": str(limit)} if limit else {}),
    }
    err_file = root / f"{name}.stderr"  # a file, not a pipe: a long stderr cannot block the process
    with open(err_file, "w") as err_out:
        p = subprocess.Popen(
            [sys.executable, script, *_train_args(model, data, out)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err_out,
            text=True,
        )
        lines, pending = [], list(signals)
        for line in p.stdout:
            lines.append(line)
            if pending and line.startswith(("REACHED", "SAVING")):
                os.kill(p.pid, pending.pop(0))
        p.wait(timeout=120)
    return out, p.returncode, "".join(lines), err_file.read_text()


def _steps(run):
    return sorted(int(x) for x in os.listdir(os.path.join(run, "checkpoints")) if x.isdigit())


@pytest.fixture(scope="module")
def uninterrupted(setup):
    root, model, data, _, env = setup
    out = str(root / "full")
    r = subprocess.run(
        [sys.executable, "-m", "flaxheads", "train", *_train_args(model, data, out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_the_step_in_flight_and_the_rerun_resumes_bitwise(setup, uninterrupted, sig):
    run, code, out, err = _signalled(setup, f"cut-{sig.name}", [sig])
    assert code == 128 + sig, out[-2000:] + err[-3000:]
    assert err.strip().splitlines() == [
        f"interrupted at step {WAIT_AT + 1}; checkpoint saved; rerun the same command to resume"
    ], err[-3000:]
    assert "Traceback" not in out + err
    assert _steps(run)[-1] == WAIT_AT + 1  # the step in flight finished and was saved
    assert not [n for n in os.listdir(os.path.join(run, "checkpoints")) if "tmp" in n]
    if sig == signal.SIGTERM:  # resuming is the same for both: once is enough
        _resumes_to_the_same_end(setup, run, WAIT_AT + 1, uninterrupted)


def _resumes_to_the_same_end(setup, run, step, uninterrupted):
    _, model, data, _, env = setup
    r = subprocess.run(
        [sys.executable, "-m", "flaxheads", "train", *_train_args(model, data, run)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"resuming from step {step}" in r.stdout
    assert _log(uninterrupted) == _log(run)  # every step's loss, grad norm, lr, and every evaluation
    _assert_bitwise(*(_items(os.path.join(d, "checkpoints", "18")) for d in (uninterrupted, run)))


@pytest.mark.slow
def test_second_signal_during_the_save_keeps_the_previous_checkpoint(setup):
    run, code, out, err = _signalled(setup, "twice", [signal.SIGTERM, signal.SIGINT], save_wait=True)
    assert code == 143, out[-2000:] + err[-3000:]
    assert f"SAVING {WAIT_AT + 1}" in out
    assert err.strip().splitlines() == [
        f"interrupted again after step {WAIT_AT + 1}; stopped without saving it; the "
        "latest checkpoint (step 4) is intact; rerun the same command to resume"
    ]
    assert _steps(run) == [4]


@pytest.mark.slow
def test_a_disk_that_stops_taking_checkpoints_ends_the_run_in_one_line(setup, uninterrupted):
    # from step 5 no file may grow past 20 kB: step 8's checkpoint (~220 kB) fails part-way, in the background
    run, code, out, err = _signalled(setup, "full-disk", [], limit=20_000)
    assert code == 1, out[-2000:] + err[-3000:]
    path = os.path.join(run, "checkpoints")
    *warnings, last = err.strip().splitlines()
    assert last == (
        f"error: could not write checkpoint {path}/8: File too large; the latest complete checkpoint is step 4 "
        f"({path}/4), intact; raise the file size limit and rerun the same command to resume"
    ), err[-3000:]
    # the report page (rewritten at each evaluation, larger than the limit) is said once, not fatal
    assert all(w.startswith(f"warning: could not write {run}/report.html") for w in warnings), err[-3000:]
    assert _steps(run) == [4]  # the half-written step 8 is never listed as a step
    _resumes_to_the_same_end(setup, run, 4, uninterrupted)


@pytest.mark.slow
@pytest.mark.serial
def test_two_processes_stop_at_the_same_step(setup):
    """SIGINT to one process of a two-process run: JAX's preemption service picks a step both reach;
    both checkpoint it (one Orbax save across the processes) and stop there."""
    import re
    import socket

    root, model, data, _, env = setup
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **env,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1 --xla_cpu_collective_call_terminate_timeout_seconds=60",
    }
    out = str(root / "two")
    args = [
        *_train_args(model, data, out),
        "--max-steps",
        "400",
        "--coordinator-address",
        f"127.0.0.1:{port}",
        "--num-processes",
        "2",
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "flaxheads", "train", *args, "--process-id", str(i)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in (0, 1)
    ]
    try:
        lines = []
        for line in procs[0].stdout:  # process 0 reports the evaluations (every 4 steps)
            lines.append(line)
            if line.startswith("step 8:"):
                os.kill(procs[1].pid, signal.SIGINT)
                break
        logs = ["".join(lines) + procs[0].communicate(timeout=300)[0], procs[1].communicate(timeout=300)[0]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [143, 130], [x[-2000:] for x in logs]
    stops = [
        re.findall(r"^interrupted at step (\d+); checkpoint saved; rerun the same command to resume$", x, re.M)
        for x in logs
    ]
    assert stops[0] == stops[1] and len(stops[0]) == 1, logs
    step = int(stops[0][0])
    # process 0 prints step 8's evaluation before it asks the service about step 8: a signal that
    # reaches process 1 before both have asked can stop the run at step 8 itself
    assert 8 <= step < 400 and _steps(out)[-1] == step
