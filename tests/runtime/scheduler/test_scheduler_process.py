"""The scheduler process's reports: one message per step and receiver, in columns, that the
TokenizerManager and the Detokenizer turn back into each request's delta."""

from __future__ import annotations

from tiny_models import tiny_tokenizer

from radixlm.runtime import messages as io
from radixlm.runtime.engine.request_state import ReqState
from radixlm.runtime.request import finish_length
from radixlm.runtime.sampling.sampling_params import SamplingParams
from radixlm.runtime.scheduler.scheduler_process import (
    UNSTREAMED_REPORT_TOKENS,
    make_req,
    report_messages,
)


def _req(rid: str, prompt: list[int], **message) -> object:
    sampling = SamplingParams.from_dict({"max_new_tokens": 8})
    return make_req(io.GenerateReq(rid, prompt, sampling, **message), tiny_tokenizer(), {})


def _over_the_wire(message):
    return None if message is None else io.decode(io.encode(message))


def test_a_step_is_one_message_per_receiver_with_sparse_extras():
    plain, ended, prompt_only = _req("a", [5, 6]), _req("b", [7]), _req(
        "c", [8, 9, 10], return_logprob=True, logprob_start=0)
    plain.cached_tokens = 1
    plain.output_ids += [11]
    ended.output_ids += [12, 13]
    ended.finish_reason = finish_length(2)
    prompt_only.input_token_logprobs += [[None, 8, None], [-1.5, 9, None]]

    tokens, texts = map(_over_the_wire, report_messages([plain, ended, prompt_only]))

    assert tokens.rids == ["a", "b", "c"]
    assert list(io.rows(tokens.rids, tokens.ends, tokens.new_ids)) == [
        ("a", [11]), ("b", [12, 13]), ("c", [])]
    assert tokens.states[0].cached_tokens == 1  # a first report carries the counters
    assert tokens.states[1].finish_reason == finish_length(2)
    assert tokens.states[2].input_token_logprobs == [[None, 8, None], [-1.5, 9, None]]
    # The Detokenizer gets the rows with tokens or a finish, its maps renumbered to them.
    outputs = list(texts.outputs())
    assert [(o.rid, o.new_ids, o.finish_reason) for o in outputs] == [
        ("a", [11], None), ("b", [12, 13], finish_length(2))]
    assert all(o.spec is not None for o in outputs)

    plain.output_ids += [14]
    tokens, texts = map(_over_the_wire, report_messages([plain, prompt_only]))
    assert tokens.rids == ["a"] and tokens.new_ids == [14]
    assert tokens.states == {} and texts.specs == {}  # nothing but a token changed

    plain.retractions += 1
    plain.output_ids += [15]
    tokens, _ = report_messages([plain])
    assert tokens.states[0].retractions == 1
    assert report_messages([plain, prompt_only]) == (None, None)


def test_the_tokenizer_manager_keeps_counters_between_the_rows_that_send_them():
    state = ReqState("a", prompt_tokens=2, return_logprob=False, top_logprobs=False,
                     streamed=True)
    state.add_tokens([11], io.OutputState(cached_tokens=1, retractions=0, jump_forward_tokens=0))
    state.add_text(io.TextOut("a", "x"))
    state.add_tokens([12, 13], None)
    state.add_text(io.TextOut("a", "yz"))
    state.add_tokens([], io.OutputState(1, 0, 1, finish_reason=finish_length(3)))
    state.add_text(io.TextOut("a", ""))

    delta = state.take_deltas()
    assert delta.tokens.new_ids == [11, 12, 13] and delta.text == "xyz"
    assert (delta.tokens.prompt_tokens, delta.tokens.cached_tokens,
            delta.tokens.jump_forward_tokens) == (2, 1, 1)
    assert state.finish_reason == finish_length(3)


def test_text_batches_keep_only_the_trims_that_are_not_zero():
    batch = io.TextBatch.of([io.TextOut("a", "x"), io.TextOut("b", "", trim=3)])
    assert batch.trims == {1: 3}
    assert list(_over_the_wire(batch).outputs()) == [io.TextOut("a", "x"),
                                                     io.TextOut("b", "", 3)]


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
        tokens, texts = map(_over_the_wire, report_messages([whole, streamed]))
        for rid, ids in io.rows(tokens.rids, tokens.ends, tokens.new_ids):
            sent[rid].append(len(ids))
        assert [o.rid for o in texts.outputs()] == tokens.rids
    assert sent["s"] == [1] * (UNSTREAMED_REPORT_TOKENS + 3)
    assert sent["w"] == [1, UNSTREAMED_REPORT_TOKENS, 2]
    assert whole.reported_ids == len(whole.output_ids)
