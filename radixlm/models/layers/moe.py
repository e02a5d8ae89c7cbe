"""The mixture-of-experts feed-forward block (Shazeer et al. 2017; GShard, Lepikhin et al.
2020): a router, routed SwiGLU experts, and optional always-on shared experts.

    out = sum_{e in topk(x)} w_e(x) * expert_e(x)  [+ g(x) * shared(x)]

where g is 1 (DeepSeek's ``n_shared_experts``) or sigmoid(shared_expert_gate(x))
(Qwen2-MoE). One constructor per family reads a Hugging Face config:

    MoEBlock.for_mixtral(config)     # softmax, top-k, renormalised; no shared expert
    MoEBlock.for_qwen2_moe(config)   # softmax, norm_topk_prob; gated shared expert
    MoEBlock.for_qwen3_moe(config)   # softmax, norm_topk_prob; no shared expert
    MoEBlock.for_deepseek(config)    # V2 (softmax, greedy / group_limited_greedy) or
                                     # V3 (sigmoid, noaux_tc); ungated shared experts

Parameters and the checkpoint names that fill them (relative to the block, e.g.
``model.layers.N.mlp.``):

- ``gate.weight`` (E, H) <- ``gate.weight``; ``gate.e_score_correction_bias`` (E,) <- same
  name (DeepSeek-V3 only);
- ``experts.w13`` / ``experts.w2`` <- ``experts.{e}.{gate_proj,up_proj,down_proj}.weight``
  (Mixtral: ``experts.{e}.{w1,w3,w2}.weight``), routed by ``load_named_weights`` to
  ``StackedExperts.load_expert_weight``;
- ``shared_experts.gate_up_proj`` / ``shared_experts.down_proj`` (a ``GatedMLP``) <-
  ``shared_experts.{gate_proj,up_proj,down_proj}.weight`` through the model's
  ``stacked_params`` (``gate_proj``/``up_proj`` -> ``gate_up_proj``) as for dense MLPs;
- ``shared_expert_gate.weight`` (1, H) (Qwen2-MoE only).

A model whose checkpoint uses other module names renames them in its ``load_weights``
(Mixtral: ``block_sparse_moe.`` -> ``mlp.``; Qwen2-MoE: ``shared_expert.`` ->
``shared_experts.``) and passes the rest to ``load_named_weights``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from radixlm.models.layers import tensor_parallel
from radixlm.models.layers.mlp import GatedMLP
from radixlm.models.layers.moe_experts import StackedExperts
from radixlm.models.layers.moe_router import MoERouter, RouterConfig

SUPPORTED_ACTIVATIONS = ("silu",)


class MoEBlock(nn.Module):
    """Router + routed experts (+ shared experts): (T, H) -> (T, H)."""

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        router: RouterConfig,
        shared_intermediate_size: int = 0,
        shared_expert_gated: bool = False,
    ):
        """``shared_intermediate_size`` 0 means no shared experts; ``shared_expert_gated``
        scales their output by sigmoid(shared_expert_gate(x)) (Qwen2-MoE)."""
        super().__init__()
        if shared_expert_gated and not shared_intermediate_size:
            raise ValueError("shared_expert_gated needs shared_intermediate_size > 0")
        self.gate = MoERouter(hidden_size, router)
        # Under tensor parallelism each part is this rank's share: one sum at the end.
        self.tp = tensor_parallel.current()
        self.experts = StackedExperts(router.num_experts, hidden_size, moe_intermediate_size,
                                      reduce=False)
        self.shared_experts = (
            GatedMLP(hidden_size, shared_intermediate_size, reduce=False)
            if shared_intermediate_size else None
        )
        self.shared_expert_gate = (
            nn.Linear(hidden_size, 1, bias=False) if shared_expert_gated else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, H) -> (T, H)."""
        topk_weights, topk_ids = self.gate(x)  # (T, k) each
        out = self.experts(x, topk_weights, topk_ids)  # (T, H)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)  # (T, H)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return self.tp.all_reduce(out)

    @classmethod
    def for_mixtral(cls, config: PretrainedConfig) -> MoEBlock:
        _check_activation(config)
        router = RouterConfig(
            num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
            renormalize=True,
        )
        return cls(config.hidden_size, config.intermediate_size, router)

    @classmethod
    def for_qwen2_moe(cls, config: PretrainedConfig) -> MoEBlock:
        _check_activation(config)
        router = RouterConfig(
            num_experts=config.num_experts, top_k=config.num_experts_per_tok,
            renormalize=bool(config.norm_topk_prob),
        )
        return cls(
            config.hidden_size, config.moe_intermediate_size, router,
            shared_intermediate_size=config.shared_expert_intermediate_size,
            shared_expert_gated=True,
        )

    @classmethod
    def for_qwen3_moe(cls, config: PretrainedConfig) -> MoEBlock:
        _check_activation(config)
        router = RouterConfig(
            num_experts=config.num_experts, top_k=config.num_experts_per_tok,
            renormalize=bool(config.norm_topk_prob),
        )
        return cls(config.hidden_size, config.moe_intermediate_size, router)

    @classmethod
    def for_deepseek(cls, config: PretrainedConfig) -> MoEBlock:
        """DeepSeek-V2/V2-Lite (``model_type`` "deepseek_v2") or V3 ("deepseek_v3")."""
        _check_activation(config)
        return cls(
            config.hidden_size, config.moe_intermediate_size, deepseek_router_config(config),
            shared_intermediate_size=config.moe_intermediate_size * (config.n_shared_experts or 0),
        )


def deepseek_router_config(config: PretrainedConfig) -> RouterConfig:
    """The router of a DeepSeek-V2 or V3 config, as transformers computes it.

    V2: softmax; ``topk_method`` "greedy" or "group_limited_greedy"; the weights are scaled
    by ``routed_scaling_factor`` and never renormalised (transformers ignores V2's
    ``norm_topk_prob``). V3: sigmoid with the correction bias, grouped (``n_group`` /
    ``topk_group``), renormalised if ``norm_topk_prob``, then scaled.
    """
    common = dict(
        num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
        routed_scaling_factor=float(config.routed_scaling_factor),
    )
    if config.model_type == "deepseek_v3":
        return RouterConfig(
            **common, scoring="sigmoid", renormalize=bool(config.norm_topk_prob),
            grouping="top2_sum", n_group=config.n_group, topk_group=config.topk_group,
            correction_bias=True,
        )
    if config.model_type != "deepseek_v2":
        raise ValueError(
            f"for_deepseek expects model_type 'deepseek_v2' or 'deepseek_v3', "
            f"got {config.model_type!r}"
        )
    method = config.topk_method
    if method == "greedy":
        return RouterConfig(**common)
    if method == "group_limited_greedy":
        return RouterConfig(
            **common, grouping="max", n_group=config.n_group, topk_group=config.topk_group
        )
    raise ValueError(
        f"DeepSeek-V2 topk_method must be 'greedy' or 'group_limited_greedy', got {method!r}"
    )


def _check_activation(config: PretrainedConfig) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"hidden_act {act!r} is not supported by MoEBlock; "
                         f"supported: {SUPPORTED_ACTIVATIONS}")
