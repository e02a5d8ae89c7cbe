"""LoRA adapters applied in the forward pass: every adapter of a batch at once, beside the
base projection computed once for all rows.

Each adapted projection of the model (``Linear.lora``) holds a ``LoraProjection``: for every
device slot of the adapter pool, the adapter's A and B of that projection, in the model's
dtype, zero-padded to the pool's rank R (an adapter of rank r < R, or one that does not
adapt a shard, contributes exactly what it should: zeros add nothing, and the kernels read
only an adapter's own r). A stacked projection (q|k|v, gate|up) keeps its shards' A
matrices stacked, so one shrink serves all shards, and B transposed over all its output
columns, each shard's columns holding that shard's B:

    a: (slots, shards * R, in)     b_t: (slots, R, out)     scaling: (slots, shards)
    ranks: (slots, shards), each slot's rank in each shard (0: not adapted), on the host

A pass's rows come in segments, each of one adapter slot (or none: -1), described by the
``LoraBatch`` the runner puts in the shared ``LoraState`` around the pass; each projection
then adds ``scaling * B (A x)`` for the rows that use an adapter. On GPUs per segment
(``kernels/triton_ops/lora_sgmv``: Triton). On CPUs per adapter, its rows gathered whatever
segments they lie in, every adapter of the pass in one call of the fused kernels'
``lora_add`` (``kernels/cpu_ops/lora_matmul.cpp``: float32 sums, each adapter's weights read
once), which the fused decode layers call too, so a decode step with adapters runs fused
and equals the module path to the bit; without the kernels, torch's products in float32.
Under tensor parallelism each rank holds its share of each projection's adapters: a
column-parallel projection (q|k|v, gate|up: its heads, its rows of the MLP) A whole and its
rows of B (``LoraShard.first_row``); a row-parallel one (o, down) its columns of A
(``in_start``) and B whole, so that each rank adds ``B (A_rank x_rank)`` to its partial
sum and the ranks' all-reduce adds them up.

Invariant: a slot's weights are written only while no pass uses the slot (the adapter
pool loads a slot before the batch that uses it is built).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.kernels.triton_ops.lora_sgmv import lora_expand, lora_shrink
from radixlm.models.lora.peft_adapter import LoraAdapter


@dataclass(frozen=True)
class LoraShard:
    """A shard of an adapted projection: checkpoint projection ``name``'s rows
    [first_row, first_row + rows) (first_row > 0: another rank holds the rows before) are
    the projection's output columns [offset, offset + rows) here."""

    name: str
    offset: int
    rows: int
    first_row: int = 0


@dataclass(frozen=True)
class AdapterGroups:
    """A pass's rows grouped by adapter slot, as the CPU kernels' ``lora_add`` takes them:
    group g is rows ``rows[starts[g]:starts[g + 1]]`` of slot ``slots[g]`` (int64, host)."""

    rows: torch.Tensor
    starts: torch.Tensor
    slots: torch.Tensor

    @classmethod
    def of(cls, starts: list[int], lens: list[int], slots: list[int]) -> AdapterGroups:
        """The groups of segments (start, length, slot; slot -1: none)."""
        rows: dict[int, list[int]] = {}
        for start, length, slot in zip(starts, lens, slots):
            if slot >= 0:
                rows.setdefault(slot, []).extend(range(start, start + length))
        bounds = [0]
        for found in rows.values():
            bounds.append(bounds[-1] + len(found))
        return cls(torch.tensor([r for found in rows.values() for r in found],
                                dtype=torch.int64),
                   torch.tensor(bounds, dtype=torch.int64),
                   torch.tensor(list(rows), dtype=torch.int64))

    def each(self) -> list[tuple[int, torch.Tensor]]:
        """(slot, its rows) of each group."""
        bounds = self.starts.tolist()
        return [(slot, self.rows[bounds[g] : bounds[g + 1]])
                for g, slot in enumerate(self.slots.tolist())]


