"""The ``mooncake`` transfer backend: the tcp backend's control messages, with the KV
itself written by Mooncake's transfer engine (``mooncake-transfer-engine``, an optional
dependency) straight from the prefill pool into the decode pool's slots: RDMA where an
InfiniBand device is named (``--disaggregation-ib-device``), TCP otherwise.

Each side registers its pool buffers with its engine once, at start. A decode side's
``KVWanted`` carries a ``KVTarget``: its engine's session, its buffers' base addresses and
the destination slot of every wanted position. The prefill side writes, per pool buffer,
one block per run of positions whose slots are consecutive on both sides, in batches of at
most ``MAX_BLOCKS_PER_BATCH`` (the engine refuses batches of thousands), then sends
``KVSent(written=True)``. Writes are synchronous: the prefill scheduler's step waits for
them, as it waits for the tcp backend's gather. A peer of the other backend is served
with frames (``tcp``), so mixed pairs still work.
"""

from __future__ import annotations

import logging

import torch

from radixlm.runtime.disaggregation import transfer_messages as wire
from radixlm.runtime.disaggregation.transfer_backend import (
    TcpDecodeLink,
    TcpPrefillLink,
    reachable_address,
)

logger = logging.getLogger(__name__)

MAX_BLOCKS_PER_BATCH = 256
"""Most (source, destination, length) blocks in one batched write."""


class MooncakePrefillLink(TcpPrefillLink):
    def __init__(self, host: str, buffers: list[torch.Tensor], ib_device: str = ""):
        super().__init__(host, buffers)
        self.engine = TransferEngineSession(host, buffers, ib_device)

    def send_kv(self, peer: bytes, header: wire.KVSent, wanted: wire.KVWanted,
                slots: torch.Tensor) -> str | None:
        target = wanted.target
        if target is None:  # a tcp decode side
            return super().send_kv(peer, header, wanted, slots)
        problem = self.engine.write(slots, target)
        if problem is not None:
            self.send_header(peer, wire.KVSent(header.room, error=problem))
            return problem
        header.written = True
        self.send_header(peer, header)
        return None

    def close(self) -> None:
        super().close()
        self.engine.close()


class MooncakeDecodeLink(TcpDecodeLink):
    def __init__(self, host: str, buffers: list[torch.Tensor], ib_device: str = ""):
        super().__init__(buffers)
        self.engine = TransferEngineSession(host, buffers, ib_device)

    def target(self, slots: torch.Tensor) -> wire.KVTarget:
        return wire.KVTarget(self.engine.session, self.engine.addresses, slots.tolist())

    def receive(self, header: wire.KVSent, frames: list[memoryview], slots: torch.Tensor
                ) -> str | None:
        if header.written:
            return None  # already in the slots: the write completed before the header left
        return super().receive(header, frames, slots)  # a tcp prefill side

    def close(self) -> None:
        super().close()
        self.engine.close()


class TransferEngineSession:
    """One Mooncake transfer engine with a pool's buffers registered (peer-to-peer
    handshake, no metadata server). Raises ``ValueError`` when the engine is missing or
    cannot start."""

    def __init__(self, host: str, buffers: list[torch.Tensor], ib_device: str = ""):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as err:
            raise ValueError(
                "--disaggregation-transfer-backend mooncake needs Mooncake's transfer "
                "engine: pip install mooncake-transfer-engine (GPU) or "
                f"mooncake-transfer-engine-non-cuda (CPU; needs libibverbs1): {err}"
            ) from None
        for buffer in buffers:
            if not buffer.is_contiguous():
                raise ValueError("the mooncake backend needs contiguous KV pool buffers")
        hostname = reachable_address(host)
        self.engine = TransferEngine()
        protocol = "rdma" if ib_device else "tcp"
        if self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, ib_device) != 0:
            raise ValueError(f"Mooncake's transfer engine did not start on {hostname} "
                             f"({protocol}{' ' + ib_device if ib_device else ''})")
        self.session = f"{hostname}:{self.engine.get_rpc_port()}"
        self.buffers = buffers
        self.addresses = [b.data_ptr() for b in buffers]
        self.row_bytes = [b.stride(0) * b.element_size() for b in buffers]
        sizes = [b.numel() * b.element_size() for b in buffers]
        if self.engine.batch_register_memory(self.addresses, sizes) != 0:
            raise ValueError("Mooncake's transfer engine could not register the KV pool")

    def write(self, slots: torch.Tensor, target: wire.KVTarget) -> str | None:
        """Writes this pool's rows at ``slots`` into ``target``'s slots; an error message if
        the target does not match or a write fails."""
        if len(target.buffer_addresses) != len(self.buffers):
            return (f"the decode server has {len(target.buffer_addresses)} KV buffers, "
                    f"this one {len(self.buffers)}")
        if len(target.slots) != len(slots):
            return f"the decode server gave {len(target.slots)} slots for {len(slots)} tokens"
        sources, destinations, lengths = [], [], []
        for (source, destination, count) in slot_runs(slots, target.slots):
            for address, remote, row in zip(self.addresses, target.buffer_addresses,
                                            self.row_bytes):
                sources.append(address + source * row)
                destinations.append(remote + destination * row)
                lengths.append(count * row)
        for at in range(0, len(lengths), MAX_BLOCKS_PER_BATCH):
            end = at + MAX_BLOCKS_PER_BATCH
            status = self.engine.batch_transfer_sync_write(
                target.session, sources[at:end], destinations[at:end], lengths[at:end])
            if status != 0:
                return f"a Mooncake write to {target.session} failed (status {status})"
        return None

    def close(self) -> None:
        if self.addresses:
            self.engine.batch_unregister_memory(self.addresses)
            self.addresses = []


def slot_runs(sources: torch.Tensor, destinations: list[int]) -> list[tuple[int, int, int]]:
    """(first source slot, first destination slot, length) for each maximal run of
    positions whose slots are consecutive on both sides."""
    source = sources.to("cpu", torch.int64)
    destination = torch.tensor(destinations, dtype=torch.int64)
    if not len(source):
        return []
    steps = (source.diff() != 1) | (destination.diff() != 1)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), steps.nonzero().flatten() + 1])
    ends = torch.cat([starts[1:], torch.tensor([len(source)])])
    return [(int(source[a]), int(destination[a]), int(b - a))
            for a, b in zip(starts.tolist(), ends.tolist())]
