"""flaxheads.runtime: the XLA flags and precision chosen from the host's CPU, what the programs
set before JAX starts, and what they leave alone."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import jax.numpy as jnp

from flaxheads import runtime
from flaxheads.errors import ConfigError

YNN = "--xla_cpu_experimental_ynn_fusion_type"
EPYC = runtime.CpuInfo("AMD EPYC 7B13", frozenset({"sse2", "avx", "avx2", "fma"}))
XEON = runtime.CpuInfo("Intel(R) Xeon(R) Platinum 8481C", frozenset({"avx2", "avx512f", "avx512_bf16", "amx_tile",
                                                                     "amx_bf16"}))


@pytest.fixture
def fresh(monkeypatch):
    """Pretend no backend has started (this test process has one running)."""
    monkeypatch.setattr(runtime, "_backend_started", lambda: False)
    monkeypatch.delenv(runtime.OPT_OUT_ENV, raising=False)
    return monkeypatch


def test_appends_to_existing_flags(fresh):
    fresh.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert runtime.configure_xla(cpu=EPYC) == [f"{YNN}="]
    assert os.environ["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=8", f"{YNN}="]
    assert runtime.configure_xla(cpu=EPYC) == []  # idempotent


def test_amx_hosts_keep_xlas_defaults(fresh):
    """YNNPACK-off was measured to win without AMX; with AMX, XLA's defaults reach the bf16 tiles."""
    fresh.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert runtime.configure_xla(cpu=XEON) == []
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"


def test_keeps_the_users_own_setting(fresh):
    fresh.setenv("XLA_FLAGS", f"{YNN}=individual_dot")
    assert runtime.configure_xla(cpu=EPYC) == []
    assert os.environ["XLA_FLAGS"] == f"{YNN}=individual_dot"


def test_opt_out_and_started_backend(fresh):
    fresh.delenv("XLA_FLAGS", raising=False)
    fresh.setenv(runtime.OPT_OUT_ENV, "0")
    assert runtime.configure_xla(cpu=EPYC) == [] and "XLA_FLAGS" not in os.environ
    fresh.delenv(runtime.OPT_OUT_ENV)
    fresh.setattr(runtime, "_backend_started", lambda: True)
    assert runtime.configure_xla(cpu=EPYC) == [] and "XLA_FLAGS" not in os.environ


X86_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile

processor\t: 1
model name\t: something else entirely
flags\t\t: fpu
"""
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics bf16
CPU part\t: 0xd4f
"""


@pytest.mark.parametrize("text, model, kind, flags", [
    (X86_CPUINFO, "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", "AMX", ()),
    (ARM_CPUINFO, "0xd4f", "NEON", (f"{YNN}=",)),
])
def test_cpu_info_reads_the_first_processor(tmp_path, text, model, kind, flags):
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    cpu = runtime.CpuInfo.read(str(path))
    assert (cpu.model, cpu.kind, runtime.cpu_xla_flags(cpu)) == (model, kind, flags)
    assert runtime.cpu_fingerprint(cpu) != runtime.cpu_fingerprint(EPYC)


def test_unreadable_cpuinfo_is_an_unknown_cpu(tmp_path):
    cpu = runtime.CpuInfo.read(str(tmp_path / "missing"))
    assert cpu.flags == frozenset() and cpu.kind == "unknown" and not cpu.amx


@pytest.mark.parametrize("kw, name", [
    (dict(backend="cpu", cpu=EPYC, jax_version="0.12.0.1"), "float32"),       # no bf16 matrix instructions
    (dict(backend="cpu", cpu=XEON, jax_version="0.12.0.1"), "bfloat16"),      # AMX, reached by jax >= 0.11
    (dict(backend="cpu", cpu=XEON, jax_version="0.10.2"), "float32"),         # AMX, but jax 0.10 does not use it
    (dict(backend="gpu", gpu_capability="9.0"), "bfloat16"),
    (dict(backend="gpu", gpu_capability="7.0"), "float32"),                    # V100: no bf16 tensor cores
    (dict(backend="tpu"), "bfloat16"),
])
def test_auto_precision_follows_the_hardware(kw, name):
    got = runtime.choose_precision("auto", **kw)
    assert got.name == name and got.reason.startswith("auto: ")


def test_asked_precision_is_kept_and_unknown_refused():
    assert runtime.choose_precision("float32", cpu=XEON, backend="cpu").name == "float32"
    assert runtime.choose_precision("bfloat16", cpu=EPYC, backend="cpu").dtype == jnp.bfloat16
    with pytest.raises(ConfigError, match="expected one of auto, float32, bfloat16"):
        runtime.choose_precision("fp16")


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
