"""Model classes by the ``architectures`` name in a Hugging Face config."""

from __future__ import annotations

from torch import nn

from radixlm.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from radixlm.models.gemma import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
)
from radixlm.models.llama import LlamaForCausalLM, MistralForCausalLM
from radixlm.models.mixtral import MixtralForCausalLM
from radixlm.models.phi3 import Phi3ForCausalLM
from radixlm.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from radixlm.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    """The class serving ``architecture``; an unknown one is a ``ValueError`` listing the known."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {sorted(MODEL_REGISTRY)}"
        ) from None
