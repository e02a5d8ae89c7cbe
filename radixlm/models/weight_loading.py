"""Reading checkpoint tensors from safetensors files into a model's (possibly fused) parameters."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

# Checkpoint entries that are derived state, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# One routed expert's tensor: "[<path>.]experts.<id>.<projection>.weight".
_EXPERT_TENSOR = re.compile(
    r"^(?P<experts>(?:.+\.)?experts)\.(?P<id>\d+)\.(?P<proj>[^.]+)\.weight$"
)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a model directory: the shards its index names, or every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise ValueError(f"{index} is not a valid safetensors index: {err}") from err
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise ValueError(f"{index} names weight files that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weight files in {model_dir}")
    return files


def iterate_safetensors(files: Iterable[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file; a corrupt file raises ``ValueError``."""
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as reader:
                for name in reader.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, reader.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as err:
            raise ValueError(f"cannot read weights from {file}: {err}") from err


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params: dict[str, tuple[str, str]],
) -> None:
    """Copies checkpoint tensors into ``model``'s parameters, by Hugging Face name.

    ``stacked_params`` maps a checkpoint module name (``q_proj``) to the fused module and
    shard it goes into (``("qkv_proj", "q")``). The leading ``model.`` of Hugging Face
    names is dropped. Every parameter must be written exactly once; a missing, unexpected
    or misshaped tensor raises ``ValueError`` naming it.

    A tensor named ``<path>.experts.<e>.<proj>.weight`` whose ``<path>.experts`` module has
    ``load_expert_weight`` (stacked MoE experts) goes there: the module copies it into
    expert e's slice and returns the shard key it filled; the module's
    ``checkpoint_shards(param_name)`` lists the keys a complete checkpoint fills. A module
    with ``load_weight(param_name, tensor)`` (a layer holding a tensor-parallel slice) takes
    its tensors through it.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    tied = getattr(model, "tie_word_embeddings", False)
    for hf_name, tensor in weights:
        name = hf_name.removeprefix("model.")
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        expert = _EXPERT_TENSOR.match(name)
        experts = expert and submodule_or_none(model, expert["experts"])
        if experts is not None and hasattr(experts, "load_expert_weight"):
            key = experts.load_expert_weight(int(expert["id"]), expert["proj"], tensor)
            loaded.add(f"{expert['experts']}.{key}")
            continue
        module_path, _, param_name = name.rpartition(".")
        parent_path, _, module_name = module_path.rpartition(".")
        if module_name in stacked_params:
            fused_name, shard = stacked_params[module_name]
            fused_path = f"{parent_path}.{fused_name}" if parent_path else fused_name
            fused = model.get_submodule(fused_path)
            fused.load_shard(shard, param_name, tensor)
            loaded.add(f"{fused_path}.{param_name}:{shard}")
            continue
        if name not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} matches no parameter of the model")
        owner = model.get_submodule(module_path) if module_path else model
        if hasattr(owner, "load_weight"):  # a layer that holds a slice (tensor parallelism)
            try:
                owner.load_weight(param_name, tensor)
            except ValueError as err:
                raise ValueError(f"checkpoint tensor {hf_name!r}: {err}") from None
            loaded.add(name)
            continue
        param = params[name]
        if param.shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(name)
    expected = set()
    for name in params:
        module_path, _, param_name = name.rpartition(".")
        module = model.get_submodule(module_path)
        shards = getattr(module, "shard_offsets", None)
        if hasattr(module, "checkpoint_shards"):
            expected.update(f"{name}:{shard}" for shard in module.checkpoint_shards(param_name))
        elif shards:
            expected.update(f"{name}:{shard}" for shard in shards)
        else:
            expected.add(name)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")


def submodule_or_none(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None
