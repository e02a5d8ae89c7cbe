"""The backends over a real ``HybridKVPool``: two requests prefill (one in chunks) and decode
while the test releases, after every step, the local pages whose tokens fell out of the
window (``HybridAllocator.release_local``); the local pool is small, so released pages are
soon handed out again and hold other tokens' KV. Each step's output of the full layer and of
the sliding (soft-capped) layer must equal the float64 reference over the whole history the
test kept."""

from __future__ import annotations

import types

import pytest
import torch
from kernel_device import KERNEL_DEVICE
from windowed_cases import HEAD_DIM, KV_HEADS, reference

from radixlm.kernels.attention.torch_native_backend import TorchNativeAttentionBackend
from radixlm.kernels.attention.triton_backend import TritonAttentionBackend, TritonBackendConfig
from radixlm.kernels.forward_batch import ForwardBatch, ForwardMode
from radixlm.kv_cache.hybrid_pool import HybridAllocator, HybridKVPool
from radixlm.kv_cache.memory_pool import ReqToTokenPool
from radixlm.models.layers.attention import PagedAttention

PAGE, WINDOW, SOFTCAP = 2, 5, 3.0
LOCAL_SLOTS = 20  # 10 local pages, for the 17 pages the two requests fill in all
HEADS = KV_HEADS * 2
SCALE = HEAD_DIM**-0.5
# Per step, the new tokens of requests 0 and 1 (0: none this step).
STEPS = [(7, 4), (4, 1)] + [(1, 1)] * 9


def make_backend(name: str):
    if name == "triton":
        return TritonAttentionBackend(TritonBackendConfig(
            num_kv_splits=2, extend_block_m=16, extend_block_n=16, decode_block_n=16))
    return TorchNativeAttentionBackend()


@pytest.mark.parametrize("backend_name", [
    "torch_native", pytest.param("triton", marks=pytest.mark.triton)])
def test_sliding_layers_over_a_hybrid_pool_that_drops_dead_pages(backend_name):
    device = KERNEL_DEVICE if backend_name == "triton" else torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    allocator = HybridAllocator(64, LOCAL_SLOTS, PAGE, device)
    pool = HybridKVPool(64 + PAGE, LOCAL_SLOTS + PAGE, 2, frozenset({1}), KV_HEADS, HEAD_DIM,
                        torch.float32, device, allocator.slot_map)
    for buffer in pool.layer_buffers():  # garbage where nothing was stored
        buffer.copy_(torch.randn(buffer.shape, generator=gen))
    rows = ReqToTokenPool(4, 64, device)
    req_rows, lens = [2, 0], [0, 0]
    history = [[{"k": [], "v": []} for _ in range(2)] for _ in range(2)]  # [request][layer]
    layers = [PagedAttention(0, HEADS, KV_HEADS, HEAD_DIM, SCALE),
              PagedAttention(1, HEADS, KV_HEADS, HEAD_DIM, SCALE, sliding_window=WINDOW,
                             logit_softcap=SOFTCAP)]
    for new in STEPS:
        out_cache_loc = []
        for b, n in enumerate(new):
            last = int(rows.req_to_token[req_rows[b], lens[b] - 1]) if lens[b] else -1
            slots = allocator.alloc_extend(last, n)
            rows.req_to_token[req_rows[b], lens[b]: lens[b] + n] = slots
            out_cache_loc.append(slots.to(device))
        prefix = list(lens)
        lens = [p + n for p, n in zip(prefix, new)]
        total = sum(new)
        mode = ForwardMode.DECODE if new == (1, 1) else ForwardMode.EXTEND
        batch = ForwardBatch(
            mode=mode, input_ids=torch.zeros(total, dtype=torch.int64, device=device),
            positions=torch.cat([torch.arange(p, p + n)
                                 for p, n in zip(prefix, new)]).to(device),
            out_cache_loc=torch.cat(out_cache_loc),
            req_pool_indices=torch.tensor(req_rows, device=device),
            seq_lens=torch.tensor(lens, device=device),
            prefix_lens=torch.tensor(prefix, device=device),
            extend_seq_lens=torch.tensor(new, device=device), req_to_token=rows.req_to_token,
            kv_pool=pool,
            attn_backend=make_backend(backend_name), seq_lens_list=list(lens),
            extend_seq_lens_list=list(new))
        batch.attn_backend.init_forward_metadata(batch)
        for layer in layers:
            q, k, v = (torch.randn(total, heads, HEAD_DIM, generator=gen).to(device)
                       for heads in (HEADS, KV_HEADS, KV_HEADS))
            prefixes = []
            for b in range(2):
                kept = history[b][layer.layer_id]
                prefixes.append((torch.cat(kept["k"]) if kept["k"] else k[:0],
                                 torch.cat(kept["v"]) if kept["v"] else v[:0]))
            case = types.SimpleNamespace(batch=batch, q=q, k=k, v=v)
            expected = reference(case, prefixes, SCALE, layer.sliding_window,
                                 layer.logit_softcap)
            out = batch.attn_backend.forward(q, k, v, layer, batch)
            torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
            start = 0
            for b, n in enumerate(new):
                history[b][layer.layer_id]["k"].append(k[start: start + n])
                history[b][layer.layer_id]["v"].append(v[start: start + n])
                start += n
        for b in range(2):  # whole pages no later query sees: positions <= len - WINDOW
            dead = max(0, lens[b] - WINDOW + 1) // PAGE * PAGE
            allocator.release_local(rows.req_to_token[req_rows[b], :dead])
    # More pages than the local pool has: released pages were handed out again.
    assert sum(-(-n // PAGE) for n in lens) > LOCAL_SLOTS // PAGE
