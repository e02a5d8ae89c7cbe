"""A stand-in for the ``flashinfer`` package's paged wrappers that refuses what FlashInfer
refuses and records every call, so the backend's use of it is checked without a GPU.

Written from FlashInfer's documented API (``BatchDecodeWithPagedKVCacheWrapper`` and
``BatchPrefillWithPagedKVCacheWrapper``, their ``__init__`` / ``plan`` / ``run``):

- q / kv data types: float16 or bfloat16 (its kernels' dtype tables stop at 16 bits;
  there is no float32 kernel); head sizes 64, 128 and 256 (what ``backend="auto"``'s
  Hopper kernels compile); ``num_qo_heads`` a multiple of ``num_kv_heads``.
- The float workspace is zeroed before its first use. On the ``meta`` device, which holds
  no values, the zeros cannot be checked; a CPU workspace is checked.
- ``plan``'s ``qo_indptr`` / ``indptr`` / ``last_page_len`` are what ``plan`` reads on the
  host: a device tensor there is copied back (a wait on the device), so this stand-in
  refuses anything but int32 CPU tensors of length B+1 / B, indptrs from 0 and
  non-decreasing, last page lengths in 1..page_size. ``indices`` must hold
  ``indptr[-1]`` int32 pages on the workspace's device: FlashInfer would copy host
  indices up, but a page list on the host means the caller read ``req_to_token`` back.
- CUDA-graph decode wrappers: int32 index buffers on the workspace's device, an indptr
  buffer one longer than the last-page-length buffer, a batch size fixed at construction
  and page lists no longer than the indices buffer (``plan`` copies into the buffers).

``run`` attends as FlashInfer documents its plans, in float64, and returns q's dtype: each
request's keys are the first ``(pages - 1) * page_size + last_page_len`` slots of the pages
listed for it; a query sits at the end of its request's keys (the causal mask and
``window_left`` are aligned there: query i of r sees keys up to n - r + i, and no more than
``window_left`` before); ``logits_soft_cap`` c turns a score s = q k * sm_scale into
c * tanh(s / c). On the ``meta`` device it returns an empty output.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 256)
LAYOUTS = ("NHD", "HND")
POS_ENCODINGS = ("NONE", "ROPE_LLAMA", "ALIBI")


class Refused(ValueError):
    """What the real FlashInfer would refuse (or could not run)."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise Refused(message)


def _check_workspace(workspace: torch.Tensor) -> None:
    _require(isinstance(workspace, torch.Tensor), "the float workspace must be a tensor")
    if workspace.device.type != "meta":
        _require(not bool(workspace.any()), "the float workspace must be zeroed before use")


def _check_host_indptr(name: str, t: torch.Tensor, length: int) -> list[int]:
    _check_host(name, t, length)
    values = t.tolist()
    _require(values[0] == 0, f"{name} must start at 0, got {values[0]}")
    _require(all(a <= b for a, b in zip(values, values[1:])), f"{name} must not decrease")
    return values


def _check_host(name: str, t: torch.Tensor, length: int) -> None:
    _require(t.device.type == "cpu", f"{name} must be on the host, not {t.device}: plan "
             "reads it there and would copy a device tensor back")
    _require(t.dtype == torch.int32, f"{name} must be int32, not {t.dtype}")
    _require(t.dim() == 1 and len(t) == length, f"{name} must have length {length}")


def _check_graph_buffer(name: str, t, device: torch.device) -> None:
    _require(torch.is_tensor(t), f"{name} should be a torch.Tensor in cudagraph mode")
    _require(t.dtype == torch.int32 and t.device == device,
             f"{name} must be int32 on {device}, not {t.dtype} on {t.device}")


