"""The prefill server's bootstrap service speaks SGLang's ``/route`` shapes, trusts no
stranger (registrations need the secret, are checked and bounded; idle and surplus
connections are let go), and a decode server's lookups in it never block and report a dead
service clearly."""

from __future__ import annotations

import contextlib
import socket
import time

import httpx
import pytest
from live_server import free_port

from radixlm.runtime.disaggregation import bootstrap as bootstrap_module
from radixlm.runtime.disaggregation.bootstrap import (
    MAX_CONNECTIONS,
    MAX_RANK,
    MAX_RANKS,
    BootstrapDirectory,
    BootstrapServer,
    register,
)
from radixlm.runtime.disaggregation.kv_rows import KVLayout

LAYOUT = KVLayout("bfloat16", [[2, 16]] * 4, 1)
SECRET = "cluster-secret"
RANK = {"rank_ip": "127.0.0.1", "rank_port": 4567}


@pytest.fixture
def service():
    port = free_port()
    server = BootstrapServer("127.0.0.1", port, LAYOUT, SECRET)
    yield f"127.0.0.1:{port}"
    server.close()


def put(service: str, body, secret: str | None = SECRET) -> httpx.Response:
    headers = {} if secret is None else {"Authorization": f"Bearer {secret}"}
    return httpx.put(f"http://{service}/route", json=body, headers=headers)


def test_a_registered_rank_is_found_with_sglangs_queries(service):
    register(service, {"role": "Prefill", "attn_tp_rank": 0, "system_dp_rank": 0,
                       "pp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": 4567}, SECRET)
    base = f"http://{service}/route"
    shape = httpx.get(base, params=dict(engine_rank=-1, target_dp_group=-1,
                                        target_pp_rank=-1)).json()
    assert shape["prefill_attn_tp_size"] == shape["prefill_dp_size"] == 1
    assert shape["page_size"] == 1 and shape["kv_cache_dtype"] == "bfloat16"
    rank = httpx.get(base, params=dict(engine_rank=0, target_dp_group=0, target_pp_rank=0))
    assert rank.json() == {"rank_ip": "127.0.0.1", "rank_port": 4567}
    missing = httpx.get(base, params=dict(engine_rank=1, target_dp_group=0, target_pp_rank=0))
    assert missing.status_code == 404
    assert httpx.get(base, params={"engine_rank": "x"}).status_code == 400
    assert httpx.get(f"http://{service}/health").text == "OK"
    bad = put(service, {"rank_ip": 5, "rank_port": 1})
    assert bad.status_code == 400 and "rank_ip" in bad.text


@pytest.mark.parametrize("secret", [None, "Bearer", "wrong", SECRET + "x", "Bearer " + SECRET])
def test_a_registration_without_the_secret_is_refused_and_changes_nothing(service, secret):
    register(service, RANK, SECRET)
    stranger = put(service, {"rank_ip": "203.0.113.9", "rank_port": 1}, secret)
    assert stranger.status_code == 401
    rank = httpx.get(f"http://{service}/route",
                     params=dict(engine_rank=0, target_dp_group=0, target_pp_rank=0))
    assert rank.json() == RANK


@pytest.mark.parametrize("body, field", [
    ({"rank_ip": "a b", "rank_port": 1}, "rank_ip"),
    ({"rank_ip": "x" * 300, "rank_port": 1}, "rank_ip"),
    ({"rank_ip": "127.0.0.1", "rank_port": 70000}, "rank_port"),
    ({"rank_ip": "127.0.0.1", "rank_port": True}, "rank_port"),
    ({**RANK, "attn_tp_rank": 2**40}, "attn_tp_rank"),
    ({**RANK, "system_dp_rank": -1}, "system_dp_rank"),
    ({**RANK, "pp_rank": "0"}, "pp_rank"),
    ([RANK], "JSON object"),
])
def test_a_registration_is_checked(service, body, field):
    reply = put(service, body)
    assert reply.status_code == 400 and field in reply.text, reply.text


@pytest.mark.slow  # registers ranks up to the bound
def test_the_registry_holds_a_bounded_number_of_ranks(service):
    for rank in range(MAX_RANKS):
        assert put(service, {**RANK, "attn_tp_rank": rank % MAX_RANK,
                             "system_dp_rank": rank // MAX_RANK}).status_code == 200
    full = put(service, {**RANK, "attn_tp_rank": MAX_RANKS % MAX_RANK, "pp_rank": 1})
    assert full.status_code == 400 and "registry holds" in full.text
    assert put(service, {**RANK, "rank_port": 4568}).status_code == 200  # a known rank moves


def test_idle_and_surplus_connections_are_let_go(service, monkeypatch):
    """Connections that send nothing are closed after the idle timeout (shortened here), and
    beyond MAX_CONNECTIONS at once new ones are closed unanswered; then it serves again."""
    monkeypatch.setattr(bootstrap_module._BootstrapHandler, "timeout", 1.0)
    host, port = service.split(":")
    idle = [socket.create_connection((host, int(port))) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        surplus = socket.create_connection((host, int(port)))
        surplus.settimeout(5)
        surplus.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        with contextlib.suppress(ConnectionResetError):
            assert surplus.recv(100) == b""  # closed, not answered
        surplus.close()
        idle[0].settimeout(5)
        assert idle[0].recv(100) == b""  # the server closed it (after 1 s here)
    finally:
        for connection in idle:
            connection.close()
    deadline = time.monotonic() + 10
    while True:
        try:
            if httpx.get(f"http://{service}/health", timeout=2).text == "OK":
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_the_directory_looks_up_off_the_callers_thread(service):
    register(service, {"rank_ip": "10.0.0.2", "rank_port": 9000}, SECRET)
    directory = BootstrapDirectory()
    silent = socket.create_server(("127.0.0.1", 0))  # takes connections, never answers
    try:
        hung = f"127.0.0.1:{silent.getsockname()[1]}"
        assert directory.peer(hung) is None  # asked: the lookup hangs on a thread, not here
        assert directory.peer(hung) is None
        deadline = time.monotonic() + 10
        while (peer := directory.peer(service)) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert peer.endpoint == "tcp://10.0.0.2:9000" and peer.layout == LAYOUT
        dead = f"127.0.0.1:{free_port()}"
        while (answer := directory.peer(dead)) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert "did not answer" in answer and dead in answer
    finally:
        silent.close()  # resets the hung lookup's connection
        directory.close()
