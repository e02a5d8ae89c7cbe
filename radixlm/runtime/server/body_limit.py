"""A limit on request bodies that holds whether their length is declared or not.

A ``Content-Length`` over the limit is refused before anything is read. A body sent without
one (chunked transfer encoding) is counted as it arrives, and reading stops with a 413 as
soon as it passes the limit, so no upload of any framing is read, parsed or held past it.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(HTTPException):
    """Raised from a request's ``receive`` once its body passes the limit (an HTTP
    exception, so that a framework parsing the body passes it on rather than wrapping it)."""

    def __init__(self, limit: int):
        super().__init__(413, f"request bodies are limited to {limit} bytes")


def too_large_response(err: BodyTooLarge) -> JSONResponse:
    """The 413 answer, in the server's error shape."""
    return JSONResponse({"error": {"message": err.detail}}, status_code=413)


class BodySizeLimit:
    """ASGI middleware: bodies over ``limit`` bytes end in ``BodyTooLarge`` (413)."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await too_large_response(BodyTooLarge(self.limit))(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, counted, send)
