"""The fused CPU kernels compute what the torch operations they replace compute: float32 to
float32 rounding, bfloat16 to one rounding step (the few-rows matmuls have their own module);
an engine serves the same tokens and logprobs with them as without; where they cannot be
built, torch's operations stay."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from radixlm.models.layers.layernorm import GemmaRMSNorm
from radixlm.models.layers.rotary_embedding import RotaryEmbedding

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5),
             torch.bfloat16: dict(atol=2e-2, rtol=1e-2)}  # one bfloat16 step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [96, 100])  # whole vectors; and a scalar tail
def test_norms_compute_what_f_rms_norm_computes(kernels, dtype, d):
    torch.manual_seed(0)
    x, residual = torch.randn(2, 7, d, dtype=dtype), torch.randn(2, 7, d, dtype=dtype)
    weight = torch.randn(d, dtype=dtype)
    expected = F.rms_norm(x, (d,), weight, 1e-6)
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-6), expected, **TOLERANCE[dtype])
    strided = torch.randn(7, 3, 2 * d, dtype=dtype)[..., ::2]  # a view, as q/k norms get
    torch.testing.assert_close(kernels.rms_norm(strided, weight, 1e-6),
                               F.rms_norm(strided, (d,), weight, 1e-6), **TOLERANCE[dtype])
    normed, summed = kernels.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, x + residual)  # rounded as torch rounds the add
    torch.testing.assert_close(normed, F.rms_norm(x + residual, (d,), weight, 1e-6),
                               **TOLERANCE[dtype])
    assert kernels.rms_norm(x[:, :0], weight, 1e-6).shape == (2, 0, d)
    eps = 0.5  # eps enters as torch adds it
    torch.testing.assert_close(kernels.rms_norm(x, weight, eps),
                               F.rms_norm(x, (d,), weight, eps), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemmas_norm_on_the_kernels_computes_what_its_torch_path_computes(kernels, dtype):
    """A float32 weight (Gemma's 1 + w) beside 16-bit x: the product taken in float32 and
    rounded once, as GemmaRMSNorm's own chain of torch operations does. The module's weight
    is in the serving dtype, as a loaded model's is, and the module runs the kernel."""
    torch.manual_seed(2)
    norm = GemmaRMSNorm(100, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(100) * 0.5)
    x, residual = torch.randn(5, 100, dtype=dtype), torch.randn(5, 100, dtype=dtype)
    assert torch.equal(norm(x), kernels.rms_norm(x, 1.0 + norm.weight.float(), 1e-6))
    heads = torch.randn(5, 3, 200, dtype=dtype)[..., ::2]  # q/k heads as a view
    for inputs in [x, heads]:
        torch.testing.assert_close(norm(inputs), norm._norm(inputs), **TOLERANCE[dtype])
    normed, summed = norm(x, residual)
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(normed, norm._norm(x + residual), **TOLERANCE[dtype])
    with torch.no_grad():
        norm.weight.add_(1.0)  # a changed weight is read again
    assert torch.equal(norm.scale(), 1.0 + norm.weight.float())
    torch.testing.assert_close(norm(x), norm._norm(x), **TOLERANCE[dtype])


def test_norms_reject_mismatched_arguments(kernels):
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="x's dtype or float32"):
        kernels.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match=r"weight must be \(d,\)"):
        kernels.rms_norm(x, torch.ones(9), 1e-6)
    with pytest.raises(RuntimeError, match="differ in shape or dtype"):
        kernels.add_rms_norm(x, torch.randn(2, 8), torch.ones(8), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80])  # halves of whole vectors; and a scalar tail
