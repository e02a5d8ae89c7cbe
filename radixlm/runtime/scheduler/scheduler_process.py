"""The Scheduler's process: builds the model and its memory, then loops: take requests from
the RequestTracker, run one scheduler step, send its outputs to the Detokenizer (which
adds their text and forwards them to the RequestTracker)."""

from __future__ import annotations

import gc
import logging
import os
import time
import traceback
from typing import Any

import msgspec
import zmq
from transformers import AutoTokenizer

from radixlm.models.model_config import ModelConfig
from radixlm.runtime import messages as wire
from radixlm.runtime.detokenizer.incremental_detokenizer import (
    CONTEXT_TOKENS,
    IncrementalDetokenizer,
)
from radixlm.runtime.disaggregation.handoffs import build_handoffs
from radixlm.runtime.disaggregation.transfer_backend import FAKE_BOOTSTRAP_HOST
from radixlm.runtime.free_memory import IdleTrim, return_free_memory
from radixlm.runtime.grammar.factory import make_grammar_backend
from radixlm.runtime.grammar.jump_forward import JumpForward
from radixlm.runtime.model_executor.model_runner import ModelRunner
from radixlm.runtime.request import LogprobRequest, Req, finish_abort
from radixlm.runtime.sampling.sampler import Sampler
from radixlm.runtime.scheduler.hierarchical_memory import build_hierarchical_cache
from radixlm.runtime.scheduler.sampling_step import SamplingStep
from radixlm.runtime.scheduler.scheduler import Scheduler
from radixlm.runtime.scheduler.windowed_memory import build_request_memory
from radixlm.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500
"""How long an idle scheduler waits for a request before checking that its parent lives."""
HANDOFF_POLL_MS = 2
"""How long a scheduler with nothing to run but KV to await from (or for) a peer server
waits for a request before it looks at the peers' messages again."""
HEARTBEAT_S = 1.0
"""Most time between two ``Heartbeat`` messages while the loop turns."""
UNSTREAMED_REPORT_TOKENS = 50
"""A request whose caller waits for the whole output (not streamed) is reported at its first
token (the time to first token), then once it has this many unreported tokens (SGLang's
interval for such requests) and at its end, not every step: each report costs the scheduler
its message and the other two processes their turn on cores the forward pass runs on. The
default model's batches of 16 requests of 32 tokens on 2 cores: the engine's and the
Detokenizer's processes took 1% of a core instead of 5%; throughput, 5 of 7 runs side by
side faster (mean 779 against 741 tok/s), within the host's noise."""


def build_scheduler(args: ServerArgs, model_path: str) -> Scheduler:
    """The model runner, KV memory, prefix cache and scheduler, in this process."""
    model_config = ModelConfig.from_path(model_path, args.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or model_path)
    runner = ModelRunner(args, model_config)
    layout = runner.window_layout
    memory = build_request_memory(runner.req_to_token_pool, runner.allocator,
                                  None if layout is None else layout.window,
                                  args.disable_radix_cache)
    if args.enable_hierarchical_cache:
        memory.tree_cache = build_hierarchical_cache(args, runner, memory.tree_cache,
                                                     model_path, tokenizer)
    grammar_backend = make_grammar_backend(
        args.grammar_backend, tokenizer, model_config.vocab_size, model_config.eos_token_ids
    )
    sampler = Sampler(model_config.vocab_size, model_config.eos_token_ids, args.random_seed,
                      grammar_backend)
    sampling_step = SamplingStep(
        tokenizer, runner.compute_logits, model_config.eos_token_ids, runner.context_length,
        jump_forward=None if args.disable_jump_forward else JumpForward(tokenizer),
    )
    prefill_handoff, decode_handoff = build_handoffs(args, memory,
                                                     runner.kv_pool.layer_buffers())
    scheduler = Scheduler(runner, memory, sampling_step, sampler, args, prefill_handoff,
                          decode_handoff)
    if args.enable_hierarchical_cache and not args.disable_adaptive_timing:
        pace = scheduler.prefill_pace  # a load is weighed against the measured prefill
        memory.tree_cache.recompute_seconds_per_token = lambda: pace.seconds_per_token
    return scheduler


def freeze_startup_objects() -> None:
    """Takes what the process made while starting (the model, the tokenizer, the pools:
    hundreds of thousands of long-lived objects) out of the garbage collector's view.

    A full collection otherwise walks all of them, and serving triggers one every few
    thousand allocations: at 256 running requests that made building a step's messages
    about ten times slower. Only objects made while serving are scanned after this.
    """
    gc.collect()
    gc.freeze()


