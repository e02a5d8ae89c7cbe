"""The routed experts of a mixture-of-experts layer: stacked weights and the computation.

Every expert is a SwiGLU MLP, ``down(silu(gate(x)) * up(x))``. Their weights are stacked
so that one kernel can see all of them:

- ``w13`` (E, 2 I, H): rows ``[0, I)`` are expert e's gate projection, ``[I, 2 I)`` its up
  projection;
- ``w2`` (E, H, I): expert e's down projection.

The computation sits behind ``ExpertsComputation`` so a fused kernel (the Triton fused MoE
of the kernels package) can replace the torch implementation here without touching the
models: set ``StackedExperts.computation``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.models.layers import tensor_parallel
from radixlm.models.layers.mlp import silu_and_mul
from radixlm.models.layers.weight_formats import PackedWeight

# Checkpoint names of an expert's projections -> (stacked parameter, shard).
# Mixtral calls them w1 (gate), w3 (up), w2 (down); Qwen-MoE and DeepSeek use *_proj.
EXPERT_PROJECTIONS = {
    "gate_proj": ("w13", "gate"),
    "up_proj": ("w13", "up"),
    "down_proj": ("w2", "down"),
    "w1": ("w13", "gate"),
    "w3": ("w13", "up"),
    "w2": ("w2", "down"),
}


class ExpertsComputation(Protocol):
    """out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]).

    Arguments: x (T, H); w13 (E, 2 I, H) and w2 (E, H, I) as described in the module
    docstring; topk_weights (T, k), any float dtype; topk_ids (T, k) int64 in [0, E), a
    token's ids distinct. Returns (T, H) in x's dtype. Must not modify its inputs. T may
    be 0.
    """

    def __call__(
        self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    ) -> torch.Tensor: ...


def grouped_experts_torch(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``ExpertsComputation`` in torch: (token, expert) pairs sorted by expert, then one
    gate/up matmul and one down matmul per *active* expert over all its tokens.

    At batch 1 only k experts run; at large batches every expert runs once on its rows.
    """
    return grouped_by_expert(
        x, topk_weights, topk_ids, w13.shape[0],
        lambda expert, rows: F.linear(rows, w13[expert]),
        lambda expert, hidden: F.linear(hidden, w2[expert]),
    )


def grouped_by_expert(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
    gate_up: Callable[[int, torch.Tensor], torch.Tensor],
    down: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The grouping of ``grouped_experts_torch`` around any per-expert matmuls:
    ``gate_up(e, rows)`` (n, H) -> (n, 2 I) and ``down(e, hidden)`` (n, I) -> (n, H) are
    expert e's projections; each runs once per active expert, on all its tokens."""
    t, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)  # (T k,)
    order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert
    token_of_pair = order // k  # (T k,) the token of each sorted pair
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    x_sorted = x.index_select(0, token_of_pair)  # (T k, H)
    out_sorted = torch.empty_like(x_sorted)  # (T k, H)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        out_sorted[rows] = down(expert, silu_and_mul(gate_up(expert, x_sorted[rows])))  # (n, H)
        start += count
    weights = topk_weights.reshape(-1).index_select(0, order).to(x.dtype)  # (T k,)
    out_sorted.mul_(weights[:, None])
    return torch.zeros_like(x).index_add_(0, token_of_pair, out_sorted)  # (T, H)


