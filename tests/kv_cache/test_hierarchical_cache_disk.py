"""The hierarchical prefix cache's disk tier (``radixlm/kv_cache/hierarchical_cache.py``
over ``disk_kv_store.py``): restarts, the warm start, prefetches, the load-cost check,
damaged files under a live cache and a full disk.

Every test runs over ``tests/hierarchical_rig.py``'s ``Rig``: real allocator, pool and
tiers, each request writing the KV a model would (``kv_of``, a hash of its prefix), so a
match or a load is checked against what a fresh computation would have written; every test
ends with the accounting balanced (``free + cached + held == pool``) and nothing protected
once no lock is held (the ``make_rig`` fixture).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
from hierarchical_rig import (
    Rig,
    block_kv,
    kv_of,
    prompt,
)
from mounts import tmpfs

# ---- the disk tier -----------------------------------------------------------------------------


def served_and_closed(make_rig, disk_dir):
    """A rig with a disk tier under ``disk_dir`` that served prompts a (13 tokens) and b
    (8, namespace "ns"), evicted them and closed (its queued disk writes finished):
    (the rig, a, b)."""
    first = make_rig(page=2, block=4, disk_dir=disk_dir)
    a, b = prompt(13), prompt(8, start=6000)
    first.serve(a)
    first.serve(b, "ns")
    first.evict_all()
    first.cache.close()
    return first, a, b


def test_a_restart_prefetches_from_disk_and_loads_exactly(make_rig, tmp_path):
    first, a, b = served_and_closed(make_rig, tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) == 3 + 2
    assert first.cache.counters.disk_writes_queued == 5
    restarted = make_rig(page=2, block=4, disk_dir=tmp_path)
    assert restarted.disk.stats().files == 5
    assert restarted.cache.load_back(a) == 0  # not in host memory yet
    assert restarted.cache.prefetch(a).result() == 12
    assert restarted.cache.prefetch(b, "ns").result() == 8
    assert restarted.cache.counters.disk_hit_tokens == 20
    loaded, matched = restarted.serve(a)
    assert loaded == matched == 12
    assert restarted.serve(b, "ns") == (8, 8)
    assert restarted.cache.prefetch(a) is None  # all held above the disk now
    assert restarted.cache.prefetch(b, None) is None


def test_a_warm_start_reads_the_most_recent_blocks_into_the_host_tier(make_rig, tmp_path):
    _, a, b = served_and_closed(make_rig, tmp_path)
    restarted = make_rig(page=2, block=4, disk_dir=tmp_path)
    assert restarted.cache.warm_up().result() == 20  # every block: the tier holds them
    assert restarted.cache.counters.warmed_tokens == 20
    assert restarted.cache.prefetch(a) is None  # nothing left to read for it
    loaded, matched = restarted.serve(a)  # exact KV: serve checks it
    assert loaded == matched == 12
    assert restarted.serve(b, "ns") == (8, 8)
    empty = make_rig(page=2, block=4, disk_dir=tmp_path / "none")
    assert empty.cache.warm_up() is None


def slowed(read, seconds: float):
    """``read`` (a real disk tier's), taking ``seconds`` longer."""
    def slow(*args):
        time.sleep(seconds)
        return read(*args)
    return slow


def test_a_prompt_read_from_disk_during_a_long_warm_start_does_not_wait_for_it(make_rig,
                                                                                tmp_path):
    """Twelve prompts' 36 blocks on disk, each read taking 20 ms: the warm start takes
    about 0.2 s with 4 readers, but a prompt's own read, queued behind one group of its
    reads at most, is done long before it (it waited for all of it once)."""
    first = make_rig(page=2, block=4, disk_dir=tmp_path, host_blocks=64)
    prompts = [prompt(12, start=1000 * (i + 1)) for i in range(12)]
    for tokens in prompts:
        first.serve(tokens)
    first.evict_all()
    first.cache.close()
    restarted = make_rig(page=2, block=4, disk_dir=tmp_path, host_blocks=64)
    disk = restarted.disk
    assert disk.stats().files == 36
    for name in ("read", "read_recorded"):
        setattr(disk, name, slowed(getattr(disk, name), 0.02))
    warm = restarted.cache.warm_up()
    time.sleep(0.01)  # (the warm start has begun)
    # (the most recent prompt: the warm start reads it last)
    assert restarted.cache.prefetch(prompts[-1]).result(timeout=30) == 12
    assert not warm.done()
    assert warm.result(timeout=30) == 36 * 4 - 12  # (it skipped what the prompt read)
    assert restarted.serve(prompts[0]) == (12, 12) and restarted.serve(prompts[-1]) == (12, 12)


def test_loads_stop_once_measured_to_cost_more_than_recomputing(make_rig):
    rig = make_rig(block=4)
    a, b = prompt(8), prompt(8, start=3000)
    rig.serve(a)
    rig.serve(b)
    rig.evict_all()
    rig.cache.recompute_seconds_per_token = lambda: 0.0  # recomputing is free
    assert rig.cache.load_back(a) == 8  # loads not measured yet: the first one runs
    free = rig.allocator.available_size()
    assert rig.cache.load_back(b) == 0 and rig.allocator.available_size() == free
    rig.cache.recompute_seconds_per_token = lambda: 1e9
    assert rig.cache.load_back(b) == 8 and rig.matched(b) == 8


def only_on_disk(make_rig, disk_dir) -> tuple[Rig, list[int]]:
    """A rig that served a 16-token prompt whose blocks are now on disk only (L1 and L2
    emptied): (the rig, the prompt)."""
    rig = make_rig(block=4, disk_dir=disk_dir)
    tokens = prompt(16)
    rig.serve(tokens)
    rig.evict_all()
    rig.drain()
    rig.cache.reset()
    rig.allocator.reset()
    return rig, tokens


def test_prefetch_reads_only_what_l1_and_l2_lack(make_rig, tmp_path):
    rig, tokens = only_on_disk(make_rig, tmp_path)
    rig.serve(tokens[:4], load=False)  # block 0 in L1
    assert rig.cache.prefetch(tokens).result() == 12
    assert rig.disk.stats().read_hits == 3
    assert rig.cache.load_back(tokens) == 12 and rig.matched(tokens) == 16


def damage_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def damage_overwrite(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * (path.stat().st_size // 256 + 1))


def damage_same_size_garbage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-8:] = b"\xff" * 8
    path.write_bytes(bytes(data))


def damage_delete(path: Path) -> None:
    path.unlink()


@pytest.mark.parametrize("damage", [damage_truncate, damage_overwrite,
                                    damage_same_size_garbage, damage_delete])
def test_a_damaged_file_under_a_live_cache_loads_only_the_whole_blocks(make_rig, tmp_path,
                                                                        caplog, damage):
    rig, tokens = only_on_disk(make_rig, tmp_path)
    keys = rig.cache.block_keys(tokens, None)
    damage(rig.disk.path_of(keys[2]))
    caplog.set_level(logging.WARNING)
    assert rig.cache.prefetch(tokens).result() == 8  # blocks 0 and 1
    assert any(r.levelno == logging.WARNING for r in caplog.records)
    assert keys[2] not in rig.host and keys[3] not in rig.host
    rig.scribble_free_slots()
    assert rig.serve(tokens) == (8, 8)
    assert not rig.disk.contains(keys[2])


def test_disk_writes_are_checked_bytes_of_the_evicted_kv(make_rig, tmp_path):
    rig = make_rig(page=4, block=8, disk_dir=tmp_path)
    tokens = prompt(24)
    rig.serve(tokens, "ns")
    rig.evict_all()
    rig.drain()
    for i, key in enumerate(rig.cache.block_keys(tokens, "ns")):
        block = tokens[i * 8:(i + 1) * 8]
        stored = rig.disk.read(key, block)
        assert torch.equal(block_kv(stored), kv_of("ns", tokens[:(i + 1) * 8], i * 8))


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 16 KiB tmpfs (a few block files), unmounted afterwards whatever happens."""
    with tmpfs(tmp_path / "mnt", "16k") as mount_point:
        yield mount_point


def test_a_full_disk_loses_blocks_with_a_warning_and_serving_goes_on(make_rig, small_tmpfs,
                                                                       caplog):
    caplog.set_level(logging.WARNING)
    rig = make_rig(block=4, slots=128, host_blocks=64, disk_dir=small_tmpfs,
                   disk_bytes=1 << 30)
    prompts = [prompt(16, start=1000 * (i + 1)) for i in range(8)]
    for tokens in prompts:
        rig.serve(tokens)
    rig.evict_all()
    rig.drain()
    disk = rig.disk.stats()
    assert disk.write_failures > 0 and 0 < disk.files < 32
    assert any("cannot write" in r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING)
    assert not [p for p in small_tmpfs.iterdir() if p.name.endswith(".tmp")]
    rig.scribble_free_slots()
    for tokens in prompts:  # every block is still in host memory
        assert rig.serve(tokens) == (16, 16)
