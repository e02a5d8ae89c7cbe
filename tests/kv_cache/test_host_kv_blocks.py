"""The host tier's contract (``radixlm/kv_cache/host_kv_blocks.py``) over real device pools.

Blocks travel between a small MHA or MLA pool (float32 and bfloat16, CPU) and the tier and
come back byte for byte; the tier is LRU over whole blocks, refreshes on loads and re-puts,
copies what it is given and what it gives, and keeps its counts under two threads.
"""

from __future__ import annotations

import threading

import pytest
import torch

from radixlm.kv_cache.host_kv_blocks import HostKVBlocks
from radixlm.kv_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

BLOCK = 4
SLOTS = 32


def make_pool(layout: str, dtype: torch.dtype, seed: int = 0):
    """A 2-layer pool whose every slot holds random bytes (nan and inf included)."""
    if layout == "mha":
        pool = MHATokenToKVPool(SLOTS, 2, 2, 4, dtype, "cpu")
    else:
        pool = MLATokenToKVPool(SLOTS, 2, 6, 2, dtype, "cpu")
    g = torch.Generator().manual_seed(seed)
    for buffer in pool.layer_buffers():
        buffer.copy_(torch.randn(buffer.shape, generator=g).to(dtype))
    pool.layer_buffers()[0].view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0])
    return pool


def rows(pool, slots: list[int]) -> list[torch.Tensor]:
    index = torch.tensor(slots)
    return [b.index_select(0, index).clone() for b in pool.layer_buffers()]


