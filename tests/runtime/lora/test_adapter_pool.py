"""Tests of radixlm/runtime/lora/adapter_pool.py and of admission by adapter: a batch's
segments, the device slots (least recently used first, never more than the limit, never one
adapter twice), unregistering while requests still use an adapter, and a scheduler that runs
more distinct adapters than it has slots without starving any."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lora_adapters import assert_matches_reference, random_prompts, write_raw_adapter
from runtime_checks import run_to_completion, scheduler_req

NAMES = [f"p{i}" for i in range(6)]


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> dict[str, Path]:
    """Six small adapters (ranks 1 and 2; q and v, or o and down)."""
    root = tmp_path_factory.mktemp("pool")
    return {name: write_raw_adapter(root / name, seed=20 + i, rank=1 + i % 2,
                                    targets=("q_proj", "v_proj") if i % 2
                                    else ("o_proj", "down_proj"))
            for i, name in enumerate(NAMES)}


@pytest.fixture
def scheduler(scheduler_for, raw):
    """An in-process scheduler serving the six adapters with two slots."""
    return scheduler_for(lora_paths=tuple(f"{n}={p}" for n, p in raw.items()),
                         max_loras_per_batch=2, max_lora_rank=4)


def slot_names(pool) -> list[str | None]:
    return pool.stats()["slots"]


def check_slots(pool) -> None:
    """The invariant: no adapter in two slots."""
    held = [name for name in slot_names(pool) if name]
    assert len(held) == len(set(held))


def segments(batch) -> list[tuple[int, int, int]]:
    return list(zip(batch.starts.tolist(), batch.lens.tolist(), batch.slots.tolist()))


def test_a_batch_s_rows_come_in_segments_of_one_adapter(scheduler):
    pool = scheduler.runner.lora
    batch = pool.batch_for([None, "p0", "p0", None, "p1", "p1"], [3, 1, 2, 1, 1, 4])
    slot = {name: i for i, name in enumerate(slot_names(pool)) if name}
    assert segments(batch) == [(0, 3, -1), (3, 3, slot["p0"]), (6, 1, -1),
                               (7, 5, slot["p1"])]
    assert batch.max_len == 5 and batch.starts.dtype == torch.int32
    assert pool.batch_for([None, None], [4, 1]) is None
    check_slots(pool)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from([None, *NAMES]), st.integers(1, 5)), min_size=1,
                max_size=12).filter(lambda rows: len({n for n, _ in rows if n}) <= 2))
def test_segments_cover_every_row_once_each_with_its_adapter_s_slot(scheduler, rows):
    pool = scheduler.runner.lora
    names, counts = [n for n, _ in rows], [c for _, c in rows]
    batch = pool.batch_for(names, counts)
    if not any(names):
        assert batch is None
        return
    per_row = [name for name, count in rows for _ in range(count)]
    held = slot_names(pool)
    covered = []
    for start, length, slot in segments(batch):
        assert start == len(covered) and length >= 1  # in order, no gap, no overlap
        covered += [None if slot == -1 else held[slot]] * length
    assert covered == per_row
    slots = batch.slots.tolist()
    assert all(a != b for a, b in zip(slots, slots[1:]))  # adjacent rows of one slot merged
    assert batch.max_len == max(batch.lens.tolist())
    check_slots(pool)


def test_slots_are_reused_least_recently_used_first(scheduler):
    pool = scheduler.runner.lora
    pool.batch_for(["p0", "p1"], [1, 1])
    assert sorted(slot_names(pool)) == ["p0", "p1"]
    pool.batch_for(["p0"], [1])  # p1 is now the least recently used
    pool.batch_for(["p2"], [1])
    assert sorted(slot_names(pool)) == ["p0", "p2"]
    pool.batch_for(["p2", "p3"], [1, 1])  # p0 goes, whatever p2's age: p2 is wanted
    assert sorted(slot_names(pool)) == ["p2", "p3"]
    slot_of_p2 = slot_names(pool).index("p2")
    pool.batch_for(["p2", "p4"], [1, 1])
    assert slot_names(pool).index("p2") == slot_of_p2  # an adapter in a slot stays there
    check_slots(pool)


def test_more_adapters_than_slots_in_one_batch_is_refused(scheduler):
    with pytest.raises(RuntimeError, match="3 adapters in one batch, above max_loras_per_"
                                           "batch 2"):
        scheduler.runner.lora.batch_for(["p0", "p1", "p2"], [1, 1, 1])


def test_an_adapter_in_use_is_unregistered_once_unused(scheduler, raw):
    pool = scheduler.runner.lora
    pool.register("late", str(raw["p1"]))
    with pytest.raises(ValueError, match="'late' is loaded already"):
        pool.register("late", str(raw["p2"]))
    pool.batch_for(["late"], [2])
    assert pool.unregister("late", in_use={"late", "p0"}) is True
    assert not pool.has("late") and pool.stats()["retiring"] == ["late"]
    with pytest.raises(ValueError, match="no LoRA adapter named 'late'"):
        pool.check("late")
    with pytest.raises(ValueError, match="'late' was unloaded but requests still run on it"):
        pool.register("late", str(raw["p1"]))  # (while its requests run)
    pool.batch_for(["late", None], [1, 1])  # its running requests still get it
    pool.purge({"late"})
    assert pool.retiring
    pool.purge({"p0"})
    assert not pool.retiring and "late" not in slot_names(pool)
    with pytest.raises(ValueError, match="no adapter named 'late'"):
        pool.unregister("late", set())
    pool.register("late", str(raw["p1"]))
    assert pool.unregister("late", in_use=set()) is False
    assert "late" not in pool.names() + pool.stats()["retiring"]


def test_more_distinct_adapters_than_slots_all_finish_right(scheduler, tiny_model_dir, raw):
    """18 requests over six adapters and the base, two slots: every step's batch holds at
    most two adapters, and no request waits forever behind others."""
    lora = scheduler.runner.lora
    prompts = random_prompts(18, seed=30)
    names = [[*NAMES, None][i % 7] for i in range(18)]
    greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    reqs = [scheduler_req(scheduler, prompt, greedy, lora_path=name)
            for prompt, name in zip(prompts, names)]
    for req in reqs:
        scheduler.add_request(req)
    seen: set[str] = set()
    for _ in range(2000):
        if all(req.finished for req in reqs):
            break
        scheduler.step()
        state = scheduler.state
        batch = {r.lora_name for r in [*state.running, state.chunked]
                 if r is not None and r.lora_name}
        assert len(batch) <= 2, batch
        assert len(slot_names(lora)) == 2
        check_slots(lora)
        seen |= batch
    else:
        pytest.fail("requests still unfinished")
    assert seen == set(NAMES)
    outs = [{"output_ids": req.output_ids, "meta_info": {}} for req in reqs]
    assert_matches_reference(tiny_model_dir(), raw, prompts, names, outs, 6)


def test_an_adapter_waiting_for_a_slot_is_not_starved_by_later_arrivals(scheduler):
    """Requests on p0 and p1 keep arriving, one each step, while one on p2 waits (both
    slots busy): p2's request still runs, before the arrivals after it."""
    greedy = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    prompts = iter(random_prompts(400, seed=31, low=4, high=12))
    early = [scheduler_req(scheduler, next(prompts), greedy, lora_path=name)
             for name in ("p0", "p1", "p0", "p1")]
    for req in early:
        scheduler.add_request(req)
    scheduler.step()
    waiting = scheduler_req(scheduler, next(prompts), greedy, lora_path="p2")
    scheduler.add_request(waiting)
    later = []
    for step in range(300):
        if waiting.finished:
            break
        req = scheduler_req(scheduler, next(prompts), greedy, lora_path=("p0", "p1")[step % 2])
        scheduler.add_request(req)
        later.append(req)
        scheduler.step()
    assert waiting.finished, "the p2 request never ran"
    rest = [r for r in early + later if not r.finished]
    for _ in range(2000):
        if all(r.finished for r in rest):
            break
        scheduler.step()
    assert all(r.finished for r in rest)


