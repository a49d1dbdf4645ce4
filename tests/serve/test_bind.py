"""flaxheads.serve.bind: the socket listens before uvicorn takes it, so a client that connects as
soon as the server prints that it is ready (a line printed during the app's startup, before uvicorn
listens) is held in the backlog, not refused."""

import socket

import pytest

pytest.importorskip("starlette", reason="the serve extra is not installed (pip install -e .[serve])")

from flaxheads.serve import bind  # noqa: E402


def test_a_client_connects_before_the_server_runs():
    sock = bind("127.0.0.1", 0)
    try:
        with socket.create_connection(sock.getsockname(), timeout=5) as client:
            conn, _ = sock.accept()  # what uvicorn does once it runs
            client.sendall(b"x")
            assert conn.recv(1) == b"x"
            conn.close()
    finally:
        sock.close()
