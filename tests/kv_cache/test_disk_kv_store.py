"""The disk tier's contract (``radixlm/kv_cache/disk_kv_store.py``) on a real filesystem.

Failures are made, not mocked: a small tmpfs that fills up, a read-only remount, files cut,
overwritten and renamed on disk, and a writer process killed with SIGKILL mid-loop. The
mount tests need root and skip where mounting is not permitted.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from mounts import tmpfs
from safetensors import safe_open
from safetensors.torch import load, load_file, save_file

from radixlm.kv_cache.disk_kv_store import (
    BLOCK_SUFFIX,
    TEMP_SUFFIX,
    DiskKVStore,
    StoreIdentity,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
BLOCK = 16
LOGGER = "radixlm.kv_cache.disk_kv_store"


@functools.cache
def block_bytes() -> int:
    """The file size of a block of ``make_identity()`` whose tokens are from ``prompt``."""
    with tempfile.TemporaryDirectory() as directory:
        store = DiskKVStore(directory, make_identity(), 1 << 20)
        fill(store, prompt(1))
        return store.stats().bytes_used


def make_identity(layout: str = "mha", dtype: str = "float32", **overrides) -> StoreIdentity:
    shapes = ((2, 8),) * 4 if layout == "mha" else ((1, 24),) * 2  # K, V per layer | latents
    fields = dict(model="test/tiny", dtype=dtype, page_size=4, block_tokens=BLOCK,
                  buffer_shapes=shapes, tokenizer="tok-v1", tp_rank=0, tp_size=1)
    return StoreIdentity(**{**fields, **overrides})


def random_block(identity: StoreIdentity, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((identity.block_tokens, *shape), generator=g).to(identity.torch_dtype)
            for shape in identity.buffer_shapes]


def prompt(n_blocks: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n_blocks * BLOCK))


def block_of(tokens: list[int], i: int) -> list[int]:
    return tokens[i * BLOCK:(i + 1) * BLOCK]


def fill(store: DiskKVStore, tokens: list[int], extra_key: str | None = None):
    """Writes every full block of ``tokens``; returns [(key, block tokens, buffers)]."""
    blocks = []
    for i, key in enumerate(store.block_keys(tokens, extra_key)):
        buffers = random_block(store.identity, seed=hash(key) % 2**31)
        assert store.write(key, block_of(tokens, i), buffers)
        blocks.append((key, block_of(tokens, i), buffers))
    return blocks


def assert_same_bytes(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def temp_files(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.name.endswith(TEMP_SUFFIX)]


def warnings_with(caplog, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.levelno == logging.WARNING and text in r.getMessage()]


# ---- round trips and keys ---------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["mha", "mla"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_keeps_every_byte(tmp_path, layout, dtype):
    identity = make_identity(layout, dtype)
    store = DiskKVStore(tmp_path, identity, capacity_bytes=1 << 30)
    buffers = random_block(identity, seed=1)
    buffers[0].view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, -float("inf")])
    tokens = prompt(1)
    (key,) = store.block_keys(tokens, None)
    assert store.write(key, tokens, buffers)
    assert_same_bytes(store.read(key, tokens), buffers)
    stats = store.stats()
    assert (stats.files, stats.reads, stats.read_hits) == (1, 1, 1)
    assert stats.bytes_used == stats.bytes_written == stats.bytes_read > 0
    store.close()


def test_chained_keys_depend_on_the_whole_prefix_namespace_and_identity(tmp_path):
    store = DiskKVStore(tmp_path / "a", make_identity(), capacity_bytes=1 << 20)
    twin = DiskKVStore(tmp_path / "b", make_identity(), capacity_bytes=1 << 20)
    other_rank = DiskKVStore(tmp_path / "c", make_identity(tp_rank=1, tp_size=2), 1 << 20)
    tokens = prompt(4)
    keys = store.block_keys(tokens, "ns")
    assert len(keys) == 4 and len(set(keys)) == 4
    assert twin.block_keys(tokens, "ns") == keys
    for other in (store.block_keys(tokens, "other"), store.block_keys(tokens, None),
                  store.block_keys(tokens, ""), other_rank.block_keys(tokens, "ns")):
        assert not set(other) & set(keys)
    assert store.block_keys(tokens, None) != store.block_keys(tokens, "")
    first_changed = [tokens[0] + 1, *tokens[1:]]
    assert not set(store.block_keys(first_changed, "ns")) & set(keys)
    third_block_changed = list(tokens)
    third_block_changed[2 * BLOCK + 3] += 1
    changed_keys = store.block_keys(third_block_changed, "ns")
    assert changed_keys[:2] == keys[:2] and not set(changed_keys[2:]) & set(keys)
    assert store.block_keys(tokens[:3 * BLOCK + 5], "ns") == keys[:3]
    assert store.block_keys(tokens[:BLOCK - 1], "ns") == []


def test_restart_finds_the_blocks_by_hashing_the_prompt(tmp_path):
    identity = make_identity("mha", "bfloat16")
    tokens = prompt(3)
    with DiskKVStore.open(tmp_path, identity, capacity_bytes=1 << 20) as store:
        blocks = fill(store, tokens, "ns")
    restarted = DiskKVStore.open(tmp_path, identity, capacity_bytes=1 << 20)
    assert restarted.stats().files == 3
    assert restarted.longest_prefix(tokens + [7, 8, 9], "ns") == 3
    assert restarted.longest_prefix(tokens, None) == 0
    for key, block_tokens, buffers in blocks:
        assert_same_bytes(restarted.read(key, block_tokens), buffers)
    restarted.delete(blocks[1][0])
    assert restarted.longest_prefix(tokens, "ns") == 1  # stops at the first missing block
    assert restarted.contains(blocks[2][0])


def test_a_warm_start_reads_recent_blocks_with_the_tokens_their_headers_record(tmp_path):
    identity = make_identity("mha", "float32")
    tokens = prompt(3)
    with DiskKVStore.open(tmp_path, identity, capacity_bytes=1 << 20) as store:
        blocks = fill(store, tokens)
        store.read(blocks[0][0], blocks[0][1])  # now the most recently used
    restarted = DiskKVStore.open(tmp_path, identity, capacity_bytes=1 << 20)
    assert restarted.recent_keys(2) == [blocks[0][0], blocks[2][0]]
    for key, block_tokens, buffers in blocks:
        found_tokens, found = restarted.read_recorded(key)
        assert found_tokens == block_tokens
        assert_same_bytes(found, buffers)
    flip_a_payload_byte(restarted.path_of(blocks[1][0]), restarted.path_of(blocks[2][0]))
    assert restarted.read_recorded(blocks[1][0]) is None  # checked as any read
    assert not restarted.contains(blocks[1][0])


def test_files_of_another_identity_are_ignored_not_deleted(tmp_path, caplog):
    tokens = prompt(2)
    with DiskKVStore(tmp_path, make_identity(), 1 << 20) as store:
        blocks = fill(store, tokens)
    files_before = sorted(tmp_path.iterdir())
    caplog.set_level(logging.WARNING, logger=LOGGER)
    other = DiskKVStore(tmp_path, make_identity(tokenizer="tok-v2"), 1 << 20)
    assert warnings_with(caplog, "2 block files of another identity")
    assert other.stats().files == 0 and other.stats().bytes_used == 0
    assert other.longest_prefix(tokens, None) == 0
    assert other.read(blocks[0][0], blocks[0][1]) is None  # not indexed: never opened
    assert sorted(tmp_path.iterdir()) == files_before
    owner = DiskKVStore(tmp_path, make_identity(), 1 << 20)
    assert_same_bytes(owner.read(blocks[0][0], blocks[0][1]), blocks[0][2])


# ---- corruption -------------------------------------------------------------------------------


def truncate(path: Path, other: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def overwrite_with_garbage(path: Path, other: Path) -> None:
    path.write_bytes(random.Random(0).randbytes(path.stat().st_size))


def flip_a_payload_byte(path: Path, other: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def claim_other_tokens(path: Path, other: Path) -> None:
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    size = path.stat().st_size
    metadata["tokens"] = json.dumps([t + 1 for t in json.loads(metadata["tokens"])])
    save_file(tensors, str(path), metadata)
    assert path.stat().st_size == size  # only the tokens check can tell


def rename_another_block_over_it(path: Path, other: Path) -> None:
    os.replace(other, path)


@pytest.mark.parametrize("damage", [truncate, overwrite_with_garbage, flip_a_payload_byte,
                                    claim_other_tokens, rename_another_block_over_it])
def test_a_damaged_block_misses_and_is_deleted(tmp_path, caplog, damage):
    store = DiskKVStore(tmp_path, make_identity(), 1 << 20)
    tokens = prompt(2)
    _, (key, block_tokens, _) = fill(store, tokens)
    twin_key = store.block_keys(tokens, "elsewhere")[1]  # the same tokens after another prefix
    assert store.write(twin_key, block_tokens, random_block(store.identity, 1))
    path = store.path_of(key)
    damage(path, store.path_of(twin_key))
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert store.read(key, block_tokens) is None
    assert not path.exists()
    assert not store.contains(key)
    assert warnings_with(caplog, "deleting corrupt block")
    assert store.stats().corrupt_deleted == 1
    assert store.stats().read_hits == 0


def test_unreadable_headers_are_deleted_at_start_up(tmp_path, caplog):
    identity = make_identity()
    with DiskKVStore(tmp_path, identity, 1 << 20) as store:
        blocks = fill(store, prompt(4))
        paths = [store.path_of(key) for key, _, _ in blocks]
    paths[0].write_bytes(b"\xff" * 100)
    paths[1].write_bytes(paths[1].read_bytes()[:4])
    misnamed = paths[2].with_name("ab" * 32 + BLOCK_SUFFIX)  # its header names another key
    os.replace(paths[2], misnamed)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    restarted = DiskKVStore(tmp_path, identity, 1 << 20)
    assert warnings_with(caplog, "deleted 3 unreadable block files")
    assert not paths[0].exists() and not paths[1].exists() and not misnamed.exists()
    assert restarted.stats().files == 1 and restarted.stats().corrupt_deleted == 3
    key, block_tokens, buffers = blocks[3]
    assert_same_bytes(restarted.read(key, block_tokens), buffers)


def test_a_later_format_version_is_left_alone(tmp_path, caplog):
    identity = make_identity()
    with DiskKVStore(tmp_path, identity, 1 << 20) as store:
        (key, block_tokens, _), = fill(store, prompt(1))
    path = store.path_of(key)
    with safe_open(str(path), framework="pt") as f:
        metadata = {**f.metadata(), "format_version": "3"}
    save_file(load_file(str(path)), str(path), metadata)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    restarted = DiskKVStore(tmp_path, identity, 1 << 20)
    assert warnings_with(caplog, "1 block files of another identity or format version")
    assert not restarted.contains(key) and restarted.read(key, block_tokens) is None
    assert path.exists()


def test_a_closed_store_misses_and_refuses_writes(tmp_path):
    store = DiskKVStore(tmp_path, make_identity(), 1 << 20)
    tokens = prompt(2)
    (key, block_tokens, buffers), _ = fill(store, tokens)
    assert store.write(key, block_tokens, buffers)  # already stored: nothing written again
    assert store.stats().bytes_written == store.stats().bytes_used
    store.close()
    assert not store.contains(key) and store.longest_prefix(tokens, None) == 0
    assert store.read(key, block_tokens) is None
    next_key = store.block_keys(prompt(3), None)[2]
    assert not store.write(next_key, block_of(prompt(3), 2), buffers)
    assert not store.path_of(next_key).exists() and store.path_of(key).exists()


# ---- failing filesystems ----------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs, unmounted afterwards whatever happens."""
    with tmpfs(tmp_path / "mnt", "256k") as mount_point:
        yield mount_point


