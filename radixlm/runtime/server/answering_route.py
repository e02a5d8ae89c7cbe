"""Route classes that answer their own errors in their API's shape (OpenAI's, Anthropic's),
so that the app's handlers for the native API (``{"error": {"message"}}``) never see them;
the app's middleware (API key, body size) still runs first."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute


def answering_route(name: str, answered: tuple[type[Exception], ...],
                    respond: Callable[[Exception], Response]) -> type[APIRoute]:
    """A route class named ``name`` whose handlers answer an ``answered`` error with
    ``respond(err)``; any other error goes on to the app (a 500)."""

    class AnsweringRoute(APIRoute):
        def get_route_handler(self) -> Callable:
            handler = super().get_route_handler()

            async def guarded(request: Request) -> Response:
                try:
                    return await handler(request)
                except answered as err:
                    return respond(err)

            return guarded

    AnsweringRoute.__name__ = AnsweringRoute.__qualname__ = name
    return AnsweringRoute
