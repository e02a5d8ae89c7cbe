"""Shared fixtures: tiny model directories, engines built once per model, and a leak check."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import write_tiny_model  # noqa: E402

import radixlm  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Returns a function (architecture, kv, tied, **config) -> a model directory, made once."""
    made: dict[tuple, Path] = {}

    def make(architecture: str = "LlamaForCausalLM", kv: str = "gqa", tied: bool = False,
             **overrides) -> Path:
        key = (architecture, kv, tied, repr(sorted(overrides.items())))
        if key not in made:
            name = f"{architecture}-{kv}-{'tied' if tied else 'untied'}"
            directory = tmp_path_factory.mktemp(name)
            made[key] = write_tiny_model(directory, architecture, kv, tied, **overrides)
        return made[key]

    return make


_ENGINES: dict[tuple, radixlm.Engine] = {}


@pytest.fixture
def engine_for(tiny_model_dir):
    """Returns a function building (once) a float32 Engine over a tiny model.

    After the test, every engine it used must be idle: every KV slot and request row free.
    """
    used: list[radixlm.Engine] = []

    def build(architecture: str = "LlamaForCausalLM", kv: str = "gqa", tied: bool = False,
              **options) -> radixlm.Engine:
        path = tiny_model_dir(architecture, kv, tied)
        key = (str(path), tuple(sorted(options.items())))
        if key not in _ENGINES:
            options = {"dtype": "float32", "max_total_tokens": 8192, **options}
            _ENGINES[key] = radixlm.Engine(str(path), **options)
        used.append(_ENGINES[key])
        return _ENGINES[key]

    yield build
    for engine in used:
        assert_engine_idle(engine)


def assert_engine_idle(engine: radixlm.Engine) -> None:
    """No request left behind: every KV slot is free or held by the prefix cache (unlocked),
    and every request row is free."""
    runner = engine.runner
    tree = engine.memory.tree_cache
    assert engine.scheduler.is_idle()
    assert tree.protected_size() == 0
    assert runner.allocator.available_size() + tree.total_size() == runner.allocator.size
    assert runner.req_to_token_pool.available_size() == runner.req_to_token_pool.size