class _PagedWrapper:
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str):
        _check_workspace(float_workspace_buffer)
        _require(kv_layout in LAYOUTS, f"kv_layout must be one of {LAYOUTS}")
        self.workspace = float_workspace_buffer
        self.device = float_workspace_buffer.device
        self.kv_layout = kv_layout
        self.plans: list[dict] = []
        self.runs: list[tuple] = []

    def _check_plan(self, batch_size: int, indptr: torch.Tensor, indices: torch.Tensor,
                    last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
                    head_dim: int, page_size: int, q_data_type, kv_data_type,
                    window_left: int, logits_soft_cap, pos_encoding_mode: str) -> list[int]:
        kv_data_type = q_data_type if kv_data_type is None else kv_data_type
        _require(q_data_type in DTYPES and kv_data_type in DTYPES,
                 f"FlashInfer has kernels for {DTYPES}, not q {q_data_type} / kv "
                 f"{kv_data_type}")
        _require(head_dim in HEAD_DIMS, f"head_dim {head_dim} is not one of {HEAD_DIMS}")
        _require(num_kv_heads > 0 and num_qo_heads % num_kv_heads == 0,
                 "num_qo_heads must be a multiple of num_kv_heads")
        _require(page_size >= 1, "page_size must be positive")
        _require(window_left >= -1, "window_left must be -1 (no window) or >= 0")
        _require(logits_soft_cap is None or logits_soft_cap >= 0, "logits_soft_cap < 0")
        _require(pos_encoding_mode in POS_ENCODINGS, f"pos_encoding_mode {pos_encoding_mode}")
        pointers = _check_host_indptr("indptr", indptr, batch_size + 1)
        _check_host("last_page_len", last_page_len, batch_size)
        _require(all(1 <= n <= page_size for n in last_page_len.tolist()),
                 "last_page_len must lie in 1..page_size")
        _require(indices.dtype == torch.int32 and indices.dim() == 1,
                 "indices must be 1-D int32")
        _require(indices.device == self.device, f"indices must be on {self.device} (the "
                 f"page list stays on the device), not {indices.device}")
        _require(len(indices) == pointers[-1],
                 f"indices holds {len(indices)} pages, indptr[-1] says {pointers[-1]}")
        return pointers

    def _check_run(self, q: torch.Tensor, paged_kv_cache, rows: int) -> None:
        _require(bool(self.plans), "run before plan")
        plan = self.plans[-1]
        _require(q.dtype == plan["q_data_type"], f"q is {q.dtype}, planned for "
                 f"{plan['q_data_type']}")
        _require(tuple(q.shape) == (rows, plan["num_qo_heads"], plan["head_dim"]),
                 f"q of shape {tuple(q.shape)} does not match the plan")
        k, v = paged_kv_cache
        expected = (plan["page_size"], plan["num_kv_heads"], plan["head_dim"])
        for t in (k, v):
            shape = tuple(t.shape[1:]) if self.kv_layout == "NHD" else (
                t.shape[2], t.shape[1], t.shape[3])
            _require(shape == expected, f"paged KV of shape {tuple(t.shape)}, planned "
                     f"pages of {expected} ({self.kv_layout})")
        self.runs.append((q, paged_kv_cache))

    def _attend(self, q: torch.Tensor, paged_kv_cache, qo_indptr: list[int]) -> torch.Tensor:
        if q.device.type == "meta":
            return torch.empty_like(q)
        plan = self.plans[-1]
        k_pages, v_pages = paged_kv_cache  # (pages, page_size, H_kv, D) as NHD
        if self.kv_layout == "HND":
            k_pages, v_pages = k_pages.transpose(1, 2), v_pages.transpose(1, 2)
        indptr, last = plan["indptr"].tolist(), plan["last_page_len"].tolist()
        indices = plan["indices"].long()
        group = plan["num_qo_heads"] // plan["num_kv_heads"]
        scale = plan["sm_scale"] or plan["head_dim"] ** -0.5
        window, cap = plan["window_left"], plan["logits_soft_cap"]
        causal = plan.get("causal", True)  # a decode query is the last: causal or not
        out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
        for b in range(len(indptr) - 1):
            pages = indices[indptr[b]: indptr[b + 1]]
            n = (len(pages) - 1) * plan["page_size"] + last[b]
            keys = k_pages[pages].flatten(0, 1)[:n].double()  # (n, H_kv, D)
            values = v_pages[pages].flatten(0, 1)[:n].double()
            rows = range(qo_indptr[b], qo_indptr[b + 1])
            for i, t in enumerate(rows):
                pos = n - len(rows) + i
                hi = pos + 1 if causal else n
                lo = 0 if window < 0 else max(0, pos - window)
                for h in range(q.shape[1]):
                    scores = keys[lo:hi, h // group] @ q[t, h].double() * scale
                    if cap:
                        scores = cap * torch.tanh(scores / cap)
                    out[t, h] = torch.softmax(scores, 0) @ values[lo:hi, h // group]
        return out.to(q.dtype)


class BatchDecodeWithPagedKVCacheWrapper(_PagedWrapper):
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend: str = "auto"):
        super().__init__(float_workspace_buffer, kv_layout)
        self.use_cuda_graph = use_cuda_graph
        self.use_tensor_cores = use_tensor_cores
        self.indptr_buffer = paged_kv_indptr_buffer
        self.indices_buffer = paged_kv_indices_buffer
        self.last_page_len_buffer = paged_kv_last_page_len_buffer
        self.fixed_batch_size = None
        if use_cuda_graph:
            _check_graph_buffer("paged_kv_indptr_buffer", paged_kv_indptr_buffer, self.device)
            _check_graph_buffer("paged_kv_indices_buffer", paged_kv_indices_buffer,
                                self.device)
            _check_graph_buffer("paged_kv_last_page_len_buffer",
                                paged_kv_last_page_len_buffer, self.device)
            self.fixed_batch_size = len(paged_kv_last_page_len_buffer)
            _require(len(paged_kv_indptr_buffer) == self.fixed_batch_size + 1,
                     "The size of paged_kv_indptr_buffer should be batch_size + 1")

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, *, pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None,
             q_data_type=torch.float16, kv_data_type=None, sm_scale=None,
             non_blocking=True):
        batch_size = len(last_page_len)
        self._check_plan(batch_size, indptr, indices, last_page_len, num_qo_heads,
                         num_kv_heads, head_dim, page_size, q_data_type, kv_data_type,
                         window_left, logits_soft_cap, pos_encoding_mode)
        if self.use_cuda_graph:
            _require(batch_size == self.fixed_batch_size,
                     f"batch size {batch_size}, fixed at {self.fixed_batch_size} for graphs")
            _require(len(indices) <= len(self.indices_buffer),
                     "The size of indices should be less than or equal to the allocated "
                     "buffer")
            self.indptr_buffer.copy_(indptr)
            self.last_page_len_buffer.copy_(last_page_len)
            self.indices_buffer[: len(indices)].copy_(indices)
        self.plans.append(dict(
            indptr=indptr, indices=indices, last_page_len=last_page_len,
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            page_size=page_size, q_data_type=q_data_type, window_left=window_left,
            logits_soft_cap=logits_soft_cap, sm_scale=sm_scale))

    def run(self, q, paged_kv_cache):
        batch_size = len(self.plans[-1]["last_page_len"]) if self.plans else -1
        self._check_run(q, paged_kv_cache, batch_size)
        return self._attend(q, paged_kv_cache, list(range(batch_size + 1)))


