"""Extend, decode and finishing steps read nothing back from the device but what
``host_reads.STEP_HOST_READS`` declares, and upload host values only through ``to_device``.

The real scheduler and model runner run a tiny model on the CPU under ``HostReadGuard``
(``tests/host_read_guard.py``), which tells the runtime's "device" tensors from host ones by
where they were made and records every read of them and every pageable upload, with its
call site. The workload touches every path of a step: prompt and output logprobs, sampled
and penalized rows, a grammar mask, chunked prefill, a cached prefix (whole pages), two
requests caching the same tokens (their duplicates freed), requests that end inside a page,
in the plain loop and with overlap (the worker's thread runs under the guard too), with
speculative decoding's verify steps (n-gram drafts, a draft model's passes), and a windowed
model (Gemma 2's local layers on the hybrid pool) past its window."""

from __future__ import annotations

import pytest
import torch
from host_read_guard import HostReadGuard
from runtime_checks import assert_pool_idle, scheduler_req
from workloads import greedy, random_ids, sampled

from radixlm.host_to_device import to_device
from radixlm.runtime.scheduler import request_memory
from radixlm.runtime.scheduler.host_reads import READ_ON_BEHALF, STEP_HOST_READS
from radixlm.runtime.scheduler.scheduler_process import build_scheduler
from radixlm.runtime.server_args import ServerArgs

CPU = torch.device("cpu")
PLAIN, OVERLAP = {"disable_overlap_schedule": True}, {"disable_overlap_schedule": False}
CONFIGS = {
    "plain-page1": {**PLAIN, "page_size": 1},
    "plain-page4": {**PLAIN, "page_size": 4},
    "overlap-page4": {**OVERLAP, "page_size": 4},
    "evicting-page4": {**PLAIN, "page_size": 4, "max_total_tokens": 96},
    "no-cache": {**OVERLAP, "page_size": 4, "disable_radix_cache": True},
    # speculative decoding: verify steps (n-gram drafts), rejected draft slots given back
    "speculative-page4": {**PLAIN, "page_size": 4, "speculative_algorithm": "NGRAM",
                          "speculative_ngram_min_match_window_size": 1},
    "speculative-overlap-page1": {**OVERLAP, "page_size": 1, "speculative_algorithm": "NGRAM",
                                  "speculative_ngram_min_match_window_size": 1},
    # a draft model (the tiny model drafting for itself): draft passes, then verify steps
    "speculative-draft-page4": {**PLAIN, "page_size": 4, "speculative_algorithm": "STANDALONE",
                                "draft_self": True},
    # Gemma 2's local layers on the hybrid pool: windows released as requests run
    "windowed-page4": {**OVERLAP, "page_size": 4, "architecture": "Gemma2ForCausalLM"},
}
TOKEN_READS = ("radixlm/runtime/scheduler/sampling_step.py:SamplingStep._sample",
               "radixlm/runtime/scheduler/decode_worker.py:DecodeInFlight.host_outputs")
LOGPROB_READ = "radixlm/runtime/sampling/logprobs.py:LogprobCopy.read"
SITES_SEEN: dict[str, set[str]] = {}
"""Each config's read sites, for the check that every declared site is still used."""
SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'


@pytest.fixture(scope="module")
def guarded(tiny_model_dir):
    """Returns a function building (once per config) a scheduler whose device tensors the
    module's guard has seen made, with the overlap worker's steps run under the guard."""
    guard = HostReadGuard(CPU)
    built = {}

    def build(name: str):
        if name not in built:
            options = {"max_total_tokens": 2048, **CONFIGS[name]}
            path = str(tiny_model_dir(options.pop("architecture", "LlamaForCausalLM")))
            if options.pop("draft_self", False):
                options["speculative_draft_model_path"] = path
            args = ServerArgs(path, dtype="float32", num_threads=1, chunked_prefill_size=32,
                              **options)
            with guard:  # recording is off: it only marks what is made on the device
                scheduler = build_scheduler(args, path)
            if scheduler.overlap.worker is not None:
                worker = scheduler.overlap.worker
                worker._run = guard.wrap(worker._run)
            built[name] = scheduler
        return guard, built[name]

    yield build
    for scheduler in built.values():
        scheduler.shutdown()


