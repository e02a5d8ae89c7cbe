"""After a forward pass: logits for the rows that need them, next tokens, logprobs, stop checks."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from radixlm.host_to_device import to_device
from radixlm.runtime.grammar.jump_forward import JumpForward
from radixlm.runtime.request import Req, finish_abort, finish_length, finish_stop
from radixlm.runtime.sampling.logprobs import LogprobCopy, Logprobs
from radixlm.runtime.sampling.sampler import Sampler
from radixlm.runtime.sampling.sampling_batch import SamplingBatch

PROMPT_LOGPROB_SLICE_ROWS = 128
"""Prompt rows put through the LM head at once for prompt logprobs (a 49,152-token
vocabulary makes 25 MB of float32 logits per slice)."""


class SamplingStep:
    """Turns a batch's hidden states into each request's next token and finish state.

    Only the rows that matter go through the LM head: each request's last new token (to
    sample from) and, for requests that asked for prompt logprobs, the prompt rows whose
    next-token distribution they asked about.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, compute_logits, eos_token_ids: set[int],
        context_length: int, jump_forward: JumpForward | None = None,
    ):
        """``jump_forward``: None disables jump-forward decoding."""
        self.tokenizer = tokenizer
        # Special tokens' texts, for stop strings naming them (their text is never shown).
        self.special_tokens = {
            tid: tokenizer.convert_ids_to_tokens(tid) for tid in tokenizer.all_special_ids
        }
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.special_tokens.update({tid: t.content for tid, t in added.items() if t.special})
        self.compute_logits = compute_logits
        self.eos_token_ids = eos_token_ids
        self.context_length = context_length
        self.jump_forward = jump_forward
        self._token_texts: dict[int, str] = {}
        """Each token's own text, decoded once (logprob entries name tokens by text; at most
        one entry per vocabulary token)."""

    def process(
        self, reqs: list[Req], hidden: torch.Tensor, prefix_lens: list[int],
        extend_lens: list[int], sampler: Sampler, sampling_batch: SamplingBatch,
    ) -> None:
        """Samples the next token of each request whose prompt is complete, records what it
        owes in logprobs, and appends the tokens (ending requests that stop).

        ``sampling_batch`` holds the running requests' rows: a request sampled for the first
        time since its admission gets its row here, after the others; requests that leave
        are the scheduler's to remove.
        """
        prompt_rows: list[int] = []  # hidden rows whose logits predict owed prompt tokens
        targets: list[int] = []  # the prompt tokens they predict
        owed: list[tuple[Req, int, int]] = []  # (request, first of its prompt_rows, count)
        sample_rows: list[int] = []  # hidden rows of the requests sampled here
        to_sample: list[Req] = []
        offset = 0
        for req, prefix, extend in zip(reqs, prefix_lens, extend_lens):
            end = prefix + extend  # positions computed: prefix .. end - 1
            # Else a chunk: its last row predicts a prompt token.
            complete = end == len(req.input_ids) + len(req.output_ids)
            first_position = None
            if req.logprobs is not None:
                first_position = self._first_input_logprob_position(req, prefix)
            if first_position is not None:
                logprob_end = end - 1 if complete else end
                count = max(logprob_end - first_position, 0)
                start = offset + first_position - prefix
                owed.append((req, len(prompt_rows), count))
                prompt_rows += range(start, start + count)
                targets += req.input_ids[first_position + 1 : first_position + 1 + count]
            # (a beam search's beams are its group's to step, not sampled here)
            if complete and req.beam is None and not self._ends_before_sampling(req):
                to_sample.append(req)
                sample_rows.append(offset + extend - 1)
            offset += extend
        copies = self._start_prompt_logprobs(hidden, owed, prompt_rows, targets)
        if to_sample:
            row_index = to_device(sample_rows, torch.int64, hidden.device)
            logits = self.compute_logits(hidden.index_select(0, row_index))  # (S, V)
            self._sample(logits, to_sample, sampler, sampling_batch)
        if owed:  # read after the tokens (or alone, in a step that samples nothing)
            self._add_prompt_logprobs(owed, copies)

    def process_decode(self, reqs: list[Req], hidden: torch.Tensor, sampler: Sampler,
                       sampling_batch: SamplingBatch) -> list[Req]:
        """``process`` for a decode step, in fewer steps: ``hidden`` has one row per request
        (its one new token), and every request samples from it (a running request is below
        its output budget and the context, and owes no prompt logprobs). Returns the
        requests that end."""
        logits = self.compute_logits(hidden)  # (B, V)
        return self._sample(logits, reqs, sampler, sampling_batch)

    def prepare(self, req: Req) -> None:
        """Sets what the stop checks read on every token of ``req``: its stop tokens and
        its output limit. Called once, when the request enters the scheduler."""
        params = req.sampling
        eos = () if params.ignore_eos else self.eos_token_ids
        req.stop_token_ids = frozenset([*(params.stop_token_ids or ()), *eos])
        req.output_limit = min(params.max_new_tokens, self.context_length - len(req.input_ids))
        req.plain_output = req.grammar_key is None and req.stop_matcher is None

    def append_tokens(self, reqs: list[Req], tokens: list[int],
                      sampling_batch: SamplingBatch | None,
                      jumped: list[Req] | None = None) -> list[Req]:
        """Appends each request's sampled token (and jump-forward's after it), and returns
        the requests that end with them. A request that had finished before gets nothing:
        an overlapped decode step (see ``overlap``) ran one step ahead for it.

        ``sampling_batch`` records the jumped tokens; None where another thread owns it
        (overlap scheduling): the caller passes ``jumped``, which gets each unfinished
        request that jump-forward extended, and rebuilds their rows itself.

        A request without grammar or stop strings (``plain_output``) that neither samples a
        stop token nor reaches its limit costs one list append and two tests here: every
        other case takes the full path (``_append_sampled``)."""
        ended = []
        for req, token in zip(reqs, tokens):
            if req.finish_reason is not None:
                continue
            if req.plain_output:
                output_ids = req.output_ids
                if token not in req.stop_token_ids and len(output_ids) + 1 < req.output_limit:
                    output_ids.append(token)
                    continue
            appended_jumps = self._append_sampled(req, token, sampling_batch)
            if req.finish_reason is not None:
                ended.append(req)
            elif appended_jumps and jumped is not None:
                jumped.append(req)
        return ended

    def _sample(self, logits: torch.Tensor, to_sample: list[Req], sampler: Sampler,
                sampling_batch: SamplingBatch) -> list[Req]:
        """Samples ``to_sample``'s next tokens from ``logits`` (S, V), a row each, adds the
        logprobs of those that want them, and appends the tokens; returns the requests they
        end."""
        sampling_batch.add(to_sample)
        rows_sampled = sampling_batch.select(to_sample)
        next_ids = sampler.sample(logits, rows_sampled)  # (S,) on the logits' device
        rows_sampled.record_sampled(next_ids)
        wanted = [i for i, req in enumerate(to_sample) if req.logprobs is not None]
        copy = None
        if wanted:
            rows = to_device(wanted, torch.int64, logits.device)
            top_k = max(to_sample[i].logprobs.top_k for i in wanted)
            copy = LogprobCopy.start(
                logits.index_select(0, rows), next_ids.index_select(0, rows), top_k)
        tokens = next_ids.tolist()  # the step's one wait for the device (host_reads.py)
        if copy is not None:  # copied behind the tokens: nothing more to wait for
            self.add_output_logprobs(
                [(to_sample[i], row) for row, i in enumerate(wanted)], copy.read())
        return self.append_tokens(to_sample, tokens, sampling_batch)

    def _start_prompt_logprobs(self, hidden: torch.Tensor, owed: list[tuple[Req, int, int]],
                               prompt_rows: list[int], targets: list[int]
                               ) -> list[LogprobCopy]:
        """Starts computing the owed prompt logprobs (none when nothing is ``owed``):
        ``prompt_rows`` of ``hidden`` predict ``targets``; ``owed`` names each request's
        span of them.

        The LM head runs over ``PROMPT_LOGPROB_SLICE_ROWS`` rows at a time, so a long
        prompt never holds rows x vocabulary logits at once (a 1,024-token chunk of a
        49,152-token vocabulary would be 200 MB, and three such copies a step). Every
        slice's copy to the host is started here; ``_add_prompt_logprobs`` reads them."""
        if not owed:
            return []
        device = hidden.device
        row_index = to_device(prompt_rows, torch.int64, device)  # (R,)
        token_ids = to_device(targets, torch.int64, device)  # (R,)
        top_k = max(req.logprobs.top_k for req, _, _ in owed)
        copies = []
        for start in range(0, len(prompt_rows), PROMPT_LOGPROB_SLICE_ROWS):
            stop = start + PROMPT_LOGPROB_SLICE_ROWS
            logits = self.compute_logits(hidden.index_select(0, row_index[start:stop]))
            copies.append(LogprobCopy.start(logits, token_ids[start:stop], top_k))
            del logits
        return copies

    def _add_prompt_logprobs(self, owed: list[tuple[Req, int, int]],
                             copies: list[LogprobCopy]) -> None:
        """Appends each request's owed prompt logprobs from ``copies`` (the slices
        ``_start_prompt_logprobs`` started)."""
        found = Logprobs([], [], [], [])
        for copy in copies:
            found.extend(copy.read())
        for req, first, count in owed:
            self._add_input_logprobs(req, found, first, count)

    def add_output_logprobs(self, wanted: list[tuple[Req, int]], found: Logprobs) -> None:
        """Appends to each request of ``wanted`` its sampled token's entry (and top
        alternatives, if it asked) from its row of ``found``."""
        for req, row in wanted:
            spec = req.logprobs
            decode = self._decode_one if spec.with_text else None
            req.output_token_logprobs += found.entries(row, row + 1, decode)
            if spec.top_k:
                req.output_top_logprobs += found.tops(row, row + 1, spec.top_k, decode)

    def _first_input_logprob_position(self, req: Req, prefix: int) -> int | None:
        """The first prompt position whose logits this extend must produce, if any.

        As in SGLang, ``logprob_start_len = s`` asks for the logprobs of prompt tokens
        s + 1 .. L - 1, computed from the logits at positions s .. L - 2 (plus a null entry
        for token 0 when s == 0). Prefix-cache matches are capped at the first position still
        owed (``Req.next_prompt_logprob_position``), so those positions are computed here.
        """
        owed = req.next_prompt_logprob_position()
        return None if owed is None else max(owed, prefix)

    def _add_input_logprobs(self, req: Req, found: Logprobs, start: int, count: int) -> None:
        """Appends the prompt logprobs in rows ``start .. start + count - 1`` of ``found``."""
        spec = req.logprobs
        decode = self._decode_one if spec.with_text else None
        if spec.start == 0 and not req.input_token_logprobs:
            first = req.input_ids[0]
            req.input_token_logprobs.append([None, first, decode(first) if decode else None])
            if spec.top_k:
                req.input_top_logprobs.append(None)
        req.input_token_logprobs += found.entries(start, start + count, decode)
        if spec.top_k:
            req.input_top_logprobs += found.tops(start, start + count, spec.top_k, decode)

    def _ends_before_sampling(self, req: Req) -> bool:
        """A request with no output budget (prefill only, or a full context) ends here."""
        if req.sampling.max_new_tokens == 0 or req.kv_len >= self.context_length:
            req.finish_reason = finish_length(len(req.output_ids))
            return True
        return False

    def _append_sampled(self, req: Req, token: int,
                        sampling_batch: SamplingBatch | None) -> bool:
        """Appends a sampled token and, for a constrained request where the grammar forces
        what follows, the jump-forward tokens after it (not for requests wanting logprobs:
        jumped tokens have none; ``sampling_batch`` records them). A grammar that has
        terminated (accepted a stop token) ends the request with that stop. Returns whether
        jump-forward appended tokens after the sampled one."""
        grammar = req.grammar
        if grammar is None:
            self._append_token(req, token)
            return False
        if not grammar.accept_token(token):  # the mask forbids this; a bug if it happens
            req.finish_reason = finish_abort(f"the grammar rejected sampled token {token}")
            return False
        tokens = [token]
        if self.jump_forward is not None and req.logprobs is None and not grammar.is_terminated():
            room = min(req.sampling.max_new_tokens - len(req.output_ids),
                       self.context_length - req.seq_len)
            tokens = self.jump_forward.jump(grammar, token, room) or tokens
        appended = 0
        while appended < len(tokens) and not req.finished:
            self._append_token(req, tokens[appended])
            appended += 1
        req.jump_forward_tokens += appended - 1  # every token after the first was not sampled
        if sampling_batch is not None and appended > 1:
            sampling_batch.record_appended(req, tokens[1:appended])
        if not req.finished and grammar.is_terminated():
            req.finish_reason = finish_stop(tokens[-1])
        return appended > 1

    def _append_token(self, req: Req, token: int) -> None:
        """Appends a sampled token and decides whether the request ends with it.

        Stops, in order: a stop token (EOS unless ``ignore_eos``, or ``stop_token_ids``); a
        stop string or regex in the text (a stop string equal to a special token's text also
        matches that token, though such text never shows); the output budget or the context.
        The Detokenizer trims the text at the stop (the text decoded here goes to it with the
        tokens: ``scheduler_process.report_message``).
        """
        params = req.sampling
        output_ids = req.output_ids
        output_ids.append(token)
        detokenizer = req.detokenizer  # with stop strings: every token is decoded here, once
        new_text = detokenizer.feed([token]) if detokenizer is not None else ""
        if token in req.stop_token_ids and len(output_ids) >= params.min_new_tokens:
            req.finish_reason = finish_stop(token)
        elif req.stop_matcher is not None:  # it comes with the request's detokenizer
            found = None
            if new_text:
                found = req.stop_matcher.search(detokenizer.text, len(new_text))
            elif self.special_tokens.get(token) in req.stop_matcher.stop:
                found = (0, 0, self.special_tokens[token])
            if found is not None:
                req.finish_reason = finish_stop(found[2])
        if req.finish_reason is None and len(output_ids) >= req.output_limit:
            req.finish_reason = finish_length(len(output_ids))

    def _decode_one(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text
