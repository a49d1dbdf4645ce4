"""What flaxheads tells, and how loud: one decision, here.

Everything a run reports goes through the ``flaxheads`` logger (``logging.getLogger("flaxheads")``
and its children, ``flaxheads.run``, ``flaxheads.training``...); only the progress bar (tqdm) and
the command's own one-line errors are written directly. The levels:

- ``WARNING``: something the user should act on ("could not write the TensorBoard events").
- :data:`SUMMARY` (25, between INFO and WARNING), the library's default: what a notebook run
  shows: one line as it starts (data, model, devices) and the final metrics table.
- ``INFO``, the command's default: the run folder, the compute and memory plans where they
  inform, evaluations as they come, per-class tables, resume lines, timings, the report's path.
- ``DEBUG``: what helps to diagnose (the memory plan on a CPU host, with what it leaves out).

When a run (or the command) starts and the ``flaxheads`` logger has no handler of its own,
flaxheads adds :class:`PlainHandler` (plain lines: below WARNING to stdout, warnings and errors to
stderr, ``warning: `` in front of a warning) and stops the records from also reaching the root
logger's handlers, so a notebook whose root logger has a handler does not show each line twice
(as transformers does with its own logger). To send flaxheads' records to handlers of your own,
add them to ``logging.getLogger("flaxheads")`` before the first run, or call
:func:`use_default_handler` with ``False``; :func:`set_verbosity` (``fh.set_verbosity("info")``)
changes the level."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

#: The library's logger: every other one of flaxheads is its child.
NAME = "flaxheads"
#: Between INFO and WARNING: the start line and the final metrics of a run; the library's default.
SUMMARY = 25
logging.addLevelName(SUMMARY, "SUMMARY")
#: The library's default level (a notebook's); the command's default is INFO.
DEFAULT = SUMMARY

#: ``set_verbosity`` names (any ``logging`` level number is taken too).
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "summary": SUMMARY,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


class PlainHandler(logging.Handler):
    """Each record as a plain line: below WARNING to ``sys.stdout``, the rest to ``sys.stderr``, a
    warning with ``warning: `` in front. The streams are looked up per record, so output redirected
    after the handler was made (``contextlib.redirect_stdout``, a notebook cell's capture) follows."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.levelno == logging.WARNING and not text.startswith("warning:"):
                text = f"warning: {text}"
            stream = sys.stdout if record.levelno < logging.WARNING else sys.stderr
            if stream is None:  # pythonw, a closed stream: nowhere to write
                return
            stream.write(text + "\n")
            stream.flush()
        except Exception:  # a logging call never raises into the run
            self.handleError(record)


def get_logger(name: str | None = None) -> logging.Logger:
    """The ``flaxheads`` logger, or its child ``flaxheads.<name>`` (a module's ``__name__`` as it is)."""
    if name and not (name == NAME or name.startswith(NAME + ".")):
        name = f"{NAME}.{name}"
    return logging.getLogger(name or NAME)


def use_default_handler(on: bool = True) -> None:
    """``on``: the ``flaxheads`` logger gets :class:`PlainHandler` unless it has a handler of its own
    (the records then stop at it), and the level :data:`DEFAULT` unless one was set. ``False``:
    flaxheads' handler is removed and the records reach the root logger's handlers again."""
    root = logging.getLogger(NAME)
    ours = [h for h in root.handlers if isinstance(h, PlainHandler)]
    if not on:
        for h in ours:
            root.removeHandler(h)
        root.propagate = True
        return
    if not root.handlers:
        root.addHandler(PlainHandler())
        root.propagate = False
    if root.level == logging.NOTSET:
        root.setLevel(DEFAULT)


def level_of(level: str | int) -> int:
    """A level by name (:data:`LEVELS`, any case) or number."""
    if isinstance(level, int):
        return level
    key = str(level).strip().lower()
    if key not in LEVELS:
        from flaxheads.errors import UsageError

        raise UsageError(f"verbosity {level!r}: expected one of {', '.join(LEVELS)} (or a logging level number)")
    return LEVELS[key]


def set_verbosity(level: str | int) -> None:
    """How much flaxheads tells: ``"debug"``, ``"info"``, ``"summary"`` (the default: a run's start
    line and final metrics), ``"warning"`` (only what needs acting on), ``"error"``. Installs
    flaxheads' handler first where the ``flaxheads`` logger has none (:func:`use_default_handler`)."""
    number = level_of(level)
    use_default_handler()
    logging.getLogger(NAME).setLevel(number)


@contextlib.contextmanager
def verbosity(level: str | int | None) -> Iterator[None]:
    """Within the block flaxheads reports at ``level`` (None: as set); the level before is restored
    after it (the command's ``-q`` / ``-v``)."""
    root = logging.getLogger(NAME)
    before = root.level
    if level is not None:
        set_verbosity(level)
    try:
        yield
    finally:
        if level is not None:
            root.setLevel(before)


def quiet_background_saves() -> None:
    """A failed asynchronous save is reported by the command in one line
    (:class:`~flaxheads.errors.WriteFailedError`); without this, Orbax logs it from each of its
    threads, asyncio logs its unretrieved tasks, and tensorstore's pending writes report the closed
    event loop they call back into: hundreds of lines of tracebacks."""
    # filters, not levels: importing orbax or jax may reset the absl logger's level
    logging.getLogger("absl").addFilter(lambda record: record.levelno >= logging.CRITICAL)
    logging.getLogger("asyncio").addFilter(lambda record: "orbax" not in record.getMessage())
    default = sys.unraisablehook

    def unraisable(u) -> None:
        if "Event loop is closed" in str(u.exc_value) or "orbax" in repr(u.object):
            return
        default(u)

    sys.unraisablehook = unraisable
