"""The Detokenizer's process: token ids in, text out, incrementally, per request.

A stream never shows a broken multi-byte character (held back until complete) nor the
start of a stop string (held back until it is known not to be one). When a request ends,
its text is trimmed at the stop the Scheduler matched: before a stop string (found anywhere
in the text, so also across chunk boundaries), or before a stop token's own text, unless
``no_stop_trim``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import zmq
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from radixlm.runtime import messages as io
from radixlm.runtime.detokenizer.incremental_detokenizer import (
    IncrementalDetokenizer,
    StopStringMatcher,
)

logger = logging.getLogger(__name__)


@dataclass
class DecodeState:
    """One request's text so far."""

    detokenizer: IncrementalDetokenizer
    spec: io.DetokenizeSpec
    matcher: StopStringMatcher | None

    def update(self, out: io.TokenOut) -> str:
        """Feeds the new tokens; returns the text to show (cumulative)."""
        detok = self.detokenizer
        if out.new_ids[:-1]:
            detok.feed(out.new_ids[:-1])
        before_last = len(detok.text)
        if out.new_ids:
            detok.feed(out.new_ids[-1:])
        if out.finish_reason is None:
            text = detok.text
            held = self.matcher.held_back(text) if self.matcher else 0
            return text[: len(text) - held]
        detok.finish()
        return self._final_text(out.finish_reason, before_last)

    def _final_text(self, reason: dict, before_last: int) -> str:
        """The text cut at the stop: before it, or (``no_stop_trim``) right after it."""
        text = self.detokenizer.text
        matched = reason.get("matched")
        if reason.get("type") != "stop" or matched is None:
            return text
        if isinstance(matched, int):  # a stop token: drop its own text unless kept
            return text if self.spec.no_stop_trim else text[:before_last]
        position = text.find(matched)
        if position < 0:  # a special token's text, never shown
            return text
        return text[: position + len(matched)] if self.spec.no_stop_trim else text[:position]


class Detokenizer:
    """Per-request decode states, keyed by rid; a state is dropped when its request ends."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}

    def handle(self, batch: io.TokenBatch) -> io.TextBatch:
        outputs = []
        for out in batch.outputs:
            state = self.states.get(out.rid)
            if state is None:
                spec = out.spec or io.DetokenizeSpec([], True, True, [], False)
                state = DecodeState(
                    IncrementalDetokenizer(
                        self.tokenizer, spec.prompt_tail, spec.skip_special_tokens,
                        spec.spaces_between_special_tokens,
                    ),
                    spec,
                    StopStringMatcher(spec.stop, []) if spec.stop else None,
                )
                self.states[out.rid] = state
            outputs.append(io.TextOut(state.update(out), out))
            if out.finish_reason is not None:
                del self.states[out.rid]
        return io.TextBatch(outputs)


def run_detokenizer_process(tokenizer_path: str, paths, ready) -> None:
    """Process entry point: decode TokenBatches into TextBatches until told to stop."""
    context = zmq.Context()
    try:
        detokenizer = Detokenizer(AutoTokenizer.from_pretrained(tokenizer_path))
        inbox = context.socket(zmq.PULL)
        inbox.bind(paths.detokenizer)
        outbox = context.socket(zmq.PUSH)
        outbox.connect(paths.tokenizer_manager)
    except Exception as err:
        ready.send_bytes(io.encode(io.ProcessFailed("detokenizer", str(err))))
        context.destroy(linger=0)
        return
    ready.send_bytes(io.encode(io.ControlReply(0, True)))
    parent = os.getppid()
    try:
        while os.getppid() == parent:
            if not inbox.poll(500):
                continue
            msg = io.decode(inbox.recv())
            if isinstance(msg, io.ControlReq) and msg.kind == "shutdown":
                return
            if isinstance(msg, io.TokenBatch):
                outbox.send(io.encode(detokenizer.handle(msg)))
    except Exception as err:
        logger.exception("the detokenizer failed")
        outbox.send(io.encode(io.ProcessFailed("detokenizer", str(err))))
    finally:
        context.destroy(linger=100)
