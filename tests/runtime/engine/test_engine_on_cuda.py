"""The Engine on a CUDA GPU, against transformers on the CPU: what the CPU suite cannot reach.

Skipped without CUDA (CI has none). Float32 tiny models (matmuls without TF32, torch's
default), on torch_native and Triton, with CUDA graphs and without: greedy tokens and prompt
and output logprobs, sampling with temperature (its first-token frequencies against the
model's distribution), grammars (regex, JSON schema) and beam search (transformers'
hypotheses) on the GPU, a Mixtral (Triton's fused-MoE kernel) and a DeepSeek-V2 (the MLA
decode kernel), and bfloat16 decode through CUDA graphs.

FlashInfer is not among the backends here: it has no float32 kernels and none for the tiny
models' head size 16 (``backend_selection.FLASHINFER_DTYPES`` / ``FLASHINFER_HEAD_DIMS``),
so ``auto`` picks Triton for these models and an explicit ``flashinfer`` is refused.

To run on any machine with an NVIDIA GPU and its driver, from a checkout of radixlm:

    pip install -e '.[gpu]' pytest pytest-timeout  # torch>=2.5 built for CUDA, triton>=3.0
    pytest tests/runtime/engine/test_engine_on_cuda.py

Each test starts its own engines (15 to 30 s a test); the models are written by the tests,
nothing is downloaded. Known to pass with torch 2.11 (CUDA 13), triton 3.6 and transformers
5.17 on one GPU.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from beam_reference import beam, check_beams, reference_beams
from tiny_models import reference_greedy, reference_model, reference_prompt_logprobs
from workloads import greedy, random_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BACKENDS = ["torch_native", "triton"]
RUNS = [(b, g) for b in BACKENDS for g in (False, True) if b != "torch_native" or not g]
"""(attention backend, CUDA graphs) pairs: torch_native cannot be captured."""
PROMPTS = ["The quick brown fox", "Paris is the capital of", "def add(a, b):", "1 2 3"]
CUDA = dict(device="cuda", max_total_tokens=4096)


def cuda_engine(engine_for, backend: str, graphs: bool, architecture="LlamaForCausalLM",
                kv="gqa", **options):
    return engine_for(architecture, kv, attention_backend=backend,
                      disable_cuda_graph=not graphs, cuda_graph_max_bs=8, **CUDA, **options)


def input_logprobs(out: dict) -> torch.Tensor:
    return torch.tensor([entry[0] for entry in out["meta_info"]["input_token_logprobs"][1:]])


@pytest.mark.parametrize(("backend", "graphs"), RUNS)
@pytest.mark.parametrize(("architecture", "kv"), [
    ("LlamaForCausalLM", "gqa"), ("Qwen3ForCausalLM", "gqa"), ("LlamaForCausalLM", "mqa"),
])
def test_greedy_tokens_and_logprobs_equal_transformers(engine_for, tiny_model_dir, backend,
                                                       graphs, architecture, kv):
    """Four prompts decoded together (with graphs, in the graph captured for 4): each one's
    24 greedy tokens, prompt logprobs and output logprobs are transformers' (1e-4)."""
    path = tiny_model_dir(architecture, kv)
    engine = cuda_engine(engine_for, backend, graphs, architecture, kv)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    outs = engine.generate(input_ids=ids, sampling_params=greedy(24), return_logprob=True,
                           logprob_start_len=0)
    for prompt_ids, out in zip(ids, outs, strict=True):
        assert out["output_ids"] == reference_greedy(path, prompt_ids, 24)
        full = reference_prompt_logprobs(path, prompt_ids + out["output_ids"])
        torch.testing.assert_close(input_logprobs(out), full[: len(prompt_ids) - 1],
                                   atol=1e-4, rtol=0)
        got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, full[len(prompt_ids) - 1:], atol=1e-4, rtol=0)