def test_rotary_and_silu_mul_compute_what_torch_computes(kernels, dtype, head_dim):
    torch.manual_seed(1)
    rope = RotaryEmbedding(head_dim, 256, {"rope_theta": 10000.0}, 256)
    cos, signed_sin = rope.lookup(torch.tensor([0, 5, 17, 255]), dtype)  # (4, 1, D) each
    qkv = torch.randn(4, 12, head_dim, dtype=dtype)
    qk = qkv[:, :9]  # q and k heads as a view of the projection's output
    expected = torch.addcmul(qk * cos, torch.roll(qk, head_dim // 2, dims=-1),
                             signed_sin)  # apply_rotary's
    got = kernels.rotary(qk, cos, signed_sin)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    if dtype == torch.bfloat16:  # no sums: rounded where torch rounds, so bit for bit
        assert torch.equal(got, expected)
    assert kernels.rotary(qk[:0], cos[:0], signed_sin[:0]).shape == (0, 9, head_dim)
    with pytest.raises(RuntimeError, match=r"must be \(T, 1, D\)"):
        kernels.rotary(qk, cos[:3], signed_sin[:3])
    gate_up = torch.randn(6, 2 * 40, dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    got = kernels.silu_mul(gate_up)
    torch.testing.assert_close(got, F.silu(gate) * up, **TOLERANCE[dtype])
    if dtype == torch.bfloat16:
        assert torch.equal(got, F.silu(gate) * up)
    with pytest.raises(RuntimeError, match=r"must be \(T, 2 I\)"):
        kernels.silu_mul(torch.randn(6, 5, dtype=dtype))



def test_bfloat16_silu_mul_equals_torch_for_every_gate(kernels):
    """Every finite bfloat16 gate (the faster exp bfloat16 takes), in whole vectors and in
    the scalar tail, against ups that round the product differently."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gates = every[torch.isfinite(every)]  # 65280 of them
    for width in (96, 40):
        rows = -(-gates.numel() // width)
        gate = torch.cat([gates, gates[: rows * width - gates.numel()]]).view(rows, width)
        up = torch.randn(rows, width, dtype=torch.bfloat16)
        for factor in (torch.ones_like(up), up):
            got = kernels.silu_mul(torch.cat([gate, factor], dim=1))
            assert torch.equal(got, F.silu(gate) * factor)

def _reference_decode(q, k_buffer, v_buffer, slots, seq_lens, scale):
    """Per request: gather its keys and values, then SDPA in float32, KV heads grouped."""
    out = []
    heads, kv_heads = q.shape[1], k_buffer.shape[1]
    for b in range(q.shape[0]):
        rows = slots[b, : seq_lens[b]]
        keys = k_buffer[rows].float().transpose(0, 1)  # (H_kv, L, D)
        values = v_buffer[rows].float().transpose(0, 1)  # (H_kv, L, D_v)
        queries = q[b].float().view(kv_heads, heads // kv_heads, -1)  # (H_kv, G, D)
        attended = F.scaled_dot_product_attention(queries, keys, values, scale=scale)
        out.append(attended.reshape(heads, -1))
    return torch.stack(out).to(q.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, dim, v_dim", [
    (9, 3, 64, 64),  # grouped-query attention
    (4, 4, 32, 32),  # multi-head
    (8, 1, 80, 64),  # latent attention: one KV head, values a view of the keys' first dims
    (4, 2, 96, 96),  # value rows of whole vector blocks and a remainder
    (6, 3, 64, 64),  # two queries a KV head
    (10, 2, 64, 64),  # five: value rows read for four queries, then for one
])
def test_decode_attention_over_the_pool_equals_gathered_sdpa(kernels, dtype, heads, kv_heads,
                                                              dim, v_dim):
    torch.manual_seed(heads + dim)
    pool_slots, batch, width = 600, 5, 70
    k_buffer = torch.randn(pool_slots, kv_heads, dim, dtype=dtype)
    v_buffer = (k_buffer[..., :v_dim] if v_dim != dim
                else torch.randn(pool_slots, kv_heads, v_dim, dtype=dtype))
    poisoned = 599  # NaN keys and values: a kernel that reads beyond a request's length fails
    k_buffer[poisoned] = float("nan")
    if v_dim == dim:
        v_buffer[poisoned] = float("nan")
    slots = torch.stack([torch.randperm(poisoned)[:width] for _ in range(batch)])
    seq_lens = torch.tensor([70, 1, 33, 69, 12])
    for b in range(batch):
        slots[b, seq_lens[b]:] = poisoned
    q = torch.randn(batch, heads, dim, dtype=dtype)
    scale = dim**-0.5
    got = kernels.paged_decode_attention(q, k_buffer, v_buffer, slots, seq_lens, scale)
    assert got.shape == (batch, heads, v_dim) and got.dtype == dtype
    expected = _reference_decode(q, k_buffer, v_buffer, slots, seq_lens, scale)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    qk = torch.randn(batch, heads + kv_heads, dim, dtype=dtype)  # q as a view, as layers pass it
    torch.testing.assert_close(
        kernels.paged_decode_attention(qk[:, :heads], k_buffer, v_buffer, slots, seq_lens, scale),
        _reference_decode(qk[:, :heads], k_buffer, v_buffer, slots, seq_lens, scale),
        **TOLERANCE[dtype])


def test_decode_attention_rejects_lengths_and_slots_outside_their_bounds(kernels):
    k_buffer = v_buffer = torch.randn(16, 2, 8)
    q, slots = torch.randn(2, 4, 8), torch.zeros(2, 5, dtype=torch.int64)
    for lens in ([0, 3], [3, 6]):
        with pytest.raises(RuntimeError, match=r"seq_lens out of \[1, S\]"):
            kernels.paged_decode_attention(q, k_buffer, v_buffer, slots, torch.tensor(lens), 1.0)
    slots[1, 2] = 16
    with pytest.raises(RuntimeError, match="slot out of the pool"):
        kernels.paged_decode_attention(q, k_buffer, v_buffer, slots, torch.tensor([5, 3]), 1.0)
    with pytest.raises(RuntimeError, match="heads do not match"):
        kernels.paged_decode_attention(torch.randn(2, 3, 8), k_buffer, v_buffer, slots,
                                       torch.tensor([1, 1]), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_rows_stores_what_index_copy_stores(kernels, dtype):
    torch.manual_seed(3)
    buffer = torch.randn(50, 2, 8, dtype=dtype)
    qkv = torch.randn(40, 5, 8, dtype=dtype)
    rows = qkv[:, 3:]  # V as a view of the projection's output (stride between rows 40)
    slots = torch.randperm(50)[:40]
    expected = buffer.clone().index_copy_(0, slots, rows)
    kernels.scatter_rows(buffer, slots, rows)
    assert torch.equal(buffer, expected)
    kernels.scatter_rows(buffer, slots[:0], rows[:0])  # nothing to store
    assert torch.equal(buffer, expected)


def test_scatter_rows_rejects_slots_and_rows_that_do_not_fit(kernels):
    buffer, rows = torch.zeros(10, 2, 4), torch.ones(3, 2, 4)
    with pytest.raises(RuntimeError, match="slot out of the buffer"):
        kernels.scatter_rows(buffer, torch.tensor([0, 10, 1]), rows)
    with pytest.raises(RuntimeError, match="slot out of the buffer"):
        kernels.scatter_rows(buffer, torch.tensor([0, -1, 1]), rows)
    assert not buffer.any()  # checked before anything is written
    with pytest.raises(RuntimeError, match="row shape"):
        kernels.scatter_rows(buffer, torch.tensor([0, 1, 2]), torch.ones(3, 4, 2))
    with pytest.raises(RuntimeError, match="dtypes differ"):
        kernels.scatter_rows(buffer, torch.tensor([0, 1, 2]), rows.double())
    with pytest.raises(RuntimeError, match="int64"):
        kernels.scatter_rows(buffer, torch.tensor([0, 1, 2], dtype=torch.int32), rows)


@torch.inference_mode()
def test_an_engine_serves_the_same_with_the_kernels_as_without(engine_for, kernels):
    prompts = [[5 + (7 * i + j) % 300 for j in range(20 + 9 * i)] for i in range(3)]
    params = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    outs = {}
    for disabled in (False, True):
        engine = engine_for("Qwen3ForCausalLM", "gqa", False, disable_cpu_kernels=disabled)
        assert engine.get_server_info()["fused_cpu_kernels"] is not disabled
        outs[disabled] = engine.generate(input_ids=prompts, sampling_params=params,
                                         return_logprob=True, logprob_start_len=0)
    for fused, plain in zip(outs[False], outs[True]):
        assert fused["output_ids"] == plain["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            got = [entry[0] for entry in fused["meta_info"][key][1:]]
            want = [entry[0] for entry in plain["meta_info"][key][1:]]
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)


def test_without_a_compiler_torch_operations_stay(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": str(tmp_path / "no-c++")}
    script = ("import logging; logging.basicConfig()\n"
              "from radixlm.kernels.cpu_ops import fused_ops\n"
              "print(fused_ops.enable(), fused_ops.enable(), fused_ops.active())\n")
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False", "False", "None"]  # asked twice, warned once
    assert run.stderr.count("fused CPU kernels unavailable, using torch's operations: "
                            "no C++ compiler") == 1
    assert len(run.stderr.strip().splitlines()) == 1  # one line, nothing from the builder
