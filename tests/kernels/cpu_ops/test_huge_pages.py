"""Tensors on huge pages: moved with their values, shapes, strides and sharing; a zeroed
buffer; the loader's weights and the KV pool placed there; nothing changed where huge
pages are off."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from radixlm.kernels.cpu_ops import huge_pages
from radixlm.kv_cache.memory_pool import MHATokenToKVPool
from radixlm.models.layers.linear import Linear
from radixlm.models.loader import load_model
from radixlm.models.model_config import ModelConfig

needs_huge_pages = pytest.mark.skipif(not huge_pages.available(),
                                      reason="transparent huge pages are off here")


def huge_kib_at(address: int) -> int:
    """AnonHugePages (KiB) of this process's mapping that holds ``address``."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            start, end = (int(part, 16) for part in head.groups())
            mapping = start <= address < end
        elif mapping and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.fixture
def huge_pages_off():
    previous = huge_pages.enable(False)
    yield
    huge_pages.enable(previous)


@needs_huge_pages
def test_moved_tensors_keep_values_shapes_strides_and_sharing():
    whole = torch.randn(1536, 1024)  # 6 MiB
    rows = whole[100:300]  # a view: it must stay a view of the same copy
    columns = whole.t()[:, 5:9]  # non-contiguous
    other = torch.randint(-128, 127, (3000, 700), dtype=torch.int8)
    bf16 = torch.nn.Parameter(torch.randn(515, 33).bfloat16(), requires_grad=False)
    expected = [t.clone() for t in (whole, rows, columns, other, bf16)]
    strides = [t.stride() for t in (whole, rows, columns, other, bf16)]
    sizes = sum(t.untyped_storage().nbytes() for t in (whole, other, bf16))
    moved = huge_pages.move_to_huge_pages([whole, rows, columns, other, bf16, whole])
    assert sizes <= moved < sizes + 3 * 64
    for tensor, want, stride in zip((whole, rows, columns, other, bf16), expected, strides):
        assert torch.equal(tensor, want) and tensor.stride() == stride
    assert isinstance(bf16, torch.nn.Parameter)
    assert whole.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()
    assert whole.data_ptr() % huge_pages.HUGE_PAGE == 0
    whole[150, 7] = 42.0  # writes through the original tensor reach its views
    assert rows[50, 7] == 42.0
    whole[5, 2] = -1.0
    assert columns[2, 0] == -1.0
    assert huge_kib_at(whole.data_ptr()) >= huge_pages.HUGE_PAGE // 1024


def test_nothing_moves_where_huge_pages_are_off(huge_pages_off):
    tensor = torch.randn(1024, 1024)
    address = tensor.data_ptr()
    assert not huge_pages.available()
    assert huge_pages.move_to_huge_pages([tensor]) == 0
    assert tensor.data_ptr() == address
    assert huge_pages.empty(1 << 22) is None
    zeros = huge_pages.zeros((1024, 1024), torch.float32)
    assert zeros.shape == (1024, 1024) and not zeros.any()


@needs_huge_pages
def test_other_devices_and_layouts_and_empty_tensors_are_left():
    meta = torch.empty(1024, 1024, device="meta")
    empty = torch.empty(0)
    sparse = torch.eye(4).to_sparse()
    assert huge_pages.move_to_huge_pages([meta, empty, sparse]) == 0
    assert meta.device.type == "meta" and empty.numel() == 0 and sparse.is_sparse


@needs_huge_pages
def test_zeros_are_zero_on_huge_pages_and_small_ones_plain():
    buffer = huge_pages.zeros((4096, 3, 64), torch.bfloat16)  # 1.5 MiB: below a huge page
    assert buffer.shape == (4096, 3, 64) and buffer.dtype == torch.bfloat16
    assert not buffer.any()
    large = huge_pages.zeros((16384, 3, 64), torch.bfloat16)  # 6 MiB
    assert large.is_contiguous() and not large.any()
    assert large.data_ptr() % huge_pages.HUGE_PAGE == 0
    large.fill_(1.5)
    assert huge_kib_at(large.data_ptr()) >= huge_pages.HUGE_PAGE // 1024


@needs_huge_pages
def test_the_kv_pool_lies_on_huge_pages():
    pool = MHATokenToKVPool(16384, 2, 3, 64, torch.bfloat16, "cpu")
    for buffer in (*pool.k_buffers, *pool.v_buffers):
        assert buffer.data_ptr() % huge_pages.HUGE_PAGE == 0 and not buffer.any()


@needs_huge_pages
def test_the_loader_puts_every_weight_in_one_mapping_with_the_same_values(tiny_model_dir,
                                                                          huge_pages_off):
    config = ModelConfig.from_path(str(tiny_model_dir("LlamaForCausalLM", "gqa", False)))
    plain = load_model(config, torch.float32, torch.device("cpu"), 64, weight_format="int8wo")
    huge_pages.enable(True)
    moved = load_model(config, torch.float32, torch.device("cpu"), 64, weight_format="int8wo")
    storages = set()
    for (name, want), got in zip(plain.state_dict().items(), moved.state_dict().values()):
        assert torch.equal(want, got), name
        storages.add(got.untyped_storage().data_ptr())
    pairs = [(a.packed, b.packed) for a, b in zip(plain.modules(), moved.modules())
             if isinstance(b, Linear) and b.packed is not None]
    assert pairs
    for want, got in pairs:
        for a, b in zip(want.tensors(), got.tensors(), strict=True):
            assert torch.equal(a, b)
            storages.add(b.untyped_storage().data_ptr())
    assert len(storages) == 1
