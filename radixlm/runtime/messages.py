"""Messages between the TokenizerManager, the Scheduler and the Detokenizer processes.

Typed msgspec structs, serialized as msgpack: a peer can only ever send data, never code
(nothing crossing a socket is unpickled). Each struct is tagged with its class name, so a
socket carrying several kinds decodes into the right one.

    TokenizerManager --GenerateReq/AbortReq/ControlReq--> Scheduler
    (a batch's GenerateReqs as the frames of one ZMQ message: they arrive together)
    Scheduler --DetokenizeBatch--> Detokenizer --TextBatch--> TokenizerManager
    Scheduler --TokenBatch/ControlReply--> TokenizerManager

Outputs travel as deltas, one message per step and receiver, in columns (request ids, their
new tokens end to end, and sparse maps for what few requests have: a finish, logprobs,
changed counters): each step the Scheduler sends every request's new tokens (with their
logprobs and the request's state) to the TokenizerManager, and the same new tokens (without
logprobs) to the Detokenizer, which sends back only the text they add. (A request that is not
streamed is sent at its first token, every 50 tokens and at its end.) So a stream of N
tokens moves O(N) bytes. The TokenizerManager pairs the two: a row that carries tokens or a
finish (a ``TokenOut``) has exactly one ``TextOut``, in the same order.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import msgspec

from radixlm.runtime.sampling.sampling_params import SamplingParams
from radixlm.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

LogprobEntry = list[Any]  # [logprob | None, token_id, text | None]


class GenerateReq(msgspec.Struct, tag=True):
    """A tokenized, validated request."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    logprob_start: int | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    extra_key: str | None = None
    prefill_leader: str | None = None
    """rid of the sample (of the same n > 1 request) whose cached prompt this one reuses."""
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    """Set for half of a disaggregated request (``runtime/disaggregation``)."""
    streamed: bool = True
    """Whether its caller takes the output step by step; if not, the Scheduler reports it
    less often (see ``scheduler_process.UNSTREAMED_REPORT_TOKENS``)."""


class AbortReq(msgspec.Struct, tag=True):
    rid: str | None = None
    """None: abort every unfinished request."""


class ControlReq(msgspec.Struct, tag=True):
    """``flush_cache``, ``server_info`` or ``shutdown``; answered by a ``ControlReply``."""

    kind: str
    request_id: int = 0


class ControlReply(msgspec.Struct, tag=True):
    request_id: int
    ok: bool
    info: dict[str, Any] = {}


class DetokenizeSpec(msgspec.Struct):
    """How to turn a request's tokens into text; sent with its first output only."""

    prompt_tail: list[int]
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    stop: list[str]
    no_stop_trim: bool


class OutputState(msgspec.Struct):
    """The parts of a request's output that most steps leave alone: its counters (sent on
    its first output and whenever they change), its finish and any logprobs."""

    cached_tokens: int
    retractions: int
    jump_forward_tokens: int
    """Output tokens so far appended by jump-forward decoding (a running total)."""
    finish_reason: dict[str, Any] | None = None
    input_token_logprobs: list[LogprobEntry] = []
    input_top_logprobs: list[Any] = []
    output_token_logprobs: list[LogprobEntry] = []
    output_top_logprobs: list[Any] = []
    beam: list[float] | None = None
    """A beam search's hypothesis: [cumulative logprob, length-normalised score]."""


class TokenBatch(msgspec.Struct, tag=True):
    """One step's outputs for the TokenizerManager, as columns (a step's message costs the
    Scheduler a few list appends per request, not an object): request ``rids[i]`` gained
    ``new_ids[ends[i - 1]:ends[i]]`` (from 0 for i = 0), and ``states[i]``, where present."""

    rids: list[str]
    ends: list[int]
    new_ids: list[int]
    states: dict[int, OutputState] = {}


class TokenOut(msgspec.Struct):
    """What one request produced since its last TokenOut (deltas), and its state: a row of
    a ``TokenBatch`` as the TokenizerManager sees it (with the counters it last received)."""

    rid: str
    new_ids: list[int]
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    cached_tokens: int
    retractions: int
    jump_forward_tokens: int = 0
    input_token_logprobs: list[LogprobEntry] = []
    input_top_logprobs: list[Any] = []
    output_token_logprobs: list[LogprobEntry] = []
    output_top_logprobs: list[Any] = []
    beam: list[float] | None = None
    """As ``OutputState.beam``, with a beam search's finish."""

    @property
    def has_text(self) -> bool:
        """True when the Detokenizer was sent this output too (and answers it with a
        ``TextOut``): it brings tokens or ends the request."""
        return bool(self.new_ids) or self.finish_reason is not None