def naive_experts_per_token(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``ExpertsComputation`` as a loop over tokens and their k experts: the reference the
    grouped computations are tested and benchmarked against."""
    out = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for weight, expert in zip(topk_weights[token].tolist(), topk_ids[token].tolist()):
            gate, up = F.linear(x[token], w13[expert]).chunk(2, dim=-1)  # (I,) each
            out[token] += weight * F.linear(F.silu(gate) * up, w2[expert])
    return out


class StackedExperts(nn.Module):
    """E SwiGLU experts with stacked weights ``w13`` (E, 2 I, H) and ``w2`` (E, H, I);
    under tensor parallelism I is this rank's slice of every expert's intermediate size.

    Loading: checkpoints store experts one by one (``experts.{e}.gate_proj.weight``, ...);
    ``load_named_weights`` finds names matching ``<path>.experts.<e>.<proj>.weight`` and
    calls ``load_expert_weight(e, proj, tensor)``, which copies the tensor into its slice
    and returns the key ``"<param>:<e>.<shard>"`` it filled. ``checkpoint_shards(param)``
    lists every key a complete checkpoint fills, so a missing expert tensor is reported.

    After loading, ``pack_expert_weights`` may replace the stacked weights by one packed
    weight per expert and projection (``packed``; ``w13`` and ``w2`` are then None): the
    experts then run ``grouped_by_expert`` through them, whatever ``computation`` says.
    """

    packed: tuple[list[PackedWeight], list[PackedWeight]] | None = None

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int,
        computation: ExpertsComputation = grouped_experts_torch, reduce: bool = True,
    ):
        """``reduce`` False leaves the sum of the ranks' parts to the caller."""
        super().__init__()
        self.reduce = reduce
        self.tp = tensor_parallel.current()  # each rank: a slice of every expert's I
        self.shard_start, self.intermediate_size = self.tp.part(
            intermediate_size, "MoE expert intermediate size")
        self.full_intermediate_size = intermediate_size
        self.num_experts = num_experts
        i = self.intermediate_size
        # Filled by the loader; empty (not initialised) avoids work for large models.
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * i, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, i))
        self.computation = computation

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """x (T, H), topk_weights (T, k), topk_ids (T, k) -> (T, H), summed over the
        ranks' slices (if ``reduce``)."""
        if self.packed is None:
            out = self.computation(x, self.w13, self.w2, topk_weights, topk_ids)
        else:
            gate_up, down = self.packed
            out = grouped_by_expert(x, topk_weights, topk_ids, self.num_experts,
                                    lambda expert, rows: gate_up[expert].matmul(rows),
                                    lambda expert, hidden: down[expert].matmul(hidden))
        return self.tp.all_reduce(out) if self.reduce else out

    def pack_expert_weights(self, packer: Callable[[torch.Tensor], PackedWeight]) -> int:
        """Replaces ``w13`` and ``w2`` by ``packer`` of each expert's (out, in) projection
        weight; returns the packed weights' bytes."""
        gate_up = [packer(self.w13[expert].detach()) for expert in range(self.num_experts)]
        down = [packer(self.w2[expert].detach()) for expert in range(self.num_experts)]
        self.packed = (gate_up, down)
        self.w13 = self.w2 = None
        return sum(weight.nbytes() for weight in gate_up + down)

    def _shard_rows(self, shard: str) -> slice:
        i = self.intermediate_size
        return {"gate": slice(0, i), "up": slice(i, 2 * i), "down": slice(None)}[shard]

    def checkpoint_shards(self, param_name: str) -> list[str]:
        """The per-expert shards a complete checkpoint writes into ``param_name``."""
        shards = ("gate", "up") if param_name == "w13" else ("down",)
        return [f"{e}.{shard}" for e in range(self.num_experts) for shard in shards]

    def load_expert_weight(self, expert_id: int, proj: str, tensor: torch.Tensor) -> str:
        """Copies checkpoint tensor ``experts.{expert_id}.{proj}.weight`` into its slice;
        returns the key it filled, ``"w13:3.gate"``. Raises ``ValueError`` on an unknown
        projection, an expert id out of range or a shape mismatch."""
        if proj not in EXPERT_PROJECTIONS:
            raise ValueError(
                f"unknown expert projection {proj!r}; known: {sorted(EXPERT_PROJECTIONS)}"
            )
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert id {expert_id} out of range [0, {self.num_experts})")
        param_name, shard = EXPERT_PROJECTIONS[proj]
        target = getattr(self, param_name)[expert_id, self._shard_rows(shard)]
        i, start = self.full_intermediate_size, self.shard_start
        full = (target.shape[0], i) if shard == "down" else (i, target.shape[1])
        if tuple(tensor.shape) != full:
            raise ValueError(
                f"expert {expert_id} {proj}: expected shape {full}, got {tuple(tensor.shape)}"
            )
        # This rank's slice of the intermediate dimension: rows of gate/up, columns of down.
        count = self.intermediate_size
        tensor = tensor[:, start : start + count] if shard == "down" else tensor[
            start : start + count]
        with torch.no_grad():
            target.copy_(tensor)
        return f"{param_name}:{expert_id}.{shard}"
