"""A LoRA adapter as PEFT saves it, read and checked against the model it is to serve.

A PEFT LoRA directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` (a
pickled ``adapter_model.bin`` is refused: files read back are never unpickled). For each
adapted projection ``W`` (out, in) of layer i it stores ``lora_A`` (r, in) and ``lora_B``
(out, r); the adapted projection is ``W x + scaling * B (A x)`` with ``scaling = lora_alpha
/ r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``. Per-module ranks and alphas
(``rank_pattern``, ``alpha_pattern``) are honoured.

Everything a server cannot serve exactly is refused with a ``ValueError`` naming it: another
PEFT type, DoRA, biases, extra trained modules (``modules_to_save``: embeddings, heads),
``fan_in_fan_out``, a rank above the server's maximum, a target module the model lacks or
the server does not adapt, tensors missing or of the wrong shape, an unreadable file.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load

from radixlm.models.lora.projections import PROJECTIONS

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_TENSOR_NAME = re.compile(
    r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
    r"\.lora_([AB])(?:\.default)?\.weight$")


@dataclass
class LoraAdapter:
    """One adapter's weights on the host, by (layer, projection): A (r, in), B (out, r)."""

    name: str
    path: str
    rank: int
    """The largest rank of its modules (what the pool must hold)."""
    target_modules: frozenset[str]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    scalings: dict[tuple[int, str], float] = field(repr=False)
    fingerprint: str = ""
    """A hash of its config and weights files: what its KV depends on (a name may be
    loaded again with other weights; the cache keys on this, not the name)."""

    def scaling(self, layer: int, projection: str) -> float:
        return self.scalings[(layer, projection)]


def load_peft_adapter(name: str, path: str | Path, max_rank: int, num_layers: int,
                      shapes: dict[str, tuple[int, int]],
                      allowed_modules: frozenset[str] | None = None) -> LoraAdapter:
    """Reads and checks the adapter at ``path``. ``shapes`` maps each projection the model
    has to its full (out, in) weight shape; ``allowed_modules``: the projections the server
    adapts (``--lora-target-modules``; None: all it has)."""
    path = Path(path)
    config = _read_config(path)
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"adapter {name!r}: r must be a positive integer, got {rank!r}")
    targets = _target_modules(name, config)
    unknown = targets - set(shapes)
    if unknown:
        raise ValueError(f"adapter {name!r}: target modules {sorted(unknown)} are not "
                         f"projections of this model (it has {sorted(shapes)})")
    if allowed_modules is not None and not targets <= allowed_modules:
        raise ValueError(f"adapter {name!r}: target modules "
                         f"{sorted(targets - allowed_modules)} are not in "
                         f"--lora-target-modules ({sorted(allowed_modules)})")
    tensors, fingerprint = _read_tensors(name, path)
    weights: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        found = _TENSOR_NAME.match(key)
        if found is None:
            raise ValueError(f"adapter {name!r}: tensor {key!r} is not a LoRA A or B of a "
                             f"decoder projection (embedding, head and bias adapters are "
                             f"not served)")
        layer, projection, which = int(found[1]), found[2], found[3]
        if projection not in targets or not 0 <= layer < num_layers:
            raise ValueError(f"adapter {name!r}: tensor {key!r} is outside its target "
                             f"modules or the model's {num_layers} layers")
        weights.setdefault((layer, projection), {})[which] = tensor
    pairs, scalings, largest = {}, {}, 0
    for (layer, projection), found in sorted(weights.items()):
        if set(found) != {"A", "B"}:
            raise ValueError(f"adapter {name!r}: layer {layer} {projection} has lora_"
                             f"{''.join(found)} but not both A and B")
        a, b = found["A"], found["B"]
        out_features, in_features = shapes[projection]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (
                out_features, r):
            raise ValueError(f"adapter {name!r}: layer {layer} {projection}: A {tuple(a.shape)}"
                             f" and B {tuple(b.shape)} do not fit ({out_features}, "
                             f"{in_features}) at one rank")
        if r > max_rank:
            raise ValueError(f"adapter {name!r}: rank {r} (layer {layer} {projection}) is "
                             f"above --max-lora-rank {max_rank}")
        pairs[(layer, projection)] = (a.float(), b.float())
        scalings[(layer, projection)] = _scaling(config, layer, projection, r)
        largest = max(largest, r)
    if not pairs:
        raise ValueError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    fingerprint = hashlib.sha256(json.dumps(config, sort_keys=True).encode()
                                 + fingerprint.encode()).hexdigest()
    return LoraAdapter(name, str(path), largest, frozenset(targets), pairs, scalings,
                       fingerprint)


