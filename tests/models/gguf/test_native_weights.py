"""A GGUF served as the file stores it (radixlm/models/gguf/native_weights.py), against
transformers on the same weights dequantized by the ``gguf`` package.

The tiny files are written with gguf's writer and quantizer, each layer's matrices in another
of the 32-value block types (the K-quants, which gguf cannot write, are in the gemma-3 file
of test_gemma3_gguf.py and in the kernels' own tests).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from fused_decode_checks import PROMPTS as FUSED_PROMPTS
from fused_decode_checks import assert_fused_equals_modules, count_fused_runs
from fused_kernels import enable_or_skip
from gguf import GGMLQuantizationType as QType
from test_conversion import (
    CHAT_TEMPLATE,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    MERGES,
    SPECIALS,
    gguf_name,
    hf_weights,
    llama_cpp_permute,
    tiny_vocab,
)
from transformers import AutoModelForCausalLM

import radixlm
from radixlm.kernels.cpu_ops.fused_ops import ProjectionKernel
from radixlm.models.default_model import resolve_model_path
from radixlm.models.gguf.conversion import convert_gguf_to_hf
from radixlm.models.layers.gguf_weight import GGUFBlockWeight, StackedWeight

LAYER_TYPES = [QType.Q4_0, QType.Q5_1]
"""Each layer's matrices' type; the embedding Q8_0, layer 0's v Q4_1, layer 1's v Q5_0."""
V_TYPES = [QType.Q4_1, QType.Q5_0]
PROMPTS = [[5, 9, 30, 41, 77, 12, 3, 99, 17, 64], [8, 100, 7], [3] * 20]


def write_quantized_gguf(path, arch: str = "llama", extra: dict | None = None,
                         raw_types: dict | None = None) -> None:
    """A tiny GGUF of ``arch`` whose matrices are block-quantized (see LAYER_TYPES);
    ``extra``: more tensors, or replacements of the generated ones (name -> array, with
    ``raw_types[name]`` if they are raw blocks)."""
    writer = gguf.GGUFWriter(path, arch)
    for add, value in [("block_count", LAYERS), ("context_length", 256),
                       ("embedding_length", HIDDEN), ("feed_forward_length", 96),
                       ("head_count", HEADS), ("head_count_kv", KV_HEADS),
                       ("key_length", HEAD_DIM), ("value_length", HEAD_DIM),
                       ("rope_dimension_count", HEAD_DIM), ("rope_freq_base", 50000.0),
                       ("layer_norm_rms_eps", 1e-6), ("vocab_size", len(tiny_vocab())),
                       ("tokenizer_model", "gpt2"), ("tokenizer_pre", "default"),
                       ("token_list", tiny_vocab()), ("token_merges", MERGES),
                       ("bos_token_id", 1), ("eos_token_id", 2), ("add_bos_token", False),
                       ("chat_template", CHAT_TEMPLATE)]:
        getattr(writer, f"add_{add}")(value)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tiny_vocab()) - len(SPECIALS)))
    for hf_name, weight in hf_weights(arch, with_output=False, seed=7).items():
        name = gguf_name(hf_name)
        if name in (extra or {}):
            continue
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            weight = llama_cpp_permute(weight, HEADS if "attn_q" in name else KV_HEADS)
        if weight.ndim == 1:
            writer.add_tensor(name, weight)
            continue
        qtype = QType.Q8_0
        if name.startswith("blk."):
            layer = int(name.split(".")[1])
            qtype = V_TYPES[layer] if "attn_v" in name else LAYER_TYPES[layer]
        writer.add_tensor(name, gguf.quants.quantize(weight * 0.2, qtype), raw_dtype=qtype)
    for name, value in (extra or {}).items():
        writer.add_tensor(name, value, raw_dtype=(raw_types or {}).get(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory):
    """(the GGUF, its float32 conversion: the reference's weights)."""
    directory = tmp_path_factory.mktemp("gguf")
    write_quantized_gguf(directory / "tiny-llama.gguf")
    reference = convert_gguf_to_hf(directory / "tiny-llama.gguf", directory / "hf",
                                   progress=False)
    return directory / "tiny-llama.gguf", reference


@pytest.fixture(scope="module")
def gguf_engine(quantized_gguf, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RADIXLM_CACHE", str(cache))
        engine = radixlm.Engine(str(quantized_gguf[0]), dtype="float32", max_total_tokens=2048,
                                chunked_prefill_step_ms=None)
    yield engine
    engine.shutdown()


def test_logprobs_and_greedy_tokens_equal_transformers_on_the_dequantized_weights(
        gguf_engine, quantized_gguf):
    reference = AutoModelForCausalLM.from_pretrained(quantized_gguf[1], dtype=torch.float32)
    greedy = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    outs = gguf_engine.generate(input_ids=PROMPTS, sampling_params=greedy, return_logprob=True,
                                logprob_start_len=0)
    for ids, out in zip(PROMPTS, outs):
        with torch.no_grad():
            logits = reference(torch.tensor([ids])).logits[0].float()
        expected = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])
        got = torch.tensor([entry[0] for entry in out["meta_info"]["input_token_logprobs"][1:]])
        torch.testing.assert_close(got, expected[:, 0], atol=1e-4, rtol=0)
        with torch.no_grad():
            tokens = reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)[0, len(ids):]
        assert out["output_ids"] == tokens.tolist()