@dataclass
class LoraBatch:
    """A pass's rows by adapter slot: segment g is rows [starts[g], starts[g] + lens[g])
    of slot ``slots[g]`` (-1: no adapter); tensors (G,) on the model's device."""

    starts: torch.Tensor
    lens: torch.Tensor
    slots: torch.Tensor
    max_len: int
    on_host: tuple[list[int], list[int], list[int]]
    """The same segments (starts, lens, slots) as host lists."""
    by_adapter: AdapterGroups | None = None
    """The CPU path's groups (one an adapter, however its rows interleave); None: taken
    from the segments when first needed."""

    def groups(self) -> AdapterGroups:
        if self.by_adapter is None:
            self.by_adapter = AdapterGroups.of(*self.on_host)
        return self.by_adapter


class LoraState:
    """What every ``LoraProjection`` of a model reads: the batch of the pass under way
    (None: no adapter in it, and the projections add nothing)."""

    def __init__(self) -> None:
        self.batch: LoraBatch | None = None
        self.projections: list[LoraProjection] = []
        """Every projection reading this state (``attach_lora``), for loading slots."""


class LoraProjection:
    """One projection's adapter weights in every slot (see the module)."""

    def __init__(self, state: LoraState, layer: int, shards: list[LoraShard],
                 in_features: int, out_features: int, slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, in_start: int = 0):
        """``shards``: in order, together the ``out_features`` columns; ``in_start``: the
        first checkpoint input column of the ``in_features`` here (a row-parallel
        projection's share)."""
        self.state, self.layer, self.shards = state, layer, shards
        self.rank, self.in_start = max_rank, in_start
        self.a = torch.zeros((slots, len(shards) * max_rank, in_features), dtype=dtype,
                             device=device)
        self.b_t = torch.zeros((slots, max_rank, out_features), dtype=dtype, device=device)
        self.scaling = torch.zeros((slots, len(shards)), dtype=torch.float32, device=device)
        self.ranks = torch.zeros((slots, len(shards)), dtype=torch.int64)
        self.bounds = torch.tensor([shard.offset for shard in shards] + [out_features],
                                   dtype=torch.int64)
        """Each shard's first column, then ``out_features`` (host)."""
        self.scales: list[list[float]] = [[0.0] * len(shards) for _ in range(slots)]
        """``scaling`` on the host: shards a slot's adapter leaves alone are skipped."""

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Writes ``adapter``'s weights of this projection into ``slot`` (zeros where it
        does not adapt a shard)."""
        r_max = self.rank
        self.a[slot].zero_()
        self.b_t[slot].zero_()
        self.scaling[slot].zero_()
        self.ranks[slot].zero_()
        columns = slice(self.in_start, self.in_start + self.a.shape[2])  # (this rank's inputs)
        for i, shard in enumerate(self.shards):
            found = adapter.weights.get((self.layer, shard.name))
            if found is None:
                continue
            a, b = found  # (r, in), (out, r): the checkpoint projection's whole
            r = a.shape[0]
            self.a[slot, i * r_max : i * r_max + r] = a[:, columns]
            rows = b[shard.first_row : shard.first_row + shard.rows]
            self.b_t[slot, :r, shard.offset : shard.offset + shard.rows] = rows.T
            self.scaling[slot, i] = adapter.scaling(self.layer, shard.name)
            self.ranks[slot, i] = r
        self.scales[slot] = self.scaling[slot].tolist()

    def kernel_operands(self) -> list[torch.Tensor]:
        """This projection's operands of the CPU kernels' ``lora_add`` (a, b_t, scaling,
        ranks, bounds)."""
        return [self.a, self.b_t, self.scaling, self.ranks, self.bounds]

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y (T, out) += each row's adapter's term for x (T, in), in place."""
        batch = self.state.batch
        if batch is None:
            return
        if not x.is_cuda:  # (torch's products, even under Triton's interpreter)
            kernels = fused_ops.for_tensor(x)
            if kernels is not None and x.stride(-1) == 1 and y.is_contiguous():
                groups = batch.groups()
                kernels.lora_add(x, y, groups.rows, groups.starts, groups.slots,
                                 *self.kernel_operands())
            else:
                self._add_by_adapter(x, y, batch.groups())
            return
        xa = lora_shrink(x, self.a, batch.starts, batch.lens, batch.slots,
                         max_seg_len=batch.max_len, use_triton=True)  # (T, shards * R)
        r = self.rank
        for i, shard in enumerate(self.shards):
            columns = slice(shard.offset, shard.offset + shard.rows)
            b = self.b_t[:, :, columns].transpose(1, 2)  # (slots, rows, R)
            lora_expand(xa[:, i * r : (i + 1) * r], b, batch.starts, batch.lens,
                        batch.slots, self.scaling[:, i], y, out_offset=shard.offset,
                        max_seg_len=batch.max_len, use_triton=True)

    def _add_by_adapter(self, x: torch.Tensor, y: torch.Tensor, groups: AdapterGroups) -> None:
        """The CPU path without the kernels: per adapter of the pass, its rows' shrink in one
        float32 product and each shard it adapts in another, added into its rows of ``y``."""
        r = self.rank
        for slot, rows in groups.each():
            scales = self.scales[slot]
            if not any(scales):
                continue
            xa = x.index_select(0, rows).float() @ self.a[slot].float().T  # (n, shards * R)
            for i, shard in enumerate(self.shards):
                if scales[i]:
                    columns = slice(shard.offset, shard.offset + shard.rows)
                    b_t = self.b_t[slot, :, columns].float()  # (R, rows)
                    term = (xa[:, i * r : (i + 1) * r] @ b_t).mul_(scales[i])
                    y[:, columns].index_add_(0, rows, term.to(y.dtype))


