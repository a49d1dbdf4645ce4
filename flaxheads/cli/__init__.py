"""The ``flaxheads`` command line: ``flaxheads train | plan | export | checkpoints | predict | embed | evaluate
| rank | serve`` (:mod:`.main`).

:func:`entry` is the command itself (the console script, and ``python -m flaxheads``): it guards
the imports first, then imports the command's libraries. It imports nothing itself, so that a
signal while jax, flax and orbax load ends the command in one line, not a traceback; a program
that imports flaxheads as a library keeps its own signal handling."""

import os
import signal
import sys
import threading

#: What the guard prints: the process was ended while it was still importing its libraries.
IMPORT_INTERRUPTED = (
    "interrupted ({name}) while starting (importing its libraries); nothing was written; rerun the same command"
)


def _end_on_signal(signum, frame) -> None:
    sys.stderr.write(IMPORT_INTERRUPTED.format(name=signal.Signals(signum).name) + "\n")
    sys.stderr.flush()
    os._exit(128 + signum)


def guard_imports() -> bool:
    """Until the command installs its own watcher (:func:`flaxheads.runtime.phases.watch_signals`),
    SIGTERM / SIGINT end the process with one line. Main thread only, and only where no handler of
    the caller's is set (a shell's ignored signal stays ignored); False where nothing was installed."""
    if threading.current_thread() is not threading.main_thread():
        return False
    installed = False
    for s in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(s) in (signal.SIG_DFL, signal.default_int_handler):
            signal.signal(s, _end_on_signal)
            installed = True
    return installed


def entry() -> int:
    """The ``flaxheads`` command: guard the imports, then run :func:`flaxheads.cli.main.main` on ``sys.argv``."""
    guard_imports()
    try:
        from flaxheads.cli.main import main
    except KeyboardInterrupt:  # no guard (a handler of the caller's): nothing started, nothing to keep
        print("interrupted; nothing was being saved", file=sys.stderr, flush=True)
        return 130
    return main()
