"""Tiles of the attention kernels, chosen from what a GPU gives one block in shared memory.

Shared memory per block differs by architecture (sm_80: 163 KiB, sm_86 / sm_89: 99 KiB,
sm_90: 227 KiB; ``SHARED_MEMORY_PER_BLOCK``), and a kernel that needs more fails at launch.
The extend kernel's tiles grow with the head width (MLA's 576-wide keys round up to 1024
columns) and the element size, so tiles are a function of (head dims, dtype, the device's
limit), computed here without a GPU:

- ``extend_tiles``: BLOCK_M queries by BLOCK_N keys for ``extend_attention``;
- ``mla_decode_tiles``: BLOCK_N keys (BLOCK_H heads fixed) for ``mla_decode_attention``.

Each starts from the caller's tiles and halves them (keys first: fewer query rows would
read every key again) until the estimate fits the limit, and raises a ``ValueError`` that
says what to use instead when even 16-wide tiles do not fit (float32 MLA prefill on a
99 KiB GPU). On GPUs both kernels run with ``num_stages=1``: their loads are gathers
through the page table, which Triton does not pipeline in 16-bit dtypes (the code is the
same at any stage count) and pipelines in float32 only by keeping more tiles in shared
memory. ``shared_limit=None`` (a CPU, the interpreter) keeps the caller's tiles but for
the register cap, and leaves Triton's stage count alone.

Invariant: the estimates bound what Triton allocates for these kernels. They count the
tiles fed to ``tl.dot`` (fitted to Triton's allocator, which reuses a dot's operand buffers
once they are dead), so ``tests/kernels/gpu_compile_check.py`` compiles every kernel for
sm_80, sm_86, sm_89 and sm_90 and fails where the compiler's figure passes the estimate or
the target's limit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

KIB = 1024
# What one block may opt in to, by compute capability (CUDA programming guide, table 23).
SHARED_MEMORY_PER_BLOCK = {80: 163 * KIB, 86: 99 * KIB, 89: 99 * KIB, 90: 227 * KIB}
MIN_TILE = 16  # tl.dot's smallest operand side
# Query rows of the extend kernel's wide (MLA) heads: its (M, DK) query and (M, DV)
# accumulator live in registers, and 64 rows of 1024 + 512 columns would spill.
WIDE_HEAD_COLUMNS = 512
WIDE_HEAD_MAX_TILE = 32


@dataclass(frozen=True)
class Tiles:
    """One launch's tiles: ``block_m`` query rows (extend) or heads (MLA decode) by
    ``block_n`` keys; ``num_stages`` for the launch (None: Triton's default);
    ``shared_bytes`` the estimate (None where there is no limit to check it against)."""

    block_m: int
    block_n: int
    num_stages: int | None
    shared_bytes: int | None

    def launch_options(self) -> dict[str, int]:
        """Keyword arguments for the kernel launch beyond its own parameters."""
        return {} if self.num_stages is None else {"num_stages": self.num_stages}


def padded(width: int) -> int:
    """A head width as the kernels tile it: a power of two, at least 16."""
    return max(MIN_TILE, triton.next_power_of_2(max(width, 1)))


def extend_shared_bytes(block_m: int, block_n: int, head_dim_k: int, head_dim_v: int,
                        itemsize: int) -> int:
    """Shared memory of one extend program at one stage: the query (M, DK), a key tile
    (DK, N) (or the value tile (N, DV) where wider), the probabilities (M, N) on their way
    into the second dot, and two float32 row statistics."""
    dk, dv = padded(head_dim_k), padded(head_dim_v)
    tiles = block_m * dk + block_n * max(dk, dv) + block_m * block_n
    return itemsize * tiles + 8 * block_m


def mla_decode_shared_bytes(block_h: int, block_n: int, latent_dim: int, rope_dim: int,
                            itemsize: int) -> int:
    """Shared memory of one MLA decode program at one stage: the query's latent and RoPE
    parts (H, D_l + D_r), the key tile's latents (N, D_l, reused as values) and its RoPE
    part (D_r, N), counted twice for the transposed copy the 16-bit dot makes."""
    dl, dr = padded(latent_dim), padded(rope_dim)
    return itemsize * (block_h * (dl + dr) + block_n * (dl + 2 * dr))


def extend_tiles(head_dim_k: int, head_dim_v: int, dtype: torch.dtype,
                 shared_limit: int | None, block_m: int = 64, block_n: int = 64) -> Tiles:
    """The extend kernel's tiles for these heads on a device giving ``shared_limit`` bytes
    per block (None: no GPU); ``block_m`` / ``block_n`` are the largest wanted."""
    if padded(head_dim_k) + padded(head_dim_v) > WIDE_HEAD_COLUMNS:
        block_m, block_n = min(block_m, WIDE_HEAD_MAX_TILE), min(block_n, WIDE_HEAD_MAX_TILE)
    if shared_limit is None:
        return Tiles(block_m, block_n, None, None)

    def need(m: int, n: int) -> int:
        return extend_shared_bytes(m, n, head_dim_k, head_dim_v, dtype.itemsize)

    while need(block_m, block_n) > shared_limit:
        if block_n > MIN_TILE and block_n >= block_m:
            block_n //= 2
        elif block_m > MIN_TILE:
            block_m //= 2
        elif block_n > MIN_TILE:
            block_n //= 2
        else:
            raise ValueError(
                f"extend attention in {dtype} with {head_dim_k}-wide keys and "
                f"{head_dim_v}-wide values needs {need(block_m, block_n)} bytes of shared "
                f"memory per block at its smallest tiles ({MIN_TILE} x {MIN_TILE}); this GPU "
                f"gives {shared_limit}. Serve in bfloat16 or float16 (--dtype), or with "
                "--attention-backend torch_native"
            )
    return Tiles(block_m, block_n, 1, need(block_m, block_n))


def mla_decode_tiles(latent_dim: int, rope_dim: int, dtype: torch.dtype,
                     shared_limit: int | None, block_h: int = 16, block_n: int = 64) -> Tiles:
    """The MLA decode kernel's tiles (``block_m`` is its head block) on a device giving
    ``shared_limit`` bytes per block (None: no GPU)."""
    if shared_limit is None:
        return Tiles(block_h, block_n, None, None)

    def need(n: int) -> int:
        return mla_decode_shared_bytes(block_h, n, latent_dim, rope_dim, dtype.itemsize)

    while need(block_n) > shared_limit:
        if block_n == MIN_TILE:
            raise ValueError(
                f"MLA decode in {dtype} with a {latent_dim} + {rope_dim} latent row needs "
                f"{need(block_n)} bytes of shared memory per block at {MIN_TILE}-key tiles; "
                f"this GPU gives {shared_limit}. Serve in bfloat16 or float16 (--dtype)"
            )
        block_n //= 2
    return Tiles(block_h, block_n, 1, need(block_n))


def shared_memory_per_block(device: torch.device) -> int | None:
    """Bytes of shared memory one block may use on ``device``; None off CUDA (the kernels
    run under the interpreter there, which has no such limit)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_shared_memory_per_block(index)


@functools.cache
def _cuda_shared_memory_per_block(index: int) -> int:
    limit = getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", 0)
    if not limit:  # older torch: ask Triton's driver
        from triton.runtime import driver

        limit = driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return int(limit)
