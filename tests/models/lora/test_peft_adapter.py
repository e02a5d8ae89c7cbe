"""Tests of radixlm/models/lora/peft_adapter.py: PEFT adapter directories read as peft reads
them (weights, ranks, scalings), and everything a server cannot serve exactly refused with a
ValueError naming it."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from lora_adapters import ALL, TINY_SHAPES, peft_reference, write_config, write_peft_adapter
from safetensors.torch import load_file, save_file

from radixlm.models.lora.peft_adapter import adapter_rank, load_peft_adapter

ALL_MODULES = frozenset(ALL)


def load(path: Path, max_rank: int = 64, allowed: frozenset[str] | None = None,
         shapes: dict = TINY_SHAPES):
    return load_peft_adapter("ad", path, max_rank, 2, shapes, allowed)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:
    return tiny_model_dir()


@pytest.fixture(scope="module")
def good(model_dir, tmp_path_factory) -> Path:
    """A peft adapter of rank 4 on q, v and down_proj."""
    return write_peft_adapter(model_dir, tmp_path_factory.mktemp("good"), seed=1, r=4,
                              lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


def copy_of(adapter: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(adapter, target)
    return target


def edit_config(adapter: Path, **fields) -> None:
    config_file = adapter / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config.update(fields)
    config_file.write_text(json.dumps(config))


def peft_modules(model_dir: Path, adapter: Path) -> dict[tuple[int, str], object]:
    """peft's LoRA layers of the adapter, by (layer, projection)."""
    found = {}
    for name, module in peft_reference(model_dir, adapter).named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            parts = name.split(".")
            found[(int(parts[parts.index("layers") + 1]), parts[-1])] = module
    return found


@pytest.mark.parametrize("lora", [
    dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    dict(r=8, lora_alpha=16, target_modules=ALL, use_rslora=True),
    dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "gate_proj", "up_proj"],
         rank_pattern={"k_proj": 2, "layers.1.mlp.up_proj": 6},
         alpha_pattern={"gate_proj": 3, "layers.0.self_attn.q_proj": 32}),
    dict(r=2, lora_alpha=5, target_modules=["v_proj", "down_proj"], use_rslora=True,
         rank_pattern={"down_proj": 8}, alpha_pattern={"v_proj": 7}),
    dict(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"], layers_to_transform=[1]),
], ids=["plain", "rslora", "patterns", "rslora-patterns", "one-layer"])
def test_weights_ranks_and_scalings_are_peft_s(model_dir, tmp_path, lora):
    adapter = write_peft_adapter(model_dir, tmp_path / "ad", seed=7, **lora)
    read = load(adapter)
    modules = peft_modules(model_dir, adapter)
    assert set(read.weights) == set(modules)
    assert read.target_modules == frozenset(lora["target_modules"])
    for key, module in modules.items():
        a, b = read.weights[key]
        torch.testing.assert_close(a, module.lora_A["default"].weight, rtol=0, atol=0)
        torch.testing.assert_close(b, module.lora_B["default"].weight, rtol=0, atol=0)
        assert read.scaling(*key) == pytest.approx(module.scaling["default"], rel=1e-12), key
    assert read.rank == max(module.r["default"] for module in modules.values())
    assert adapter_rank(adapter) == max([lora["r"], *lora.get("rank_pattern", {}).values()])


def test_overlapping_alpha_patterns_resolve_as_peft_does(model_dir, tmp_path):
    adapter = write_peft_adapter(model_dir, tmp_path / "ad", seed=3, r=4, lora_alpha=8,
                                 target_modules=["q_proj"],
                                 alpha_pattern={"q_proj": 2, "layers.1.self_attn.q_proj": 32})
    read = load(adapter)
    for key, module in peft_modules(model_dir, adapter).items():
        assert read.scaling(*key) == pytest.approx(module.scaling["default"]), key


def test_rslora_scales_by_the_square_root_of_the_rank(tmp_path):
    from lora_adapters import write_raw_adapter

    adapter = write_raw_adapter(tmp_path / "ad", seed=0, rank=4, alpha=6)
    assert load(adapter).scaling(0, "q_proj") == pytest.approx(6 / 4)
    edit_config(adapter, use_rslora=True)
    assert load(adapter).scaling(1, "v_proj") == pytest.approx(6 / math.sqrt(4))


# Refusals: each names what is wrong ------------------------------------------------------


