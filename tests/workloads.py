"""Prompts and sampling presets shared by the runtime tests."""

from __future__ import annotations

import random

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France; Berlin is",
    "def add(a, b):",
    "In 1492, Columbus sailed the ocean blue.",
    "a",
]

LONG_TEXT = " ".join([
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "In 1492, Columbus sailed the ocean blue. Numbers: 0 1 2 3 4 5 6 7 8 9.",
] * 4)


def greedy(max_new_tokens: int = 24, **extra) -> dict:
    return {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **extra}


def sampled(seed: int | None, max_new_tokens: int = 16, **extra) -> dict:
    return {"temperature": 1.0, "max_new_tokens": max_new_tokens, "ignore_eos": True,
            "sampling_seed": seed, **extra}


def random_ids(seed: int, length: int, vocab: int = 300) -> list[int]:
    """``length`` token ids drawn from [3, vocab) (above the tiny tokenizer's special ids)."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]
