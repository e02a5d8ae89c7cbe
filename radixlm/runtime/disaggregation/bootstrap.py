"""The bootstrap service of a prefill server, and the decode side's lookups in it.

A prefill server listens on ``disaggregation_bootstrap_port`` with SGLang's routes:

- ``PUT /route``: a prefill rank registers where it takes KV requests (JSON with
  ``rank_ip``, ``rank_port``, ``attn_tp_rank``, ``system_dp_rank``, ``pp_rank``; answered
  ``OK``). radixlm's scheduler registers itself this way, in process.
- ``GET /route?engine_rank=-1&target_dp_group=-1&target_pp_rank=-1``: the prefill
  server's shape (``prefill_attn_tp_size``, ``prefill_dp_size``, ``prefill_pp_size``),
  plus radixlm's ``kv_layout`` (page size, KV dtype, per-buffer row shapes), which a
  decode server checks against its own before it asks for any KV.
- ``GET /route?engine_rank=R&target_dp_group=D&target_pp_rank=P``: that rank's
  ``rank_ip`` and ``rank_port``; 404 when no such rank registered.
- ``GET /health``: ``OK``.

SGLang's router never calls it: it only tells the decode server (``bootstrap_host``,
``bootstrap_port``) where to look. A decode scheduler looks up each prefill server once,
off its loop (``BootstrapDirectory``).
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import msgspec

from radixlm.runtime.disaggregation.kv_rows import KVLayout

logger = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 5.0
MAX_BODY_BYTES = 1 << 16
RANK_FIELDS = {"rank_ip": str, "rank_port": int}


class BootstrapServer:
    """The registry of a prefill server's ranks, served over HTTP from a daemon thread.
    Binding fails (``OSError``) when the port is taken."""

    def __init__(self, host: str, port: int, layout: KVLayout):
        self.layout = layout
        self.ranks: dict[tuple[int, int, int], dict] = {}  # (dp, tp, pp) -> rank_ip/port
        self.lock = threading.Lock()
        handler = type("Handler", (_BootstrapHandler,), {"registry": self})
        self.http = ThreadingHTTPServer((host.strip("[]"), port), handler)
        self.http.daemon_threads = True
        self.thread = threading.Thread(target=self.http.serve_forever, name="bootstrap",
                                       daemon=True)
        self.thread.start()

    def register(self, info: dict) -> None:
        """Records a rank (``PUT /route``'s body). Raises ``ValueError`` for a bad one."""
        for name, kind in RANK_FIELDS.items():
            if not isinstance(info.get(name), kind) or isinstance(info.get(name), bool):
                raise ValueError(f"{name} must be a {kind.__name__}")
        key = tuple(int(info.get(k, 0)) for k in ("system_dp_rank", "attn_tp_rank", "pp_rank"))
        with self.lock:
            self.ranks[key] = {"rank_ip": info["rank_ip"], "rank_port": info["rank_port"]}

    def lookup(self, query: dict[str, list[str]]) -> tuple[int, dict | str]:
        try:
            rank, dp, pp = (int(query[k][0]) for k in
                            ("engine_rank", "target_dp_group", "target_pp_rank"))
        except (KeyError, ValueError):
            return 400, "engine_rank, target_dp_group and target_pp_rank are required integers"
        if rank == dp == pp == -1:
            return 200, {"prefill_attn_tp_size": 1, "prefill_dp_size": 1,
                         "prefill_pp_size": 1, "page_size": self.layout.page_size,
                         "kv_cache_dtype": self.layout.dtype,
                         "kv_layout": msgspec.to_builtins(self.layout)}
        with self.lock:
            found = self.ranks.get((dp, rank, pp))
        return (200, found) if found else (404, f"no prefill rank {rank} of dp group {dp}")

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


class _BootstrapHandler(BaseHTTPRequestHandler):
    registry: BootstrapServer

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == "/health":
            return self._answer(200, "OK")
        if url.path != "/route":
            return self._answer(404, "not found")
        return self._answer(*self.registry.lookup(parse_qs(url.query)))

    def do_PUT(self) -> None:
        if urlsplit(self.path).path != "/route":
            return self._answer(404, "not found")
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_BODY_BYTES:
            return self._answer(400, "a JSON body of at most 64 KiB is required")
        try:
            self.registry.register(json.loads(self.rfile.read(length)))
        except (ValueError, AttributeError, TypeError) as err:
            return self._answer(400, f"bad registration: {err}")
        return self._answer(200, "OK")

    def _answer(self, status: int, body: dict | str) -> None:
        data = (json.dumps(body) if isinstance(body, dict) else body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if isinstance(body, dict)
                         else "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
        logger.debug("bootstrap: " + format, *args)


@dataclass(frozen=True)
class PrefillPeer:
    """Where a prefill server takes KV requests, and its pool layout."""

    endpoint: str
    layout: KVLayout


class BootstrapDirectory:
    """The decode side's view of prefill servers, by ``host:port``, looked up in a
    background thread (a lookup never blocks the scheduler loop)."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="bootstrap-lookup")
        self.peers: dict[str, Future] = {}

    def peer(self, address: str) -> PrefillPeer | str | None:
        """The peer at ``address`` (``host:port``), an error message, or None while the
        lookup runs."""
        future = self.peers.get(address)
        if future is None:
            future = self.peers[address] = self.pool.submit(_look_up, address)
        if not future.done():
            return None
        result = future.result()
        if isinstance(result, str):
            del self.peers[address]  # looked up again by the next request
        return result

    def forget(self, address: str) -> None:
        """Drops what is known of ``address`` (a transfer with it failed: it may have moved)."""
        self.peers.pop(address, None)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _look_up(address: str) -> PrefillPeer | str:
    base = f"http://{address}/route"
    try:
        shape = _get_json(f"{base}?engine_rank=-1&target_dp_group=-1&target_pp_rank=-1")
        rank = _get_json(f"{base}?engine_rank=0&target_dp_group=0&target_pp_rank=0")
        layout = msgspec.convert(shape["kv_layout"], KVLayout)
        return PrefillPeer(f"tcp://{rank['rank_ip']}:{rank['rank_port']}", layout)
    except (OSError, ValueError, KeyError, TypeError, msgspec.ValidationError) as err:
        return f"the prefill server's bootstrap service at {address} did not answer: {err}"


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=LOOKUP_TIMEOUT_S) as response:
        return json.loads(response.read(MAX_BODY_BYTES))


def register(address: str, info: dict) -> None:
    """``PUT /route`` of a rank's ``info`` at the bootstrap service at ``address``."""
    request = urllib.request.Request(f"http://{address}/route", data=json.dumps(info).encode(),
                                     method="PUT", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=LOOKUP_TIMEOUT_S) as response:
        response.read()
