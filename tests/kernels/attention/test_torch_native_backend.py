"""TorchNativeAttentionBackend against a naive per-request attention loop over the paged pool.

Each case scatters the KV of ragged requests over random pool slots and random request
rows, leaves stale slot indices past every sequence's end, and checks the backend's
output and what it wrote into the pool.
"""

from __future__ import annotations

import pytest
import torch
from fused_kernels import enable_or_skip

from radixlm.kernels.attention import torch_native_backend
from radixlm.kernels.attention.torch_native_backend import (
    TorchNativeAttentionBackend,
    _InPoolExtend,
)
from radixlm.kernels.cpu_ops import fused_ops
from radixlm.kernels.cpu_ops.execution_plan import CpuExecutionPlan
from radixlm.kernels.forward_batch import ForwardBatch, ForwardMode
from radixlm.kv_cache.allocator import TokenToKVPoolAllocator
from radixlm.kv_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
from radixlm.models.layers.attention import PagedAttention

POOL_TOKENS = 256
NUM_LAYERS = 2
LAYER = 1
KV_HEADS = 2
HEAD_DIM = 16

@pytest.fixture(params=["cost", "split"])
def layout_choice(request, monkeypatch):
    """"cost": the backend picks padded or sequence-by-sequence attention by its cost model;
    "split": calls cost nothing, so every extend batch of two or more sequences attends
    sequence by sequence."""
    if request.param == "split":
        monkeypatch.setattr(torch_native_backend, "CALL_COST_PAIRS", 0)
    return request.param


@pytest.fixture(params=["mask", "padded"])
def causal_padding(request, monkeypatch):
    """"mask": a sequence after a prefix always attends under a mask; "padded": one whose
    prefix is short enough (at most an eighth of its new tokens) attends causally after
    zero queries at any length."""
    if request.param == "mask":
        monkeypatch.setattr(torch_native_backend, "CAUSAL_PAD_MAX_PREFIX", 0)
    else:
        monkeypatch.setattr(torch_native_backend, "CAUSAL_PAD_MIN_KEYS", 0)
    return request.param


def assert_layout_follows(choice, backend, mode, extend_lens):
    split = backend._layout.sequences is not None
    if choice == "split" and mode is ForwardMode.EXTEND and len(extend_lens) > 1:
        assert split == (max(extend_lens) > 1)
    if choice == "cost" and max(extend_lens) < 16:  # small batches: one padded call
        assert not split


def assert_padding_follows(choice, backend, prefix_lens, extend_lens):
    """Every sequence after a prefix of at most an eighth of its new tokens attends without
    a mask under "padded", and under a mask under "mask"."""
    layout = backend._layout
    short = [0 < p <= e / 8 for p, e in zip(prefix_lens, extend_lens, strict=True)]
    if layout.sequences is not None:
        unmasked = [s.slots is not None and s.mask is None for s in layout.sequences]
        assert unmasked == [choice == "padded" and s for s in short]
    elif len(short) == 1 and extend_lens[0] > 1 and prefix_lens[0] > 0:
        assert layout.is_causal == (choice == "padded" and short[0])
        assert (layout.mask is None) == layout.is_causal


# (mode, prefix lengths, extend lengths)
CASES = {
    "extend_ragged_with_prefixes": (ForwardMode.EXTEND, [0, 5, 3, 9], [7, 1, 4, 2]),
    "extend_fresh_batch": (ForwardMode.EXTEND, [0, 0, 0], [3, 8, 1]),
    "extend_long_ragged_fresh_batch": (ForwardMode.EXTEND, [0, 0, 0], [40, 7, 33]),
    "extend_long_fresh_beside_a_prefix": (ForwardMode.EXTEND, [0, 6], [40, 3]),
    "extend_one_fresh_sequence": (ForwardMode.EXTEND, [0], [9]),
    "extend_one_sequence_after_prefix": (ForwardMode.EXTEND, [6], [5]),
    "extend_one_sequence_after_short_prefix": (ForwardMode.EXTEND, [3], [40]),
    "extend_sequences_after_short_prefixes": (ForwardMode.EXTEND, [2, 0, 4], [30, 7, 35]),
    "extend_one_token_prompt": (ForwardMode.EXTEND, [0], [1]),
    "extend_single_tokens_after_prefixes": (ForwardMode.EXTEND, [4, 0, 2], [1, 1, 1]),
    "decode_ragged": (ForwardMode.DECODE, [4, 11, 1, 7], [1, 1, 1, 1]),
    "decode_uniform": (ForwardMode.DECODE, [6, 6, 6], [1, 1, 1]),
    "decode_one_request": (ForwardMode.DECODE, [13], [1]),
}


