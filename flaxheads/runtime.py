"""Process-level settings that flaxheads' programs choose for the host they run on.

Importing flaxheads never changes XLA's configuration: the ``train`` program and the
benchmarks call :func:`configure_xla` first thing, and a script that wants the same
settings calls it before its first JAX computation.

What is chosen from the CPU's features (:class:`CpuInfo`), and the measurements behind it
(docs/performance.md has the A/B numbers and the CPU of each):

* XLA flags (:func:`cpu_xla_flags`). On x86 CPUs with AVX2 but no AVX-512,
  ``--xla_cpu_experimental_ynn_fusion_type=reduce`` keeps XLA:CPU's YNNPACK fusions (jaxlib routes
  dots *and* reductions through them) for reductions only: dots go to Eigen, which won the dense
  products of the forward on a 2-core AMD EPYC (AVX2), and the softmax's reductions to YNNPACK;
  LayerNorm's statistics are then products too (:func:`layer_norm_dots`). The MiniLM forward at
  32 x 256 took 0.84x the time of YNNPACK off (1311 against 1569 ms), and no shape measured lost.
  Under jax < 0.11 YNNPACK is turned off (:data:`EIGEN_FLAGS`, ~12% there). Train steps compile
  with YNNPACK's dots back on (:func:`gradient_compiler_options`, one program's option): measured
  per program, every train step took less time with them (0.95x at 16 x 128 tokens, 0.83x on
  packed short texts) and compiled in 0.7-0.8x the time.
  With AMX (jax >= 0.11) the dots go to oneDNN's matmul custom call and YNNPACK keeps the
  reductions (:data:`ONEDNN_FLAGS`): on a 2-core Intel Xeon with AMX oneDNN ran MiniLM's bf16 dense
  products ~2x faster than YNNPACK (4096 x 384 x 1536: 1.6 vs 3.2 ms), and the MiniLM bf16 train
  step went 1.23x -> 1.93x PyTorch autocast, the fp32 one 1.34x -> 1.41x. oneDNN wants bf16 products
  with bf16 outputs, which ``backbones.layers`` asks for when :func:`onednn_dots` says so. YNNPACK's
  reductions let forward programs hand it each attention whole (:func:`ynn_attention`, with
  LayerNorm's statistics as products): the bf16 forward at 32 x 128 went 1.18x -> 1.47x PyTorch
  autocast, the fp32 one 1.09x -> 1.17x; train steps ran as before (fp32 1.45x, bf16 2.02x) and
  frozen-backbone ones faster.
  With AVX-512 and no AMX XLA's defaults are kept: on a 2-core AMD EPYC with AVX-512 and
  AVX512-BF16 they gave the fp32 train step 1.14x and forward 1.11x, and the bfloat16 GEMM 2.2x
  (YNNPACK's bf16 dots; Eigen converts). Where nothing was measured (ARM, other ISAs) the
  defaults are kept too.
* malloc (:func:`configure_malloc`, glibc only): one arena, no ``mmap`` for big blocks, no
  trimming. XLA:CPU allocates each execution's outputs and temporaries afresh on its worker
  threads; glibc serves blocks over 32 MiB (and, in a thread's arena, over 64 MiB whatever the
  settings) with a fresh ``mmap`` and unmaps them on free, so every step faulted its big buffers in
  again (MiniLM train step at 16 x 128: 153k page faults, ~600 MB, per step). Kept in one heap they
  are reused: 0 faults in most runs, the step ~13% faster and the AdamW pass 78 -> 46 ms (2-core AMD
  EPYC); in some runs part of them still fault, as threads that allocated before the call keep arenas.
* Precision (:func:`choose_precision`): ``bfloat16`` where the hardware multiplies it natively
  and JAX reaches it (TPU; NVIDIA GPUs from sm_80; CPUs with AMX or AVX512-BF16 under
  jax >= 0.11), ``float32`` elsewhere. Without bf16 matrix instructions a bf16 dot is converted
  and runs slower than fp32 (AMD EPYC with AVX2, jax 0.12: ~0.8x the fp32 GEMM), so bfloat16
  there would cost speed and precision. With AVX512-BF16 (AMD EPYC, jax 0.12) the bf16 GEMM ran
  1.9x the fp32 one, the MiniLM train step 1.23x and the forward 1.5x, at equal test accuracy.

:func:`enable_compile_cache` turns on JAX's persistent compilation cache for a program, so a
second identical run loads its executables instead of compiling them again. The folder is
per jax version and per CPU (model name and instruction-set flags): an executable compiled
for one CPU's vector extensions must never run on another that shares the home folder.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import warnings
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

#: XLA:CPU's YNNPACK fusions for reductions only: dots go to Eigen, reductions (softmax, LayerNorm's
#: statistics as :func:`layer_norm_dots` leaves them) to YNNPACK. x86 with AVX2 and no AVX-512 under
#: jax >= 0.11 (the module docstring says why: :func:`cpu_xla_flags`).
CPU_FLAGS: tuple[str, ...] = ("--xla_cpu_experimental_ynn_fusion_type=reduce",)
#: XLA:CPU's YNNPACK fusions off: dots to Eigen, reductions in XLA's own loops. The same CPUs under
#: jax < 0.11, where this was measured.
EIGEN_FLAGS: tuple[str, ...] = ("--xla_cpu_experimental_ynn_fusion_type=",)
_ONEDNN: tuple[str, ...] = ("--xla_cpu_use_onednn=true", "--xla_cpu_experimental_onednn_custom_call=true")
#: XLA:CPU's dots through oneDNN's matmul custom call, with YNNPACK's fusions for reductions only (with
#: dots among their types they take the dots first): forward programs then get attention fused whole
#: by YNNPACK (:func:`ynn_attention`). Chosen on CPUs with AMX under jax >= 0.11 (:func:`cpu_xla_flags`).
ONEDNN_FLAGS: tuple[str, ...] = CPU_FLAGS + _ONEDNN
#: oneDNN's dots with YNNPACK off (oneDNN's softmax, XLA's reductions): the AMX choice before
#: YNNPACK's fused attention.
ONEDNN_ALONE_FLAGS: tuple[str, ...] = EIGEN_FLAGS + _ONEDNN

#: XLA:CPU's YNNPACK fusions as jax 0.12 has them by default (dots and reductions), as one program's
#: compiler option: what :func:`gradient_compiler_options` gives train steps back where
#: :data:`CPU_FLAGS` kept the dots from them for the process.
YNN_PROGRAM_OPTIONS: dict[str, str] = {
    "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE"}

#: Set to ``0`` to make :func:`configure_xla` a no-op and :func:`gradient_compiler_options` empty
#: (e.g. to compare against XLA's defaults).
OPT_OUT_ENV = "FLAXHEADS_XLA_DEFAULTS"

#: ``FLAXHEADS_MALLOC=0`` makes :func:`configure_malloc` a no-op.
MALLOC_OPT_OUT_ENV = "FLAXHEADS_MALLOC"
#: What :func:`configure_malloc` sets: glibc's environment variable, its ``mallopt`` parameter
#: (malloc.h: M_ARENA_MAX, M_MMAP_MAX, M_TRIM_THRESHOLD) and the value. The same variables in a
#: child's environment give a process that does not call it (a peer in a benchmark) the same heap.
MALLOC_SETTINGS: tuple[tuple[str, int, int], ...] = (
    ("MALLOC_ARENA_MAX", -8, 1),
    ("MALLOC_MMAP_MAX_", -4, 0),
    ("MALLOC_TRIM_THRESHOLD_", -1, 2**31 - 1),
)

#: ``--precision`` values: ``auto`` asks :func:`choose_precision`.
PRECISIONS: tuple[str, ...] = ("auto", "float32", "bfloat16")
#: The default of ``flaxheads train --precision`` (``auto`` when unset).
PRECISION_ENV = "FLAXHEADS_PRECISION"


@dataclass(frozen=True)
class CpuInfo:
    """The host CPU's model name and instruction-set flags (``/proc/cpuinfo``; empty elsewhere)."""

    model: str = ""
    flags: frozenset[str] = frozenset()

    @classmethod
    def read(cls, path: str = "/proc/cpuinfo") -> "CpuInfo":
        """The first processor's entry (the other cores repeat it); an empty ``CpuInfo`` when unreadable."""
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                first = f.read().split("\n\n")[0]
        except OSError:
            return cls(platform.processor())
        fields = {}
        for line in first.splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
        # x86 names them "model name" / "flags"; ARM "CPU part" / "Features"
        model = fields.get("model name") or fields.get("CPU part") or platform.processor()
        return cls(model, frozenset((fields.get("flags") or fields.get("Features") or "").split()))

    @property
    def amx(self) -> bool:
        """AMX bfloat16 tiles (Intel Xeon from Sapphire Rapids)."""
        return "amx_bf16" in self.flags

    @property
    def bf16(self) -> bool:
        """bfloat16 dot instructions: AVX512-BF16 or AMX (without them a bf16 dot is converted)."""
        return self.amx or "avx512_bf16" in self.flags

    @property
    def kind(self) -> str:
        """The widest matrix/vector extension, as the tables in docs/performance.md name CPUs."""
        for flag, name in (("amx_bf16", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"), ("asimd", "NEON")):
            if flag in self.flags:
                return name
        return "unknown"


def _installed_jax() -> str:
    import jax  # importing jax starts no backend: XLA_FLAGS can still be set after this

    return jax.__version__


def cpu_xla_flags(cpu: CpuInfo, jax_version: str | None = None) -> tuple[str, ...]:
    """The XLA flags :func:`configure_xla` adds on this CPU (module docstring): oneDNN's dots with
    AMX under jax >= 0.11 (``jax_version``, default the installed one); on x86 with AVX2 and no
    AVX-512 Eigen's dots, with YNNPACK's reductions under jax >= 0.11 (:data:`CPU_FLAGS`) and without
    YNNPACK under older jax (:data:`EIGEN_FLAGS`); XLA's defaults elsewhere."""
    new_jax = _version(jax_version or _installed_jax()) >= (0, 11)
    if cpu.amx and new_jax:
        return ONEDNN_FLAGS
    if "avx2" in cpu.flags and "avx512f" not in cpu.flags:
        return CPU_FLAGS if new_jax else EIGEN_FLAGS
    return ()


def _split_flags(xla_flags: str) -> list[str]:
    try:
        return shlex.split(xla_flags)
    except ValueError as e:
        raise ConfigError(f"XLA_FLAGS={xla_flags!r} cannot be split into flags ({e}): expected space-separated "
                          "--name=value flags; fix its quoting") from None


def _flag_values(xla_flags: str) -> dict[str, str]:
    """``{"--name": "value"}`` of an ``XLA_FLAGS`` string (the last setting of a name wins)."""
    values = {}
    for flag in _split_flags(xla_flags):
        name, _, value = flag.partition("=")
        values[name] = value.strip().lower()
    return values


def onednn_dots(xla_flags: str | None = None) -> bool:
    """Whether XLA:CPU hands this process's dots to oneDNN, from ``xla_flags`` (default
    ``$XLA_FLAGS``): oneDNN and its matmul custom call on, and YNNPACK's fusions (which take the
    dots first) set to no dot type.

    Read where a computation is arranged for the dot library (``backbones.layers``): oneDNN runs
    bf16 x bf16 -> bf16 products on AMX but bf16 x bf16 -> float32 ones ~10x slower, and YNNPACK
    the other way round on the AVX512-BF16 CPU measured."""
    flags = _flag_values(os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags)
    on = ("true", "1")
    return (flags.get("--xla_cpu_use_onednn") in on and flags.get("--xla_cpu_experimental_onednn_custom_call") in on
            and _no_ynn_dots(_ynn_types(xla_flags)))


def _no_ynn_dots(types: set[str] | None) -> bool:
    """Whether YNNPACK's fusion types (:func:`_ynn_types`) leave the dots alone: set, without a dot type."""
    return types is not None and not any("dot" in t for t in types)


def ynn_reductions(xla_flags: str | None = None) -> bool:
    """Whether XLA:CPU's YNNPACK fusions take this process's reductions, from ``xla_flags`` (default
    ``$XLA_FLAGS``): yes at XLA's default and with :data:`CPU_FLAGS`, no when
    ``--xla_cpu_experimental_ynn_fusion_type`` lists no ``reduce`` (:data:`EIGEN_FLAGS` and
    :data:`ONEDNN_ALONE_FLAGS` set it empty).

    Without them a large reduction runs as XLA's own tree of reduce-windows, ~5x slower than
    memory allows (MiniLM's gradient norm: 21 ms against 4-5 ms, AMD EPYC with AVX2); code that
    reduces big arrays reads this to fold them first (``training.optim.sum_of_squares``)."""
    types = _ynn_types(xla_flags)
    return types is None or "reduce" in types


def _ynn_types(xla_flags: str | None) -> set[str] | None:
    """The fusion types ``--xla_cpu_experimental_ynn_fusion_type`` lists in ``xla_flags`` (default
    ``$XLA_FLAGS``); ``None`` where it is not set (XLA's default: dots and reductions)."""
    flags = _flag_values(os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags)
    value = flags.get("--xla_cpu_experimental_ynn_fusion_type")
    return None if value is None else {t for t in value.split(",") if t}


def _eigen_dots(xla_flags: str | None) -> bool:
    """Whether this process's dots are Eigen's: YNNPACK's fusion types set without a dot type and
    oneDNN's dots off (:data:`CPU_FLAGS`, :data:`EIGEN_FLAGS`)."""
    return _no_ynn_dots(_ynn_types(xla_flags)) and not onednn_dots(xla_flags)


def layer_norm_dots(xla_flags: str | None = None) -> bool:
    """Whether LayerNorm computes its mean and variance as products with a ``1/n`` column
    (``backbones.layers.layer_norm``) instead of reductions: where this process gives dots to Eigen
    or oneDNN and reductions to YNNPACK (:data:`CPU_FLAGS`, :data:`ONEDNN_FLAGS`), from ``xla_flags``
    (default ``$XLA_FLAGS``).

    There the reductions' YNNPACK fusions take the whole LayerNorm out of XLA's loop fusions, and
    Eigen's matrix-vector products were faster: the MiniLM forward at 32 x 256 took 1311 ms against
    1551 ms with reductions and 1569 ms with YNNPACK off (AMD EPYC with AVX2, jax 0.12; every shape
    from 1 x 16 to 32 x 256 measured as fast or faster). Beside oneDNN's dots YNNPACK's reduction
    fusions otherwise take in the neighbouring dense products (Intel Xeon with AMX, bf16 forward at
    32 x 256: 436 ms against 258 ms with the products). Read at trace time."""
    types = _ynn_types(xla_flags)
    return _no_ynn_dots(types) and "reduce" in types


def ynn_attention(xla_flags: str | None = None) -> bool:
    """Whether attention without dropout is arranged for YNNPACK to fuse whole, both products
    included (``backbones.layers.attend_ynn``): oneDNN's dots with YNNPACK's reductions
    (:data:`ONEDNN_FLAGS`), from ``xla_flags`` (default ``$XLA_FLAGS``). Read at trace time.

    Intel Xeon with AMX, jax 0.12, MiniLM forward at every position: bf16 32 x 256 1.00x PyTorch
    autocast against 0.89-0.95x with oneDNN's products and softmax, 32 x 128 1.22-1.27x against
    1.13x; float32 32 x 256 0.95x against 0.90x."""
    return onednn_dots(xla_flags) and ynn_reductions(xla_flags)


#: The most parameter bytes :func:`constant_weights` lets a program hold as constants: the
#: executable keeps its own (reordered) copy of them, one per compiled shape.
CONSTANT_WEIGHTS_MAX_BYTES = 1 << 30


def constant_weights(nbytes: int, dtype="float32", xla_flags: str | None = None, *,
                     backend: str | None = None) -> bool:
    """Whether an inference program whose parameters stay the same over many calls (a feature
    cache's encoder, prediction) takes them as compile-time constants: on the CPU ``backend``
    (default JAX's) with oneDNN's dots (:func:`onednn_dots`, from ``xla_flags``), for a float32
    compute ``dtype`` and at most :data:`CONSTANT_WEIGHTS_MAX_BYTES` of them (``nbytes``).

    XLA reorders constant weights into oneDNN's blocked layout once, at compile time
    ("weights_prepacked"), instead of oneDNN repacking them in every product. Intel Xeon with AMX,
    jax 0.12, MiniLM forward at every position, same process: float32 32 x 256 755 ms against 817
    (PyTorch 769), 32 x 128 342 against 372 ms, the same numbers to the bit. In bfloat16 the
    forward gained 3% (255 against 263 ms) but each program compiled ~0.4 s longer: a 500-article
    encode lost more than it gained. Eigen's and YNNPACK's dots have no such step, so elsewhere
    the parameters stay arguments."""
    import jax
    import jax.numpy as jnp

    return ((backend or jax.default_backend()) == "cpu" and jnp.dtype(dtype) == jnp.float32
            and onednn_dots(xla_flags) and nbytes <= CONSTANT_WEIGHTS_MAX_BYTES)


def gradient_compiler_options(xla_flags: str | None = None, *, backend: str | None = None,
                              jax_version: str | None = None) -> dict[str, str]:
    """``compiler_options`` for programs that take gradients (train steps): :data:`YNN_PROGRAM_OPTIONS`
    where this process kept the dots from YNNPACK for Eigen (``xla_flags``, default ``$XLA_FLAGS``,
    lists no dot type in ``--xla_cpu_experimental_ynn_fusion_type`` and has no oneDNN dots:
    :data:`CPU_FLAGS`, :data:`EIGEN_FLAGS`) on the CPU ``backend`` (default JAX's) under jax >= 0.11
    (``jax_version``, default the installed one); ``{}`` elsewhere (:data:`ONEDNN_FLAGS` included: its
    train steps ran as fast as with YNNPACK off, and frozen-backbone ones faster), and when
    ``FLAXHEADS_XLA_DEFAULTS=0``.

    Eigen's dots win the forward at 32 x 256 tokens, but YNNPACK's win every train step measured on
    a 2-core AMD EPYC with AVX2 (jax 0.12): MiniLM packed short texts, 1 row of 64-128 tokens,
    0.83x the step time; 16 x 128 0.95x; and each train step compiles in 0.7-0.8x the time.
    Read when a step is jitted (``Parallel.compile(..., gradients=True)``); ``training.optim``
    reads :func:`gradient_ynn_reductions` to arrange its reductions for the same programs."""
    if os.environ.get(OPT_OUT_ENV, "1") == "0":
        return {}
    if not _eigen_dots(xla_flags):
        return {}
    if _version(jax_version or _installed_jax()) < (0, 11):
        return {}  # measured on jax 0.12 only
    if backend is None:
        import jax

        backend = jax.default_backend()
    return dict(YNN_PROGRAM_OPTIONS) if backend == "cpu" else {}


def gradient_ynn_reductions(xla_flags: str | None = None) -> bool:
    """Whether YNNPACK takes the reductions of train steps compiled with
    :func:`gradient_compiler_options`: the process's setting (:func:`ynn_reductions`), or the
    train steps' own."""
    return ynn_reductions(xla_flags) or bool(gradient_compiler_options(xla_flags))


@dataclass(frozen=True)
class Precision:
    """A resolved ``--precision``: ``float32`` or ``bfloat16``, and why it was chosen."""

    name: str
    reason: str

    @property
    def dtype(self):
        import jax.numpy as jnp

        return jnp.bfloat16 if self.name == "bfloat16" else jnp.float32


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())


def choose_precision(want: str = "auto", *, backend: str | None = None, cpu: CpuInfo | None = None,
                     jax_version: str | None = None, gpu_capability: str | None = None) -> Precision:
    """Resolve ``want`` (one of :data:`PRECISIONS`) for this host. ``float32``/``bfloat16`` are kept
    as asked; ``auto`` picks bfloat16 only where the hardware multiplies it natively and JAX reaches
    that (module docstring). The keywords default to this process's backend, CPU and jax."""
    if want not in PRECISIONS:
        raise ConfigError(f"precision {want!r} is not known: expected one of {', '.join(PRECISIONS)}")
    if want != "auto":
        return Precision(want, "asked for")
    import jax

    backend = backend or jax.default_backend()
    if backend == "tpu":
        return Precision("bfloat16", "auto: TPU matrix units multiply bfloat16")
    if backend == "gpu":
        cap = gpu_capability if gpu_capability is not None else str(getattr(jax.devices()[0], "compute_capability", ""))
        if _version(cap) >= (8, 0):
            return Precision("bfloat16", f"auto: GPU compute capability {cap} has bfloat16 tensor cores")
        return Precision("float32", f"auto: GPU compute capability {cap or 'unknown'} has no bfloat16 tensor cores")
    if backend != "cpu":
        return Precision("float32", f"auto: float32 on the {backend} backend")
    cpu = cpu or CpuInfo.read()
    jax_version = jax_version or _installed_jax()
    units = "AMX bfloat16 tiles" if cpu.amx else "AVX512-BF16 instructions"
    if cpu.bf16 and _version(jax_version) >= (0, 11):
        return Precision("bfloat16", f"auto: {cpu.model or 'this CPU'} has {units}")
    if cpu.bf16:
        return Precision("float32", f"auto: jax {jax_version} does not use this CPU's {units} (jax >= 0.11 does)")
    return Precision("float32", f"auto: {cpu.model or 'this CPU'} has no bfloat16 matrix instructions "
                                "(bfloat16 matmuls would run converted)")


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - jax not importable: nothing started
        return False
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if callable(started) else False


def configure_xla(flags: tuple[str, ...] | None = None, *, cpu: CpuInfo | None = None) -> list[str]:
    """Append ``flags`` (default: :func:`cpu_xla_flags` for ``cpu``, this host's CPU) to
    ``XLA_FLAGS`` for this process; returns the flags it added.

    A flag whose name the user already set in ``XLA_FLAGS`` is left as the user set it.
    Does nothing (returns ``[]``) when ``FLAXHEADS_XLA_DEFAULTS=0`` or when JAX has already
    started a backend in this process (flags are read once, at backend start)."""
    if os.environ.get(OPT_OUT_ENV, "1") == "0" or _backend_started():
        return []
    if flags is None:
        flags = cpu_xla_flags(cpu or CpuInfo.read())
    current = _split_flags(os.environ.get("XLA_FLAGS", ""))
    names = {f.split("=", 1)[0] for f in current}
    added = [f for f in flags if f.split("=", 1)[0] not in names]
    if added:
        os.environ["XLA_FLAGS"] = " ".join(current + added)
    return added


def malloc_env() -> dict[str, str]:
    """:data:`MALLOC_SETTINGS` as environment variables, for a child process."""
    return {name: str(value) for name, _, value in MALLOC_SETTINGS}


def configure_malloc() -> list[str]:
    """Keep freed memory in one glibc heap for this process (see the module docstring); returns
    the settings applied, as ``NAME=value``.

    Call it first thing, before JAX starts its threads: a thread that already has its own arena
    keeps it (and a block over 64 MiB allocated there is still mapped afresh; the environment
    variables of :func:`malloc_env`, set before the process starts, leave no such thread). A
    setting whose environment variable is set is left to glibc, which read it at start; each
    applied setting is written to the environment, for child processes. Does nothing (returns
    ``[]``) without glibc, when ``FLAXHEADS_MALLOC=0``, or when JAX has already started a backend."""
    if os.environ.get(MALLOC_OPT_OUT_ENV, "1") == "0" or _backend_started() or platform.libc_ver()[0] != "glibc":
        return []
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # pragma: no cover - a glibc without mallopt
        return []
    applied = []
    for name, param, value in MALLOC_SETTINGS:
        if name not in os.environ and mallopt(param, value) == 1:
            os.environ[name] = str(value)  # child processes start with the same heap; a second call keeps it
            applied.append(f"{name}={value}")
    return applied


#: ``FLAXHEADS_COMPILE_CACHE``: a folder for the persistent compilation cache, or ``0`` to turn it off.
CACHE_ENV = "FLAXHEADS_COMPILE_CACHE"
# JAX records a "miss" as it writes the new entry
_REQUEST, _HIT, _WRITE = ("/jax/compilation_cache/compile_requests_use_cache", "/jax/compilation_cache/cache_hits",
                          "/jax/compilation_cache/cache_misses")


def cpu_fingerprint(cpu: CpuInfo | None = None) -> str:
    """A short hash of this host's CPU model and instruction-set flags."""
    cpu = cpu or CpuInfo.read()
    text = " ".join([platform.machine(), cpu.model, *sorted(cpu.flags)])
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/flaxheads/xla/jax-<version>-<cpu>`` (``~/.cache`` when XDG_CACHE_HOME is unset)."""
    import jax

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "flaxheads" / "xla" / f"jax-{jax.__version__}-{cpu_fingerprint()}"


#: JAX's warning when XLA cannot serialize a compiled program. jaxlib 0.12's XLA:CPU fails so on
#: every program with oneDNN's matmul calls (:data:`ONEDNN_FLAGS`): such programs compile again in
#: each run, which :meth:`CompileCache.summary` says; the warning itself is silenced.
UNSTORABLE_WARNING = r"Error writing persistent compilation cache entry for .*: MemoryError: std::bad_alloc"


@dataclass
class CompileCache:
    """Where the persistent compilation cache lives and how this process used it so far, from
    JAX's cache events: programs asked for (``requests``), loaded (``hits``) and written
    (``stored``); the rest of the requests were compiled and could not be stored."""

    folder: Path
    requests: int = 0
    hits: int = 0
    stored: int = 0

    def _count(self, event: str, **_kwargs) -> None:
        if event == _REQUEST:
            self.requests += 1
        elif event == _HIT:
            self.hits += 1
        elif event == _WRITE:
            self.stored += 1

    @property
    def compiled(self) -> int:
        return max(self.requests - self.hits, self.stored)

    def summary(self) -> str:
        lost = self.compiled - self.stored
        note = f"; {lost} could not be stored (XLA cannot save oneDNN's products) and compile in every run" \
            if lost else ""
        return f"compile cache: {self.hits} loaded, {self.compiled} compiled, {self.stored} stored{note} ({self.folder})"


def enable_compile_cache(folder: str | os.PathLike | None = None) -> CompileCache | None:
    """Turn on JAX's persistent compilation cache for this process; ``None`` when it is off.

    ``folder`` defaults to ``$FLAXHEADS_COMPILE_CACHE``, else :func:`default_cache_dir`;
    ``FLAXHEADS_COMPILE_CACHE=0`` turns it off. Every compiled program is stored, however quick its
    compile: a run compiles a handful of programs, and each one skipped saves start-up time. A
    program XLA cannot serialize is not (:data:`UNSTORABLE_WARNING`)."""
    env = os.environ.get(CACHE_ENV, "")
    if folder is None and env.strip().lower() in ("0", "off", "false", "no"):
        return None
    import jax

    path = Path(folder or env or default_cache_dir()).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # a read-only home: run without the cache rather than fail
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    warnings.filterwarnings("ignore", message=UNSTORABLE_WARNING, category=UserWarning)
    cache = CompileCache(path)
    jax.monitoring.register_event_listener(cache._count)
    return cache
