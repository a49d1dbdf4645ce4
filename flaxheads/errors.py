"""The errors flaxheads raises for a user's mistake: every one is a :class:`FlaxheadsError`.

Programs (``flaxheads ...``) print ``error: <message>`` and exit 2 for these; anything else
is a bug in flaxheads and keeps its traceback."""

from __future__ import annotations

import errno
import os
import re


class FlaxheadsError(ValueError):
    """Base of every user-facing error: the message says what was wrong, what was expected and how to fix it.

    A ``ValueError`` so code that caught the library's ``ValueError`` before keeps working."""


class UsageError(FlaxheadsError):
    """A command-line flag or argument that is missing, malformed or out of range (or two that conflict)."""


class ConfigError(FlaxheadsError):
    """A pooler, head, loss or model setting that is unknown, malformed or inconsistent with another."""


class TrainingError(FlaxheadsError):
    """A training or device-placement setting or input that cannot work (parallel mode, mesh,
    optimizer, packing, ...); the message says which and how to fix it. Bad data has its own,
    :class:`flaxheads.data.tables.DataError`."""


class WriteFailedError(FlaxheadsError):
    """Writing a checkpoint or an export failed on the way (disk full, read-only, quota): the
    message names the path and the cause, and what was kept. Not the user's mistake in the
    command line: programs exit 1 (:attr:`exit_code`), not 2."""

    exit_code = 1


#: The errors a write meets on a bad disk (full, too large for a limit, read-only, quota, permissions, I/O).
WRITE_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EROFS, errno.EDQUOT, errno.EACCES, errno.EIO)
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")  # how tensorstore reports the errno of a failed write


def os_error_cause(err: BaseException) -> str | None:
    """The OS reason behind ``err`` ("No space left on device", "File too large", ...), from an
    ``OSError`` in its chain or the errno in tensorstore's message; None when there is none."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]  # __cause__ / __context__ may be None
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return os.strerror(e.errno)
        m = _OS_ERROR_CODE.search(str(e))
        if m:
            return os.strerror(int(m.group(1)))
        for known in map(os.strerror, WRITE_ERRNOS):
            if known in str(e):
                return known
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return None


def one_line(error: BaseException) -> str:
    """The message of ``error`` on one line (what the command line prints): its lines joined with
    ``; `` (a space after a ``:``)."""
    text = ""
    for line in (x.strip() for x in str(error).splitlines()):
        if line:
            text += line if not text else (" " if text.endswith(":") else "; ") + line
    return text or type(error).__name__
