"""Process-level XLA settings that flaxheads' programs apply before JAX starts a backend.

Importing flaxheads never changes XLA's configuration: the ``train`` program and the
benchmarks call :func:`configure_xla` first thing, and a script that wants the same
settings calls it before its first JAX computation.

Why these flags (measured on a 2-core x86 CPU, MiniLM, batch 32 x 128 tokens, bench/):

* ``--xla_cpu_experimental_ynn_fusion_type=`` turns off XLA:CPU's YNNPACK fusions (jaxlib
  0.10 routes dots *and* reductions through them). With them off, dots go to Eigen and
  reductions stay inside XLA's own loop fusions: the train step is ~12% faster and the
  forward ~7% faster (alternating separate-process runs). Results agree to float32 rounding.
"""
from __future__ import annotations

import os
import shlex

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