def test_a_full_disk_refuses_writes_and_keeps_serving(small_tmpfs, caplog):
    store = DiskKVStore(small_tmpfs, make_identity(), capacity_bytes=1 << 30)
    tokens = prompt(200)
    keys = store.block_keys(tokens, None)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    stored = []
    for i, key in enumerate(keys):
        buffers = random_block(store.identity, seed=i)
        if not store.write(key, block_of(tokens, i), buffers):
            break
        stored.append((key, block_of(tokens, i), buffers))
    else:
        pytest.fail("a 256 KiB tmpfs took every block")
    assert stored
    refused = keys[len(stored):len(stored) + 5]
    for key in refused[1:]:
        assert not store.write(key, block_of(tokens, keys.index(key)), random_block(
            store.identity, seed=0))
    assert len(warnings_with(caplog, "ENOSPC")) == 1  # once per kind, not once per block
    assert store.stats().write_failures == len(refused)
    assert temp_files(small_tmpfs) == []
    block_files = {p.name for p in small_tmpfs.glob("*" + BLOCK_SUFFIX)}
    assert block_files == {store.path_of(key).name for key, _, _ in stored}  # nothing partial
    for key, block_tokens, buffers in stored:
        assert_same_bytes(store.read(key, block_tokens), buffers)
    for key, _, _ in stored[:5]:
        store.delete(key)
    assert store.write(refused[0], block_of(tokens, len(stored)), random_block(store.identity, 0))


