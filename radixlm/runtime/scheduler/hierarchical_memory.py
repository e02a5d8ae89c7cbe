"""Building the hierarchical prefix cache for a scheduler (``--enable-hierarchical-cache``):
the tiers' sizes from the options, and the identity its blocks carry.

The identity (``disk_kv_store.StoreIdentity``) is what the bytes of a block depend on: the
model (its resolved path, a hash of its config, the weight format), the KV dtype and layout
(the pool's buffers), the page and block sizes and the tokenizer (a hash of its vocabulary
and rules). A disk tier written under any other identity is ignored, and every block key
includes it, so no block computed by another model, dtype or tokenizer is ever loaded.

With tensor parallelism (rank 0's scheduler builds this) the identity is rank 0's, which
names the number of ranks too; each rank's disk tier is a directory of its own under
``hicache_storage_dir`` (``host_tier_ranks.rank_directory``), and the tiers report their
changes of host rows to the other ranks (``host_tier_ranks.HostTierLog``).
"""

from __future__ import annotations

import hashlib
import json
import os

from radixlm.kv_cache.disk_kv_store import DiskKVStore
from radixlm.kv_cache.hierarchical_cache import HierarchicalCache
from radixlm.kv_cache.host_kv_blocks import HostKVBlocks
from radixlm.kv_cache.kv_block_format import StoreIdentity
from radixlm.kv_cache.radix_tree import RadixCache
from radixlm.runtime.hicache_options import GB, host_tier_blocks
from radixlm.runtime.model_executor.host_tier_ranks import HostTierLog, rank_directory
from radixlm.runtime.model_executor.model_runner import ModelRunner
from radixlm.runtime.server_args import ServerArgs


def build_hierarchical_cache(args: ServerArgs, runner: ModelRunner, tree: RadixCache,
                             model_path: str, tokenizer) -> HierarchicalCache:
    """The tiers over ``tree`` (the runner's device pool) that ``args`` ask for."""
    if runner.window_layout is not None or not isinstance(tree, RadixCache):
        raise ValueError("enable_hierarchical_cache needs the plain KV pool and radix cache "
                         "(this model's sliding-window layers keep a hybrid pool)")
    pool, block, ranks = runner.kv_pool, args.hicache_block_tokens, args.tp_size
    identity = StoreIdentity.of_pool(
        pool, model=model_identity(model_path, runner), tokenizer=tokenizer_identity(tokenizer),
        page_size=args.page_size, block_tokens=block, tp_size=ranks)
    host = HostKVBlocks(pool, block, host_tier_blocks(args, pool.bytes_per_token(),
                                                      runner.max_total_tokens))
    log = None
    if runner.step_sender is not None:  # (the other ranks mirror the rows)
        log = host.mirror = runner.step_sender.host_tier = HostTierLog(runner.step_sender)
    disk = None
    if args.hicache_storage_backend == "file":
        disk = DiskKVStore(rank_directory(args.hicache_storage_dir, 0, ranks), identity,
                           int(args.hicache_storage_size * GB))
        if log is not None:
            log.opened(identity.fingerprint())
    cache = HierarchicalCache(tree, pool, host, disk, identity.fingerprint(),
                              write_through=args.hicache_write_policy == "write_through",
                              min_load_tokens=args.page_size)
    cache.warm_up()  # (in the background: a restarted server's recent prefixes to host)
    return cache


def model_identity(model_path: str, runner: ModelRunner) -> str:
    """The model's resolved path, a hash of its full config and its weight format."""
    config = runner.model_config.hf_config.to_dict()
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    return f"{os.path.realpath(model_path)}|{digest.hexdigest()[:16]}|{runner.weight_format}"


def tokenizer_identity(tokenizer) -> str:
    """A hash of the tokenizer's vocabulary and rules (a fast tokenizer's whole JSON)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = (backend.to_str() if backend is not None
            else json.dumps(sorted(tokenizer.get_vocab().items())))
    return hashlib.sha256(text.encode()).hexdigest()
