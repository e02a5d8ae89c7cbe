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
"""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING

import torch

from radixlm.kernels.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from radixlm.runtime.model_executor.model_runner import ModelRunner

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
    """Captured decode graphs of one ModelRunner (triton or flashinfer backend, CUDA only)."""

    def __init__(self, runner: ModelRunner, max_batch_size: int):
        if runner.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.runner = runner
        self.batch_sizes = capture_batch_sizes(max_batch_size)
        self.max_batch_size = self.batch_sizes[-1]
        device, n = runner.device, self.max_batch_size
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.zeros(n, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=device)
        self.ones = torch.ones(n, dtype=torch.int64, device=device)
        self.zeros = torch.zeros(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._flashinfer_states: dict[int, object] = {}
        self._prepare_backend()
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
        self._refresh_metadata(size, static)
        self.graphs[size].replay()
        return self.outputs[size][:b].clone()

    # Capture ------------------------------------------------------------------------------

    def _prepare_backend(self) -> None:
        from radixlm.kernels.attention.flashinfer_backend import FlashInferAttentionBackend
        from radixlm.kernels.attention.triton_backend import TritonAttentionBackend

        backend, runner = self.runner.attn_backend, self.runner
        if isinstance(backend, TritonAttentionBackend):
            _, v_buffer = runner.kv_pool.get_kv(0)
            heads = runner.attention_layer.num_heads
            backend.reserve_decode_scratch(
                self.max_batch_size, heads, v_buffer.shape[-1], runner.device
            )
        elif isinstance(backend, FlashInferAttentionBackend):
            page = runner.args.page_size
            max_pages = -(-runner.context_length // page) * self.max_batch_size
            for size in self.batch_sizes:
                self._flashinfer_states[size] = backend.make_graph_state(size, max_pages)
        else:
            raise ValueError(
                f"CUDA graphs need the triton or flashinfer backend, not {type(backend).__name__}"
            )

    def _static_batch(self, size: int, seq_lens_list: list[int]) -> ForwardBatch:
        runner = self.runner
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
            req_to_token=runner.req_to_token_pool.req_to_token,
            kv_pool=runner.kv_pool,
            attn_backend=runner.attn_backend,
            seq_lens_list=seq_lens_list,
            extend_seq_lens_list=[1] * size,
        )

    def _refresh_metadata(self, size: int, static: ForwardBatch) -> None:
        """Metadata outside the graph: FlashInfer's plan; the Triton backend's reset."""
        if size in self._flashinfer_states:
            self.runner.attn_backend.plan_graph_decode(
                self._flashinfer_states[size], static, static.seq_lens,
                static.req_pool_indices,
            )
        else:
            self.runner.attn_backend.init_forward_metadata(static)

    def _capture_all(self) -> None:
        pool = None
        model = self.runner.model
        with torch.inference_mode():
            for size in reversed(self.batch_sizes):  # largest first: later ones reuse its pool
                static = self._static_batch(size, [1] * size)
                self._refresh_metadata(size, static)
                for _ in range(2):  # warm-up: kernels compile and autotune outside capture
                    model(static.input_ids, static.positions, static)
                torch.cuda.synchronize(self.runner.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = model(static.input_ids, static.positions, static)
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.synchronize(self.runner.device)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.batch_sizes)
