"""Checks and request helpers shared by test modules (importable: a conftest is not)."""

from __future__ import annotations

import uuid

import radixlm
from radixlm.runtime import messages as wire
from radixlm.runtime.engine.request_caps import RequestCaps
from radixlm.runtime.engine.request_inputs import RequestLimits
from radixlm.runtime.grammar.factory import constraint_checker
from radixlm.runtime.request import Req
from radixlm.runtime.sampling.sampling_params import SamplingParams
from radixlm.runtime.scheduler.scheduler import Scheduler
from radixlm.runtime.scheduler.scheduler_process import make_req
from radixlm.runtime.server_args import ServerArgs


def entry_limits(**overrides) -> RequestLimits:
    """What a request is checked against where it enters, for a 1,000-token vocabulary, a
    4,096-token context and an 8,192-slot pool (``overrides``: other values)."""
    return RequestLimits(**{
        "context_length": 4096, "vocab_size": 1000, "max_total_tokens": 8192, "page_size": 1,
        "generation_defaults": {}, "check_constraint": constraint_checker("xgrammar"),
        "caps": RequestCaps.from_options(ServerArgs()), "max_prompt_chars": 10**6,
        **overrides})


def assert_engine_idle(engine: radixlm.Engine) -> None:
    """No request left behind: every KV slot is free or held unlocked by the prefix cache,
    and every request row is free."""
    info = engine.get_server_info()
    assert_pool_idle(info)


def assert_pool_idle(info: dict) -> None:
    assert info["num_running"] == 0 and info["num_waiting"] == 0
    assert info.get("disaggregation", {}).get("waiting", 0) == 0  # no KV handoff pending
    assert info["cache_protected_tokens"] == 0
    assert info["free_kv_tokens"] + info["cache_tokens"] == info["max_total_tokens"]
    assert info["free_request_rows"] == info["request_rows"]


def scheduler_req(scheduler: Scheduler, input_ids: list[int], sampling: dict | None = None,
                  rid: str | None = None, **fields) -> Req:
    """A request for ``scheduler`` as the Engine would send it."""
    params = SamplingParams.from_dict(sampling)
    message = wire.GenerateReq(rid or uuid.uuid4().hex, list(input_ids), params, **fields)
    return make_req(message, scheduler.sampling_step.tokenizer, {})


def beam_reqs(scheduler: Scheduler, input_ids: list[int], sampling: dict,
              rid: str | None = None) -> list[Req]:
    """The ``n`` requests of a beam search (``sampling`` has ``use_beam_search``), as the
    Engine sends them: ``rid-0`` leads, the others name it; best first once finished."""
    params = SamplingParams.from_dict(sampling)
    rid = rid or uuid.uuid4().hex
    leaders: dict[str, Req] = {}
    reqs = []
    for j in range(params.n):
        message = wire.GenerateReq(f"{rid}-{j}", list(input_ids), params,
                                 prefill_leader=f"{rid}-0" if j else None)
        reqs.append(make_req(message, scheduler.sampling_step.tokenizer, leaders))
        leaders[reqs[-1].rid] = reqs[-1]
    return reqs


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



def mooncake_missing() -> str | None:
    """Why Mooncake's transfer engine cannot load here (its wheel needs the system's
    libibverbs1), or None when it can."""
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as err:
        return f"Mooncake's transfer engine cannot load: {err}"
    return None
