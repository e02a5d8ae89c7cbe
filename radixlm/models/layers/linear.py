"""Linear layers whose weight is several checkpoint tensors stacked along the output dim.

Fusing q/k/v (and gate/up) into one matmul saves a kernel launch and a read of the input
per layer. The checkpoint keeps them apart, so each stacked layer knows where each named
shard goes and loads it there.
"""

from __future__ import annotations

import torch
from torch import nn


class StackedLinear(nn.Linear):
    """``nn.Linear`` whose output rows are the concatenation of named shards.

    ``shard_sizes`` maps a shard name (e.g. "q", "k", "v") to its number of output rows, in
    the order they are stacked.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool):
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def load_shard(self, shard: str, param_name: str, tensor: torch.Tensor) -> None:
        """Copies checkpoint tensor ``tensor`` into the rows of ``shard`` of ``param_name``."""
        offset, size = self.shard_offsets[shard]
        target = getattr(self, param_name)
        if tensor.shape[0] != size or tensor.shape[1:] != target.shape[1:]:
            raise ValueError(
                f"shard {shard!r} of {param_name}: expected {(size, *target.shape[1:])}, "
                f"got {tuple(tensor.shape)}"
            )
        with torch.no_grad():
            target[offset : offset + size].copy_(tensor)
