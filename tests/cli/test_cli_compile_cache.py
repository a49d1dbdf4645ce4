"""The persistent compilation cache: a second identical ``flaxheads train`` loads every program the
first one compiled (JAX's own cache counters, as reported in ``summary.json``)."""

import json

import pytest
from cli_helpers import run_process, train_args, write_csv

from flaxheads.runtime.compile_cache import default_cache_dir
from flaxheads.runtime.cpu import cpu_fingerprint

pytestmark = pytest.mark.full


def _train(model, data, out, cache) -> dict:
    proc = run_process(
        *train_args(model, data, out, "--max-steps", "2", "--batch-size", "4", "--checkpoint-every", "0"),
        env={"FLAXHEADS_COMPILE_CACHE": str(cache)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_second_identical_run_compiles_nothing(bert_folder, tmp_path):
    data = write_csv(tmp_path / "data.csv", 24)
    cache = tmp_path / "cache"
    runs = [_train(bert_folder, data, tmp_path / f"run{i}", cache) for i in (1, 2)]
    first, second = (r["compile_cache"] for r in runs)
    assert first["compiled"] > 0 and first["stored"] == first["compiled"], first
    for r in runs:  # start-up is reported (what the cache shortens); its size is a bench's business
        assert 0 < r["first_step_seconds"] <= r["seconds_to_first_step"], r
        assert 0 <= r["eval_seconds"] <= r["seconds"], r
    assert second["compiled"] == 0 and second["loaded"] >= first["compiled"], (first, second)
    assert any(cache.iterdir())


@pytest.mark.parametrize("value", ["0", "off"])
def test_cache_turned_off_by_the_variable(monkeypatch, value):
    import jax

    from flaxheads.runtime.compile_cache import CACHE_ENV, enable_compile_cache

    before = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv(CACHE_ENV, value)
    assert enable_compile_cache() is None
    assert jax.config.jax_compilation_cache_dir == before


def test_cache_folder_is_per_jax_version_and_cpu():
    import jax

    fp = cpu_fingerprint()
    assert len(fp) == 12 and int(fp, 16) >= 0 and fp == cpu_fingerprint()
    assert default_cache_dir().name == f"jax-{jax.__version__}-{fp}"
