"""The training package's user error (bad data has its own, :class:`flaxheads.training.data.DataError`)."""
from __future__ import annotations

from ..errors import FlaxheadsError


class TrainingError(FlaxheadsError):
    """A training setting or input that cannot work; the message says which and how to fix it."""
