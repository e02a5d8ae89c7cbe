"""The device-to-host reads the step loop makes on purpose, each with its reason.

On a GPU the host waits whenever it reads a device tensor (``.tolist()``, ``.item()``,
``int()``, ``.cpu()``, a boolean-mask gather, ``torch.unique``) and whenever it copies host
data to the device from pageable memory: the copy is queued behind every kernel before it.
With overlap scheduling such a wait stops the host from queueing step N + 1 before step N
ends. A step needs one wait, for its sampled tokens (they decide the next step); everything
else is kept as host values beside the device tensors (``RequestMemory``: each request's
last slot, whole-page prefixes) or is copied behind the tokens into pinned memory and read
after them (``LogprobCopy``), and host values reach the device through ``to_device``.

What remains is listed here. Beam search reads its beams' scores and slots every step by
design (its host picks the next beams) and is outside the guarded workload.
``tests/runtime/scheduler/test_step_host_reads.py`` runs extend, decode and finishing steps
(plain and overlapped, and a windowed model's) through the real scheduler and
model runner on the CPU under a guard that records every read and every upload not made by
``to_device``, and fails on one whose site is not a key of ``STEP_HOST_READS``. A site is
``path:qualname`` of the function that reads, or, for a function in ``READ_ON_BEHALF``, of
the first function outside those that called it.
"""

from __future__ import annotations

STEP_HOST_READS: dict[str, str] = {
    "radixlm/runtime/scheduler/sampling_step.py:SamplingStep._sample":
        "the step's sampled tokens, in the plain loop: the one wait a step needs (the host "
        "appends them, checks stops and builds the next step from them)",
    "radixlm/runtime/scheduler/decode_worker.py:DecodeInFlight.host_outputs":
        "the tokens of the decode step in flight, with overlap: on CUDA copied into pinned "
        "memory behind that step's sampling and waited for on an event recorded after the "
        "copy, so the step queued behind it keeps running",
    "radixlm/runtime/scheduler/speculative_decode.py:SpeculativeDecode._accept":
        "a speculative verify step's chosen tokens: once for a batch of plain greedy rows "
        "(the step's one wait, as a decode step's), else one wait per position checked (the "
        "next position's token is chosen after the grammar, penalties and seeds have "
        "taken this one)",
    "radixlm/runtime/speculative/draft_model_proposer.py:DraftModelProposer._argmax":
        "a draft model's tokens, once per draft pass (each pass is fed the tokens of the "
        "one before; --speculative-algorithm STANDALONE only)",
    "radixlm/runtime/sampling/logprobs.py:LogprobCopy.read":
        "logprobs, read after the tokens of their step (copied behind them, into pinned "
        "memory on CUDA): they wait for nothing the token read has not; a prompt chunk "
        "that samples nothing reads only its prompt logprobs, its one wait (the test "
        "checks the order)",
    "radixlm/runtime/scheduler/request_memory.py:RequestMemory._free_duplicates":
        "a request's own slots for tokens another request cached first: their pages were "
        "never held as host numbers (only when two requests computed the same tokens)",
    "radixlm/runtime/scheduler/request_memory.py:RequestMemory._free_uncached":
        "without the prefix cache (--disable-radix-cache), a finished request's slots: the "
        "host keeps only its last slot, not its every page",
    "radixlm/kv_cache/radix_tree.py:RadixCache.evict":
        "the cache's evicted nodes hold their slots on the device (only when the pool runs "
        "out of free pages)",
    "radixlm/kv_cache/hybrid_pool.py:HybridAllocator.local_held":
        "windowed models (the hybrid pool): which cached pages still hold their local-layer "
        "KV, read when a waiting request is matched against the cache; the match's slots "
        "are device tensors (keeping their pages' numbers on the host as well is left to do)",
    "radixlm/kv_cache/windowed_radix_tree.py:WindowedRadixCache.usable_length":
        "windowed models: how much of a cache match has its local-layer KV, from "
        "local_held's answer, at admission",
    "radixlm/kv_cache/hybrid_pool.py:HybridAllocator.move_local":
        "windowed models: a finished or chunked request's local-layer pages handed to the "
        "cache's nodes, whose slots are device tensors",
    "radixlm/kv_cache/hybrid_pool.py:HybridAllocator.release_local":
        "windowed models: a running request's local-layer pages that fell out of its window, "
        "freed as it decodes (a page's worth of tokens apart)",
    "radixlm/kernels/attention/windowed_attention.py:build_layout":
        "the torch-native backend's windowed attention lays out its gather from the host "
        "lengths (the CPU's backend, where host and device are one memory; GPUs attend "
        "through Triton or FlashInfer)",
    "radixlm/kernels/attention/windowed_attention.py:WindowedAttention._grid_kv":
        "the torch-native backend's windowed gather with build_layout's host index",
    "radixlm/runtime/grammar/xgrammar_backend.py:_apply_byte_penalties":
        "the grammar mask on the CPU: the bitmask and the logits are both host memory there "
        "(on a GPU, apply_bitmask copies the bitmask from pinned memory instead)",
}
"""Site -> why the read is there and why it costs no more than it must."""

READ_ON_BEHALF: tuple[str, ...] = (
    "radixlm/kv_cache/allocator.py:TokenToKVPoolAllocator.free",
    "radixlm/kv_cache/allocator.py:TokenToKVPoolAllocator._pages",
)
"""Functions that read for their caller: a read in them is the caller's (a new caller of
``free`` in the step loop is a new site, not a declared one)."""
