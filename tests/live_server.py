"""A real uvicorn server on 127.0.0.1, in a background thread, for tests."""

from __future__ import annotations

import socket
import subprocess
import threading
import time

import httpx
import uvicorn


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, timeout: float = 60, path: str = "/health",
                 process: subprocess.Popen | None = None) -> None:
    """Waits until ``url`` answers ``path`` with 200 (a server process starting up); fails
    after ``timeout`` seconds, or as soon as ``process`` (the server's, if given) exits."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert process is None or process.poll() is None, f"{url} exited before {path} answered"
        assert time.monotonic() < deadline, f"{url} did not answer {path} in {timeout} s"
        time.sleep(0.2)


def stop_process(process: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM, then SIGKILL if ``process`` has not exited ``timeout`` s later."""
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class LiveServer:
    """uvicorn in a background thread; stopped by ``close``."""

    def __init__(self, app):
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
