"""The SamplingBatch's invariants: one row per request in order, a setting's columns present
exactly while some row uses it, and token state kept incrementally equal to what a batch built
from scratch over the same requests holds; and, through the in-process scheduler, the
batch's rows are the running requests across admission, retraction, abort and finish."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from runtime_checks import scheduler_req

from radixlm.runtime.sampling.sampler import Sampler
from radixlm.runtime.sampling.sampling_batch import FEATURES, SamplingBatch, features_of
from radixlm.runtime.sampling.sampling_params import SamplingParams

VOCAB = 12
EOS = 11


@dataclass(eq=False)
class FakeReq:
    """What the batch reads of a request."""

    sampling: SamplingParams
    input_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    output_ids: list[int] = field(default_factory=list)
    grammar: object = None


def fake(output_ids=(), input_ids=(1, 2, 3), **params) -> FakeReq:
    return FakeReq(SamplingParams.from_dict(params), list(input_ids), list(output_ids))


def new_batch() -> SamplingBatch:
    return SamplingBatch(VOCAB, [EOS], torch.device("cpu"))


def columns(batch: SamplingBatch) -> dict[str, torch.Tensor | None]:
    return {name: getattr(batch, name) for names in FEATURES.values() for name in names}


def row_sets(table: torch.Tensor | None) -> list[set[int]] | None:
    return None if table is None else [set(row) for row in table.tolist()]


def row_sums(ids: torch.Tensor | None, values: torch.Tensor | None) -> list[dict] | None:
    """Per row: each listed id's total (pads add 0)."""
    if ids is None:
        return None
    sums = []
    for row_ids, row_values in zip(ids.tolist(), values.tolist()):
        total: dict[int, float] = {}
        for token, value in zip(row_ids, row_values):
            total[token] = total.get(token, 0.0) + value
        sums.append({t: v for t, v in total.items() if v})
    return sums


def counts(batch: SamplingBatch) -> torch.Tensor | None:
    """(K, V) counts of each row's output tokens."""
    if batch.count_slots is None:
        return None
    return batch.count_table[batch.count_slots]


def summary(batch: SamplingBatch) -> dict:
    """What the batch means, whatever the padding and order of its token lists."""
    plain = {name: tensor for name, tensor in columns(batch).items() if tensor is not None
             and name not in ("output_ids", "count_slots", "seen_ids", "bias_ids",
                              "bias_values", "banned_ids")}
    return {
        "plain": {name: tensor.tolist() for name, tensor in plain.items()},
        "present": sorted(name for name, tensor in columns(batch).items() if tensor is not None),
        "seen": row_sets(batch.seen_ids),
        "output": None if batch.output_ids is None else [
            ids - {0} for ids in row_sets(batch.output_ids)],
        "counts": None if counts(batch) is None else counts(batch).tolist(),
        "bias": row_sums(batch.bias_ids, batch.bias_values),
        "banned": row_sets(batch.banned_ids),
    }


def assert_same_state(batch: SamplingBatch, reqs: list[FakeReq]) -> None:
    """``batch`` means what a batch built at once from ``reqs`` means, and changes logits as
    that batch does."""
    fresh = new_batch()
    fresh.add(reqs)
    assert batch.reqs == reqs and len(batch) == len(reqs)
    assert summary(batch) == summary(fresh)
    used = {f for r in reqs for f in features_of(r)}
    assert {f for f in FEATURES if batch.uses(f)} == used
    logits = torch.randn(len(reqs), VOCAB)
    sampler = Sampler(VOCAB, {EOS}, 0)
    assert torch.equal(sampler.process_logits(logits.clone(), batch),
                       sampler.process_logits(logits.clone(), fresh))


PARAMS = [
    {"temperature": 0.0},
    {"temperature": 0.7, "top_k": 3},
    {"temperature": 0.9, "top_p": 0.8, "min_p": 0.1, "sampling_seed": 5},
    {"temperature": 0.0, "frequency_penalty": 0.5, "presence_penalty": 0.25},
    {"temperature": 1.0, "repetition_penalty": 1.3},
    {"temperature": 0.0, "logit_bias": {"4": 2.0, "9": -1.0}},
    {"temperature": 0.5, "min_new_tokens": 3, "stop_token_ids": [6]},
    {"temperature": 0.0, "min_new_tokens": 2, "ignore_eos": True, "stop_token_ids": [5]},
]

operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.tuples(st.integers(0, len(PARAMS) - 1),
                                                     st.lists(st.integers(0, VOCAB - 1),
                                                              max_size=4)),
                                           min_size=1, max_size=3)),
        st.tuples(st.just("remove"), st.lists(st.integers(0, 20), max_size=3)),
        st.tuples(st.just("sample"), st.integers(0, 2**16)),
        st.tuples(st.just("jump"), st.integers(0, 20), st.lists(st.integers(0, VOCAB - 1),
                                                                 min_size=1, max_size=3)),
    ),
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(operations)
def test_incremental_updates_equal_a_batch_built_from_scratch(ops):
    batch, reqs = new_batch(), []
    for op in ops:
        if op[0] == "add":
            joining = [fake(outputs, **PARAMS[which]) for which, outputs in op[1]]
            batch.add(joining)
            reqs += joining
        elif op[0] == "remove" and reqs:
            leaving = [reqs[i % len(reqs)] for i in op[1]]
            batch.remove(leaving)
            reqs = [r for r in reqs if r not in leaving]
        elif op[0] == "sample" and reqs:
            tokens = torch.randint(VOCAB, (len(reqs),), generator=torch.Generator().manual_seed(
                op[1]))
            batch.record_sampled(tokens)
            for req, token in zip(reqs, tokens.tolist()):
                req.output_ids.append(token)
        elif op[0] == "jump" and reqs:
            req = reqs[op[1] % len(reqs)]
            batch.record_appended(req, op[2])
            req.output_ids += op[2]
        assert_same_state(batch, reqs)


def test_a_greedy_only_batch_holds_no_tensors():
    batch = new_batch()
    batch.add([fake(temperature=0.0) for _ in range(4)])
    assert all(t is None for t in columns(batch).values())
    assert batch.is_plain_greedy() and not batch.needs_penalties()
    batch.add([fake(temperature=0.0, logit_bias={"3": 1.0})])
    assert not batch.is_plain_greedy() and batch.needs_penalties()


def test_columns_are_dropped_when_their_last_user_leaves():
    plain, penalised = fake(temperature=0.0), fake(frequency_penalty=1.0, output_ids=[2, 2])
    batch = new_batch()
    batch.add([plain, penalised])
    assert counts(batch)[1, 2] == 2
    batch.remove([penalised])
    assert batch.output_ids is None and batch.frequency_penalties is None
    assert batch.count_table is None
    assert batch.temperatures is None  # the penalised row sampled; the greedy one is left


def test_add_skips_requests_that_already_have_a_row():
    a, b = fake(), fake()
    batch = new_batch()
    batch.add([a])
    batch.add([a, b])
    assert batch.reqs == [a, b]


def test_a_view_shares_its_rows_with_the_batch():
    reqs = [fake(frequency_penalty=1.0, min_new_tokens=2) for _ in range(4)]
    batch = new_batch()
    batch.add(reqs)
    assert batch.select(reqs) is batch
    view = batch.select(reqs[1:3])
    assert view.reqs == reqs[1:3] and len(view) == 2
    view.record_sampled(torch.tensor([5, 7]))
    assert counts(batch)[:, 5].tolist() == [0, 1, 0, 0]
    assert counts(batch)[:, 7].tolist() == [0, 0, 1, 0]
    assert batch.output_lens[:, 0].tolist() == [0, 1, 1, 0]
    assert row_sets(batch.output_ids) == [{0}, {5}, {7}, {0}]  # 0: padding
    with pytest.raises(RuntimeError, match="not on a view"):
        view.add([fake()])


def test_select_refuses_requests_that_are_not_consecutive_rows():
    reqs = [fake() for _ in range(3)]
    batch = new_batch()
    batch.add(reqs)
    with pytest.raises(ValueError, match="consecutive rows"):
        batch.select([reqs[0], reqs[2]])
    with pytest.raises(ValueError, match="consecutive rows"):
        batch.select([reqs[1], reqs[0]])
    with pytest.raises(ValueError, match="consecutive rows"):
        batch.select([fake()])


