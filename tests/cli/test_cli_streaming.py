"""`flaxheads train` on streamed tables (--stream, or a large file / glob): a run from shards, its
one-line refusals and `evaluate --split`; two processes, each reading only its rows of every batch,
train the single process's run, and resume their own run mid-epoch bitwise."""

import json
import os
import shutil

import numpy as np
import pytest
from cli_helpers import SMALL, assert_one_line_error, run_cli, two_processes, write_csv

from flaxheads.cli.main import main

pytestmark = pytest.mark.full


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
    code, stdout, err = run_cli(
        capsys,
        "train",
        "--model",
        bert_folder,
        "--data",
        glob,
        "--split",
        "0.6,0.2,0.2",
        *SMALL,
        "--max-steps",
        "4",
        "--batch-size",
        "4",
        "--eval-limit",
        "5",
        "--output-dir",
        out,
        "--log-every",
        "1",
    )
    assert code == 0, err
    assert "read from disk as it trains (streamed), evaluating on a sample of 5 validation examples" in stdout
    cfg = json.loads((out / "config.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    from flaxheads.data import splits as D
    from flaxheads.data import streaming as S

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

    # packed, the same batch gives the same loss in fewer token slots (the later steps of a packed run
    # drift from the unpacked one's by up to 2% here, in memory too: the batches are equal, see
    # test_streaming.py, and so are the gradients at the start)
    packed = tmp_path / "packed"
    code, stdout, err = run_cli(
        capsys,
        "train",
        "--model",
        bert_folder,
        "--data",
        glob,
        "--split",
        "0.6,0.2,0.2",
        *SMALL,
        "--max-steps",
        "4",
        "--batch-size",
        "4",
        "--eval-limit",
        "5",
        "--output-dir",
        packed,
        "--pack",
        "--log-every",
        "1",
    )
    assert code == 0, err
    assert "short texts packed (--no-pack to turn off)" in stdout
    plain, got = _losses(out), _losses(packed)
    assert sorted(got) == sorted(plain) == [1, 2, 3, 4]
    assert got[1] == pytest.approx(plain[1], rel=1e-6)
    np.testing.assert_allclose([got[s] for s in plain], list(plain.values()), rtol=5e-2)

    for extra, needle in (
        (["--limit", "10"], "--limit samples a table held in memory"),
        (["--cache-features"], "streamed data cannot"),
    ):
        code, _, err = run_cli(
            capsys,
            "train",
            "--model",
            bert_folder,
            "--data",
            glob,
            *SMALL,
            "--max-steps",
            "1",
            "--output-dir",
            tmp_path / "x",
            *extra,
        )
        assert_one_line_error(code, err, needle)


def _losses(folder):
    return {e["step"]: e["loss"] for e in map(json.loads, open(os.path.join(folder, "metrics.jsonl"))) if "loss" in e}


def _restore(step_dir):
    """A checkpoint's items as host arrays, whatever processes wrote them (onto this process's first device)."""
    import jax
    import orbax.checkpoint as ocp

    ckptr, one = ocp.StandardCheckpointer(), jax.sharding.SingleDeviceSharding(jax.devices()[0])
    out = {}
    for item in ("head", "backbone", "opt_state"):
        path = os.path.join(step_dir, item)
        if os.path.isdir(path):
            tree = ckptr.metadata(path).item_metadata.tree
            like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), tree)
            out[item] = jax.tree.map(np.asarray, ckptr.restore(path, like))
    return out


@pytest.mark.slow
@pytest.mark.serial
def test_two_processes_train_the_single_process_batches_and_resume_mid_epoch(bert_folder, tmp_path):
    data = write_csv(tmp_path / "d.csv", 40, seed=4)
    run = [
        "train",
        "--model",
        bert_folder,
        "--data",
        data,
        "--stream",
        "--split",
        "0.6,0.2,0.2",
        *SMALL,
        "--max-steps",
        "9",
        "--batch-size",
        "4",
        "--eval-batch-size",
        "4",
        "--log-every",
        "1",
        "--checkpoint-every",
        "2",
        "--keep",
        "10",
        "--keep-best-by",
        "none",
        "--lr",
        "1e-3",
        "--head-lr",
        "1e-2",
    ]
    single, multi, cut = tmp_path / "single", tmp_path / "multi", tmp_path / "cut"
    assert main([*run, "--output-dir", str(single)]) == 0
    logs = two_processes(run, multi)
    assert "run folder" in logs[0] and "run folder" not in logs[1]
    cfg = json.loads((multi / "config.json").read_text())
    assert cfg["devices"]["processes"] == 2 and cfg["devices"]["width"] == 2
    # each process fed its half of every batch of the single process's run (6 steps per epoch: 9 cross one)
    a, b = _losses(single), _losses(multi)
    assert sorted(b) == list(range(1, 10))
    np.testing.assert_allclose([b[s] for s in range(1, 10)], [a[s] for s in range(1, 10)], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        np.load(multi / "predictions.npz")["test_logits"], np.load(single / "predictions.npz")["test_logits"], atol=1e-5
    )
    # the two-process run stopped after its step-4 checkpoint (mid-epoch) and run again: the same run, bitwise
    shutil.copytree(multi, cut)
    for d in os.listdir(cut / "checkpoints"):
        if d.isdigit() and int(d) > 4:
            shutil.rmtree(cut / "checkpoints" / d)
    logs = two_processes(run, cut)
    assert "resuming from step 4" in logs[0]
    assert _losses(cut) == b
    full, resumed = _restore(multi / "checkpoints" / "9"), _restore(cut / "checkpoints" / "9")
    assert set(full) == {"head", "backbone", "opt_state"}
    import jax

    for x, y in zip(jax.tree.leaves(full), jax.tree.leaves(resumed)):
        assert np.array_equal(x, y)
