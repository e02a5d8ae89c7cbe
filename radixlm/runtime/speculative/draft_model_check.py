"""Checks a ``STANDALONE`` draft model where the server starts, before any process does."""

from __future__ import annotations

from pathlib import Path

from radixlm.models.default_model import resolve_model_path
from radixlm.models.model_config import ModelConfig
from radixlm.models.registry import model_class


def resolve_draft_model(draft_path: str, target: ModelConfig,
                        trust_remote_code: bool = False) -> Path:
    """The draft model's local directory: ``draft_path`` resolved as a model path is, its
    architecture served, its vocabulary the target's (its tokens are the target's ids).
    Raises ``ValueError`` naming what is wrong."""
    path = resolve_model_path(draft_path)
    config = ModelConfig.from_path(path, trust_remote_code)
    try:
        model_class(config.architecture)
    except ValueError as err:
        raise ValueError(f"speculative_draft_model_path {draft_path!r}: {err}") from err
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_draft_model_path {draft_path!r} has a vocabulary of "
                         f"{config.vocab_size} tokens, the target model {target.vocab_size}: "
                         f"a draft model needs the target's tokenizer")
    return path
