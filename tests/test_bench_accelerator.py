"""bench/accelerator.py --smoke: the accelerator check's whole code path on CPU (tiny sizes), so the
script is known to run before a GPU machine is lent for its few minutes."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ("bert", "deberta-v3", "modernbert", "llama")
SMOKE_RUNS = (("bert-base", 16, 2), ("llama-1b+lora", 16, 2), ("modernbert-base", 32, 2))
CHECKS = ("f32 logits", "f32 grads", "bf16 logits", "fused == plain", "bf16 fused == plain")


@pytest.mark.slow
def test_accelerator_smoke(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run(
        [sys.executable, os.path.join("bench", "accelerator.py"), str(tmp_path), "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads((tmp_path / "accelerator.json").read_text())
    assert {"header", "correctness", "train", "predict"} <= set(report) and report["smoke"]
    assert report["header"]["jax_backend"] == "cpu"

    # every correctness check of every family ran and passed on CPU
    rows = {(r["family"], r["check"]): r for r in report["correctness"]}
    assert set(rows) == {(f, c) for f in FAMILIES for c in CHECKS}, [r["name"] for r in report["correctness"]]
    for key, r in rows.items():
        assert r["status"] == "pass", (key, r)
        assert r["max_rel_diff" if key[1] == "f32 grads" else "max_abs_diff"] <= r["tol"], (key, r)
    assert all(rows[(f, "fused == plain")]["max_abs_diff"] <= 1e-4 for f in FAMILIES)
    assert all(rows[(f, "f32 grads")]["params_compared"] >= 10 for f in FAMILIES)

    # the smoke sizes' train benches (the full run's second BERT-base differs only in its sizes),
    # flaxheads and PyTorch eager each (no torch.compile on CPU), positive times
    train = report["train"]
    assert all(r["status"] == "ok" for r in train), train
    assert {r["name"] for r in train} == {f"train {n} T={t} B={b}" for n, t, b in SMOKE_RUNS}
    assert {r["system"] for r in train} == {"flaxheads", "torch eager"}
    assert all("torch.compile skipped" in r["note"] for r in train)
    for r in train:
        assert 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"] and r["model_tflop_per_step"] > 0, r
        assert r["mfu"] > 0 and r["flaxheads_speedup"] > 0, r
    assert report["peak_bf16_tflops"] > 0

    # prediction: both systems, the same scores
    pred = {r["system"]: r for r in report["predict"]}
    assert set(pred) == {"flaxheads", "pipeline"} and all(r["status"] == "ok" for r in pred.values())
    assert all(r["texts_per_s"] > 0 for r in pred.values())
    assert pred["flaxheads"]["max_score_diff"] < 1e-4

    # the table comes last
    assert p.stdout.rstrip().splitlines()[-1].startswith("| predict |")
