"""The LoRA options: their checks and the adapters named at start-up (light: the CLI's
parser reads them).

Names are SGLang's: ``--enable-lora``, ``--lora-paths name=path ...``,
``--max-loras-per-batch``, ``--max-lora-rank``, ``--lora-target-modules``.
"""

from __future__ import annotations

import re

from radixlm.models.lora.projections import PROJECTIONS

ADAPTER_NAME = re.compile(r"^[A-Za-z0-9/.][A-Za-z0-9._\-/]{0,255}$")
DEFAULT_MAX_RANK = 16
"""The highest rank served when neither ``max_lora_rank`` nor a start-up adapter says."""


def check_lora_options(args) -> None:
    """Raises ``ValueError`` naming the option that is out of range;
    turns ``enable_lora`` on where ``lora_paths`` are given."""
    if args.lora_paths:
        args.enable_lora = True
        if isinstance(args.lora_paths, str):
            args.lora_paths = [args.lora_paths]
        parse_lora_paths(args.lora_paths)
    batch = args.max_loras_per_batch
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= 256:
        raise ValueError(f"max_loras_per_batch must be an integer in 1..256, got {batch!r}")
    rank = args.max_lora_rank
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)
                             or not 1 <= rank <= 512):
        raise ValueError(f"max_lora_rank must be an integer in 1..512, got {rank!r}")
    targets = args.lora_target_modules
    if targets is not None:
        if isinstance(targets, str):
            targets = args.lora_target_modules = [targets]
        if targets == ["all"]:
            args.lora_target_modules = None
        elif not targets or not set(targets) <= set(PROJECTIONS):
            raise ValueError(f"lora_target_modules must name projections among "
                             f"{list(PROJECTIONS)} (or 'all'), got {targets}")


def parse_lora_paths(entries: list[str]) -> dict[str, str]:
    """``name=path`` entries (or a bare path, named by itself) -> {name: path}."""
    found: dict[str, str] = {}
    for entry in entries:
        if not isinstance(entry, str) or not entry:
            raise ValueError(f"lora_paths entries must be 'name=path' strings, got {entry!r}")
        name, sep, path = entry.partition("=")
        if not sep:
            name = path = entry
        check_adapter_name(name)
        if name in found:
            raise ValueError(f"lora_paths names adapter {name!r} twice")
        found[name] = path
    return found


def check_adapter_name(name) -> None:
    if not isinstance(name, str) or not ADAPTER_NAME.match(name):
        raise ValueError(f"an adapter name must be 1-256 letters, digits or ._-/ "
                         f"(not starting with _ or -), got {name!r}")