def workload(scheduler) -> list[list]:
    """Two waves of requests: the second reuses the first's cached prompts."""
    shared = random_ids(1, 23)
    first = [
        scheduler_req(scheduler, random_ids(2, 45), greedy(6), return_logprob=True,
                      top_logprobs_num=2, logprob_start=3),
        scheduler_req(scheduler, random_ids(6, 10), greedy(24)),  # beyond the tiny window
        scheduler_req(scheduler, random_ids(3, 13), sampled(7, 5, frequency_penalty=0.5,
                                                            repetition_penalty=1.2)),
        scheduler_req(scheduler, shared, greedy(3)),
        scheduler_req(scheduler, shared, greedy(5)),  # the same tokens, cached twice
        scheduler_req(scheduler, random_ids(4, 9), {"temperature": 0.0, "max_new_tokens": 6,
                                                    "json_schema": SCHEMA}),
    ]
    second = [
        scheduler_req(scheduler, shared + random_ids(5, 6), greedy(4), return_logprob=True),
        scheduler_req(scheduler, random_ids(2, 45)[:40], sampled(9, 3)),
    ]
    return [first, second]


def run_guarded(guard: HostReadGuard, scheduler) -> list[int]:
    """Runs the workload's waves under the guard; returns where each step's findings
    start in ``guard.findings``."""
    steps = []
    for wave in workload(scheduler):
        for req in wave:
            scheduler.add_request(req)
        guard.recording = True
        try:
            with guard:
                for _ in range(200):
                    if all(req.finished for req in wave):
                        break
                    steps.append(len(guard.findings))
                    scheduler.step()
        finally:
            guard.recording = False
        assert all(req.finished for req in wave)
    scheduler.drain()
    return steps


def logprobs_read_before_tokens(guard: HostReadGuard, steps: list[int]) -> list[str]:
    """Steps that read a logprob copy before their tokens (a step that samples nothing,
    a prompt chunk, may read only logprobs: that is its one wait)."""
    early = []
    for start, stop in zip(steps, [*steps[1:], len(guard.findings)]):
        sites = [f.site(READ_ON_BEHALF) for f in guard.findings[start:stop]]
        if any(site in TOKEN_READS for site in sites):
            first_token = min(i for i, site in enumerate(sites) if site in TOKEN_READS)
            early += [guard.findings[start + i].describe(READ_ON_BEHALF)
                      for i, site in enumerate(sites[:first_token]) if site == LOGPROB_READ]
    return early


def unexpected_report(guard: HostReadGuard) -> str:
    found = guard.unexpected(STEP_HOST_READS, READ_ON_BEHALF)
    lines = sorted({f.describe(READ_ON_BEHALF) for f in found})
    return ("host reads or pageable uploads not declared in "
            "radixlm/runtime/scheduler/host_reads.py:\n  " + "\n  ".join(lines))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_steps_read_back_only_the_declared_values(guarded, name):
    guard, scheduler = guarded(name)
    guard.findings.clear()
    stats = scheduler.state.stats
    before = (stats.extend_steps, stats.decode_steps)
    steps = run_guarded(guard, scheduler)
    if "speculative" in name:  # again: now drafts come from the first run's outputs (tree)
        steps += run_guarded(guard, scheduler)
    assert stats.extend_steps > before[0] and stats.decode_steps > before[1]
    assert not guard.unexpected(STEP_HOST_READS, READ_ON_BEHALF), unexpected_report(guard)
    early = logprobs_read_before_tokens(guard, steps)
    assert not early, "logprobs read before their step's tokens:\n  " + "\n  ".join(early)
    sites = {f.site(READ_ON_BEHALF) for f in guard.findings}
    token_read = ("radixlm/runtime/scheduler/decode_worker.py:DecodeInFlight.host_outputs"
                  if "overlap" in name else
                  "radixlm/runtime/scheduler/sampling_step.py:SamplingStep._sample")
    assert token_read in sites, "the guard missed the step's token read"
    if "speculative" in name:
        assert stats.spec_verify_steps > 0, "no verify step ran: the workload proposed nothing"
        assert "radixlm/runtime/scheduler/speculative_decode.py:SpeculativeDecode._accept" in sites
    if "draft" in name:
        assert ("radixlm/runtime/speculative/draft_model_proposer.py:DraftModelProposer._argmax"
                in sites)
    assert LOGPROB_READ in sites
    assert_pool_idle(scheduler.server_info())
    SITES_SEEN[name] = sites


