"""The Engine's three processes: async use, failures of a child, shutdown, and the
Detokenizer's text rules."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import zmq
from tiny_models import tiny_tokenizer
from workloads import PROMPTS, greedy

import radixlm
from radixlm.runtime import messages as wire
from radixlm.runtime.detokenizer.detokenizer_process import Detokenizer
from radixlm.runtime.engine.errors import RuntimeUnavailable
from radixlm.runtime.engine.native_output import native_results


def test_async_generate_runs_inside_a_running_event_loop(engine_for):
    engine = engine_for()
    expected = engine.generate(PROMPTS[:3], greedy(8))

    async def main():
        together = await engine.async_generate(PROMPTS[:3], greedy(8))
        alone = await asyncio.gather(*(engine.async_generate(p, greedy(8)) for p in PROMPTS[:3]))
        chunks = [c async for c in await engine.async_generate(PROMPTS[0], greedy(8), stream=True)]
        # The blocking API works from inside a loop too: it never runs the caller's loop.
        blocking = engine.generate(PROMPTS[0], greedy(8))
        return together, alone, chunks, blocking

    together, alone, chunks, blocking = asyncio.run(main())
    ids = [o["output_ids"] for o in expected]
    assert [o["output_ids"] for o in together] == ids
    assert [o["output_ids"] for o in alone] == ids
    assert chunks[-1]["output_ids"] == ids[0] and blocking["output_ids"] == ids[0]


def test_generate_calls_from_several_threads_batch_together(engine_for):
    engine = engine_for()
    expected = [engine.generate(p, greedy(12))["output_ids"] for p in PROMPTS]
    results: dict[int, list[int]] = {}

    def worker(i: int) -> None:
        results[i] = engine.generate(PROMPTS[i], greedy(12))["output_ids"]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [results[i] for i in range(len(PROMPTS))] == expected


def test_a_batch_arrives_whole_and_is_prefilled_in_one_pass(engine_for):
    """A list of prompts reaches the scheduler as one message: it admits them together, one
    prefill pass for the batch. (Sent one by one, the first of 40 requests were prefilled
    in a pass of their own in every one of four runs of this test.)"""
    engine = engine_for()
    for round_ in range(5):
        prompts = [f"{round_}: {p}" for p in PROMPTS * 8]  # new to the cache each round
        before = engine.get_server_info()["stats"]["extend_steps"]
        outputs = engine.generate(prompts, greedy(2))
        assert len(outputs) == len(prompts)
        assert engine.get_server_info()["stats"]["extend_steps"] - before == 1


def test_killing_the_scheduler_fails_pending_calls_within_seconds(tiny_model_dir):
    """Four requests of 4000 tokens each, which cannot end before the kill lands (see the
    Detokenizer's test below)."""
    model = tiny_model_dir(max_position_embeddings=4096)
    engine = radixlm.Engine(str(model), dtype="float32", max_total_tokens=4 * 4096)
    try:
        stream = engine.generate([PROMPTS[0]] * 4, greedy(4000, ignore_eos=True), stream=True)
        next(stream)  # the requests are running
        engine._runtime.processes["scheduler"].kill()
        killed = time.monotonic()
        with pytest.raises(RuntimeUnavailable, match="scheduler"):
            for _ in stream:
                pass
        assert time.monotonic() - killed < 5
        assert not engine.is_healthy()
        with pytest.raises(RuntimeUnavailable):
            engine.generate(PROMPTS[0], greedy(2))
    finally:
        engine.shutdown()
    assert all(p.poll() is not None for p in engine._runtime.processes.values())


def test_shutdown_leaves_no_child_process(tiny_model_dir):
    engine = radixlm.Engine(str(tiny_model_dir()), dtype="float32", max_total_tokens=1024)
    processes = list(engine._runtime.processes.values())
    assert all(p.poll() is None for p in processes)
    assert engine.generate(PROMPTS[0], greedy(4))["meta_info"]["completion_tokens"] == 4
    started = time.monotonic()
    engine.shutdown()
    assert time.monotonic() - started < 5
    assert all(p.poll() is not None for p in processes)
    with pytest.raises(RuntimeUnavailable):
        engine.generate(PROMPTS[0], greedy(2))


def test_a_model_that_fails_to_load_raises_naming_the_file(tmp_path, tiny_model_dir):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir(), broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="model.safetensors"):
        radixlm.Engine(str(broken), dtype="float32", max_total_tokens=1024)


def _detokenize_out(rid, new_ids, finish=None, stop=(), no_stop_trim=False, first=False):
    """A one-row ``TokenBatch``."""
    spec = wire.DetokenizeSpec([], True, True, list(stop), no_stop_trim) if first else None
    states = {} if finish is None else {0: wire.OutputState(0, 0, 0, finish_reason=finish)}
    return wire.TokenBatch([rid], [len(new_ids)], list(new_ids), states,
                         {} if spec is None else {0: spec})


def _shown_text(detokenizer: Detokenizer, out: wire.TokenBatch, before: str) -> str:
    """The text a client shows after ``out``: ``before``, cut by the row's trim, plus its
    text; the row's tokens and state are forwarded as they came."""
    batch = detokenizer.handle(out)
    assert (batch.rids, batch.new_ids, batch.states) == (out.rids, out.new_ids, out.states)
    return before[: len(before) - batch.trims.get(0, 0)] + batch.texts[0]