@pytest.mark.parametrize("fields, words", [
    ({"use_dora": True}, "DoRA"),
    ({"bias": "lora_only"}, "bias"),
    ({"bias": "all"}, "bias"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"peft_type": "IA3"}, "peft_type"),
    ({"r": 0}, "r must be"),
    ({"r": "8"}, "r must be"),
    ({"target_modules": "all-linear"}, "target_modules"),
    ({"target_modules": []}, "target_modules"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
    ({"lora_alpha": "big"}, "lora_alpha"),
])
def test_configs_a_server_cannot_serve_exactly_are_refused(good, tmp_path, fields, words):
    adapter = copy_of(good, tmp_path)
    edit_config(adapter, **fields)
    with pytest.raises(ValueError, match=words):
        load(adapter)


def test_a_rank_above_the_server_s_maximum_is_refused_naming_it(good):
    with pytest.raises(ValueError, match="rank 4 .*above --max-lora-rank 2"):
        load(good, max_rank=2)
    assert load(good, max_rank=4).rank == 4


def test_target_modules_the_model_lacks_are_refused(good):
    shapes = {k: v for k, v in TINY_SHAPES.items() if k != "down_proj"}
    with pytest.raises(ValueError, match=r"\['down_proj'\] are not projections of this model"):
        load(good, shapes=shapes)


def test_target_modules_outside_the_served_ones_are_refused(good):
    with pytest.raises(ValueError, match=r"\['down_proj'\] are not in --lora-target-modules"):
        load(good, allowed=frozenset({"q_proj", "v_proj"}))
    assert load(good, allowed=frozenset({"q_proj", "v_proj", "down_proj"})).rank == 4


def test_a_missing_config_is_refused(good, tmp_path):
    adapter = copy_of(good, tmp_path)
    (adapter / "adapter_config.json").unlink()
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load(adapter)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load(tmp_path / "nowhere")


def test_an_unparsable_config_is_refused(good, tmp_path):
    adapter = copy_of(good, tmp_path)
    (adapter / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="unreadable"):
        load(adapter)
    (adapter / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        load(adapter)


def test_a_pickled_bin_alone_is_refused_never_unpickled(good, tmp_path, monkeypatch):
    adapter = copy_of(good, tmp_path)
    tensors = load_file(adapter / "adapter_model.safetensors")
    (adapter / "adapter_model.safetensors").unlink()
    torch.save(tensors, adapter / "adapter_model.bin")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("unpickled"))
    with pytest.raises(ValueError, match="adapter_model.bin is a pickle"):
        load(adapter)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_corrupt_weights_file_is_refused(good, tmp_path, damage):
    adapter = copy_of(good, tmp_path)
    weights = adapter / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x00" * 64 + data,
                         "empty": b""}[damage])
    with pytest.raises(ValueError, match="adapter_model.safetensors is unreadable"):
        load(adapter)


def rewrite_tensors(adapter: Path, change) -> None:
    weights = adapter / "adapter_model.safetensors"
    tensors = load_file(weights)
    change(tensors)
    save_file(tensors, str(weights))


def test_tensors_missing_their_pair_or_misshapen_or_foreign_are_refused(good, tmp_path):
    key = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
    cases = [
        (lambda t: t.pop(key), "lora_A but not both"),
        (lambda t: t.update({key: torch.zeros(64, 3)}), "do not fit"),
        (lambda t: t.update({key.replace("layers.1", "layers.2"): t[key].clone()}),
         "2 layers"),
        (lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}),
         "is not a LoRA A or B"),
        (lambda t: t.update({key.replace("q_proj", "k_proj"): torch.zeros(32, 4)}),
         "outside its target modules"),
        (lambda t: t.clear() or t.update({"x": torch.zeros(1)}), "not a LoRA"),
    ]
    for index, (change, words) in enumerate(cases):
        adapter = copy_of(good, tmp_path / str(index))
        rewrite_tensors(adapter, change)
        with pytest.raises(ValueError, match=words):
            load(adapter)


def test_an_adapter_with_no_tensors_is_refused(good, tmp_path):
    adapter = copy_of(good, tmp_path)
    save_file({}, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="holds no LoRA weights"):
        load(adapter)


def test_adapter_rank_reads_the_config_alone(tmp_path):
    write_config(tmp_path, r=4, rank_pattern={"q_proj": 12})
    assert adapter_rank(tmp_path) == 12
    write_config(tmp_path, r=True)
    with pytest.raises(ValueError, match="positive integers"):
        adapter_rank(tmp_path)
