"""LoRA adapters applied in the forward pass: every adapter of a batch at once, beside the
base projection computed once for all rows.

Each adapted projection of the model (``Linear.lora``) holds a ``LoraProjection``: for every
device slot of the adapter pool, the adapter's A and B of that projection, zero-padded to
the pool's rank R (an adapter of rank r < R, or one that does not adapt this projection,
contributes exactly what it should: zero columns add nothing). A stacked projection (q|k|v,
gate|up) keeps its shards' A matrices stacked, so one shrink serves all shards:

    A: (slots, shards * R, in)      B[shard]: (slots, shard rows, R)    scaling: (slots, shards)

A pass's rows come in segments, each of one adapter slot (or none: -1), described by the
``LoraBatch`` the runner puts in the shared ``LoraState`` around the pass; each projection
then adds ``scaling * B (A x)`` per segment (``kernels/triton_ops/lora_sgmv``: Triton on
GPUs); on a CPU per adapter instead, its rows gathered whatever segments they lie in, in
float32 (one shrink and one product per shard it adapts: a batch of 16 adapters takes 16,
not one per request), skipping the shards an adapter leaves alone. Under tensor
parallelism (not served yet: refused at start-up) a column-parallel projection would keep A
whole and its rows of B, a row-parallel one its columns of A and B whole, so that each rank
adds ``B (A_rank x_rank)`` to its partial sum and the ranks' all-reduce adds them up.

Invariant: a slot's weights are written only while no pass uses the slot (the adapter
pool loads a slot before the batch that uses it is built).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixlm.kernels.triton_ops.lora_sgmv import lora_expand, lora_shrink
from radixlm.models.lora.peft_adapter import LoraAdapter


@dataclass
class LoraBatch:
    """A pass's rows by adapter slot: segment g is rows [starts[g], starts[g] + lens[g])
    of slot ``slots[g]`` (-1: no adapter); tensors (G,) on the model's device."""

    starts: torch.Tensor
    lens: torch.Tensor
    slots: torch.Tensor
    max_len: int
    rows_by_slot: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """(slot, its rows (int64, on the model's device)) of each adapter in the pass: the
    CPU path's groups (one pair of products per adapter, however its rows interleave);
    empty: taken from the segments when needed."""

    def groups(self) -> list[tuple[int, torch.Tensor]]:
        if not self.rows_by_slot:
            self.rows_by_slot = rows_by_slot(self.starts.tolist(), self.lens.tolist(),
                                             self.slots.tolist(), self.starts.device)
        return self.rows_by_slot


def rows_by_slot(starts: list[int], lens: list[int], slots: list[int],
                 device: torch.device) -> list[tuple[int, torch.Tensor]]:
    """Each adapter slot's rows, from segments (start, length, slot; slot -1: none)."""
    rows: dict[int, list[int]] = {}
    for start, length, slot in zip(starts, lens, slots):
        if slot >= 0:
            rows.setdefault(slot, []).extend(range(start, start + length))
    return [(slot, torch.tensor(found, dtype=torch.int64, device=device))
            for slot, found in rows.items()]


class LoraState:
    """What every ``LoraProjection`` of a model reads: the batch of the pass under way
    (None: no adapter in it, and the projections add nothing)."""

    def __init__(self) -> None:
        self.batch: LoraBatch | None = None
        self.projections: list[LoraProjection] = []
        """Every projection reading this state (``attach_lora``), for loading slots."""