def test_a_read_only_directory_refuses_writes_and_still_serves_reads(small_tmpfs, caplog):
    identity = make_identity()
    store = DiskKVStore(small_tmpfs, identity, capacity_bytes=1 << 20)
    tokens = prompt(3)
    blocks = fill(store, tokens[:2 * BLOCK])
    remount = subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)],
                             capture_output=True, text=True)
    if remount.returncode != 0:
        pytest.skip(f"remounting read-only is not permitted here: {remount.stderr.strip()}")
    caplog.set_level(logging.WARNING, logger=LOGGER)
    key = store.block_keys(tokens, None)[2]
    assert not store.write(key, block_of(tokens, 2), random_block(identity, 2))
    assert not store.write(key, block_of(tokens, 2), random_block(identity, 2))
    assert len(warnings_with(caplog, "EROFS")) == 1
    assert temp_files(small_tmpfs) == [] and store.stats().write_failures == 2
    restarted = DiskKVStore(small_tmpfs, identity, capacity_bytes=1 << 20)
    assert restarted.longest_prefix(tokens, None) == 2
    for key, block_tokens, buffers in blocks:
        assert_same_bytes(store.read(key, block_tokens), buffers)
        assert_same_bytes(restarted.read(key, block_tokens), buffers)


WRITER = """
import json, sys, torch
from radixlm.kv_cache.disk_kv_store import DiskKVStore, StoreIdentity
directory, fields, capacity, n_blocks, seed = sys.argv[1:6]
identity = StoreIdentity(**json.loads(fields))
store = DiskKVStore(directory, identity, int(capacity))
tokens = list(range(int(n_blocks) * identity.block_tokens))
keys = store.block_keys(tokens, None)
g = torch.Generator().manual_seed(int(seed))
payloads = [[torch.randn((identity.block_tokens, *shape), generator=g)
             for shape in identity.buffer_shapes] for _ in range(3)]
print("ready", flush=True)
while True:
    for i, key in enumerate(keys):
        block = tokens[i * identity.block_tokens:(i + 1) * identity.block_tokens]
        store.write(key, block, payloads[i % 3])
"""


