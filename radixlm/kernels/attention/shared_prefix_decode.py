"""Decode attention for requests that share a prefix of KV slots, in plain PyTorch (the
torch-native backend's, for a ``ForwardBatch``'s ``shared_prefixes``).

A beam search's k beams share their prompt's slots. Read per request, the prompt's keys are
gathered k times and scored in k small matmuls of one query row group each; read once, they
are scored for all k beams' queries in one matmul per KV head, (k x G, D) @ (D, P), the
shape a CPU's GEMM runs well. Each beam's own keys after the prefix are scored as usual, and
one softmax runs over the prefix's scores and its own together, so the result is the
attention over the whole sequence (up to floating-point summation order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SharedPrefixRun:
    """Requests ``start .. start + count - 1`` of a decode batch, sharing ``prefix_slots``.

    ``suffix_slots`` (count, S) are each request's slots after the prefix, padded to the
    longest; ``suffix_mask`` (count, 1, 1, S) marks the real ones (None: all are)."""

    start: int
    count: int
    prefix_slots: torch.Tensor
    suffix_slots: torch.Tensor
    suffix_mask: torch.Tensor | None


def plan_runs(kv_slots: torch.Tensor, seq_lens: list[int],
              shared_prefixes: list[tuple[int, int, int]]) -> list[SharedPrefixRun]:
    """The runs of a decode batch whose KV slot table is ``kv_slots`` (B, S), its requests'
    lengths ``seq_lens``; runs with nothing shared are left out."""
    runs = []
    for start, count, prefix in shared_prefixes:
        lens = seq_lens[start : start + count]
        if prefix <= 0 or min(lens) <= prefix:
            continue
        longest = max(lens)
        suffix = kv_slots[start : start + count, prefix:longest]
        mask = None
        if min(lens) != longest:
            own = torch.tensor(lens, device=kv_slots.device) - prefix
            visible = torch.arange(longest - prefix, device=kv_slots.device)[None, :] < own[:, None]
            mask = visible[:, None, None, :]
        runs.append(SharedPrefixRun(start, count, kv_slots[start, :prefix], suffix, mask))
    return runs


def attend_shared_prefix(q: torch.Tensor, run: SharedPrefixRun, k_buffer: torch.Tensor,
                         v_buffer: torch.Tensor, values_view_keys: bool, num_kv_heads: int,
                         scaling: float) -> torch.Tensor:
    """Attention of the run's queries q (k, H, D), one per request, over the prefix and each
    request's own keys; returns (k, H, D_v). ``values_view_keys``: the values are the first
    D_v dims of the keys (a latent pool), read from the keys."""
    k, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    d_v = v_buffer.shape[-1]
    prefix_len, suffix_len = run.prefix_slots.numel(), run.suffix_slots.shape[1]
    prefix_keys = k_buffer.index_select(0, run.prefix_slots)  # (P, H_kv, D)
    own_keys = k_buffer.index_select(0, run.suffix_slots.reshape(-1)).view(
        k, suffix_len, num_kv_heads, -1)  # (k, S, H_kv, D)
    if values_view_keys:
        prefix_values, own_values = prefix_keys[..., :d_v], own_keys[..., :d_v]
    else:
        prefix_values = v_buffer.index_select(0, run.prefix_slots)  # (P, H_kv, D_v)
        own_values = v_buffer.index_select(0, run.suffix_slots.reshape(-1)).view(
            k, suffix_len, num_kv_heads, d_v)  # (k, S, H_kv, D_v)
    queries = q.view(k, num_kv_heads, group, head_dim)
    by_head = queries.permute(1, 0, 2, 3).reshape(num_kv_heads, k * group, head_dim)
    prefix_scores = torch.matmul(by_head, prefix_keys.permute(1, 2, 0))  # (H_kv, kG, P)
    prefix_scores = prefix_scores.view(num_kv_heads, k, group, prefix_len).transpose(0, 1)
    own_scores = torch.matmul(queries, own_keys.permute(0, 2, 3, 1))  # (k, H_kv, G, S)
    if run.suffix_mask is not None:
        own_scores = own_scores.masked_fill(~run.suffix_mask, float("-inf"))
    scores = torch.cat([prefix_scores, own_scores], dim=-1).float() * scaling
    probs = torch.softmax(scores, dim=-1).to(prefix_values.dtype)  # (k, H_kv, G, P + S)
    prefix_probs = probs[..., :prefix_len].transpose(0, 1).reshape(
        num_kv_heads, k * group, prefix_len)
    out = torch.matmul(prefix_probs, prefix_values.transpose(0, 1))  # (H_kv, kG, D_v)
    out = out.view(num_kv_heads, k, group, d_v).transpose(0, 1)  # (k, H_kv, G, D_v)
    out = out + torch.matmul(probs[..., prefix_len:], own_values.transpose(1, 2))
    return out.reshape(k, num_heads, d_v)
