"""Run an ASGI app with uvicorn on a background thread, on a free port: for tests, not product code."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager


@contextmanager
def running(app, host: str = "127.0.0.1", port: int = 0, shutdown_timeout_s: float = 30.0):
    """Run `app` with uvicorn on a background thread; yields (base URL, uvicorn server)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=shutdown_timeout_s))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        if not thread.is_alive() or time.time() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()
    try:
        yield f"http://{bound[0]}:{bound[1]}", server
    finally:
        server.should_exit = True
        thread.join(timeout=shutdown_timeout_s + 10)
