"""Process-level XLA settings that flaxheads' programs apply before JAX starts a backend.

Importing flaxheads never changes XLA's configuration: the ``train`` program and the
benchmarks call :func:`configure_xla` first thing, and a script that wants the same
settings calls it before its first JAX computation.

Why these flags (measured on a 2-core x86 CPU, MiniLM, batch 32 x 128 tokens, bench/):

* ``--xla_cpu_experimental_ynn_fusion_type=`` turns off XLA:CPU's YNNPACK fusions (jaxlib
  0.10 routes dots *and* reductions through them). With them off, dots go to Eigen and
  reductions stay inside XLA's own loop fusions: the train step is ~12% faster and the
  forward ~7% faster (alternating separate-process runs). Results agree to float32 rounding.

:func:`enable_compile_cache` turns on JAX's persistent compilation cache for a program, so a
second identical run loads its executables instead of compiling them again. The folder is
per jax version and per CPU (model name and instruction-set flags): an executable compiled
for one CPU's vector extensions must never run on another that shares the home folder.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shlex
from dataclasses import dataclass
from pathlib import Path

#: Flags applied by :func:`configure_xla` on CPU hosts, with the reason in the module docstring.
CPU_FLAGS: tuple[str, ...] = ("--xla_cpu_experimental_ynn_fusion_type=",)

#: Set to ``0`` to make :func:`configure_xla` a no-op (e.g. to compare against XLA's defaults).
OPT_OUT_ENV = "FLAXHEADS_XLA_DEFAULTS"


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - jax not importable: nothing started
        return False
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if callable(started) else False


def configure_xla(flags: tuple[str, ...] = CPU_FLAGS) -> list[str]:
    """Append ``flags`` to ``XLA_FLAGS`` for this process; returns the flags it added.

    A flag whose name the user already set in ``XLA_FLAGS`` is left as the user set it.
    Does nothing (returns ``[]``) when ``FLAXHEADS_XLA_DEFAULTS=0`` or when JAX has already
    started a backend in this process (flags are read once, at backend start)."""
    if os.environ.get(OPT_OUT_ENV, "1") == "0" or _backend_started():
        return []
    current = shlex.split(os.environ.get("XLA_FLAGS", ""))
    names = {f.split("=", 1)[0] for f in current}
    added = [f for f in flags if f.split("=", 1)[0] not in names]
    if added:
        os.environ["XLA_FLAGS"] = " ".join(current + added)
    return added


#: ``FLAXHEADS_COMPILE_CACHE``: a folder for the persistent compilation cache, or ``0`` to turn it off.
CACHE_ENV = "FLAXHEADS_COMPILE_CACHE"
_HIT, _MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"


def cpu_fingerprint() -> str:
    """A short hash of this host's CPU model and instruction-set flags (``/proc/cpuinfo`` where there is one)."""
    text = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            # the first processor's model and flags; the other cores repeat them
            text += "".join(ln for ln in f.read().split("\n\n")[0].splitlines()
                            if ln.startswith(("model name", "flags", "Features", "CPU part")))
    except OSError:
        pass
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/flaxheads/xla/jax-<version>-<cpu>`` (``~/.cache`` when XDG_CACHE_HOME is unset)."""
    import jax

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "flaxheads" / "xla" / f"jax-{jax.__version__}-{cpu_fingerprint()}"


@dataclass
class CompileCache:
    """Where the persistent compilation cache lives and how this process used it so far."""

    folder: Path
    hits: int = 0
    misses: int = 0

    def _count(self, event: str, **_kwargs) -> None:
        if event == _HIT:
            self.hits += 1
        elif event == _MISS:
            self.misses += 1

    def summary(self) -> str:
        return f"compile cache: {self.hits} loaded, {self.misses} compiled and stored ({self.folder})"


def enable_compile_cache(folder: str | os.PathLike | None = None) -> CompileCache | None:
    """Turn on JAX's persistent compilation cache for this process; ``None`` when it is off.

    ``folder`` defaults to ``$FLAXHEADS_COMPILE_CACHE``, else :func:`default_cache_dir`;
    ``FLAXHEADS_COMPILE_CACHE=0`` turns it off. Every compiled program is stored, however quick its
    compile: a run compiles a handful of programs, and each one skipped saves start-up time."""
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
    cache = CompileCache(path)
    jax.monitoring.register_event_listener(cache._count)
    return cache
