"""Weight layouts by groups of 16 output features (columns of the product), for the fused
CPU kernels, and their inverses.

- Column pairs (``by_column_pairs``): (out / 16, in / 2, 16, 2), for each group of 16
  outputs and each pair of inputs the 16 outputs' two weights side by side: what the AVX-512
  BF16 dot products of ``pair_matmul`` and ``int8_pair_matmul`` take (a pair of inputs a
  lane).
- Column blocks (``by_column_blocks``): (out / 16, in, 16), for each group of 16 outputs and
  each input the 16 outputs' weights, contiguous: what ``blocked_matmul`` and
  ``blocked_int8_matmul`` widen once and multiply by several rows' input (float32 passes).

Invariant: each layout holds the weight's values unchanged, only moved;
``from_column_pairs`` and ``from_column_blocks`` give back the (out, in) weight.
"""

from __future__ import annotations

import torch

from radixlm.kernels.cpu_ops.fused_ops import BLOCK_COLUMNS, PAIR_COLUMNS


def fits_column_pairs(weight: torch.Tensor) -> bool:
    """Whether a (out, in) weight can be laid out by column pairs: out a multiple of 16, in
    even."""
    out_features, in_features = weight.shape
    return out_features % PAIR_COLUMNS == 0 and in_features % 2 == 0


def by_column_pairs(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) -> (out / 16, in / 2, 16, 2), contiguous."""
    out_features, in_features = weight.shape
    pairs = weight.view(out_features // PAIR_COLUMNS, PAIR_COLUMNS, in_features // 2, 2)
    return pairs.permute(0, 2, 1, 3).contiguous()


def gates_by_pairs(pairs: torch.Tensor) -> bool:
    """Whether weight pairs (``by_column_pairs``) can stand for a gate stacked over an up
    for the kernels' gated products: the two halves' boundary falls between groups of 16."""
    return pairs.dim() == 4 and pairs.shape[0] % 2 == 0


def from_column_pairs(pairs: torch.Tensor) -> torch.Tensor:
    """The (out, in) weight of ``by_column_pairs``' layout (a copy)."""
    groups, in_pairs = pairs.shape[:2]
    return pairs.permute(0, 2, 1, 3).reshape(groups * PAIR_COLUMNS, in_pairs * 2)


def fits_column_blocks(weight: torch.Tensor) -> bool:
    """Whether a (out, in) weight can be laid out in column blocks: out a multiple of 16."""
    return weight.shape[0] % BLOCK_COLUMNS == 0


def by_column_blocks(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) -> (out / 16, in, 16), contiguous: blocks[b, k, j] = weight[16 b + j, k].
    ValueError where out is not a multiple of 16."""
    out_features, in_features = weight.shape
    if not fits_column_blocks(weight):
        raise ValueError(f"weight must have a multiple of {BLOCK_COLUMNS} rows, "
                         f"not {out_features}")
    blocks = weight.reshape(out_features // BLOCK_COLUMNS, BLOCK_COLUMNS, in_features)
    return blocks.transpose(1, 2).contiguous()


def from_column_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """The (out, in) weight of ``by_column_blocks``' layout (a copy)."""
    count, in_features, columns = blocks.shape
    return blocks.transpose(1, 2).reshape(count * columns, in_features)
