"""bfloat16 weights in oneDNN's blocked layout or the fused kernels' column pairs: each
product equals torch's ``F.linear`` on the same weight (also where the plain rows kept beside
oneDNN's serve passes of a few rows); a bfloat16 CPU model gets the layouts on its
projections, head and experts (and only then); a laid-out model serves as close to float32
as transformers' bfloat16 does."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from fused_kernels import enable_or_skip
from tiny_models import reference_model

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.kernels.cpu_ops.execution_plan import CpuExecutionPlan
from radixlm.models.layers.cpu_weight_layout import (
    FEW_ROWS,
    BlockedWeight,
    PairedWeight,
    uses_blocked_layout,
)
from radixlm.models.layers.linear import Linear
from radixlm.models.layers.mlp import GatedMLP, silu_and_mul
from radixlm.models.layers.moe_experts import StackedExperts
from radixlm.models.layers.weight_formats import ConversionBuffer, Int8Weight
from radixlm.models.loader import load_model
from radixlm.models.model_config import ModelConfig

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not uses_blocked_layout(CPU, torch.bfloat16),
                                reason="this torch or CPU has no oneDNN bfloat16 matmul")


def test_the_layout_applies_to_bfloat16_on_cpus_only():
    assert not uses_blocked_layout(CPU, torch.float32)
    assert not uses_blocked_layout(CPU, torch.float16)
    assert not uses_blocked_layout(torch.device("meta"), torch.bfloat16)
    assert not uses_blocked_layout(CPU, torch.bfloat16, "int8wo")  # the format packs instead


@pytest.fixture
def kernels_on():
    """The fused CPU kernels on for the test (few-row passes over kept rows use them)."""
    was_on = fused_ops.active() is not None
    enable_or_skip()
    yield
    if not was_on:
        fused_ops.disable()


@pytest.mark.parametrize("keep_rows", [False, True])
@pytest.mark.parametrize("rows", [1, 3, FEW_ROWS, FEW_ROWS + 1, 16, 64, 300])
def test_a_laid_out_weight_multiplies_as_f_linear_does(kernels_on, rows, keep_rows):
    """Through oneDNN, or (kept rows, up to FEW_ROWS) the fused kernels' dense_matmul."""
    torch.manual_seed(rows)
    weight = (torch.randn(192, 160) * 0.05).bfloat16()
    blocked = BlockedWeight.pack(weight, CpuExecutionPlan(keep_rows=keep_rows))
    assert torch.equal(blocked.dequantized(), weight.float())
    assert blocked.nbytes() == 192 * 160 * 2 * (2 if keep_rows else 1)
    assert (blocked.rows is not None) == keep_rows
    x = torch.randn(rows, 320).bfloat16()[:, ::2]  # a strided view, as a split's can be
    got = blocked.matmul(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 192)
    # One bfloat16 step at most (oneDNN may block the sums differently for some sizes).
    torch.testing.assert_close(got.float(), F.linear(x, weight).float(), atol=1e-2, rtol=1e-2)
    assert blocked.matmul(x[:0]).shape == (0, 192)


def test_prompt_passes_leave_the_kept_rows_alone(kernels_on):
    """In a prompt pass of the plan (the runner's ``pass_scope``) a few-row pass reads
    oneDNN's layout, outside it the kept rows; the plan is restored after, even when the pass
    fails. (The kept rows are zeroed here so that the two paths tell apart.)"""
    torch.manual_seed(0)
    weight = (torch.randn(64, 32) * 0.05).bfloat16()
    plan = CpuExecutionPlan(keep_rows=True)
    blocked = BlockedWeight.pack(weight, plan)
    blocked.rows = torch.zeros_like(weight)
    x = torch.randn(2, 32).bfloat16()
    expected = F.linear(x, weight)
    assert not blocked.matmul(x).any()  # the kept (zeroed) rows
    with plan.pass_scope(2, prompt=True):
        torch.testing.assert_close(blocked.matmul(x), expected, atol=1e-2, rtol=1e-2)
        assert blocked.fused_projection(2, torch.bfloat16) is None  # oneDNN's: no kernel
    with plan.pass_scope(2, prompt=False):
        assert not blocked.matmul(x).any()
    with plan.pass_scope(2, prompt=True):
        with plan.pass_scope(1, prompt=False):  # (logits inside a prompt pass, say)
            assert blocked.matmul(x).any()  # still the prompt pass's products
        assert blocked.matmul(x).any()  # restored, not reset
    with pytest.raises(RuntimeError, match="boom"), plan.pass_scope(2, prompt=True):
        raise RuntimeError("boom")
    assert not blocked.matmul(x).any()
    other = BlockedWeight.pack(weight, CpuExecutionPlan(keep_rows=True))
    other.rows = torch.zeros_like(weight)
    with plan.pass_scope(2, prompt=True):  # another model's plan: not in a pass
        assert not other.matmul(x).any()


@pytest.fixture
def kernels_off():
    """The fused CPU kernels off for the test (a load keeps plain rows, never pairs)."""
    module = fused_ops.active()
    fused_ops.disable()
    yield
    if module is not None:
        fused_ops.enable()