def build_batch(mode, prefix_lens, extend_lens, num_heads, seed, dtype=torch.float32):
    """Pools with random prefix KV at scattered slots, plus the new tokens' q, k, v."""
    gen = torch.Generator().manual_seed(seed)
    allocator = TokenToKVPoolAllocator(POOL_TOKENS)
    req_pool = ReqToTokenPool(max_requests=8, max_context_len=64, device="cpu")
    kv_pool = MHATokenToKVPool(
        POOL_TOKENS + 1, NUM_LAYERS, KV_HEADS, HEAD_DIM, dtype, "cpu"
    )
    # Garbage everywhere, so a key read through a wrong or stale index changes the result.
    for layer in range(NUM_LAYERS):
        kv_pool.k_buffers[layer].normal_(generator=gen)
        kv_pool.v_buffers[layer].normal_(generator=gen)
    # Stale slot indices in every row, as left behind by earlier requests.
    req_pool.req_to_token.copy_(torch.randint(0, POOL_TOKENS + 1, (8, 64), generator=gen))

    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    all_slots = allocator.alloc(sum(seq_lens))
    all_slots = all_slots[torch.randperm(len(all_slots), generator=gen)]
    rows = [req_pool.alloc() for _ in range(8)]
    rows = [rows[i] for i in torch.randperm(8, generator=gen)[: len(seq_lens)].tolist()]
    slots_of, out_cache_loc, offset = [], [], 0
    for row, seq_len, prefix in zip(rows, seq_lens, prefix_lens, strict=True):
        slots = all_slots[offset : offset + seq_len]
        offset += seq_len
        req_pool.req_to_token[row, :seq_len] = slots
        slots_of.append(slots)
        out_cache_loc.append(slots[prefix:])

    total = sum(extend_lens)
    q = torch.randn(total, num_heads, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)

    def as_tensor(values):
        return torch.tensor(values, dtype=torch.int64)

    positions = [p + i for p, e in zip(prefix_lens, extend_lens, strict=True) for i in range(e)]
    batch = ForwardBatch(
        mode=mode,
        input_ids=torch.zeros(total, dtype=torch.int64),
        positions=as_tensor(positions),
        out_cache_loc=torch.cat(out_cache_loc),
        req_pool_indices=as_tensor(rows),
        seq_lens=as_tensor(seq_lens),
        prefix_lens=as_tensor(prefix_lens),
        extend_seq_lens=as_tensor(extend_lens),
        req_to_token=req_pool.req_to_token,
        kv_pool=kv_pool,
        attn_backend=TorchNativeAttentionBackend(),
        seq_lens_list=seq_lens,
        extend_seq_lens_list=list(extend_lens),
    )
    return batch, slots_of, q, k, v


def naive_attention(q, k_new, v_new, k_prefix, v_prefix, prefix_len, scale):
    """One request: q (E, H, D) attends to prefix + new keys with a causal, offset mask."""
    keys = torch.cat([k_prefix, k_new])  # (S, H_kv, D)
    values = torch.cat([v_prefix, v_new])
    ratio = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(ratio, dim=1)  # (S, H, D)
    values = values.repeat_interleave(ratio, dim=1)
    out = q.new_empty(*q.shape[:2], values.shape[-1])  # (E, H, D_v)
    for head in range(q.shape[1]):
        for i in range(q.shape[0]):
            visible = prefix_len + i + 1
            scores = keys[:visible, head] @ q[i, head] * scale  # (visible,)
            out[i, head] = torch.softmax(scores, dim=0) @ values[:visible, head]
    return out


