"""A GGUF's weights loaded into a model as the file stores them.

Each block-quantized matrix of a type served in blocks (``layers/gguf_weight.native_type``)
that lands whole on a projection or on the token embedding / output head becomes that
layer's packed weight (``GGUFBlockWeight``) over the file's bytes, memory-mapped: nothing is
dequantized or converted (the q/k rows llama.cpp permuted are reordered, a copy of those two;
the loader may then move the bytes as they are onto huge pages).
A fused projection (q/k/v, gate/up) whose checkpoint shards are all served in blocks holds
them stacked, each in its own type (``StackedWeight``). Everything else, norms and biases,
float matrices, and matrices of a type not served in blocks (each such type logged once,
with the count), is dequantized with the ``gguf`` package and loaded as a checkpoint
tensor through the model's own ``load_weights``.

Under tensor parallelism, and on devices other than the CPU, every matrix is dequantized at
load (with a warning): their kernels take a rank's or a device's share of plain weights.
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from radixlm.models.gguf.conversion import GGUFModel
from radixlm.models.gguf.gguf_file import matrix_shape
from radixlm.models.layers.gguf_weight import GGUFBlockWeight, StackedWeight, native_type
from radixlm.models.layers.linear import Linear
from radixlm.models.layers.vocab_parallel import VocabParallelEmbedding
from radixlm.models.layers.weight_formats import ConversionBuffer
from radixlm.models.weight_loading import submodule_or_none

logger = logging.getLogger(__name__)

_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


@dataclass
class _Matrix:
    """One checkpoint matrix bound for a layer's packed weight."""

    gguf_name: str
    tensor: object  # gguf ReaderTensor
    shard: str | None  # the fused layer's shard it fills, None: the layer's whole weight


def load_gguf_weights(model: nn.Module, path: Path, dtype: torch.dtype,
                      in_blocks: bool) -> dict[str, int]:
    """Loads the GGUF at ``path`` into ``model`` (built from its view's config). Where
    ``in_blocks``, block-quantized matrices are held as stored (see the module docstring);
    otherwise every tensor is dequantized. Returns counts: ``blocks`` (matrices held in
    blocks), ``dequantized`` (tensors loaded as floats), ``bytes`` (of the blocks held)."""
    gguf_model = GGUFModel.open(path)
    targets = _block_targets(model, gguf_model) if in_blocks else {}
    held, buffer = 0, ConversionBuffer()
    for module, matrices in targets.items():
        parts = [_block_weight(gguf_model, m, buffer) for m in matrices]
        packed = parts[0] if matrices[0].shard is None else StackedWeight(parts)
        if isinstance(module, VocabParallelEmbedding):
            held += module.take_packed(packed, dtype)
        else:
            held += module.take_packed(packed)
    in_layers = {m.gguf_name for matrices in targets.values() for m in matrices}
    rest = [t for t in gguf_model.reader.tensors
            if t.name not in in_layers and gguf_model.hf_name(t.name) is not None]
    _warn_dequantized(rest, in_blocks, path)
    model.load_weights(_float_tensors(gguf_model, rest))
    return {"blocks": len(in_layers), "dequantized": len(rest), "bytes": held}


def _block_targets(model: nn.Module, gguf_model: GGUFModel) -> dict[nn.Module, list[_Matrix]]:
    """The layers that hold GGUF blocks, each with its matrices in shard order: a layer
    whose every checkpoint matrix is served in blocks and has the layer's shape."""
    stacked = getattr(model, "stacked_params", {})
    tied = getattr(model, "tie_word_embeddings", False)
    found: dict[nn.Module, dict[str | None, _Matrix]] = defaultdict(dict)
    for tensor in gguf_model.reader.tensors:
        hf_name = gguf_model.hf_name(tensor.name)
        if hf_name is None or not native_type(tensor.tensor_type):
            continue
        name = hf_name.removeprefix("model.")
        if tied and name == "lm_head.weight":
            continue
        module_path, _, param = name.rpartition(".")
        parent, _, leaf = module_path.rpartition(".")
        shard = None
        if leaf in stacked:
            fused, shard = stacked[leaf]
            module_path = f"{parent}.{fused}" if parent else fused
        module = submodule_or_none(model, module_path)
        if param == "weight" and isinstance(module, (Linear, VocabParallelEmbedding)):
            found[module][shard] = _Matrix(tensor.name, tensor, shard)
    targets = {}
    for module, by_shard in found.items():
        order = list(getattr(module, "shard_offsets", None) or [None])
        if set(by_shard) == set(order) and all(
                _fits(module, by_shard[s]) for s in order):
            targets[module] = [by_shard[s] for s in order]
    return targets


def _fits(module: nn.Module, matrix: _Matrix) -> bool:
    """Whether the matrix has the shape of the layer's (shard's) weight, on one rank."""
    rows, columns = matrix_shape(matrix.tensor)
    if isinstance(module, VocabParallelEmbedding):
        return module.tp.size == 1 and (rows, columns) == tuple(module.weight.shape)
    if getattr(module, "tp", None) is not None and module.tp.size != 1:
        return False
    out = module.shard_offsets[matrix.shard][1] if matrix.shard else module.out_features
    return (rows, columns) == (out, module.in_features) and not getattr(
        module, "shard_starts", None)


def _block_weight(gguf_model: GGUFModel, matrix: _Matrix,
                  buffer: ConversionBuffer) -> GGUFBlockWeight:
    tensor = matrix.tensor
    blocks = gguf_model.hf_layout(tensor.name, tensor.data)  # (out, row bytes) uint8
    with warnings.catch_warnings():  # the file's map is read-only; the blocks are never written
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        blocks = torch.from_numpy(blocks)
    return GGUFBlockWeight(blocks, tensor.tensor_type, matrix_shape(tensor), buffer)


def _float_tensors(gguf_model: GGUFModel, tensors: list) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor in its layout) of each tensor, dequantized."""
    from gguf.quants import dequantize

    for tensor in tensors:
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        values = np.ascontiguousarray(gguf_model.hf_layout(tensor.name, values))
        yield gguf_model.hf_name(tensor.name), torch.from_numpy(values)


def _warn_dequantized(tensors: list, in_blocks: bool, path: Path) -> None:
    """One warning line per quantized type that is dequantized, with its tensor count."""
    counts = Counter(t.tensor_type.name for t in tensors
                     if t.tensor_type.name not in _FLOAT_TYPES
                     and not (in_blocks and native_type(t.tensor_type)))
    for name, count in sorted(counts.items()):
        reason = ("no block kernel serves this type" if in_blocks
                  else "block weights are served on one CPU rank only")
        logger.warning("GGUF %s: %d %s tensors dequantized to float (%s)", path.name, count,
                       name, reason)

