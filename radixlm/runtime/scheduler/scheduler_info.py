"""What a scheduler reports of itself (``/server_info``): its counters, and a snapshot of its
pool, cache, queues and options."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class SchedulerStats:
    """Counters since the scheduler started."""

    forward_steps: int = 0
    extend_steps: int = 0
    decode_steps: int = 0
    """Steps that extend running requests (one token each, or their jumped tokens)."""
    jump_forward_steps: int = 0
    """Decode steps run as an extend because some request had jumped tokens."""
    overlapped_steps: int = 0
    """Decode steps queued behind the one in flight, fed its tokens on the device."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    retractions: int = 0
    spec_verify_steps: int = 0
    """Decode steps that verified draft tokens (speculative decoding)."""
    spec_drafted_requests: int = 0
    """Requests verified with a draft, summed over those steps."""
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_branch_tokens: int = 0
    """Accepted draft tokens off a token tree's main chain (they count in the above too)."""


def describe(scheduler) -> dict:
    """A ``Scheduler``'s pool, cache, queues, counters and options, as plain data (the
    scheduler is not imported here: it imports this module)."""
    runner, memory = scheduler.runner, scheduler.memory
    return {
        "context_length": runner.context_length,
        "max_total_tokens": runner.max_total_tokens,
        "kv_bytes_per_token": runner.kv_pool.bytes_per_token(),
        "kv_memory_budget_bytes": runner.kv_memory_budget,
        "free_kv_tokens": memory.allocator.available_size(),
        "cache_tokens": memory.tree_cache.total_size(),
        "cache_protected_tokens": memory.tree_cache.protected_size(),
        "peak_kv_tokens": scheduler.state.peak_kv_tokens,
        "request_rows": memory.req_to_token_pool.size,
        "free_request_rows": memory.req_to_token_pool.available_size(),
        "page_size": memory.page_size,
        "num_running": len(scheduler.state.running) + (scheduler.state.chunked is not None),
        "num_waiting": len(scheduler.state.waiting),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "quantization": runner.weight_format,
        "device": str(runner.device),
        "attention_backend": runner.attention_backend_name,
        "cuda_graph": runner.cuda_graph_runner is not None,
        "fused_moe": runner.fused_moe,
        "fused_cpu_kernels": runner.fused_cpu_kernels,
        "vocab_size": runner.model_config.vocab_size,
        "stats": dataclasses.asdict(scheduler.state.stats),
        "tp_size": runner.tp.size,
        "nnodes": scheduler.args.nnodes,
        # Every rank's pool has the same slots, each holding its share of the heads.
        "tp_ranks": [{"rank": rank, "kv_tokens": runner.max_total_tokens,
                      "kv_bytes": runner.max_total_tokens * runner.kv_pool.bytes_per_token()}
                     for rank in range(runner.tp.size)],
        "disaggregation_mode": scheduler.args.disaggregation_mode,
        "disaggregation": scheduler.handoffs.stats(),
        "sliding_window_kv": None if scheduler.windows is None else scheduler.windows.info(),
        "lora": None if runner.lora is None else runner.lora.stats(),
        "hierarchical_cache": _tiers(scheduler),
        "speculative_algorithm": (None if scheduler.speculation is None
                                  else scheduler.args.speculative_algorithm),
        "avg_spec_accept_length": _accept_length(scheduler.state.stats),
        **{k: getattr(scheduler.args, k) for k in ("schedule_policy", "batching",
                                                  "chunked_prefill_size", "disable_radix_cache")},
    }


def _accept_length(stats: SchedulerStats) -> float | None:
    """Tokens a request gained per verify step that checked a draft of it (SGLang's
    ``avg_spec_accept_length``: accepted draft tokens plus the target's own)."""
    if not stats.spec_drafted_requests:
        return None
    return 1 + stats.spec_accepted_tokens / stats.spec_drafted_requests


def _tiers(scheduler) -> dict | None:
    """The hierarchical cache's per-tier state (None without one), with the device tier's
    hits: the prompt tokens admitted requests found cached, loaded ones included (counted
    once a request, as ``cached_tokens``)."""
    cache = scheduler.memory.tree_cache
    if not hasattr(cache, "block_keys"):
        return None
    return {**cache.stats(), "device_hit_tokens": scheduler.state.stats.cached_tokens}
