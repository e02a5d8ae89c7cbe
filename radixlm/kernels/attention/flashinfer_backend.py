"""The FlashInfer attention backend (Ye et al. 2025): paged prefill and decode wrappers on GPUs.

FlashInfer splits attention into a ``plan`` (scheduling work over the batch's page table,
done on the host once per batch) and a ``run`` per layer. This backend plans in
``init_forward_metadata`` and runs in ``forward_extend`` / ``forward_decode``, after storing
the new K/V into the pool, so the paged kernels see each request's whole sequence.

Page table: FlashInfer reads KV as pages of ``page_size`` consecutive slots (NHD layout,
(pages, page_size, H_kv, D), a view of our (slots, H_kv, D) buffers); how the table is
built is ``flashinfer_page_table``'s. Extend is causal with the mask aligned to the end of
the sequence (query i of an extend of length e over n keys sees keys < n - e + i + 1),
which is exactly "prefix plus the new tokens up to itself".

Sliding windows, logit soft-capping and slot maps are fixed at plan time in FlashInfer
(``window_left = W - 1``, ``logits_soft_cap``), so each distinct kind of layer in a batch,
(window, softcap, slot map), gets a wrapper of its own, planned once a batch: in
``init_forward_metadata`` for the plain kind and every kind met before, else when the
first layer of the kind runs. A windowed
kind's page table starts at the page of the first key its first query sees (FlashInfer
aligns the causal mask and the window to the end of the keys, so leading pages may go);
a slot-mapped kind's pages are the layer's own (a hybrid pool pairs pages offset for
offset; a dropped page reads as page 0, outside every window).

Invariants, each guarded on the CPU by ``tests/kernels/attention/test_flashinfer_plan.py``
against a stand-in FlashInfer that refuses what the real one refuses:

- Planning reads nothing from the device. ``plan``'s host arrays (``qo_indptr``,
  ``indptr``, ``last_page_len``) are built on the host from ``ForwardBatch``'s host
  lengths, in pinned memory that the next batch's plans do not overwrite while
  ``plan``'s copies out of it are in flight (``PlanStaging``: two halves, a batch each);
  the page list stays on the device, built by device ops of host-known size. Every kind
  of layer met before is planned ahead of the batch's first kernel, so a batch's copies
  run as soon as the batch before it ends.
- FlashInfer's workspace is zeroed when allocated, as FlashInfer requires of it before
  its first use.
- CUDA graphs: ``DecodeGraphState`` owns the decode wrappers of one captured batch size;
  every size's wrapper of one kind of layer shares that kind's fixed index buffers
  (``GraphIndexBuffers``, sized for the largest batch at the longest context), since one
  graph replays at a time and each replay is planned first (``init_decode_graph_metadata``,
  outside the graph). A kind first met inside a capture cannot be planned there, and
  raises.

FlashInfer is a constructor argument (the package by default, imported then), so this
module loads everywhere and tests hand the backend a stand-in; constructing it with the
real package needs CUDA (``backend_selection`` says why before that).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from radixlm.kernels.attention.attention_backend import AttentionBackend, DecodeGraphSpec
from radixlm.kernels.attention.flashinfer_page_table import (
    PlanStaging,
    device_page_indices,
    host_page_table,
)
from radixlm.kernels.forward_batch import ForwardBatch, ForwardMode

WORKSPACE_BYTES = 128 * 2**20
"""FlashInfer's scratch for split-KV partial results, shared by all wrappers."""


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
    fb: ForwardBatch, page_size: int, *, window: int | None = None,
    slot_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page table: (indptr (B+1,), page indices (total,), last page lens (B,)),
    int32; indptr and last page lens on the host, the indices on the batch's device."""
    host = host_page_table(fb, page_size, window)
    indices = device_page_indices(fb, page_size, host.total_pages, window, slot_map)
    return host.indptr, indices, host.last_page_len


@dataclass
class GraphIndexBuffers:
    """One kind of layer's fixed decode index buffers, shared by every captured batch size
    (a size's wrapper takes the leading ``size + 1`` / ``size`` rows of the small ones)."""

    indptr: torch.Tensor  # (max_bs + 1,) int32
    indices: torch.Tensor  # (max_bs * max_pages_per_req,) int32
    last_page_len: torch.Tensor  # (max_bs,) int32

    @classmethod
    def allocate(cls, max_batch_size: int, max_pages: int,
                 device: torch.device) -> GraphIndexBuffers:
        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)
        return cls(zeros(max_batch_size + 1), zeros(max_pages),
                   torch.ones(max_batch_size, dtype=torch.int32, device=device))


