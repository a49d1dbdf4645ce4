"""What a command's process logs: one line per failed save, not every writer thread's traceback."""

from __future__ import annotations

import logging
import sys


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
