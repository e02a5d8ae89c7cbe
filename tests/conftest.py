"""Shared fixtures: tiny model directories, engines built once per model, a leak check, and
the same process-wide kernel switches for every test whatever ran before it."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))

from process_settings import ProcessSettings  # noqa: E402
from runtime_checks import assert_engine_idle, assert_pool_idle  # noqa: E402
from tiny_models import write_tiny_model  # noqa: E402

import radixlm  # noqa: E402
from radixlm.runtime.scheduler.scheduler import Scheduler  # noqa: E402
from radixlm.runtime.scheduler.scheduler_process import build_scheduler  # noqa: E402
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


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def chat_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A copy of the tiny model given a chat template (for /v1/chat/completions)."""
    model = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(tiny_model_dir(), model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return model


MAX_LIVE_ENGINES = 3
"""Cached engines alive at once (each holds two child processes of a few hundred MB): the
least recently used one that the running test does not use is shut down past this. They
outlive their module: starting an engine costs seconds (mostly its scheduler's imports),
and many modules ask for the same one."""

_ENGINES: OrderedDict[tuple, radixlm.Engine] = OrderedDict()


def _shut_down(engines: list[radixlm.Engine]) -> None:
    """Shuts the engines down side by side (each waits about a second for its children)."""
    with ThreadPoolExecutor(max(len(engines), 1)) as pool:
        list(pool.map(lambda engine: engine.shutdown(), engines))


@pytest.fixture(scope="module", autouse=True)
def _module_settings_restored():
    """A module leaves the process-wide kernel switches as it found them (after its own
    module-scoped fixtures are gone: this one is set up before them)."""
    before = ProcessSettings.now()
    yield
    before.apply()


@pytest.fixture(autouse=True)
def _test_settings_restored(_module_settings_restored):
    """A test leaves the process-wide kernel switches as it found them: the next test
    computes what it would compute alone."""
    before = ProcessSettings.now()
    yield
    before.apply()


@pytest.fixture(scope="session", autouse=True)
def _shut_down_engines_at_the_end():
    """The cached engines stop when the session ends."""
    yield
    engines = list(_ENGINES.values())
    _ENGINES.clear()
    _shut_down(engines)


@pytest.fixture(scope="module", autouse=True)
def _shut_down_engines(_shut_down_engines_at_the_end):
    """A module hands on its cached engines as it would find a new one: each that still
    serves with its prefix cache emptied, any other stopped. Its in-process schedulers stop
    when it ends."""
    yield
    for key, engine in list(_ENGINES.items()):
        if not (engine.is_healthy() and engine.flush_cache()):
            _shut_down([_ENGINES.pop(key)])
    for scheduler, _ in _SCHEDULERS.values():
        scheduler.shutdown()
    _SCHEDULERS.clear()


@pytest.fixture
def engine_for(tiny_model_dir):
    """Returns a function building (once; kept across modules, see MAX_LIVE_ENGINES) a
    float32 Engine over a tiny model.
    Its prompts are cut into chunks by size only, not by the measured prefill speed, and its
    kernels are chosen without timing them (``disable_adaptive_timing``): where a chunk ends
    or which kernel sums a row changes the float32 sums slightly (prompt logprobs against
    transformers' by up to 2e-4 were seen under load), and a test's outcome must not depend
    on the machine's load.

    After the test, every engine it used must be idle: every KV slot and request row free.
    """
    used: list[radixlm.Engine] = []

    def build(architecture: str = "LlamaForCausalLM", kv: str = "gqa", tied: bool = False,
              **options) -> radixlm.Engine:
        path = tiny_model_dir(architecture, kv, tied)
        key = (str(path), tuple(sorted(options.items())))
        if key not in _ENGINES:
            idle = [k for k, engine in _ENGINES.items() if engine not in used]
            _shut_down([_ENGINES.pop(k) for k in idle[: max(len(_ENGINES) + 1
                                                            - MAX_LIVE_ENGINES, 0)]])
            options = {"dtype": "float32", "max_total_tokens": 8192,
                       "chunked_prefill_step_ms": None, "disable_adaptive_timing": True,
                       **options}
            _ENGINES[key] = radixlm.Engine(str(path), **options)
        _ENGINES.move_to_end(key)
        used.append(_ENGINES[key])
        return _ENGINES[key]

    yield build
    for engine in used:
        assert_engine_idle(engine)


_SCHEDULERS: dict[tuple, tuple[Scheduler, ProcessSettings]] = {}
"""In-process schedulers, each with the process-wide switches its runner set when built
(set again when a later test of the module takes it)."""


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
            scheduler = build_scheduler(ServerArgs(str(path), **options), str(path))
            _SCHEDULERS[key] = scheduler, ProcessSettings.now()
        scheduler, settings = _SCHEDULERS[key]
        settings.apply()
        used.append(scheduler)
        return scheduler

    yield build
    for scheduler in used:
        assert_pool_idle(scheduler.server_info())