def test_detokenizer_finds_a_stop_string_split_across_chunks_and_holds_it_back():
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode("The quick brown fox")
    text = tokenizer.decode(ids)
    stop = "n fo"  # spans the tokens of "brown" and " fox"
    detokenizer = Detokenizer(tokenizer)
    shown = []
    for i, token in enumerate(ids):
        # As the Scheduler does: the request ends with the token that completes the stop.
        done = stop in tokenizer.decode(ids[: i + 1])
        out = _detokenize_out("r", [token], {"type": "stop", "matched": stop} if done else None,
                              stop=[stop], first=i == 0)
        shown.append(_shown_text(detokenizer, out, shown[-1] if shown else ""))
        if done:
            break
    kept = text[: text.index(stop)]
    for partial in shown:
        assert kept.startswith(partial)  # never the start of the stop string
    assert shown[-1] == kept
    assert "r" not in detokenizer.states


def test_detokenizer_never_shows_a_broken_character():
    tokenizer = tiny_tokenizer()
    text = "Héllo wörld 😀 ünïcödé"
    ids = tokenizer.encode(text)
    detokenizer = Detokenizer(tokenizer)
    shown = []
    for i, token in enumerate(ids):
        finish = {"type": "length", "length": len(ids)} if i == len(ids) - 1 else None
        out = _detokenize_out("u", [token], finish, first=i == 0)
        shown.append(_shown_text(detokenizer, out, shown[-1] if shown else ""))
    assert all("\ufffd" not in piece for piece in shown)
    assert shown[-1] == text
    assert all(text.startswith(piece) for piece in shown)


def test_the_scheduler_survives_an_invalid_message(engine_for):
    """Requests are validated where they enter; one that reaches the scheduler with a value
    of the wrong type is refused by its rid, and the scheduler keeps serving."""
    engine = engine_for()
    bad = wire.GenerateReq("bad-request", [5, 6, 7], {"temperature": "hot"})
    [out] = engine._call(native_results(engine._tracker.stream([bad], streamed=False), [bad]))
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert "temperature" in out["meta_info"]["finish_reason"]["message"]
    assert engine.generate(PROMPTS[0], greedy(3))["meta_info"]["completion_tokens"] == 3


@pytest.mark.parametrize("frame", [b"\xff\x00garbage", b"\x81\xa4type\xa9GenerateR", b"",
                                   b"\x81\xa4type\xa7AbortReq"])
def test_a_malformed_frame_on_any_socket_is_dropped_and_the_engine_keeps_serving(
        engine_for, frame):
    """Any local process can connect to the runtime's sockets: a frame that is not a message
    (not msgpack, truncated, or of the wrong shape) is logged and dropped by each receiver;
    it used to end the scheduler, the detokenizer or the request tracker's receive loop."""
    engine = engine_for()
    expected = engine.generate(PROMPTS[0], greedy(4))["output_ids"]
    context = zmq.Context()
    try:
        for path in (engine._runtime.paths.scheduler, engine._runtime.paths.detokenizer,
                     engine._runtime.paths.request_tracker):
            sender = context.socket(zmq.PUSH)
            sender.connect(path)
            sender.send(frame)
            sender.close(linger=2000)
    finally:
        context.term()
    time.sleep(0.5)
    assert engine.is_healthy()
    assert engine.generate(PROMPTS[0], greedy(4))["output_ids"] == expected


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_when_the_detokenizer_dies_the_scheduler_stops_decoding_for_nobody(tiny_model_dir):
    """Sixteen requests of 4000 tokens each: they cannot all be decoded, and their outputs
    taken, before the kill lands (16 x 480 tokens of the tiny model took 0.7-1.0 s, and once,
    on a busy CI machine, finished before the watchdog saw the Detokenizer gone)."""
    model = tiny_model_dir(max_position_embeddings=4096)
    engine = radixlm.Engine(str(model), dtype="float32", max_total_tokens=16 * 4096)
    try:
        stream = engine.generate([PROMPTS[0]] * 16, greedy(4000, ignore_eos=True), stream=True)
        next(stream)  # the requests are running
        engine._runtime.processes["detokenizer"].kill()
        with pytest.raises(RuntimeUnavailable, match="detokenizer"):
            for _ in stream:
                pass
        scheduler = engine._runtime.processes["scheduler"].pid
        time.sleep(0.3)  # the abort lands
        before = _cpu_seconds(scheduler)
        time.sleep(1.0)
        assert _cpu_seconds(scheduler) - before < 0.2  # idle, not decoding 16 requests
    finally:
        engine.shutdown()


class _NoDecoding:
    """A tokenizer the Detokenizer must not use."""

    def decode(self, *args, **kwargs):
        raise AssertionError("decoded twice: the Scheduler's text came with the tokens")


def test_the_detokenizer_takes_the_schedulers_text_for_a_request_with_stop_strings():
    """A request with stop strings is decoded once, by the Scheduler (its stop check): the
    Detokenizer holds back a possible stop start and cuts at the stop on that text."""
    detokenizer = Detokenizer(_NoDecoding())
    spec = wire.DetokenizeSpec([], True, True, ["STOP"], False)
    shown = ""
    steps = [("Hello ST", None), ("OP and more", {"type": "stop", "matched": "STOP"})]
    for i, (text, finish) in enumerate(steps):
        states = {} if finish is None else {0: wire.OutputState(0, 0, 0, finish_reason=finish)}
        batch = detokenizer.handle(wire.TokenBatch(
            ["r"], [1], [7 + i], states, {0: spec} if i == 0 else {},
            {0: wire.DecodedText(text, before_last=0)}))
        shown = shown[: len(shown) - batch.trims.get(0, 0)] + batch.texts[0]
        if finish is None:
            assert shown == "Hello "  # "ST" could start the stop: held back
    assert shown == "Hello "
    assert "r" not in detokenizer.states
