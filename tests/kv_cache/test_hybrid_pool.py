"""The hybrid pool (``radixlm/kv_cache/hybrid_pool.py``): request pages paired with local
pages, the slot map that follows the pairing, local KV freed apart from full KV, writes and
copies through the map."""

from __future__ import annotations

import pytest
import torch

from radixlm.kv_cache.allocator import OutOfKVSlots
from radixlm.kv_cache.hybrid_pool import HybridAllocator, HybridKVPool
from radixlm.kv_cache.memory_pool import copy_slots


def check_map(allocator: HybridAllocator) -> None:
    """The module's invariants: the slot map follows the page map; a local page is paired
    at most once and free exactly when unpaired."""
    page = allocator.page_size
    pages = torch.arange(len(allocator.page_map))
    local = allocator.page_map
    want = torch.where(local[:, None] == 0, 0, local[:, None] * page + torch.arange(page))
    assert torch.equal(allocator.slot_map, want.reshape(-1))
    paired = local[local != 0].tolist()
    assert len(paired) == len(set(paired))
    free = set(allocator.local._free_pages)
    assert not free & set(paired)
    assert len(free) + len(paired) == allocator.local.num_pages
    assert int(local[0]) == 0 and pages.numel() == allocator.num_pages + 1


@pytest.mark.parametrize("page", [1, 4, 16])
def test_allocations_pair_every_request_page_with_a_local_page(page):
    allocator = HybridAllocator(64 * page, 16 * page, page)
    a = allocator.alloc(3 * page - 1)
    b = allocator.alloc_extend(int(a[-1]), 2)
    c = allocator.alloc_next([int(b[-1]), -1])
    check_map(allocator)
    for slots in (a, b, torch.tensor(c)):
        assert bool(allocator.local_held(slots).all())
        assert bool((allocator.slot_map[slots] != 0).all())
    assert allocator.local_available_size() == allocator.local.size - (
        allocator.size - allocator.available_size())


@pytest.mark.parametrize("page", [1, 4, 16])
def test_release_local_frees_local_pages_only_and_zeroes_their_map(page):
    allocator = HybridAllocator(64 * page, 16 * page, page)
    slots = allocator.alloc(4 * page)
    full_free = allocator.available_size()
    assert allocator.release_local(slots[: 2 * page]) == 2 * page
    assert allocator.release_local(slots[: 2 * page]) == 0  # a second release is a no-op
    assert allocator.available_size() == full_free
    assert allocator.local_held(slots).tolist() == [False] * (2 * page) + [True] * (2 * page)
    assert bool((allocator.slot_map[slots[: 2 * page]] == 0).all())
    check_map(allocator)
    allocator.free(slots)  # the rest of the local pages go with the request pages
    assert allocator.available_size() == allocator.size
    assert allocator.local_available_size() == allocator.local.size
    check_map(allocator)


def test_a_short_local_pool_refuses_an_allocation_without_taking_request_pages():
    allocator = HybridAllocator(64, 8, 4)
    allocator.alloc(8)
    with pytest.raises(OutOfKVSlots):
        allocator.alloc(4)
    assert allocator.available_size() == 64 - 8
    check_map(allocator)


def test_move_local_hands_a_local_page_to_a_page_that_lost_its_own():
    allocator = HybridAllocator(64, 32, 4)
    tree, mine = allocator.alloc(8), allocator.alloc(8)
    allocator.release_local(tree)
    assert allocator.move_local(mine, tree) == 2
    assert bool(allocator.local_held(tree).all()) and not bool(allocator.local_held(mine).any())
    check_map(allocator)
    allocator.free(mine)
    allocator.free(tree)
    assert allocator.local_available_size() == allocator.local.size


def make_pool(page: int = 4) -> tuple[HybridAllocator, HybridKVPool]:
    allocator = HybridAllocator(64, 32, page)
    pool = HybridKVPool(allocator.size + page, allocator.local.size + page, 3, frozenset({0, 2}),
                        2, 8, torch.float32, "cpu", allocator.slot_map)
    return allocator, pool


def test_sliding_layers_store_at_local_slots_full_layers_at_request_slots():
    allocator, pool = make_pool()
    slots = allocator.alloc(6)
    k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    for layer in range(3):
        pool.set_kv(layer, slots, k, v)
    assert pool.slot_map_for(1) is None and pool.slot_map_for(0) is pool.slot_map_for(2)
    assert pool.get_kv(0)[0].shape[0] == allocator.local.size + 4
    assert pool.get_kv(1)[0].shape[0] == allocator.size + 4
    local = allocator.slot_map[slots]
    torch.testing.assert_close(pool.get_kv(0)[0][local], k)
    torch.testing.assert_close(pool.get_kv(2)[1][local], v)
    torch.testing.assert_close(pool.get_kv(1)[0][slots], k)
    assert len(pool.layer_buffers()) == 6
    assert pool.bytes_per_local_token() * 3 == pool.bytes_per_token() * 2


def test_copy_slots_copies_through_the_map_in_sliding_layers():
    allocator, pool = make_pool()
    src, dst = allocator.alloc(4), allocator.alloc(4)
    k = torch.randn(4, 2, 8)
    for layer in range(3):
        pool.set_kv(layer, src, k, -k)
    copy_slots(pool, src, dst)
    for layer in range(3):
        keys, values = pool.get_kv(layer)
        rows = allocator.slot_map[dst] if layer != 1 else dst
        torch.testing.assert_close(keys[rows], k)
        torch.testing.assert_close(values[rows], -k)
