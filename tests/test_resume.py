"""Resume: a `train` run SIGKILLed mid-run and resumed equals an uninterrupted run, bitwise on CPU
(params, optimizer state, dropout key, logged losses, evaluations); the same through `fit`
with a frozen backbone and under pmap."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from flaxheads.training.loop import TIMED

pytestmark = pytest.mark.full

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _data_csv(path, n=40, seed=0):
    from train_helpers import WORDS

    rng = np.random.default_rng(seed)
    rows = ["text,label"]
    for i in range(n):
        label = i % 3
        # class-dependent vocabulary, so the model has something to learn
        words = [WORDS[(label * 7 + int(rng.integers(0, 12))) % len(WORDS)] for _ in range(int(rng.integers(3, 12)))]
        rows.append(f"{' '.join(words)},c{label}")
    path.write_text("\n".join(rows) + "\n")
    return str(path)


_SLEEPER = textwrap.dedent("""
    # `flaxheads train`, but at step KILL_AT it says so and waits to be killed.
    import os, sys, time
    import flaxheads.training.loop as T
    import flaxheads.cli.train as C

    K = int(os.environ["KILL_AT"])
    real_fit = T.fit

    def fit(*a, callbacks=(), **kw):
        def stop(state, step, m):
            if step == K:
                print(f"REACHED {K}", flush=True)
                time.sleep(600)
        return real_fit(*a, callbacks=[*callbacks, T.hooks(on_step_end=stop)], **kw)

    T.fit = fit
    sys.exit(C.main(sys.argv[1:]))