class DetokenizeOut(msgspec.Struct):
    """A request's new tokens for the Detokenizer (a row of a ``DetokenizeBatch``)."""

    rid: str
    new_ids: list[int]
    finish_reason: dict[str, Any] | None
    spec: DetokenizeSpec | None = None
    """Sent with the request's first output only."""


class DetokenizeBatch(msgspec.Struct, tag=True):
    """One step's new tokens for the Detokenizer, as columns: request ``rids[i]`` gained
    ``new_ids[ends[i - 1]:ends[i]]``; ``finish_reasons[i]`` and ``specs[i]`` where present
    (the spec with a request's first output only)."""

    rids: list[str]
    ends: list[int]
    new_ids: list[int]
    finish_reasons: dict[int, dict[str, Any]] = {}
    specs: dict[int, DetokenizeSpec] = {}

    @classmethod
    def of(cls, outputs: list[DetokenizeOut]) -> DetokenizeBatch:
        batch = cls([], [], [])
        for i, out in enumerate(outputs):
            batch.rids.append(out.rid)
            batch.new_ids += out.new_ids
            batch.ends.append(len(batch.new_ids))
            if out.finish_reason is not None:
                batch.finish_reasons[i] = out.finish_reason
            if out.spec is not None:
                batch.specs[i] = out.spec
        return batch

    def outputs(self) -> Iterator[DetokenizeOut]:
        for i, (rid, new_ids) in enumerate(rows(self.rids, self.ends, self.new_ids)):
            yield DetokenizeOut(rid, new_ids, self.finish_reasons.get(i), self.specs.get(i))


class TextOut(msgspec.Struct):
    """The text one ``DetokenizeOut`` adds: safe to show (complete characters, no partial
    stop string). On the last one, the text so far is first cut by ``trim`` characters
    (text already shown past the stop the Scheduler matched, e.g. a stop regex), then
    ``text`` is appended."""

    rid: str
    text: str
    trim: int = 0


class TextBatch(msgspec.Struct, tag=True):
    """The Detokenizer's answer to a ``DetokenizeBatch``, as columns: ``texts[i]`` for
    ``rids[i]``, with ``trims[i]`` where it is not 0."""

    rids: list[str]
    texts: list[str]
    trims: dict[int, int] = {}

    @classmethod
    def of(cls, outputs: list[TextOut]) -> TextBatch:
        return cls([out.rid for out in outputs], [out.text for out in outputs],
                   {i: out.trim for i, out in enumerate(outputs) if out.trim})

    def outputs(self) -> Iterator[TextOut]:
        trims = self.trims
        for i, (rid, text) in enumerate(zip(self.rids, self.texts)):
            yield TextOut(rid, text, trims.get(i, 0))


def rows(rids: list[str], ends: list[int], new_ids: list[int]) -> Iterator[tuple[str, list[int]]]:
    """Each request's id and new tokens from a batch's columns."""
    start = 0
    for rid, end in zip(rids, ends):
        yield rid, new_ids[start:end]
        start = end


class SocketPaths(msgspec.Struct):
    """The ``ipc://`` endpoints of the three processes' input sockets."""

    scheduler: str
    detokenizer: str
    tokenizer_manager: str


class ChildConfig(msgspec.Struct):
    """What a child process is started with (msgpack on its stdin)."""

    server_args: ServerArgs
    model_path: str
    tokenizer_path: str
    paths: SocketPaths


class Heartbeat(msgspec.Struct, tag=True):
    """The Scheduler's sign of life, at most every ``HEARTBEAT_S`` while its loop turns
    (``/health`` fails when none comes for too long while requests wait)."""


class ProcessFailed(msgspec.Struct, tag=True):
    """A child process's last word before it exits on an error."""

    process: str
    message: str


Message = (
    GenerateReq | AbortReq | ControlReq | ControlReply | TokenBatch | DetokenizeBatch
    | TextBatch | Heartbeat | ProcessFailed
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)


def decode_or_drop(data: bytes, receiver: str) -> Message | None:
    """The message in ``data``, or None, logged, for a frame that is not one: any local
    process can connect to a socket, and a malformed frame must not take its receiver
    down."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        logger.error("the %s dropped a frame that is not a message: %s", receiver, err)
        return None
