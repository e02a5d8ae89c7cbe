"""The adapters a server holds: registered on the host, loaded into device slots by use.

Every registered adapter's weights stay on the host (``LoraAdapter``: read and checked when
registered). The model's adapted projections hold ``max_loras_per_batch`` device slots
(``models/lora/lora_layers.py``); a batch's adapters are put into slots when the batch is
built (``batch_for``), the least recently used slot that no adapter of the batch needs
giving way. The scheduler admits at most ``max_loras_per_batch`` distinct adapters into
the running batch, so a batch's adapters always fit.

An unfinished request keeps its adapter: unregistering one that requests still use takes
its name away from new requests at once, and its weights once none of them is left
(``purge``, which the scheduler calls with the adapters of its unfinished requests).

Under tensor parallelism rank 0's pool decides: each time it loads an adapter into a slot
it says so (``on_load``: the step sender tells the other ranks, which load the same adapter
from its path into the same slot, ``load_slot``), and a pass's segments name slots, so
every rank adds its share of the same adapters (``batch_of``).

Invariants: ``_slots[s]`` names the adapter whose weights slot s holds (None: empty), and
no adapter is in two slots; a name is registered or retired, never both.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from radixlm.host_to_device import to_device
from radixlm.models.lora.lora_layers import AdapterGroups, LoraBatch, LoraState, attach_lora
from radixlm.models.lora.peft_adapter import LoraAdapter, adapter_rank, load_peft_adapter
from radixlm.models.lora.projections import PROJECTIONS
from radixlm.runtime.lora_options import DEFAULT_MAX_RANK, check_adapter_name, parse_lora_paths

RANK_ADAPTERS_PER_SLOT = 4
"""Another rank keeps at most this many adapters a slot read (the rest read again)."""


class LoraAdapterPool:
    """Adapters by name, and the model's device slots for them (see the module)."""

    def __init__(self, model, num_layers: int, slots: int, max_rank: int | None,
                 target_modules: list[str] | None, lora_paths: list[str] | None,
                 dtype: torch.dtype, device: torch.device):
        startup = parse_lora_paths(lora_paths or [])
        targets = frozenset(target_modules or PROJECTIONS)
        self.num_layers, self.device = num_layers, device
        self.state = LoraState()
        self.slots = slots
        self._slots: list[str | None] = [None] * slots
        self._recent: OrderedDict[int, None] = OrderedDict((s, None) for s in range(slots))
        self._adapters: dict[str, LoraAdapter] = {}
        self._retired: dict[str, LoraAdapter] = {}
        """Unregistered adapters that requests still use."""
        self.on_load: Callable[[int, LoraAdapter], None] | None = None
        """Called with (slot, adapter) before a batch's adapter is loaded into a slot."""
        if max_rank is None:  # the highest start-up rank (read from their configs)
            max_rank = max([DEFAULT_MAX_RANK, *(adapter_rank(path)
                                                for path in startup.values())])
        self.max_rank = max_rank
        self.shapes = attach_lora(model, self.state, slots, max_rank, targets, dtype, device)
        if not self.shapes:
            raise ValueError("this model has no projection LoRA adapters can adapt")
        self.targets = targets & frozenset(self.shapes)
        for name, path in startup.items():
            self.register(name, path)

    # Registration -----------------------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(self._adapters)

    def register(self, name: str, path: str) -> LoraAdapter:
        """Reads, checks and registers the adapter at ``path`` as ``name`` (ValueError
        naming what is wrong: the name taken, the files, the rank, the modules)."""
        check_adapter_name(name)
        if name in self._adapters:
            raise ValueError(f"an adapter named {name!r} is loaded already")
        if name in self._retired:
            raise ValueError(f"adapter {name!r} was unloaded but requests still run on it; "
                             f"load it again once they end")
        adapter = load_peft_adapter(name, path, self.max_rank, self.num_layers, self.shapes,
                                    self.targets)
        self._adapters[name] = adapter
        return adapter

    def unregister(self, name: str, in_use: set[str]) -> bool:
        """Takes ``name`` away from new requests; its weights go now, or once none of
        the unfinished requests use it (``in_use``: their adapters). True: still in use."""
        if name not in self._adapters:
            raise ValueError(f"no adapter named {name!r} is loaded")
        self._retired[name] = self._adapters.pop(name)
        self.purge(in_use)
        return name in self._retired

    def purge(self, in_use: set[str]) -> None:
        """Drops the retired adapters none of ``in_use`` names."""
        for name in [n for n in self._retired if n not in in_use]:
            del self._retired[name]
            for slot, held in enumerate(self._slots):
                if held == name:
                    self._slots[slot] = None

    @property
    def retiring(self) -> bool:
        return bool(self._retired)

    # Requests ------------------------------------------------------------------------------------

    def has(self, name: str) -> bool:
        return name in self._adapters

    def check(self, name: str) -> None:
        """ValueError unless new requests may use ``name``."""
        if name not in self._adapters:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded (loaded: "
                             f"{self.names()})")

    def cache_namespace(self, name: str, extra_key: str | None) -> str:
        """The prefix-cache namespace of a request under adapter ``name`` and the client's
        ``extra_key``: the adapter's weights (not its name: a name may be loaded again
        with others) apart from every client key (which cannot hold a NUL)."""
        return f"{extra_key or ''}\x00lora:{self._adapters[name].fingerprint}"

    # Batches -------------------------------------------------------------------------------------

    def batch_for(self, names: list[str | None], rows: list[int]) -> LoraBatch | None:
        """The ``LoraBatch`` of a pass whose requests, in order, use adapters ``names`` (None:
        none) over ``rows`` consecutive rows each; None where no request uses one. Loads the
        batch's adapters into slots first."""
        if not any(names):
            return None
        slot_of = self._place({name for name in names if name})
        starts, lens, slots, start = [], [], [], 0
        for name, count in zip(names, rows):
            slot = slot_of[name] if name else -1
            if slots and slots[-1] == slot and starts[-1] + lens[-1] == start:
                lens[-1] += count  # the same adapter as the request before: one segment
            else:
                starts.append(start)
                lens.append(count)
                slots.append(slot)
            start += count
        return self.batch_of(starts, lens, slots)

    def batch_of(self, starts: list[int], lens: list[int], slots: list[int]) -> LoraBatch:
        """The ``LoraBatch`` of segments (start, length, slot; -1: none) of slots loaded."""
        table = to_device([starts, lens, slots], torch.int32, self.device)
        groups = (AdapterGroups.of(starts, lens, slots)
                  if self.device.type == "cpu" else None)  # (the CPU path's, from host lists)
        return LoraBatch(table[0], table[1], table[2], max(lens), (starts, lens, slots), groups)

    def _place(self, wanted: set[str]) -> dict[str, int]:
        """A slot for each adapter of ``wanted`` (at most ``slots`` of them), loading those
        not in one into the least recently used slots the others do not hold."""
        if len(wanted) > self.slots:
            raise RuntimeError(f"{len(wanted)} adapters in one batch, above "
                               f"max_loras_per_batch {self.slots}")
        found = {name: slot for slot, name in enumerate(self._slots) if name in wanted}
        for name in wanted - set(found):
            slot = next(s for s in self._recent if self._slots[s] not in wanted)
            adapter = self._adapters.get(name) or self._retired[name]
            if self.on_load is not None:
                self.on_load(slot, adapter)
            self._write_slot(slot, adapter)
            found[name] = slot
        for slot in found.values():
            self._recent.move_to_end(slot)
        return found

    def _write_slot(self, slot: int, adapter: LoraAdapter) -> None:
        for projection in self.state.projections:
            projection.load(slot, adapter)
        self._slots[slot] = adapter.name

    def load_slot(self, slot: int, name: str, path: str, fingerprint: str) -> None:
        """Another rank's side of rank 0's ``on_load``: adapter ``name`` from ``path`` into
        ``slot`` (read again unless held under that name with that ``fingerprint``);
        ValueError where the files at ``path`` are no longer what rank 0 read."""
        adapter = self._adapters.get(name)
        if adapter is None or adapter.fingerprint != fingerprint:
            adapter = load_peft_adapter(name, path, self.max_rank, self.num_layers,
                                        self.shapes, self.targets)
            if adapter.fingerprint != fingerprint:
                raise ValueError(f"adapter {name!r} at {path} changed since rank 0 read it")
            self._adapters.pop(name, None)
            self._adapters[name] = adapter  # (kept: the next use of the name loads no file)
            idle = [n for n in self._adapters if n not in self._slots and n != name]
            for stale in idle[: max(0, len(self._adapters) - RANK_ADAPTERS_PER_SLOT * self.slots)]:
                del self._adapters[stale]  # (the least recently read first)
        self._write_slot(slot, adapter)

    def stats(self) -> dict:
        return {"adapters": self.names(), "retiring": sorted(self._retired),
                "slots": list(self._slots), "max_loras_per_batch": self.slots,
                "max_lora_rank": self.max_rank}
