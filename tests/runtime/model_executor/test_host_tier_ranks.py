"""The hierarchical prefix cache over tensor-parallel ranks
(``radixlm/runtime/model_executor/host_tier_ranks.py``).

In one process: rank 0's host tier records its changes of rows (``HostTierLog``) and another
rank's ``HostTierFollower`` applies them to a pool of its own (other bytes: its share of the
heads), so its pool ends up moved exactly as rank 0's was: the same rows, LRU reuse of rows,
files in its own directory under rank 0's keys, reads started ahead and put into the rows
rank 0 filled, and a block it could not read flagged for the confirmation.

Two ranks (slow stage): schedulers of a model split over two gloo ranks with a 256-token
device pool, whose evicted prefixes come back from the host tiers, or after a restart from
each rank's disk directory, with the tokens and logprobs of a cold two-rank scheduler; a
block the other rank lost is recomputed and dropped on rank 0 too.
"""

from __future__ import annotations

import contextlib
import os
import random

import pytest
import torch
from runtime_checks import assert_pool_idle, run_to_completion, scheduler_req
from workloads import greedy, random_ids

from radixlm.kv_cache.disk_kv_store import DiskKVStore
from radixlm.kv_cache.host_kv_blocks import HostKVBlocks
from radixlm.kv_cache.kv_block_format import StoreIdentity, chained_block_keys
from radixlm.kv_cache.memory_pool import MHATokenToKVPool
from radixlm.runtime.model_executor.host_tier_ranks import (
    HostTierFollower,
    HostTierLog,
    key_ints,
    key_of,
    rank_directory,
)
from radixlm.runtime.scheduler.scheduler_process import build_scheduler
from radixlm.runtime.server_args import ServerArgs

BLOCK = 4
SLOTS = 64
CAPACITY = 3


def random_pool(seed: int) -> MHATokenToKVPool:
    pool = MHATokenToKVPool(SLOTS, 2, 2, 4, torch.float32, "cpu")
    g = torch.Generator().manual_seed(seed)
    for buffer in pool.layer_buffers():
        buffer.copy_(torch.randn(buffer.shape, generator=g))
    return pool


def kv_of(pool, slots) -> list[torch.Tensor]:
    return [b.index_select(0, torch.as_tensor(slots)).clone() for b in pool.layer_buffers()]


