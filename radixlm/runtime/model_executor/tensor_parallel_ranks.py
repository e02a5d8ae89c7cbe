"""One scheduler, N model ranks: how rank 0 (the scheduler's process) drives ranks 1..N-1.

Every rank holds its share of the model (``models/layers/tensor_parallel``) and a KV pool
of its share of the heads under the same slot numbers, so the allocator, the request rows
and the radix cache exist once, on rank 0. Before each forward pass rank 0 broadcasts the
step (``send_step``): its sizes, then the host values it has as lists (each request's prefix
and new lengths, the rows the prefix cache rewrote in place since the last step
(``ReqToTokenPool.rewritten``) and their lengths) on the CPU group (gloo), then one int64
payload of device values on the model's group (gloo on CPUs, NCCL on GPUs, so the payload
never leaves the device there): token ids, positions, the new tokens' slots, request rows,
the rewritten rows' slots, and for an extend step each request's whole row of slots (a
prefix-cache hit or a re-admitted request brings slots the other ranks have not seen; a
decode step's one new slot per request is in the new tokens' slots; a pass with LoRA adapters
adds its segments' starts, lengths and slots to the host values, and each adapter rank 0
loads into a slot is announced before the step that uses it, by name, path and fingerprint
(``send_lora_slot``), for every rank to load it into the same slot). No rank reads the
device to take a step apart: the lengths it is cut by arrive on the host. The other ranks
(``tp_worker``) write those rows into their own request table and run the same pass; the
layers' all-reduces keep them in step. Logits are a
step of their own (``send_logits``): rank 0 broadcasts the hidden rows it wants them for,
every rank projects them onto its share of the vocabulary, and the shares are gathered.
Rank 0 alone samples.

With the hierarchical prefix cache, rank 0's changes to its host rows go first, before any
other message (``HOST_TIER``: ``host_tier_ranks``), so every rank copies the same slots to
and from the same rows before the pass that depends on them.

Between steps the other ranks wait inside a broadcast, which gloo and NCCL end after the
collective timeout (``--dist-timeout``); an idle rank 0 sends keep-alives (``keep_alive``),
which also find a rank that died meanwhile. What crosses between ranks is int64 and hidden-
state tensors; nothing is pickled.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from radixlm.kernels.forward_batch import ForwardBatch, ForwardMode
from radixlm.kv_cache.memory_pool import ReqToTokenPool
from radixlm.models.layers.tensor_parallel import TensorParallel

FORWARD, LOGITS, SHUTDOWN, KEEP_ALIVE, LORA_SLOT, HOST_TIER = 1, 2, 3, 4, 5, 6
HEADER_LEN = 7
JOIN_TIMEOUT_S = 300
"""Longest the ranks wait for each other at start (other nodes' commands may come later)."""
KEEP_ALIVES_PER_TIMEOUT = 4
"""An idle rank 0 sends this many keep-alives per collective timeout: the other ranks wait
for the next step inside a collective, which would otherwise time out on an idle server."""


@dataclass
class Step:
    """A forward pass as the other ranks receive it (tensors on the model's device)."""

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    prefix_lens: list[int]
    extend_lens: list[int]
    rows: torch.Tensor
    """Extend steps: each request's slots for its first ``prefix + extend`` tokens, one
    after another; decode steps: empty."""
    rewritten: list[tuple[int, torch.Tensor]]
    """(row, its first slots) of rows replaced in place since the last step."""
    lora_segments: tuple[list[int], list[int], list[int]] | None = None
    """The pass's LoRA segments (starts, lengths, adapter slots), or None: no adapter."""


@dataclass
class LoraSlot:
    """Rank 0 loaded adapter ``name`` (read from ``path``; its files' ``fingerprint``) into
    ``slot``: every rank loads it there too."""

    slot: int
    name: str
    path: str
    fingerprint: str


@dataclass
class HostTierChanges:
    """Rank 0's host tier changed rows (``host_tier_ranks``): its record, host ints, and the
    slots it names (on the model's device), for every rank to make the same changes."""

    host: list[int]
    slots: torch.Tensor | None


def init_ranks(rank: int, size: int, init_address: str, backend: str,
               device: torch.device, timeout_s: float) -> tuple[TensorParallel, object]:
    """Joins the ranks' process group (blocks until all ``size`` have joined, at most
    ``JOIN_TIMEOUT_S`` or ``timeout_s``, the limit of every later collective); returns (this
    rank's ``TensorParallel`` on the model's group, the CPU group)."""
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    host, port = init_address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), size, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=max(timeout_s, JOIN_TIMEOUT_S)))
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else (
        dist.group.WORLD)
    return TensorParallel(rank, size, dist.group.WORLD), cpu_group


