"""The runtime's errors that callers (the Engine's users, the HTTP server) handle by kind."""

from __future__ import annotations


class RuntimeUnavailable(RuntimeError):
    """A runtime process died or the runtime was shut down (HTTP 503)."""


class QueueFull(RuntimeError):
    """More requests are in flight than the runtime accepts (``max_queued_requests``;
    HTTP 503)."""
