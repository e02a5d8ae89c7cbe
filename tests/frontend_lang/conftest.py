"""One default-model Engine for the DSL's tests, reached in-process or through a live server."""

from __future__ import annotations

import pytest
from live_server import LiveServer

import radixlm
from radixlm.runtime.server.http_server import create_app


@pytest.fixture(scope="module")
def default_engine():
    engine = radixlm.Engine()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def default_server(default_engine):
    live = LiveServer(create_app(default_engine))
    yield live
    live.close()


@pytest.fixture(params=["engine", "server"])
def default_backend(request, default_engine):
    """The default model behind the in-process Engine backend and behind RuntimeEndpoint."""
    if request.param == "engine":
        return default_engine
    return radixlm.RuntimeEndpoint(request.getfixturevalue("default_server").url)
