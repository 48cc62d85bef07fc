"""``k3bundle serve`` started inside this process for a command that runs against it.

``perf BUNDLE``, ``soak BUNDLE`` and ``faults BUNDLE`` serve the bundle (or checkpoint) here, on a
free 127.0.0.1 port the OS picks, with uvicorn in a thread: the command then measures it as it
would any endpoint, and the server is stopped on the way out, whether the command finished,
failed or was interrupted (Ctrl-C).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from k3bundle.serve.errors import ServeError

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


@contextlib.contextmanager
def serving_engine(engine) -> Iterator[str]:
    """Serve ``engine`` with uvicorn on 127.0.0.1 (a free port); yields the base URL (``…/v1``)."""
    import uvicorn

    from k3bundle.serve import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise ServeError(f"the local server for {engine.name} did not start on 127.0.0.1:{port}")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/v1"
    finally:  # also on an error or Ctrl-C in the body: the thread ends, the port is freed
        server.should_exit = True
        thread.join(STOP_TIMEOUT_S)
        sock.close()


@contextlib.contextmanager
def serving(source: str | Path, device: str = "cpu", **engine_kw) -> Iterator[str]:
    """Load ``source`` (a bundle or checkpoint) on ``device`` and serve it locally; yields the base URL."""
    from k3bundle.serve import Engine, require_extra

    require_extra()  # before the model is read
    with serving_engine(Engine(source, device=device, **engine_kw)) as url:
        yield url
