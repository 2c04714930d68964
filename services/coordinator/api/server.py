"""Serving an app with uvicorn on a background thread (embedding, single-process runs, tests)."""

from __future__ import annotations

import threading
import time

import uvicorn
from fastapi import FastAPI


class ServerThread:
    """`with ServerThread(app) as server: server.url` — port 0 picks a free port."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="uvicorn", daemon=True)
        self.host = host
        self.port = port

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the HTTP server exited during startup (see the log above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the HTTP server did not start within {timeout} s")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