class BatchPrefillWithPagedKVCacheWrapper(_PagedWrapper):
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, backend: str = "auto"):
        super().__init__(float_workspace_buffer, kv_layout)
        _require(not use_cuda_graph, "this stand-in has no graph prefill: the backend "
                 "captures decode only")

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, *, causal=False,
             pos_encoding_mode="NONE", sm_scale=None, window_left=-1, logits_soft_cap=None,
             q_data_type=torch.float16, kv_data_type=None, non_blocking=True):
        batch_size = len(qo_indptr) - 1
        queries = _check_host_indptr("qo_indptr", qo_indptr, batch_size + 1)
        pages = self._check_plan(batch_size, paged_kv_indptr, paged_kv_indices,
                                 paged_kv_last_page_len, num_qo_heads, num_kv_heads,
                                 head_dim_qk, page_size, q_data_type, kv_data_type,
                                 window_left, logits_soft_cap, pos_encoding_mode)
        if causal:
            last = paged_kv_last_page_len.tolist()
            for b in range(batch_size):
                kv_len = (pages[b + 1] - pages[b] - 1) * page_size + last[b]
                _require(queries[b + 1] - queries[b] <= kv_len,
                         f"request {b}: more queries than keys under a causal mask")
        self.plans.append(dict(
            qo_indptr=qo_indptr, indptr=paged_kv_indptr, indices=paged_kv_indices,
            last_page_len=paged_kv_last_page_len, num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim_qk, page_size=page_size,
            q_data_type=q_data_type, window_left=window_left, causal=causal,
            logits_soft_cap=logits_soft_cap, sm_scale=sm_scale))

    def run(self, q, paged_kv_cache):
        qo_indptr = self.plans[-1]["qo_indptr"].tolist() if self.plans else [-1]
        self._check_run(q, paged_kv_cache, qo_indptr[-1])
        return self._attend(q, paged_kv_cache, qo_indptr)


def standin_flashinfer() -> SimpleNamespace:
    """The stand-in, shaped like the ``flashinfer`` module the backend takes."""
    return SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=BatchDecodeWithPagedKVCacheWrapper,
        BatchPrefillWithPagedKVCacheWrapper=BatchPrefillWithPagedKVCacheWrapper)
