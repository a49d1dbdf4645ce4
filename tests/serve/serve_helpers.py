"""A server on 127.0.0.1 in a thread of the test process, for the tests of flaxheads.serve."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

import pytest

uvicorn = pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install -e .[serve])")
pytest.importorskip("starlette", reason="the serve extra is not installed (pip install -e .[serve])")


# the tiny models and texts of the prediction tests (tests/predict/predict_helpers.py)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "predict"))


@contextlib.contextmanager
def serving(app, timeout: float = 300.0):
    """``app`` on a free 127.0.0.1 port until the block ends; yields its base URL."""
    from flaxheads.serve import bind

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", loop="asyncio", http="h11")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
