"""glibc heap settings for programs that run XLA:CPU step after step.

One arena, no ``mmap`` for big blocks, no trimming. XLA:CPU allocates each execution's outputs and
temporaries afresh on its worker threads; glibc serves blocks over 32 MiB (and, in a thread's arena,
over 64 MiB whatever the settings) with a fresh ``mmap`` and unmaps them on free, so every step
faulted its big buffers in again (MiniLM train step at 16 x 128: 153k page faults, ~600 MB, per
step). Kept in one heap they are reused: 0 faults in most runs, the step ~13% faster and the AdamW
pass 78 -> 46 ms (2-core AMD EPYC); in some runs part of them still fault, as threads that allocated
before the call keep arenas.
"""

from __future__ import annotations

import ctypes
import os
import platform

from flaxheads.runtime.cpu import backend_started

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
    if os.environ.get(MALLOC_OPT_OUT_ENV, "1") == "0" or backend_started() or platform.libc_ver()[0] != "glibc":
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


def release_free_memory() -> None:
    """Give the pages of freed heap blocks back to the system (glibc's ``malloc_trim``; elsewhere a
    no-op). For a one-off phase that frees what it allocated, block after block (a lazy load that
    quantises each kernel as it reads it): glibc keeps freed heap memory mapped, and the holes the
    float kernels left between the codes that stay held its RSS near the float base's size."""
    if platform.libc_ver()[0] != "glibc":
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # pragma: no cover - a glibc without malloc_trim
        pass
