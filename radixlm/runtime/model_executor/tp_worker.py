"""Tensor-parallel ranks 1..N-1: processes that hold a share of the model and run every
forward pass rank 0 broadcasts (``tensor_parallel_ranks``), and nothing else (no HTTP, no
tokenizer, no scheduler).

``rank_processes`` starts them: rank 0's model runner on its node, ``radixlm serve
--node-rank i`` on the others. A rank exits when rank 0 says so, or when a collective
fails (rank 0 or a peer died).
"""

from __future__ import annotations

import logging
import sys

import msgspec
import torch
import torch.distributed as dist

from radixlm.host_to_device import to_device
from radixlm.kernels.forward_batch import ForwardBatch, ForwardMode
from radixlm.models.model_config import ModelConfig
from radixlm.runtime.hicache_options import GB, host_tier_blocks
from radixlm.runtime.model_executor.host_tier_ranks import HostTierFollower
from radixlm.runtime.model_executor.model_runner import ModelRunner
from radixlm.runtime.model_executor.rank_processes import RankConfig
from radixlm.runtime.model_executor.tensor_parallel_ranks import (
    HostTierChanges,
    LoraSlot,
    Step,
    StepReceiver,
)
from radixlm.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)


def rank_main() -> None:
    """A rank process's entry point."""
    config = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=RankConfig)  # from LocalRanks
    logging.basicConfig(format=f"[rank {config.rank}] %(levelname)s %(name)s: %(message)s")
    try:
        run_rank(config.server_args, config.model_path, config.rank)
    except Exception as err:  # a failed collective (rank 0 gone) or a failed start
        logger.error("tensor-parallel rank %d stops: %s", config.rank, err)
        sys.exit(1)


def run_rank(args: ServerArgs, model_path: str, rank: int) -> None:
    """Builds this rank's share of the model and runs rank 0's steps until told to stop."""
    runner = ModelRunner(args, ModelConfig.from_path(model_path, args.trust_remote_code),
                         rank=rank)
    receiver = StepReceiver(runner.tp, runner.cpu_group, runner.device,
                            runner.model_config.hidden_size, runner.dtype)
    host_tier = host_tier_follower(args, runner, rank)
    while (step := receiver.receive()) is not None:
        if isinstance(step, torch.Tensor):  # hidden rows: this rank's share of the logits
            runner.compute_logits(step)
        elif isinstance(step, LoraSlot):
            runner.lora.load_slot(step.slot, step.name, step.path, step.fingerprint)
        elif isinstance(step, HostTierChanges):
            host_tier.apply(step.host, step.slots, runner.cpu_group)
        else:
            runner.forward(step_batch(runner, step))
    if host_tier is not None:
        host_tier.close()
    dist.destroy_process_group()


def host_tier_follower(args: ServerArgs, runner: ModelRunner,
                       rank: int) -> HostTierFollower | None:
    """This rank's share of the hierarchical prefix cache's host and disk tiers (as large
    as rank 0's), or None without one."""
    if not args.enable_hierarchical_cache:
        return None
    pool = runner.kv_pool
    return HostTierFollower(
        pool, args.hicache_block_tokens,
        host_tier_blocks(args, pool.bytes_per_token(), runner.max_total_tokens),
        args.hicache_storage_dir if args.hicache_storage_backend == "file" else None,
        int(args.hicache_storage_size * GB), args.page_size, rank, args.tp_size)


def step_batch(runner: ModelRunner, step: Step) -> ForwardBatch:
    """The forward batch of ``step``, with its request rows written into this rank's table
    first (rows rewritten in place, then an extend step's whole rows or a decode step's one
    new slot per request), all without reading the device: rows and columns are indexed on
    the device, lengths come from the host (and LoRA segments, whose slots rank 0 had this
    rank load before)."""
    table = runner.req_to_token_pool.req_to_token
    seq_lens = [p + e for p, e in zip(step.prefix_lens, step.extend_lens)]
    device = step.input_ids.device
    for row, slots in step.rewritten:
        table[row, : len(slots)] = slots
    if step.mode == ForwardMode.EXTEND:
        lens = to_device(seq_lens, torch.int64, device)  # (B,)
        total = sum(seq_lens)
        rows = step.req_pool_indices.repeat_interleave(lens, output_size=total)  # (T,)
        starts = (torch.cumsum(lens, 0) - lens).repeat_interleave(lens, output_size=total)
        table[rows, torch.arange(total, device=device) - starts] = step.rows
    else:
        table[step.req_pool_indices, step.positions] = step.out_cache_loc
    batch = ForwardBatch(
        mode=step.mode,
        input_ids=step.input_ids,
        positions=step.positions,
        out_cache_loc=step.out_cache_loc,
        req_pool_indices=step.req_pool_indices,
        seq_lens=to_device(seq_lens, torch.int64, device),
        prefix_lens=to_device(step.prefix_lens, torch.int64, device),
        extend_seq_lens=to_device(step.extend_lens, torch.int64, device),
        req_to_token=table,
        kv_pool=runner.kv_pool,
        attn_backend=runner.attn_backend,
        seq_lens_list=seq_lens,
        extend_seq_lens_list=step.extend_lens,
    )
    if step.lora_segments is not None:
        batch.lora = runner.lora.batch_of(*step.lora_segments)
    return batch
