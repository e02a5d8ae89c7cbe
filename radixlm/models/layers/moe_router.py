"""The router of a mixture-of-experts layer: which ``top_k`` experts each token goes to, and
with what weights.

Three families of routing are covered, each as its reference implementation computes it
(router logits always in float32):

- softmax, then top-k, optionally renormalised over the k chosen (Mixtral, Jiang et al.
  2024, always renormalises; Qwen2-MoE / Qwen3-MoE follow ``norm_topk_prob``);
- DeepSeek-V2 (DeepSeek-AI 2024) ``group_limited_greedy``: softmax scores, experts split
  into ``n_group`` groups, only the ``topk_group`` groups with the highest single score
  compete, weights times ``routed_scaling_factor``;
- DeepSeek-V3 (DeepSeek-AI 2024) ``noaux_tc``: sigmoid scores; a learnt per-expert
  correction bias is added *for the choice only* (groups ranked by the sum of their two
  best biased scores); the weights are the unbiased scores of the chosen experts,
  renormalised if ``norm_topk_prob``, times ``routed_scaling_factor``.

Router logits are computed in float32 whatever the serving dtype, so the choice of experts
does not flip on bfloat16 rounding of near-tied logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SCORINGS = ("softmax", "sigmoid")
GROUPINGS = ("none", "max", "top2_sum")


@dataclass(frozen=True)
class RouterConfig:
    """How a router picks experts.

    ``grouping``: ``"none"`` (plain top-k), ``"max"`` (DeepSeek-V2: a group's score is its
    best expert's score; experts of dropped groups score 0) or ``"top2_sum"`` (DeepSeek-V3:
    the sum of its two best biased scores; experts of dropped groups score -inf).
    ``correction_bias``: whether a per-expert bias is added to the scores for the choice.
    """

    num_experts: int
    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    grouping: str = "none"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False

    def __post_init__(self):
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}"
            )
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if self.grouping not in GROUPINGS:
            raise ValueError(f"grouping must be one of {GROUPINGS}, got {self.grouping!r}")
        if self.grouping != "none":
            if self.n_group < 1 or self.num_experts % self.n_group:
                raise ValueError(
                    f"n_group must divide num_experts={self.num_experts}, got {self.n_group}"
                )
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(
                    f"topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}"
                )
            if self.grouping == "top2_sum" and self.num_experts // self.n_group < 2:
                raise ValueError(
                    "grouping 'top2_sum' needs >= 2 experts per group, got "
                    f"{self.num_experts} experts in {self.n_group} groups"
                )


def select_experts(
    router_logits: torch.Tensor, config: RouterConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits (T, E) float32 -> (topk_weights (T, k) float32, topk_ids (T, k) int64).

    The order of the k experts of a token is unspecified; every id is in [0, E) and a
    token's ids are distinct.
    """
    if config.scoring == "softmax":
        scores = router_logits.softmax(dim=-1)  # (T, E)
    else:
        scores = router_logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    if config.grouping != "none":
        choice = _mask_dropped_groups(choice, config)
    topk_ids = torch.topk(choice, config.top_k, dim=-1, sorted=False).indices  # (T, k)
    if correction_bias is None and config.grouping != "top2_sum":
        # DeepSeek-V2 zeroes dropped groups; their experts (only picked when k exceeds the
        # surviving experts) carry weight 0, which ``choice`` holds.
        topk_weights = choice.gather(1, topk_ids)
    else:
        topk_weights = scores.gather(1, topk_ids)  # unbiased weights of the chosen
    if config.renormalize:
        # The epsilon is DeepSeek-V3's; for softmax scores it is below float32 resolution.
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if config.routed_scaling_factor != 1.0:
        topk_weights = topk_weights * config.routed_scaling_factor
    return topk_weights, topk_ids


def _mask_dropped_groups(choice: torch.Tensor, config: RouterConfig) -> torch.Tensor:
    """Keeps the scores of the ``topk_group`` best groups, masks the rest: (T, E) -> (T, E)."""
    t = choice.shape[0]
    grouped = choice.view(t, config.n_group, -1)  # (T, G, E/G)
    if config.grouping == "max":
        group_scores = grouped.max(dim=-1).values  # (T, G)
        fill = 0.0
    else:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (T, G)
        fill = float("-inf")
    kept = torch.topk(group_scores, config.topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)  # (T, G)
    return grouped.masked_fill(~keep[:, :, None], fill).view(t, -1)


class MoERouter(nn.Module):
    """The gate: ``weight`` (E, H) and, for DeepSeek-V3, ``e_score_correction_bias`` (E,).

    Both are marked ``keep_float32``: the loader leaves them in float32 when the rest of
    the model is cast (as transformers keeps DeepSeek-V3's gate), so the router's logits
    are float32 without a cast of the weight every step, and the bias can shift scores in
    [0, 1] by small amounts. (In bfloat16 this is slightly more precise than transformers'
    Mixtral and Qwen-MoE, whose router logits are bfloat16.)
    """

    def __init__(self, hidden_size: int, config: RouterConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size))
        self.weight.keep_float32 = True
        if config.correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(config.num_experts, dtype=torch.float32)
            )
            self.e_score_correction_bias.keep_float32 = True
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, H) -> (topk_weights (T, k) float32, topk_ids (T, k))."""
        logits = F.linear(x.float(), self.weight)  # (T, E) float32
        bias = self.e_score_correction_bias
        return select_experts(logits, self.config, None if bias is None else bias.float())
