"""Tests for radixlm/models/gguf/conversion.py on tiny GGUF files written with gguf.GGUFWriter.

The weights are made in Hugging Face layout, permuted the way llama.cpp's converter permutes them,
written to a GGUF (some F32, some Q8_0), converted back, and loaded with transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from radixlm.models.gguf.architectures import unpermute_rotary_rows
from radixlm.models.gguf.conversion import convert_gguf_to_hf
from radixlm.runtime.server_args import ServerArgs

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 16, 96, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "Ġ Ġ"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute`, written out independently."""
    half = weight.shape[0] // num_heads // 2
    grouped = weight.reshape(num_heads, 2, half, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def tiny_vocab() -> list[str]:
    byte_chars = list(bytes_to_unicode().values())
    merged = ["".join(merge.split(" ")) for merge in MERGES]
    return SPECIALS + byte_chars + merged


def hf_weights(arch: str, with_output: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights in Hugging Face names and layout."""
    rng = np.random.default_rng(seed)
    vocab = len(tiny_vocab())

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    weights = {"model.embed_tokens.weight": rand(vocab, HIDDEN), "model.norm.weight": rand(HIDDEN)}
    if with_output:
        weights["lm_head.weight"] = rand(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": rand(HIDDEN),
            p + "post_attention_layernorm.weight": rand(HIDDEN),
            p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.up_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, FFN),
        }
        if arch == "qwen2":
            weights[p + "self_attn.q_proj.bias"] = rand(HEADS * HEAD_DIM)
            weights[p + "self_attn.k_proj.bias"] = rand(KV_HEADS * HEAD_DIM)
            weights[p + "self_attn.v_proj.bias"] = rand(KV_HEADS * HEAD_DIM)
        if arch == "qwen3":
            weights[p + "self_attn.q_norm.weight"] = rand(HEAD_DIM)
            weights[p + "self_attn.k_norm.weight"] = rand(HEAD_DIM)
    return weights


GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in TOP_NAMES:
        return TOP_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest]}"


def q8_0_round_trip(weight: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(gguf.quants.quantize(weight, QType.Q8_0), QType.Q8_0)


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    with_output: bool = False,
    add_bos: bool = False,
    skip_tensor: str | None = None,
    pre: str = "default",
    extra: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Write a tiny GGUF; return the float32 weights the conversion must reproduce (HF layout).

    Layer 0's q/k and the norms stay F32 (exact); every other matrix is Q8_0, so its expected
    value is the Q8_0 round trip. Q8_0 blocks run along a row, so quantizing commutes with the
    row permutation and the expectation stays exact.
    """
    weights = hf_weights(arch, with_output)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(tiny_vocab()))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tiny_vocab())
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tiny_vocab()) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)

    expected = {}
    for hf_name, weight in weights.items():
        name = gguf_name(hf_name)
        stored = weight
        if arch == "llama" and name.endswith("attn_q.weight"):
            stored = llama_cpp_permute(weight, HEADS)
        elif arch == "llama" and name.endswith("attn_k.weight"):
            stored = llama_cpp_permute(weight, KV_HEADS)
        if weight.ndim == 2 and not name.startswith("blk.0.attn_"):
            quantized = gguf.quants.quantize(stored, QType.Q8_0)
            expected[hf_name] = q8_0_round_trip(weight)
            if name != skip_tensor:
                writer.add_tensor(name, quantized, raw_dtype=QType.Q8_0)
        else:
            expected[hf_name] = weight
            if name != skip_tensor:
                writer.add_tensor(name, stored)
    for name, weight in (extra or {}).items():
        writer.add_tensor(name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize("with_output", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_converted_weights_equal_gguf_tensors_in_hf_layout(tmp_path, arch, with_output):
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", arch, with_output)
    out = convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf", progress=False)

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    state = model.state_dict()
    for name, want in expected.items():
        np.testing.assert_array_equal(state[name].numpy(), want, err_msg=name)
    assert model.config.tie_word_embeddings is (not with_output)
    if not with_output:
        assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_config_json_describes_the_gguf(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    out = convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf", progress=False)

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"]) == (HIDDEN, FFN)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (HEADS, KV_HEADS)
    assert (config["num_hidden_layers"], config["head_dim"]) == (LAYERS, HEAD_DIM)
    assert config["rms_norm_eps"] == 1e-6 and config["rope_theta"] == 50000.0
    assert config["max_position_embeddings"] == 128
    assert config["vocab_size"] == len(tiny_vocab())
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["torch_dtype"] == "float32"
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2}


def test_tokenizer_round_trips_and_renders_chat_template(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    out = convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf", progress=False)

    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("hello world").input_ids
    vocab = tiny_vocab()
    assert [vocab[i] for i in ids] == ["hello", "Ġworld"]  # merges applied, no BOS
    assert tok.decode(ids) == "hello world"
    assert tok.encode("<|im_end|>") == [2]  # specials stay whole
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "pre,pieces",
    [("default", ["x", "Ġ", "Ġ", "1", "2"]), ("smollm", ["x", "ĠĠ", "1", "2"])],
)
def test_smollm_pre_tokenizer_isolates_digits_before_the_gpt2_split(tmp_path, pre, pieces):
    """llama.cpp's "smollm" splits on each digit first, so a space run before one stays whole."""
    write_tiny_gguf(tmp_path / "tiny.gguf", pre=pre)
    out = convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf", progress=False)

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.convert_ids_to_tokens(tok("x  12").input_ids) == pieces


def test_add_bos_token_flag_prepends_exactly_one_bos(tmp_path):
    from tokenizers import Tokenizer

    write_tiny_gguf(tmp_path / "tiny.gguf", add_bos=True)
    out = convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf", progress=False)

    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is True
    hello = tiny_vocab().index("hello")
    assert AutoTokenizer.from_pretrained(out)("hello").input_ids == [1, hello]
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode("hello").ids == [1, hello]


@pytest.mark.parametrize("num_heads,head_dim", [(1, 2), (3, 8), (4, 16), (9, 64)])
def test_unpermute_inverts_llama_cpp_permute(num_heads, head_dim):
    weight = np.random.default_rng(1).standard_normal((num_heads * head_dim, 5))
    np.testing.assert_array_equal(
        unpermute_rotary_rows(llama_cpp_permute(weight, num_heads), num_heads), weight
    )


def test_unpermuted_rows_make_rotate_half_rope_equal_interleaved_rope():
    """HF's rotate-half RoPE on un-permuted rows == ggml's pairwise RoPE on the stored rows."""
    head_dim, pos = 16, 7
    rng = np.random.default_rng(2)
    stored = rng.standard_normal((head_dim, 8))  # one head, as llama.cpp stores it
    x = rng.standard_normal(8)
    angles = pos * 10000.0 ** (-np.arange(head_dim // 2) * 2 / head_dim)
    cos, sin = np.cos(angles), np.sin(angles)

    q = stored @ x  # interleaved pairs (q[2i], q[2i+1]) rotate by angle i
    ggml = np.empty_like(q)
    ggml[0::2] = q[0::2] * cos - q[1::2] * sin
    ggml[1::2] = q[0::2] * sin + q[1::2] * cos

    h = unpermute_rotary_rows(stored, 1) @ x  # halves (h[i], h[i + d/2]) rotate by angle i
    half = head_dim // 2
    hf = np.concatenate([h[:half] * cos - h[half:] * sin, h[:half] * sin + h[half:] * cos])
    np.testing.assert_allclose(np.stack([hf[:half], hf[half:]], 1).reshape(-1), ggml)


def test_random_bytes_raise_value_error_naming_the_path(tmp_path):
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(np.random.default_rng(3).bytes(4096))
    with pytest.raises(ValueError, match="corrupt.gguf"):
        convert_gguf_to_hf(path, tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists()


def test_truncated_gguf_raises_value_error_naming_the_path(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    data = (tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError, match="cut.gguf"):
        convert_gguf_to_hf(tmp_path / "cut.gguf", tmp_path / "hf", progress=False)


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "gemma.gguf", "gemma")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'gemma'.*llama, qwen2, qwen3, gemma2, gemma3, phi3"):
        convert_gguf_to_hf(tmp_path / "gemma.gguf", tmp_path / "hf", progress=False)


def test_missing_tensor_raises_and_leaves_no_directory(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", skip_tensor="blk.1.ffn_up.weight")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"rope_freqs.weight": np.ones(HEAD_DIM // 2, np.float32)}, "RoPE scaling"),
        ({"blk.0.attn_q_norm.weight": np.ones(HEAD_DIM, np.float32)}, "attn_q_norm"),
        ({"blk.7.attn_norm.weight": np.ones(HIDDEN, np.float32)}, "blk.7.attn_norm"),
    ],
)
def test_tensor_the_converter_cannot_map_raises(tmp_path, extra, message):
    write_tiny_gguf(tmp_path / "tiny.gguf", extra=extra)
    with pytest.raises(ValueError, match=message):
        convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf", progress=False)


def test_failure_while_writing_leaves_no_partial_directory(tmp_path, monkeypatch):
    import radixlm.models.gguf.conversion as conversion

    write_tiny_gguf(tmp_path / "tiny.gguf")

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(conversion, "write_tokenizer", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


def test_non_empty_output_directory_is_refused(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="hf"):
        convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf", progress=False)
    assert (tmp_path / "hf" / "keep.txt").read_text() == "user data"


def test_quantization_gguf_means_the_files_own_formats(tmp_path):
    write_tiny_gguf(tmp_path / "model.gguf")
    args = ServerArgs(model_path=str(tmp_path / "model.gguf"), quantization="gguf", device="cpu")
    assert args.weight_format() is None  # served as stored (gguf/native_weights.py)


def test_quantization_gguf_needs_a_gguf_model(tmp_path):
    with pytest.raises(ValueError, match="gguf.*is not one"):
        ServerArgs(model_path=str(tmp_path), quantization="gguf", device="cpu")
