"""Renders chat templates that requests bring, in a worker process the server can kill.

A client's template is code: in the server's own process nothing could stop one that loops
(a thread cannot be killed) or bound one that prints without end. Here each render runs in
``template_render_worker`` under a memory cap, one at a time, and a render that passes
``timeout_s`` kills the worker (the next render starts a fresh one). Invariants: at most one
worker is alive; at most ``max_waiting`` renders wait for it (more are refused, 503); a caller
waits no longer than its turn plus ``timeout_s`` (plus the worker's start).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

import msgspec

from radixlm.runtime.engine.errors import QueueFull

RENDER_TIMEOUT_S = 10.0
"""How long a client's own template may take to render before its worker is killed and the
request fails."""
RENDER_HEADROOM_BYTES = 1 << 30
"""The memory a render may take beyond the worker's own (a template that prints without end
fails here)."""
MAX_WAITING_RENDERS = 16
"""Renders that may wait for the worker; more fail at once (``QueueFull``, HTTP 503)."""
START_TIMEOUT_S = 120.0
"""How long the worker may take to load the tokenizer."""


class ClientTemplateRenderer:
    """The server's side of the template worker (thread-safe; ``render`` blocks)."""

    def __init__(self, tokenizer_path: str, timeout_s: float = RENDER_TIMEOUT_S,
                 headroom_bytes: int = RENDER_HEADROOM_BYTES,
                 max_waiting: int = MAX_WAITING_RENDERS):
        self.tokenizer_path = tokenizer_path
        self.timeout_s = timeout_s
        self.headroom_bytes = headroom_bytes
        self.max_waiting = max_waiting
        self._turn = threading.Lock()  # held for one render
        self._places = threading.BoundedSemaphore(max_waiting)  # one per render in line
        self._worker: subprocess.Popen | None = None
        self._pending = b""  # bytes read past the last reply's newline
        self._ready = False  # the worker has said it loaded the tokenizer
        self._closed = False
        self._start()  # loads while the server starts, not at the first request

    def render(self, messages: list[dict[str, Any]], kwargs: dict[str, Any],
               max_chars: int) -> str:
        """The prompt text of ``messages`` in the template ``kwargs["chat_template"]``, with
        the other ``kwargs`` as template variables. Raises ``ValueError`` (the request's
        fault: the template failed, rendered past ``max_chars``, its memory cap or
        ``timeout_s``) or ``QueueFull`` (too many renders waiting)."""
        try:
            line = msgspec.json.encode({"messages": messages, "kwargs": kwargs,
                                        "max_chars": max_chars})
        except (TypeError, msgspec.EncodeError) as err:
            raise ValueError(f"the chat template's inputs are not JSON: {err}") from None
        if not self._places.acquire(blocking=False):
            raise QueueFull(f"{self.max_waiting} requests' chat templates are waiting to "
                            "render; try again later")
        try:
            with self._turn:
                reply = self._exchange(line + b"\n")
        finally:
            self._places.release()
        if "error" in reply:
            raise ValueError(f"the chat template failed: {reply['error']}")
        return reply["text"]

    def close(self) -> None:
        """Stops the worker (a render under way fails: its thread sees the pipe close and
        cleans up after it)."""
        self._closed = True
        if self._turn.acquire(blocking=False):
            try:
                self._stop()
            finally:
                self._turn.release()
        elif (worker := self._worker) is not None:
            worker.kill()

    # Internals --------------------------------------------------------------------------

    def _start(self) -> None:
        self._pending, self._ready = b"", False
        self._worker = subprocess.Popen(
            [sys.executable, "-m", "radixlm.runtime.engine.template_render_worker",
             self.tokenizer_path, str(self.headroom_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})

    def _stop(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.kill()
            worker.wait()
            worker.stdin.close()
            worker.stdout.close()

    def _exchange(self, line: bytes) -> dict[str, Any]:
        """Sends one request and reads its reply (with ``_turn`` held)."""
        if self._closed:
            raise QueueFull("the server is shutting down")
        if self._worker is None or self._worker.poll() is not None:
            self._stop()
            self._start()
        if not self._ready:
            self._read_line(time.monotonic() + START_TIMEOUT_S, "start")  # {"ready": true}
            self._ready = True
        try:
            self._worker.stdin.write(line)
            self._worker.stdin.flush()
        except (BrokenPipeError, OSError):
            self._stop()
            raise ValueError("the chat template failed: its renderer stopped") from None
        return self._read_line(time.monotonic() + self.timeout_s, "render")

    def _read_line(self, deadline: float, what: str) -> dict[str, Any]:
        """The worker's next reply, checked for its shape (the worker ran a client's code)."""
        fd = self._worker.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            readable = select.select([fd], [], [], max(left, 0))[0] if left > 0 else []
            if not readable:
                self._stop()
                if what == "start":
                    raise ValueError("the chat template renderer did not start in "
                                     f"{START_TIMEOUT_S} s")
                raise ValueError(f"the request's chat template took over {self.timeout_s} s "
                                 "to render (its renderer was stopped)")
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                self._stop()
                raise ValueError("the chat template failed: its renderer stopped (a template "
                                 f"that needs over {self.headroom_bytes >> 20} MiB ends it)")
            self._pending += chunk
        reply_line, self._pending = self._pending.split(b"\n", 1)
        try:
            reply = msgspec.json.decode(reply_line, type=dict[str, str | bool])
        except msgspec.DecodeError:
            reply = {}
        if not any(isinstance(reply.get(key), kind) for key, kind in REPLY_FIELDS[what]):
            self._stop()
            raise ValueError("the chat template failed: its renderer sent a malformed reply")
        return reply


REPLY_FIELDS = {"start": (("ready", bool),), "render": (("text", str), ("error", str))}
"""What a reply must hold in each phase (one of them, of its type)."""
