"""Shared by tito's tests: a server on loopback (a module of its own, so a test can import it by a name
no other test directory uses)."""

from __future__ import annotations

import threading
import time


class LiveServer:
    """tito served by uvicorn on loopback in a background thread."""

    def __init__(self, app, port: int | None = None) -> None:
        import uvicorn

        from molt.vllm_server import free_port

        self.url = f"http://127.0.0.1:{port or free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "tito did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
