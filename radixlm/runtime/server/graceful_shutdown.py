"""Shutting down on SIGTERM without losing an answer.

uvicorn on its own stops accepting connections, waits a few seconds, then cancels what is
still running: a non-streaming caller gets a 500 or a cut connection, a stream ends without
an error event. ``DrainingServer`` drains first: on the first SIGTERM (or SIGINT) the Engine
refuses new requests (503, and ``/health`` answers 503 so a router stops sending), the
requests in flight get ``grace_s`` seconds to finish, and the rest end with an error the
caller sees (503, or a stream's error event); only then does uvicorn stop. A second signal
stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

from radixlm.runtime.engine.engine import Engine

logger = logging.getLogger(__name__)

SHUTDOWN_REASON = "the server is shutting down"


class DrainingServer(uvicorn.Server):
    """A uvicorn server that drains ``engine`` before it stops (see the module)."""

    def __init__(self, config: uvicorn.Config, engine: Engine, grace_s: float):
        super().__init__(config)
        self.engine = engine
        self.grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        """The first stop signal starts the drain; a second one (or one before the server
        runs) is uvicorn's own: stop now."""
        if self._drain is not None or self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self._captured_signals.append(sig)  # re-raised after the server stops, as uvicorn does
        self._loop.call_soon_threadsafe(self._start_drain, sig)

    def _start_drain(self, sig: int) -> None:
        if self._drain is None:
            logger.info("%s: draining (at most %.0f s) before stopping",
                        signal.Signals(sig).name, self.grace_s)
            self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.engine.async_drain(self.grace_s, SHUTDOWN_REASON)
        except Exception:  # a dead runtime has nothing to drain
            logger.exception("draining failed; stopping now")
        self.should_exit = True
