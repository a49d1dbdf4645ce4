"""Running the app: uvicorn on a socket bound here (so port 0 works and the address is known
before the model warms up), 127.0.0.1 unless told otherwise; SIGTERM / SIGINT stop taking
connections, answer every request in flight, and return normally (exit 0)."""

from __future__ import annotations

import signal
import socket
import threading

from starlette.applications import Starlette

#: Seconds the in-flight requests get to finish after SIGTERM before their connections are closed.
GRACEFUL_SHUTDOWN_S = 30


#: Connections the kernel holds for the server before it accepts them (while it warms up, too).
BACKLOG = 2048


def bind(host: str = "127.0.0.1", port: int = 8080) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one).

    It listens from here on, not from when uvicorn starts: a client that connects once the
    server says it is ready (its ``serving ...`` line comes from the app's startup, before uvicorn
    takes the socket) waits in the backlog for its answer instead of being refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(BACKLOG)
    sock.set_inheritable(True)
    return sock


def run(app: Starlette, sock: socket.socket, *, log_level: str = "warning") -> int:
    """Serve ``app`` on ``sock`` until SIGTERM / SIGINT (or the server is told to stop); drains
    the requests in flight and returns 0."""
    import uvicorn

    # asyncio + h11 whatever else is installed: the stack the tests cover (uvloop + httptools served
    # MiniLM no faster under bench/serve_load.py, 39.5 req/s at concurrency 64 against 34-46)
    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        loop="asyncio",
        http="h11",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it has drained, to the handler that was
    # there before it: a handler that does nothing turns a drained shutdown into a normal return
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)} if main else {}
    # and the signals reach no wakeup pipe meanwhile: the command's watcher (flaxheads.runtime.phases)
    # reads that pipe from a thread, and a byte of uvicorn's re-raise read after the command's handler
    # is back would end a drained server with 143 instead of 0
    wakeup = signal.set_wakeup_fd(-1) if main else -1
    try:
        server.run(sockets=[sock])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if wakeup != -1:
            signal.set_wakeup_fd(wakeup, warn_on_full_buffer=False)
    return 0
