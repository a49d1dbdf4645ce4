"""flaxheads.runtime.configure_xla: what the programs set before JAX starts, and what they leave alone."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from flaxheads import runtime

YNN = "--xla_cpu_experimental_ynn_fusion_type"


@pytest.fixture
def fresh(monkeypatch):
    """Pretend no backend has started (this test process has one running)."""
    monkeypatch.setattr(runtime, "_backend_started", lambda: False)
    monkeypatch.delenv(runtime.OPT_OUT_ENV, raising=False)
    return monkeypatch


def test_appends_to_existing_flags(fresh):
    fresh.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert runtime.configure_xla() == [f"{YNN}="]
    assert os.environ["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=8", f"{YNN}="]
    assert runtime.configure_xla() == []  # idempotent


def test_keeps_the_users_own_setting(fresh):
    fresh.setenv("XLA_FLAGS", f"{YNN}=individual_dot")
    assert runtime.configure_xla() == []
    assert os.environ["XLA_FLAGS"] == f"{YNN}=individual_dot"


def test_opt_out_and_started_backend(fresh):
    fresh.delenv("XLA_FLAGS", raising=False)
    fresh.setenv(runtime.OPT_OUT_ENV, "0")
    assert runtime.configure_xla() == [] and "XLA_FLAGS" not in os.environ
    fresh.delenv(runtime.OPT_OUT_ENV)
    fresh.setattr(runtime, "_backend_started", lambda: True)
    assert runtime.configure_xla() == [] and "XLA_FLAGS" not in os.environ


def test_importing_flaxheads_changes_nothing_and_the_flag_reaches_xla():
    """In a fresh process: import leaves XLA_FLAGS alone; configure_xla before the first
    computation really turns YNNPACK fusions off in the compiled program."""
    code = (
        "import os, flaxheads, jax, jax.numpy as jnp\n"
        "assert 'XLA_FLAGS' not in os.environ, os.environ.get('XLA_FLAGS')\n"
        "import sys\n"
        "if sys.argv[1] == 'on':\n"
        "    from flaxheads.runtime import configure_xla; assert configure_xla()\n"
        "f = jax.jit(lambda a, b: a @ b)\n"
        "print('__ynn' in f.lower(jnp.ones((256, 256)), jnp.ones((256, 256))).compile().as_text())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", runtime.OPT_OUT_ENV)}
    env["JAX_PLATFORMS"] = "cpu"
    out = {}
    for mode in ("on", "off"):
        r = subprocess.run([sys.executable, "-c", code, mode], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        out[mode] = r.stdout.strip().splitlines()[-1]
    assert out["on"] == "False"
    assert out["off"] == "True", ("XLA's CPU default no longer uses YNNPACK fusions: re-measure whether "
                                  "flaxheads.runtime.CPU_FLAGS still helps (bench/train_step.py)")