@pytest.mark.parametrize("gqa_ratio", [1, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_attention_matches_naive_reference_and_writes_new_kv(case, gqa_ratio, layout_choice,
                                                            causal_padding):
    mode, prefix_lens, extend_lens = CASES[case]
    num_heads = KV_HEADS * gqa_ratio
    batch, slots_of, q, k, v = build_batch(mode, prefix_lens, extend_lens, num_heads, seed=7)
    pool = batch.kv_pool
    before_k = [b.clone() for b in pool.k_buffers]
    before_v = [b.clone() for b in pool.v_buffers]
    layer = PagedAttention(LAYER, num_heads, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    req_to_token_before = batch.req_to_token.clone()

    backend = batch.attn_backend
    backend.init_forward_metadata(batch)
    assert_layout_follows(layout_choice, backend, mode, extend_lens)
    assert_padding_follows(causal_padding, backend, prefix_lens, extend_lens)
    call = backend.forward_decode if mode is ForwardMode.DECODE else backend.forward_extend
    out = call(q, k, v, layer, batch)

    assert out.shape == q.shape and out.dtype == q.dtype
    offset = 0
    for slots, prefix, extend in zip(slots_of, prefix_lens, extend_lens, strict=True):
        new = slice(offset, offset + extend)
        offset += extend
        expected = naive_attention(
            q[new], k[new], v[new], before_k[LAYER][slots[:prefix]],
            before_v[LAYER][slots[:prefix]], prefix, layer.scaling,
        )
        torch.testing.assert_close(out[new], expected, atol=1e-5, rtol=1e-5)

    # New K/V land at out_cache_loc of this layer; nothing else in the pool changes.
    loc = batch.out_cache_loc
    torch.testing.assert_close(pool.k_buffers[LAYER][loc], k, atol=0, rtol=0)
    torch.testing.assert_close(pool.v_buffers[LAYER][loc], v, atol=0, rtol=0)
    untouched = torch.ones(pool.num_slots, dtype=torch.bool)
    untouched[loc] = False
    for layer_id in range(NUM_LAYERS):
        if layer_id != LAYER:
            assert torch.equal(pool.k_buffers[layer_id], before_k[layer_id])
            assert torch.equal(pool.v_buffers[layer_id], before_v[layer_id])
        assert torch.equal(pool.k_buffers[layer_id][untouched], before_k[layer_id][untouched])
        assert torch.equal(pool.v_buffers[layer_id][untouched], before_v[layer_id][untouched])
    assert torch.equal(batch.req_to_token, req_to_token_before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][0] is ForwardMode.EXTEND])
def test_extends_attend_through_the_prefill_kernel(case, dtype, layout_choice):
    """Where the fused causal prefill attention serves (bfloat16: AVX-512 BF16, no AMX;
    float32: AVX2 or AVX-512), every extend batch goes to it whole, fresh sequences and
    those after a prefix, over keys where they lie in the pool: no padded grid, no mask;
    the new K/V are stored; the outputs are float32 attention's over the same inputs, to a
    bfloat16 step or float32 rounding."""
    mode, prefix_lens, extend_lens = CASES[case]
    batch, slots_of, q, k, v = build_batch(mode, prefix_lens, extend_lens, 4, seed=9,
                                           dtype=dtype)
    was_on = fused_ops.active() is not None
    enable_or_skip()
    try:
        plan = CpuExecutionPlan(pair_kernels=fused_ops.pair_kernels_pay())  # the runner's
        batch.attn_backend.cpu_plan = plan
        if fused_ops.causal_prefill_attention(*batch.kv_pool.get_kv(LAYER),
                                              plan.pair_kernels) is None:
            pytest.skip("the prefill kernel does not serve on this CPU")
        before_k = batch.kv_pool.k_buffers[LAYER].clone()
        before_v = batch.kv_pool.v_buffers[LAYER].clone()
        layer = PagedAttention(LAYER, 4, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
        backend = batch.attn_backend
        backend.init_forward_metadata(batch)
        layout = backend._layout
        assert isinstance(layout, _InPoolExtend)  # no padded grid, mask or split
        assert torch.equal(layout.kv_slots, batch.req_to_token[
            batch.req_pool_indices, :max(batch.seq_lens_list)])
        out = backend.forward_extend(q, k, v, layer, batch)
        stored = torch.cat([slots[p:p + e] for slots, p, e in
                            zip(slots_of, prefix_lens, extend_lens, strict=True)])
        assert torch.equal(batch.kv_pool.k_buffers[LAYER][stored], k)
        assert torch.equal(batch.kv_pool.v_buffers[LAYER][stored], v)
    finally:
        if not was_on:
            fused_ops.disable()
    offset = 0
    for slots, prefix, extend in zip(slots_of, prefix_lens, extend_lens, strict=True):
        new = slice(offset, offset + extend)
        offset += extend
        expected = naive_attention(
            q[new].float(), k[new].float(), v[new].float(), before_k[slots[:prefix]].float(),
            before_v[slots[:prefix]].float(), prefix, layer.scaling,
        )
        tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out[new].float(), expected, atol=tolerance, rtol=tolerance)


def test_forward_dispatches_by_mode_to_the_same_result():
    mode, prefix_lens, extend_lens = CASES["decode_ragged"]
    batch, _, q, k, v = build_batch(mode, prefix_lens, extend_lens, 4, seed=3)
    layer = PagedAttention(0, 4, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    backend = batch.attn_backend
    backend.init_forward_metadata(batch)
    via_forward = backend.forward(q, k, v, layer, batch)
    direct = backend.forward_decode(q, k, v, layer, batch)
    torch.testing.assert_close(via_forward, direct, atol=0, rtol=0)


def test_metadata_is_shared_by_every_layer_of_a_batch():
    """init_forward_metadata runs once; each layer then attends over its own KV."""
    mode, prefix_lens, extend_lens = CASES["extend_ragged_with_prefixes"]
    batch, slots_of, q, k, v = build_batch(mode, prefix_lens, extend_lens, 4, seed=5)
    before_k = [b.clone() for b in batch.kv_pool.k_buffers]
    before_v = [b.clone() for b in batch.kv_pool.v_buffers]
    backend = batch.attn_backend
    backend.init_forward_metadata(batch)
    for layer_id in range(NUM_LAYERS):
        layer = PagedAttention(layer_id, 4, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
        out = backend.forward_extend(q, k, v, layer, batch)
        slots, prefix, extend = slots_of[1], prefix_lens[1], extend_lens[1]
        start = extend_lens[0]
        new = slice(start, start + extend)
        expected = naive_attention(
            q[new], k[new], v[new], before_k[layer_id][slots[:prefix]],
            before_v[layer_id][slots[:prefix]], prefix, layer.scaling,
        )
        torch.testing.assert_close(out[new], expected, atol=1e-5, rtol=1e-5)


LATENT, ROPE = 12, 4


@pytest.mark.parametrize("case", list(CASES))
def test_latent_pool_attention_matches_naive_reference_and_stores_rows_once(case, layout_choice,
                                                                          causal_padding):
    """MLA layout: one KV head whose keys are latent + RoPE rows and whose values are the
    first LATENT dims of the same rows; the output has LATENT dims per head."""
    mode, prefix_lens, extend_lens = CASES[case]
    batch, slots_of, _, _, _ = build_batch(mode, prefix_lens, extend_lens, 4, seed=11)
    gen = torch.Generator().manual_seed(12)
    pool = MLATokenToKVPool(POOL_TOKENS + 1, NUM_LAYERS, LATENT, ROPE, torch.float32, "cpu")
    for buffer in pool.kv_buffers:
        buffer.normal_(generator=gen)
    batch.kv_pool = pool
    before = [b.clone() for b in pool.kv_buffers]
    total, num_heads = sum(extend_lens), 4
    q = torch.randn(total, num_heads, LATENT + ROPE, generator=gen)
    k = torch.randn(total, 1, LATENT + ROPE, generator=gen)
    layer = PagedAttention(LAYER, num_heads, 1, LATENT + ROPE, 0.3, v_head_dim=LATENT)

    backend = batch.attn_backend
    backend.init_forward_metadata(batch)
    assert_layout_follows(layout_choice, backend, mode, extend_lens)
    out = backend.forward(q, k, k[..., :LATENT], layer, batch)

    assert out.shape == (total, num_heads, LATENT)
    offset = 0
    for slots, prefix, extend in zip(slots_of, prefix_lens, extend_lens, strict=True):
        new = slice(offset, offset + extend)
        offset += extend
        cached = before[LAYER][slots[:prefix]]
        expected = naive_attention(
            q[new], k[new], k[new, :, :LATENT], cached, cached[..., :LATENT], prefix, 0.3
        )
        torch.testing.assert_close(out[new], expected, atol=1e-5, rtol=1e-5)
    loc = batch.out_cache_loc
    assert torch.equal(pool.kv_buffers[LAYER][loc], k)
    assert torch.equal(pool.get_kv(LAYER)[1][loc], k[..., :LATENT])
    untouched = torch.ones(pool.num_slots, dtype=torch.bool)
    untouched[loc] = False
    assert torch.equal(pool.kv_buffers[LAYER][untouched], before[LAYER][untouched])
    assert torch.equal(pool.kv_buffers[1 - LAYER], before[1 - LAYER])


def test_only_long_sequences_after_short_prefixes_attend_causally_after_zero_queries():
    pads = torch_native_backend._pads_causally  # (new tokens, all keys)
    assert pads(510, 512) and pads(456, 512) and pads(950, 1000)
    assert not pads(512, 512)  # fresh: causal over its own keys, nothing to pad
    assert not pads(248, 256)  # too few keys for the causal kernel to skip blocks
    assert not pads(440, 512)  # a prefix of more than an eighth of the new tokens
    assert not pads(1, 600)  # a decode step