def attach_lora(model, state: LoraState, slots: int, max_rank: int,
                target_modules: frozenset[str], dtype: torch.dtype,
                device: torch.device) -> dict[str, tuple[int, int]]:
    """Gives each adaptable projection of ``model``'s decoder layers named (by its
    checkpoint names) in ``target_modules`` a ``LoraProjection`` of ``slots`` slots of
    rank ``max_rank`` (this rank's share, under tensor parallelism); returns the (out, in)
    shape of every adaptable projection the model has, by checkpoint name, whole as in the
    checkpoint (what adapters are checked against)."""
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
                in_start = getattr(linear, "in_start", 0)  # (a row-parallel share)
                in_total = getattr(linear, "in_features_total", linear.in_features)
                totals = getattr(linear, "shard_totals", {})
                for shard in shards:
                    shapes[shard.name] = (totals.get(_stacked_shard(shard.name, stacked),
                                                     shard.rows), in_total)
                if any(shard.name in target_modules for shard in shards):
                    linear.lora = LoraProjection(state, layer_id, shards, linear.in_features,
                                                 linear.out_features, slots, max_rank, dtype,
                                                 device, in_start)
                    state.projections.append(linear.lora)
    return shapes


def _stacked_shard(name: str, stacked: dict[str, tuple[str, str]]) -> str:
    """The shard of its stacked projection that checkpoint projection ``name`` is."""
    return stacked[name][1] if name in stacked else name


def _shards(linear, module_name: str, by_module: dict[str, list[str]],
            stacked: dict[str, tuple[str, str]]) -> list[LoraShard]:
    """The shards of ``linear`` (one: a projection that is not stacked)."""
    names = by_module.get(module_name)
    if not names:
        return [LoraShard(module_name, 0, linear.out_features)]
    shards = []
    for name in names:
        shard = stacked[name][1]
        offset, rows = linear.shard_offsets[shard]
        shards.append(LoraShard(name, offset, rows, linear.shard_starts.get(shard, 0)))
    return shards