LOAD_IMPORTS = """
import json, sys, torch
from radixlm.models.default_model import resolve_model_path
from radixlm.models.loader import load_model
from radixlm.models.model_config import ModelConfig
config = ModelConfig.from_path(resolve_model_path(sys.argv[1]))
load_model(config, torch.float32, torch.device("cpu"), 256)
print(json.dumps({name: name in sys.modules for name in
                  ["torch._dynamo", "triton", "transformers.modeling_utils"]}))
"""


def test_loading_a_gguf_imports_neither_torch_compiler_nor_transformers_models(tmp_path):
    path = tmp_path / "tiny-llama.gguf"
    write_quantized_gguf(path)
    env = {**os.environ, "RADIXLM_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", LOAD_IMPORTS, str(path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert imported == {"torch._dynamo": False, "triton": False,
                        "transformers.modeling_utils": False}


@pytest.mark.parametrize("huge", [False, True], ids=["mapped", "huge_pages"])
def test_block_matrices_are_held_as_the_file_stores_them(quantized_gguf, tmp_path,
                                                         monkeypatch, huge):
    """Without huge pages the blocks are views of the file's mapping; with them they are
    copied, byte for byte, into one huge-page mapping and the file is no longer mapped."""
    from radixlm.kernels.cpu_ops import huge_pages
    from radixlm.models.loader import load_model
    from radixlm.models.model_config import ModelConfig

    if huge and not huge_pages.available():
        pytest.skip("transparent huge pages are off here")
    monkeypatch.setenv("RADIXLM_CACHE", str(tmp_path))
    view = resolve_model_path(str(quantized_gguf[0]))
    assert not list(view.glob("*.safetensors"))  # no converted copy on disk
    previous = huge_pages.enable(huge)
    try:
        model = load_model(ModelConfig.from_path(view), torch.float32, torch.device("cpu"), 256)
    finally:
        huge_pages.enable(previous)
    file = str(quantized_gguf[0].resolve())
    layer = model.layers[1]
    qkv = layer.self_attn.qkv_proj.packed
    assert isinstance(qkv, StackedWeight) and layer.self_attn.qkv_proj.weight is None
    assert [p.qtype for p in qkv.parts] == [QType.Q5_1, QType.Q5_1, QType.Q5_0]
    down = layer.mlp.down_proj.packed
    assert isinstance(down, GGUFBlockWeight) and down.qtype == QType.Q5_1
    embedding = model.embed_tokens.packed
    assert embedding.qtype == QType.Q8_0 and model.embed_tokens.weight is None
    blocks = [down.blocks, embedding.blocks, *(part.blocks for part in qkv.parts)]
    if huge:
        gc.collect()  # readers that earlier tests left in reference cycles map it too
        assert file not in _mapped_files()
        assert len({b.untyped_storage().data_ptr() for b in blocks}) == 1
    else:
        assert _mapped_file(down.blocks.data_ptr()) == file
        assert _mapped_file(embedding.blocks.data_ptr()) == file
    stored = {t.name: t for t in gguf.GGUFReader(quantized_gguf[0]).tensors}
    np.testing.assert_array_equal(down.blocks.numpy(), stored["blk.1.ffn_down.weight"].data)
    np.testing.assert_array_equal(embedding.blocks.numpy(), stored["token_embd.weight"].data)


@pytest.mark.parametrize("dtype, requests", [("float32", 3), ("bfloat16", 1), ("bfloat16", 3)])
def test_fused_decode_steps_over_the_blocks_equal_the_module_path_to_the_bit(
        quantized_gguf, tmp_path, monkeypatch, dtype, requests):
    """Every layer's decode step as one call of the kernels (the stack), each projection on
    the blocks as stored: q, k and v of two types in one call (``quantized_matmul_parts``)."""
    enable_or_skip()
    monkeypatch.setenv("RADIXLM_CACHE", str(tmp_path))
    fused_runs = count_fused_runs(monkeypatch)
    used = assert_fused_equals_modules(resolve_model_path(str(quantized_gguf[0])), fused_runs,
                                       monkeypatch, FUSED_PROMPTS[-requests:], dtype=dtype)
    assert used == [ProjectionKernel.GGUF] * 4
    assert fused_runs["stacked"] > 0


def _mappings() -> list[tuple[int, int, str | None]]:
    """This process's mappings (Linux's /proc/self/maps): start, end, and the file mapped
    (None for anonymous memory)."""
    with open("/proc/self/maps") as maps:
        rows = [line.split(maxsplit=5) for line in maps]
    return [(*(int(x, 16) for x in fields[0].split("-")),
             fields[5].strip() if len(fields) == 6 else None) for fields in rows]


def _mapped_files() -> set[str]:
    return {file for _, _, file in _mappings() if file is not None}


def _mapped_file(address: int) -> str | None:
    """The file this process has mapped at ``address``, or None."""
    return next((file for start, end, file in _mappings() if start <= address < end), None)


def test_a_type_without_block_kernel_is_dequantized_with_one_warning(tmp_path, caplog,
                                                                     monkeypatch):
    """The output head in IQ4_NL (no block kernel here): loaded as floats equal to gguf's
    dequantization, with one warning line naming the type."""
    from radixlm.models.loader import load_model
    from radixlm.models.model_config import ModelConfig

    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (len(tiny_vocab()), HIDDEN // 32, 18), dtype=np.uint8)
    blocks[:, :, :2] = np.full((1, 1), 0.01, np.float16).view(np.uint8)  # each block's scale
    blocks = blocks.reshape(len(tiny_vocab()), -1)
    write_quantized_gguf(tmp_path / "iq4.gguf", extra={"output.weight": blocks},
                         raw_types={"output.weight": QType.IQ4_NL})
    monkeypatch.setenv("RADIXLM_CACHE", str(tmp_path / "cache"))
    view = resolve_model_path(str(tmp_path / "iq4.gguf"))
    with caplog.at_level(logging.WARNING):
        model = load_model(ModelConfig.from_path(view), torch.float32, torch.device("cpu"), 256)
    lines = [r.getMessage() for r in caplog.records if "IQ4_NL" in r.getMessage()]
    assert len(lines) == 1 and re.search(r"1 IQ4_NL tensors dequantized", lines[0])
    expected = gguf.quants.dequantize(blocks, QType.IQ4_NL)
    np.testing.assert_array_equal(model.lm_head.weight.numpy(), expected)


def _type_field_offset(path, tensor_name: str) -> int:
    """The byte offset of a tensor's type in the file's tensor table."""
    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == tensor_name)
    raw_dtype = tensor.field.parts[4]  # a view of the mapped file
    return int(raw_dtype.ctypes.data - reader.data.ctypes.data)


@pytest.mark.parametrize("damage", ["truncated", "unknown type", "shape", "architecture"])
def test_a_broken_file_is_one_error_naming_it_and_leaves_no_cache_directory(
        tmp_path, monkeypatch, damage):
    path = tmp_path / "broken.gguf"
    if damage == "shape":  # layer 1's q norm disagrees with the head dim
        write_quantized_gguf(path, extra={"blk.1.attn_q_norm.weight": np.ones(3, np.float32)},
                             arch="qwen3")
        match = r"attn_q_norm.weight' has shape \(3,\), the metadata implies \(16,\)"
    else:
        write_quantized_gguf(path)
        data = bytearray(path.read_bytes())
        if damage == "truncated":
            data = data[: len(data) - 1000]
            match = "truncated"
        elif damage == "unknown type":
            offset = _type_field_offset(path, "blk.1.ffn_up.weight")
            data[offset:offset + 4] = (99).to_bytes(4, "little")
            match = "type this version of gguf does not know"
        else:
            data = data.replace(b"llama", b"llaba", 1)
            match = "architecture 'llaba'; supported GGUF architectures: llama, qwen2"
        path.write_bytes(bytes(data))
    monkeypatch.setenv("RADIXLM_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=match) as error:
        resolve_model_path(str(path))
    assert "broken.gguf" in str(error.value) and "\n" not in str(error.value)
    assert not list((tmp_path / "cache" / "models").glob("gguf-view-*"))
