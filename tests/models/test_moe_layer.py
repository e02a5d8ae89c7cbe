"""The MoE block against transformers' MoE modules on the same weights, loaded the way a
checkpoint stores them (expert by expert); the grouped expert computation against a loop."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import write_tiny_model
from torch import nn
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from radixlm.models.layers.moe import MoEBlock
from radixlm.models.layers.moe_experts import grouped_experts_torch, naive_experts_per_token
from radixlm.models.layers.moe_router import MoERouter, RouterConfig, select_experts
from radixlm.models.llama import LlamaForCausalLM
from radixlm.models.loader import load_model
from radixlm.models.model_config import ModelConfig
from radixlm.models.weight_loading import load_named_weights

HIDDEN = 64
COMMON = dict(hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2)
# (transformers config, its MoE module, our constructor, checkpoint names of gate/up/down)
FAMILIES = {
    "mixtral": (
        transformers.MixtralConfig(**COMMON, num_local_experts=8, num_experts_per_tok=2),
        MixtralSparseMoeBlock, MoEBlock.for_mixtral, ("w1", "w3", "w2"),
    ),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig(
            **COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, norm_topk_prob=False,
        ),
        Qwen2MoeSparseMoeBlock, MoEBlock.for_qwen2_moe, ("gate_proj", "up_proj", "down_proj"),
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig(
            **COMMON, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
            norm_topk_prob=True,
        ),
        Qwen3MoeSparseMoeBlock, MoEBlock.for_qwen3_moe, ("gate_proj", "up_proj", "down_proj"),
    ),
    "deepseek_v2_group_limited": (
        transformers.DeepseekV2Config(
            **COMMON, n_routed_experts=16, num_experts_per_tok=3, moe_intermediate_size=32,
            n_shared_experts=2, topk_method="group_limited_greedy", n_group=4, topk_group=2,
            routed_scaling_factor=1.5,
        ),
        DeepseekV2Moe, MoEBlock.for_deepseek, ("gate_proj", "up_proj", "down_proj"),
    ),
    "deepseek_v2_lite_greedy": (
        transformers.DeepseekV2Config(
            **COMMON, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            n_shared_experts=1, topk_method="greedy",
        ),
        DeepseekV2Moe, MoEBlock.for_deepseek, ("gate_proj", "up_proj", "down_proj"),
    ),
    "deepseek_v3": (
        transformers.DeepseekV3Config(
            **COMMON, n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
            n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
            norm_topk_prob=True,
        ),
        DeepseekV3MoE, MoEBlock.for_deepseek, ("gate_proj", "up_proj", "down_proj"),
    ),
}


def random_reference(module_class, config, seed: int = 0) -> nn.Module:
    """transformers' MoE module with random weights (and a random correction bias)."""
    torch.manual_seed(seed)
    module = module_class(config).float().eval()
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0.0, 0.2)
        for name, buffer in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.3, 0.3)
    return module


def per_expert_checkpoint(module: nn.Module, proj_names: tuple[str, str, str]):
    """(name, tensor) of ``module``'s state as a checkpoint stores it: one tensor per expert
    and projection, shared-expert names renamed to ours (DeepSeek's)."""
    gate, up, down = proj_names
    for name, tensor in module.state_dict().items():
        if name == "experts.gate_up_proj":
            for e, stacked in enumerate(tensor):
                g, u = stacked.chunk(2, dim=0)
                yield f"experts.{e}.{gate}.weight", g
                yield f"experts.{e}.{up}.weight", u
        elif name == "experts.down_proj":
            for e, weight in enumerate(tensor):
                yield f"experts.{e}.{down}.weight", weight
        else:
            yield name.replace("shared_expert.", "shared_experts."), tensor


def our_block(family: str, reference: nn.Module) -> MoEBlock:
    config, _, build, proj_names = FAMILIES[family]
    block = build(config)
    load_named_weights(block, per_expert_checkpoint(reference, proj_names),
                       LlamaForCausalLM.stacked_params)
    return block.eval()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tokens", [1, 5, 64])
@torch.inference_mode()
def test_block_matches_transformers_module(family, tokens):
    config, module_class, _, _ = FAMILIES[family]
    reference = random_reference(module_class, config)
    block = our_block(family, reference)
    x = torch.randn(1, tokens, HIDDEN)
    expected = reference(x)[0]
    torch.testing.assert_close(block(x[0]), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_router_picks_the_experts_transformers_picks(family):
    config, module_class, _, _ = FAMILIES[family]
    reference = random_reference(module_class, config, seed=1)
    block = our_block(family, reference)
    x = torch.randn(200, HIDDEN)
    _, ref_weights, ref_ids = reference.gate(x)
    weights, ids = block.gate(x)
    ref_ids, order = ref_ids.sort(dim=-1)
    ids, ours = ids.sort(dim=-1)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights.gather(1, ours), ref_weights.float().gather(1, order))