class LoraProjection:
    """One projection's adapter weights in every slot (see the module)."""

    def __init__(self, state: LoraState, layer: int, shards: list[tuple[str, int, int]],
                 in_features: int, slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device):
        """``shards``: (checkpoint projection name, first output row, rows) per shard."""
        self.state, self.layer, self.shards = state, layer, shards
        self.rank = max_rank
        if device.type == "cpu":  # small products: float32 is the fast and exact one here
            dtype = torch.float32
        self.scales: list[list[float]] = [[0.0] * len(shards) for _ in range(slots)]
        """``scaling`` on the host: shards a slot's adapter leaves alone are skipped."""
        self.a = torch.zeros((slots, len(shards) * max_rank, in_features), dtype=dtype,
                             device=device)
        self.b = [torch.zeros((slots, rows, max_rank), dtype=dtype, device=device)
                  for _, _, rows in shards]
        self.scaling = torch.zeros((slots, len(shards)), dtype=torch.float32, device=device)

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Writes ``adapter``'s weights of this projection into ``slot`` (zeros where it
        does not adapt a shard)."""
        r_max = self.rank
        self.a[slot].zero_()
        self.scaling[slot].zero_()
        for i, (name, _, _) in enumerate(self.shards):
            self.b[i][slot].zero_()
            found = adapter.weights.get((self.layer, name))
            if found is None:
                continue
            a, b = found  # (r, in), (out, r)
            r = a.shape[0]
            self.a[slot, i * r_max : i * r_max + r] = a
            self.b[i][slot, :, :r] = b
            self.scaling[slot, i] = adapter.scaling(self.layer, name)
        self.scales[slot] = self.scaling[slot].tolist()

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y (T, out) += each row's adapter's term for x (T, in), in place."""
        batch = self.state.batch
        if batch is None:
            return
        if not x.is_cuda:  # (torch's products, even under Triton's interpreter)
            self._add_by_adapter(x, y, batch)
            return
        xa = lora_shrink(x, self.a, batch.starts, batch.lens, batch.slots,
                         max_seg_len=batch.max_len, use_triton=True)  # (T, shards * R)
        r = self.rank
        for i, (_, offset, _) in enumerate(self.shards):
            lora_expand(xa[:, i * r : (i + 1) * r], self.b[i], batch.starts, batch.lens,
                        batch.slots, self.scaling[:, i], y, out_offset=offset,
                        max_seg_len=batch.max_len, use_triton=True)

    def _add_by_adapter(self, x: torch.Tensor, y: torch.Tensor, batch: LoraBatch) -> None:
        """The CPU path: per adapter of the pass, its rows' shrink in one product (float32)
        and each shard it adapts in another, added into its rows of ``y``."""
        r = self.rank
        for slot, rows in batch.groups():
            scales = self.scales[slot]
            if not any(scales):
                continue
            xa = x.index_select(0, rows).float() @ self.a[slot].T  # (n, shards * R)
            for i, (_, offset, size) in enumerate(self.shards):
                if scales[i]:
                    term = (xa[:, i * r : (i + 1) * r] @ self.b[i][slot].T).mul_(scales[i])
                    y[:, offset : offset + size].index_add_(0, rows, term.to(y.dtype))


def attach_lora(model, state: LoraState, slots: int, max_rank: int,
                target_modules: frozenset[str], dtype: torch.dtype,
                device: torch.device) -> dict[str, tuple[int, int]]:
    """Gives each adaptable projection of ``model``'s decoder layers named (by its
    checkpoint names) in ``target_modules`` a ``LoraProjection`` of ``slots`` slots of
    rank ``max_rank``; returns the (out, in) shape of every adaptable projection the model
    has, by checkpoint name (what adapters are checked against). One rank only: under
    tensor parallelism each rank would slice A or B by its share (see the module)."""
    shapes: dict[str, tuple[int, int]] = {}
    stacked = getattr(model, "stacked_params", {})
    by_module: dict[str, list[str]] = {}
    for name, (module, _) in stacked.items():
        by_module.setdefault(module, []).append(name)
    for layer_id, layer in enumerate(model.layers):
        for block_name in ("self_attn", "mlp"):
            block = getattr(layer, block_name, None)
            for module_name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                linear = getattr(block, module_name, None)
                if linear is None or not hasattr(linear, "lora"):
                    continue
                shards = _shards(linear, module_name, by_module, stacked)
                for name, _, rows in shards:
                    shapes[name] = (rows, linear.in_features)
                if any(name in target_modules for name, *_ in shards):
                    linear.lora = LoraProjection(state, layer_id, shards, linear.in_features,
                                                 slots, max_rank, dtype, device)
                    state.projections.append(linear.lora)
    return shapes


def _shards(linear, module_name: str, by_module: dict[str, list[str]],
            stacked: dict[str, tuple[str, str]]) -> list[tuple[str, int, int]]:
    """(checkpoint name, output offset, rows) of each shard of ``linear`` (one: a
    projection that is not stacked)."""
    names = by_module.get(module_name)
    if not names:
        return [(module_name, 0, linear.out_features)]
    return [(name, *linear.shard_offsets[stacked[name][1]]) for name in names]
