"""The FlashInfer attention backend (Ye et al. 2025): paged prefill and decode wrappers on GPUs.

FlashInfer splits attention into a ``plan`` (scheduling work over the batch's page table,
done on the host once per batch) and a ``run`` per layer. This backend plans in
``init_forward_metadata`` and runs in ``forward_extend`` / ``forward_decode``, after storing
the new K/V into the pool, so the paged kernels see each request's whole sequence.

Page table: FlashInfer reads KV as pages of ``page_size`` consecutive slots (NHD layout,
(pages, page_size, H_kv, D), a view of our (slots, H_kv, D) buffers). It relies on the
allocator's invariant that token i of a request lives at offset ``i % page_size`` of its
page: a request's page list is ``req_to_token[row, 0:n:page_size] // page_size`` and its last
page holds ``(n - 1) % page_size + 1`` tokens. Extend is causal with the mask aligned to the
end of the sequence (query i of an extend of length e over n keys sees keys < n - e + i + 1),
which is exactly "prefix plus the new tokens up to itself".

For CUDA graphs, ``DecodeGraphState`` owns a decode wrapper with fixed index buffers per
captured batch size (made in ``prepare_decode_graphs``); ``plan`` is re-run on the one of
the batch's size (outside the graph, ``init_decode_graph_metadata``) before each replay.

FlashInfer is imported lazily: this module loads everywhere; constructing the backend
without CUDA or the package raises (``backend_selection`` says why before that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from radixlm.kernels.attention.attention_backend import AttentionBackend, DecodeGraphSpec
from radixlm.kernels.forward_batch import ForwardBatch, ForwardMode

WORKSPACE_BYTES = 128 * 2**20
"""FlashInfer's scratch for split-KV partial results, shared by both wrappers."""


@dataclass
class AttentionShape:
    """What a FlashInfer plan needs to know about every layer (all layers share it)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    scaling: float
    """The softmax scale; FlashInfer fixes it at plan time, so every layer must share it."""


def paged_kv_table(
    fb: ForwardBatch, page_size: int, seq_lens: torch.Tensor | None = None,
    req_pool_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page table: (indptr (B+1,), page indices (total,), last page lens (B,)).

    int32 tensors on the batch's device. ``seq_lens`` / ``req_pool_indices`` override the
    batch's (CUDA-graph padding).
    """
    seq_lens = fb.seq_lens if seq_lens is None else seq_lens
    rows = fb.req_pool_indices if req_pool_indices is None else req_pool_indices
    pages_per_req = (seq_lens + page_size - 1) // page_size  # (B,)
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32, device=seq_lens.device)
    indptr[1:] = torch.cumsum(pages_per_req, 0)
    max_pages = int(pages_per_req.max()) if len(seq_lens) else 0
    first_slots = torch.arange(max_pages, device=seq_lens.device) * page_size  # (P,)
    table = fb.req_to_token[rows[:, None], first_slots[None, :]] // page_size  # (B, P)
    valid = torch.arange(max_pages, device=seq_lens.device)[None, :] < pages_per_req[:, None]
    indices = table[valid].to(torch.int32)
    last_page_len = ((seq_lens - 1) % page_size + 1).to(torch.int32)
    return indptr, indices, last_page_len


