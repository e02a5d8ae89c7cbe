"""The Engine on the Triton backend, on the CPU under Triton's interpreter: the same greedy
tokens as on the torch-native backend, for a batch of prompts, then prefix-cache hits.

The Engine's scheduler process inherits ``TRITON_INTERPRET=1`` from this process (set by
conftest when there is no GPU), so its kernels are interpreted too.
"""

from __future__ import annotations

import pytest
from workloads import PROMPTS, greedy

pytestmark = pytest.mark.triton
slow = pytest.mark.slow  # interpreted Triton engines: CI's last stage

# Longer than two pages of 16 tokens, so its hits are page-aligned and non-empty.
SHARED = (
    "The quick brown fox jumps over the lazy dog. In 1492, Columbus sailed the ocean blue. "
    "Paris is the capital of France; Berlin is the capital of"
)
BATCH = [PROMPTS[0], PROMPTS[4], SHARED + " Germany."]
HITS = [SHARED + " Spain?", SHARED + " Germany."]


@slow
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_engine_generates_the_torch_native_greedy_tokens(engine_for, page_size):
    options = {} if page_size == 1 else {"page_size": page_size}
    reference = engine_for(**options)
    assert reference.get_server_info()["attention_backend"] == "torch_native"
    expected = reference.generate(BATCH + HITS, greedy(8))

    engine = engine_for(attention_backend="triton", **options)
    assert engine.get_server_info()["attention_backend"] == "triton"
    first = engine.generate(BATCH, greedy(8))  # a batched extend, then batched decodes
    hits = engine.generate(HITS, greedy(8))  # extends over cached prefixes
    assert [o["output_ids"] for o in first + hits] == [o["output_ids"] for o in expected]
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in hits)


@slow
def test_triton_engine_serves_a_latent_attention_moe_model(engine_for):
    """DeepSeek-V2 (MLA latent pool, MoE layer through the fused kernel) on Triton."""
    reference = engine_for("DeepseekV2ForCausalLM")
    expected = reference.generate(BATCH, greedy(6))
    engine = engine_for("DeepseekV2ForCausalLM", attention_backend="triton")
    assert engine.get_server_info()["fused_moe"] is True
    out = engine.generate(BATCH, greedy(6))
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in expected]


@pytest.mark.parametrize("dtype, refused", [("float32", True), ("bfloat16", False)])
def test_latent_attention_that_fits_no_tile_is_refused_when_the_runner_starts(
        tiny_model_dir, monkeypatch, dtype, refused):
    """On a GPU giving a block 99 KiB (sm_86, sm_89), float32 MLA prefill fits no tile: the
    model runner refuses it as it starts, naming what to serve with, not at the first step.
    (The device's limit is the only thing taken from a GPU here: the runner is a CPU one.)"""
    from radixlm.kernels.triton_ops import tile_plan
    from radixlm.models.model_config import ModelConfig
    from radixlm.runtime.model_executor.model_runner import ModelRunner
    from radixlm.runtime.server_args import ServerArgs

    monkeypatch.setattr(tile_plan, "shared_memory_per_block",
                        lambda device: tile_plan.SHARED_MEMORY_PER_BLOCK[86])
    # DeepSeek's latent widths (a 512 latent and 64 RoPE dims) in a tiny model
    path = str(tiny_model_dir("DeepseekV2ForCausalLM", kv_lora_rank=512, qk_rope_head_dim=64))
    args = ServerArgs(path, dtype=dtype, max_total_tokens=256, attention_backend="triton")
    if refused:
        with pytest.raises(ValueError, match="shared memory.*Serve in bfloat16 or float16"):
            ModelRunner(args, ModelConfig.from_path(path))
    else:
        ModelRunner(args, ModelConfig.from_path(path))