def make_req(msg: wire.GenerateReq, tokenizer, leaders: dict[str, Req],
             disaggregation_mode: str = "null", transfer_backend: str = "tcp") -> Req:
    params = msg.sampling  # validated where the request entered
    handoff = None
    if msg.bootstrap_room is not None and disaggregation_mode != "null":
        handoff = {"prefill": "send", "decode": "receive"}[disaggregation_mode]
        if transfer_backend == "fake" or msg.bootstrap_host == FAKE_BOOTSTRAP_HOST:
            handoff = "fake" if handoff == "send" else None  # the pair moves no KV
    detokenizer = None
    if params.stop or params.stop_regex:  # stop strings are matched on text
        detokenizer = IncrementalDetokenizer(
            tokenizer, msg.input_ids, params.skip_special_tokens,
            params.spaces_between_special_tokens,
        )
    if msg.prefill_leader and params.use_beam_search:
        leader = leaders.get(msg.prefill_leader)
        if leader is None or leader.sampling.n != params.n or not (
                leader.sampling.use_beam_search):
            raise ValueError(f"no beam search of width {params.n} named "
                             f"{msg.prefill_leader!r} is running")
    logprobs = None
    if msg.return_logprob:  # (a decode server's half computes no prompt logprobs)
        logprobs = LogprobRequest(None if handoff == "receive" else msg.logprob_start,
                                  msg.top_logprobs_num, msg.return_text_in_logprobs)
    return Req(
        rid=msg.rid, input_ids=msg.input_ids, sampling=params, detokenizer=detokenizer,
        logprobs=logprobs, extra_key=msg.extra_key, lora_name=msg.lora_path,
        prefill_leader=leaders.get(msg.prefill_leader) if msg.prefill_leader else None,
        handoff=handoff, bootstrap_room=msg.bootstrap_room,
        bootstrap_address=(f"{msg.bootstrap_host}:{msg.bootstrap_port}"
                           if handoff == "receive" else None),
        streamed=msg.streamed,
    )


