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
