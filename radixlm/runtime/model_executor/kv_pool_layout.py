"""Which KV pool a model gets, and how many tokens it holds: the plain one (every layer keeps
every token's KV: ``plain_kv_pool``), or, for a model with sliding-window layers, the hybrid
one whose sliding layers keep only the tokens inside their window (``kv_cache/hybrid_pool.py``).
The plain pool's tokens (``kv_pool_tokens``): ``max_total_tokens`` where given, else what a
share of the free memory (``kv_cache_memory_fraction``) holds in the model's KV layout on
this rank, at most what the running requests could use.

The hybrid pool is used where everything that reads or moves KV follows its slot map;
elsewhere the plain pool is kept and the reason logged (the backends still mask the
windows, so results are the same; only the memory is not saved):

- the attention backend must apply ``slot_map_for`` (``SLOT_MAP_BACKENDS``);
- one rank: tensor-parallel ranks mirror the request table, not the slot map;
- no disaggregation: ``kv_rows`` moves a request's rows of every buffer by request slot;
- K and V per layer (not MLA's latents);
- no speculative decoding: a verify step gives back its rejected tokens' slots, which the
  hybrid allocator's paired local pages do not follow.

Sizing: the full-attention layers' pool is the plain pool's (``max_total_tokens``). The
local pool holds, per running request, its window, two pages (the partial ones at each
end) and the largest extend (a prompt chunk: ``chunked_prefill_size``, else the context),
plus half as much again for the prefix cache's windows; never more than the full pool.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from radixlm.kernels.attention.backend_selection import BackendRequest, resolve_backend_name
from radixlm.kv_cache.hybrid_pool import HybridAllocator, HybridKVPool
from radixlm.kv_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, RowWriter
from radixlm.models.model_config import ModelConfig
from radixlm.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

SLOT_MAP_BACKENDS = frozenset({"torch_native"})
"""Attention backends that read sliding layers through the pool's slot map."""


@dataclass(frozen=True)
class WindowedLayout:
    """The hybrid pool's shape: the window W, its layers, and the local pool's tokens."""

    window: int
    sliding_layers: frozenset[int]
    local_tokens: int


def plain_pool_reason(args: ServerArgs, config: ModelConfig, device: torch.device) -> str | None:
    """Why a model with sliding layers keeps every token's KV here; None: it need not."""
    if getattr(config, "uses_mla", False):
        return "its attention is MLA (latents, not K and V per layer)"
    if args.tp_size > 1:
        return "tensor-parallel ranks do not mirror the sliding layers' slot map"
    if args.disaggregation_mode != "null":
        return "disaggregation moves KV rows by request slot (kv_rows.py)"
    if args.speculative_algorithm is not None:
        return "speculative decoding gives rejected draft tokens' slots back (paired pages)"
    backend = resolve_backend_name(BackendRequest(
        args.attention_backend, device, args.resolved_dtype(), config.head_dim))
    if backend not in SLOT_MAP_BACKENDS:
        return f"the {backend} attention backend does not read through a slot map"
    return None


def windowed_layout(args: ServerArgs, config: ModelConfig, device: torch.device,
                    full_tokens: int, context_length: int) -> WindowedLayout | None:
    """The hybrid pool's layout for this model and server, or None for the plain pool
    (logging why, for a model that has sliding layers)."""
    window, sliding = config.sliding_window, frozenset(config.sliding_layers)
    if not window or not sliding:
        return None
    reason = plain_pool_reason(args, config, device)
    if reason is not None:
        logger.info("sliding-window layers keep every token's KV (plain pool): %s", reason)
        return None
    page = args.page_size
    chunk = min(args.chunked_prefill_size or context_length, context_length)
    running = args.max_running_requests * (min(window, context_length) + 2 * page + chunk)
    local = min(full_tokens, running + running // 2)
    return WindowedLayout(window, sliding, max(page, local // page * page))


def build_hybrid_pools(layout: WindowedLayout, full_tokens: int, page_size: int,
                       num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       device: torch.device, write_rows: RowWriter
                       ) -> tuple[HybridAllocator, HybridKVPool]:
    """The allocator (request slots paired with local ones) and the pool over them."""
    allocator = HybridAllocator(full_tokens, layout.local_tokens, page_size, device)
    pool = HybridKVPool(
        allocator.size + page_size, allocator.local.size + page_size, num_layers,
        layout.sliding_layers, num_kv_heads, head_dim, dtype, device, allocator.slot_map,
        write_rows)
    logger.info("sliding-window layers (W=%d, %d of %d layers) keep their window: %d local "
                "KV slots beside %d", layout.window, len(layout.sliding_layers), num_layers,
                allocator.local.size, allocator.size)
    return allocator, pool


def kv_pool_tokens(args: ServerArgs, config: ModelConfig, dtype: torch.dtype,
                   device: torch.device, num_kv_heads: int,
                   context_length: int) -> tuple[int, int | None]:
    """(The plain pool's tokens, the memory budget they were sized by; None where
    ``max_total_tokens`` gives them): see the module. ``num_kv_heads``: this rank's."""
    if args.max_total_tokens is not None:
        return args.max_total_tokens, None
    per_token = config.kv_bytes_per_token(torch.finfo(dtype).bits // 8)
    if not config.uses_mla:  # this rank's KV heads only
        per_token = per_token // config.num_kv_heads * num_kv_heads
    budget = int(available_memory(device) * args.kv_cache_memory_fraction)
    useful = args.max_running_requests * context_length
    return max(args.page_size, min(budget // per_token, useful)), budget


def plain_kv_pool(config: ModelConfig, num_slots: int, num_kv_heads: int, dtype: torch.dtype,
                  device: torch.device, write_rows: RowWriter
                  ) -> MHATokenToKVPool | MLATokenToKVPool:
    """The pool layout the model attends over: latents for MLA models, else K and V of this
    rank's ``num_kv_heads``, stored by ``write_rows``."""
    if config.uses_mla:
        return MLATokenToKVPool(num_slots, config.num_layers, config.kv_lora_rank,
                                config.qk_rope_head_dim, dtype, device, write_rows)
    return MHATokenToKVPool(num_slots, config.num_layers, num_kv_heads, config.head_dim,
                            dtype, device, write_rows)


def available_memory(device: torch.device) -> int:
    """Free bytes on ``device`` (host memory available to new allocations on the CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
