"""The hierarchical cache's options: their checks (light: the CLI's parser reads them).

Names are SGLang's (``--enable-hierarchical-cache``, ``--hicache-ratio``, ``--hicache-size``,
``--hicache-write-policy``, ``--hicache-storage-backend``); the disk tier's directory,
capacity and the tiers' block size are ours (SGLang's file backend takes its directory
from the environment). The default write policy is ``write_back`` (SGLang's is
``write_through``): a prefix costs the host tier a copy only once the device pool gives it up.
"""

from __future__ import annotations

GB = 1 << 30
WRITE_POLICIES = ("write_back", "write_through")
STORAGE_BACKENDS = ("file",)


def check_hicache_options(args) -> None:
    """Raises ``ValueError`` naming the option that is out of range or does not combine
    (``args``: the ``ServerArgs``)."""
    if args.hicache_write_policy not in WRITE_POLICIES:
        raise ValueError(f"hicache_write_policy must be one of {WRITE_POLICIES}, "
                         f"got {args.hicache_write_policy!r}")
    if args.hicache_storage_backend not in (None, *STORAGE_BACKENDS):
        raise ValueError(f"hicache_storage_backend must be one of {STORAGE_BACKENDS} (or "
                         f"unset), got {args.hicache_storage_backend!r}")
    for name in ("hicache_ratio", "hicache_storage_size"):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a number > 0, got {value!r}")
    size = args.hicache_size
    if isinstance(size, bool) or not isinstance(size, (int, float)) or size < 0:
        raise ValueError(f"hicache_size must be a number of GB >= 0, got {size!r}")
    block = args.hicache_block_tokens
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or (
            block % args.page_size):
        raise ValueError(f"hicache_block_tokens must be a positive multiple of page_size "
                         f"({args.page_size}), got {block!r}")
    if not args.enable_hierarchical_cache:
        if args.hicache_storage_backend is not None:
            raise ValueError("hicache_storage_backend needs enable_hierarchical_cache")
        return
    if args.disable_radix_cache:
        raise ValueError("enable_hierarchical_cache needs the radix cache (not "
                         "disable_radix_cache)")


def host_tier_blocks(args, bytes_per_token: int, pool_tokens: int) -> int:
    """The host tier's capacity in blocks: ``hicache_size`` GB, else ``hicache_ratio`` times
    the device pool (``pool_tokens``); every tensor-parallel rank counts the same."""
    block = args.hicache_block_tokens
    if args.hicache_size:
        capacity = int(args.hicache_size * GB) // (bytes_per_token * block)
    else:
        capacity = int(args.hicache_ratio * pool_tokens) // block
    return max(capacity, 1)
