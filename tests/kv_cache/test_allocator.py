"""The paged allocator: which slots it hands out, in which order, and all-or-nothing when it
runs short."""

from __future__ import annotations

import pytest
import torch

from radixlm.kv_cache.allocator import OutOfKVSlots, TokenToKVPoolAllocator, opens_page


def pages_of(slots: torch.Tensor, page_size: int) -> list[int]:
    return torch.unique_consecutive(slots // page_size).tolist()


@pytest.mark.parametrize("page_size", [1, 4])
def test_an_allocation_takes_its_pages_in_ascending_order_even_after_scrambled_frees(
        page_size):
    allocator = TokenToKVPoolAllocator(64 * page_size, page_size)
    first = allocator.alloc(10 * page_size)
    assert pages_of(first, page_size) == sorted(pages_of(first, page_size))
    held = [allocator.alloc(page_size) for _ in range(20)]
    for index in (7, 2, 15, 3, 11, 0, 9):  # freed out of order
        allocator.free(held[index])
    again = allocator.alloc(7 * page_size)
    pages = pages_of(again, page_size)
    assert len(pages) == 7 and pages == sorted(pages)
    expected = sorted(int(held[i][0]) // page_size for i in (7, 2, 15, 3, 11, 0, 9))
    assert pages == expected  # the freed pages, most recently freed first, reused


def test_alloc_next_continues_each_page_and_opens_one_at_a_boundary():
    allocator = TokenToKVPoolAllocator(32, page_size=4)
    a = allocator.alloc(3)   # one page, one slot left in it
    b = allocator.alloc(4)   # a full page
    free_before = allocator.available_size()
    slots = allocator.alloc_next([int(a[-1]), int(b[-1]), -1])
    assert slots[0] == int(a[-1]) + 1                    # the room left in a's page
    assert slots[1] % 4 == 0 and slots[2] % 4 == 0       # fresh pages for b and the empty one
    assert slots[1] != slots[2]
    assert allocator.available_size() == free_before - 2 * 4
    assert [opens_page(last, 4) for last in (int(a[-1]), int(b[-1]), -1)] == [
        False, True, True]


def test_alloc_next_takes_nothing_when_the_pool_runs_short():
    allocator = TokenToKVPoolAllocator(8, page_size=4)
    a = allocator.alloc(4)
    b = allocator.alloc(4)
    assert allocator.available_size() == 0
    with pytest.raises(OutOfKVSlots):
        allocator.alloc_next([int(a[-1]), int(b[-1])])
    assert allocator.available_size() == 0
    allocator.free(b)
    assert allocator.alloc_next([int(a[-1])]) == [int(b[0])]  # the page b gave back
    assert allocator.available_size() == 0


def test_alloc_next_with_pages_of_one_token_always_opens_a_page():
    allocator = TokenToKVPoolAllocator(8, page_size=1)
    slots = allocator.alloc_next([3, 5])
    assert len(set(slots)) == 2 and allocator.available_size() == 6


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("last_in_page", [None, 0, 2, 3])
@pytest.mark.parametrize("num_tokens", [0, 1, 2, 5, 9])
def test_extend_gives_the_last_slot_on_the_host_as_alloc_extend_places_it(
        page_size, last_in_page, num_tokens):
    allocator = TokenToKVPoolAllocator(64, page_size)
    last = -1
    if last_in_page is not None:
        last = int(allocator.alloc(last_in_page % page_size + 1)[-1])
    free = allocator.available_size()
    slots, host_last = allocator.extend(last, num_tokens)
    assert len(slots) == num_tokens
    assert host_last == (int(slots[-1]) if num_tokens else last)
    expected = list(range(last + 1, last + 1 + min(num_tokens, (-last - 1) % page_size)))
    if page_size > 1 and last >= 0:  # the room left in the last page comes first
        assert slots[: len(expected)].tolist() == expected
    fresh = num_tokens - (len(expected) if page_size > 1 and last >= 0 else 0)
    assert free - allocator.available_size() == -(-fresh // page_size) * page_size


def test_free_pages_returns_host_page_numbers_as_free_does_their_slots():
    by_slots, by_pages = (TokenToKVPoolAllocator(32, page_size=4) for _ in range(2))
    slots = by_slots.alloc(10)
    assert by_pages.alloc(10).tolist() == slots.tolist()
    by_slots.free(slots)
    by_pages.free_pages(sorted(set((slots // 4).tolist())))
    assert by_slots.available_size() == by_pages.available_size() == 32
    assert sorted(by_slots._free_pages) == sorted(by_pages._free_pages)