class SchedulerLoop:
    """Receives requests, steps the scheduler, reports the changes of its requests (those
    of a request that is not streamed, less often: ``UNSTREAMED_REPORT_TOKENS``)."""

    def __init__(self, scheduler: Scheduler, tokenizer, context: zmq.Context,
                 paths: wire.SocketPaths):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.inbox = context.socket(zmq.PULL)
        self.inbox.bind(paths.scheduler)
        self.to_detokenizer = context.socket(zmq.PUSH)
        self.to_detokenizer.connect(paths.detokenizer)
        self.to_request_tracker = context.socket(zmq.PUSH)
        self.to_request_tracker.connect(paths.request_tracker)
        self.by_rid: dict[str, Req] = {}
        self.parent = os.getppid()
        self.last_heartbeat = 0.0
        self.trim = IdleTrim()

    def run(self) -> None:
        while True:
            scheduler = self.scheduler
            wait_ms = 0 if scheduler.has_work_to_run() else (
                IDLE_POLL_MS if scheduler.is_idle() else HANDOFF_POLL_MS)
            if not self._receive(wait_ms):
                return
            self._heartbeat()
            self._check_ranks()
            if scheduler.is_idle():
                self.trim.idle()
                scheduler.runner.keep_ranks_alive()
                continue
            self.trim.busy()
            try:
                stepped = self.scheduler.step()
            except Exception as err:  # a failed step must not take the server down
                self._check_ranks()
                lost = self.scheduler.runner.lost_ranks(err)
                if lost is not None:  # ... unless the model's ranks are gone: it cannot serve
                    raise RuntimeError(lost) from err
                logger.exception("scheduler step failed")
                stepped = self.scheduler.requests()
                for req in stepped:  # (their KV may be half written: none is cached)
                    self.scheduler.abort(req, f"internal error: {err}", cache=False)
            self._report(stepped)

    def _check_ranks(self) -> None:
        """Raises when a tensor-parallel rank exited: the loop ends and the RequestTracker
        fails every pending request with the reason."""
        failure = self.scheduler.runner.rank_failure()
        if failure is not None:
            raise RuntimeError(failure)

    def _heartbeat(self) -> None:
        """Tells the RequestTracker the loop turns, at most every ``HEARTBEAT_S``."""
        now = time.monotonic()
        if now - self.last_heartbeat >= HEARTBEAT_S:
            self.last_heartbeat = now
            self.to_request_tracker.send(wire.encode(wire.Heartbeat()))

    def _receive(self, timeout: int) -> bool:
        """Handles every message that comes within ``timeout`` ms (and those right after
        it); False when told to shut down (or orphaned). A batch's requests come as the
        frames of one ZMQ message, so they are all added before the next step."""
        while self.inbox.poll(timeout):
            timeout = 0
            for frame in self.inbox.recv_multipart():
                msg = self._decode(frame)
                if isinstance(msg, wire.GenerateReq):
                    self._add(msg)
                elif isinstance(msg, wire.AbortReq):
                    self._abort(msg.rid)
                elif isinstance(msg, wire.ControlReq):
                    if msg.kind == "shutdown":
                        return False
                    self._control(msg)
        return os.getppid() == self.parent

    def _add(self, msg: wire.GenerateReq) -> None:
        try:
            args = self.scheduler.args
            req = make_req(msg, self.tokenizer, self.by_rid, args.disaggregation_mode,
                           args.disaggregation_transfer_backend)
            self.scheduler.check_adapter(req)
        except (ValueError, TypeError) as err:  # the Engine validates; this is a last guard
            self._refuse(msg.rid, f"invalid request: {err}")
            return
        self.by_rid[req.rid] = req
        self.scheduler.add_request(req)

    def _refuse(self, rid: str, message: str) -> None:
        """Ends a request that never ran, with ``message`` as its abort reason."""
        state = wire.OutputState(0, 0, 0, finish_reason=finish_abort(message))
        self.to_detokenizer.send(wire.encode(wire.TokenBatch([rid], [0], [], {0: state})))

    def _decode(self, data: bytes) -> wire.Message | None:
        """The message, or None for one that does not decode (a request among them is
        refused by its rid, so its caller does not wait forever)."""
        try:
            return wire.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as err:
            try:
                raw = msgspec.msgpack.decode(data)
            except msgspec.DecodeError:  # not msgpack at all (a stray local process)
                raw = None
            if isinstance(raw, dict) and raw.get("type") == "GenerateReq" and isinstance(
                    raw.get("rid"), str):
                self._refuse(raw["rid"], f"invalid request: {err}")
            else:
                logger.error("dropped a frame that is not a message: %s", err)
            return None

    def _abort(self, rid: str | None) -> None:
        victims = [r for r in self.scheduler.requests() if rid is None or r.rid == rid]
        for req in victims:
            self.scheduler.abort(req, "aborted by request")
        # A beam search ends whole: every member is reported.
        named = {id(r) for r in victims}
        victims += [m for r in list(victims) if r.beam is not None
                    for m in r.beam.members if id(m) not in named]
        self._report(victims)

    def _control(self, msg: wire.ControlReq) -> None:
        info: dict[str, Any] = {}
        ok = True
        if msg.kind == "flush_cache":
            ok = self.scheduler.flush_cache()
        elif msg.kind == "server_info":
            info = self.scheduler.server_info()
        elif msg.kind in ("load_lora_adapter", "unload_lora_adapter"):
            try:
                if msg.kind == "load_lora_adapter":
                    info = self.scheduler.load_lora_adapter(msg.args.get("lora_name"),
                                                            msg.args.get("lora_path"))
                else:
                    info = self.scheduler.unload_lora_adapter(msg.args.get("lora_name"))
            except ValueError as err:
                ok, info = False, {"error": str(err)}
        else:
            ok, info = False, {"error": f"unknown control request {msg.kind!r}"}
        self.to_request_tracker.send(wire.encode(wire.ControlReply(msg.request_id, ok, info)))

    def _report(self, reqs: list[Req]) -> None:
        """Sends what ``reqs`` produced (see ``report_message``) to the Detokenizer."""
        batch = report_message(reqs)
        for req in reqs:
            if req.finished:
                self.by_rid.pop(req.rid, None)
        if batch is not None:
            self.to_detokenizer.send(wire.encode(batch))


