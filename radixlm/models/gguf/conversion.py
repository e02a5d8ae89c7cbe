"""A GGUF file (llama.cpp's format) as a Hugging Face model directory the runtime loads.

Two forms, both written whole or not at all (into a temporary sibling directory renamed into
place at the end):

- a *view* (``write_gguf_view``): ``config.json``, the tokenizer files and
  ``generation_config.json`` rebuilt from the metadata, and ``gguf_source.json`` naming the
  file (its resolved path, size and modification time). No weights: the loader reads them
  from the GGUF itself, block-quantized matrices as they are stored
  (``native_weights.py``). This is how a user's ``.gguf`` is served.
- a *conversion* (``convert_gguf_to_hf``): the same files plus a float32
  ``model.safetensors`` of every tensor dequantized with the ``gguf`` package, renamed and
  put in Hugging Face's layout (``architectures.to_hf_layout``). The default model is kept
  so, in its best serving format.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from radixlm.models.gguf.architectures import (
    ROPE_FACTOR_TENSORS,
    GGUFArchitecture,
    architecture,
    build_config,
    expected_shape,
    expected_tensors,
    hf_tensor_name,
    to_hf_layout,
)
from radixlm.models.gguf.gguf_file import Metadata, matrix_shape, open_reader
from radixlm.models.gguf.tokenizer import end_of_turn_ids, write_tokenizer

logger = logging.getLogger(__name__)

GGUF_SOURCE_FILE = "gguf_source.json"


@dataclass(frozen=True)
class GGUFModel:
    """An opened, checked GGUF: its reader, metadata, architecture and Hugging Face config."""

    path: Path
    reader: object  # gguf_header.GGUFHeader (gguf.GGUFReader for a big-endian file)
    meta: Metadata
    arch: str
    spec: GGUFArchitecture
    config: dict

    @classmethod
    def open(cls, gguf_path: str | os.PathLike) -> GGUFModel:
        """Raises FileNotFoundError for a missing file and ValueError, naming the file, for a
        corrupt or truncated one, an unserved architecture or an unmappable tensor."""
        path = Path(gguf_path)
        reader = open_reader(path)
        meta = Metadata(reader, path)
        arch, spec = architecture(meta)
        if "tokenizer.ggml.model" not in reader.fields:
            raise ValueError(f"GGUF file {str(path)!r} carries no tokenizer (tokenizer.ggml.model)")
        described = {t.name: (np.asarray(t.data, dtype=np.float32)
                              if t.name in ROPE_FACTOR_TENSORS else [int(d) for d in t.shape])
                     for t in reader.tensors}
        config = build_config(meta, arch, described)
        model = cls(path, reader, meta, arch, spec, config)
        names = set()
        for tensor in reader.tensors:
            name = model.hf_name(tensor.name)
            if name is None:
                continue
            names.add(name)
            expected, shape = expected_shape(name, config), matrix_shape(tensor)
            if expected is not None and shape != expected:
                raise ValueError(
                    f"GGUF file {str(path)!r}: tensor {tensor.name!r} has shape {shape}, the "
                    f"metadata implies {expected}")
        missing = sorted(expected_tensors(spec, config) - names)
        if missing:
            raise ValueError(
                f"GGUF file {str(path)!r} lacks {len(missing)} tensors, e.g. {missing[:3]}")
        return model

    def hf_name(self, gguf_name: str) -> str | None:
        return hf_tensor_name(gguf_name, self.spec, self.config["num_hidden_layers"], self.path)

    def hf_layout(self, gguf_name: str, weight):
        return to_hf_layout(gguf_name, weight, self.spec, self.config, self.path)


def write_gguf_view(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Writes the view of ``gguf_path`` (see the module docstring) at ``out_dir``."""
    model = GGUFModel.open(gguf_path)
    resolved = model.path.resolve()
    stat = resolved.stat()
    source = {"path": str(resolved), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}

    def write(directory: Path) -> None:
        _write_description(directory, model)
        _write_json(directory / GGUF_SOURCE_FILE, source)

    return _publish(Path(out_dir), write)


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a view directory stands for, or None for an ordinary directory. A file
    that has changed or gone since the view was written is a ``ValueError`` naming it."""
    pointer = model_dir / GGUF_SOURCE_FILE
    if not pointer.is_file():
        return None
    try:
        source = json.loads(pointer.read_text())
        path, size, mtime = Path(source["path"]), int(source["size"]), int(source["mtime_ns"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{pointer} is not a valid GGUF source record: {err}") from None
    if not path.is_file():
        raise ValueError(f"the GGUF file {str(path)!r} behind {model_dir} no longer exists")
    stat = path.stat()
    if (stat.st_size, stat.st_mtime_ns) != (size, mtime):
        raise ValueError(f"the GGUF file {str(path)!r} changed since {model_dir} was written; "
                         "remove that directory to rebuild it")
    return path


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, progress: bool = True
) -> Path:
    """Converts ``gguf_path`` into a Hugging Face directory at ``out_dir`` and returns it.

    The directory holds ``config.json``, a float32 ``model.safetensors`` with every parameter
    the config implies (``lm_head.weight`` only when the GGUF has ``output.weight``),
    ``tokenizer.json``, ``tokenizer_config.json`` (chat template, special tokens,
    ``add_bos_token`` as the GGUF states) and ``generation_config.json``. Raises
    FileNotFoundError if ``gguf_path`` is missing, FileExistsError if ``out_dir`` exists and
    is not empty, and ValueError (naming the path) as ``GGUFModel.open`` does.
    """
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    model = GGUFModel.open(gguf_path)
    _refuse_non_empty(Path(out_dir))
    tensors: dict[str, np.ndarray] = {}
    for tensor in tqdm(model.reader.tensors, desc="radixlm: dequantizing GGUF",
                       disable=not progress):
        hf_name = model.hf_name(tensor.name)
        if hf_name is None:
            continue
        weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        tensors[hf_name] = np.ascontiguousarray(model.hf_layout(tensor.name, weight))

    def write(directory: Path) -> None:
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        _write_description(directory, model)

    out = _publish(Path(out_dir), write)
    logger.info("converted %s into %s", model.path, out)
    return out


def _write_description(directory: Path, model: GGUFModel) -> None:
    """config.json, generation_config.json and the tokenizer files."""
    config = model.config
    _write_json(directory / "config.json", config)
    write_tokenizer(model.path, directory, config["max_position_embeddings"],
                    model.meta.get("tokenizer.ggml.pre"), model.arch)
    eos = [config["eos_token_id"]] if config["eos_token_id"] is not None else []
    eos += end_of_turn_ids(directory, model.arch)
    generation = {"bos_token_id": config["bos_token_id"],
                  "eos_token_id": eos[0] if len(eos) == 1 else (eos or None)}
    _write_json(directory / "generation_config.json", generation)


def _refuse_non_empty(out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"output directory {str(out)!r} exists and is not empty")


def _publish(out: Path, write: Callable[[Path], None]) -> Path:
    """Runs ``write`` into a staging sibling of ``out`` and renames it to ``out``: ``out``
    appears complete or not at all."""
    _refuse_non_empty(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        write(staging)
        _apply_umask_permissions(staging)
        if out.exists():
            out.rmdir()  # empty (checked above); os.replace cannot replace a directory portably
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _apply_umask_permissions(directory: Path) -> None:
    """Give the staged directory the modes a plain mkdir/open would (mkdtemp makes it 0700)."""
    # A fresh file's mode reveals the umask without os.umask's process-wide set-and-restore.
    probe = directory / ".umask-probe"
    probe.touch(mode=0o666)
    file_mode = probe.stat().st_mode & 0o777
    probe.unlink()
    for child in directory.iterdir():
        child.chmod(file_mode)
    directory.chmod(file_mode | ((file_mode & 0o444) >> 2))  # read bit implies search bit


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
