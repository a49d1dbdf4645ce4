"""The ``flaxheads`` logger as a fresh process finds it, for tests of what a run or a command tells:
no handler, no level set, records propagating (whatever an earlier test in this process left)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from flaxheads.runtime.logs import NAME, use_default_handler


@contextlib.contextmanager
def fresh_logging(install: bool = True) -> Iterator[logging.Logger]:
    """The ``flaxheads`` logger reset to a new process's (``install``: with the handler a run adds);
    its handlers, level and propagation are restored afterwards."""
    logger = logging.getLogger(NAME)
    before = (list(logger.handlers), logger.level, logger.propagate)
    for h in before[0]:
        logger.removeHandler(h)
    logger.setLevel(logging.NOTSET)
    logger.propagate = True
    if install:
        use_default_handler()
    try:
        yield logger
    finally:
        for h in list(logger.handlers):
            logger.removeHandler(h)
        for h in before[0]:
            logger.addHandler(h)
        logger.setLevel(before[1])
        logger.propagate = before[2]
