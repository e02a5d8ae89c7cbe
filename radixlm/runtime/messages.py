"""Messages between the TokenizerManager, the Scheduler and the Detokenizer processes.

Typed msgspec structs, serialized as msgpack: a peer can only ever send data, never code
(nothing crossing a socket is unpickled). Each struct is tagged with its class name, so a
socket carrying several kinds decodes into the right one.

    TokenizerManager --GenerateReq/AbortReq/ControlReq--> Scheduler
    Scheduler --DetokenizeBatch--> Detokenizer --TextBatch--> TokenizerManager
    Scheduler --TokenBatch/ControlReply--> TokenizerManager

Outputs travel as deltas: each step the Scheduler sends every request's new tokens (with
their logprobs and the request's state) to the TokenizerManager, and the same new tokens
(without logprobs) to the Detokenizer, which sends back only the text they add. So a
stream of N tokens moves O(N) bytes. The TokenizerManager pairs the two: a ``TokenOut``
that carries tokens or a finish has exactly one ``TextOut``, in the same order.
"""

from __future__ import annotations

from typing import Any

import msgspec

from radixlm.runtime.sampling.sampling_params import SamplingParams
from radixlm.runtime.server_args import ServerArgs

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


class TokenOut(msgspec.Struct):
    """What one request produced since its last TokenOut (deltas), and its state."""

    rid: str
    new_ids: list[int]
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    cached_tokens: int
    retractions: int
    jump_forward_tokens: int = 0
    """Output tokens so far appended by jump-forward decoding (a running total)."""
    input_token_logprobs: list[LogprobEntry] = []
    input_top_logprobs: list[Any] = []
    output_token_logprobs: list[LogprobEntry] = []
    output_top_logprobs: list[Any] = []

    @property
    def has_text(self) -> bool:
        """True when the Detokenizer was sent this output too (and answers it with a
        ``TextOut``): it brings tokens or ends the request."""
        return bool(self.new_ids) or self.finish_reason is not None


class TokenBatch(msgspec.Struct, tag=True):
    outputs: list[TokenOut]


class DetokenizeOut(msgspec.Struct):
    """A request's new tokens for the Detokenizer (the ``has_text`` part of a TokenOut)."""

    rid: str
    new_ids: list[int]
    finish_reason: dict[str, Any] | None
    spec: DetokenizeSpec | None = None
    """Sent with the request's first output only."""


class DetokenizeBatch(msgspec.Struct, tag=True):
    outputs: list[DetokenizeOut]


class TextOut(msgspec.Struct):
    """The text one ``DetokenizeOut`` adds: safe to show (complete characters, no partial
    stop string). On the last one, the text so far is first cut by ``trim`` characters
    (text already shown past the stop the Scheduler matched, e.g. a stop regex), then
    ``text`` is appended."""

    rid: str
    text: str
    trim: int = 0


class TextBatch(msgspec.Struct, tag=True):
    outputs: list[TextOut]


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


class ProcessFailed(msgspec.Struct, tag=True):
    """A child process's last word before it exits on an error."""

    process: str
    message: str


Message = (
    GenerateReq | AbortReq | ControlReq | ControlReply | TokenBatch | DetokenizeBatch
    | TextBatch | ProcessFailed
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)