class FlashInferAttentionBackend(AttentionBackend):
    supports_cuda_graph = True
    uses_custom_kernels = True

    def __init__(self, shape: AttentionShape, device: torch.device,
                 flashinfer: ModuleType | Any | None = None):
        """``flashinfer``: the module whose wrapper classes this backend plans and runs
        (the ``flashinfer`` package, the ``gpu`` extra, when None)."""
        if flashinfer is None:
            import flashinfer  # selection checks it is importable
        self._flashinfer = flashinfer
        self.shape = shape
        self.device = device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._staging = PlanStaging(device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._decode = self._decode_wrapper()
        self._eager = {(ForwardMode.EXTEND, kind_key(PLAIN)): self._prefill,
                       (ForwardMode.DECODE, kind_key(PLAIN)): self._decode}
        self._kinds: dict[tuple, Kind] = {kind_key(PLAIN): PLAIN}  # every kind met
        self._batch: ForwardBatch | None = None
        self._planned: dict[tuple, Any] = {}  # this batch's planned wrappers, by kind
        self._active: Any = None  # the plain kind's
        self._graph_state: DecodeGraphState | None = None  # this batch's, under graphs
        self._graph_states: dict[int, DecodeGraphState] = {}  # per captured batch size
        self._graph_buffers: dict[tuple, GraphIndexBuffers] = {}  # per kind, all sizes
        self._graph_spec: DecodeGraphSpec | None = None

    def _decode_wrapper(self, **graph_buffers):
        """A decode wrapper; with ``graph_buffers`` (its index buffers) one for CUDA graphs.
        Large GQA groups are a small matmul per KV head: tensor cores pay off from 4 up."""
        return self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=bool(graph_buffers),
            use_tensor_cores=self.shape.num_heads // self.shape.num_kv_heads >= 4,
            **graph_buffers)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Plans every kind of layer met so far, before the batch's first kernel (a kind
        met first later in the batch is planned when it is met)."""
        self._batch, self._graph_state, self._planned = forward_batch, None, {}
        self._staging.start_batch()
        for kind in list(self._kinds.values()):
            self._wrapper_for(kind)
        self._active = self._planned[kind_key(PLAIN)]

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
        self._plan(wrapper, kind)
        self._planned[key] = wrapper
        return wrapper

    def _plan(self, wrapper, kind: Kind) -> None:
        """Plans ``wrapper`` for this batch's layers of ``kind``: host arrays from the
        batch's host lengths, the page list on the device (a graph wrapper's ``plan``
        copies it into its fixed buffer, device to device)."""
        fb, shape = self._batch, self.shape
        window, softcap, slot_map = kind
        host = host_page_table(fb, shape.page_size, window, self._staging)
        indices = device_page_indices(fb, shape.page_size, host.total_pages, window,
                                      slot_map)
        options = dict(sm_scale=shape.scaling, q_data_type=shape.dtype,
                       kv_data_type=shape.dtype, logits_soft_cap=softcap,
                       window_left=-1 if window is None else window - 1, non_blocking=True)
        heads = (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.page_size)
        if fb.mode is ForwardMode.DECODE:
            wrapper.plan(host.indptr, indices, host.last_page_len, *heads,
                         pos_encoding_mode="NONE", **options)
        else:
            wrapper.plan(host.qo_indptr, host.indptr, indices, host.last_page_len, *heads,
                         causal=True, **options)
        self._staging.plan_done()

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
        """One graph decode wrapper per captured batch size; their index buffers, one set
        per kind of layer, are shared by all sizes."""
        self._graph_spec = spec
        self._graph_states = {size: DecodeGraphState(None, size) for size in spec.batch_sizes}
        for state in self._graph_states.values():
            state.wrapper = state.wrapper_for(kind_key(PLAIN), self)

    def graph_buffers_for(self, key: tuple) -> GraphIndexBuffers:
        """The fixed index buffers of one kind of layer, made when the kind is first met."""
        buffers = self._graph_buffers.get(key)
        if buffers is None:
            spec = self._graph_spec
            pages_per_req = -(-spec.max_context_len // self.shape.page_size)
            buffers = self._graph_buffers[key] = GraphIndexBuffers.allocate(
                spec.max_batch_size, pages_per_req * spec.max_batch_size, self.device)
        return buffers

    def init_decode_graph_metadata(self, forward_batch: ForwardBatch) -> None:
        """Plans the wrappers captured for this batch's size, one per kind of layer met so
        far (their buffers are rewritten in place), and makes them the ones the captured
        ``run`` calls use. The batch is padded: its host and device lengths agree."""
        state = self._graph_states.get(forward_batch.batch_size)
        if state is None:
            raise ValueError(
                f"no decode graph state for batch size {forward_batch.batch_size}; "
                f"prepared sizes: {sorted(self._graph_states)}"
            )
        self._batch, self._graph_state, self._planned = forward_batch, state, {}
        self._staging.start_batch()
        for key, kind in self._kinds.items():
            wrapper = state.wrapper_for(key, self)
            self._plan(wrapper, kind)
            self._planned[key] = wrapper
        self._active = state.wrapper


@dataclass
class DecodeGraphState:
    """The fixed-buffer decode wrappers of one captured batch size: ``wrapper`` the plain
    kind's, ``by_kind`` every kind's (each over its kind's shared index buffers)."""

    wrapper: Any
    batch_size: int
    by_kind: dict = field(default_factory=dict)

    def wrapper_for(self, key: tuple, backend: FlashInferAttentionBackend):
        wrapper = self.by_kind.get(key)
        if wrapper is None:
            buffers, size = backend.graph_buffers_for(key), self.batch_size
            wrapper = backend._decode_wrapper(
                paged_kv_indptr_buffer=buffers.indptr[: size + 1],
                paged_kv_indices_buffer=buffers.indices,
                paged_kv_last_page_len_buffer=buffers.last_page_len[:size])
            self.by_kind[key] = wrapper
        return wrapper
