"""Tests of ``RequestMemory.alloc`` listing its slots and ``give_back``
(radixlm/runtime/scheduler/request_memory.py), a speculative verify step's KV: a request
extended by its last token and a draft keeps the slots of the tokens it kept, gives the rest
back at once, and the conservation invariant (free + cached + held == pool) holds after every
step and after its release."""

from __future__ import annotations

import random

import pytest

from radixlm.kv_cache.allocator import TokenToKVPoolAllocator, pages_for
from radixlm.kv_cache.memory_pool import ReqToTokenPool
from radixlm.kv_cache.radix_tree import RadixCache
from radixlm.runtime.request import Req
from radixlm.runtime.sampling.sampling_params import SamplingParams
from radixlm.runtime.scheduler.request_memory import RequestMemory

POOL = 512


def make_memory(page_size: int) -> RequestMemory:
    allocator = TokenToKVPoolAllocator(POOL, page_size)
    return RequestMemory(ReqToTokenPool(4, 256, "cpu"), allocator,
                         RadixCache(allocator, page_size))


def held_slots(memory: RequestMemory, reqs: list[Req]) -> int:
    """Slots the running requests hold beyond their tree prefix, in whole pages."""
    return sum(pages_for(r.kv_len, memory.page_size) - len(r.prefix_indices) for r in reqs)


def assert_conserved(memory: RequestMemory, reqs: list[Req]) -> None:
    assert (memory.allocator.available_size() + memory.tree_cache.total_size()
            + held_slots(memory, reqs)) == memory.allocator.size


def start(memory: RequestMemory, prompt: list[int]) -> Req:
    """Admits ``prompt`` and runs its prefill: one output token, without KV yet."""
    req = Req("r", list(prompt), SamplingParams())
    memory.match_and_lock(req)
    memory.assign_row(req)
    count = len(prompt) - req.kv_len
    memory.alloc(req, count)
    req.kv_len += count
    req.output_ids.append(7)
    return req


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_verify_step_keeps_the_kept_tokens_slots_and_gives_back_the_rest(page_size):
    rng = random.Random(page_size)
    memory = make_memory(page_size)
    row_of = memory.req_to_token
    for round_ in range(6):
        prompt = [rng.randrange(3, 50) for _ in range(rng.randint(3, 13))]
        req = start(memory, prompt)
        assert_conserved(memory, [req])
        for _ in range(8):
            draft = rng.randint(0, 6)
            before = row_of[req.req_pool_idx, : req.kv_len].tolist()
            listed = []
            slots = memory.alloc(req, 1 + draft, listed)
            assert slots.tolist() == listed
            req.kv_len += 1 + draft
            assert row_of[req.req_pool_idx, : req.kv_len].tolist() == before + listed
            keep = rng.randint(1, 1 + draft)
            memory.give_back(req, listed, keep)
            req.output_ids += [rng.randrange(3, 50) for _ in range(keep)]
            assert req.kv_len == len(before) + keep == req.seq_len - 1
            assert req.last_slot == listed[keep - 1]
            assert row_of[req.req_pool_idx, : req.kv_len].tolist() == before + listed[:keep]
            assert_conserved(memory, [req])
        memory.release(req)
        assert_conserved(memory, [])
        assert memory.tree_cache.protected_size() == 0, round_


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_failed_pass_giving_back_every_draft_slot_leaves_the_request_as_before(page_size):
    memory = make_memory(page_size)
    req = start(memory, list(range(3, 9)))
    free, kv_len = memory.allocator.available_size(), req.kv_len
    listed = []
    memory.alloc(req, 6, listed)
    req.kv_len += 6
    memory.give_back(req, listed, 1)
    # Only the last token's slot stays: as after a plain decode step's allocation.
    assert req.kv_len == kv_len + 1 and req.last_slot == listed[0]
    assert memory.allocator.available_size() == free - (
        pages_for(kv_len + 1, page_size) - pages_for(kv_len, page_size))
    memory.release(req)
    assert_conserved(memory, [])


def test_give_back_keeps_one_to_all_of_the_listed_slots():
    memory = make_memory(1)
    req = start(memory, [3, 4, 5])
    listed = []
    memory.alloc(req, 3, listed)
    req.kv_len += 3
    for keep in (0, 4):
        with pytest.raises(ValueError, match="keeps 1..3"):
            memory.give_back(req, listed, keep)
    memory.give_back(req, listed, 3)
    req.output_ids += [1, 2, 3]
    memory.release(req)
    assert_conserved(memory, [])
