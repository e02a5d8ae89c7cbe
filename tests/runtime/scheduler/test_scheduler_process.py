"""The scheduler process's reports: one message per step, in columns, that the Detokenizer
completes with text and the RequestTracker turns into each request's delta."""

from __future__ import annotations

from tiny_models import tiny_tokenizer

from radixlm.runtime import messages as wire
from radixlm.runtime.engine.request_state import ReqState
from radixlm.runtime.request import finish_length
from radixlm.runtime.sampling.sampling_params import SamplingParams
from radixlm.runtime.scheduler.scheduler_process import (
    UNSTREAMED_REPORT_TOKENS,
    make_req,
    report_message,
)


def _req(rid: str, prompt: list[int], **message) -> object:
    sampling = SamplingParams.from_dict({"max_new_tokens": 8})
    return make_req(wire.GenerateReq(rid, prompt, sampling, **message), tiny_tokenizer(), {})


def _over_the_wire(message):
    return None if message is None else wire.decode(wire.encode(message))


def test_a_step_is_one_message_with_sparse_extras():
    plain, ended, prompt_only = _req("a", [5, 6]), _req("b", [7]), _req(
        "c", [8, 9, 10], return_logprob=True, logprob_start=0)
    plain.cached_tokens = 1
    plain.output_ids += [11]
    ended.output_ids += [12, 13]
    ended.finish_reason = finish_length(2)
    prompt_only.input_token_logprobs += [[None, 8, None], [-1.5, 9, None]]

    batch = _over_the_wire(report_message([plain, ended, prompt_only]))

    assert batch.rids == ["a", "b", "c"]
    assert list(wire.rows(batch.rids, batch.ends, batch.new_ids)) == [
        ("a", [11]), ("b", [12, 13]), ("c", [])]
    assert batch.states[0].cached_tokens == 1  # a first report carries the counters
    assert batch.states[1].finish_reason == finish_length(2)
    assert batch.states[2].input_token_logprobs == [[None, 8, None], [-1.5, 9, None]]
    # The Detokenizer's spec comes with a request's first row that makes text.
    assert sorted(batch.specs) == [0, 1]
    assert batch.texts == {}  # no stop strings: the Scheduler decoded nothing

    plain.output_ids += [14]
    batch = _over_the_wire(report_message([plain, prompt_only]))
    assert batch.rids == ["a"] and batch.new_ids == [14]
    assert batch.states == {} and batch.specs == {}  # nothing but a token changed

    plain.retractions += 1
    plain.output_ids += [15]
    assert report_message([plain]).states[0].retractions == 1
    assert report_message([plain, prompt_only]) is None


def test_a_request_with_stop_strings_sends_the_text_its_stop_check_decoded():
    """The Scheduler decodes a request with stop strings to match them; that text goes to
    the Detokenizer with the tokens, so it is decoded once."""
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode("The quick brown fox")
    sampling = SamplingParams.from_dict({"max_new_tokens": 8, "stop": ["zzz"]})
    req = make_req(wire.GenerateReq("s", [5, 6], sampling), tokenizer, {})
    sent = ""
    for token in ids:
        req.output_ids.append(token)
        req.detokenizer.feed([token])  # as SamplingStep does, token by token
        sent += _over_the_wire(report_message([req])).texts[0].text
    req.finish_reason = finish_length(len(ids))
    last = _over_the_wire(report_message([req])).texts[0]
    assert sent + last.text == tokenizer.decode([5, 6] + ids)[len(tokenizer.decode([5, 6])):]
    assert last.before_last == len(tokenizer.decode(ids[:-1]))


def test_the_request_tracker_keeps_counters_between_the_rows_that_send_them():
    state = ReqState("a", prompt_tokens=2)
    state.add([11], "x", 0, wire.OutputState(cached_tokens=1, retractions=0, jump_forward_tokens=0))
    state.add([12, 13], "yz", 0, None)
    state.add([], "", 0, wire.OutputState(1, 0, 1, finish_reason=finish_length(3)))

    delta = state.take_deltas()
    assert delta.new_ids == [11, 12, 13] and delta.text == "xyz"
    assert (delta.prompt_tokens, delta.cached_tokens, delta.jump_forward_tokens) == (2, 1, 1)
    assert state.finish_reason == finish_length(3)


def test_a_row_of_prompt_logprobs_only_goes_out_with_the_next_row():
    state = ReqState("a", prompt_tokens=3)
    state.add([], "", 0, wire.OutputState(0, 0, 0, input_token_logprobs=[[None, 8, None]]))
    assert state.take_deltas() is None and not state.changed.is_set()
    state.add([11], "x", 0, None)
    delta = state.take_deltas()
    assert delta.new_ids == [11] and delta.input_token_logprobs == [[None, 8, None]]


def test_a_request_that_is_not_streamed_reports_its_first_token_its_50th_and_its_end():
    """Nobody reads a request that is not streamed before its end: after its first token
    (the time to first token) it is reported once it has UNSTREAMED_REPORT_TOKENS new
    tokens, and at its end with every token not yet sent; a streamed one, every step."""
    whole, streamed = _req("w", [5, 6], streamed=False), _req("s", [7])
    assert (whole.streamed, streamed.streamed) == (False, True)
    sent: dict[str, list[int]] = {"w": [], "s": []}
    for step in range(1, UNSTREAMED_REPORT_TOKENS + 4):
        whole.output_ids.append(step)
        streamed.output_ids.append(step)
        if step == UNSTREAMED_REPORT_TOKENS + 3:
            whole.finish_reason = finish_length(step)
        batch = _over_the_wire(report_message([whole, streamed]))
        for rid, ids in wire.rows(batch.rids, batch.ends, batch.new_ids):
            sent[rid].append(len(ids))
    assert sent["s"] == [1] * (UNSTREAMED_REPORT_TOKENS + 3)
    assert sent["w"] == [1, UNSTREAMED_REPORT_TOKENS, 2]
    assert whole.reported_ids == len(whole.output_ids)