@pytest.mark.parametrize(("architecture", "kv"), [
    ("MixtralForCausalLM", "gqa"), ("DeepseekV2ForCausalLM", "mha"),
])
@pytest.mark.parametrize("graphs", [False, True])
def test_moe_and_mla_models_on_triton_equal_transformers(engine_for, tiny_model_dir,
                                                          architecture, kv, graphs):
    """Triton's fused-MoE kernel (Mixtral) and its MLA decode kernel (DeepSeek-V2) on the
    GPU: greedy tokens and prompt logprobs are transformers'."""
    path = tiny_model_dir(architecture, kv)
    engine = cuda_engine(engine_for, "triton", graphs, architecture, kv)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    outs = engine.generate(input_ids=ids, sampling_params=greedy(16), return_logprob=True,
                           logprob_start_len=0)
    for prompt_ids, out in zip(ids, outs, strict=True):
        assert out["output_ids"] == reference_greedy(path, prompt_ids, 16)
        torch.testing.assert_close(input_logprobs(out), reference_prompt_logprobs(
            path, prompt_ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize(("backend", "graphs"), [("triton", True), ("torch_native", False)])
def test_sampled_first_tokens_follow_the_models_distribution(engine_for, tiny_model_dir,
                                                             backend, graphs):
    """3000 one-token samples at temperature 0.7 with top_k 4 on the GPU: their
    frequencies are transformers' tempered, top-4 renormalised probabilities (total
    variation under 0.05; the sampling noise is about 0.015)."""
    path = tiny_model_dir()
    engine = cuda_engine(engine_for, backend, graphs)
    prompt = engine.tokenizer.encode(PROMPTS[1])
    params = {"temperature": 0.7, "top_k": 4, "max_new_tokens": 1}
    samples = 3000
    outs = engine.generate(input_ids=[prompt] * samples, sampling_params=params)
    with torch.inference_mode():
        logits = reference_model(path)(torch.tensor([prompt])).logits[0, -1].float()
    top = torch.topk(logits, 4)
    want = torch.softmax(top.values / 0.7, dim=-1)
    counts = torch.zeros(4)
    for out in outs:
        token = out["output_ids"][0]
        assert token in top.indices.tolist(), "a token outside the top 4 was sampled"
        counts[top.indices.tolist().index(token)] += 1
    distance = 0.5 * (counts / samples - want).abs().sum()
    assert distance < 0.05, (counts / samples, want)


def test_seeded_sampling_on_the_gpu_repeats_and_differs_by_seed(engine_for):
    engine = cuda_engine(engine_for, "triton", True)
    params = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 16, "ignore_eos": True}
    first, again, other = (engine.generate(PROMPTS[0], {**params, "sampling_seed": seed})
                           for seed in (5, 5, 6))
    assert first["output_ids"] == again["output_ids"]
    assert first["output_ids"] != other["output_ids"]


@pytest.mark.parametrize(("backend", "graphs"), [("triton", True), ("torch_native", False)])
def test_top_logprobs_on_the_gpu_are_the_models_best_tokens(engine_for, tiny_model_dir,
                                                            backend, graphs):
    """Greedy with top_logprobs_num=3: each step's three entries are transformers' three
    most likely next tokens with their logprobs (1e-4)."""
    path = tiny_model_dir()
    engine = cuda_engine(engine_for, backend, graphs)
    prompt = engine.tokenizer.encode(PROMPTS[0])
    out = engine.generate(input_ids=prompt, sampling_params=greedy(8), return_logprob=True,
                          top_logprobs_num=3)
    with torch.inference_mode():
        logits = reference_model(path)(torch.tensor([prompt + out["output_ids"]])).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1: -1]
    for step, entries in enumerate(out["meta_info"]["output_top_logprobs"]):
        want = torch.topk(logprobs[step], 3)
        assert [e[1] for e in entries] == want.indices.tolist()
        torch.testing.assert_close(torch.tensor([e[0] for e in entries]), want.values,
                                   atol=1e-4, rtol=0)


REGEX = r"[A-Z][a-z]{1,6} (is|was) [0-9]{1,2} years old\."
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "population": {"type": "integer", "minimum": 0}},
          "required": ["city", "population"]}


@pytest.mark.parametrize(("backend", "graphs"), [("triton", True), ("torch_native", False)])
def test_grammars_constrain_sampled_outputs_on_the_gpu(engine_for, backend, graphs):
    """Regex and JSON-schema constrained sampling (4 samples each, temperature 0.7): every
    output matches, and ends because the grammar ended it."""
    engine = cuda_engine(engine_for, backend, graphs)
    params = {"temperature": 0.7, "max_new_tokens": 120, "n": 4}
    for out in engine.generate(PROMPTS[1], {**params, "regex": REGEX}):
        assert re.fullmatch(REGEX, out["text"]), out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
    for out in engine.generate(PROMPTS[1], {**params, "json_schema": json.dumps(SCHEMA)}):
        value = json.loads(out["text"])
        assert set(value) == {"city", "population"} and len(value["city"]) <= 10
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_on_the_gpu_gives_transformers_hypotheses(engine_for, tiny_model_dir,
                                                              width):
    """Beams sharing a 50-token prompt's pages (page size 4, copy on write) under CUDA
    graphs: transformers' hypotheses and scores."""
    path = tiny_model_dir()
    engine = cuda_engine(engine_for, "triton", True, page_size=4)
    ids = random_ids(900 + width, 50)
    eos = engine.tokenizer.eos_token_id
    outs = engine.generate(input_ids=ids, sampling_params=beam(width, 12))
    expected = reference_beams(path, ids, width, 12, 1.0, False, [eos])
    check_beams(outs, expected, 1.0, [eos], 12, path, ids)


def test_bfloat16_decode_with_graphs_stays_near_float32(engine_for, tiny_model_dir):
    """bfloat16 weights and KV through CUDA graphs: the prompt logprobs are within 0.05 of
    transformers' float32 ones, and eager bfloat16 decode gives the same tokens."""
    path = tiny_model_dir()
    graphs = cuda_engine(engine_for, "triton", True, dtype="bfloat16")
    eager = cuda_engine(engine_for, "triton", False, dtype="bfloat16")
    ids = [graphs.tokenizer.encode(p) for p in PROMPTS]
    outs = graphs.generate(input_ids=ids, sampling_params=greedy(16), return_logprob=True,
                           logprob_start_len=0)
    for prompt_ids, out in zip(ids, outs, strict=True):
        torch.testing.assert_close(input_logprobs(out), reference_prompt_logprobs(
            path, prompt_ids), atol=0.05, rtol=0)
    assert [o["output_ids"] for o in outs] == [
        o["output_ids"] for o in eager.generate(input_ids=ids, sampling_params=greedy(16))]
