"""Shared fixtures: tiny model directories, engines built once per model, and a leak check."""

from __future__ import annotations

import dataclasses
import os
import sys
import uuid
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import write_tiny_model  # noqa: E402

import radixlm  # noqa: E402
from radixlm.runtime import io_messages as io  # noqa: E402
from radixlm.runtime.request import Req  # noqa: E402
from radixlm.runtime.sampling_params import SamplingParams  # noqa: E402
from radixlm.runtime.scheduler import Scheduler  # noqa: E402
from radixlm.runtime.scheduler_process import build_scheduler, make_req  # noqa: E402
from radixlm.runtime.server_args import ServerArgs  # noqa: E402


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


@pytest.fixture(scope="session", autouse=True)
def _shut_down_engines():
    """Stops every cached engine's processes at the end of the session."""
    yield
    for engine in _ENGINES.values():
        engine.shutdown()


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
    """No request left behind: every KV slot is free or held unlocked by the prefix cache,
    and every request row is free."""
    info = engine.get_server_info()
    assert_pool_idle(info)


def assert_pool_idle(info: dict) -> None:
    assert info["num_running"] == 0 and info["num_waiting"] == 0
    assert info["cache_protected_tokens"] == 0
    assert info["free_kv_tokens"] + info["cache_tokens"] == info["max_total_tokens"]
    assert info["free_request_rows"] == info["request_rows"]


_SCHEDULERS: dict[tuple, Scheduler] = {}


@pytest.fixture
def scheduler_for(tiny_model_dir):
    """Returns a function building (once) an in-process Scheduler over a tiny float32 model,
    for tests of scheduling itself; its pool must be idle after the test."""
    used: list[Scheduler] = []

    def build(architecture: str = "LlamaForCausalLM", kv: str = "gqa", tied: bool = False,
              **options) -> Scheduler:
        path = tiny_model_dir(architecture, kv, tied)
        key = (str(path), tuple(sorted(options.items())))
        if key not in _SCHEDULERS:
            options = {"dtype": "float32", "max_total_tokens": 8192, **options}
            _SCHEDULERS[key] = build_scheduler(ServerArgs(str(path), **options), str(path))
        used.append(_SCHEDULERS[key])
        return _SCHEDULERS[key]

    yield build
    for scheduler in used:
        assert_pool_idle(scheduler.server_info())


def scheduler_req(scheduler: Scheduler, input_ids: list[int], sampling: dict | None = None,
                  rid: str | None = None, **fields) -> Req:
    """A request for ``scheduler`` as the Engine would send it."""
    params = dataclasses.asdict(SamplingParams.from_dict(sampling))
    message = io.GenerateReq(rid or uuid.uuid4().hex, list(input_ids), params, **fields)
    return make_req(message, scheduler.output_processor.tokenizer, {})


def run_to_completion(scheduler: Scheduler, reqs: list[Req], max_steps: int = 10_000) -> None:
    """Steps until every request finished; fails (instead of hanging) after ``max_steps``."""
    for req in reqs:
        scheduler.add_request(req)
    for _ in range(max_steps):
        if all(req.finished for req in reqs):
            return
        scheduler.step()
    for req in reqs:
        scheduler.abort(req)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")
