"""The disk tier (L3) of the hierarchical prefix cache: KV blocks in files that outlive the server.

A block is the KV of ``block_tokens`` consecutive tokens (a multiple of the pool's page
size): one tensor per per-slot buffer of the pool, in the order of ``layer_buffers()``,
each (block_tokens, *slot_shape) of the pool's dtype, stored as one byte payload
(``kv_block_format``). It is keyed by a chained hash over
the whole prefix up to its end,

    key_{-1} = H(identity fingerprint, extra_key)      key_i = H(key_{i-1}, tokens of block i)

so a restarted server finds a prompt's blocks by hashing the prompt (``block_keys``),
without any index of its own on disk. Each block is one safetensors file ``<key>.safetensors``
whose metadata holds the format version, the ``StoreIdentity``, the block's tokens, its key
and a checksum of the payload. Files are never unpickled; they are read back as untrusted
input.

Invariants:
- a file is indexed only if its header names this format version, this identity and the
  key of its file name; files of another identity or version are left alone, never read;
- a read returns tensors only after every check passed (key, identity, the caller's tokens,
  the payload's name, dtype and size, checksum); a file failing one is deleted and the read
  misses;
- a block file appears only whole: it is written to ``<key>.<tag>.tmp`` beside it, fsynced
  and renamed over the final name, so a crash leaves at most a temp file, which the next
  start-up of the same identity deletes (one live store per identity and directory);
- ``bytes_used`` (the sum of indexed file sizes) plus the bytes of writes under way never
  exceeds ``capacity_bytes``: a write first evicts least-recently-used blocks;
- ``write`` never raises for an I/O failure (disk full, read-only, permissions): it returns
  False, logs one warning per kind of failure and interval, and removes its temp file.

Recency is kept in memory (an ordered index, oldest first) and persisted as file mtimes,
which order the index at start-up; a read touches its file's mtime. The index is guarded by
one lock, so reads and writes may run in a worker thread while the scheduler asks
``contains`` and ``longest_prefix``; files are read and written outside the lock, and only
deleted under it (so an eviction never races a write of the same key into the index).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from radixlm.kv_cache.kv_block_format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    KEY_PATTERN,
    CorruptBlock,
    StoreIdentity,
    chained_block_keys,
    header_metadata,
    pack_payload,
    payload_checksum,
    unpack_payload,
)

logger = logging.getLogger(__name__)

BLOCK_SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
_WARNING_INTERVAL_S = 60.0


@dataclasses.dataclass(frozen=True, slots=True)
class DiskKVStoreStats:
    files: int
    bytes_used: int
    bytes_written: int
    bytes_read: int
    reads: int
    read_hits: int
    write_failures: int
    corrupt_deleted: int


class _WarningLimiter:
    """Logs a warning of a kind at most once per interval, then how many were held back."""

    def __init__(self, interval_s: float = _WARNING_INTERVAL_S):
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warn(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self._interval_s:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        held = self._held.pop(kind, 0)
        self._last[kind] = now
        suffix = f" ({held} more like it held back)" if held else ""
        logger.warning(message + suffix, *args)


class DiskKVStore:
    """Blocks of KV under ``directory``, at most ``capacity_bytes`` of files, of one identity.

    Opening raises OSError only if the directory cannot be created or listed. After
    ``close`` every lookup misses and every write is refused (returns False), so a worker
    thread finishing a write after shutdown does no harm.
    """

    def __init__(self, directory: str | os.PathLike, identity: StoreIdentity, capacity_bytes: int):
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        self.directory = Path(directory)
        self.identity = identity
        self.capacity_bytes = capacity_bytes
        self._identity_json = identity.canonical_json()
        self._fingerprint = identity.fingerprint()
        self._temp_tag = self._fingerprint[:16]
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file size, oldest first
        self._bytes_used = 0
        self._bytes_reserved = 0
        self._counters = dict.fromkeys(
            ("bytes_written", "bytes_read", "reads", "read_hits", "write_failures",
             "corrupt_deleted"), 0)
        self._warnings = _WarningLimiter()
        self._closed = False
        self.directory.mkdir(parents=True, exist_ok=True)
        self._load_index()

    @classmethod
    def open(cls, directory: str | os.PathLike, identity: StoreIdentity,
             capacity_bytes: int) -> DiskKVStore:
        return cls(directory, identity, capacity_bytes)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._index.clear()

    def __enter__(self) -> DiskKVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- lookups ---------------------------------------------------------------------------

    def block_keys(self, tokens: Sequence[int], extra_key: str | None) -> list[str]:
        """One key per full block of ``tokens``; a trailing partial block has none."""
        return chained_block_keys(self._fingerprint, self.identity.block_tokens, tokens, extra_key)

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def longest_prefix(self, tokens: Sequence[int], extra_key: str | None) -> int:
        """How many leading full blocks of ``tokens`` are stored (up to the first missing)."""
        keys = self.block_keys(tokens, extra_key)
        with self._lock:
            for n, key in enumerate(keys):
                if key not in self._index:
                    return n
            return len(keys)

    def stats(self) -> DiskKVStoreStats:
        with self._lock:
            return DiskKVStoreStats(files=len(self._index), bytes_used=self._bytes_used,
                                    **self._counters)

    def path_of(self, key: str) -> Path:
        if not KEY_PATTERN.fullmatch(key):
            raise ValueError(f"a block key is 64 lowercase hex digits, got {key!r}")
        return self.directory / (key + BLOCK_SUFFIX)

    # ---- write -----------------------------------------------------------------------------

    def write(self, key: str, tokens_of_block: Sequence[int], buffers: list[torch.Tensor]) -> bool:
        """Stores a block; True if it is stored (now or already). Raises ValueError for
        inputs that do not fit the identity; never raises OSError."""
        path = self.path_of(key)
        tokens = self._check_tokens(tokens_of_block)
        self._check_buffers(buffers)
        with self._lock:
            if key in self._index:  # content-addressed: the stored block is this one
                self._index.move_to_end(key)
                return True
            if self._closed:
                return False
        payload = pack_payload([t.detach().to("cpu") for t in buffers])
        metadata = {
            "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
            "identity": self._identity_json, "key": key, "tokens": json.dumps(tokens),
            "checksum": payload_checksum([payload]),
        }
        data = save_safetensors({"payload": payload}, metadata)
        with self._lock:
            if key in self._index or self._closed:  # written meanwhile by another thread
                return not self._closed
            if len(data) > self.capacity_bytes:
                self._counters["write_failures"] += 1
                self._warnings.warn("too_large", "disk KV store: a block of %d bytes exceeds "
                                    "the capacity, %d bytes", len(data), self.capacity_bytes)
                return False
            while self._index and (self._bytes_used + self._bytes_reserved + len(data)
                                   > self.capacity_bytes):
                self._remove_locked(next(iter(self._index)))
            if self._bytes_used + self._bytes_reserved + len(data) > self.capacity_bytes:
                self._counters["write_failures"] += 1  # other writes under way hold the room
                return False
            self._bytes_reserved += len(data)
        stored = self._write_file_atomically(path, data)
        with self._lock:
            self._bytes_reserved -= len(data)
            if not stored:
                self._counters["write_failures"] += 1
            elif not self._closed:
                self._bytes_used += len(data) - self._index.pop(key, 0)
                self._index[key] = len(data)
                self._counters["bytes_written"] += len(data)
        return stored

    def _check_tokens(self, tokens_of_block: Sequence[int]) -> list[int]:
        tokens = [int(t) for t in tokens_of_block]
        if len(tokens) != self.identity.block_tokens:
            raise ValueError(f"a block holds block_tokens={self.identity.block_tokens} tokens, "
                             f"got {len(tokens)}")
        return tokens

    def _check_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        shapes = self.identity.buffer_shapes
        if len(buffers) != len(shapes):
            raise ValueError(f"expected {len(shapes)} buffers (one per pool buffer), "
                             f"got {len(buffers)}")
        for i, (t, shape) in enumerate(zip(buffers, shapes)):
            expected = (self.identity.block_tokens, *shape)
            if tuple(t.shape) != expected:
                raise ValueError(f"buffer {i} has shape {tuple(t.shape)}, expected {expected}")
            if t.dtype != self.identity.torch_dtype:
                raise ValueError(f"buffer {i} has dtype {t.dtype}, "
                                 f"expected {self.identity.torch_dtype}")

    def _write_file_atomically(self, path: Path, data: bytes) -> bool:
        temp = path.with_name(f"{path.stem}.{self._temp_tag}-{secrets.token_hex(4)}{TEMP_SUFFIX}")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, path)
            return True
        except OSError as e:
            kind = errno.errorcode.get(e.errno, "OSError") if e.errno else type(e).__name__
            self._warnings.warn(f"write:{kind}", "disk KV store: cannot write to %s (%s: %s); "
                                "the block is not stored, serving goes on", self.directory,
                                kind, e.strerror or e)
            with contextlib.suppress(OSError):
                os.unlink(temp)
            return False

    # ---- read and delete -------------------------------------------------------------------

    def read(self, key: str, tokens_of_block: Sequence[int]) -> list[torch.Tensor] | None:
        """The block's buffers (CPU tensors), or None if it is not stored or fails a check."""
        found = self._read(key, self._check_tokens(tokens_of_block))
        return None if found is None else found[1]

    def read_recorded(self, key: str) -> tuple[list[int], list[torch.Tensor]] | None:
        """A block whose tokens the caller does not know (a warm start): its tokens as its
        header records them, and its buffers, after every other check (key, identity,
        tensors, checksum); None as ``read``."""
        return self._read(key, None)

    def recent_keys(self, limit: int) -> list[str]:
        """Up to ``limit`` stored keys, the most recently used first."""
        with self._lock:
            return list(reversed(self._index))[:limit]

    def _read(self, key: str, tokens: list[int] | None
              ) -> tuple[list[int], list[torch.Tensor]] | None:
        path = self.path_of(key)
        with self._lock:
            self._counters["reads"] += 1
            size = self._index.get(key)
        if size is None:
            return None
        try:
            with open(path, "rb") as f:  # a file that changed size is never read into memory
                data = f.read() if os.fstat(f.fileno()).st_size == size else None
        except OSError as e:  # vanished, or unreadable: either way no longer a block
            self._warnings.warn("read", "disk KV store: cannot read %s (%s)", path, e)
            with self._lock:
                self._remove_locked(key)
            return None
        try:
            if data is None:
                raise CorruptBlock("its size changed since it was indexed")
            tokens, buffers = self._verified_buffers(data, key, tokens)
        except CorruptBlock as e:
            logger.warning("disk KV store: deleting corrupt block %s: %s", path.name, e)
            with self._lock:
                self._counters["corrupt_deleted"] += 1
                self._remove_locked(key)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # persists recency for the next start-up
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            self._counters["read_hits"] += 1
            self._counters["bytes_read"] += len(data)
        return tokens, buffers

    def _verified_buffers(self, data: bytes, key: str, tokens: list[int] | None
                          ) -> tuple[list[int], list[torch.Tensor]]:
        """The block's tokens and buffers once every check passed (``tokens`` None: the
        header's, if they are a block's worth of token ids)."""
        try:
            metadata = header_metadata(data)
            tensors = load_safetensors(data)
            if tokens is None:
                tokens = self._check_tokens(json.loads(metadata.get("tokens", "null")))
        except Exception as e:  # safetensors raises its own error types on malformed input
            raise CorruptBlock(f"unreadable ({e})") from None
        checks = (("format", FORMAT_NAME), ("format_version", FORMAT_VERSION),
                  ("identity", self._identity_json), ("key", key), ("tokens", json.dumps(tokens)))
        for field, expected in checks:
            if metadata.get(field) != expected:
                raise CorruptBlock(f"its {field} is not the expected one")
        if sorted(tensors) != ["payload"]:
            raise CorruptBlock(f"holds tensors {sorted(tensors)}, expected ['payload']")
        try:
            buffers = unpack_payload(tensors["payload"], self.identity)
        except ValueError as e:
            raise CorruptBlock(str(e)) from None
        if metadata.get("checksum") != payload_checksum([tensors["payload"]]):
            raise CorruptBlock("payload checksum mismatch")
        return tokens, buffers

    def delete(self, key: str) -> None:
        with self._lock:
            self._remove_locked(key)

    def _remove_locked(self, key: str) -> None:
        if key in self._index:
            self._bytes_used -= self._index.pop(key)
        try:
            os.unlink(self.path_of(key))
        except FileNotFoundError:
            pass
        except OSError as e:
            self._warnings.warn("delete", "disk KV store: cannot delete %s (%s)", key, e)

    # ---- start-up --------------------------------------------------------------------------

    def _load_index(self) -> None:
        """Indexes this identity's block files by header, oldest mtime first; deletes this
        identity's temp files and the block files whose header is unreadable or misnamed."""
        found: list[tuple[int, str, int]] = []  # (mtime_ns, key, size)
        counts = dict.fromkeys(("temp", "corrupt", "foreign"), 0)
        for entry in os.scandir(self.directory):
            key = entry.name.removesuffix(BLOCK_SUFFIX)
            if entry.name.endswith(TEMP_SUFFIX):
                verdict = "temp" if f".{self._temp_tag}-" in entry.name else "skip"
            elif not entry.name.endswith(BLOCK_SUFFIX) or not KEY_PATTERN.fullmatch(key):
                verdict = "skip"
            else:
                try:
                    with safe_open(entry.path, framework="pt") as f:
                        verdict = self._header_verdict(f.metadata() or {}, key)
                    stat = entry.stat()
                except Exception:  # safetensors raises its own error types on a bad header
                    verdict = "corrupt"
            if verdict == "ours":
                found.append((stat.st_mtime_ns, key, stat.st_size))
            elif verdict == "foreign":
                counts["foreign"] += 1
            elif verdict != "skip":
                counts[verdict] += _unlink_quietly(entry.path)
        for _, key, size in sorted(found):
            self._index[key] = size
            self._bytes_used += size
        while self._bytes_used > self.capacity_bytes:
            self._remove_locked(next(iter(self._index)))
        self._counters["corrupt_deleted"] = counts["corrupt"]
        if counts["foreign"]:
            logger.warning("disk KV store %s: ignoring %d block files of another identity or "
                           "format version (neither read nor deleted)", self.directory,
                           counts["foreign"])
        if counts["corrupt"] or counts["temp"]:
            logger.warning("disk KV store %s: deleted %d unreadable block files and %d temp "
                           "files of interrupted writes", self.directory, counts["corrupt"],
                           counts["temp"])

    def _header_verdict(self, metadata: dict[str, str], key: str) -> str:
        """"ours", "foreign" (another identity or format version: left alone) or "corrupt"."""
        if metadata.get("format") != FORMAT_NAME:
            return "corrupt"
        if (metadata.get("format_version") != FORMAT_VERSION
                or metadata.get("identity") != self._identity_json):
            return "foreign"
        return "ours" if metadata.get("key") == key else "corrupt"


def _unlink_quietly(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError as e:
        logger.warning("disk KV store: cannot delete %s (%s)", path, e)
        return False
