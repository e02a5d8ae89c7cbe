"""Gemma 2 and Phi-3 GGUFs (no public file of either is at hand): tiny random transformers
models written as llama.cpp lays them out, with the tensor names of ``gguf``'s own table
(``gguf.TENSOR_NAMES``) and the metadata keys of its writer, Gemma's norms stored as 1 + w,
Phi-3's q/k/v and gate/up fused, matrices in Q8_0. Served as stored, they must equal
transformers on the same (dequantized) weights; Gemma 2's decode steps run fused on the
blocks as stored, as its modules run them."""

from __future__ import annotations

import gguf
import pytest
import torch
from fused_decode_checks import PROMPTS, assert_sandwich_equals_modules
from fused_kernels import enable_or_skip
from gguf import MODEL_TENSOR as T
from gguf import GGMLQuantizationType as QType
from test_conversion import MERGES, SPECIALS, tiny_vocab
from tiny_models import write_tiny_model
from transformers import AutoModelForCausalLM

import radixlm
from radixlm.kernels.cpu_ops.fused_ops import ProjectionKernel
from radixlm.models.default_model import resolve_model_path
from radixlm.runtime.device_choice import cpu_has_native_bf16

BLOCK_NAMES = {
    "input_layernorm": T.ATTN_NORM, "self_attn.q_proj": T.ATTN_Q, "self_attn.k_proj": T.ATTN_K,
    "self_attn.v_proj": T.ATTN_V, "self_attn.o_proj": T.ATTN_OUT,
    "self_attn.qkv_proj": T.ATTN_QKV, "mlp.gate_proj": T.FFN_GATE, "mlp.up_proj": T.FFN_UP,
    "mlp.gate_up_proj": T.FFN_UP, "mlp.down_proj": T.FFN_DOWN,
}
GEMMA_NORMS = {"post_attention_layernorm": T.ATTN_POST_NORM,
               "pre_feedforward_layernorm": T.FFN_NORM,
               "post_feedforward_layernorm": T.FFN_POST_NORM}
TOP = {"model.embed_tokens": T.TOKEN_EMBD, "model.norm": T.OUTPUT_NORM, "lm_head": T.OUTPUT}
MODELS = {  # architecture -> (GGUF arch, config overrides)
    "Gemma2ForCausalLM": ("gemma2", {"query_pre_attn_scalar": 16}),  # llama.cpp: the head dim
    "Phi3ForCausalLM": ("phi3", {"rope_parameters": {"rope_type": "default",
                                                     "rope_theta": 10000.0}}),
}


def gguf_name(hf_name: str, arch: str) -> str:
    module = hf_name.removesuffix(".weight")
    if module in TOP:
        return gguf.TENSOR_NAMES[TOP[module]] + ".weight"
    _, _, layer, rest = module.split(".", 3)
    names = BLOCK_NAMES | (GEMMA_NORMS if arch == "gemma2" else
                           {"post_attention_layernorm": T.FFN_NORM})
    return gguf.TENSOR_NAMES[names[rest]].format(bid=int(layer)) + ".weight"


def write_gguf(model, arch: str, path) -> None:
    """``model`` (transformers) as llama.cpp's converter would write it, Q8_0 matrices; its
    own weights become their Q8_0 round trip (the reference's)."""
    config = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tiny_vocab())
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tiny_vocab()) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    with torch.no_grad():
        for hf_name, param in model.named_parameters():
            if hf_name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            values = param.numpy()
            if values.ndim == 2:
                blocks = gguf.quants.quantize(values, QType.Q8_0)
                param.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, QType.Q8_0)))
                writer.add_tensor(gguf_name(hf_name, arch), blocks, raw_dtype=QType.Q8_0)
            else:
                shift = 1.0 if arch == "gemma2" and hf_name.endswith("norm.weight") else 0.0
                writer.add_tensor(gguf_name(hf_name, arch), values + shift)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.slow  # an engine each (~6 s): CI's last stage
@pytest.mark.parametrize("architecture", list(MODELS))
def test_served_as_stored_equals_transformers(tmp_path, monkeypatch, architecture):
    arch, overrides = MODELS[architecture]
    directory = write_tiny_model(tmp_path / "hf", architecture, "gqa", tied=arch == "gemma2",
                                 vocab_size=len(tiny_vocab()), **overrides)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    write_gguf(reference, arch, tmp_path / f"{arch}.gguf")
    monkeypatch.setenv("RADIXLM_CACHE", str(tmp_path / "cache"))
    engine = radixlm.Engine(str(tmp_path / f"{arch}.gguf"), dtype="float32",
                            max_total_tokens=1024, chunked_prefill_size=8,
                            chunked_prefill_step_ms=None)
    prompts = [[5 + (7 * i) % 250 for i in range(n)] for n in (30, 5, 17)]  # past the window
    try:
        outs = engine.generate(input_ids=prompts, return_logprob=True, logprob_start_len=0,
                               sampling_params={"max_new_tokens": 8, "temperature": 0.0,
                                                "ignore_eos": True})
    finally:
        engine.shutdown()
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            logits = reference(torch.tensor([ids])).logits[0]
            greedy = reference.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)[0, len(ids):]
        expected = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])
        got = torch.tensor([e[0] for e in out["meta_info"]["input_token_logprobs"][1:]])
        torch.testing.assert_close(got, expected[:, 0], atol=1e-4, rtol=0)
        assert out["output_ids"] == greedy.tolist()


def test_gemma2_decode_steps_on_the_blocks_as_stored_run_fused_as_the_modules(
    tmp_path, monkeypatch
):
    """Every projection a GGUF block weight (``ProjectionKernel.GGUF``) in the one fused call
    of Gemma's sandwich layers: its steps equal the modules' to the bit."""
    enable_or_skip()
    arch, overrides = MODELS["Gemma2ForCausalLM"]
    directory = write_tiny_model(tmp_path / "hf", "Gemma2ForCausalLM", "gqa", tied=True,
                                 vocab_size=len(tiny_vocab()), **overrides)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    write_gguf(reference, arch, tmp_path / f"{arch}.gguf")
    monkeypatch.setenv("RADIXLM_CACHE", str(tmp_path / "cache"))
    view = resolve_model_path(tmp_path / f"{arch}.gguf")
    dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    runner = assert_sandwich_equals_modules(view, monkeypatch, dtype=dtype)
    qkv = runner.model.layers[0].self_attn.qkv_proj
    assert qkv.fused_projection(len(PROMPTS), runner.dtype).kernel is ProjectionKernel.GGUF
