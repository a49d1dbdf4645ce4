"""JAX's persistent compilation cache for a program, so a second identical run loads its
executables instead of compiling them again.

The folder is per jax version and per CPU (model name and instruction-set flags): an executable
compiled for one CPU's vector extensions must never run on another that shares the home folder.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from flaxheads.runtime.cpu import cpu_fingerprint

#: ``FLAXHEADS_COMPILE_CACHE``: a folder for the persistent compilation cache, or ``0`` to turn it off.
CACHE_ENV = "FLAXHEADS_COMPILE_CACHE"
# JAX records a "miss" as it writes the new entry
_REQUEST, _HIT, _WRITE = (
    "/jax/compilation_cache/compile_requests_use_cache",
    "/jax/compilation_cache/cache_hits",
    "/jax/compilation_cache/cache_misses",
)

#: JAX's warning when XLA cannot serialize a compiled program. jaxlib 0.12's XLA:CPU fails so on
#: every program with oneDNN's matmul calls: such programs compile again in each run, which
#: :meth:`CompileCache.summary` says; the warning itself is silenced.
UNSTORABLE_WARNING = r"Error writing persistent compilation cache entry for .*: MemoryError: std::bad_alloc"


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/flaxheads/xla/jax-<version>-<cpu>`` (``~/.cache`` when XDG_CACHE_HOME is unset)."""
    import jax

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "flaxheads" / "xla" / f"jax-{jax.__version__}-{cpu_fingerprint()}"


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
        note = (
            f"; {lost} could not be stored (XLA cannot save oneDNN's products) and compile in every run" if lost else ""
        )
        return (
            f"compile cache: {self.hits} loaded, {self.compiled} compiled, {self.stored} stored{note} ({self.folder})"
        )


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