def report_message(reqs: list[Req]) -> wire.TokenBatch | None:
    """What ``reqs`` produced since they were last reported (and marks it reported): tokens,
    logprobs, states, and the text of requests whose stop strings the Scheduler matched on
    text it decoded (None when there is nothing to send). A request that is not streamed and
    has reported its first token waits until it ends or has ``UNSTREAMED_REPORT_TOKENS`` new
    tokens.

    A request that only gained tokens costs a few list appends; the rest (a finish,
    logprobs, changed counters, the Detokenizer's spec, decoded text) goes into the sparse
    maps.
    """
    rids: list[str] = []
    ends: list[int] = []
    new_ids: list[int] = []
    states: dict[int, wire.OutputState] = {}
    specs: dict[int, wire.DetokenizeSpec] = {}
    texts: dict[int, wire.DecodedText] = {}
    for req in reqs:
        output_ids = req.output_ids
        reported = req.reported_ids
        finish = req.finish_reason
        if finish is None and req.beam is not None:
            continue  # a beam's tokens change as the search goes: only its end is reported
        if (finish is None and not req.streamed and reported > 0
                and len(output_ids) - reported < UNSTREAMED_REPORT_TOKENS):
            continue  # nobody reads it before its end: see UNSTREAMED_REPORT_TOKENS
        if len(output_ids) == reported and finish is None and (
                len(req.input_token_logprobs) == req.reported_input_logprobs):
            continue
        row = len(rids)
        rids.append(req.rid)
        new_ids += output_ids[reported:]
        ends.append(len(new_ids))
        counters = (req.cached_tokens, req.retractions, req.jump_forward_tokens,
                    req.spec_verify_ct)
        if finish is not None or req.logprobs is not None or counters != req.reported_counters:
            states[row] = _output_state(req, counters)
        if len(output_ids) > reported or finish is not None:  # the rows that make text
            if not req.reported_text:
                specs[row] = _detokenize_spec(req)
            if req.detokenizer is not None:
                texts[row] = _decoded_text(req)
        req.reported_ids = len(output_ids)
    if not rids:
        return None
    return wire.TokenBatch(rids, ends, new_ids, states, specs, texts)


def _output_state(req: Req, counters: tuple[int, int, int, int]) -> wire.OutputState:
    """``req``'s counters, finish and unreported logprobs (marked reported)."""
    state = wire.OutputState(*counters, finish_reason=req.finish_reason)
    if req.beam_score is not None:
        state.beam = [req.cumulative_logprob, req.beam_score]
    req.reported_counters = counters
    if req.logprobs is not None:
        state.input_token_logprobs = req.input_token_logprobs[req.reported_input_logprobs:]
        state.input_top_logprobs = req.input_top_logprobs[req.reported_input_logprobs:]
        state.output_token_logprobs = req.output_token_logprobs[req.reported_ids:]
        state.output_top_logprobs = req.output_top_logprobs[req.reported_ids:]
        req.reported_input_logprobs = len(req.input_token_logprobs)
    return state


def _detokenize_spec(req: Req) -> wire.DetokenizeSpec:
    """How the Detokenizer turns ``req``'s tokens into text (sent once; marked sent)."""
    params = req.sampling
    req.reported_text = True
    return wire.DetokenizeSpec(
        prompt_tail=req.input_ids[-CONTEXT_TOKENS:],
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
        stop=params.stop or [],
        no_stop_trim=params.no_stop_trim,
    )


def _decoded_text(req: Req) -> wire.DecodedText:
    """The text ``req``'s detokenizer made since the last report (flushed at its end; marked
    reported)."""
    detokenizer = req.detokenizer
    if req.finished:
        detokenizer.finish()
    text = detokenizer.text
    decoded = wire.DecodedText(text[req.reported_chars:], detokenizer.before_last_feed)
    req.reported_chars = len(text)
    return decoded


def run_scheduler_process(args: ServerArgs, model_path: str, paths: wire.SocketPaths,
                          ready) -> None:
    """Process entry point. ``ready.send_bytes`` gets the scheduler's facts or an error."""
    context = zmq.Context()
    try:
        scheduler = build_scheduler(args, model_path)
        loop = SchedulerLoop(scheduler, scheduler.sampling_step.tokenizer, context, paths)
        freeze_startup_objects()
        return_free_memory()  # what loading the model and the tokenizer left in the heap
    except Exception as err:
        ready.send_bytes(wire.encode(wire.ProcessFailed("scheduler", _describe(err))))
        return
    ready.send_bytes(wire.encode(wire.ControlReply(0, True, scheduler.server_info())))
    try:
        loop.run()
    except Exception as err:
        logger.exception("the scheduler loop failed")
        loop.to_request_tracker.send(wire.encode(wire.ProcessFailed("scheduler", _describe(err))))
    finally:
        scheduler.shutdown()
        context.destroy(linger=100)


def _describe(err: BaseException) -> str:
    if isinstance(err, ValueError):
        return str(err)
    return "".join(traceback.format_exception_only(type(err), err)).strip()
