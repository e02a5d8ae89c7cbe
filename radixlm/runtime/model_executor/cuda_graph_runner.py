"""CUDA-graph decode: capture the model's decode step once per batch size, then replay it.

A decode step launches hundreds of small kernels; on a GPU their launch overhead, not the
arithmetic, bounds small batches. At start-up the model's decode forward is captured as a
CUDA graph for each size in ``capture_batch_sizes``; a later decode batch of B requests is
copied into the static input buffers, padded to the next captured size, and the graph is
replayed.

Padding rows are harmless by construction: they read row 0 of ``req_to_token`` with a
sequence of length 1 (any slot index there is valid memory) and write their K/V into slot 0,
the allocator's reserved padding page; their outputs are dropped.

Invariants: a graph is replayed only for DECODE batches no larger than the largest captured
size; attention metadata that lives outside the graph (FlashInfer's plan) is refreshed
before every replay; the backend's decode scratch is pinned across capture and replay.
What a backend does for each of these is its own business, behind the graph hooks of the
``AttentionBackend`` contract (``prepare_decode_graphs``, ``init_decode_graph_metadata``).

The runner is handed the pieces it captures over (model, pools, backend, device, sizes),
not the ``ModelRunner`` that owns them.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import Any

import torch

from radixlm.kernels.attention.attention_backend import AttentionBackend, DecodeGraphSpec
from radixlm.kernels.attention.attention_layer import AttentionLayer
from radixlm.kernels.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_batch_size``, which is always last."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = [s for s in (1, 2, 4) if s < max_batch_size]
    sizes += list(range(8, max_batch_size, 8))
    return sizes + [max_batch_size]


def padded_batch_size(batch_size: int, sizes: list[int]) -> int:
    """The smallest captured size that holds ``batch_size`` requests."""
    i = bisect.bisect_left(sizes, batch_size)
    if i == len(sizes):
        raise ValueError(f"batch of {batch_size} exceeds the largest captured size {sizes[-1]}")
    return sizes[i]


class CudaGraphDecodeRunner:
    """Captured decode graphs of one model over one KV pool (CUDA only, on an attention
    backend with ``supports_cuda_graph``).

    ``model(input_ids, positions, forward_batch)`` is the decode forward to capture;
    ``attention_layer`` the head layout all its layers share; ``req_to_token`` the
    request-to-slot table; ``max_context_len`` the most tokens a request may hold.
    """

    def __init__(
        self, model: Callable[..., torch.Tensor], attn_backend: AttentionBackend, kv_pool: Any,
        req_to_token: torch.Tensor, attention_layer: AttentionLayer, *,
        device: torch.device, max_batch_size: int, max_context_len: int,
    ):
        if device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if not attn_backend.supports_cuda_graph:
            raise ValueError(
                f"CUDA graphs need an attention backend that supports them (triton or "
                f"flashinfer), not {type(attn_backend).__name__}"
            )
        self.model = model
        self.attn_backend = attn_backend
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.device = device
        self.batch_sizes = capture_batch_sizes(max_batch_size)
        self.max_batch_size = self.batch_sizes[-1]
        n = self.max_batch_size
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.zeros(n, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=device)
        self.ones = torch.ones(n, dtype=torch.int64, device=device)
        self.zeros = torch.zeros(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        attn_backend.prepare_decode_graphs(DecodeGraphSpec(
            tuple(self.batch_sizes), max_context_len, attention_layer, kv_pool, device
        ))
        self._capture_all()

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        return (
            forward_batch.mode is ForwardMode.DECODE
            and forward_batch.batch_size <= self.max_batch_size
        )

    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """The decode step's hidden states (B, hidden), computed by the captured graph."""
        fb = forward_batch
        b = fb.batch_size
        size = padded_batch_size(b, self.batch_sizes)
        self.input_ids[:b].copy_(fb.input_ids)
        self.positions[:b].copy_(fb.positions)
        self.out_cache_loc[:b].copy_(fb.out_cache_loc)
        self.req_pool_indices[:b].copy_(fb.req_pool_indices)
        self.seq_lens[:b].copy_(fb.seq_lens)
        if size > b:  # padding rows: see the module docstring
            for buffer in (self.input_ids, self.positions, self.out_cache_loc,
                           self.req_pool_indices):
                buffer[b:size].zero_()
            self.seq_lens[b:size].fill_(1)
        static = self._static_batch(size, fb.seq_lens_list + [1] * (size - b))
        self.attn_backend.init_decode_graph_metadata(static)
        self.graphs[size].replay()
        return self.outputs[size][:b].clone()

    # Capture ------------------------------------------------------------------------------

    def _static_batch(self, size: int, seq_lens_list: list[int]) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            out_cache_loc=self.out_cache_loc[:size],
            req_pool_indices=self.req_pool_indices[:size],
            seq_lens=self.seq_lens[:size],
            # Decode backends do not read prefix lengths; a static buffer keeps a replay from
            # computing (or a captured kernel from reading) a tensor made outside the graph.
            prefix_lens=self.zeros[:size],
            extend_seq_lens=self.ones[:size],
            req_to_token=self.req_to_token,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            seq_lens_list=seq_lens_list,
            extend_seq_lens_list=[1] * size,
        )

    def _capture_all(self) -> None:
        pool = None
        model = self.model
        with torch.inference_mode():
            for size in reversed(self.batch_sizes):  # largest first: later ones reuse its pool
                static = self._static_batch(size, [1] * size)
                self.attn_backend.init_decode_graph_metadata(static)
                for _ in range(2):  # warm-up: kernels compile and autotune outside capture
                    model(static.input_ids, static.positions, static)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = model(static.input_ids, static.positions, static)
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.batch_sizes)
