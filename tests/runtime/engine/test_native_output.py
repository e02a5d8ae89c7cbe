"""``engine/native_output.py``: cumulative and incremental native chunks from the same deltas.

The deltas are built by hand (a request of three steps, with logprobs and top logprobs), so
every chunk boundary is known; the end-to-end streams are in
``tests/runtime/server/test_stream_logprobs.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from radixlm.runtime import messages as wire
from radixlm.runtime.engine.native_output import OUTPUT_LISTS, native_chunks, native_results
from radixlm.runtime.engine.request_state import OutputDelta
from radixlm.runtime.sampling.sampling_params import SamplingParams

PROMPT = [7, 8, 9]


def request(rid: str = "r", **fields) -> wire.GenerateReq:
    fields = {"return_logprob": True, "top_logprobs_num": 2, **fields}
    return wire.GenerateReq(rid, PROMPT, SamplingParams(), **fields)


def step(ids: list[int], text: str, finish: dict | None = None, trim: int = 0,
         prompt_logprobs: bool = False) -> OutputDelta:
    """A delta bringing ``ids`` (each with a made-up logprob and two top entries)."""
    delta = OutputDelta("r", ids, text, finish, len(PROMPT), 0, 0, trim=trim)
    delta.output_token_logprobs = [[-0.5 * i, i, None] for i in ids]
    delta.output_top_logprobs = [[[-0.1, i, None], [-2.0, i + 1, None]] for i in ids]
    if prompt_logprobs:
        delta.input_token_logprobs = [[None, PROMPT[0], None]] + [
            [-1.0, i, None] for i in PROMPT[1:]]
        delta.input_top_logprobs = [None] + [[[-1.0, i, None]] for i in PROMPT[1:]]
    return delta


STEPS = [
    step([11], "Hello", prompt_logprobs=True),
    step([12, 13], " wor"),
    step([14], "ld!", {"type": "length", "length": 4}),
]


async def indexed(deltas: list[tuple[int, OutputDelta]]) -> AsyncIterator[tuple[int, OutputDelta]]:
    for item in deltas:
        yield item


def chunks_of(deltas: list[OutputDelta], incremental: bool) -> list[dict]:
    async def collect() -> list[dict]:
        stream = native_chunks(indexed([(0, d) for d in deltas]), [request()], False,
                               incremental)
        return [chunk async for chunk in stream]
    return asyncio.run(collect())


def whole_of(deltas: list[OutputDelta]) -> dict:
    return asyncio.run(native_results(indexed([(0, d) for d in deltas]), [request()]))[0]


def test_incremental_chunks_are_disjoint_segments_that_concatenate_to_the_whole():
    whole = whole_of(STEPS)
    chunks = chunks_of(STEPS, incremental=True)
    assert [c["text"] for c in chunks] == ["Hello", " wor", "ld!"]
    assert [c["output_ids"] for c in chunks] == [[11], [12, 13], [14]]
    assert "".join(c["text"] for c in chunks) == whole["text"] == "Hello world!"
    for name in OUTPUT_LISTS:
        joined = [entry for c in chunks for entry in c["meta_info"][name]]
        assert joined == whole["meta_info"][name]
    for chunk in chunks:
        meta = chunk["meta_info"]
        assert len(meta["output_token_logprobs"]) == len(chunk["output_ids"])
        assert len(meta["output_top_logprobs"]) == len(chunk["output_ids"])


def test_cumulative_chunks_hold_everything_so_far_and_end_with_the_whole():
    whole = whole_of(STEPS)
    chunks = chunks_of(STEPS, incremental=False)
    assert [c["text"] for c in chunks] == ["Hello", "Hello wor", "Hello world!"]
    assert [c["output_ids"] for c in chunks] == [[11], [11, 12, 13], [11, 12, 13, 14]]
    final = chunks[-1]
    assert final["text"] == whole["text"] and final["output_ids"] == whole["output_ids"]
    for name in OUTPUT_LISTS:
        assert final["meta_info"][name] == whole["meta_info"][name]


@pytest.mark.parametrize("incremental", [False, True])
def test_every_chunk_counts_the_whole_output_and_keeps_prompt_logprobs_whole(incremental):
    whole = whole_of(STEPS)
    for chunk, completed in zip(chunks_of(STEPS, incremental), [1, 3, 4], strict=True):
        meta = chunk["meta_info"]
        assert meta["completion_tokens"] == completed
        assert meta["output_token_logprobs_length"] == completed
        assert meta["input_token_logprobs"] == whole["meta_info"]["input_token_logprobs"]
        assert meta["input_top_logprobs"] == whole["meta_info"]["input_top_logprobs"]
    assert whole["meta_info"]["output_token_logprobs_length"] == 4


def test_the_length_field_is_absent_without_logprobs():
    async def collect() -> list[dict]:
        stream = native_chunks(indexed([(0, d) for d in STEPS]),
                               [request(return_logprob=False, top_logprobs_num=0)], False,
                               True)
        return [chunk async for chunk in stream]
    for chunk in asyncio.run(collect()):
        assert "output_token_logprobs_length" not in chunk["meta_info"]
        assert "output_token_logprobs" not in chunk["meta_info"]


def test_incremental_segments_are_per_prompt_in_a_batched_stream():
    other = [step([21], "A"), step([22], "B", {"type": "length", "length": 2})]
    interleaved = [(0, STEPS[0]), (1, other[0]), (0, STEPS[1]), (1, other[1]), (0, STEPS[2])]

    async def collect() -> list[dict]:
        stream = native_chunks(indexed(interleaved), [request("a"), request("b")], True, True)
        return [chunk async for chunk in stream]
    chunks = asyncio.run(collect())
    by_index = {0: [], 1: []}
    for chunk in chunks:
        by_index[chunk["index"]].append(chunk)
    assert "".join(c["text"] for c in by_index[0]) == "Hello world!"
    assert "".join(c["text"] for c in by_index[1]) == "AB"
    assert [i for c in by_index[1] for i in c["output_ids"]] == [21, 22]
    assert [c["meta_info"]["output_token_logprobs_length"] for c in by_index[1]] == [1, 2]


def test_a_segment_never_repeats_text_an_earlier_one_sent_when_the_end_is_trimmed():
    # A stop regex matched "or" after it was sent: the last delta takes 2 characters back.
    trimmed = STEPS[:2] + [step([14], "", {"type": "stop", "matched": "or"}, trim=2)]
    whole = whole_of(trimmed)
    assert whole["text"] == "Hello w"
    chunks = chunks_of(trimmed, incremental=True)
    assert [c["text"] for c in chunks] == ["Hello", " wor", ""]
    assert [i for c in chunks for i in c["output_ids"]] == whole["output_ids"]