def assert_same_bytes(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def tokens(i: int) -> list[int]:
    return list(range(100 * i, 100 * i + BLOCK))


def put(host: HostKVBlocks, pool, key: str, first_slot: int) -> bool:
    slots = torch.arange(first_slot, first_slot + BLOCK)
    return host.put_from_pool(key, tokens(first_slot), pool, slots)


# ---- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["mha", "mla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_round_trip_between_pools_byte_for_byte(layout, dtype):
    source, target = make_pool(layout, dtype, seed=1), make_pool(layout, dtype, seed=2)
    host = HostKVBlocks(source, BLOCK, capacity=4)
    assert all(b.dtype == dtype for b in host.buffers)
    expected = rows(source, [5, 9, 2, 17])
    assert host.put_from_pool("a", tokens(1), source, torch.tensor([5, 9, 2, 17]))
    assert host.tokens_of("a") == tuple(tokens(1))
    untouched = rows(target, [0, 1, 2, 3, 4, 5, 6, 7, 12, 13])
    assert host.load_into_pool("a", target, torch.tensor([8, 11, 10, 9]))
    assert_same_bytes(rows(target, [8, 11, 10, 9]), expected)
    assert_same_bytes(rows(target, [0, 1, 2, 3, 4, 5, 6, 7, 12, 13]), untouched)
    assert_same_bytes(host.block_tensors("a"), expected)


@pytest.mark.parametrize("layout", ["mha", "mla"])
def test_a_load_with_skip_writes_only_the_rest_of_the_block(layout):
    source, target = make_pool(layout, torch.bfloat16, 1), make_pool(layout, torch.bfloat16, 2)
    host = HostKVBlocks(source, BLOCK, capacity=2)
    put(host, source, "a", 4)
    before = rows(target, list(range(SLOTS)))
    assert host.load_into_pool("a", target, torch.tensor([20, 21]), skip=2)
    assert_same_bytes(rows(target, [20, 21]), rows(source, [6, 7]))
    after = rows(target, list(range(SLOTS)))
    keep = [s for s in range(SLOTS) if s not in (20, 21)]
    assert_same_bytes([b[keep] for b in after], [b[keep] for b in before])
    block_bytes = host.block_bytes
    assert host.stats().bytes_loaded == block_bytes // 2


def test_a_missing_block_loads_nothing():
    pool = make_pool("mha", torch.float32)
    host = HostKVBlocks(pool, BLOCK, capacity=2)
    before = rows(pool, list(range(SLOTS)))
    assert not host.load_into_pool("absent", pool, torch.arange(4, 8))
    assert host.block_tensors("absent") is None and host.tokens_of("absent") is None
    assert_same_bytes(rows(pool, list(range(SLOTS))), before)
    assert host.stats().bytes_loaded == 0


@pytest.mark.parametrize("layout", ["mha", "mla"])
def test_a_run_of_blocks_goes_in_and_out_whole_through_rows_that_are_not_adjacent(layout):
    """A run stored in one call takes the rows of the blocks it drops (here rows 0, 2 and 3:
    not one span) and loads back, from a token inside its first block, into slots in any
    order, with the bytes that storing and loading block by block gives."""
    source, target = make_pool(layout, torch.float32, 1), make_pool(layout, torch.float32, 2)
    host = HostKVBlocks(source, BLOCK, capacity=5)
    for i, key in enumerate("pqrst"):  # rows 0-4
        put(host, source, key, 4 * i)
    assert host.load_into_pool("q", target, torch.arange(4))  # q (row 1) the most recent
    slots = torch.randperm(SLOTS)[:3 * BLOCK].tolist()
    blocks = [(key, tokens(10 + i), False) for i, key in enumerate("xyz")]
    assert host.put_run_from_pool(blocks, source, torch.tensor(slots)) == [True, True, True]
    assert "q" in host and not any(key in host for key in "prs")
    for i, key in enumerate("xyz"):
        assert_same_bytes(host.block_tensors(key), rows(source, slots[4 * i : 4 * i + 4]))
    assert host.put_run_from_pool([blocks[1], ("w", tokens(1), False)], source,
                                  torch.tensor(slots[:8])) == [False, True]  # y: refreshed
    target_slots = torch.randperm(SLOTS)[: 3 * BLOCK - 1].tolist()
    assert host.load_run_into_pool(list("xyz"), target, torch.tensor(target_slots), 1) == 3
    assert_same_bytes(rows(target, target_slots), rows(source, slots[1:]))


def test_a_run_loads_up_to_its_first_missing_block_and_a_run_too_long_keeps_its_last():
    pool = make_pool("mha", torch.float32)
    host = HostKVBlocks(pool, BLOCK, capacity=2)
    blocks = [(key, tokens(i), False) for i, key in enumerate("abc")]
    assert host.put_run_from_pool(blocks, pool, torch.arange(12)) == [False, True, True]
    assert "a" not in host
    assert_same_bytes(host.block_tensors("c"), rows(pool, [8, 9, 10, 11]))
    before = rows(pool, list(range(SLOTS)))
    assert host.load_run_into_pool(["b", "a", "c"], pool, torch.arange(20, 32)) == 1
    assert_same_bytes(rows(pool, [20, 21, 22, 23]), rows(pool, [4, 5, 6, 7]))
    assert_same_bytes(rows(pool, list(range(24, 32))), [b[24:32] for b in before])
    assert host.load_run_into_pool(["a"], pool, torch.arange(20, 24)) == 0


# ---- LRU ---------------------------------------------------------------------------------------


def test_a_full_tier_drops_the_least_recently_used_block():
    pool = make_pool("mha", torch.float32)
    host = HostKVBlocks(pool, BLOCK, capacity=3)
    for i, key in enumerate("abc"):
        assert put(host, pool, key, 4 * (i + 1))
    assert put(host, pool, "d", 16)
    assert "a" not in host and all(k in host for k in "bcd")
    assert host.stats().dropped == 1 and host.stats().blocks == 3
    assert_same_bytes(host.block_tensors("d"), rows(pool, [16, 17, 18, 19]))


def test_a_load_refreshes_a_block():
    pool = make_pool("mha", torch.float32)
    host = HostKVBlocks(pool, BLOCK, capacity=3)
    for i, key in enumerate("abc"):
        put(host, pool, key, 4 * (i + 1))
    assert host.load_into_pool("a", pool, torch.arange(20, 24))
    put(host, pool, "d", 16)
    assert "a" in host and "b" not in host
    put(host, pool, "e", 24)
    assert "c" not in host and all(k in host for k in "ade")


def test_a_re_put_of_a_stored_key_returns_false_refreshes_and_copies_nothing():
    pool = make_pool("mha", torch.float32)
    host = HostKVBlocks(pool, BLOCK, capacity=3)
    for i, key in enumerate("abc"):
        put(host, pool, key, 4 * (i + 1))
    written = host.stats().bytes_written
    original = rows(pool, [4, 5, 6, 7])
    assert not put(host, pool, "a", 8)  # other slots: a key names one content, kept as is
    assert host.stats().bytes_written == written
    assert_same_bytes(host.block_tensors("a"), original)
    assert not host.put_tensors("a", tokens(4), rows(pool, [8, 9, 10, 11]))
    assert_same_bytes(host.block_tensors("a"), original)
    put(host, pool, "d", 16)
    assert "a" in host and "b" not in host


def test_capacity_one_keeps_the_latest_block():
    pool = make_pool("mla", torch.float32)
    host = HostKVBlocks(pool, BLOCK, capacity=1)
    put(host, pool, "a", 4)
    put(host, pool, "b", 8)
    assert "a" not in host and "b" in host
    assert_same_bytes(host.block_tensors("b"), rows(pool, [8, 9, 10, 11]))


def test_capacity_below_one_raises():
    with pytest.raises(ValueError, match="at least one block"):
        HostKVBlocks(make_pool("mha", torch.float32), BLOCK, capacity=0)


# ---- copies ------------------------------------------------------------------------------------


def test_stored_blocks_do_not_follow_later_writes_to_their_sources():
    pool = make_pool("mha", torch.bfloat16)
    host = HostKVBlocks(pool, BLOCK, capacity=4)
    from_pool = rows(pool, [4, 5, 6, 7])
    put(host, pool, "a", 4)
    given = [t.clone() for t in rows(pool, [8, 9, 10, 11])]
    kept = [t.clone() for t in given]
    assert host.put_tensors("b", tokens(2), given)
    for buffer in pool.layer_buffers():
        buffer.fill_(7.0)
    for t in given:
        t.fill_(-3.0)
    assert_same_bytes(host.block_tensors("a"), from_pool)
    assert_same_bytes(host.block_tensors("b"), kept)


def test_block_tensors_are_copies():
    pool = make_pool("mha", torch.float32)
    host = HostKVBlocks(pool, BLOCK, capacity=2)
    put(host, pool, "a", 4)
    handed_out = host.block_tensors("a")
    for t in handed_out:
        t.fill_(0.5)
    assert_same_bytes(host.block_tensors("a"), rows(pool, [4, 5, 6, 7]))
    host.load_into_pool("a", pool, torch.arange(12, 16))
    assert_same_bytes(rows(pool, [12, 13, 14, 15]), rows(pool, [4, 5, 6, 7]))


def test_put_tensors_round_trips_into_a_pool():
    pool = make_pool("mla", torch.bfloat16)
    host = HostKVBlocks(pool, BLOCK, capacity=2)
    block = [torch.randn((BLOCK, *b.shape[1:])).to(b.dtype) for b in pool.layer_buffers()]
    assert host.put_tensors("x", tokens(3), block)
    assert host.load_into_pool("x", pool, torch.tensor([3, 1, 30, 31]))
    assert_same_bytes(rows(pool, [3, 1, 30, 31]), block)


# ---- queries and errors ------------------------------------------------------------------------


def test_run_length_counts_stored_keys_from_the_first():
    pool = make_pool("mha", torch.float32)
    host = HostKVBlocks(pool, BLOCK, capacity=4)
    put(host, pool, "a", 4)
    put(host, pool, "b", 8)
    put(host, pool, "d", 12)
    assert host.run_length([]) == 0
    assert host.run_length(["a", "b", "c", "d"]) == 2
    assert host.run_length(["a", "b"]) == 2
    assert host.run_length(["c", "a"]) == 0
    assert host.run_length(["d"]) == 1


@pytest.mark.parametrize("count", [BLOCK - 1, BLOCK + 1, 0])
def test_a_wrong_token_count_raises_and_stores_nothing(count):
    pool = make_pool("mha", torch.float32)
    host = HostKVBlocks(pool, BLOCK, capacity=2)
    with pytest.raises(ValueError, match=f"holds {BLOCK} tokens, got {count}"):
        host.put_from_pool("a", list(range(count)), pool, torch.arange(4, 4 + BLOCK))
    with pytest.raises(ValueError, match=f"holds {BLOCK} tokens, got {count}"):
        host.put_tensors("a", list(range(count)), rows(pool, [4, 5, 6, 7]))
    assert "a" not in host
    assert host.stats() == host.stats().__class__(0, 2, 0, 0, 0, 0)


def test_a_put_whose_copy_fails_stores_nothing():
    pool = make_pool("mha", torch.float32)
    host = HostKVBlocks(pool, BLOCK, capacity=2)
    with pytest.raises(IndexError):
        host.put_from_pool("a", tokens(1), pool, torch.tensor([4, 5, 6, SLOTS + 5]))
    assert "a" not in host and host.stats().blocks == 0


def test_stats_count_blocks_bytes_and_drops():
    pool = make_pool("mha", torch.float32)  # 4 buffers of (2, 4) float32 per slot: 128 B
    host = HostKVBlocks(pool, BLOCK, capacity=2)
    assert host.block_bytes == 4 * 2 * 4 * 4 * BLOCK
    put(host, pool, "a", 4)
    put(host, pool, "b", 8)
    put(host, pool, "a", 12)  # refreshed only
    host.put_tensors("c", tokens(3), rows(pool, [1, 2, 3, 4]))  # drops b
    host.load_into_pool("a", pool, torch.arange(20, 24))
    host.load_into_pool("c", pool, torch.arange(24, 27), skip=1)
    host.load_into_pool("b", pool, torch.arange(20, 24))  # dropped: loads nothing
    stats = host.stats()
    size = host.block_bytes
    assert (stats.blocks, stats.capacity, stats.dropped) == (2, 2, 1)
    assert stats.bytes_used == 2 * size
    assert stats.bytes_written == 3 * size
    assert stats.bytes_loaded == size + 3 * size // 4
    host.clear()
    cleared = host.stats()
    assert (cleared.blocks, cleared.bytes_used) == (0, 0)
    assert "a" not in host and host.run_length(["a"]) == 0
    for i, key in enumerate("xy"):  # every row is free again
        assert put(host, pool, key, 4 * (i + 1))
    assert host.stats().dropped == 1


def test_two_threads_putting_and_loading_keep_the_counts_consistent():
    pool = make_pool("mha", torch.float32)
    host = HostKVBlocks(pool, BLOCK, capacity=8)
    errors: list[BaseException] = []
    puts = [0, 0]
    loads = [0, 0]
    start = threading.Barrier(2)

    def work(worker: int) -> None:
        try:
            start.wait()
            for i in range(200):
                key = f"{worker}-{i % 13}"
                first = 4 + 4 * ((worker * 3 + i) % 6)
                if host.put_from_pool(key, tokens(i), pool, torch.arange(first, first + BLOCK)):
                    puts[worker] += 1
                other = f"{1 - worker}-{i % 13}"
                if host.load_into_pool(other, pool, torch.arange(28, 32), skip=0):
                    loads[worker] += 1
                tensors = host.block_tensors(key)
                if tensors is not None:
                    assert len(tensors) == 4
                host.run_length([key, other])
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,)) for w in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    stats = host.stats()
    assert stats.blocks == len(host._index) == 8
    assert len(host._index) + len(host._free) == host.capacity
    assert sorted(row for row, _ in host._index.values()) == sorted(set(
        row for row, _ in host._index.values()))
    assert stats.bytes_written == sum(puts) * host.block_bytes
    assert stats.bytes_loaded == sum(loads) * host.block_bytes
    assert stats.dropped == sum(puts) - 8


