"""Llama (Touvron et al. 2023) and the models that share its decoder: Llama 2/3, SmolLM2, Mistral.

A pre-norm decoder: x + attn(norm(x)), then + mlp(norm(x)); grouped-query attention with
rotary positions; a gated SiLU MLP; an optionally tied output embedding. Qwen2 (QKV bias)
and Qwen3 (per-head q/k RMSNorm) are the same block with those switches on. Layers the
config makes local (``model_config.attention_windows``: Mistral's ``sliding_window``)
attend to their W most recent keys.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.models.decoder_lm import DecoderOnlyLM
from radixlm.models.layers import tensor_parallel
from radixlm.models.layers.attention import PagedAttention
from radixlm.models.layers.layernorm import RMSNorm
from radixlm.models.layers.linear import RowParallelLinear, StackedLinear
from radixlm.models.layers.mlp import GatedMLP
from radixlm.models.layers.rotary_embedding import apply_rotary
from radixlm.models.layers.tensor_parallel import head_share
from radixlm.models.model_config import attention_windows
from radixlm.models.weight_loading import load_named_weights


class LlamaAttention(nn.Module):
    def __init__(
        self, config: PretrainedConfig, layer_id: int,
        qkv_bias: bool = False, qk_norm: bool = False, *,
        norm: type[nn.Module] = RMSNorm, scaling: float | None = None,
        sliding_window: int | None = None, logit_softcap: float | None = None,
        rotary_dim: int | None = None,
    ):
        """``qkv_bias``/``qk_norm``: Qwen2's projection bias, Qwen3's per-head norms (of
        class ``norm``: Gemma 3 passes its own). ``scaling``: the softmax scale (default
        head_dim^-0.5); ``sliding_window``, ``logit_softcap``: see ``PagedAttention``;
        ``rotary_dim``: the leading dims of each head RoPE rotates (default all: Phi-3's
        ``partial_rotary_factor`` makes it fewer; the rope table is that wide)."""
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = d = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        tp = tensor_parallel.current()
        share = head_share(tp, num_heads, num_kv_heads)  # this rank's heads
        self.num_heads, self.num_kv_heads = share.q_count, share.kv_count
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = StackedLinear(
            config.hidden_size,
            {"q": share.q_count * d, "k": share.kv_count * d, "v": share.kv_count * d},
            bias=qkv_bias or attention_bias,
            shard_starts={"q": share.q_start * d, "k": share.kv_start * d,
                          "v": share.kv_start * d} if tp.size > 1 else None,
        )
        self.o_proj = RowParallelLinear(num_heads * d, config.hidden_size, attention_bias, tp,
                                        share.q_start * d, share.q_count * d)
        self.q_norm = norm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = norm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary_dim = rotary_dim or d
        self.attn = PagedAttention(
            layer_id, self.num_heads, self.num_kv_heads, self.head_dim,
            self.head_dim**-0.5 if scaling is None else scaling,
            sliding_window=sliding_window, logit_softcap=logit_softcap,
        )

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """rope: the (cos, sin) of each token's position; x: (T, hidden) -> (T, hidden)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x).view(t, -1, self.head_dim)  # (T, H + 2 H_kv, D), this rank's
        h, h_kv = self.num_heads, self.num_kv_heads
        if self.q_norm is not None:
            q, k, v = qkv.split([h, h_kv, h_kv], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        else:
            qk, v = qkv[:, : h + h_kv], qkv[:, h + h_kv :]
        # q and k sit side by side, so one rotation covers both.
        if self.rotary_dim == self.head_dim:
            qk = apply_rotary(qk, *rope)  # (T, H + H_kv, D)
        else:  # only the leading rotary_dim dims of each head turn
            r = self.rotary_dim
            qk = torch.cat([apply_rotary(qk[..., :r], *rope), qk[..., r:]], dim=-1)
        q, k = qk[:, :h], qk[:, h:]
        out = self.attn(q, k, v, forward_batch)  # (T, H, D)
        return self.o_proj(out.reshape(t, -1))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: PretrainedConfig, layer_id: int, mlp: nn.Module | None = None,
        attn: nn.Module | None = None, **attn_options,
    ):
        """``mlp``: the feed-forward block, (T, hidden) -> (T, hidden); by default the dense
        gated MLP of ``config.intermediate_size`` (MoE models pass an ``MoEBlock``).
        ``attn``: the attention, (rope, x, forward_batch) -> (T, hidden); by default Llama's
        with ``attn_options`` (DeepSeek passes multi-head latent attention)."""
        super().__init__()
        self.self_attn = attn if attn is not None else LlamaAttention(
            config, layer_id, **attn_options)
        self.mlp = mlp if mlp is not None else GatedMLP(
            config.hidden_size, config.intermediate_size,
            bias=bool(getattr(config, "mlp_bias", False)),
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
        residual: torch.Tensor | None, forward_batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this block's output, the residual stream before it is added). (On a
        CPU the runner may run a decode step's layers as fused kernel calls instead, with the
        same result: ``runtime/model_executor/cpu_decode_runner.py``.)"""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(rope, h, forward_batch)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(DecoderOnlyLM):
    qkv_bias = False
    qk_norm = False

    def __init__(self, config: PretrainedConfig, max_position: int,
                 rope_head_dim: int | None = None):
        """``rope_head_dim``: the dims RoPE rotates per head (default the whole head)."""
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        # Read before the layers are made (DecoderOnlyLM.__init__ makes them).
        self.window, self.sliding_layers = attention_windows(config)
        self.rotary_dim = rope_head_dim or head_dim
        super().__init__(config, max_position, rope_head_dim=self.rotary_dim)

    def layer_window(self, layer_id: int) -> int | None:
        """W for a layer that attends to its W most recent keys, else None."""
        return self.window if layer_id in self.sliding_layers else None

    def make_layer(self, config: PretrainedConfig, layer_id: int) -> LlamaDecoderLayer:
        """Decoder layer ``layer_id``; subclasses override it to swap the attention options
        or the feed-forward block."""
        return LlamaDecoderLayer(config, layer_id, qkv_bias=self.qkv_bias, qk_norm=self.qk_norm,
                                 sliding_window=self.layer_window(layer_id),
                                 rotary_dim=self.rotary_dim)

    # Checkpoint tensors that land in a shard of a stacked (fused) parameter.
    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, weights, self.stacked_params)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral 7B: the Llama decoder; with ``sliding_window`` set (its first release), every
    layer attends to its W most recent keys."""
