"""The Detokenizer's process: a step's outputs in, the same outputs with their text out.

For each row of a ``TokenBatch`` it adds the text the row's new tokens make, and forwards
the tokens, logprobs and states as they came, in one ``OutputBatch`` per batch: outputs run
Scheduler -> Detokenizer -> RequestTracker. The text never holds a broken multi-byte
character (held back until complete) nor the start of a stop string (held back until it is
known not to be one). When a request ends, its text is cut at the stop the Scheduler
matched: before a stop string (found anywhere in the text, so also across chunk
boundaries), or before a stop token's own text, unless ``no_stop_trim``; text already sent
past that point (only a stop regex can leave some) is taken back with a trim.

Each token is decoded once: here, or, for a request with stop strings or regexes, by the
Scheduler, which matches them on its text and sends that text along (``DecodedText``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import zmq

from radixlm.runtime import messages as wire
from radixlm.runtime.detokenizer.incremental_detokenizer import IncrementalDetokenizer
from radixlm.runtime.detokenizer.stop_matcher import StopMatcher
from radixlm.runtime.detokenizer.text_decoder import RustTextDecoder, TextDecoder
from radixlm.runtime.free_memory import return_free_memory

logger = logging.getLogger(__name__)

PLAIN_SPEC = wire.DetokenizeSpec([], True, True, [], False)
"""For a request whose spec never came (one refused before it ran)."""


@dataclass
class DecodeState:
    """One request's text: decoded so far (here, or by the Scheduler: then ``detokenizer``
    is None and ``text`` grows by what it sent), and how much of it has been sent."""

    detokenizer: IncrementalDetokenizer | None
    spec: wire.DetokenizeSpec
    matcher: StopMatcher | None
    text: str = ""
    sent: int = 0
    """Characters of ``text`` already sent (a prefix of it)."""

    def update(self, new_ids: list[int], finish_reason: dict[str, Any] | None,
               decoded: wire.DecodedText | None) -> tuple[str, int]:
        """Takes the new tokens (or the Scheduler's text for them); returns the text they
        add that is safe to show, and the characters of text already sent to take back."""
        detok = self.detokenizer
        if detok is None:
            if decoded is not None:
                self.text += decoded.text
            before_last = decoded.before_last if decoded is not None else len(self.text)
        else:
            if new_ids[:-1]:
                detok.feed(new_ids[:-1])
            before_last = len(detok.text)
            if new_ids:
                detok.feed(new_ids[-1:])
            if finish_reason is not None:
                detok.finish()
            self.text = detok.text
        text = self.text
        if finish_reason is None:
            shown = len(text) - (self.matcher.held_back(text) if self.matcher else 0)
            delta = text[self.sent:shown]  # what is held back never shrinks what was shown
            self.sent = max(shown, self.sent)
            return delta, 0
        final = self._final_length(finish_reason, before_last)
        return text[self.sent:final], max(self.sent - final, 0)

    def _final_length(self, reason: dict, before_last: int) -> int:
        """Where the text ends: before the stop, or (``no_stop_trim``) right after it."""
        text = self.text
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

    def __init__(self, tokenizer: TextDecoder):
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}

    def handle(self, batch: wire.TokenBatch) -> wire.OutputBatch:
        """``batch`` with the text of each row (empty for a row that brings neither tokens
        nor a finish: prompt logprobs only)."""
        texts: list[str] = []
        trims: dict[int, int] = {}
        for row, (rid, new_ids) in enumerate(wire.rows(batch.rids, batch.ends, batch.new_ids)):
            finish_reason = batch.finish_reason(row)
            if not new_ids and finish_reason is None:
                texts.append("")
                continue
            state = self.states.get(rid) or self._start(rid, batch.specs.get(row),
                                                        row in batch.texts)
            text, trim = state.update(new_ids, finish_reason, batch.texts.get(row))
            texts.append(text)
            if trim:
                trims[row] = trim
            if finish_reason is not None:
                del self.states[rid]
        return wire.OutputBatch(batch.rids, batch.ends, batch.new_ids, batch.states, texts, trims)

    def _start(self, rid: str, spec: wire.DetokenizeSpec | None, decoded: bool) -> DecodeState:
        spec = spec or PLAIN_SPEC
        detokenizer = None if decoded else IncrementalDetokenizer(
            self.tokenizer, spec.prompt_tail, spec.skip_special_tokens,
            spec.spaces_between_special_tokens,
        )
        state = DecodeState(detokenizer, spec, StopMatcher(spec.stop, []) if spec.stop else None)
        self.states[rid] = state
        return state


def load_decoder(tokenizer_path: str, decoder_path: str | None):
    """What the Detokenizer decodes with: ``RustTextDecoder`` or transformers' tokenizer
    (imported here, in the process, only when needed)."""
    if decoder_path is not None:
        return RustTextDecoder(decoder_path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_path)


def run_detokenizer_process(tokenizer_path: str, paths, ready,
                            decoder_path: str | None = None) -> None:
    """Process entry point: turns TokenBatches into OutputBatches until told to stop. It
    decodes with the Rust tokenizer at ``decoder_path`` where the Engine wrote one (no
    transformers, no torch in this process), else with transformers' tokenizer."""
    context = zmq.Context()
    try:
        detokenizer = Detokenizer(load_decoder(tokenizer_path, decoder_path))
        inbox = context.socket(zmq.PULL)
        inbox.bind(paths.detokenizer)
        outbox = context.socket(zmq.PUSH)
        outbox.connect(paths.request_tracker)
        return_free_memory()  # what parsing the tokenizer left in the heap
    except Exception as err:
        ready.send_bytes(wire.encode(wire.ProcessFailed("detokenizer", str(err))))
        context.destroy(linger=0)
        return
    ready.send_bytes(wire.encode(wire.ControlReply(0, True)))
    parent = os.getppid()
    try:
        while os.getppid() == parent:
            if not inbox.poll(500):
                continue
            msg = wire.decode_or_drop(inbox.recv(), "detokenizer")
            if isinstance(msg, wire.ControlReq) and msg.kind == "shutdown":
                return
            if isinstance(msg, wire.TokenBatch):
                outbox.send(wire.encode(detokenizer.handle(msg)))
    except Exception as err:
        logger.exception("the detokenizer failed")
        outbox.send(wire.encode(wire.ProcessFailed("detokenizer", str(err))))
    finally:
        context.destroy(linger=100)