# ---- CUDA (the device check, benchmarks/gpu_check.sh, runs these) ------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_write_back_keeps_the_kv_of_its_time_and_no_copy_waits_on_the_host():
    """The write-back's copy runs on the side stream while the current stream overwrites
    the slots it came from (a freed slot's next use): the row holds the old KV, a load
    brings it back into other slots, and neither call makes the host wait."""
    torch.manual_seed(0)
    pool = MHATokenToKVPool(1 << 14, 4, 8, 128, torch.bfloat16, "cuda")
    for buffer in pool.layer_buffers():
        buffer.copy_(torch.randn(buffer.shape, device="cuda").to(torch.bfloat16))
    block = 512
    host = HostKVBlocks(pool, block, capacity=4)
    assert all(b.is_pinned() for b in host.buffers)
    slots = torch.randperm(1 << 14, device="cuda")[: 3 * block]
    expected = [b.index_select(0, slots).cpu() for b in pool.layer_buffers()]
    blocks = [(f"k{i}", list(range(block)), False) for i in range(3)]
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert host.put_run_from_pool(blocks, pool, slots) == [True] * 3
        for buffer in pool.layer_buffers():  # the slots' next use, at once
            buffer.index_fill_(0, slots, -1.0)
        target = torch.arange(3 * block - 7, device="cuda")
        assert host.load_run_into_pool(["k0", "k1", "k2"], pool, target, skip=7) == 3
    finally:
        torch.cuda.set_sync_debug_mode("default")
    host.wait_for_copies()
    for i in range(3):
        got = host.block_tensors(f"k{i}")
        assert_same_bytes(got, [e[i * block : (i + 1) * block] for e in expected])
    assert_same_bytes([b[: 3 * block - 7].cpu() for b in pool.layer_buffers()],
                      [e[7:] for e in expected])
