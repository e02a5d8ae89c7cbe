"""KV rows as raw bytes: what one pool's slots hold arrives in another pool's slots, for
multi-head and MLA pools and any dtype, and a frame that does not fit is refused."""

from __future__ import annotations

import pytest
import torch

from radixlm.kv_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from radixlm.runtime.disaggregation.kv_rows import (
    KVLayout,
    byte_views,
    gather_rows,
    scatter_rows,
)


def pools(kind: str, dtype: torch.dtype):
    if kind == "mha":
        return [MHATokenToKVPool(16, 3, 2, 8, dtype, "cpu") for _ in range(2)]
    return [MLATokenToKVPool(16, 3, 12, 4, dtype, "cpu") for _ in range(2)]


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_gathered_at_some_slots_arrive_at_others(kind, dtype):
    source, target = pools(kind, dtype)
    for buffer in source.layer_buffers():
        buffer.copy_(torch.randn(buffer.shape).to(dtype))
    sent, received = torch.tensor([3, 9, 4]), torch.tensor([11, 2, 7])
    frames = [bytes(view) for view in byte_views(gather_rows(source.layer_buffers(), sent))]
    scatter_rows(target.layer_buffers(), received, frames)
    for mine, theirs in zip(source.layer_buffers(), target.layer_buffers()):
        assert torch.equal(theirs[received], mine[sent])
        untouched = [s for s in range(16) if s not in received.tolist()]
        assert not theirs[untouched].any()
    layout = KVLayout.of(source.layer_buffers(), 1)
    assert layout.bytes_per_token() == source.bytes_per_token()
    assert sum(len(f) for f in frames) == 3 * source.bytes_per_token()


def test_a_frame_of_the_wrong_size_is_refused():
    source, target = pools("mha", torch.float32)
    frames = [bytes(v) for v in byte_views(gather_rows(source.layer_buffers(), torch.tensor([1])))]
    with pytest.raises(ValueError, match="bytes where"):
        scatter_rows(target.layer_buffers(), torch.tensor([1, 2]), frames)
    with pytest.raises(ValueError, match="KV frames for"):
        scatter_rows(target.layer_buffers(), torch.tensor([1]), frames[:-1])


def test_layouts_that_differ_say_how():
    mha = KVLayout.of(pools("mha", torch.float32)[0].layer_buffers(), 1)
    assert mha.mismatch(mha) is None
    assert "page sizes differ: prefill 1, decode 16" in mha.mismatch(
        KVLayout(mha.dtype, mha.row_shapes, 16))
    assert "KV dtypes differ" in mha.mismatch(
        KVLayout.of(pools("mha", torch.bfloat16)[0].layer_buffers(), 1))
    assert "KV layouts differ" in mha.mismatch(
        KVLayout.of(pools("mla", torch.float32)[0].layer_buffers(), 1))
