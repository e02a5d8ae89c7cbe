"""Builds a model from a Hugging Face directory: config -> class -> weights, in the chosen dtype."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

import torch
from torch import nn

from radixlm.kernels.cpu_ops import fused_ops, huge_pages
from radixlm.kernels.cpu_ops.execution_plan import TORCH_CHOICES, CpuExecutionPlan
from radixlm.models.gguf.conversion import gguf_source
from radixlm.models.layers.cpu_weight_layout import lay_out_for_cpu, uses_blocked_layout
from radixlm.models.layers.linear import Linear
from radixlm.models.layers.tensor_parallel import SINGLE, TensorParallel, building
from radixlm.models.layers.vocab_parallel import VocabParallelEmbedding
from radixlm.models.layers.weight_formats import PackedWeight, pack_weights
from radixlm.models.layers.weight_storage import SIXTEEN_BIT_STORAGE, store_in_16_bits
from radixlm.models.model_config import ModelConfig
from radixlm.models.registry import model_class
from radixlm.models.weight_loading import iterate_safetensors, safetensors_files

logger = logging.getLogger(__name__)


def load_model(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, max_position: int,
    tp: TensorParallel = SINGLE, weight_format: str | None = None,
    plan: CpuExecutionPlan = TORCH_CHOICES,
) -> nn.Module:
    """The model of ``config.architecture`` with its checkpoint weights, in eval mode.

    ``max_position`` bounds the positions the model will see (the serving context length);
    dynamic NTK RoPE scales its frequencies for it. ``tp``: the share of a tensor-parallel
    rank (a size that does not divide the model's heads or intermediate sizes is a
    ``ValueError``).
    ``weight_format``: a weight-only format (``weight_formats.py``) the projections and the
    output head are packed into, from the checkpoint's float32 weights (int8 by column pairs
    for a bfloat16 model on a CPU where the plan keeps kernel copies and runs column pairs);
    ``SIXTEEN_BIT_STORAGE``: they are kept in 16 bits and computed
    in float32 (``weight_storage.py``; for a float32 ``dtype``). In a float32 ``dtype`` on a
    CPU with the fused kernels on, ``fp16wo``'s weights are stored so too, all in float16,
    and ``int8wo``'s in column blocks where they fit (their figures against rows:
    ``weight_storage.py``, ``weight_formats.py``). Without one, a bfloat16 model on a CPU
    gets them in its kernel's layout (``cpu_weight_layout.py``), with the fused CPU kernels'
    own copies where the plan keeps them. ``plan``: the runner's CPU plan
    (``kernels/cpu_ops/execution_plan.py``), which every linear layer and packed weight holds.
    """
    cls = model_class(config.architecture)
    gguf_file = gguf_source(config.path)
    if gguf_file is not None and weight_format not in (None, "gguf"):
        raise ValueError(f"{gguf_file.name} is served in its own formats; quantization "
                         f"{weight_format!r} applies to safetensors checkpoints")
    weight_format = None if weight_format == "gguf" else weight_format
    files = None if gguf_file is not None else safetensors_files(config.path)
    with torch.device(device), building(tp), _without_init(gguf_file is not None):
        model = cls(config.text_config, max_position=max_position)
    if gguf_file is None:
        model.load_weights(iterate_safetensors(files))
    else:
        _load_gguf(model, gguf_file, dtype, device, tp)
    for module in model.modules():
        if isinstance(module, (Linear, VocabParallelEmbedding)):
            module.plan = plan
    float32_kernels = (dtype == torch.float32 and torch.device(device).type == "cpu"
                       and fused_ops.active() is not None)
    half_in_float32 = weight_format == "fp16wo" and float32_kernels
    if weight_format == SIXTEEN_BIT_STORAGE or half_in_float32:
        counts = store_in_16_bits(model, half_only=half_in_float32)
        logger.info("weights stored in 16 bits, computed in float32: %.1f MiB (%d bfloat16, "
                    "exact; %d float16, rounded; %d left float32)", counts["bytes"] / 2**20,
                    counts["bfloat16"], counts["float16"], counts["float32"])
    elif weight_format is not None:
        by_pairs = (plan.keep_rows and plan.pair_kernels and dtype == torch.bfloat16
                    and torch.device(device).type == "cpu")
        packed = pack_weights(model, weight_format, by_pairs, by_blocks=float32_kernels)
        logger.info("weights packed as %s: %.1f MiB", weight_format, packed / 2**20)
    # RoPE frequencies stay float32; parameters take the serving dtype, except those marked
    # ``keep_float32`` (e.g. an MoE router's score correction bias).
    for param in model.parameters():
        if not getattr(param, "keep_float32", False):
            param.data = param.data.to(dtype)
    if uses_blocked_layout(device, dtype, weight_format):
        laid_out = lay_out_for_cpu(model, plan)
        logger.info("weights laid out for oneDNN's bfloat16 kernels: %.1f MiB", laid_out / 2**20)
    model.train(False).requires_grad_(False)
    if torch.device(device).type == "cpu":
        moved = huge_pages.move_to_huge_pages(_weight_tensors(model))
        logger.info("weights on huge pages: %.1f MiB", moved / 2**20)
    return model


def _weight_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The model's parameters, buffers and packed weights' tensors, a GGUF's blocks among
    them: read in place from the file's mapping until they are moved (the mapping is then
    dropped, so resident memory holds them once)."""
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if isinstance(packed, PackedWeight):
            tensors += packed.tensors()
    return tensors


@contextlib.contextmanager
def _without_init(skip: bool) -> Iterator[None]:
    """Where the weights will be replaced (a GGUF's blocks), the model is built without
    initialising them: untouched memory, freed as the blocks take their place. torch's init
    functions (transformers' list of them and of the modules that bind them) are no-ops
    meanwhile; transformers' own ``no_init_weights`` would import its modeling code, and
    with it torch's compiler and triton (seconds of start-up, tens of MiB a process)."""
    if not skip:
        yield
        return
    from transformers.initialization import TORCH_INIT_FUNCTIONS, TORCH_MODULES_TO_PATCH

    bound = [sys.modules[name] for name in TORCH_MODULES_TO_PATCH if name in sys.modules]
    originals = [(module, name, getattr(module, name))
                 for module in bound for name in TORCH_INIT_FUNCTIONS if hasattr(module, name)]
    for module, name, _ in originals:
        setattr(module, name, _no_init)
    try:
        yield
    finally:
        for module, name, function in originals:
            setattr(module, name, function)


def _no_init(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def _load_gguf(model: nn.Module, path, dtype: torch.dtype, device, tp: TensorParallel) -> None:
    from radixlm.models.gguf.native_weights import load_gguf_weights

    in_blocks = tp.size == 1 and torch.device(device).type == "cpu"
    if not in_blocks:
        logger.warning("GGUF %s: block weights are served on one CPU rank; dequantizing them",
                       path.name)
    counts = load_gguf_weights(model, path, dtype, in_blocks)
    logger.info("GGUF %s: %d matrices held in blocks (%.1f MiB, as the file stores them), %d "
                "tensors loaded as floats", path.name, counts["blocks"], counts["bytes"] / 2**20,
                counts["dequantized"])


def validate_split(config: ModelConfig, tp_size: int) -> None:
    """Raises ``ValueError`` naming what stops the model from splitting into ``tp_size``
    tensor-parallel shares (head counts or intermediate sizes the size does not divide):
    builds rank 0's share without memory (on the meta device), as every rank will."""
    with torch.device("meta"), building(TensorParallel(0, tp_size)):
        model_class(config.architecture)(config.text_config, max_position=1)
