"""DeepSeek-V2 / V3 (MLA, with and without MoE) against transformers on the same tiny weights
(float32), and the size of their latent KV pool."""

from __future__ import annotations

import pytest
import torch
from runtime_checks import assert_engine_idle
from tiny_models import (
    MLA_ARCHITECTURES,
    reference_greedy,
    reference_prompt_logprobs,
    write_tiny_model,
)

import radixlm
from radixlm.runtime.scheduler.scheduler_process import build_scheduler
from radixlm.runtime.server_args import ServerArgs

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France; Berlin is",
    "def add(a, b):",
    "In 1492, Columbus sailed the ocean blue. Numbers: 0 1 2 3",
    "Héllo",
    "The lazy dog jumps over the quick brown fox. The capital of Germany is Berlin and",
    "Numbers: 9 8 7 6 5 4 3 2 1 0",
]
GREEDY = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}
YARN = {
    "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 10000.0,
}
# name -> (architecture, config overrides); MLA_ARCHITECTURES holds the base configs.
VARIANTS = {
    # V2-Lite: one q_proj, layer 0 dense, layer 1 MoE with the greedy softmax router.
    "v2_lite_moe": ("DeepseekV2ForCausalLM", {}),
    # V2 with q-LoRA, every layer dense (MLA alone), tied embeddings.
    "v2_q_lora_dense": ("DeepseekV2ForCausalLM", dict(
        q_lora_rank=24, first_k_dense_replace=2, tie_word_embeddings=True)),
    # V3: q-LoRA, layer 0 dense, layer 1 MoE with the sigmoid, grouped, bias-corrected router.
    "v3_moe": ("DeepseekV3ForCausalLM", {}),
    # V3 with rotate-half RoPE and DeepSeek's YaRN (cos/sin factor and softmax correction).
    "v3_yarn_rotate_half": ("DeepseekV3ForCausalLM", dict(
        rope_interleave=False, rope_parameters=YARN)),
}


@pytest.fixture(scope="module")
def deepseek_engines(tmp_path_factory):
    """name -> (model directory, float32 Engine), built on first use, shut down at the end."""
    built: dict[str, tuple] = {}

    def get(name: str):
        if name not in built:
            architecture, overrides = VARIANTS[name]
            path = write_tiny_model(tmp_path_factory.mktemp(name), architecture, "mha",
                                    **overrides)
            built[name] = path, radixlm.Engine(str(path), dtype="float32", max_total_tokens=4096)
        return built[name]

    yield get
    for _, engine in built.values():
        engine.shutdown()


def logprob_values(entries: list) -> torch.Tensor:
    return torch.tensor([entry[0] for entry in entries if entry[0] is not None])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prompt_logprobs_and_greedy_tokens_match_transformers(deepseek_engines, name):
    path, engine = deepseek_engines(name)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    alone = [
        engine.generate(input_ids=i, sampling_params=GREEDY, return_logprob=True,
                        logprob_start_len=0)
        for i in ids[:2]
    ]
    together = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True,
                               logprob_start_len=0)
    for prompt_ids, out in zip(ids, together, strict=True):
        assert out["output_ids"] == reference_greedy(path, prompt_ids, 32)
        got = logprob_values(out["meta_info"]["input_token_logprobs"])
        torch.testing.assert_close(got, reference_prompt_logprobs(path, prompt_ids),
                                   atol=1e-4, rtol=0)
    for out, batched in zip(alone, together):
        assert out["output_ids"] == batched["output_ids"]
    assert_engine_idle(engine)


@pytest.mark.parametrize("name", ["v2_lite_moe", "v3_moe"])
def test_a_prompt_extending_a_cached_one_hits_the_radix_cache_and_matches_transformers(
    deepseek_engines, name
):
    path, engine = deepseek_engines(name)
    engine.flush_cache()
    first = engine.tokenizer.encode(PROMPTS[5])
    engine.generate(input_ids=first, sampling_params=GREEDY)
    extended = first + engine.tokenizer.encode(" Paris is the capital of France; Berlin is")
    start = len(first) - 2  # logprobs from inside the cached prefix on
    out = engine.generate(input_ids=extended, sampling_params=GREEDY, return_logprob=True,
                          logprob_start_len=start)
    assert out["meta_info"]["cached_tokens"] == start  # matches are capped at the start
    assert out["output_ids"] == reference_greedy(path, extended, 32)
    got = logprob_values(out["meta_info"]["input_token_logprobs"])
    torch.testing.assert_close(got, reference_prompt_logprobs(path, extended)[start:],
                               atol=1e-4, rtol=0)
    assert_engine_idle(engine)


# KV bytes per token and pool capacity ----------------------------------------------------------


def test_server_info_reports_latent_kv_bytes_per_token(deepseek_engines):
    _, engine = deepseek_engines("v3_moe")
    config = MLA_ARCHITECTURES["DeepseekV3ForCausalLM"][1]
    layers, float32 = 2, 4
    expected = (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * layers * float32
    assert engine.get_server_info()["kv_bytes_per_token"] == expected == 320


def test_the_latent_pool_holds_as_many_times_more_tokens_as_mha_would_take_more_bytes(
    tmp_path_factory
):
    """Sized from the same kind of memory budget, the pool of a DeepSeek model holds
    (MHA bytes / MLA bytes) times more tokens per budget byte than its decompressed MHA
    equivalent: a Llama whose K and V per layer take H x (nope + rope) + H x v numbers."""
    config = MLA_ARCHITECTURES["DeepseekV2ForCausalLM"][1]
    heads = 4
    # 4 x (16 + 8) + 4 x 16 = 160 numbers = 2 x 4 heads x 20 dims: a Llama with head_dim 20.
    decompressed = heads * (config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
                            + config["v_head_dim"])
    assert decompressed == 2 * heads * 20
    latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    dirs = {
        "mla": write_tiny_model(tmp_path_factory.mktemp("ds-pool"), "DeepseekV2ForCausalLM",
                                "mha", first_k_dense_replace=2),
        "mha": write_tiny_model(tmp_path_factory.mktemp("llama-pool"), "LlamaForCausalLM",
                                "mha", head_dim=20),
    }
    infos = {}
    for name, path in dirs.items():
        # A budget far below max_running_requests x context (64 x 512 tokens), so it binds.
        args = ServerArgs(str(path), dtype="float32", kv_cache_memory_fraction=2e-4)
        infos[name] = build_scheduler(args, str(path)).server_info()
    assert infos["mla"]["kv_bytes_per_token"] == 2 * latent * 4
    assert infos["mha"]["kv_bytes_per_token"] == 2 * decompressed * 4
    tokens_per_byte = {}
    for name, info in infos.items():
        budget = info["kv_memory_budget_bytes"]
        assert info["max_total_tokens"] == budget // info["kv_bytes_per_token"] < 64 * 512
        tokens_per_byte[name] = info["max_total_tokens"] / budget
    ratio = tokens_per_byte["mla"] / tokens_per_byte["mha"]
    assert ratio == pytest.approx(decompressed / latent, rel=1e-3)
