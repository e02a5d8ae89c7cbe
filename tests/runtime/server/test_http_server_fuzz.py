"""Schemathesis against the server's own /openapi.json: generated requests to every route
must never get a 5xx or crash the server. Requests go over real HTTP to a live server."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from live_server import LiveServer

from radixlm.runtime.server.http_server import create_app

pytestmark = pytest.mark.slow  # ~30 s of generated requests: CI's last stage


@pytest.fixture
def api_schema(engine_for):
    server = LiveServer(create_app(engine_for(max_total_tokens=4096)))
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    schema.config.base_url = server.url
    yield schema
    server.close()


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=50, deadline=None,
          suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_generated_request_gets_a_server_error(case):
    response = case.call(timeout=60)
    assert response.status_code < 500, (case.path, case.body, response.text[:300])
