"""The transfer backends: how a prefill scheduler and a decode scheduler exchange a
request's KV (``transfer_messages``), behind one interface per side.

- ``tcp``: ZMQ over TCP. The prefill side binds a ROUTER socket (its ``endpoint``, which
  the bootstrap service hands to decode servers); each decode side connects a DEALER per
  prefill endpoint. KV rows leave as frames that point at the gathered tensors' memory (no
  copy on the send side) and are written into the decode pool's slots on arrival. Works
  between any two machines, for any pool layout (MHA or the MLA latent).
- ``mooncake`` (``mooncake_backend``): the same control messages; the KV itself is
  written by Mooncake's transfer engine straight into the decode pool's slots.
- ``fake``: moves nothing, so it needs no link: the scheduler serves such pairs unpaired
  (``scheduler_process.make_req``): the prefill half ends after its prompt, the decode
  half computes the prompt itself (warm-up and health requests only).

Both sides poll: ``poll()`` returns what arrived since the last call, never blocking.
"""

from __future__ import annotations

import logging
import socket

import msgspec
import torch
import zmq

from radixlm.runtime.disaggregation import transfer_messages as wire
from radixlm.runtime.disaggregation.kv_rows import byte_views, gather_rows, scatter_rows

logger = logging.getLogger(__name__)

FAKE_BOOTSTRAP_HOST = "2.2.2.2"
"""A pair with this ``bootstrap_host`` moves no KV whatever the backend (SGLang's
warm-up and health requests): the prefill half ends after its prompt, the decode half
computes the prompt itself."""
MAX_CONTROL_BYTES = 1 << 20
"""Largest frame a prefill side accepts (decode sides only send small headers)."""


class PrefillLink:
    """The prefill side of a backend: where decode servers reach it, what they sent, and
    moving a request's KV (from ``buffers``, this server's pool) to one of them."""

    endpoint: str = ""

    def poll(self) -> list[tuple[bytes, wire.TransferMessage]]:
        """(peer, message) pairs that arrived since the last call."""
        return []

    def send_header(self, peer: bytes, header: wire.KVSent) -> None:
        """Sends ``header`` alone (an error, or KV already written) to ``peer``."""

    def send_kv(self, peer: bytes, header: wire.KVSent, wanted: wire.KVWanted,
                slots: torch.Tensor) -> str | None:
        """Moves the KV at this pool's ``slots`` (those of ``wanted``'s positions) to
        ``peer``, then ``header``; an error message (the peer told) if it cannot."""

    def close(self) -> None:
        pass


class DecodeLink:
    """The decode side of a backend: asking prefill endpoints for KV, and writing what
    arrives into ``buffers``, this server's pool."""

    def target(self, slots: torch.Tensor) -> wire.KVTarget | None:
        """Where a prefill side may write the KV of ``slots`` itself; None: send frames."""
        return None

    def send(self, endpoint: str, message: wire.KVWanted | wire.KVReceived | wire.KVCancel
             ) -> None:
        """Sends ``message`` to the prefill side at ``endpoint``."""

    def poll(self) -> list[tuple[wire.KVSent, list[memoryview]]]:
        """KV headers that arrived since the last call, each with its frames."""
        return []

    def receive(self, header: wire.KVSent, frames: list[memoryview], slots: torch.Tensor
                ) -> str | None:
        """Puts the KV that ``header`` announces at this pool's ``slots``; an error message
        if it does not fit them."""

    def close(self) -> None:
        pass


class TcpPrefillLink(PrefillLink):
    def __init__(self, host: str, buffers: list[torch.Tensor]):
        self.buffers = buffers
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{reachable_address(host)}:{port}"

    def poll(self) -> list[tuple[bytes, wire.TransferMessage]]:
        arrived = []
        while self.socket.poll(0):
            frames = self.socket.recv_multipart()
            if len(frames) != 2:
                logger.error("dropped a KV control message of %d frames", len(frames))
                continue
            try:
                arrived.append((frames[0], wire.decode(frames[1])))
            except (msgspec.DecodeError, msgspec.ValidationError) as err:
                logger.error("dropped a KV control frame that is not a message: %s", err)
        return arrived

    def send_header(self, peer: bytes, header: wire.KVSent) -> None:
        self.socket.send_multipart([peer, wire.encode(header)])

    def send_kv(self, peer: bytes, header: wire.KVSent, wanted: wire.KVWanted,
                slots: torch.Tensor) -> str | None:
        rows = gather_rows(self.buffers, slots)
        # copy=False: the frames reference the tensors' memory until ZMQ has sent them.
        self.socket.send_multipart([peer, wire.encode(header), *byte_views(rows)], copy=False)
        return None

    def close(self) -> None:
        self.socket.close(linger=0)


class TcpDecodeLink(DecodeLink):
    def __init__(self, buffers: list[torch.Tensor]):
        self.buffers = buffers
        self.context = zmq.Context.instance()
        self.sockets: dict[str, zmq.Socket] = {}
        self.poller = zmq.Poller()

    def send(self, endpoint: str, message) -> None:
        peer = self.sockets.get(endpoint)
        if peer is None:
            peer = self.sockets[endpoint] = self.context.socket(zmq.DEALER)
            peer.setsockopt(zmq.LINGER, 0)
            peer.connect(endpoint)
            self.poller.register(peer, zmq.POLLIN)
        peer.send(wire.encode(message))

    def poll(self) -> list[tuple[wire.KVSent, list[memoryview]]]:
        arrived = []
        while self.sockets:
            ready = dict(self.poller.poll(0))
            if not ready:
                break
            for peer in ready:
                frames = peer.recv_multipart(copy=False)
                try:
                    header = wire.decode(frames[0].buffer)
                except (msgspec.DecodeError, msgspec.ValidationError) as err:
                    logger.error("dropped a KV frame that is not a message: %s", err)
                    continue
                if not isinstance(header, wire.KVSent):
                    logger.error("dropped an unexpected %s", type(header).__name__)
                    continue
                arrived.append((header, [f.buffer for f in frames[1:]]))
        return arrived

    def receive(self, header: wire.KVSent, frames: list[memoryview], slots: torch.Tensor
                ) -> str | None:
        if header.written:
            return "the prefill server wrote KV directly, which this backend cannot take"
        try:
            scatter_rows(self.buffers, slots, frames)
        except ValueError as err:
            return str(err)
        return None

    def close(self) -> None:
        for peer in self.sockets.values():
            peer.close(linger=0)
        self.sockets.clear()


def reachable_address(host: str) -> str:
    """The address peers use for a socket bound to ``host`` (a wildcard bind is reached
    at this machine's own address)."""
    if host in ("0.0.0.0", "", "*"):
        return socket.gethostbyname(socket.gethostname())
    if host == "::":
        return socket.gethostname()
    return host
