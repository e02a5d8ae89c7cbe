"""The API key: where it comes from, and the check that guards every route but /health.

A key given as ``--api-key`` shows in ``ps`` to every user of the machine, so it may also
come from the environment (``RADIXLM_API_KEY``) or a file (``--api-key-file``, its first
line). The check is ASGI middleware, not Starlette's ``BaseHTTPMiddleware``, so the routes
keep the connection's own ``receive`` (and with it the client's disconnect).
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

API_KEY_ENV = "RADIXLM_API_KEY"
OPEN_ROUTES = frozenset({"/health"})


def resolve_api_key(api_key: str | None, api_key_file: str | None) -> str | None:
    """The key from ``api_key``, else ``api_key_file``'s first line, else the environment's
    ``RADIXLM_API_KEY``; None: no key. Raises ``ValueError`` for two sources at once, an
    unreadable or empty file, or an empty key."""
    if api_key is not None and api_key_file is not None:
        raise ValueError("give api_key or api_key_file, not both")
    if api_key_file is not None:
        try:
            lines = Path(api_key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"api_key_file {api_key_file!r} cannot be read: {err}") from None
        api_key = lines[0].strip() if lines else ""
        if not api_key:
            raise ValueError(f"api_key_file {api_key_file!r} holds no key on its first line")
    elif api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None
    if api_key is not None and not api_key.strip():
        raise ValueError("the API key is empty")
    return api_key


class ApiKeyCheck:
    """ASGI middleware: without ``Authorization: Bearer <key>`` (the scheme in any case) or
    ``x-api-key: <key>`` (what Anthropic's clients send), the key compared in constant time,
    every HTTP route but ``OPEN_ROUTES`` answers 401."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_ROUTES:
            headers = dict(scope.get("headers", ()))
            scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
            bearer = scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(),
                                                                         self.expected)
            anthropic = hmac.compare_digest(headers.get(b"x-api-key", b"").strip(),
                                            self.expected)
            if not (bearer or anthropic):
                response = JSONResponse({"error": {"message": "invalid or missing API key"}},
                                        status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
