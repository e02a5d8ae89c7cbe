"""The paged allocator of KV slots (PagedAttention's block table, one level down).

The token-to-KV pool holds ``num_pages * page_size`` slots. A slot index ``s`` lies in page
``s // page_size``. Page 0 is reserved: its slots are where padded positions write and read,
so a gather over a padded index table never touches a live token. All other pages are handed
out whole: a request's tokens fill its last page before a new one is taken, so a page belongs
to exactly one owner (a request, or a radix-tree node once cached).

Invariants (checked by tests after every engine run):
- ``available_size() + (tokens held by requests and the cache) == size``;
- a page is either in the free list or owned, never both, never twice in the free list.

The free list is host integers, and so is everything ``alloc_next``, ``extend`` and
``free_pages`` take or return: a caller that keeps its sequences' last slots and pages on
the host allocates and frees without reading the device. Slots reach the device in one
copy from host values (``to_device``: pinned memory on CUDA). ``free`` of a device tensor
of slots is the one read back (``radixlm/runtime/scheduler/host_reads.py`` says where the
step loop still does it).
"""

from __future__ import annotations

import torch

from radixlm.host_to_device import to_device


def pages_for(num_tokens: int, page_size: int) -> int:
    """Slots in the whole pages that ``num_tokens`` tokens occupy."""
    return -(-num_tokens // page_size) * page_size


def opens_page(last_slot: int, page_size: int) -> bool:
    """Whether the token after the one at ``last_slot`` (< 0: none yet) needs a fresh page."""
    return last_slot < 0 or (last_slot + 1) % page_size == 0


class OutOfKVSlots(RuntimeError):
    """Raised when an allocation cannot be served; callers evict or retract and retry."""


class TokenToKVPoolAllocator:
    """Hands out KV slot indices in pages of ``page_size`` tokens.

    ``size`` is the number of usable token slots (a multiple of ``page_size``); the reserved
    page 0 is not counted in it.
    """

    def __init__(self, size: int, page_size: int = 1, device: str | torch.device = "cpu"):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size < page_size:
            raise ValueError(
                f"the KV pool must hold at least one page ({page_size} tokens), got {size}"
            )
        self.page_size = page_size
        self.num_pages = size // page_size
        self.size = self.num_pages * page_size
        self.device = torch.device(device)
        self.reset()

    def reset(self) -> None:
        # Pages 1..num_pages are usable; page 0 is the padding page.
        self._free_pages: list[int] = list(range(self.num_pages, 0, -1))

    def available_size(self) -> int:
        """Free token slots (whole free pages only)."""
        return len(self._free_pages) * self.page_size

    def alloc(self, num_tokens: int) -> torch.Tensor:
        """Slots for ``num_tokens`` tokens in fresh pages (the last page may be partly used)."""
        if num_tokens == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        pages = self._take_pages(-(-num_tokens // self.page_size))
        return self._page_slots(pages)[:num_tokens]

    def alloc_extend(self, last_slot: int, num_tokens: int) -> torch.Tensor:
        """Slots for ``num_tokens`` tokens that follow the token stored at ``last_slot``.

        The slots after ``last_slot`` inside its page are used first, then fresh pages, so
        each request's tokens stay packed into its own pages. ``last_slot < 0`` means the
        sequence is empty so far.
        """
        return self.extend(last_slot, num_tokens)[0]

    def extend(self, last_slot: int, num_tokens: int) -> tuple[torch.Tensor, int]:
        """``alloc_extend``'s slots on the device, and the last of them as a host integer
        (``last_slot`` itself for no tokens), for callers that keep each sequence's last
        slot without reading the device."""
        page = self.page_size
        if num_tokens == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device), last_slot
        in_page, rest, pages = self._extension(last_slot, num_tokens)
        last = last_slot + in_page if rest == 0 else pages[-1] * page + (rest - 1) % page
        if in_page == 0:
            return self._page_slots(pages)[:num_tokens], last
        # One copy: the slots left in the last page, then the fresh pages' numbers.
        values = to_device([*range(last_slot + 1, last_slot + 1 + in_page), *pages],
                           torch.int64, self.device)
        head, fresh = values.split([in_page, len(pages)])
        if not pages:
            return head, last
        offsets = torch.arange(page, device=self.device)
        return torch.cat([head, (fresh[:, None] * page + offsets).reshape(-1)[:rest]]), last

    def extend_listed(self, last_slot: int, num_tokens: int) -> list[int]:
        """``extend``'s slots as host integers (for a caller that may give the tail back:
        ``free_tail``); the same slots ``extend`` would hand out."""
        page = self.page_size
        in_page, rest, pages = self._extension(last_slot, num_tokens)
        fresh = [p * page + offset for p in pages for offset in range(page)][:rest]
        return [*range(last_slot + 1, last_slot + 1 + in_page), *fresh]

    def _extension(self, last_slot: int, num_tokens: int) -> tuple[int, int, list[int]]:
        """Where ``num_tokens`` tokens after the one at ``last_slot`` go: how many fit in
        its page's free slots, how many are left, and the fresh pages taken for those."""
        page = self.page_size
        in_page = 0
        if last_slot >= 0 and page > 1:
            in_page = min(page - (last_slot % page + 1), num_tokens)
        rest = num_tokens - in_page
        return in_page, rest, self._take_pages(-(-rest // page)) if rest else []

    def free_tail(self, slots: list[int], keep: int) -> None:
        """Gives back ``slots[keep:]`` of a sequence's latest ``extend_listed`` slots (they
        hold nothing any longer), ``keep >= 1``: the pages only those slots lie in, never
        the page of ``slots[keep - 1]``, which the sequence goes on filling."""
        if keep < 1:
            raise ValueError(f"free_tail keeps at least one slot, got keep={keep}")
        kept_page = slots[keep - 1] // self.page_size
        pages = dict.fromkeys(slot // self.page_size for slot in slots[keep:])
        self.free_pages([page for page in pages if page != kept_page])

    def alloc_next(self, last_slots: list[int]) -> list[int]:
        """One slot for the token after each of ``last_slots`` (the slot of a sequence's
        last token, < 0 for an empty sequence): the next slot of its page where the page has
        room, else the first slot of a fresh page. All or nothing: raises
        ``OutOfKVSlots`` having taken no page. Host integers, for callers that keep each
        sequence's last slot (a decode step's allocation, without a device read)."""
        page = self.page_size
        fresh = [opens_page(last, page) for last in last_slots]
        pages = iter(self._take_pages(sum(fresh)))
        return [next(pages) * page if new else last + 1
                for last, new in zip(last_slots, fresh)]

    def free(self, slots: torch.Tensor) -> None:
        """Returns the pages that ``slots`` lie in. Every slot of a freed page must be dead.
        ``slots`` are read back from the device: the host waits for it."""
        if slots.numel() == 0:
            return
        self.free_pages(self._pages(slots))

    def free_pages(self, pages: list[int]) -> None:
        """Returns ``pages`` (page numbers, each owned once, every slot dead) without a
        device read."""
        self._free_pages.extend(pages)

    def _pages(self, slots: torch.Tensor) -> list[int]:
        """The distinct pages ``slots`` lie in, read from the device."""
        if self.page_size == 1:
            return slots.tolist()
        return torch.unique(slots // self.page_size).tolist()

    def _take_pages(self, num_pages: int) -> list[int]:
        if num_pages > len(self._free_pages):
            raise OutOfKVSlots(
                f"need {num_pages} KV pages, {len(self._free_pages)} free "
                f"(page_size={self.page_size})"
            )
        split = len(self._free_pages) - num_pages
        pages = self._free_pages[split:]
        del self._free_pages[split:]
        # Ascending, so that a sequence's pages follow one another in the pool where they
        # can: attention then reads its KV forwards, page after page (16 requests of ~400
        # tokens decoding over pages of 16 taken in the free list's descending order: the
        # model's forward 20% slower than over ascending ones, in-process).
        pages.sort()
        return pages

    def _page_slots(self, pages: list[int]) -> torch.Tensor:
        """The slots of ``pages``, on the device (copied without waiting for it)."""
        pages = to_device(pages, torch.int64, self.device)
        if self.page_size == 1:
            return pages
        offsets = torch.arange(self.page_size, device=self.device)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)
