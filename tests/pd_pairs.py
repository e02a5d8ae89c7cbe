"""Requests sent as SGLang's router sends them to a prefill and a decode server: the same
request, with the same ``bootstrap_*`` fields, to both at once."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor


def paired(prefill, decode, port: int, room: int | None = None, halves: str = "both",
           **request):
    """Sends ``request`` to both engines at once (``port``: the prefill server's bootstrap
    port); returns (prefill's result, decode's result), or the exception a half raised in
    place of its result; a stream's result is its list of chunks."""
    room = random.randrange(2**63) if room is None else room
    fields = dict(bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=room,
                  **request)
    engines = {"both": (prefill, decode), "prefill": (prefill,), "decode": (decode,)}[halves]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(_generate, engine, fields) for engine in engines]
        results = [f.exception() or f.result() for f in futures]
    return tuple(results) if halves == "both" else results[0]


def _generate(engine, fields: dict):
    result = engine.generate(**fields)
    return list(result) if fields.get("stream") else result
