"""Qwen2 (Yang et al. 2024) and Qwen3 (Qwen team 2025): the Llama decoder with two switches.

Qwen2 adds a bias to the q, k and v projections; Qwen3 drops it and normalises each query
and key head with an RMSNorm before RoPE. Everything else is ``radixlm.models.llama``.
"""

from __future__ import annotations

from radixlm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
