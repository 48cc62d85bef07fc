"""A real ``k3bundle serve`` app on a free localhost port, in a thread of the test process."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


@contextlib.contextmanager
def serving(engine):
    """Serve ``engine`` with uvicorn on 127.0.0.1 (a port the OS picks); yields the base URL."""
    import uvicorn

    from k3bundle.serve import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
