"""The causal prefill attention kernels (``prefill_attention.cpp`` in bfloat16,
``prefill_attention_float32.cpp`` in float32) compute what causal attention computes:
against float32 attention over the same inputs they err no more than torch's SDPA in their
dtype does (bfloat16: one bfloat16 step; float32: float32 rounding), for fresh prompts and
prompts after a cached prefix, grouped-query heads, every tail of their row and key blocks,
and strided views of a fused QKV output; a batch of sequences, their keys read through
slots in a pool, gives each sequence what it gets alone; they reject what they cannot
take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixlm.kernels.cpu_ops import fused_ops


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=str)
def dtype(request):
    return request.param


@pytest.fixture(scope="module")
def paged(kernels, dtype):
    if dtype == torch.bfloat16 and not kernels.prefill_attention_available():
        pytest.skip("this CPU has no AVX-512 BF16")
    return kernels.paged_prefill_attention


def close_to(got, want, dtype):
    """Within one rounding step of ``dtype`` (bfloat16's, or float32's after a softmax)."""
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def kernel(paged):
    """One sequence: q (n, H, D) as the last n of the S keys (S, H_kv, D) and values, which
    are the pool (slot j holds key j)."""
    def attend(q, k, v, scale):
        total = torch.tensor([k.shape[0]])
        return paged(q, k, v, torch.arange(k.shape[0])[None], total,
                     torch.tensor([q.shape[0]]), scale)
    return attend


def reference(q, k, v, scale):
    """q (n, H, D) as the last n of the S positions of k (S, H_kv, D), v (S, H_kv, D_v), in
    float32, query by query over the keys it sees."""
    q, k, v = q.float(), k.float(), v.float()
    n, total, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = torch.empty(n, q.shape[1], v.shape[-1])
    for i in range(n):
        seen = total - n + i + 1
        scores = torch.einsum("hd,shd->hs", q[i], k[:seen]) * scale
        out[i] = torch.einsum("hs,shd->hd", scores.softmax(-1), v[:seen])
    return out


def sdpa(q, k, v, scale):
    """torch's causal SDPA in q's dtype over the same inputs (zero queries before the n)."""
    pad = k.shape[0] - q.shape[0]
    queries = F.pad(q.transpose(0, 1)[None], (0, 0, pad, 0))
    out = F.scaled_dot_product_attention(queries, k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], is_causal=True,
                                         scale=scale, enable_gqa=True)
    return out[0, :, pad:].transpose(0, 1)


# (new tokens n, all keys S, heads H, KV heads, D, D_v)
SHAPES = [
    (1, 1, 4, 4, 64, 64),  # one token
    (7, 7, 4, 2, 64, 64),  # fewer rows than a row group
    (64, 64, 9, 3, 64, 64),  # whole blocks, the default model's heads
    (77, 77, 9, 3, 64, 64),  # a tail of rows and of keys
    (33, 100, 8, 2, 64, 64),  # after a cached prefix
    (1, 50, 4, 1, 64, 64),  # one token after a prefix (a decode-like extend)
    (40, 131, 4, 4, 128, 128),  # wide heads, an odd count of keys
    (19, 19, 2, 1, 48, 32),  # D not a multiple of 32, D_v of 16
    (300, 300, 9, 3, 64, 64),  # more than one block of keys: the running softmax
    (20, 600, 4, 2, 64, 64),  # after a prefix of two blocks and more
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_it_errs_from_float32_attention_no_more_than_torch_sdpa(kernel, dtype, shape):
    n, total, heads, kv_heads, dim, v_dim = shape
    gen = torch.Generator().manual_seed(n * 1000 + total)
    q = torch.randn(n, heads, dim, generator=gen).to(dtype)
    k = (2 * torch.randn(total, kv_heads, dim, generator=gen)).to(dtype)
    v = torch.randn(total, kv_heads, v_dim, generator=gen).to(dtype)
    scale = dim**-0.5
    got = kernel(q, k, v, scale)
    assert got.shape == (n, heads, v_dim) and got.dtype == dtype
    want = reference(q, k, v, scale)
    torch_error = (sdpa(q, k, v, scale).float() - want).abs().max().item()
    error = (got.float() - want).abs().max().item()
    # bfloat16: within torch's own error (one bfloat16 step); float32: within twice torch's,
    # float32 sums taken in another order (2.7e-6 against 2.6e-6 at 300 tokens).
    if dtype == torch.bfloat16:
        assert error <= max(torch_error, 2**-8) * 1.01, (error, torch_error)
    else:
        assert error <= max(torch_error, 2e-6) * 2, (error, torch_error)
    close_to(got, want, dtype)


def test_it_reads_strided_views_of_a_fused_projection(kernel, dtype):
    """q, k and v as the column slices of one (T, (H + 2 H_kv) D) output, unpacked."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(90, (8 + 2 * 2) * 64, generator=gen).to(dtype)
    q, k, v = qkv.split([8 * 64, 2 * 64, 2 * 64], dim=1)
    q, k, v = q.view(90, 8, 64), k.view(90, 2, 64), v.view(90, 2, 64)
    got = kernel(q, k, v, 0.125)
    assert torch.equal(got, kernel(q.contiguous(), k.contiguous(), v.contiguous(), 0.125))
    close_to(got, reference(q, k, v, 0.125), dtype)