def half_written_files(directory: Path, seconds: float) -> list[str]:
    """Watches ``directory`` for ``seconds``: the block files seen that do not parse as whole
    safetensors files (a write seen half done)."""
    seen = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for path in directory.glob("*" + BLOCK_SUFFIX):
            try:
                data = path.read_bytes()  # once open, the file reads whole even if evicted
            except FileNotFoundError:
                continue  # evicted between the listing and the open
            try:
                load(data)
            except Exception as e:  # safetensors' own error types
                seen.append(f"{path.name}: {e}")
        time.sleep(0.002)
    return seen


def test_kill_9_during_writes_leaves_only_whole_blocks(tmp_path):
    identity = make_identity(block_tokens=64, buffer_shapes=((8, 128),) * 4)  # 1 MiB blocks
    fields = identity.canonical_json()
    capacity, n_blocks = 6 << 20, 10  # fewer than n_blocks fit: every write writes
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    rng = random.Random(60)
    for round_ in range(4):
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), fields, str(capacity), str(n_blocks),
             str(round_)], stdout=subprocess.PIPE, env=env, cwd=REPO_ROOT)
        try:
            assert writer.stdout.readline().strip() == b"ready"
            assert half_written_files(tmp_path, rng.uniform(0.05, 0.4)) == []
        finally:
            writer.send_signal(signal.SIGKILL)
            writer.wait()
        assert writer.returncode == -signal.SIGKILL
    store = DiskKVStore(tmp_path, identity, capacity)
    assert temp_files(tmp_path) == []
    tokens = list(range(n_blocks * identity.block_tokens))
    keys = store.block_keys(tokens, None)
    present = [i for i, key in enumerate(keys) if store.contains(key)]
    assert present and store.stats().files == len(present)
    for i in present:
        assert store.read(keys[i], tokens[i * 64:(i + 1) * 64]) is not None
    assert store.stats().corrupt_deleted == 0
    assert store.stats().bytes_used <= capacity


