"""Work for a client that has gone is stopped, whether or not it streams.

A streaming response notices a disconnect itself (its writes fail and Starlette cancels
it; the stream's cleanup aborts the requests). A non-streaming route only writes when its
result is complete, so without help it runs to the end for nobody: a 2,000-token request,
or a batch of thousands, keeps the scheduler busy after its caller left. This middleware
listens for the disconnect once the body has been read and, if no response has started,
cancels the route; cancelling an Engine call aborts what it queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499
"""The status logged (as nginx does) for a request whose client left before its answer."""


class CancelOnDisconnect:
    """ASGI middleware: a request whose client disconnects before its response starts is
    cancelled.

    Invariant: after the body's last message, only this middleware reads the connection's
    ``receive`` (once: a disconnect is the only message left); the app's later reads wait
    for that message, so a streaming response still sees the disconnect itself.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_read = asyncio.Event()
        after_body: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        response_started = False

        async def app_receive() -> Message:
            if body_read.is_set():
                return await asyncio.shield(after_body)
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_read.set()
                if message["type"] == "http.disconnect" and not after_body.done():
                    after_body.set_result(message)
            return message

        async def app_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        app_task = asyncio.ensure_future(self.app(scope, app_receive, app_send))
        watcher = asyncio.ensure_future(_watch(receive, body_read, after_body))
        try:
            await asyncio.wait({app_task, after_body}, return_when=asyncio.FIRST_COMPLETED)
            if not app_task.done() and not response_started:
                app_task.cancel()
                logger.info("%s %s: the client left before its answer; cancelled (%d)",
                            scope.get("method"), scope.get("path"), CLIENT_CLOSED_REQUEST)
                with contextlib.suppress(asyncio.CancelledError):
                    await app_task
                return
            await app_task
        finally:
            watcher.cancel()
            if not app_task.done():  # this middleware was itself cancelled
                app_task.cancel()


async def _watch(receive: Receive, body_read: asyncio.Event,
                 after_body: asyncio.Future) -> None:
    """Reads the one message that follows the body (a disconnect) into ``after_body``."""
    await body_read.wait()
    if after_body.done():
        return
    message = await receive()
    if not after_body.done():
        after_body.set_result(message)
