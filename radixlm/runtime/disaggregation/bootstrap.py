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

Trust: a registration decides where decode servers send for KV (and so who reads prompts'
KV), so ``PUT /route`` needs ``Authorization: Bearer <secret>``: the server's API key where
it has one, else a secret of the process's own (only the scheduler registers then). The
lookups stay open, as SGLang's decode servers send no key. A registration is checked (an
address, a port, ranks below ``MAX_RANK``) and the registry holds at most ``MAX_RANKS``
ranks; a connection idle for ``IDLE_TIMEOUT_S`` is closed, and past ``MAX_CONNECTIONS`` at
once new ones are closed unanswered.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import re
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
MAX_RANK = 1024
"""Ranks (data-parallel group, tensor-parallel rank, pipeline stage) are below this."""
MAX_RANKS = 256
"""The most ranks the registry holds."""
IDLE_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 32
RANK_KEYS = ("system_dp_rank", "attn_tp_rank", "pp_rank")
_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``MAX_CONNECTIONS`` at once (more are closed)."""

    daemon_threads = True
    request_queue_size = 2 * MAX_CONNECTIONS  # (the listen backlog)

    def __init__(self, address, handler):
        super().__init__(address, handler)
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class BootstrapServer:
    """The registry of a prefill server's ranks, served over HTTP from a daemon thread;
    registrations must carry ``secret``. Binding fails (``OSError``) when the port is
    taken."""

    def __init__(self, host: str, port: int, layout: KVLayout, secret: str):
        if not secret:
            raise ValueError("the bootstrap service needs a secret for registrations")
        self.layout = layout
        self.secret = secret
        self.ranks: dict[tuple[int, int, int], dict] = {}  # (dp, tp, pp) -> rank_ip/port
        self.lock = threading.Lock()
        handler = type("Handler", (_BootstrapHandler,), {"registry": self})
        self.http = _BoundedHTTPServer((host.strip("[]"), port), handler)
        self.thread = threading.Thread(target=self.http.serve_forever, name="bootstrap",
                                       daemon=True)
        self.thread.start()

    def authorized(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header carries the secret."""
        given = (header or "").removeprefix("Bearer ").encode()
        return hmac.compare_digest(given, self.secret.encode())

    def register(self, info: dict) -> None:
        """Records a rank (``PUT /route``'s body). Raises ``ValueError`` for a bad one."""
        if not isinstance(info, dict):
            raise ValueError("the body must be a JSON object")
        address, port = info.get("rank_ip"), info.get("rank_port")
        if not isinstance(address, str) or not _is_host(address):
            raise ValueError("rank_ip must be an IP address or a host name")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ValueError("rank_port must be an integer in 1..65535")
        key = tuple(info.get(name, 0) for name in RANK_KEYS)
        if not all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k < MAX_RANK
                   for k in key):
            raise ValueError(f"{', '.join(RANK_KEYS)} must be integers in 0..{MAX_RANK - 1}")
        with self.lock:
            if key not in self.ranks and len(self.ranks) >= MAX_RANKS:
                raise ValueError(f"the registry holds {MAX_RANKS} ranks already")
            self.ranks[key] = {"rank_ip": address, "rank_port": port}

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


def _is_host(text: str) -> bool:
    try:
        ipaddress.ip_address(text.strip("[]"))
        return True
    except ValueError:
        return _HOST_NAME.fullmatch(text) is not None


class _BootstrapHandler(BaseHTTPRequestHandler):
    registry: BootstrapServer
    timeout = IDLE_TIMEOUT_S  # (the socket's: a client that sends nothing is let go)

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
        if not self.registry.authorized(self.headers.get("Authorization")):
            return self._answer(401, "registering a rank needs the bootstrap secret "
                                     "(Authorization: Bearer <the server's API key>)")
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = 0
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


def register(address: str, info: dict, secret: str) -> None:
    """``PUT /route`` of a rank's ``info`` at the bootstrap service at ``address``."""
    request = urllib.request.Request(f"http://{address}/route", data=json.dumps(info).encode(),
                                     method="PUT", headers={"Content-Type": "application/json",
                                                            "Authorization": f"Bearer {secret}"})
    with urllib.request.urlopen(request, timeout=LOOKUP_TIMEOUT_S) as response:
        response.read()