def test_banning_rows_and_seed_positions_follow_the_recorded_output():
    """Positions count the tokens recorded, not the request's output list: a sampler that
    runs ahead of the host appending its tokens sees the same positions."""
    short, done = fake(min_new_tokens=3, output_ids=[1]), fake(min_new_tokens=1, output_ids=[1])
    seeded = fake(temperature=0.5, sampling_seed=7, output_ids=[1, 2])
    batch = new_batch()
    batch.add([short, done, seeded])
    assert batch.banning_rows() == [0]
    assert batch.seeded_rows() == [(2, 7, 2)]
    batch.record_sampled(torch.tensor([4, 4, 4]))
    assert batch.banning_rows() == [0] and batch.seeded_rows() == [(2, 7, 3)]
    batch.record_appended(short, [5])  # the host has appended none of these yet
    assert batch.banning_rows() == [] and not batch.needs_penalties()
    assert short.output_ids == [1]


# Through the scheduler -----------------------------------------------------------------------

MIXED = [
    {"max_new_tokens": 12, "temperature": 0.0},
    {"max_new_tokens": 9, "temperature": 0.8, "top_k": 5, "sampling_seed": 3},
    {"max_new_tokens": 14, "temperature": 0.0, "frequency_penalty": 0.7,
     "repetition_penalty": 1.2},
    {"max_new_tokens": 6, "temperature": 0.7, "min_new_tokens": 4, "logit_bias": {"7": 1.0}},
    {"max_new_tokens": 0},  # ends before sampling: never gets a row
]


def step_and_check(scheduler) -> None:
    """One scheduler step; then (once a decode step in flight is processed) the batch's rows
    are the running requests, in order, and its state equals a batch built from scratch for
    them."""
    scheduler.step()
    scheduler.drain()
    batch = scheduler.state.sampling_batch
    assert batch.reqs == scheduler.state.running
    fresh = SamplingBatch(batch.vocab_size, batch.eos_token_ids, batch.device)
    fresh.add(scheduler.state.running)
    assert summary(batch) == summary(fresh)


def test_the_scheduler_keeps_one_row_per_running_request(scheduler_for):
    """Admission in several extend steps, retraction on a small pool, an abort and finishes:
    after every step the batch's rows are the running requests, and its token state that of
    a batch built afresh from them."""
    scheduler = scheduler_for(max_total_tokens=320, max_running_requests=6,
                              chunked_prefill_size=64, init_new_token_ratio=0.01,
                              min_new_token_ratio=0.01)
    prompts = [[3 + (7 * i + j) % 200 for j in range(20 + 9 * i)] for i in range(15)]
    reqs = [scheduler_req(scheduler, p, MIXED[i % len(MIXED)]) for i, p in enumerate(prompts)]
    for req in reqs:
        scheduler.add_request(req)
    batch = scheduler.state.sampling_batch
    aborted = False
    for _ in range(2000):
        if all(r.finished for r in reqs):
            break
        step_and_check(scheduler)
        if not aborted and len(scheduler.state.running) > 2:
            scheduler.abort(scheduler.state.running[1])
            aborted = True
            assert batch.reqs == scheduler.state.running
    assert all(r.finished for r in reqs)
    assert scheduler.state.stats.retractions > 0, "the pool should have forced retractions"
    assert len(batch) == 0 and all(t is None for t in columns(batch).values())


JSON_SCHEMA = ('{"type": "object", "properties": {"name": {"type": "string", "pattern": '
               '"^[a-z]{1,6}$"}, "age": {"type": "integer"}}, "required": ["name", "age"]}')


def test_jump_forward_tokens_reach_the_batch(scheduler_for):
    """Constrained requests with penalties: jump-forward appends tokens without a draw, and
    the batch counts them as it counts sampled ones."""
    scheduler = scheduler_for()
    params = [{"max_new_tokens": 40, "json_schema": JSON_SCHEMA, "temperature": 0.8,
               "frequency_penalty": 0.5, "repetition_penalty": 1.2, "min_new_tokens": 3},
              {"max_new_tokens": 40, "json_schema": JSON_SCHEMA, "temperature": 0.0,
               "presence_penalty": 0.3}]
    reqs = [scheduler_req(scheduler, [3 + (5 * i + j) % 200 for j in range(12)], params[i % 2])
            for i in range(6)]
    for req in reqs:
        scheduler.add_request(req)
    for _ in range(500):
        if all(r.finished for r in reqs):
            break
        step_and_check(scheduler)
    assert all(r.finished for r in reqs)
    assert sum(r.jump_forward_tokens for r in reqs) > 0
