"""Messages between the RequestTracker, the Scheduler and the Detokenizer processes.

Typed msgspec structs, serialized as msgpack: a peer can only ever send data, never code
(nothing crossing a socket is unpickled). Each struct is tagged with its class name, so a
socket carrying several kinds decodes into the right one.

    RequestTracker --GenerateReq/AbortReq/ControlReq--> Scheduler
    (a batch's GenerateReqs as the frames of one ZMQ message: they arrive together)
    Scheduler --TokenBatch--> Detokenizer --OutputBatch--> RequestTracker
    Scheduler --ControlReply/Heartbeat--> RequestTracker

Outputs run one way and travel as deltas, one message per step, in columns (request ids,
their new tokens end to end, and sparse maps for what few requests have: a finish,
logprobs, changed counters): the Scheduler sends each step's new tokens with their
logprobs and the requests' states to the Detokenizer, which adds the text they make and
forwards the rest as it came. (A request that is not streamed is sent at its first token,
every 50 tokens and at its end.) So a stream of N tokens moves O(N) bytes.
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
    lora_path: str | None = None
    """The LoRA adapter it runs with, by name (SGLang's field name); None: the base model."""


class AbortReq(msgspec.Struct, tag=True):
    rid: str | None = None
    """None: abort every unfinished request."""


class ControlReq(msgspec.Struct, tag=True):
    """``flush_cache``, ``server_info``, ``load_lora_adapter``, ``unload_lora_adapter`` or
    ``shutdown``; answered by a ``ControlReply``."""

    kind: str
    request_id: int = 0
    args: dict[str, str] = {}
    """Its arguments (``load_lora_adapter``: ``lora_name``, ``lora_path``)."""


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
    spec_verify_ct: int = 0
    """Speculative verify steps that checked a draft of the request (a running total)."""
    finish_reason: dict[str, Any] | None = None
    input_token_logprobs: list[LogprobEntry] = []
    input_top_logprobs: list[Any] = []
    output_token_logprobs: list[LogprobEntry] = []
    output_top_logprobs: list[Any] = []
    beam: list[float] | None = None
    """A beam search's hypothesis: [cumulative logprob, length-normalised score]."""


class DecodedText(msgspec.Struct):
    """Text the Scheduler decoded itself, to match a request's stop strings and regexes: the
    Detokenizer takes it as the request's text rather than decoding the same tokens again."""

    text: str
    """What the request's text gained since its last report (at its end, flushed whole)."""
    before_last: int = 0
    """The length of the whole text before the request's last token (read at its end, where a
    stop token's own text is cut)."""


class TokenBatch(msgspec.Struct, tag=True):
    """One step's outputs, Scheduler to Detokenizer, as columns (a step's message costs the
    Scheduler a few list appends per request, not an object): request ``rids[i]`` gained
    ``new_ids[ends[i - 1]:ends[i]]`` (from 0 for i = 0), and, where present, ``states[i]``
    (counters, finish, logprobs), ``specs[i]`` (with the first row that brings tokens or a
    finish) and ``texts[i]`` (for a request with stop strings or regexes)."""

    rids: list[str]
    ends: list[int]
    new_ids: list[int]
    states: dict[int, OutputState] = {}
    specs: dict[int, DetokenizeSpec] = {}
    texts: dict[int, DecodedText] = {}

    def finish_reason(self, row: int) -> dict[str, Any] | None:
        state = self.states.get(row)
        return None if state is None else state.finish_reason


class OutputBatch(msgspec.Struct, tag=True):
    """One step's outputs, Detokenizer to RequestTracker: a ``TokenBatch``'s columns as
    they came, and the text each row adds (``texts[i]``, safe to show: whole characters, no
    possible start of a stop string). On a request's last row, the text so far is first cut
    by ``trims[i]`` characters (where present: text already shown past the stop the
    Scheduler matched, e.g. a stop regex), then ``texts[i]`` is appended."""

    rids: list[str]
    ends: list[int]
    new_ids: list[int]
    states: dict[int, OutputState]
    texts: list[str]
    trims: dict[int, int] = {}


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
    request_tracker: str


class ChildConfig(msgspec.Struct):
    """What a child process is started with (msgpack on its stdin)."""

    server_args: ServerArgs
    model_path: str
    tokenizer_path: str
    paths: SocketPaths
    decoder_path: str | None = None
    """The Engine's tokenizer's Rust backend as JSON, where the Detokenizer decodes with it
    alone (``detokenizer/text_decoder.py``); None: it loads transformers' tokenizer."""


class Heartbeat(msgspec.Struct, tag=True):
    """The Scheduler's sign of life, at most every ``HEARTBEAT_S`` while its loop turns
    (``/health`` fails when none comes for too long while requests wait)."""


class ProcessFailed(msgspec.Struct, tag=True):
    """A child process's last word before it exits on an error."""

    process: str
    message: str


Message = (
    GenerateReq | AbortReq | ControlReq | ControlReply | TokenBatch | OutputBatch | Heartbeat
    | ProcessFailed
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
