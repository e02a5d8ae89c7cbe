"""The Detokenizer's process: token ids in, text deltas out, incrementally, per request.

For each ``DetokenizeOut`` it answers one ``TextOut`` carrying only the text the new tokens
add. That text never holds a broken multi-byte character (held back until complete) nor
the start of a stop string (held back until it is known not to be one). When a request
ends, its text is cut at the stop the Scheduler matched: before a stop string (found
anywhere in the text, so also across chunk boundaries), or before a stop token's own text,
unless ``no_stop_trim``; text already sent past that point (only a stop regex can leave
some) is taken back with ``trim``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from radixlm.runtime import messages as io
from radixlm.runtime.detokenizer.incremental_detokenizer import IncrementalDetokenizer
from radixlm.runtime.detokenizer.stop_matcher import StopMatcher

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@dataclass
class DecodeState:
    """One request's text: decoded so far, and how much of it has been sent."""

    detokenizer: IncrementalDetokenizer
    spec: io.DetokenizeSpec
    matcher: StopMatcher | None
    sent: int = 0
    """Characters of ``detokenizer.text`` already sent (a prefix of it)."""

    def update(self, out: io.DetokenizeOut) -> io.TextOut:
        """Feeds the new tokens; returns the text they add that is safe to show."""
        detok = self.detokenizer
        if out.new_ids[:-1]:
            detok.feed(out.new_ids[:-1])
        before_last = len(detok.text)
        if out.new_ids:
            detok.feed(out.new_ids[-1:])
        if out.finish_reason is None:
            text = detok.text
            shown = len(text) - (self.matcher.held_back(text) if self.matcher else 0)
            delta = text[self.sent:shown]  # what is held back never shrinks what was shown
            self.sent = max(shown, self.sent)
            return io.TextOut(out.rid, delta)
        detok.finish()
        final = self._final_length(out.finish_reason, before_last)
        trim = max(self.sent - final, 0)
        return io.TextOut(out.rid, detok.text[self.sent:final], trim)

    def _final_length(self, reason: dict, before_last: int) -> int:
        """Where the text ends: before the stop, or (``no_stop_trim``) right after it."""
        text = self.detokenizer.text
        matched = reason.get("matched")
        if reason.get("type") != "stop" or matched is None:
            return len(text)
        if isinstance(matched, int):  # a stop token: drop its own text unless kept
            return len(text) if self.spec.no_stop_trim else before_last
        position = text.find(matched)
        if position < 0:  # a special token's text, never shown
            return len(text)
        return position + len(matched) if self.spec.no_stop_trim else position


class Detokenizer:
    """Per-request decode states, keyed by rid; a state is dropped when its request ends."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}

    def handle(self, batch: io.DetokenizeBatch) -> io.TextBatch:
        texts = []
        for out in batch.outputs():
            state = self.states.get(out.rid)
            if state is None:
                spec = out.spec or io.DetokenizeSpec([], True, True, [], False)
                state = DecodeState(
                    IncrementalDetokenizer(
                        self.tokenizer, spec.prompt_tail, spec.skip_special_tokens,
                        spec.spaces_between_special_tokens,
                    ),
                    spec,
                    StopMatcher(spec.stop, []) if spec.stop else None,
                )
                self.states[out.rid] = state
            texts.append(state.update(out))
            if out.finish_reason is not None:
                del self.states[out.rid]
        return io.TextBatch.of(texts)


def run_detokenizer_process(tokenizer_path: str, paths, ready) -> None:
    """Process entry point: decode TokenBatches into TextBatches until told to stop."""
    from transformers import AutoTokenizer  # loaded in the process, not by importing it

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
            msg = io.decode_or_drop(inbox.recv(), "detokenizer")
            if isinstance(msg, io.ControlReq) and msg.kind == "shutdown":
                return
            if isinstance(msg, io.DetokenizeBatch):
                outbox.send(io.encode(detokenizer.handle(msg)))
    except Exception as err:
        logger.exception("the detokenizer failed")
        outbox.send(io.encode(io.ProcessFailed("detokenizer", str(err))))
    finally:
        context.destroy(linger=100)
