"""The Engine on the Triton backend, on the CPU under Triton's interpreter: the same greedy
tokens as on the torch-native backend, for a batch of prompts, then prefix-cache hits.

The Engine's scheduler process inherits ``TRITON_INTERPRET=1`` from this process (set by
conftest when there is no GPU), so its kernels are interpreted too.
"""

from __future__ import annotations

import pytest
from workloads import PROMPTS, greedy

pytestmark = [pytest.mark.triton, pytest.mark.slow]  # interpreted Triton: CI's last stage

# Longer than two pages of 16 tokens, so its hits are page-aligned and non-empty.
SHARED = (
    "The quick brown fox jumps over the lazy dog. In 1492, Columbus sailed the ocean blue. "
    "Paris is the capital of France; Berlin is the capital of"
)
BATCH = [PROMPTS[0], PROMPTS[4], SHARED + " Germany."]
HITS = [SHARED + " Spain?", SHARED + " Germany."]


@pytest.mark.parametrize("page_size", [1, pytest.param(16, marks=pytest.mark.slow)])
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


def test_triton_engine_serves_a_latent_attention_moe_model(engine_for):
    """DeepSeek-V2 (MLA latent pool, MoE layer through the fused kernel) on Triton."""
    reference = engine_for("DeepseekV2ForCausalLM")
    expected = reference.generate(BATCH, greedy(6))
    engine = engine_for("DeepseekV2ForCausalLM", attention_backend="triton")
    assert engine.get_server_info()["fused_moe"] is True
    out = engine.generate(BATCH, greedy(6))
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in expected]
