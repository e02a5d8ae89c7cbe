"""CPU tensors on 2 MiB pages (Linux's transparent huge pages), for the memory a decode step
streams: the weights, and the KV pool it gathers from.

A decode step of the default model reads about 270 MB of weights. On 4 KiB pages that is
some 65,000 pages a step, far more than the TLB holds, so each costs a page walk; on 2 MiB
pages it is about 130. Measured on a 2-core Zen 4 (all of the default model's weights by
column pairs, ``pair_matmul``, 2 threads, three runs of interleaved rounds, huge against
small pages): one row 0.92-1.06x (two runs of three in favour), 4 rows 0.84-0.95x, 16 rows
0.94x; whole decode steps in docs/engine.md.

Linux backs an anonymous mapping with huge pages where it is advised to
(``MADV_HUGEPAGE``) and the system's setting allows (``enabled`` of ``always`` or
``madvise``); memory already touched stays on small pages, so tensors are copied into a
fresh mapping (``move_to_huge_pages``) rather than advised where they lie. Elsewhere
(another OS, huge pages ``never``) the functions change nothing.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Iterable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_enabled = True  # see enable


def available() -> bool:
    """Whether tensors can be put on huge pages here: Linux's setting allows an advised
    mapping huge pages, and they are not turned off (``enable(False)``)."""
    if not _enabled or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = SETTING.read_text()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def enable(on: bool = True) -> bool:
    """Turns the use of huge pages on or off for this process (for comparisons); returns
    the previous state."""
    global _enabled
    previous, _enabled = _enabled, on
    return previous


def empty(nbytes: int) -> torch.Tensor | None:
    """An untouched (nbytes,) uint8 CPU tensor on a fresh anonymous mapping advised to use
    huge pages, starting on a 2 MiB boundary; None where ``available()`` is not. The
    tensor keeps the mapping alive; the pages are given as it is first written."""
    if not available() or nbytes <= 0:
        return None
    # Private (a shared mapping is shmem, whose huge pages are another setting), with a
    # spare 2 MiB for the boundary.
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError as error:
        logger.debug("huge pages: madvise failed (%s)", error)
        mapping.close()
        return None
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, on a fresh anonymous mapping (huge
    pages where available), which the OS zero-fills as each page is first touched: memory
    is taken as the tensor is written, not at allocation (a KV pool sized for its most
    tokens holds only what its requests have used)."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    buffer = empty(nbytes) if nbytes >= HUGE_PAGE else None
    if buffer is None and nbytes >= mmap.PAGESIZE:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    if buffer is None:
        return torch.zeros(shape, dtype=dtype)
    return buffer.view(dtype).view(shape)


def move_to_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Copies the storages of ``tensors`` (those strided and on the CPU; others are left)
    into one huge-page mapping and points every tensor that uses them at the copy, in place
    (``Tensor.set_``): the same values, shapes, strides and sharing (two views of one
    storage stay views of one copy). Returns the bytes moved (0 where huge pages are not
    available). For tensors nothing writes to through another reference: a tensor outside
    ``tensors`` that shares a moved storage keeps the old memory."""
    storages: dict[int, torch.UntypedStorage] = {}  # by address
    users: dict[int, dict[int, torch.Tensor]] = {}  # storage address: tensors by id
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            continue
        storages.setdefault(storage.data_ptr(), storage)
        users.setdefault(storage.data_ptr(), {})[id(tensor)] = tensor
    offsets, total = {}, 0
    for key, storage in storages.items():
        offsets[key] = total
        total += -(-storage.nbytes() // 64) * 64  # each copy 64-byte aligned
    arena = empty(total)
    if arena is None:
        return 0
    with torch.no_grad():
        for key, storage in storages.items():
            start = offsets[key]
            copy = arena[start:start + storage.nbytes()]
            copy.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            for tensor in users[key].values():
                offset = (arena.storage_offset() + start) // tensor.element_size()
                tensor.set_(arena.untyped_storage(), offset + tensor.storage_offset(),
                            tensor.size(), tensor.stride())
    return total