def runs_a_new_adapter_behind_cache_hits(scheduler) -> bool:
    """Requests on p0 and p1 whose prefixes are cached keep arriving, one a step, while one
    on p2 waits (both slots busy): whether p2's request ran within 200 steps."""
    greedy = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    shared = {name: random_prompts(1, seed=40 + i, low=48, high=48)[0]
              for i, name in enumerate(("p0", "p1"))}
    tails = iter(random_prompts(400, seed=41, low=2, high=4))
    run_to_completion(scheduler, [scheduler_req(scheduler, shared[name], greedy,
                                                lora_path=name) for name in ("p0", "p1")])
    running = [scheduler_req(scheduler, shared[name] + next(tails), greedy, lora_path=name)
               for name in ("p0", "p1")]
    for req in running:
        scheduler.add_request(req)
    scheduler.step()
    waiting = scheduler_req(scheduler, random_prompts(1, seed=42)[0], greedy, lora_path="p2")
    scheduler.add_request(waiting)
    later = []
    for step in range(200):
        if waiting.finished:
            break
        name = ("p0", "p1")[step % 2]
        later.append(scheduler_req(scheduler, shared[name] + next(tails), greedy,
                                   lora_path=name))
        scheduler.add_request(later[-1])
        scheduler.step()
    ran = waiting.finished
    rest = [r for r in running + later + [waiting] if not r.finished]
    for _ in range(3000):
        if all(r.finished for r in rest):
            break
        scheduler.step()
    assert all(r.finished for r in rest)
    return ran


def test_a_new_adapter_is_not_starved_by_cache_hits_first_come_first_served(scheduler_for,
                                                                              raw):
    fcfs = scheduler_for(lora_paths=tuple(f"{n}={p}" for n, p in raw.items()),
                         max_loras_per_batch=2, max_lora_rank=4, schedule_policy="fcfs")
    assert runs_a_new_adapter_behind_cache_hits(fcfs)


def test_a_new_adapter_is_not_starved_by_cache_hits_under_lpm(scheduler):
    assert runs_a_new_adapter_behind_cache_hits(scheduler)