""")


def _train_args(model, data, out):
    return [
        "--model",
        model,
        "--data",
        data,
        "--split",
        "0.6,0.2,0.2",
        "--epochs",
        "3",
        "--batch-size",
        "4",
        "--eval-every",
        "4",
        "--log-every",
        "1",
        "--max-length",
        "16",
        "--bucket-step",
        "16",
        "--lr",
        "3e-3",
        "--keep",
        "2",
        "--no-progress",
        "--output-dir",
        out,
    ]


def _env(cache):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    # the killed run compiles; the two later runs load its executables (same programs, less CI time)
    env.update(
        JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
    )
    return env


def _log(run):
    """metrics.jsonl without the wall-clock throughput."""
    out = []
    for line in open(os.path.join(run, "metrics.jsonl")):
        e = json.loads(line)
        for k in TIMED:
            e.pop(k, None)
        out.append(e)
    return out


def _items(step_dir):
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()
    out = {}
    for item in ("head", "backbone", "opt_state", "extra"):
        p = os.path.join(step_dir, item)
        if os.path.isdir(p):
            out[item] = jax.tree.map(np.asarray, ckptr.restore(p))
    return out


def _assert_bitwise(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x, y), np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))


@pytest.mark.slow
def _killed_at(script, argv, env, step: int) -> list[str]:
    """Run the sleeper script on ``argv`` and SIGKILL it once it reports reaching ``step``: its output lines."""
    b = subprocess.Popen(
        [sys.executable, str(script), *argv],
        cwd=REPO,
        env={**env, "KILL_AT": str(step)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in b.stdout:
        lines.append(line)
        if line.startswith(f"REACHED {step}"):
            os.kill(b.pid, signal.SIGKILL)
            break
    b.wait(timeout=60)
    assert b.returncode == -signal.SIGKILL, "".join(lines)[-3000:]
    return lines


def test_sigkilled_train_run_resumes_to_the_same_result(tmp_path, capfd):
    from train_helpers import tiny_bert_folder

    model = tiny_bert_folder(tmp_path / "bert", dropout=0.1)  # dropout on: the keys must match too
    data = _data_csv(tmp_path / "data.csv")
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    script = tmp_path / "sleeper.py"
    script.write_text(_SLEEPER)
    env = _env(tmp_path / "jax-cache")
    _killed_at(script, _train_args(model, data, cut), env, 10)
    steps_left = sorted(int(x) for x in os.listdir(os.path.join(cut, "checkpoints")) if x.isdigit())
    # 24 training examples, batches of 4: 6 steps per epoch; checkpoints at the evaluations
    # (every 4 steps), so the resume starts mid-epoch (step 8 = epoch 1 + 2 batches)
    assert steps_left and max(steps_left) <= 10

    # side by side: the uninterrupted run, and the resume (the same command, nothing else)
    a = subprocess.Popen(
        [sys.executable, "-m", "flaxheads", "train", *_train_args(model, data, full)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    r = subprocess.run(
        [sys.executable, "-m", "flaxheads", "train", *_train_args(model, data, cut)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    out_a, _ = a.communicate(timeout=400)
    assert a.returncode == 0, out_a[-3000:]
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"resuming from step {max(steps_left)}" in r.stdout
    sa, sb = (json.load(open(os.path.join(d, "summary.json"))) for d in (full, cut))
    assert sb["resumed_from"] == max(steps_left) and sa["resumed_from"] is None
    assert sa["steps"] == sb["steps"] == 18
    assert sa["metrics"] == sb["metrics"]
    assert _log(full) == _log(cut)  # every step's loss, grad norm, lr, and every evaluation
    # TensorBoard's reader hides the steps the killed run logged past its checkpoint (the event
    # file's session start), so the two runs' curves are the same
    if importlib.util.find_spec("tensorboard") is not None:
        from train_helpers import event_scalars

        untimed = [
            {
                (t, s, v)
                for t, s, v in event_scalars(os.path.join(d, "tensorboard"))
                if t.removeprefix("train/") not in TIMED
            }
            for d in (full, cut)
        ]
        assert len(os.listdir(os.path.join(cut, "tensorboard"))) == 2 and untimed[0] == untimed[1]
        assert max(s for _, s, _ in untimed[0]) == 18
    ia, ib = (_items(os.path.join(d, "checkpoints", "18")) for d in (full, cut))
    assert set(ia) == {"head", "backbone", "opt_state", "extra"}
    _assert_bitwise(ia, ib)
    # and the run really trained: the final params moved away from the initial ones
    assert not np.array_equal(
        ia["head"]["head"]["classifier"]["kernel"],
        _items(
            os.path.join(
                full,
                "checkpoints",
                str(min(int(x) for x in os.listdir(os.path.join(full, "checkpoints")) if x.isdigit())),
            )
        )["head"]["head"]["classifier"]["kernel"],
    )
    # retention: the 2 latest + the best by validation accuracy
    kept = sorted(int(x) for x in os.listdir(os.path.join(full, "checkpoints")) if x.isdigit())
    assert kept[-2:] == [16, 18] and len(kept) <= 3
    # the listing command sees them
    # what the program says about resuming that cannot work (in-process: no training happens)
    from flaxheads.cli.train import main

    def err(*extra):
        code = main(_train_args(model, data, full) + list(extra))
        return code, capfd.readouterr().err

    code, msg = err("--no-resume")
    assert code == 2 and "already has checkpoints (latest step 18)" in msg
    code, msg = err("--head", "mlp")
    assert code == 2 and "incompatible head config" in msg and "head.type: checkpoint 'linear' vs target 'mlp'" in msg
    code, msg = err("--resume-step", "3")
    assert code == 2 and "no checkpoint for step 3" in msg and "available steps: [16, 18]" in msg

    from flaxheads.checkpoint import format_listing, list_checkpoints

    rows = list_checkpoints(full)
    assert rows[-1]["latest"] and sum(r["best"] for r in rows) == 1
    assert "validation/accuracy=" in format_listing(rows)


@pytest.mark.slow
def test_sigkilled_streamed_run_resumes_mid_epoch_bitwise(tmp_path):
    """The same with the table streamed: the data position comes back from the step (the epoch's
    windows are read again up to the batch the killed run stopped before)."""
    from train_helpers import tiny_bert_folder

    model = tiny_bert_folder(tmp_path / "bert", dropout=0.1)
    data = _data_csv(tmp_path / "data.csv", n=48, seed=1)
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    script = tmp_path / "sleeper.py"
    script.write_text(_SLEEPER)
    env = _env(tmp_path / "jax-cache")

    def args(out):
        return [*_train_args(model, data, out), "--stream", "--eval-limit", "6", "--checkpoint-every", "5"]

    lines = _killed_at(script, args(cut), env, 11)
    assert "streamed" in "".join(lines)
    left = max(int(x) for x in os.listdir(os.path.join(cut, "checkpoints")) if x.isdigit())
    # checkpoints every 5 steps and at the evaluations (every 4); the hash split leaves 35 training
    # rows, 9 batches of 4 per epoch: the resume starts mid-epoch (8 or 10; 10 may be cut by the kill)
    assert left in (8, 10)
    a = subprocess.Popen(
        [sys.executable, "-m", "flaxheads", "train", *args(full)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    r = subprocess.run(
        [sys.executable, "-m", "flaxheads", "train", *args(cut)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    out_a, _ = a.communicate(timeout=400)
    assert a.returncode == 0, out_a[-3000:]
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"resuming from step {left}" in r.stdout
    sa, sb = (json.load(open(os.path.join(d, "summary.json"))) for d in (full, cut))
    assert sa["steps"] == sb["steps"] == 27
    assert sa["metrics"] == sb["metrics"]
    assert _log(full) == _log(cut)
    last = str(sa["steps"])
    _assert_bitwise(*(_items(os.path.join(d, "checkpoints", last)) for d in (full, cut)))
