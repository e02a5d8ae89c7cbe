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

Sliding windows, logit soft-capping and slot maps are fixed at plan time in FlashInfer
(``window_left = W - 1``, ``logits_soft_cap``), so each distinct kind of layer in a batch,
(window, softcap, slot map), gets a wrapper of its own, planned once a batch when the
first layer of the kind runs (the plain kind in ``init_forward_metadata``). A windowed
kind's page table starts at the page of the first key its first query sees (FlashInfer
aligns the causal mask and the window to the end of the keys, so leading pages may go);
a slot-mapped kind's pages are the layer's own (``slot_map[first slot of the page] //
page_size``: a hybrid pool pairs pages offset for offset; a dropped page reads as page 0,
outside every window).

For CUDA graphs, ``DecodeGraphState`` owns a decode wrapper with fixed index buffers per
captured batch size (made in ``prepare_decode_graphs``); ``plan`` is re-run on the one of
the batch's size (outside the graph, ``init_decode_graph_metadata``) before each replay,
with one more fixed-buffer wrapper per kind of layer this backend has met (a kind first met
inside a capture cannot be planned there, and raises).

FlashInfer is imported lazily: this module loads everywhere; constructing the backend
without CUDA or the package raises (``backend_selection`` says why before that).
"""

from __future__ import annotations

from dataclasses import dataclass, field
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


Kind = tuple[int | None, float | None, torch.Tensor | None]
"""What a plan fixes about a layer: (sliding window, logit softcap, slot map)."""
PLAIN: Kind = (None, None, None)


def kind_key(kind: Kind) -> tuple[int | None, float | None, int]:
    return kind[0], kind[1], id(kind[2])


def paged_kv_table(
    fb: ForwardBatch, page_size: int, seq_lens: torch.Tensor | None = None,
    req_pool_indices: torch.Tensor | None = None, window: int | None = None,
    slot_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page table: (indptr (B+1,), page indices (total,), last page lens (B,)).

    int32 tensors on the batch's device. ``seq_lens`` / ``req_pool_indices`` override the
    batch's (CUDA-graph padding). ``window``: pages wholly before the first key the first
    new token sees are left out; ``slot_map``: the pages are the layer's own.
    """
    seq_lens = fb.seq_lens if seq_lens is None else seq_lens
    rows = fb.req_pool_indices if req_pool_indices is None else req_pool_indices
    device = seq_lens.device
    end_pages = (seq_lens + page_size - 1) // page_size  # (B,)
    first_page = torch.zeros_like(end_pages)
    if window is not None:
        new = fb.extend_seq_lens if fb.mode is ForwardMode.EXTEND else 1
        first_page = (seq_lens - new + 1 - window).clamp(min=0) // page_size
    pages_per_req = end_pages - first_page
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32, device=device)
    indptr[1:] = torch.cumsum(pages_per_req, 0)
    max_pages = int(pages_per_req.max()) if len(seq_lens) else 0
    pages = first_page[:, None] + torch.arange(max_pages, device=device)[None, :]  # (B, P)
    first_slots = (pages * page_size).clamp(max=fb.req_to_token.shape[1] - 1)
    slots = fb.req_to_token[rows[:, None], first_slots]  # (B, P)
    if slot_map is not None:
        if slot_map.device != slots.device:
            raise ValueError(f"the slot map is on {slot_map.device}, the batch on {device}")
        slots = slot_map[slots]
    valid = torch.arange(max_pages, device=device)[None, :] < pages_per_req[:, None]
    indices = (slots // page_size)[valid].to(torch.int32)
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
        self._decode = self._decode_wrapper()
        self._eager = {(ForwardMode.EXTEND, kind_key(PLAIN)): self._prefill,
                       (ForwardMode.DECODE, kind_key(PLAIN)): self._decode}
        self._kinds: dict[tuple, Kind] = {kind_key(PLAIN): PLAIN}  # every kind met
        self._batch: ForwardBatch | None = None
        self._planned: dict[tuple, Any] = {}  # this batch's planned wrappers, by kind
        self._active: Any = None  # the plain kind's
        self._graph_state: DecodeGraphState | None = None  # this batch's, under graphs
        self._graph_rows: tuple = (None, None)  # its padded (seq_lens, req_pool_indices)
        self._graph_states: dict[int, DecodeGraphState] = {}  # per captured batch size

    def _decode_wrapper(self, **graph_buffers):
        """A decode wrapper; with ``graph_buffers`` (its index buffers) one for CUDA graphs.
        Large GQA groups are a small matmul per KV head: tensor cores pay off from 4 up."""
        return self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=bool(graph_buffers),
            use_tensor_cores=self.shape.num_heads // self.shape.num_kv_heads >= 4,
            **graph_buffers)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self._batch, self._graph_state, self._planned = forward_batch, None, {}
        self._graph_rows = (None, None)
        self._active = self._wrapper_for(PLAIN)

    def _wrapper_for(self, kind: Kind):
        """This batch's wrapper for layers of ``kind``, planned on first use."""
        key = kind_key(kind)
        wrapper = self._planned.get(key)
        if wrapper is not None:
            return wrapper
        self._kinds[key] = kind
        state = self._graph_state
        if state is not None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"a layer of kind (window, softcap) = {kind[:2]} met first inside a CUDA "
                    "graph capture, where it cannot be planned: run a batch with every "
                    "kind of layer before capturing")
            wrapper = state.wrapper_for(key, self)
        else:
            wrapper = self._eager.get((self._batch.mode, key))
            if wrapper is None:
                wrapper = (self._decode_wrapper() if self._batch.mode is ForwardMode.DECODE
                           else self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                               self.workspace, "NHD"))
                self._eager[(self._batch.mode, key)] = wrapper
        self._plan(wrapper, kind, *self._graph_rows)
        self._planned[key] = wrapper
        return wrapper

    def _plan(self, wrapper, kind: Kind, seq_lens: torch.Tensor | None = None,
              req_pool_indices: torch.Tensor | None = None) -> None:
        fb, shape = self._batch, self.shape
        window, softcap, slot_map = kind
        indptr, indices, last_page_len = paged_kv_table(
            fb, shape.page_size, seq_lens, req_pool_indices, window, slot_map)
        options = dict(sm_scale=shape.scaling, q_data_type=shape.dtype,
                       kv_data_type=shape.dtype, logits_soft_cap=softcap,
                       window_left=-1 if window is None else window - 1)
        heads = (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.page_size)
        if fb.mode is ForwardMode.DECODE:
            wrapper.plan(indptr, indices, last_page_len, *heads, pos_encoding_mode="NONE",
                         **options)
            return
        qo_indptr = torch.zeros(fb.batch_size + 1, dtype=torch.int32, device=self.device)
        qo_indptr[1:] = torch.cumsum(fb.extend_seq_lens, 0)
        wrapper.plan(qo_indptr, indptr, indices, last_page_len, *heads, causal=True, **options)

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
        slot_map = fb.kv_pool.slot_map_for(layer.layer_id)
        kind = (layer.sliding_window, layer.logit_softcap, slot_map)
        plain = kind_key(kind) == kind_key(PLAIN)
        wrapper = self._active if plain else self._wrapper_for(kind)
        fb.kv_pool.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        k_buffer, v_buffer = fb.kv_pool.get_kv(layer.layer_id)
        page = self.shape.page_size
        paged = (
            k_buffer.view(-1, page, *k_buffer.shape[1:]),  # (pages, page, H_kv, D)
            v_buffer.view(-1, page, *v_buffer.shape[1:]),
        )
        return wrapper.run(q.contiguous(), paged)

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
        """Plans the wrappers captured for this batch's size, one per kind of layer met so
        far (their buffers are rewritten in place), and makes them the ones the captured
        ``run`` calls use."""
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
        """Decode wrappers with fixed buffers for one captured batch size (the plain kind's
        now, the others' when first planned)."""
        state = DecodeGraphState(None, batch_size, max_pages)
        state.wrapper = state.wrapper_for(kind_key(PLAIN), self)
        return state

    def plan_graph_decode(
        self, state: DecodeGraphState, forward_batch: ForwardBatch,
        seq_lens: torch.Tensor, req_pool_indices: torch.Tensor,
    ) -> None:
        """Plans the captured wrappers for this (padded) batch, one per kind met, and makes
        them the active ones."""
        self._batch, self._graph_state, self._planned = forward_batch, state, {}
        self._graph_rows = (seq_lens, req_pool_indices)
        for key, kind in self._kinds.items():
            wrapper = state.wrapper_for(key, self)
            self._plan(wrapper, kind, seq_lens, req_pool_indices)
            self._planned[key] = wrapper
        self._active = state.wrapper


@dataclass
class DecodeGraphState:
    """The fixed-buffer decode wrappers of one captured batch size: ``wrapper`` the plain
    kind's, ``by_kind`` every kind's (each with its own index buffers)."""

    wrapper: Any
    batch_size: int
    max_pages: int
    by_kind: dict = field(default_factory=dict)

    def wrapper_for(self, key: tuple, backend: FlashInferAttentionBackend):
        wrapper = self.by_kind.get(key)
        if wrapper is None:
            device = backend.device
            wrapper = backend._decode_wrapper(
                paged_kv_indptr_buffer=torch.zeros(self.batch_size + 1, dtype=torch.int32,
                                                   device=device),
                paged_kv_indices_buffer=torch.zeros(self.max_pages, dtype=torch.int32,
                                                    device=device),
                paged_kv_last_page_len_buffer=torch.ones(self.batch_size, dtype=torch.int32,
                                                         device=device))
            self.by_kind[key] = wrapper
        return wrapper