# ---- capacity ---------------------------------------------------------------------------------


def test_lru_eviction_keeps_within_capacity_and_spares_recent_reads(tmp_path):
    identity = make_identity()
    tokens = prompt(5)
    block_size = block_bytes()
    capacity = 3 * block_size + block_size // 2
    store = DiskKVStore(tmp_path / "store", identity, capacity)
    a, b, c, d, e = [(key, block_of(tokens, i)) for i, key in
                     enumerate(store.block_keys(tokens, None))]
    for key, block_tokens in (a, b, c):
        assert store.write(key, block_tokens, random_block(identity, 0))
    assert store.read(*a) is not None
    assert store.write(*d, random_block(identity, 0))
    assert [store.contains(k) for k, _ in (a, b, c, d)] == [True, False, True, True]
    assert not store.path_of(b[0]).exists()
    assert store.stats().bytes_used <= capacity and store.stats().files == 3
    store.close()
    for (key, _), mtime in ((a, 1_000), (c, 3_000), (d, 2_000)):
        os.utime(store.path_of(key), (mtime, mtime))
    smaller = DiskKVStore(tmp_path / "store", identity, 2 * block_size + block_size // 2)
    assert [smaller.contains(k) for k, _ in (a, c, d)] == [False, True, True]
    assert not store.path_of(a[0]).exists()
    assert smaller.write(*e, random_block(identity, 0))  # evicts d, the older one
    assert [smaller.contains(k) for k, _ in (c, d, e)] == [True, False, True]


class DiskKVStoreMachine(RuleBasedStateMachine):
    """The store against a reference LRU of block indices, capacity three blocks."""

    n_blocks = 6

    def __init__(self):
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="disk_kv_store_"))
        self.identity = make_identity()
        self.tokens = prompt(self.n_blocks)
        self.payloads = [random_block(self.identity, seed=i) for i in range(self.n_blocks)]
        self.store = self._open()
        self.keys = self.store.block_keys(self.tokens, None)
        self.model: OrderedDict[int, None] = OrderedDict()  # oldest first

    def _open(self) -> DiskKVStore:
        return DiskKVStore(self.directory, self.identity, capacity_bytes=3 * block_bytes() + 100)

    def teardown(self):
        self.store.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    @rule(i=st.integers(0, n_blocks - 1))
    def write(self, i):
        assert self.store.write(self.keys[i], block_of(self.tokens, i), self.payloads[i])
        if i not in self.model and len(self.model) == 3:
            self.model.popitem(last=False)
        self.model[i] = None
        self.model.move_to_end(i)

    @rule(i=st.integers(0, n_blocks - 1))
    def read(self, i):
        got = self.store.read(self.keys[i], block_of(self.tokens, i))
        assert (got is not None) == (i in self.model)
        if got is not None:
            assert_same_bytes(got, self.payloads[i])
            self.model.move_to_end(i)

    @rule(i=st.integers(0, n_blocks - 1))
    def delete(self, i):
        self.store.delete(self.keys[i])
        self.model.pop(i, None)

    @rule()
    def restart(self):
        """Recency survives as mtimes (set here: the clock's tick may not tell writes apart)."""
        self.store.close()
        for rank, i in enumerate(self.model):
            os.utime(self.store.path_of(self.keys[i]), ns=(rank * 10**9, rank * 10**9))
        self.store = self._open()

    @invariant()
    def matches_the_reference(self):
        stored = [i for i in range(self.n_blocks) if self.store.contains(self.keys[i])]
        assert stored == sorted(self.model)
        stats = self.store.stats()
        assert stats.files == len(self.model)
        assert stats.bytes_used == len(self.model) * block_bytes()
        on_disk = {p.name for p in self.directory.iterdir()}
        assert on_disk == {self.store.path_of(self.keys[i]).name for i in self.model}


