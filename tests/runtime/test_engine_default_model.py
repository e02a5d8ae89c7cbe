"""The Engine end to end on the default model (SmolLM2-135M-Instruct), against transformers on
the same dequantized weights."""

from __future__ import annotations

import pytest
import torch
import transformers
from runtime_checks import assert_engine_idle

import radixlm
from radixlm.models.default_model import default_model_path

pytestmark = pytest.mark.default_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
]


@pytest.fixture(scope="module")
def engine():
    with radixlm.Engine(dtype="float32", max_total_tokens=4096) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference():
    return transformers.AutoModelForCausalLM.from_pretrained(
        default_model_path(), dtype=torch.float32
    ).eval()


@torch.inference_mode()
def test_greedy_continuations_equal_transformers(engine, reference):
    params = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    outputs = engine.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs):
        ids = engine.tokenizer.encode(prompt)
        expected = reference.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0,
        )[0, len(ids):].tolist()
        assert out["output_ids"] == expected, prompt
    assert_engine_idle(engine)


def test_chat_template_answer_names_paris(engine):
    prompt = engine.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    out = engine.generate(prompt, {"max_new_tokens": 32, "temperature": 0.0})
    assert "Paris" in out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert_engine_idle(engine)


def test_bfloat16_engine_answers_too():
    with radixlm.Engine(dtype="bfloat16", max_total_tokens=2048) as engine:
        prompt = engine.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}]
        )
        out = engine.generate(prompt, {"max_new_tokens": 32, "temperature": 0.0})
        assert "Paris" in out["text"]
        assert_engine_idle(engine)
