"""The frame every decoder-only model here shares: embed, decoder layers, final norm, LM head.

A model supplies its decoder layers (``make_layer``) and the width its RoPE rotates; this
class owns the token embedding, the rotary table the layers share (looked up once per
batch), the final RMSNorm and the output projection (tied to the embedding or not).
Three hooks cover the Gemma-style variations, each off by default: ``embed_scale`` (the
embedding multiplied by it, in the activations' dtype), ``final_logit_softcap`` (logits
become c * tanh(logits / c)), and ``make_rotary`` / ``make_norm`` (a model whose layers
rotate by per-layer-type tables, or whose final norm is not Llama's). Whatever
``make_rotary``'s module returns from ``lookup`` is what every layer receives as ``rope``.

Layer contract: ``layer(rope, x, residual, forward_batch) -> (x, residual)``, pre-norm, the
residual stream carried separately and added by the next norm (``residual`` is None for
the first layer). ``embed`` and ``final_norm`` are the steps around the layers, for a runner
that runs the layers its own way (``runtime/model_executor/cpu_decode_runner.py``).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.models.layers.layernorm import RMSNorm
from radixlm.models.layers.rotary_embedding import RotaryEmbedding
from radixlm.models.layers.vocab_parallel import VocabParallelEmbedding
from radixlm.models.model_config import rope_parameters


class DecoderOnlyLM(nn.Module):
    """Token ids -> final hidden states; ``compute_logits`` maps chosen rows to the vocabulary."""

    embed_scale: float | None = None
    """None, or the factor the token embedding is multiplied by (Gemma: sqrt(hidden))."""
    final_logit_softcap: float | None = None
    """None, or c: logits become c * tanh(logits / c) (Gemma 2)."""

    def __init__(self, config: PretrainedConfig, max_position: int, rope_head_dim: int):
        super().__init__()
        self.config = config
        self.max_position = max_position  # the serving context (dynamic NTK RoPE scales for it)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.make_layer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = self.make_norm(config)
        self.rotary_emb = self.make_rotary(config, rope_head_dim, max_position)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size)

    def make_layer(self, config: PretrainedConfig, layer_id: int) -> nn.Module:
        """Decoder layer ``layer_id`` (see the layer contract above)."""
        raise NotImplementedError

    def make_norm(self, config: PretrainedConfig) -> nn.Module:
        """The final norm: ``norm(x, residual) -> (norm(x + residual), x + residual)``."""
        return RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_rotary(self, config: PretrainedConfig, rope_head_dim: int,
                    max_position: int) -> nn.Module:
        """The rotary table(s): a module whose ``lookup(positions, dtype)`` gives the layers'
        ``rope``; by default one ``RotaryEmbedding`` of the config's RoPE settings."""
        return RotaryEmbedding(
            rope_head_dim, max_position, rope_parameters(config),
            trained_context=getattr(config, "max_position_embeddings", max_position),
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """input_ids, positions: (T,) -> hidden states (T, hidden)."""
        x, rope = self.embed(input_ids, positions)
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual, forward_batch)
        return self.final_norm(x, residual)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """input_ids, positions: (T,) -> the first layer's input (T, hidden) and the
        rotary table's rows for ``positions``."""
        x = self.embed_tokens(input_ids)  # (T, hidden)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x, self.rotary_emb.lookup(positions, x.dtype)

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The last layer's output and residual stream -> the final hidden states."""
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (N, hidden) -> float32 logits (N, vocab); under tensor parallelism a
        collective, which every rank calls with the same rows."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = head.logits(hidden)  # (N, vocab)
        cap = self.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