def test_a_later_query_changes_no_earlier_output(kernel, dtype):
    """Causality: the first rows' outputs are those of the prompt cut after them."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(70, 4, 64, generator=gen).to(dtype)
    k = torch.randn(70, 2, 64, generator=gen).to(dtype)
    v = torch.randn(70, 2, 64, generator=gen).to(dtype)
    whole = kernel(q, k, v, 0.125)
    assert torch.equal(whole[:37], kernel(q[:37], k[:37], v[:37], 0.125))


@pytest.mark.parametrize("cached", [1, 31, 64, 100, 270])
def test_a_prompt_after_a_cache_hit_computes_what_the_whole_prompt_did(kernel, dtype, cached):
    """Rows after a cached prefix equal, bit for bit, the same rows of the whole prompt:
    key blocks start at position 0 whatever the rows, and keys a row does not see add
    exact zeros."""
    gen = torch.Generator().manual_seed(cached)
    q = torch.randn(400, 9, 64, generator=gen).to(dtype)
    k = torch.randn(400, 3, 64, generator=gen).to(dtype)
    v = torch.randn(400, 3, 64, generator=gen).to(dtype)
    assert torch.equal(kernel(q[cached:], k, v, 0.125), kernel(q, k, v, 0.125)[cached:])


def test_it_rejects_what_it_cannot_take(kernel, dtype):
    q = torch.zeros(4, 4, 64, dtype=dtype)
    k = torch.zeros(8, 2, 64, dtype=dtype)
    with pytest.raises(RuntimeError, match="all bfloat16 or all float32"):
        kernel(q.half(), k.half(), k.half(), 1.0)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(RuntimeError, match="all bfloat16 or all float32"):
        kernel(q, k.to(other), k, 1.0)
    with pytest.raises(RuntimeError, match="extend_lens"):
        kernel(torch.zeros(9, 4, 64, dtype=dtype), k, k, 1.0)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        kernel(torch.zeros(4, 3, 64, dtype=dtype), k, k, 1.0)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernel(q, k, k[..., :40], 1.0)
    with pytest.raises(RuntimeError, match="unit stride"):
        kernel(q, k.transpose(1, 2).contiguous().transpose(1, 2), k, 1.0)


def test_the_backend_takes_them_only_where_they_serve(kernels):
    """bfloat16 pools of head dims it takes on AVX-512 BF16 builds for CPUs without AMX,
    float32 ones on builds with AVX2 or AVX-512 vectors; nothing else."""
    flags = fused_ops._cpu_flags()
    keys = torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    in_bfloat16 = (kernels.prefill_attention_available() and kernels.pair_matmul_available()
                   and "amx_bf16" not in flags)
    assert fused_ops.pair_kernels_pay() == in_bfloat16
    pays = fused_ops.pair_kernels_pay()
    assert (fused_ops.causal_prefill_attention(keys, keys, pays) is not None) == in_bfloat16
    assert fused_ops.causal_prefill_attention(keys, keys, False) is None  # the plan says no
    vectorized = fused_ops._vector_capability(flags) != ["-DCPU_CAPABILITY=DEFAULT"]
    wide = keys.float()
    assert (fused_ops.causal_prefill_attention(wide, wide, pays) is not None) == vectorized
    assert fused_ops.causal_prefill_attention(keys.half(), keys.half(), pays) is None
    assert fused_ops.causal_prefill_attention(keys, wide, pays) is None
    for pool in (keys, wide):
        assert fused_ops.causal_prefill_attention(pool, pool[..., :40], pays) is None
        latent = torch.zeros(8, 1, 576, dtype=pool.dtype)  # MLA: values of 512 dims
        assert fused_ops.causal_prefill_attention(latent, latent[..., :512], pays) is None


# (new tokens, all keys) of each sequence of a paged batch: fresh prompts, prompts after
# prefixes (short, long, whole key blocks), one-token extends, one long prompt among them.
PAGED_BATCH = [(12, 12), (1, 1), (5, 40), (33, 97), (1, 64), (130, 130), (7, 71)]


def paged_batch(gen, dtype, heads=9, kv_heads=3, dim=64, v_dim=64, pool_rows=700):
    """A pool of random K/V rows, each sequence's keys at random distinct rows, and the
    queries of all sequences one after another."""
    k_buffer = torch.randn(pool_rows, kv_heads, dim, generator=gen).to(dtype)
    v_buffer = torch.randn(pool_rows, kv_heads, v_dim, generator=gen).to(dtype)
    width = max(total for _, total in PAGED_BATCH) + 3
    rows = torch.randperm(pool_rows, generator=gen)
    slots = torch.zeros(len(PAGED_BATCH), width, dtype=torch.int64)
    used = 0
    for b, (_, total) in enumerate(PAGED_BATCH):
        slots[b, :total] = rows[used:used + total]
        used += total
    seq_lens = torch.tensor([total for _, total in PAGED_BATCH])
    extend_lens = torch.tensor([n for n, _ in PAGED_BATCH])
    q = torch.randn(int(extend_lens.sum()), heads, dim, generator=gen).to(dtype)
    return q, k_buffer, v_buffer, slots, seq_lens, extend_lens


@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)], ids=str)
def test_a_batch_gives_each_sequence_what_it_gets_alone(kernel, paged, dtype, heads):
    gen = torch.Generator().manual_seed(heads[0] * 10 + heads[1])
    q, k_buffer, v_buffer, slots, seq_lens, extend_lens = paged_batch(gen, dtype, *heads)
    got = paged(q, k_buffer, v_buffer, slots, seq_lens, extend_lens, 0.125)
    assert got.shape == (q.shape[0], heads[0], 64)
    start = 0
    for b, (n, total) in enumerate(PAGED_BATCH):
        keys = slots[b, :total]
        alone = kernel(q[start:start + n], k_buffer[keys], v_buffer[keys], 0.125)
        assert torch.equal(got[start:start + n], alone), b
        close_to(got[start:start + n], reference(
            q[start:start + n], k_buffer[keys], v_buffer[keys], 0.125), dtype)
        start += n


def test_a_batch_it_cannot_take_is_rejected_naming_why(paged, dtype):
    gen = torch.Generator().manual_seed(1)
    q, k_buffer, v_buffer, slots, seq_lens, extend_lens = paged_batch(gen, dtype)
    with pytest.raises(RuntimeError, match="outside the pool"):
        bad = slots.clone()
        bad[2, 3] = k_buffer.shape[0]
        paged(q, k_buffer, v_buffer, bad, seq_lens, extend_lens, 1.0)
    with pytest.raises(RuntimeError, match="extend_lens"):
        paged(q, k_buffer, v_buffer, slots, seq_lens, seq_lens + 1, 1.0)
    with pytest.raises(RuntimeError, match="sum"):
        paged(q[1:], k_buffer, v_buffer, slots, seq_lens, extend_lens, 1.0)
    with pytest.raises(RuntimeError, match="int64"):
        paged(q, k_buffer, v_buffer, slots.int(), seq_lens, extend_lens, 1.0)
    with pytest.raises(RuntimeError, match="same rows"):
        paged(q, k_buffer, v_buffer[:-1], slots, seq_lens, extend_lens, 1.0)