@pytest.fixture
def pairs_on(kernels_on):
    """The fused CPU kernels on, where their pair_matmul serves (else the test skips)."""
    if not fused_ops.pair_kernels_pay():
        pytest.skip("pair_matmul does not serve here (no AVX-512 BF16, or an AMX CPU)")


@pytest.mark.parametrize("rows", [1, 3, 16, 300])
def test_a_paired_weight_multiplies_as_f_linear_does(pairs_on, rows):
    """Through the kernels' pair_matmul, whatever the rows and inside prompt passes too;
    with the kernels off, through F.linear on the weight unpacked."""
    torch.manual_seed(rows)
    weight = (torch.randn(192, 160) * 0.05).bfloat16()
    paired = PairedWeight.pack(weight)
    assert torch.equal(paired.dequantized(), weight.float())
    assert paired.nbytes() == 192 * 160 * 2
    x = torch.randn(rows, 320).bfloat16()[:, ::2]
    got = paired.matmul(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 192)
    torch.testing.assert_close(got.float(), F.linear(x, weight).float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(got, fused_ops.active().pair_matmul(x, paired.pairs))
    with CpuExecutionPlan(keep_rows=True, pair_kernels=True).pass_scope(rows, prompt=True):
        assert torch.equal(paired.matmul(x), got)
    fused_ops.disable()
    try:
        assert torch.equal(paired.matmul(x), F.linear(x, weight))
    finally:
        fused_ops.enable()


@pytest.mark.parametrize("weight_format", [None, "int8wo"])
def test_a_gated_mlp_over_pairs_gets_its_silu_from_the_kernel(pairs_on, weight_format):
    """GatedMLP's gate_up over pairs (bfloat16, or int8 by pairs) hands silu(gate) * up to
    one kernel call: the same bits as the product, then silu_and_mul; with the kernels off,
    or halves that split a group of 16, it takes those two steps."""
    torch.manual_seed(0)
    mlp = GatedMLP(64, 48).bfloat16()
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.pack_weight(PairedWeight.pack if weight_format is None else
                          lambda w: Int8Weight.pack(w, ConversionBuffer(), by_pairs=True))
    x = torch.randn(5, 64).bfloat16()
    gated = mlp.gate_up_proj.silu_gated_project(x)
    assert gated is not None and gated.shape == (5, 48)
    two_steps = silu_and_mul(mlp.gate_up_proj(x))
    assert torch.equal(gated, two_steps)
    assert torch.equal(mlp(x), mlp.down_proj(two_steps))
    fused_ops.disable()
    try:
        assert mlp.gate_up_proj.silu_gated_project(x) is None
        assert mlp(x).shape == (5, 64)
    finally:
        fused_ops.enable()
    odd = GatedMLP(64, 40).bfloat16()  # halves of 40: the boundary inside a group
    odd.gate_up_proj.pack_weight(PairedWeight.pack)
    assert odd.gate_up_proj.silu_gated_project(x) is None


def test_only_weights_that_fit_are_paired():
    assert PairedWeight.fits(torch.zeros(48, 64)) and PairedWeight.fits(torch.zeros(16, 2))
    assert not PairedWeight.fits(torch.zeros(40, 64))  # out features not a multiple of 16
    assert not PairedWeight.fits(torch.zeros(48, 63))  # odd in features


def _load(path, dtype, weight_format=None, keep_rows=False) -> torch.nn.Module:
    """The model loaded as a runner with the kernels' own copies (``keep_rows``, the plan's
    pairs where they pay here) or without would load it."""
    plan = CpuExecutionPlan(keep_rows=keep_rows,
                            pair_kernels=keep_rows and fused_ops.pair_kernels_pay())
    return load_model(ModelConfig.from_path(str(path)), dtype, CPU, 128,
                      weight_format=weight_format, plan=plan)


def test_a_bfloat16_model_gets_the_layout_on_its_projections_and_head(tiny_model_dir):
    path = tiny_model_dir("Qwen2ForCausalLM", "gqa", True)  # biased q/k/v, tied head
    model = _load(path, torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.packed, BlockedWeight) and m.weight is None
                           for m in linears)
    head = model.embed_tokens  # the lookup keeps its rows
    assert isinstance(head.packed, BlockedWeight) and head.weight.dtype == torch.bfloat16
    assert torch.equal(head.packed.dequantized(), head.weight.float())
    assert all(m.packed is None for m in _load(path, torch.float32).modules()
               if isinstance(m, Linear))
    int8 = _load(path, torch.bfloat16, "int8wo")  # a weight format packs them instead
    assert all(isinstance(m.packed, Int8Weight) for m in int8.modules() if isinstance(m, Linear))
    assert all(m.packed.rows is None for m in linears)


