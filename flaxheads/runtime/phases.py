"""What the ``flaxheads`` command is doing (its phase), and how a signal ends it in each.

Training has its own handling (:mod:`flaxheads.training.preemption`: the step in flight finishes
and is saved). In every other phase (loading a model, reading or tokenising data, scanning a
stream, evaluating, exporting) SIGTERM and SIGINT end the process at once with one line naming
the phase, exit 143 / 130, even inside a long call into XLA or a reader: Python runs its signal
handlers only between bytecodes, so the command watches a wakeup pipe from a thread instead.

Before it exits, the watcher removes the temporary files and folders that outputs are written
into (:func:`temporary`) and takes the lock an output's final rename holds (:func:`committing`):
an output is either renamed whole before the process ends, or never; nothing is left half written
under its final name, and the previous output stays as it was.

Before the watcher, while the command imports its libraries, :func:`flaxheads.cli.guard_imports`
ends it in one line: the command guards its own imports; ``import flaxheads`` reads no ``sys.argv``."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator

SIGNALS = (signal.SIGTERM, signal.SIGINT)

_stack: list[str] = []
_temps: set[str] = set()
_commit = threading.RLock()


@contextlib.contextmanager
def phase(name: str, *, unless_named: bool = False) -> Iterator[None]:
    """Within the block the process is ``name`` ("loading the model", "exporting", ...);
    ``unless_named``: only where no outer block names the phase (``evaluate`` predicts)."""
    _stack.append(_stack[-1] if unless_named and _stack else name)
    try:
        yield
    finally:
        _stack.pop()


def current() -> str:
    """The innermost phase (``"starting"`` before any)."""
    return _stack[-1] if _stack else "starting"


@contextlib.contextmanager
def temporary(path: str) -> Iterator[str]:
    """``path`` (a temporary file or folder) is removed if a signal ends the process in the block."""
    _temps.add(path)
    try:
        yield path
    finally:
        _temps.discard(path)


@contextlib.contextmanager
def committing() -> Iterator[None]:
    """Hold around the rename that puts an output in place: a signal waits for it to finish."""
    with _commit:
        yield


def _ignore(signum, frame) -> None:
    """The Python-level handler while the watcher acts (the wakeup pipe carries the signal)."""


def exit_line(signum: int, what: str) -> str:
    name = "SIGINT" if signum == signal.SIGINT else "SIGTERM" if signum == signal.SIGTERM else f"signal {signum}"
    return f"interrupted ({name}) while {what}; no partial output was left; rerun the same command"


def _watch(fd: int, write: Callable[[str], None]) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        for signum in data:
            if signal.getsignal(signum) is not _ignore:
                continue  # training (or the server) handles signals itself now
            _commit.acquire()  # never released: a rename in progress completes, none starts after
            for p in list(_temps):
                shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else _remove(p)
            write(exit_line(signum, current()))
            os._exit(128 + signum)


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def watch_signals(write: Callable[[str], None] | None = None) -> bool:
    """Install the command's signal watcher (main thread only; once); False where it cannot be."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is _ignore:
        return False
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    for s in SIGNALS:
        if signal.getsignal(s) != signal.SIG_IGN:  # a shell's background job, nohup: stays ignored
            signal.signal(s, _ignore)
    out = write or (lambda line: (sys.stderr.write(line + "\n"), sys.stderr.flush()))
    threading.Thread(target=_watch, args=(r, out), name="flaxheads-signals", daemon=True).start()
    return True