TestDiskKVStoreStateful = DiskKVStoreMachine.TestCase
TestDiskKVStoreStateful.settings = settings(max_examples=30, stateful_step_count=25,
                                            deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])


def test_a_block_larger_than_the_capacity_is_refused(tmp_path):
    store = DiskKVStore(tmp_path, make_identity(), capacity_bytes=1024)
    tokens = prompt(1)
    assert not store.write(store.block_keys(tokens, None)[0], tokens,
                           random_block(store.identity, 0))
    assert store.stats().write_failures == 1 and list(tmp_path.iterdir()) == []


def test_concurrent_writes_and_lookups_keep_the_byte_count_true(tmp_path):
    identity = make_identity()
    tokens = prompt(24)
    keys = DiskKVStore(tmp_path / "probe", identity, 1 << 20).block_keys(tokens, None)
    store = DiskKVStore(tmp_path / "store", identity, capacity_bytes=8 * 6000)
    errors = []

    def writer(indices):
        try:
            for i in indices:
                store.write(keys[i], block_of(tokens, i), random_block(identity, i))
        except Exception as e:  # surfaced in the main thread
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(range(k, 24, 3),)) for k in range(3)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        store.longest_prefix(tokens, None)
        assert store.stats().bytes_used <= store.capacity_bytes
    for t in threads:
        t.join()
    assert errors == []
    on_disk = sum(p.stat().st_size for p in (tmp_path / "store").glob("*" + BLOCK_SUFFIX))
    assert store.stats().bytes_used == on_disk <= store.capacity_bytes


# ---- bad input --------------------------------------------------------------------------------


def test_buffers_that_do_not_fit_the_identity_raise_value_error(tmp_path):
    identity = make_identity()
    store = DiskKVStore(tmp_path, identity, 1 << 20)
    tokens = prompt(1)
    key = store.block_keys(tokens, None)[0]
    good = random_block(identity, 0)
    with pytest.raises(ValueError, match="expected 4 buffers"):
        store.write(key, tokens, good[:3])
    with pytest.raises(ValueError, match=r"buffer 2 has shape \(16, 2, 9\)"):
        store.write(key, tokens, [*good[:2], torch.zeros(BLOCK, 2, 9), good[3]])
    with pytest.raises(ValueError, match="buffer 1 has dtype torch.float16"):
        store.write(key, tokens, [good[0], good[1].half(), *good[2:]])
    with pytest.raises(ValueError, match="block_tokens=16"):
        store.write(key, tokens[:-1], good)
    with pytest.raises(ValueError, match="64 lowercase hex digits"):
        store.write("../escape", tokens, good)
    with pytest.raises(ValueError, match="block_tokens must be a positive multiple"):
        make_identity(block_tokens=18)
    with pytest.raises(ValueError, match="dtype must name a torch dtype"):
        make_identity(dtype="float33")
    assert store.stats().files == 0 and list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_tensors_are_copied_to_the_host(tmp_path):
    identity = make_identity(dtype="bfloat16")
    store = DiskKVStore(tmp_path, identity, 1 << 20)
    tokens = prompt(1)
    key = store.block_keys(tokens, None)[0]
    buffers = random_block(identity, 0)
    assert store.write(key, tokens, [t.cuda() for t in buffers])
    assert_same_bytes(store.read(key, tokens), buffers)
