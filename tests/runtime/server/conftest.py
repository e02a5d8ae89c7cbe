"""Fixtures of the HTTP server's tests."""

from __future__ import annotations

import pytest
from live_server import LiveServer

from radixlm.runtime.server.http_server import create_app


@pytest.fixture
def live(engine_for):
    """Starts (per call) a real server on 127.0.0.1 over ``engine_for(**options)``; returns
    its URL. The servers stop after the test."""
    servers = []

    def start(**options):
        server = LiveServer(create_app(engine_for(**options)))
        servers.append(server)
        return server.url

    yield start
    for server in servers:
        server.close()

