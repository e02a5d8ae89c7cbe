"""The vocabulary split across tensor-parallel ranks: the token embedding and the LM head.

Each rank holds rows [start, start + count) of the (vocabulary, hidden) matrix, the
vocabulary padded up to a multiple of the ranks (padding rows are zero and their logits are
cut off). The embedding looks up the ids its rows cover, zeroes the others and sums over the
ranks (each token's row lives on exactly one); the LM head computes its rows' logits and
gathers every rank's to all of them. With one rank both are plain: a lookup and a matmul.
A checkpoint's matrix may be held only in its own packed format (GGUF blocks, ``take_packed``):
the lookup then decodes the rows it needs, and ``weight`` is None.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from radixlm.kernels.cpu_ops.execution_plan import TORCH_CHOICES, CpuExecutionPlan
from radixlm.models.layers import tensor_parallel
from radixlm.models.layers.weight_formats import PackedWeight, plain_matmul


class VocabParallelEmbedding(nn.Module):
    """A (vocab_size, hidden) matrix of which this rank holds its share of rows:
    ``forward`` embeds token ids, ``logits`` projects hidden states onto the vocabulary
    (through ``packed``, a weight-only copy of the matrix, when one was made)."""

    packed: PackedWeight | None = None
    dtype: torch.dtype = torch.float32
    """The lookups' dtype where the matrix is held only packed (``take_packed``)."""
    plan: CpuExecutionPlan = TORCH_CHOICES
    """The model's CPU plan (the loader sets it)."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp = tp = tensor_parallel.current()
        padded = -(-vocab_size // tp.size) * tp.size
        self.start, count = tp.part(padded, "padded vocabulary")
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(count, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (T,) -> (T, hidden), the same on every rank."""
        if self.weight is None:  # held only packed (one rank: ``take_packed``)
            return self.packed.rows(input_ids).to(self.dtype)
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        elsewhere = (local < 0) | (local >= self.weight.shape[0])  # (T,) another rank's row
        x = F.embedding(local.masked_fill(elsewhere, 0), self.weight)  # (T, hidden)
        return self.tp.all_reduce(x.masked_fill(elsewhere[:, None], 0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (N, hidden) -> float32 logits (N, vocab_size), on every rank (a
        collective: every rank calls it with the same rows)."""
        if self.packed is None:
            local = plain_matmul(hidden, self.weight,  # (N, vocab / tp)
                                 fused_rows=self.plan.float32_fused_rows)
        else:
            local = self.packed.matmul(hidden)
        if self.tp.size > 1:
            shares = [torch.empty_like(local) for _ in range(self.tp.size)]
            dist.all_gather(shares, local.contiguous(), group=self.tp.group)
            local = torch.cat(shares, dim=-1)[:, : self.vocab_size]
        return local.float()

    def pack_weight(self, packer) -> int:
        """Packs a copy of the weight for ``logits`` (lookups keep reading ``weight``, one
        row a token); returns its bytes."""
        self.packed = packer(self.weight.detach())
        return self.packed.nbytes()

    def take_packed(self, packed: PackedWeight, dtype: torch.dtype) -> int:
        """Holds ``packed``, the whole (vocab_size, hidden) matrix in a checkpoint's own
        format (which must offer ``rows(ids)``), instead of the weight, for both lookups
        (rows decoded into ``dtype``, the model's) and logits; one rank only. Returns its
        bytes."""
        if self.tp.size != 1 or self.weight.shape[0] != self.vocab_size:
            raise ValueError("a packed embedding is held whole, on one rank")
        self.packed, self.dtype = packed, dtype
        self.weight = None
        return packed.nbytes()

    def load_weight(self, param_name: str, tensor: torch.Tensor) -> None:
        """Copies this rank's rows of the checkpoint's (vocab_size, hidden) matrix."""
        full = (self.vocab_size, self.weight.shape[1])
        if tuple(tensor.shape) != full:
            raise ValueError(f"{param_name}: expected {full}, got {tuple(tensor.shape)}")
        rows = tensor[self.start : self.start + self.weight.shape[0]]
        with torch.no_grad():
            self.weight.zero_()
            self.weight[: len(rows)].copy_(rows)
