"""Tests of the allocator's host-listed extension and tail release
(radixlm/kv_cache/allocator.py: ``extend_listed``, ``free_tail``), which speculative decoding
uses to give back the slots of rejected draft tokens: the same slots ``extend`` hands out,
and exactly the pages only the tail holds freed, so ``available + held == size`` throughout."""

from __future__ import annotations

import random

import pytest

from radixlm.kv_cache.allocator import TokenToKVPoolAllocator


def pages(slots: list[int], page_size: int) -> set[int]:
    return {slot // page_size for slot in slots}


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_extend_listed_hands_out_the_slots_extend_would(page_size):
    rng = random.Random(page_size)
    listed = TokenToKVPoolAllocator(64 * page_size, page_size)
    extended = TokenToKVPoolAllocator(64 * page_size, page_size)
    held: list[list[int]] = [[], [], []]  # three sequences growing side by side
    for _ in range(80):
        seq = rng.randrange(3)
        last = held[seq][-1] if held[seq] else -1
        count = rng.randint(0 if held[seq] else 1, 2 * page_size + 1)
        got = listed.extend_listed(last, count)
        want, want_last = extended.extend(last, count)
        assert got == want.tolist()
        assert (got[-1] if got else last) == want_last
        assert listed.available_size() == extended.available_size()
        held[seq] += got
        if rng.random() < 0.2:  # the sequence ends: its pages go back, to both alike
            for allocator in (listed, extended):
                allocator.free_pages(sorted(pages(held[seq], page_size)))
            held[seq] = []


def test_extend_listed_fills_the_last_page_before_taking_fresh_ones():
    allocator = TokenToKVPoolAllocator(64, 4)
    first = allocator.extend_listed(-1, 3)
    assert len(first) == 3 and pages(first, 4) == {first[0] // 4} and first[0] % 4 == 0
    more = allocator.extend_listed(first[-1], 6)
    assert more[0] == first[-1] + 1  # the room left in the page
    assert all(s % 4 == i for i, s in enumerate(more[1:5]))  # then a fresh page, in order
    assert allocator.available_size() == 64 - 3 * 4


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("before", [0, 1, 3, 4, 5])
def test_free_tail_frees_exactly_the_pages_only_the_tail_lies_in(page_size, before):
    for count in range(1, 11):
        for keep in range(1, count + 1):
            allocator = TokenToKVPoolAllocator(32 * page_size, page_size)
            head = allocator.extend_listed(-1, before) if before else []
            last = head[-1] if head else -1
            listed = allocator.extend_listed(last, count)
            held_before = pages(head + listed, page_size)
            assert allocator.available_size() + len(held_before) * page_size == allocator.size
            allocator.free_tail(listed, keep)
            kept = pages(head + listed[:keep], page_size)
            # What stays held: the pages of the kept slots, nothing more.
            assert allocator.available_size() + len(kept) * page_size == allocator.size
            freed = set(allocator._free_pages) & held_before
            assert freed == held_before - kept
            # The sequence goes on from its last kept slot, into the same page where it
            # has room: nothing it keeps is handed out again.
            last = listed[keep - 1]
            again = allocator.extend_listed(last, 2 * page_size)
            assert not set(again) & set(head + listed[:keep])
            if (last + 1) % page_size:
                assert again[0] == last + 1
            else:
                assert again[0] % page_size == 0


def test_free_tail_keeps_at_least_one_slot():
    allocator = TokenToKVPoolAllocator(16, 4)
    listed = allocator.extend_listed(-1, 3)
    with pytest.raises(ValueError, match="keep"):
        allocator.free_tail(listed, 0)
    allocator.free_tail(listed, 3)  # keeping all frees nothing
    assert allocator.available_size() == 16 - 4