def test_kept_rows_are_the_weights_themselves(tiny_model_dir, kernels_off):
    """With kept rows and no pairs each laid-out weight keeps its plain (out, in)
    rows; a tied head's are the embedding's own tensor, not a copy."""
    path = tiny_model_dir("Qwen2ForCausalLM", "gqa", True)
    model = _load(path, torch.bfloat16, keep_rows=True)
    for module in model.modules():
        if isinstance(module, Linear):
            assert module.packed.rows.is_contiguous()
            assert torch.equal(module.packed.rows.float(), module.packed.dequantized())
    head = model.embed_tokens
    assert head.packed.rows.data_ptr() == head.weight.data_ptr()


def test_where_pairs_serve_they_replace_onednns_layout(tiny_model_dir, pairs_on):
    """Projections, the tied head (the lookup keeps its rows) and each routed expert."""
    model = _load(tiny_model_dir("Qwen2MoeForCausalLM", "gqa", True), torch.bfloat16,
                  keep_rows=True)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.packed, PairedWeight) for m in linears)
    head = model.embed_tokens
    assert isinstance(head.packed, PairedWeight) and head.weight.dtype == torch.bfloat16
    assert torch.equal(head.packed.dequantized(), head.weight.float())
    experts = [m for m in model.modules() if isinstance(m, StackedExperts)]
    assert experts and all(isinstance(w, PairedWeight)
                           for m in experts for w in m.packed[0] + m.packed[1])


def test_a_bfloat16_moe_model_gets_the_layout_on_each_routed_expert(tiny_model_dir):
    model = _load(tiny_model_dir("Qwen2MoeForCausalLM", "gqa", True), torch.bfloat16)
    experts = [m for m in model.modules() if isinstance(m, StackedExperts)]
    assert experts and all(m.w13 is None and m.w2 is None for m in experts)
    for module in experts:
        gate_up, down = module.packed
        assert len(gate_up) == len(down) == module.num_experts
        assert all(isinstance(w, BlockedWeight) for w in gate_up + down)


@torch.inference_mode()
def test_laid_out_experts_compute_what_their_stacked_weights_do():
    torch.manual_seed(0)
    experts = StackedExperts(num_experts=4, hidden_size=64, intermediate_size=96)
    with torch.no_grad():
        experts.w13.normal_(0.0, 0.1)
        experts.w2.normal_(0.0, 0.1)
    experts = experts.bfloat16()
    x = torch.randn(12, 64).bfloat16()
    topk_ids = torch.stack([torch.randperm(4)[:2] for _ in range(12)])  # (12, 2), distinct
    topk_weights = torch.rand(12, 2)
    expected = experts(x, topk_weights, topk_ids)
    nbytes = experts.pack_expert_weights(
        functools.partial(BlockedWeight.pack, plan=CpuExecutionPlan()))
    assert experts.w13 is None and nbytes == 4 * (2 * 96 * 64 + 64 * 96) * 2
    got = experts(x, topk_weights, topk_ids)
    assert got.dtype == torch.bfloat16 and got.shape == (12, 64)
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-2, rtol=1e-2)
    assert experts(x[:0], topk_weights[:0], topk_ids[:0]).shape == (0, 64)


@torch.inference_mode()
@pytest.mark.parametrize("architecture", [
    "Qwen2ForCausalLM",  # biased q/k/v, tied head
    "Qwen3ForCausalLM",  # per-head q/k norms
    "Qwen2MoeForCausalLM",  # routed and shared experts beside the laid-out attention
    "DeepseekV3ForCausalLM",  # latent attention's projections, q-LoRA
])
def test_a_laid_out_model_is_as_close_to_float32_as_transformers_bfloat16(
        engine_for, tiny_model_dir, architecture):
    kv = "mha" if architecture.startswith("Deepseek") else "gqa"  # MLA has no KV groups
    path = tiny_model_dir(architecture, kv, True)
    engine = engine_for(architecture, kv, True, dtype="bfloat16")
    torch.manual_seed(0)
    prompts = [torch.randint(20, 380, (40,)).tolist() for _ in range(3)]
    outs = engine.generate(input_ids=prompts, return_logprob=True, logprob_start_len=0,
                           sampling_params={"max_new_tokens": 8, "temperature": 0.0,
                                            "ignore_eos": True})
    exact_model = reference_model(path)
    bf16_model = type(exact_model).from_pretrained(path, dtype=torch.bfloat16).eval()
    ours_error = theirs_error = 0.0
    for ids, out in zip(prompts, outs):
        sequence = torch.tensor([ids + out["output_ids"]])
        targets = sequence[0, 1:, None]
        exact = torch.log_softmax(exact_model(sequence).logits[0, :-1], -1).gather(1, targets)
        theirs = torch.log_softmax(bf16_model(sequence).logits[0, :-1].float(), -1)
        meta = out["meta_info"]
        ours = torch.tensor([e[0] for e in meta["input_token_logprobs"][1:]]
                            + [e[0] for e in meta["output_token_logprobs"]])
        ours_error = max(ours_error, (ours - exact[:, 0]).abs().max().item())
        theirs_error = max(theirs_error,
                           (theirs.gather(1, targets) - exact).abs().max().item())
    assert ours_error <= 2 * theirs_error + 1e-2, (ours_error, theirs_error)