class FlashInferAttentionBackend(AttentionBackend):
    supports_cuda_graph = True
    uses_custom_kernels = True

    def __init__(self, shape: AttentionShape, device: torch.device):
        import flashinfer  # the `gpu` extra; selection checks it is importable

        self._flashinfer = flashinfer
        self.shape = shape
        self.device = device
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self._decode_uses_tensor_cores(),
        )
        self._active: Any = None
        self._graph_states: dict[int, DecodeGraphState] = {}  # per captured batch size

    def _decode_uses_tensor_cores(self) -> bool:
        """Large GQA groups are a small matmul per KV head: tensor cores pay off from 4 up."""
        return self.shape.num_heads // self.shape.num_kv_heads >= 4

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        shape = self.shape
        indptr, indices, last_page_len = paged_kv_table(fb, shape.page_size)
        if fb.mode is ForwardMode.DECODE:
            self._plan_decode(self._decode, indptr, indices, last_page_len)
            self._active = self._decode
            return
        qo_indptr = torch.zeros(fb.batch_size + 1, dtype=torch.int32, device=self.device)
        qo_indptr[1:] = torch.cumsum(fb.extend_seq_lens, 0)
        self._prefill.plan(
            qo_indptr, indptr, indices, last_page_len,
            shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.page_size,
            causal=True, sm_scale=shape.scaling, q_data_type=shape.dtype,
            kv_data_type=shape.dtype,
        )
        self._active = self._prefill

    def _plan_decode(self, wrapper, indptr, indices, last_page_len) -> None:
        shape = self.shape
        wrapper.plan(
            indptr, indices, last_page_len,
            shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.page_size,
            pos_encoding_mode="NONE", sm_scale=shape.scaling, q_data_type=shape.dtype,
            kv_data_type=shape.dtype,
        )

    def forward_extend(self, q, k, v, layer, forward_batch):
        return self._run(q, k, v, layer, forward_batch)

    def forward_decode(self, q, k, v, layer, forward_batch):
        return self._run(q, k, v, layer, forward_batch)

    def _run(self, q, k, v, layer, fb: ForwardBatch) -> torch.Tensor:
        if layer.scaling != self.shape.scaling:
            raise ValueError(
                f"layer {layer.layer_id} scales by {layer.scaling}, the plan by "
                f"{self.shape.scaling}: FlashInfer needs one scale for all layers"
            )
        fb.kv_pool.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        k_buffer, v_buffer = fb.kv_pool.get_kv(layer.layer_id)
        page = self.shape.page_size
        paged = (
            k_buffer.view(-1, page, *k_buffer.shape[1:]),  # (pages, page, H_kv, D)
            v_buffer.view(-1, page, *v_buffer.shape[1:]),
        )
        return self._active.run(q.contiguous(), paged)

    # CUDA graphs --------------------------------------------------------------------------

    def prepare_decode_graphs(self, spec: DecodeGraphSpec) -> None:
        """One graph decode wrapper per captured batch size, each with room for the pages of
        the largest batch at the longest context."""
        max_pages_per_req = -(-spec.max_context_len // self.shape.page_size)
        max_pages = max_pages_per_req * spec.max_batch_size
        self._graph_states = {
            size: self.make_graph_state(size, max_pages) for size in spec.batch_sizes
        }

    def init_decode_graph_metadata(self, forward_batch: ForwardBatch) -> None:
        """Plans the wrapper captured for this batch's size (its buffers are rewritten in
        place) and makes it the one the captured ``run`` calls use."""
        state = self._graph_states.get(forward_batch.batch_size)
        if state is None:
            raise ValueError(
                f"no decode graph state for batch size {forward_batch.batch_size}; "
                f"prepared sizes: {sorted(self._graph_states)}"
            )
        self.plan_graph_decode(
            state, forward_batch, forward_batch.seq_lens, forward_batch.req_pool_indices
        )

    def make_graph_state(self, batch_size: int, max_pages: int) -> DecodeGraphState:
        """A decode wrapper with fixed buffers for one captured batch size."""
        indptr = torch.zeros(batch_size + 1, dtype=torch.int32, device=self.device)
        indices = torch.zeros(max_pages, dtype=torch.int32, device=self.device)
        last_page_len = torch.ones(batch_size, dtype=torch.int32, device=self.device)
        wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True,
            use_tensor_cores=self._decode_uses_tensor_cores(),
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last_page_len,
        )
        return DecodeGraphState(wrapper)

    def plan_graph_decode(
        self, state: DecodeGraphState, forward_batch: ForwardBatch,
        seq_lens: torch.Tensor, req_pool_indices: torch.Tensor,
    ) -> None:
        """Plans the captured wrapper for this (padded) batch and makes it the active one."""
        indptr, indices, last_page_len = paged_kv_table(
            forward_batch, self.shape.page_size, seq_lens, req_pool_indices
        )
        self._plan_decode(state.wrapper, indptr, indices, last_page_len)
        self._active = state.wrapper


@dataclass
class DecodeGraphState:
    wrapper: Any