def test_a_new_read_in_the_step_fails_naming_its_call_site(guarded, monkeypatch):
    guard, scheduler = guarded("plain-page4")
    allocate = request_memory.RequestMemory.alloc

    def alloc_reading_back(self, req, num_tokens):  # what RequestMemory.alloc once did
        slots = allocate(self, req, num_tokens)
        req.last_slot = int(slots[-1]) if num_tokens else req.last_slot
        return slots

    monkeypatch.setattr(request_memory.RequestMemory, "alloc", alloc_reading_back)
    guard.findings.clear()
    run_guarded(guard, scheduler)
    report = unexpected_report(guard)
    assert "_local_scalar_dense" in report
    assert "radixlm/runtime/scheduler/step_batches.py:StepBatches.extend" in report


def test_every_declared_site_is_still_used():
    """Run after the configs above: a declared read that no step makes any more goes."""
    if set(SITES_SEEN) != set(CONFIGS):
        pytest.skip("needs every config of test_steps_read_back_only_the_declared_values")
    unused = set(STEP_HOST_READS) - set().union(*SITES_SEEN.values())
    assert not unused, f"declared in host_reads.py but never read: {sorted(unused)}"


# The guard itself --------------------------------------------------------------------------

def reads_of(action) -> list[str]:
    guard = HostReadGuard(CPU)
    with guard:
        device = torch.arange(8, device=CPU)
        host = torch.arange(8)
        guard.recording = True
        action(device, host)
    return [f"{f.kind}:{f.what}" for f in guard.findings]


@pytest.mark.parametrize("action", [
    lambda d, h: d.tolist(),
    lambda d, h: d[0].item(),
    lambda d, h: int(d[1]),
    lambda d, h: bool(d[2] > 1),
    lambda d, h: [0, 1, 2][d[1]],
    lambda d, h: d.cpu(),
    lambda d, h: d[d > 3],
    lambda d, h: torch.unique(d),
    lambda d, h: d.nonzero(),
    lambda d, h: (d + 1).tolist(),  # an op's output is on the device too
    lambda d, h: h.copy_(d),
], ids=["tolist", "item", "int", "bool", "index", "cpu", "mask", "unique", "nonzero",
        "derived", "copy-to-host"])
def test_the_guard_records_each_kind_of_read(action):
    found = reads_of(action)
    assert found and all(f.startswith("read:") for f in found), found


@pytest.mark.parametrize("action", [
    lambda d, h: torch.tensor([1, 2], device=CPU),
    lambda d, h: h.to(CPU),
    lambda d, h: d[[1, 2]],
    lambda d, h: d.copy_(h),
], ids=["tensor-on-device", "to-device", "list-index", "copy-from-host"])
def test_the_guard_records_uploads_from_pageable_memory(action):
    found = reads_of(action)
    assert found and all(f.startswith("upload:") for f in found), found


def test_the_guard_lets_host_work_and_to_device_through():
    def action(d, h):
        h.tolist()
        int(h[1])
        torch.unique(h)
        to_device([1, 2, 3], torch.int64, CPU)
        (d + to_device([1] * 8, torch.int64, CPU)).sum()

    assert reads_of(action) == []

