"""The errors flaxheads raises for a user's mistake: every one is a :class:`FlaxheadsError`.

Programs (``flaxheads ...``) print ``error: <message>`` and exit 2 for these; anything else
is a bug in flaxheads and keeps its traceback."""
from __future__ import annotations


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
    :class:`flaxheads.tables.DataError`."""