@torch.inference_mode()
def test_correction_bias_changes_the_choice_but_not_the_weights_source():
    """DeepSeek-V3: the bias moves experts in and out of the top-k; the weights stay the
    unbiased sigmoid scores of the chosen (renormalised, scaled)."""
    config = RouterConfig(num_experts=16, top_k=4, scoring="sigmoid", renormalize=True,
                          grouping="top2_sum", n_group=4, topk_group=2,
                          routed_scaling_factor=2.5, correction_bias=True)
    torch.manual_seed(0)
    logits = torch.randn(100, 16)
    bias = torch.rand(16) * 0.5
    weights, ids = select_experts(logits, config, bias)
    _, unbiased_ids = select_experts(logits, config, torch.zeros(16))
    assert not torch.equal(ids.sort(-1).values, unbiased_ids.sort(-1).values)
    chosen = logits.sigmoid().gather(1, ids)
    torch.testing.assert_close(weights, 2.5 * chosen / chosen.sum(-1, keepdim=True))
    # Only experts of the two kept groups (of four experts each) are chosen.
    assert torch.tensor([len(set(row)) for row in (ids // 4).tolist()]).le(2).all()


@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(0, 4, 2), (1, 8, 2), (7, 8, 3),
                                                         (300, 16, 4), (33, 4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_grouped_experts_equal_a_per_token_loop(tokens, experts, top_k, dtype):
    torch.manual_seed(tokens)
    hidden, inter = 32, 24
    x = torch.randn(tokens, hidden, dtype=dtype)
    w13 = torch.randn(experts, 2 * inter, hidden, dtype=dtype) * 0.2
    w2 = torch.randn(experts, hidden, inter, dtype=dtype) * 0.2
    ids = torch.rand(tokens, experts).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k)
    inputs = [t.clone() for t in (x, w13, w2, weights, ids)]
    got = grouped_experts_torch(x, w13, w2, weights, ids)
    expected = naive_experts_per_token(x.float(), w13.float(), w2.float(), weights, ids)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)
    for before, after in zip(inputs, (x, w13, w2, weights, ids)):
        assert torch.equal(before, after)


def test_missing_expert_tensor_is_reported():
    config, module_class, build, proj_names = FAMILIES["qwen2_moe"]
    reference = random_reference(module_class, config)
    weights = [(n, t) for n, t in per_expert_checkpoint(reference, proj_names)
               if n != "experts.5.up_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*experts\.w13:5\.up"):
        load_named_weights(build(config), weights, LlamaForCausalLM.stacked_params)


def test_misshaped_or_out_of_range_expert_tensor_is_refused():
    config, _, build, _ = FAMILIES["mixtral"]
    block = build(config)
    with pytest.raises(ValueError, match="expected shape"):
        block.experts.load_expert_weight(0, "w1", torch.zeros(3, HIDDEN))
    with pytest.raises(ValueError, match="out of range"):
        block.experts.load_expert_weight(8, "w1", torch.zeros(96, HIDDEN))
    with pytest.raises(ValueError, match="unknown expert projection"):
        block.experts.load_expert_weight(0, "w4", torch.zeros(96, HIDDEN))


@pytest.mark.parametrize(("fields", "message"), [
    (dict(num_experts=8, top_k=9), "top_k"),
    (dict(num_experts=8, top_k=2, scoring="relu"), "scoring"),
    (dict(num_experts=8, top_k=2, grouping="max", n_group=3), "n_group"),
    (dict(num_experts=8, top_k=2, grouping="max", n_group=4, topk_group=5), "topk_group"),
    (dict(num_experts=8, top_k=2, grouping="top2_sum", n_group=8), "top2_sum"),
])
def test_router_config_names_the_bad_field(fields, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(**fields)


@pytest.mark.parametrize("architecture", ["DeepseekV3ForCausalLM", "MixtralForCausalLM"])
def test_router_parameters_stay_float32_when_the_model_is_cast(tmp_path, architecture):
    path = write_tiny_model(tmp_path, architecture)
    model = load_model(ModelConfig.from_path(path), torch.bfloat16, "cpu", max_position=64)
    routers = [m for m in model.modules() if isinstance(m, MoERouter)]
    assert routers and all(r.weight.dtype == torch.float32 for r in routers)
    biases = [r.e_score_correction_bias for r in routers if r.e_score_correction_bias is not None]
    assert all(b.dtype == torch.float32 for b in biases)
    assert (architecture == "DeepseekV3ForCausalLM") == bool(biases)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