def adapter_rank(path: str | Path) -> int:
    """The highest rank the adapter at ``path`` declares (``r`` and ``rank_pattern``), from
    its config alone (ValueError where it is unreadable)."""
    config = _read_config(Path(path))
    ranks = [config.get("r"), *(config.get("rank_pattern") or {}).values()]
    if not all(isinstance(r, int) and not isinstance(r, bool) and r > 0 for r in ranks):
        raise ValueError(f"{path}: ranks must be positive integers, got {ranks}")
    return max(ranks)


def _read_config(path: Path) -> dict:
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise ValueError(f"no {CONFIG_FILE} in {str(path)!r}: not a PEFT adapter directory")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{config_file}: unreadable ({err})") from err
    if not isinstance(config, dict):
        raise ValueError(f"{config_file}: not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{config_file}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, refused in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out")):
        if config.get(key):
            raise ValueError(f"{config_file}: {refused} adapters are not served")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{config_file}: bias {config['bias']!r} (trained biases) is not "
                         f"served")
    if config.get("modules_to_save"):
        raise ValueError(f"{config_file}: modules_to_save {config['modules_to_save']} "
                         f"(fully trained modules) are not served")
    return config


def _target_modules(name: str, config: dict) -> set[str]:
    targets = config.get("target_modules")
    if isinstance(targets, str):  # PEFT allows a regex or "all-linear"
        raise ValueError(f"adapter {name!r}: target_modules {targets!r} must be a list of "
                         f"projection names")
    if not isinstance(targets, list) or not targets:
        raise ValueError(f"adapter {name!r}: target_modules must be a non-empty list")
    targets = {str(t).rsplit(".", 1)[-1] for t in targets}
    if not targets <= set(PROJECTIONS):
        raise ValueError(f"adapter {name!r}: target modules {sorted(targets - set(PROJECTIONS))}"
                         f" are not served (served: {list(PROJECTIONS)})")
    return targets


def _read_tensors(name: str, path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """The weights file's tensors, and a hash of its bytes."""
    weights_file = path / WEIGHTS_FILE
    if not weights_file.is_file():
        pickled = (path / "adapter_model.bin").is_file()
        raise ValueError(f"adapter {name!r}: no {WEIGHTS_FILE} in {str(path)!r}"
                         + (" (adapter_model.bin is a pickle, never loaded: save the adapter"
                            " with safe_serialization)" if pickled else ""))
    try:
        data = weights_file.read_bytes()
        return load(data), hashlib.sha256(data).hexdigest()
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"adapter {name!r}: {weights_file} is unreadable ({err})") from err


def _scaling(config: dict, layer: int, projection: str, rank: int) -> float:
    """``lora_alpha`` (or the ``alpha_pattern`` entry matching the module's name, as PEFT
    matches it) over the rank, or over its square root with ``use_rslora``."""
    alpha = config.get("lora_alpha", 8)
    block = "self_attn" if projection in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    module = f"model.layers.{layer}.{block}.{projection}"
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):  # the first match wins, as in PEFT
            alpha = value
            break
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"lora_alpha must be a number, got {alpha!r}")
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