def assert_same(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


class TwoRanks:
    """Rank 0's host tier (with its log) and another rank's follower, each over a pool of
    its own; ``sync`` sends what rank 0 recorded, as ``StepSender`` would."""

    def __init__(self, directory=None, pools=None):
        self.pools = pools or (random_pool(0), random_pool(1))
        self.host = HostKVBlocks(self.pools[0], BLOCK, CAPACITY)
        self.log = self.host.mirror = HostTierLog(sender=None)
        self.follower = HostTierFollower(self.pools[1], BLOCK, CAPACITY,
                                         None if directory is None else str(directory),
                                         1 << 30, 1, rank=1, size=2)
        self.keys = chained_block_keys("f" * 64, BLOCK, list(range(8 * BLOCK)), None)

    def sync(self) -> None:
        changes = self.log.take()
        if changes is not None:
            self.follower.apply(*changes, cpu_group=None)

    def store(self, block: int, first_slot: int, disk=None) -> None:
        slots = torch.arange(first_slot, first_slot + BLOCK)
        tokens = list(range(block * BLOCK, (block + 1) * BLOCK))
        assert self.host.put_from_pool(self.keys[block], tokens, self.pools[0], slots,
                                       to_disk=disk is not None)
        if disk is not None:
            assert disk.write(self.keys[block], tokens, kv_of(self.pools[0], slots))

    def load(self, block: int, first_slot: int, skip: int = 0) -> None:
        slots = torch.arange(first_slot, first_slot + BLOCK - skip)
        assert self.host.load_into_pool(self.keys[block], self.pools[0], slots, skip)


def test_each_rank_has_a_disk_directory_of_its_own_and_keys_cross_as_bytes():
    assert rank_directory("/tmp/kv", 0, 1) == "/tmp/kv"
    assert rank_directory("/tmp/kv", 1, 4) == "/tmp/kv/tp4-rank1"
    key = chained_block_keys("0" * 64, BLOCK, list(range(BLOCK)), None)[0]
    assert len(key_ints(key)) == 32 and key_of(key_ints(key)) == key


def test_a_follower_moves_its_share_through_the_rows_rank_0_chose():
    ranks = TwoRanks()
    # Four blocks into three rows: the fourth takes the least recently used one's row.
    for block, first_slot in enumerate([0, 4, 8, 12]):
        ranks.store(block, first_slot)
    ranks.sync()
    assert ranks.host.run_length(ranks.keys[:1]) == 0  # block 0 was dropped
    for block, source, target in [(1, 4, 40), (3, 12, 48)]:
        ranks.load(block, target)
        ranks.sync()
        for pool in ranks.pools:
            assert_same(kv_of(pool, range(target, target + BLOCK)),
                        kv_of(pool, range(source, source + BLOCK)))
    ranks.load(2, 56, skip=1)  # a block's tail only
    ranks.sync()
    for pool in ranks.pools:
        assert_same(kv_of(pool, range(56, 59)), kv_of(pool, range(9, 12)))


def identity_of(pool, rank: int) -> StoreIdentity:
    return StoreIdentity.of_pool(pool, model="m", tokenizer="t", page_size=1,
                                 block_tokens=BLOCK, tp_rank=rank, tp_size=2)


def with_disks(tmp_path) -> tuple[TwoRanks, str, DiskKVStore]:
    """Two ranks whose disk tiers are open under ``tmp_path``: (the ranks, rank 0's key
    fingerprint, rank 0's disk tier)."""
    ranks = TwoRanks(tmp_path)
    fingerprint = identity_of(ranks.pools[0], 0).fingerprint()
    ranks.log.opened(fingerprint)
    disk = DiskKVStore(rank_directory(str(tmp_path), 0, 2), identity_of(ranks.pools[0], 0),
                       1 << 30)
    return ranks, fingerprint, disk


def test_a_followers_share_goes_to_its_own_directory_and_comes_back_from_it(tmp_path):
    ranks, fingerprint, disk = with_disks(tmp_path)
    ranks.store(0, 0, disk)
    ranks.store(1, 4, disk)
    # A block only the device pool holds, written at shutdown straight from the slots.
    tokens = list(range(2 * BLOCK, 3 * BLOCK))
    assert disk.write(ranks.keys[2], tokens, kv_of(ranks.pools[0], range(20, 24)))
    ranks.log.device_written(ranks.keys[2], tokens, torch.arange(20, 24))
    ranks.sync()
    ranks.follower.close()  # (finishes its writes)
    names = [sorted(os.listdir(tmp_path / f"tp2-rank{r}")) for r in (0, 1)]
    assert names[0] == names[1] and len(names[0]) == 3
    theirs = DiskKVStore(tmp_path / "tp2-rank1", ranks.follower.disk.identity, 1 << 30)
    for block, first_slot in [(1, 4), (2, 20)]:
        assert_same(theirs.read_recorded(ranks.keys[block])[1],
                    kv_of(ranks.pools[1], range(first_slot, first_slot + BLOCK)))

    # A restart: empty rows on both ranks; rank 0 reads its files, the follower its own.
    again = TwoRanks(tmp_path, pools=ranks.pools)  # (the same bytes to compare against)
    again.log.opened(fingerprint)
    again.log.fetching(again.keys[:2])
    again.sync()
    for block in range(2):
        tokens, tensors = disk.read_recorded(again.keys[block])
        assert again.host.put_tensors(again.keys[block], tokens, tensors)
    again.sync()
    assert again.follower.held([0, 1]) == [True, True]  # (rows 0 and 1, in order of use)
    again.load(1, 32)
    again.sync()
    for pool in again.pools:
        assert_same(kv_of(pool, range(32, 36)), kv_of(pool, range(4, 8)))
    again.follower.close()


def test_a_block_the_follower_cannot_read_is_flagged_not_held(tmp_path):
    ranks, fingerprint, disk = with_disks(tmp_path)
    for block in range(3):
        ranks.store(block, 4 * block, disk)
    ranks.sync()
    ranks.follower.close()
    theirs = tmp_path / "tp2-rank1"
    files = sorted(theirs.iterdir())
    (theirs / f"{ranks.keys[1]}.safetensors").unlink()  # deleted before the restart
    damaged = theirs / f"{ranks.keys[2]}.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-16] + os.urandom(16))  # damaged under it
    assert len(files) == 3

    follower = HostTierFollower(random_pool(1), BLOCK, CAPACITY, str(tmp_path), 1 << 30, 1,
                                rank=1, size=2)
    log = HostTierLog(sender=None)
    log.opened(fingerprint)
    log.fetching(ranks.keys[:3])
    for row, block in enumerate(range(3)):
        log.fetched(row, ranks.keys[block])
    follower.apply(*log.take(), cpu_group=None)
    assert follower.held([0, 1, 2]) == [True, False, False]
    follower.close()


# Two ranks -----------------------------------------------------------------------------------

BASE = {"dtype": "float32", "num_threads": 1, "disable_adaptive_timing": True,
        "chunked_prefill_step_ms": None, "tp_size": 2}
COLD = {**BASE, "disable_radix_cache": True}
HI = {**BASE, "max_total_tokens": 256, "max_running_requests": 8,
      "enable_hierarchical_cache": True, "hicache_block_tokens": 8, "hicache_ratio": 16.0}
LOGPROBS = {"return_logprob": True, "top_logprobs_num": 3}


@contextlib.contextmanager
def two_rank_scheduler(path, **options):
    scheduler = build_scheduler(ServerArgs(str(path), **options), str(path))
    try:
        yield scheduler
    finally:
        scheduler.shutdown()


def prompts_over_shared_prefixes(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [random_ids(seed * 100 + i, 40) for i in range(3)]
    return [systems[i % 3] + random_ids(seed * 1000 + i, rng.randint(16, 40))
            for i in range(count)]


def run_in_groups(scheduler, prompts: list[list[int]], group: int = 3) -> list:
    done = []
    for start in range(0, len(prompts), group):
        reqs = [scheduler_req(scheduler, p, greedy(8), **LOGPROBS)
                for p in prompts[start : start + group]]
        run_to_completion(scheduler, reqs, max_steps=20_000)
        done += reqs
    return done


def assert_same_outputs(got: list, expected: list) -> None:
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.output_ids == theirs.output_ids
        torch.testing.assert_close(torch.tensor([e[0] for e in ours.output_token_logprobs]),
                                   torch.tensor([e[0] for e in theirs.output_token_logprobs]),
                                   atol=1e-5, rtol=0)


def tiers(scheduler) -> dict:
    info = scheduler.server_info()
    assert_pool_idle(info)
    return info["hierarchical_cache"]


@pytest.fixture(scope="module")
def cold_outputs(tiny_model_dir):
    """Each prompt list's outputs from a cold two-rank scheduler (no prefix cache); call it
    while no other two-rank scheduler runs (a process joins one group of ranks at a time)."""
    found = {}

    def outputs(prompts: list[list[int]], architecture: str = "LlamaForCausalLM") -> list:
        key = (str(prompts), architecture)
        if key not in found:
            with two_rank_scheduler(tiny_model_dir(architecture), **COLD) as cold:
                found[key] = run_in_groups(cold, prompts)
        return found[key]

    return outputs


@pytest.mark.slow
@pytest.mark.parametrize(("architecture", "policy", "page_size"), [
    ("LlamaForCausalLM", "write_back", 1),  # KV heads split between the ranks
    ("LlamaForCausalLM", "write_through", 4),
    ("DeepseekV2ForCausalLM", "write_back", 1),  # MLA: each rank holds the whole latent
])
def test_two_ranks_load_evicted_prefixes_back_from_their_host_tiers_exactly(
        tiny_model_dir, cold_outputs, architecture, policy, page_size):
    prompts = prompts_over_shared_prefixes(12, 5)
    expected = cold_outputs(prompts, architecture)  # (first: one two-rank group at a time)
    with two_rank_scheduler(tiny_model_dir(architecture), **HI, hicache_write_policy=policy,
                            page_size=page_size) as hi:
        run_in_groups(hi, prompts)  # the second round finds the first's prefixes evicted
        before = tiers(hi)["host_hit_tokens"]
        assert_same_outputs(run_in_groups(hi, prompts), expected)
        assert tiers(hi)["host_hit_tokens"] > before


def block_names(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".safetensors"))


@pytest.mark.slow
def test_two_ranks_restart_from_their_own_disk_directories_exactly(tiny_model_dir, cold_outputs,
                                                                   tmp_path):
    prompts = prompts_over_shared_prefixes(10, 6)
    expected = cold_outputs(prompts)
    options = {**HI, "hicache_storage_backend": "file", "hicache_storage_dir": str(tmp_path)}
    with two_rank_scheduler(tiny_model_dir(), **options) as first:
        run_in_groups(first, prompts)
    names = [block_names(tmp_path / f"tp2-rank{r}") for r in (0, 1)]
    assert names[0] == names[1] and len(names[0]) >= 10
    with two_rank_scheduler(tiny_model_dir(), **options) as second:
        assert_same_outputs(run_in_groups(second, prompts), expected)
        found = tiers(second)
        assert found["disk_hit_tokens"] > 0 and found["host_hit_tokens"] > 0, found


@pytest.mark.slow
def test_blocks_the_other_rank_lost_are_recomputed_and_dropped_on_rank_0(
        tiny_model_dir, cold_outputs, tmp_path):
    prompts = prompts_over_shared_prefixes(10, 7)
    expected = cold_outputs(prompts)
    options = {**HI, "hicache_storage_backend": "file", "hicache_storage_dir": str(tmp_path)}
    with two_rank_scheduler(tiny_model_dir(), **options) as first:
        run_in_groups(first, prompts)
    theirs = tmp_path / "tp2-rank1"
    names = block_names(theirs)
    for i, name in enumerate(names):  # every file of the other rank deleted or damaged
        if i % 2:
            os.unlink(theirs / name)
        else:
            data = (theirs / name).read_bytes()
            (theirs / name).write_bytes(data[:-16] + bytes(b ^ 0xFF for b in data[-16:]))
    with two_rank_scheduler(tiny_model_dir(), **options) as second:
        assert_same_outputs(run_in_groups(second, prompts), expected)
        found = tiers(second)
        assert found["rank_misses"] > 0, found
        assert found["disk"]["files"] < len(names) + found["disk_writes_queued"], found
