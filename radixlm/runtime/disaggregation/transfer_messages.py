"""What a decode server and a prefill server say to each other about one request's KV.

Typed msgspec structs, msgpack-encoded, tagged by class name; KV itself follows a
``KVSent`` header as raw tensor frames (``kv_rows``). Nothing executable crosses the wire.

    decode --KVWanted(room, slots' count, layout[, target])--> prefill
    prefill --KVSent(room, first token, ...) + one frame per pool buffer--> decode
            (or, given a target, KV written into the decode pool, then KVSent(written))
    decode --KVReceived(room, ok)--> prefill        (the prefill request then ends)
    decode --KVCancel(room)--> prefill              (the decode request was aborted)

A ``bootstrap_room`` (a random integer the router draws per request) names the pair.
"""

from __future__ import annotations

from typing import Any

import msgspec

from radixlm.runtime.disaggregation.kv_rows import KVLayout


class KVTarget(msgspec.Struct):
    """Where a backend that writes into the decode pool itself (``mooncake``) puts the KV:
    the decode side's transfer session, the base address of each of its pool buffers
    (``layer_buffers`` order) and the slot of each wanted position."""

    session: str
    buffer_addresses: list[int]
    slots: list[int]


class KVWanted(msgspec.Struct, tag=True):
    """The decode side has slots for the prompt's positions ``start`` .. ``prompt_len`` - 1
    (``start``: what its own prefix cache already holds)."""

    room: int
    prompt_len: int
    start: int
    layout: KVLayout
    target: KVTarget | None = None
    """Set by decode sides that can be written into directly; None: send frames."""


class KVSent(msgspec.Struct, tag=True):
    """The KV of positions ``start`` .. ``prompt_len`` - 1, one frame per pool buffer after
    this header, or already ``written`` into the ``KVWanted.target`` (no frames); or
    ``error`` (no frames) when the prefill side cannot send it."""

    room: int
    start: int = 0
    prompt_len: int = 0
    error: str | None = None
    first_token: int = 0
    cached_tokens: int = 0
    """Prompt tokens the prefill server found in its prefix cache."""
    first_token_logprob: list[Any] | None = None
    first_top_logprobs: list[Any] | None = None
    written: bool = False


class KVReceived(msgspec.Struct, tag=True):
    room: int
    error: str | None = None


class KVCancel(msgspec.Struct, tag=True):
    room: int
    error: str | None = None
    """Why (a layout mismatch found at bootstrap); None: the decode request was aborted."""


TransferMessage = KVWanted | KVSent | KVReceived | KVCancel

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(TransferMessage)


def encode(message: TransferMessage) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes | memoryview) -> TransferMessage:
    """Raises ``msgspec.DecodeError`` / ``msgspec.ValidationError`` for a frame that is not
    a message."""
    return _decoder.decode(data)
