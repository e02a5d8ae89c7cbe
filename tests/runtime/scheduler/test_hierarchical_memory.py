"""The hierarchical prefix cache under a live scheduler (``--enable-hierarchical-cache``:
radixlm/kv_cache/hierarchical_cache.py, built by radixlm/runtime/scheduler/
hierarchical_memory.py): requests whose prefixes were evicted from the device pool (L1) and
served from the host tier (L2) or, after a restart, from the disk tier (L3) give the tokens
and the logprobs of a scheduler computing every prompt cold, under both write policies,
pages of one and four tokens, chunked prefill and retraction; a disk tier written by
another model or dtype is ignored; damaged, missing, read-only or full disks cost only
recomputation and a warning; the pool ends idle and the tiers' stats stay consistent.

The pools here hold 256 tokens, a few times less than each workload's prompts, so L1 evicts
and the host tier is what serves the second round; every test checks in the server info
that the tier it is about was hit, so a cache that silently recomputes fails them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import subprocess
import threading

import pytest
import torch
from mounts import tmpfs
from runtime_checks import assert_pool_idle, run_to_completion, scheduler_req
from workloads import greedy, random_ids

from radixlm.kv_cache.disk_kv_store import DiskKVStore
from radixlm.runtime.scheduler.scheduler_process import build_scheduler
from radixlm.runtime.server_args import ServerArgs

# One thread and no kernel chosen by timing: both schedulers of a comparison compute the
# same float32 sums (greedy ties could otherwise flip).
BASE = {"num_threads": 1, "disable_adaptive_timing": True, "chunked_prefill_step_ms": None}
COLD = {**BASE, "disable_radix_cache": True}
HI = {**BASE, "max_total_tokens": 256, "max_running_requests": 8,
      "enable_hierarchical_cache": True, "hicache_block_tokens": 8, "hicache_ratio": 16.0}
SMALL_POOL = {"max_total_tokens": 160, "init_new_token_ratio": 0.01,
              "min_new_token_ratio": 0.01, "new_token_ratio_decay": 0.5}
LOGPROBS = {"return_logprob": True, "top_logprobs_num": 3}
CACHE_LOGGERS = ("radixlm.kv_cache.disk_kv_store", "radixlm.kv_cache.hierarchical_cache")


def shared_prefix_prompts(count: int, seed: int, system: int = 40) -> list[list[int]]:
    """``count`` prompts over three system prompts of ``system`` tokens, each followed by
    16-40 tokens of its own."""
    rng = random.Random(seed)
    systems = [random_ids(seed * 100 + i, system) for i in range(3)]
    return [systems[i % 3] + random_ids(seed * 1000 + i, rng.randint(16, 40))
            for i in range(count)]


def run(scheduler, prompts, params, **fields) -> list:
    """The requests run as one batch; their finished ``Req``s."""
    reqs = [scheduler_req(scheduler, p, s, **fields) for p, s in zip(prompts, params)]
    run_to_completion(scheduler, reqs, max_steps=20_000)
    return reqs


def run_in_groups(scheduler, prompts, params, group: int = 3, **fields) -> list:
    """The requests run ``group`` at a time (later groups find earlier groups' prefixes in
    whichever tier keeps them by then)."""
    reqs = []
    for start in range(0, len(prompts), group):
        reqs += run(scheduler, prompts[start : start + group], params[start : start + group],
                    **fields)
    return reqs


def assert_same_outputs(got: list, expected: list, atol: float = 1e-5) -> None:
    """Token for token, and (where asked for) the output logprobs and top logprobs within
    ``atol``."""
    assert len(got) == len(expected)
    for ours, theirs in zip(got, expected):
        assert ours.output_ids == theirs.output_ids, ours.rid
        if not theirs.output_token_logprobs:
            continue
        assert len(ours.output_token_logprobs) == len(ours.output_ids)
        assert [e[1] for e in ours.output_token_logprobs] == ours.output_ids
        torch.testing.assert_close(torch.tensor([e[0] for e in ours.output_token_logprobs]),
                                   torch.tensor([e[0] for e in theirs.output_token_logprobs]),
                                   atol=atol, rtol=0)
        assert len(ours.output_top_logprobs) == len(ours.output_ids)
        for top, their_top in zip(ours.output_top_logprobs, theirs.output_top_logprobs):
            assert [e[1] for e in top] == [e[1] for e in their_top]
            torch.testing.assert_close(torch.tensor([e[0] for e in top]),
                                       torch.tensor([e[0] for e in their_top]),
                                       atol=atol, rtol=0)


def tiers(scheduler) -> dict:
    """The hierarchical cache's stats, after checking the pool is idle and the tiers'
    accounting holds."""
    info = scheduler.server_info()
    assert_pool_idle(info)
    found = info["hierarchical_cache"]
    host = found["host"]
    assert 0 <= host["blocks"] <= host["capacity"], host
    assert host["tokens"] == host["blocks"] * found["block_tokens"]
    assert found["device_tokens"] == info["cache_tokens"]
    assert found["device_tokens"] <= info["max_total_tokens"]
    disk = found["disk"]
    if disk is not None:
        capacity = scheduler.memory.tree_cache.disk.capacity_bytes
        assert disk["files"] >= 0 and 0 <= disk["bytes_used"] <= capacity, disk
    return found


COUNTERS = ("device_hit_tokens", "host_hit_tokens", "disk_hit_tokens", "loads", "write_backs",
            "disk_writes_queued")


def since(scheduler, before: dict) -> dict:
    now = tiers(scheduler)
    return {name: now[name] - before[name] for name in COUNTERS}


def fresh(scheduler):
    """``scheduler`` with empty L1 and L2: its hits come from this test only."""
    assert scheduler.flush_cache()
    found = tiers(scheduler)
    assert found["device_tokens"] == 0 and found["host"]["blocks"] == 0, found
    return scheduler


def make(path, **options):
    """A scheduler of its own (``scheduler_for`` shares them by options: a restart needs a
    new one over the same directory); shut it down after use."""
    options = {"dtype": "float32", **options}
    return build_scheduler(ServerArgs(str(path), **options), str(path))


@contextlib.contextmanager
def scheduler_over(path, **options):
    scheduler = make(path, **options)
    try:
        yield scheduler
    finally:
        scheduler.shutdown()


def disk_options(directory, **options) -> dict:
    return {**HI, "hicache_storage_backend": "file", "hicache_storage_dir": str(directory),
            **options}


def drain_disk_writes(scheduler) -> None:
    """Waits for the disk writes queued so far (the disk worker is one thread: a no-op
    queued after them ends after them)."""
    scheduler.memory.tree_cache._worker.submit(lambda: None).result()


def block_files(directory) -> list:
    return sorted((p for p in os.scandir(directory) if p.name.endswith(".safetensors")),
                  key=lambda p: p.name)


# L2: exactness -------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_prompts_loaded_back_from_the_host_tier_give_the_cold_tokens_and_logprobs(
        scheduler_for, policy, page_size):
    prompts = shared_prefix_prompts(12, 1)
    params = [greedy(8) for _ in prompts]
    expected = run_in_groups(scheduler_for(**COLD), prompts, params, **LOGPROBS)
    hi = fresh(scheduler_for(**HI, hicache_write_policy=policy, page_size=page_size))
    before = tiers(hi)
    first = run_in_groups(hi, prompts, params, **LOGPROBS)
    second = run_in_groups(hi, prompts, params, **LOGPROBS)
    assert_same_outputs(first, expected)
    assert_same_outputs(second, expected)
    delta = since(hi, before)
    assert delta["host_hit_tokens"] > 0 and delta["loads"] > 0, delta
    assert delta["write_backs"] > 0, delta
    assert tiers(hi)["write_policy"] == policy


def conversation_turn(conversations: list[list[int]], reqs: list, turn: int) -> None:
    """Each conversation's next prompt: its last prompt, the model's answer, new text."""
    for i, req in enumerate(reqs):
        conversations[i] = conversations[i] + req.output_ids + random_ids(
            7_000 + 100 * turn + i, 12)


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_interleaved_multi_turn_conversations_give_the_cold_tokens_and_logprobs(
        scheduler_for, policy):
    cold = scheduler_for(**COLD)
    hi = fresh(scheduler_for(**HI, hicache_write_policy=policy))
    before = tiers(hi)
    ours = shared_prefix_prompts(8, 2, system=48)
    theirs = [list(p) for p in ours]
    for turn in range(4):
        params = [greedy(6) for _ in ours]
        expected = run_in_groups(cold, theirs, params, group=2, **LOGPROBS)
        got = run_in_groups(hi, ours, params, group=2, **LOGPROBS)
        assert_same_outputs(got, expected)
        conversation_turn(ours, got, turn)
        conversation_turn(theirs, expected, turn)
    delta = since(hi, before)
    assert delta["host_hit_tokens"] > 0 and delta["loads"] > 0, delta


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_over_loaded_prefixes_gives_the_cold_tokens(scheduler_for, page_size):
    prompts = shared_prefix_prompts(10, 3, system=56)
    params = [greedy(8) for _ in prompts]
    expected = run_in_groups(scheduler_for(**COLD), prompts, params, **LOGPROBS)
    hi = fresh(scheduler_for(**HI, chunked_prefill_size=16, page_size=page_size))
    before = tiers(hi)
    run_in_groups(hi, prompts, params, **LOGPROBS)
    assert_same_outputs(run_in_groups(hi, prompts, params, **LOGPROBS), expected)
    delta = since(hi, before)
    assert delta["host_hit_tokens"] > 0 and delta["loads"] > 0, delta


def test_retracted_requests_over_loaded_prefixes_give_the_cold_tokens(scheduler_for):
    rng = random.Random(4)
    prompts = shared_prefix_prompts(24, 4, system=24)
    params = [greedy(rng.randint(8, 40)) for _ in prompts]
    expected = run(scheduler_for(**COLD), prompts, params)
    hi = fresh(scheduler_for(**{**HI, **SMALL_POOL}))
    before_retractions = hi.server_info()["stats"]["retractions"]
    before = tiers(hi)
    run(hi, prompts, params)
    assert_same_outputs(run(hi, prompts, params), expected)
    assert hi.server_info()["stats"]["retractions"] > before_retractions
    delta = since(hi, before)
    assert delta["host_hit_tokens"] > 0 and delta["loads"] > 0, delta


def test_prompt_logprobs_after_a_loaded_prefix_equal_cold_ones(scheduler_for):
    """Prompt logprobs owed from a position on cap the cached prefix there (``match_key``):
    what is loaded stops before it, and the owed positions are computed."""
    prompts = shared_prefix_prompts(12, 15)
    params = [greedy(4) for _ in prompts]
    cold = scheduler_for(**COLD)
    hi = fresh(scheduler_for(**HI))
    run_in_groups(hi, prompts, params)
    before = tiers(hi)
    for prompt, sampling in zip(prompts, params):
        fields = {**LOGPROBS, "logprob_start": len(prompt) - 6}
        [theirs] = run(cold, [prompt], [sampling], **fields)
        [ours] = run(hi, [prompt], [sampling], **fields)
        assert_same_outputs([ours], [theirs])
        assert len(ours.input_token_logprobs) == len(theirs.input_token_logprobs) > 0
        assert [e[1] for e in ours.input_token_logprobs] == [
            e[1] for e in theirs.input_token_logprobs]
        assert None not in [e[0] for e in ours.input_token_logprobs]
        torch.testing.assert_close(
            torch.tensor([e[0] for e in ours.input_token_logprobs]),
            torch.tensor([e[0] for e in theirs.input_token_logprobs]), atol=1e-5, rtol=0)
    delta = since(hi, before)
    assert delta["host_hit_tokens"] > 0 and delta["loads"] > 0, delta


def test_the_overlap_schedule_over_loaded_prefixes_gives_the_cold_tokens(scheduler_for):
    prompts = shared_prefix_prompts(12, 17)
    params = [greedy(8) for _ in prompts]
    overlap = {"disable_overlap_schedule": False}
    expected = run_in_groups(scheduler_for(**COLD, **overlap), prompts, params, **LOGPROBS)
    hi = fresh(scheduler_for(**HI, **overlap))
    before, steps = tiers(hi), hi.server_info()["stats"]["overlapped_steps"]
    run_in_groups(hi, prompts, params, **LOGPROBS)
    assert_same_outputs(run_in_groups(hi, prompts, params, **LOGPROBS), expected)
    assert hi.server_info()["stats"]["overlapped_steps"] > steps
    delta = since(hi, before)
    assert delta["host_hit_tokens"] > 0 and delta["loads"] > 0, delta


def test_device_hits_count_the_tokens_loaded_from_the_host_tier(scheduler_for):
    hi = fresh(scheduler_for(**HI))
    prompt = random_ids(1, 64)
    run(hi, [prompt], [greedy(4)])
    for i in range(6):  # evicts it from L1
        run(hi, [random_ids(100 + i, 64)], [greedy(4)])
    before = tiers(hi)
    run(hi, [prompt], [greedy(4)])
    delta = since(hi, before)
    assert delta["host_hit_tokens"] > 0, delta
    assert delta["device_hit_tokens"] >= delta["host_hit_tokens"], delta


def test_hicache_size_sets_the_host_tier_in_bytes(scheduler_for):
    block_bytes = scheduler_for(**COLD).runner.kv_pool.bytes_per_token() * 8
    hi = fresh(scheduler_for(**HI | {"hicache_size": 20 * block_bytes / (1 << 30)}))
    assert tiers(hi)["host"]["capacity"] == 20
    prompts = shared_prefix_prompts(12, 18)
    params = [greedy(8) for _ in prompts]
    expected = run_in_groups(scheduler_for(**COLD), prompts, params)
    run_in_groups(hi, prompts, params)
    assert_same_outputs(run_in_groups(hi, prompts, params), expected)
    host = tiers(hi)["host"]
    assert host["blocks"] == 20 and host["bytes_used"] == 20 * block_bytes, host


def test_a_host_tier_of_a_few_blocks_drops_the_oldest_and_stays_exact(scheduler_for):
    prompts = shared_prefix_prompts(12, 5)
    params = [greedy(8) for _ in prompts]
    expected = run_in_groups(scheduler_for(**COLD), prompts, params)
    hi = fresh(scheduler_for(**HI | {"hicache_ratio": 0.25}))  # 64 tokens: 8 blocks
    run_in_groups(hi, prompts, params)
    assert_same_outputs(run_in_groups(hi, prompts, params), expected)
    host = tiers(hi)["host"]
    assert host["capacity"] == 8 and host["blocks"] == 8 and host["dropped"] > 0, host


def test_blocks_are_not_shared_across_extra_keys(scheduler_for):
    prompts = shared_prefix_prompts(12, 14)
    params = [greedy(8) for _ in prompts]
    cold = scheduler_for(**COLD)
    hi = fresh(scheduler_for(**HI))
    run_in_groups(hi, prompts, params, extra_key="a")  # the first ones are in L2 by now
    before = tiers(hi)
    expected = run(cold, prompts[:1], params[:1], extra_key="b", **LOGPROBS)
    assert_same_outputs(run(hi, prompts[:1], params[:1], extra_key="b", **LOGPROBS), expected)
    delta = since(hi, before)
    assert delta["host_hit_tokens"] == 0 and delta["device_hit_tokens"] == 0, delta
    before = tiers(hi)
    expected = run(cold, prompts[:1], params[:1], extra_key="a", **LOGPROBS)
    assert_same_outputs(run(hi, prompts[:1], params[:1], extra_key="a", **LOGPROBS), expected)
    assert since(hi, before)["host_hit_tokens"] > 0


# L3: restarts and identities -------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_restarted_scheduler_serves_prompts_from_the_disk_tier_exactly(
        scheduler_for, tiny_model_dir, tmp_path, page_size):
    path = tiny_model_dir()
    prompts = shared_prefix_prompts(10, 6)
    params = [greedy(8) for _ in prompts]
    expected = run_in_groups(scheduler_for(**COLD), prompts, params, **LOGPROBS)
    options = disk_options(tmp_path / "kv", page_size=page_size)
    with scheduler_over(path, **options) as first:
        done = run_in_groups(first, prompts, params, **LOGPROBS)
        assert_same_outputs(done, expected)
        assert tiers(first)["disk_writes_queued"] > 0
        computed = {key + ".safetensors" for req in done for key in
                    first.memory.tree_cache.block_keys(req.input_ids + req.output_ids[:-1],
                                                       None)}
    # shutting down finished the queued writes and wrote what only L1 held: every whole
    # block computed is on disk
    written = {p.name for p in block_files(tmp_path / "kv")}
    assert computed <= written
    with scheduler_over(path, **options) as second:
        assert tiers(second)["disk"]["files"] == len(written)
        assert_same_outputs(run_in_groups(second, prompts, params, **LOGPROBS), expected)
        found = tiers(second)
        assert found["disk_hit_tokens"] > 0 and found["host_hit_tokens"] > 0, found


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_a_restart_finds_the_prefixes_the_last_scheduler_kept_in_the_device_pool(
        scheduler_for, tiny_model_dir, tmp_path, policy):
    path = tiny_model_dir()
    prompts = shared_prefix_prompts(10, 16)
    params = [greedy(8) for _ in prompts]
    options = disk_options(tmp_path / "kv", hicache_write_policy=policy)
    with scheduler_over(path, **options) as first:
        run_in_groups(first, prompts, params)
        # the first prompt's system prompt (40 tokens) is used to the end: kept in L1
        assert first.memory.tree_cache.tree.cached_length(prompts[0][:40], None) == 40
    expected = run(scheduler_for(**COLD), prompts[:1], params[:1], **LOGPROBS)
    with scheduler_over(path, **options) as second:
        assert_same_outputs(run(second, prompts[:1], params[:1], **LOGPROBS), expected)
        found = tiers(second)
    assert found["disk_hit_tokens"] >= 40, found


@pytest.mark.parametrize("other", ["model", "dtype"])
def test_a_disk_tier_written_by_another_model_or_dtype_is_ignored(
        scheduler_for, tiny_model_dir, tmp_path, caplog, other):
    path = tiny_model_dir()
    prompts = shared_prefix_prompts(10, 7)
    params = [greedy(8) for _ in prompts]
    options = disk_options(tmp_path / "kv")
    if other == "model":
        writer, writer_options = tiny_model_dir(seed=1), options
    else:
        writer, writer_options = path, {**options, "dtype": "bfloat16"}
    with scheduler_over(writer, **writer_options) as first:
        run_in_groups(first, prompts, params)
    written = block_files(tmp_path / "kv")
    assert written
    expected = run_in_groups(scheduler_for(**COLD), prompts, params, **LOGPROBS)
    with caplog.at_level(logging.WARNING), scheduler_over(path, **options) as second:
        assert tiers(second)["disk"]["files"] == 0
        assert_same_outputs(run_in_groups(second, prompts, params, **LOGPROBS), expected)
        assert tiers(second)["disk_hit_tokens"] == 0
    assert "another identity" in caplog.text
    assert {p.name for p in written} <= {p.name for p in block_files(tmp_path / "kv")}


def step_until_finished(scheduler, reqs: list, max_steps: int = 20_000) -> None:
    for _ in range(max_steps):
        if all(req.finished for req in reqs):
            return
        scheduler.step()
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


@pytest.mark.parametrize("abort", [False, True], ids=["served", "aborted"])
def test_a_request_waits_for_its_disk_read_while_others_run(
        scheduler_for, tiny_model_dir, tmp_path, monkeypatch, abort):
    path = tiny_model_dir()
    prompts = shared_prefix_prompts(10, 16)
    params = [greedy(8) for _ in prompts]
    # (write-through: the prompt's system prompt, still in L1 at the end, is on disk too)
    options = disk_options(tmp_path / "kv", hicache_write_policy="write_through")
    with scheduler_over(path, **options) as first:
        run_in_groups(first, prompts, params)
    expected = run(scheduler_for(**COLD), prompts[:1], params[:1], **LOGPROBS)
    release, reading = threading.Event(), threading.Event()
    read = DiskKVStore.read

    def held_read(store, key, tokens):
        reading.set()
        assert release.wait(60)
        return read(store, key, tokens)

    monkeypatch.setattr(DiskKVStore, "read", held_read)
    with scheduler_over(path, **options) as hi:
        waiting = scheduler_req(hi, prompts[0], params[0], **LOGPROBS)
        hi.add_request(waiting)
        assert reading.wait(60)
        other = scheduler_req(hi, random_ids(99, 30), greedy(8))
        run_to_completion(hi, [other])  # while the first one's blocks are being read
        assert not waiting.finished and not waiting.output_ids
        assert hi.server_info()["num_waiting"] == 1
        if abort:
            hi.abort(waiting)
        release.set()
        step_until_finished(hi, [waiting])
        if not abort:
            assert_same_outputs([waiting], expected)
        hi.memory.tree_cache.close()  # the read has ended either way
        found = tiers(hi)
        assert found["disk_hit_tokens"] > 0, found
        assert (found["host_hit_tokens"] > 0) != abort, found


# L3: faults under a live scheduler ----------------------------------------------------------


def damage(files: list, how: str) -> None:
    """Cuts each file to half its size, overwrites it with random bytes, flips bytes of its
    payload (the last ones: the header stays whole) or deletes it."""
    for entry in files:
        size = os.path.getsize(entry.path)
        if how == "deleted":
            os.unlink(entry.path)
            continue
        with open(entry.path, "r+b") as f:
            if how == "truncated":
                f.truncate(size // 2)
            elif how == "garbage":
                f.write(os.urandom(size))
            else:
                f.seek(size - 16)
                flipped = bytes(b ^ 0xFF for b in f.read(16))
                f.seek(size - 16)
                f.write(flipped)


@pytest.mark.parametrize("how", ["truncated", "garbage", "flipped", "deleted"])
def test_block_files_damaged_under_a_live_scheduler_cost_only_recomputation(
        scheduler_for, tiny_model_dir, tmp_path, caplog, how):
    path = tiny_model_dir()
    prompts = shared_prefix_prompts(10, 8)
    params = [greedy(8) for _ in prompts]
    expected = run_in_groups(scheduler_for(**COLD), prompts, params, **LOGPROBS)
    with scheduler_over(path, **disk_options(tmp_path / "kv")) as hi:
        run_in_groups(hi, prompts, params)
        drain_disk_writes(hi)
        files = block_files(tmp_path / "kv")
        assert len(files) >= 4
        damage(files, how)
        assert fresh(hi)
        before = tiers(hi)
        with caplog.at_level(logging.WARNING):
            got = run_in_groups(hi, prompts, params, **LOGPROBS)
        assert_same_outputs(got, expected)
        delta = since(hi, before)
        assert delta["disk_hit_tokens"] == 0, delta
    assert any(r.name in CACHE_LOGGERS and r.levelno >= logging.WARNING
               for r in caplog.records), caplog.text


def test_block_files_damaged_between_runs_are_deleted_at_start_up(
        scheduler_for, tiny_model_dir, tmp_path, caplog):
    path = tiny_model_dir()
    prompts = shared_prefix_prompts(10, 9)
    params = [greedy(8) for _ in prompts]
    expected = run_in_groups(scheduler_for(**COLD), prompts, params, **LOGPROBS)
    options = disk_options(tmp_path / "kv")
    with scheduler_over(path, **options) as first:
        run_in_groups(first, prompts, params)
        kept = {key + ".safetensors" for key in first.memory.tree_cache.block_keys(prompts[0],
                                                                                  None)}
    files = [p for p in block_files(tmp_path / "kv") if p.name not in kept]
    assert len(files) >= 8
    for start, how in enumerate(["truncated", "garbage", "flipped", "deleted"]):
        damage(files[start:8:4], how)
    with caplog.at_level(logging.WARNING), scheduler_over(path, **options) as second:
        assert "unreadable" in caplog.text  # the ones whose header is gone, at start-up
        assert_same_outputs(run_in_groups(second, prompts, params, **LOGPROBS), expected)
        found = tiers(second)
    assert found["disk_hit_tokens"] > 0, found  # the first prompt's blocks, left whole


def test_a_full_disk_loses_blocks_with_a_warning_and_requests_stay_exact(
        scheduler_for, tiny_model_dir, tmp_path, caplog):
    path = tiny_model_dir()
    prompts = shared_prefix_prompts(12, 10)
    params = [greedy(8) for _ in prompts]
    expected = run_in_groups(scheduler_for(**COLD), prompts, params, **LOGPROBS)
    with tmpfs(tmp_path / "kv", "24k") as directory, caplog.at_level(logging.WARNING):
        with scheduler_over(path, **disk_options(directory)) as hi:
            assert_same_outputs(run_in_groups(hi, prompts, params, **LOGPROBS), expected)
            assert_same_outputs(run_in_groups(hi, prompts, params, **LOGPROBS), expected)
            drain_disk_writes(hi)
            disk = tiers(hi)["disk"]
        assert disk["write_failures"] > 0, disk
    assert "disk KV store" in caplog.text


def test_a_read_only_disk_serves_its_blocks_and_loses_new_ones_with_a_warning(
        scheduler_for, tiny_model_dir, tmp_path, caplog):
    path = tiny_model_dir()
    prompts = shared_prefix_prompts(12, 11)
    params = [greedy(8) for _ in prompts]
    expected = run_in_groups(scheduler_for(**COLD), prompts, params, **LOGPROBS)
    others = shared_prefix_prompts(12, 12)
    expected_others = run_in_groups(scheduler_for(**COLD), others, params)
    with tmpfs(tmp_path / "kv", "16m") as directory:
        options = disk_options(directory)
        with scheduler_over(path, **options) as first:
            run_in_groups(first, prompts, params)
        subprocess.run(["mount", "-o", "remount,ro", str(directory)], check=True)
        with caplog.at_level(logging.WARNING), scheduler_over(path, **options) as second:
            assert_same_outputs(run_in_groups(second, prompts, params, **LOGPROBS), expected)
            assert_same_outputs(run_in_groups(second, others, params), expected_others)
            drain_disk_writes(second)
            found = tiers(second)
        assert found["disk_hit_tokens"] > 0, found
        assert found["disk"]["write_failures"] > 0, found
    assert "disk KV store" in caplog.text


# The Engine and the default model --------------------------------------------------------------


def test_engine_server_info_reports_each_tiers_occupancy_and_hits(engine_for):
    engine = engine_for(enable_hierarchical_cache=True, max_total_tokens=256,
                        hicache_block_tokens=8, num_threads=1)
    prompts = shared_prefix_prompts(10, 13)
    for _ in range(2):
        for start in range(0, len(prompts), 3):
            engine.generate(input_ids=prompts[start : start + 3], sampling_params=greedy(4))
    info = engine.get_server_info()["hierarchical_cache"]
    assert info["write_policy"] == "write_back" and info["block_tokens"] == 8
    assert info["device_tokens"] > 0
    assert 0 < info["host"]["blocks"] <= info["host"]["capacity"]
    assert info["host"]["tokens"] == 8 * info["host"]["blocks"]
    assert info["host_hit_tokens"] > 0 and info["loads"] > 0 and info["write_backs"] > 0
    assert info["disk"] is None


@pytest.mark.slow
def test_default_model_outputs_from_host_and_disk_equal_cold_ones(tmp_path):
    from radixlm.models.default_model import default_model_path

    path = str(default_model_path())
    rng = random.Random(0)
    system = [rng.randrange(100, 40_000) for _ in range(120)]
    # 120 + 8 * (80 + 8) tokens: more than the pool's 512, so the first ones are evicted
    prompts = [system + [rng.randrange(100, 40_000) for _ in range(80)] for _ in range(8)]
    params = [greedy(8) for _ in prompts]
    # A cached prefix changes the shapes of the suffix's matmuls (as any prefix hit does):
    # over this model's 30 layers, float32 sums differ from cold ones past 1e-5.
    atol = 1e-4
    with scheduler_over(path, **COLD) as cold:
        expected = [run(cold, [p], [s], **LOGPROBS)[0] for p, s in zip(prompts, params)]
    options = {**disk_options(tmp_path / "kv"), "max_total_tokens": 512,
               "hicache_block_tokens": 32}
    with scheduler_over(path, **options) as hi:
        for _ in range(2):
            got = [run(hi, [p], [s], **LOGPROBS)[0] for p, s in zip(prompts, params)]
            assert_same_outputs(got, expected, atol)
        assert tiers(hi)["host_hit_tokens"] > 0
    with scheduler_over(path, **options) as restarted:
        got = [run(restarted, [p], [s], **LOGPROBS)[0] for p, s in zip(prompts, params)]
        assert_same_outputs(got, expected, atol)
        assert tiers(restarted)["disk_hit_tokens"] > 0
