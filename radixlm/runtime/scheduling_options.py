"""The scheduling options' checks: the batching mode, the order of the waiting queue, prompt
chunks and the new-token ratios admission reserves by (light: the CLI's parser reads them).
"""

from __future__ import annotations

from radixlm.runtime.option_checks import check_positive

BATCHING_MODES = ("continuous", "static")
SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs", "lof", "random")


def check_scheduling_options(args) -> None:
    """Raises ``ValueError`` naming the option that is out of range (``args``: the
    ``ServerArgs``, its ``chunked_prefill_size`` of -1 already read as None)."""
    names = ["max_prefill_tokens"]
    names += [name for name in ("chunked_prefill_size", "chunked_prefill_step_ms")
              if getattr(args, name) is not None]
    for name in names:
        check_positive(name, getattr(args, name))
    if args.schedule_policy not in SCHEDULE_POLICIES:
        raise ValueError(
            f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {args.schedule_policy!r}")
    if args.batching not in BATCHING_MODES:
        raise ValueError(f"batching must be one of {BATCHING_MODES}, got {args.batching!r}")
    for name in ("init_new_token_ratio", "min_new_token_ratio"):
        if not 0.0 < getattr(args, name) <= 1.0:
            raise ValueError(f"{name} must be in (0, 1], got {getattr(args, name)}")
    if not 0.0 <= args.new_token_ratio_decay < 1.0:
        raise ValueError(
            f"new_token_ratio_decay must be in [0, 1), got {args.new_token_ratio_decay}")
