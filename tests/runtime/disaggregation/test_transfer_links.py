"""The transfer links, one prefill side and one decode side over real sockets (and, for
``mooncake``, Mooncake's real transfer engine over TCP): the KV at the sender's slots
arrives at the receiver's slots for multi-head and MLA pools, whichever backend each
side runs, and a target that does not fit is refused with the peer told."""

from __future__ import annotations

import time

import pytest
import torch
from runtime_checks import mooncake_missing

from radixlm.kv_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from radixlm.runtime.disaggregation import transfer_messages as wire
from radixlm.runtime.disaggregation.kv_rows import KVLayout
from radixlm.runtime.disaggregation.mooncake_backend import (
    MooncakeDecodeLink,
    MooncakePrefillLink,
    TransferEngineSession,
    slot_runs,
)
from radixlm.runtime.disaggregation.transfer_backend import TcpDecodeLink, TcpPrefillLink

HOST = "127.0.0.1"
MISSING = mooncake_missing()
NEEDS_MOONCAKE = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
SLOW = pytest.mark.slow  # CI installs Mooncake's engine (and libibverbs1) for its last stage


def pools(kind: str):
    if kind == "mha":
        return [MHATokenToKVPool(64, 3, 2, 8, torch.bfloat16, "cpu") for _ in range(2)]
    return [MLATokenToKVPool(64, 3, 12, 4, torch.float32, "cpu") for _ in range(2)]


def links(prefill_backend: str, decode_backend: str, source, target):
    sender = (MooncakePrefillLink(HOST, source.layer_buffers()) if prefill_backend ==
              "mooncake" else TcpPrefillLink(HOST, source.layer_buffers()))
    receiver = (MooncakeDecodeLink(HOST, target.layer_buffers()) if decode_backend ==
                "mooncake" else TcpDecodeLink(target.layer_buffers()))
    return sender, receiver


def wait_for(poll, seconds: float = 10.0) -> list:
    deadline = time.monotonic() + seconds
    while not (arrived := poll()):
        assert time.monotonic() < deadline, "nothing arrived"
        time.sleep(0.001)
    return arrived


def transfer(sender, receiver, layout, sent: torch.Tensor, received: torch.Tensor,
             target: wire.KVTarget | None = None):
    """One request's exchange; returns (send_kv's answer, the header that arrived, the
    receiver's answer)."""
    wanted = wire.KVWanted(7, len(sent), 0, layout,
                           target if target is not None else receiver.target(received))
    receiver.send(sender.endpoint, wanted)
    peer, wanted = wait_for(sender.poll)[0]
    problem = sender.send_kv(peer, wire.KVSent(7, 0, len(sent), first_token=5), wanted, sent)
    header, frames = wait_for(receiver.poll)[0]
    return problem, header, (None if header.error else receiver.receive(header, frames,
                                                                        received))


def test_slot_runs_cover_every_position_once_in_maximal_runs():
    sources = torch.tensor([4, 5, 6, 9, 10, 2])
    destinations = [1, 2, 3, 4, 8, 9]
    assert slot_runs(sources, destinations) == [(4, 1, 3), (9, 4, 1), (10, 8, 1), (2, 9, 1)]
    assert slot_runs(torch.tensor([], dtype=torch.int64), []) == []
    assert slot_runs(torch.arange(3, 40), list(range(50, 87))) == [(3, 50, 37)]


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_tcp_links_move_the_rows_between_pools(kind):
    check_rows_move("tcp", "tcp", kind)


@pytest.mark.parametrize("prefill,decode", [("mooncake", "mooncake"), ("mooncake", "tcp"),
                                            ("tcp", "mooncake")])
@pytest.mark.parametrize("kind", ["mha", "mla"])
@SLOW
@NEEDS_MOONCAKE
def test_mooncake_links_move_the_rows_and_pair_with_tcp_ones(prefill, decode, kind):
    check_rows_move(prefill, decode, kind)


def check_rows_move(prefill_backend: str, decode_backend: str, kind: str) -> None:
    source, target = pools(kind)
    for buffer in source.layer_buffers():
        buffer.copy_(torch.randn(buffer.shape).to(buffer.dtype))
    sent = torch.tensor([3, 4, 5, 6, 20, 21, 40, 9])
    received = torch.tensor([10, 11, 12, 30, 31, 32, 2, 50])
    sender, receiver = links(prefill_backend, decode_backend, source, target)
    try:
        problem, header, received_problem = transfer(
            sender, receiver, KVLayout.of(source.layer_buffers(), 1), sent, received)
    finally:
        sender.close()
        receiver.close()
    assert (problem, header.error, received_problem) == (None, None, None)
    assert header.first_token == 5
    assert header.written == (prefill_backend == decode_backend == "mooncake")
    for mine, theirs in zip(source.layer_buffers(), target.layer_buffers()):
        assert torch.equal(theirs[received], mine[sent])
        untouched = [s for s in range(64) if s not in received.tolist()]
        assert not theirs[untouched].any()


@SLOW
@NEEDS_MOONCAKE
def test_a_mooncake_target_that_does_not_fit_is_refused_and_the_peer_told():
    source, target = pools("mha")
    sender, receiver = links("mooncake", "mooncake", source, target)
    layout = KVLayout.of(source.layer_buffers(), 1)
    try:
        good = receiver.target(torch.tensor([1, 2]))
        short = wire.KVTarget(good.session, good.buffer_addresses, [1])
        problem, header, _ = transfer(sender, receiver, layout, torch.tensor([1, 2]),
                                      torch.tensor([1, 2]), short)
        assert "2 tokens" in problem and header.error == problem
        few = wire.KVTarget(good.session, good.buffer_addresses[:2], [1, 2])
        problem, header, _ = transfer(sender, receiver, layout, torch.tensor([1, 2]),
                                      torch.tensor([1, 2]), few)
        assert "KV buffers" in problem and header.error == problem
    finally:
        sender.close()
        receiver.close()


def test_the_mooncake_backend_names_its_package_when_it_cannot_load(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "mooncake.engine", None)
    source, _ = pools("mha")
    with pytest.raises(ValueError, match="pip install mooncake-transfer-engine"):
        TransferEngineSession(HOST, source.layer_buffers())