def loopback_address() -> str:
    """127.0.0.1:<a port nothing listens on now>, where one node's ranks can meet."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def threads_per_rank(size: int, nnodes: int) -> int:
    """CPU threads each rank runs, so that the ranks of a node share its cores without
    oversubscribing them."""
    return max(1, (os.cpu_count() or 1) // max(1, size // nnodes))


def agree_on_pool_size(tokens: int, cpu_group) -> int:
    """The smallest KV pool any rank can hold (each sized its own from its memory)."""
    value = torch.tensor([tokens], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=cpu_group)
    return int(value)


class StepSender:
    """Rank 0's side: broadcasts each forward pass, the logits wanted, keep-alives and the
    end, one at a time (a lock keeps two threads' messages apart)."""

    def __init__(self, tp: TensorParallel, cpu_group, rows: ReqToTokenPool, timeout_s: float):
        self.tp, self.cpu_group, self.rows = tp, cpu_group, rows
        self.keep_alive_s = timeout_s / KEEP_ALIVES_PER_TIMEOUT
        self.last_sent = time.monotonic()
        self.lock = threading.Lock()
        self.host_tier = None
        """Rank 0's ``HostTierLog`` (the hierarchical prefix cache), whose changes go before
        every message; None without one."""

    def keep_alive(self) -> None:
        """Sends a keep-alive if nothing was sent for a while, and the host tier's changes
        (call it only while no step is in flight). A rank that died shows here as a
        ``RuntimeError``."""
        if time.monotonic() - self.last_sent >= self.keep_alive_s:
            self._send_header([KEEP_ALIVE, 0, 0, 0, 0, 0, 0])
        elif self.host_tier is not None:
            self.exchange_tier_changes()

    def exchange_tier_changes(self, agree: int = 0) -> list[bool]:
        """Sends the host tier's changes now; with ``agree`` (the changes end in a
        ``CONFIRM`` of that many rows), each row's flag agreed by every rank (the minimum)."""
        with self.lock:
            self._send_tier_changes()
            if not agree:
                return []
            held = torch.ones(agree, dtype=torch.int64)
            dist.all_reduce(held, op=dist.ReduceOp.MIN, group=self.cpu_group)
            return [bool(flag) for flag in held.tolist()]

    def _send_tier_changes(self) -> None:
        """(Holding the lock.) The host tier's changes recorded so far, if any."""
        changes = None if self.host_tier is None else self.host_tier.take()
        if changes is None:
            return
        host, slots = changes
        count = 0 if slots is None else len(slots)
        dist.broadcast(torch.tensor([HOST_TIER, 0, len(host), count, 0, 0, 0],
                                    dtype=torch.int64), 0, group=self.cpu_group)
        dist.broadcast(torch.tensor(host, dtype=torch.int64), 0, group=self.cpu_group)
        if count:
            dist.broadcast(slots, 0, group=self.tp.group)
        self.last_sent = time.monotonic()

    def _send_header(self, fields: list[int], payload: torch.Tensor | None = None,
                     lengths: list[int] | None = None) -> None:
        """The header, then (a forward pass) its host ``lengths`` on the CPU group, then the
        ``payload`` on the model's group."""
        with self.lock:
            self._send_tier_changes()
            dist.broadcast(torch.tensor(fields, dtype=torch.int64), 0, group=self.cpu_group)
            if lengths is not None:
                dist.broadcast(torch.tensor(lengths, dtype=torch.int64), 0,
                               group=self.cpu_group)
            if payload is not None:
                dist.broadcast(payload, 0, group=self.tp.group)
            self.last_sent = time.monotonic()

    def send_step(self, batch: ForwardBatch) -> None:
        extend = batch.mode == ForwardMode.EXTEND
        table = self.rows.req_to_token
        rewritten, self.rows.rewritten = self.rows.rewritten, {}
        extend_lens = batch.extend_seq_lens_list
        # On the host: prefix and new lengths, then the rows replaced in place since the
        # last pass (the prefix cache swapped slots) and their lengths.
        lengths = [*(n - e for n, e in zip(batch.seq_lens_list, extend_lens)), *extend_lens,
                   *rewritten, *rewritten.values()]
        parts = [batch.input_ids, batch.positions, batch.out_cache_loc,
                 batch.req_pool_indices]
        parts += [table[row, :n] for row, n in rewritten.items()]
        if extend:  # each request's row, up to its length (host lengths: no device sync)
            batch_rows = table.index_select(0, batch.req_pool_indices)
            parts += [batch_rows[b, :n] for b, n in enumerate(batch.seq_lens_list)]
        segments = 0
        if batch.lora is not None:
            starts, lens, slots = batch.lora.on_host
            segments = len(starts)
            lengths += [*starts, *lens, *slots]
        payload = torch.cat([p.to(torch.int64) for p in parts])
        self._send_header([FORWARD, int(extend), len(batch.input_ids), batch.batch_size,
                           len(payload), len(rewritten), segments], payload, lengths)

    def send_lora_slot(self, slot: int, adapter) -> None:
        """Has the other ranks load ``adapter`` (a ``LoraAdapter``) into ``slot``: its name,
        path and fingerprint as UTF-8 bytes on the CPU group (nothing pickled)."""
        texts = [adapter.name.encode(), adapter.path.encode(), adapter.fingerprint.encode()]
        data = torch.tensor(list(b"".join(texts)), dtype=torch.int64)
        with self.lock:
            self._send_tier_changes()
            dist.broadcast(torch.tensor([LORA_SLOT, slot, *map(len, texts), 0, 0],
                                        dtype=torch.int64), 0, group=self.cpu_group)
            dist.broadcast(data, 0, group=self.cpu_group)
            self.last_sent = time.monotonic()

    def send_logits(self, hidden: torch.Tensor) -> None:
        """Has the other ranks compute their share of the logits of ``hidden`` (N, H)."""
        self._send_header([LOGITS, 0, hidden.shape[0], 0, 0, 0, 0], hidden.contiguous())

    def shutdown(self) -> None:
        """Tells the other ranks to exit (ignored when they are gone already)."""
        with contextlib.suppress(RuntimeError, ValueError):
            self._send_header([SHUTDOWN, 0, 0, 0, 0, 0, 0])


class StepReceiver:
    """Ranks 1..N-1: the next step rank 0 sends: a forward pass, hidden rows (N, H) to
    compute logits of, an adapter to load (``LoraSlot``), host-tier changes
    (``HostTierChanges``), or None (shut down)."""

    def __init__(self, tp: TensorParallel, cpu_group, device: torch.device,
                 hidden_size: int, dtype: torch.dtype):
        self.tp, self.cpu_group, self.device = tp, cpu_group, device
        self.hidden_size, self.dtype = hidden_size, dtype

    def receive(self) -> Step | torch.Tensor | LoraSlot | HostTierChanges | None:
        command = KEEP_ALIVE
        while command == KEEP_ALIVE:
            header = torch.zeros(HEADER_LEN, dtype=torch.int64)
            dist.broadcast(header, 0, group=self.cpu_group)
            command, extend, tokens, batch_size, length, rewrites, segments = header.tolist()
        if command == SHUTDOWN:
            return None
        if command == LORA_SLOT:
            sizes = [tokens, batch_size, length]  # the name's, path's, fingerprint's bytes
            data = torch.empty(sum(sizes), dtype=torch.int64)
            dist.broadcast(data, 0, group=self.cpu_group)
            name, path, fingerprint = (bytes(part.tolist()).decode()
                                       for part in data.split(sizes))
            return LoraSlot(extend, name, path, fingerprint)
        if command == HOST_TIER:
            host = torch.empty(tokens, dtype=torch.int64)  # (tokens: the host ints' count)
            dist.broadcast(host, 0, group=self.cpu_group)
            slots = None
            if batch_size:  # (the slots' count)
                slots = torch.empty(batch_size, dtype=torch.int64, device=self.device)
                dist.broadcast(slots, 0, group=self.tp.group)
            return HostTierChanges(host.tolist(), slots)
        if command == LOGITS:
            hidden = torch.empty(tokens, self.hidden_size, dtype=self.dtype, device=self.device)
            dist.broadcast(hidden, 0, group=self.tp.group)
            return hidden
        lengths = torch.empty(2 * batch_size + 2 * rewrites + 3 * segments, dtype=torch.int64)
        dist.broadcast(lengths, 0, group=self.cpu_group)
        host = lengths.tolist()  # host memory: the CPU group's
        prefix_lens, extend_lens = host[:batch_size], host[batch_size : 2 * batch_size]
        rewritten_rows = host[2 * batch_size : 2 * batch_size + rewrites]
        rewritten_lens = host[2 * batch_size + rewrites : 2 * batch_size + 2 * rewrites]
        lora = host[2 * batch_size + 2 * rewrites :]
        lora_segments = ((lora[:segments], lora[segments : 2 * segments],
                          lora[2 * segments :]) if segments else None)
        payload = torch.empty(length, dtype=torch.int64, device=self.device)
        dist.broadcast(payload, 0, group=self.tp.group)
        head = 3 * tokens + batch_size + sum(rewritten_lens)
        input_ids, positions, out_cache_loc, req_pool_indices, rewritten_slots, rows = \
            payload.split([tokens, tokens, tokens, batch_size, sum(rewritten_lens),
                           length - head])
        return Step(ForwardMode.EXTEND if extend else ForwardMode.DECODE, input_ids,
                    positions, out_cache_loc, req_pool_indices, prefix_lens, extend_lens,
                    rows, list(zip(rewritten_rows, rewritten_slots.split(rewritten_lens))),
                    lora_segments)
