"""The prefill server's bootstrap service speaks SGLang's ``/route`` shapes, and a decode
server's lookups in it never block and report a dead service clearly."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from live_server import free_port

from radixlm.runtime.disaggregation.bootstrap import BootstrapDirectory, BootstrapServer, register
from radixlm.runtime.disaggregation.kv_rows import KVLayout

LAYOUT = KVLayout("bfloat16", [[2, 16]] * 4, 1)


@pytest.fixture
def service():
    port = free_port()
    server = BootstrapServer("127.0.0.1", port, LAYOUT)
    yield f"127.0.0.1:{port}"
    server.close()


def test_a_registered_rank_is_found_with_sglangs_queries(service):
    register(service, {"role": "Prefill", "attn_tp_rank": 0, "system_dp_rank": 0,
                       "pp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": 4567})
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
    bad = httpx.put(base, json={"rank_ip": 5, "rank_port": 1})
    assert bad.status_code == 400 and "rank_ip" in bad.text


def test_the_directory_looks_up_off_the_callers_thread(service):
    register(service, {"rank_ip": "10.0.0.2", "rank_port": 9000})
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
