"""A request's life inside the runtime: its inputs, its KV, its output so far, and how it ended."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from radixlm.kv_cache.base import CacheNode
from radixlm.runtime.detokenizer.incremental_detokenizer import IncrementalDetokenizer
from radixlm.runtime.detokenizer.stop_matcher import StopMatcher
from radixlm.runtime.grammar.constraints import GrammarKey
from radixlm.runtime.grammar.grammar_backend import GrammarMatcher
from radixlm.runtime.sampling.sampling_params import SamplingParams


def finish_stop(matched: str | int) -> dict[str, Any]:
    return {"type": "stop", "matched": matched}


def finish_length(length: int) -> dict[str, Any]:
    return {"type": "length", "length": length}


def finish_abort(message: str) -> dict[str, Any]:
    return {"type": "abort", "message": message}


@dataclass
class LogprobRequest:
    """What logprobs a request wants back.

    ``start`` is the first prompt position whose logprob is returned (None: output only).
    """

    start: int | None = None
    top_k: int = 0
    with_text: bool = False


@dataclass(eq=False)
class Req:
    """One generation request.

    States: waiting (no ``req_pool_idx``) -> running (holds a request row and the KV slots
    of its first ``kv_len`` tokens, the first ``len(prefix_indices)`` of them locked in the
    prefix cache) -> finished (``finish_reason`` set; KV handed to the cache or freed, row
    returned). The tokens of the sequence are ``input_ids + output_ids``.

    A constrained request (``grammar_key`` set) first waits for its grammar to compile, then
    runs with ``grammar``, a matcher that has accepted exactly ``output_ids``.
    """

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    detokenizer: IncrementalDetokenizer | None = None
    """Only for requests with stop strings, which are matched on the output text (sent on to
    the Detokenizer, which decodes it no second time)."""
    logprobs: LogprobRequest | None = None
    created: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    extra_key: str | None = None
    """Namespace of the prefix cache: requests with different keys never share KV."""
    req_pool_idx: int | None = None
    kv_len: int = 0
    last_slot: int = -1
    """The KV slot of the last token with KV, where pages hold several tokens (the next
    token goes into its page if there is room); not kept when pages are single tokens."""
    # The cached prefix this request runs on (tree-owned slots) and the node locked for it.
    prefix_indices: torch.Tensor | None = None
    last_node: CacheNode | None = None
    cached_tokens: int = 0
    retractions: int = 0
    # For the 2nd..nth sample of an n > 1 request: the sample whose prefill the others
    # wait for, so they reuse its cached prompt instead of computing it again.
    prefill_leader: Req | None = None
    input_token_logprobs: list[list[Any]] = field(default_factory=list)
    input_top_logprobs: list[Any] = field(default_factory=list)
    output_token_logprobs: list[list[Any]] = field(default_factory=list)
    output_top_logprobs: list[Any] = field(default_factory=list)
    stop_matcher: StopMatcher | None = None
    grammar_key: GrammarKey | None = None
    grammar: GrammarMatcher | None = None
    jump_forward_tokens: int = 0
    """Output tokens appended by jump-forward decoding rather than sampled."""
    spec_verify_ct: int = 0
    """Speculative verify steps that checked a draft of this request (SGLang's name)."""
    # How much of the output (tokens and their logprobs; prompt logprobs; text) has been
    # reported, and whether the Detokenizer has had the request's first message (its spec).
    reported_ids: int = 0
    reported_input_logprobs: int = 0
    reported_text: bool = False
    reported_chars: int = 0
    """Characters of ``detokenizer.text`` reported (with a detokenizer only)."""
    reported_counters: tuple[int, int, int] | None = None
    """(cached_tokens, retractions, jump_forward_tokens, spec_verify_ct) as last reported."""
    streamed: bool = True
    """Whether its caller takes the output step by step (``GenerateReq.streamed``)."""
    # Set by ``SamplingStep.prepare`` when the request enters the scheduler:
    stop_token_ids: frozenset[int] = frozenset()
    """The tokens that end the request (``stop_token_ids``, plus EOS unless ``ignore_eos``)."""
    output_limit: int = 0
    """The output length that ends it: its budget, or what the context leaves."""
    plain_output: bool = False
    """No grammar and no stop strings: only stop tokens and ``output_limit`` end it."""
    handoff: str | None = None
    """Prefill/decode disaggregation (``runtime/disaggregation``): ``send`` (a prefill
    server's half, whose KV goes to a decode server), ``fake`` (the same, sending
    nothing), ``receive`` (a decode server's half, whose prompt's KV comes from a prefill
    server); None: both halves run here."""
    bootstrap_room: int | None = None
    """The number pairing the two halves."""
    bootstrap_address: str | None = None
    """The prefill server's bootstrap service (``host:port``), for a ``receive`` half."""
    beam: Any = None
    """The ``BeamGroup`` this request is a member of (``scheduler/beam_groups.py``; typed
    loosely, as the scheduler's module imports this one), None outside beam search: its
    beams run as the group's requests, which report only their final hypotheses."""
    drafting: Any = None
    """A speculative proposer's state for this request (``runtime/speculative``; typed
    loosely, as for ``beam``), None without speculation."""
    lora_name: str | None = None
    """The LoRA adapter it runs with (``runtime/lora``); its KV is cached apart: its
    ``extra_key`` carries the name."""
    kv_prefetch: Future | None = None
    """The hierarchical cache's read of this request's prompt blocks from disk, while it
    runs (``Admission``: the request waits, others go on)."""
    cumulative_logprob: float | None = None
    beam_score: float | None = None
    """A finished beam hypothesis's summed logprobs and length-normalised score."""

    def __post_init__(self) -> None:
        params = self.sampling
        if self.detokenizer is not None and (params.stop or params.stop_regex):
            self.stop_matcher = StopMatcher(params.stop or [], params.stop_regex or [])
        if self.grammar_key is None:
            self.grammar_key = params.constraint()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def width(self) -> int:
        """Request rows (and decoding sequences) the request runs as: its beam width."""
        return 1 if self.beam is None else self.beam.width

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    def match_key(self) -> list[int]:
        """The tokens a prefix-cache match may cover.

        Capped at the sequence length - 1 (the last token must be computed to sample from
        its logits) and, while prompt logprobs are still owed, at the first position owed
        (those positions must be computed too).
        """
        limit = self.seq_len - 1
        owed = self.next_prompt_logprob_position()
        if owed is not None:
            limit = min(limit, owed)
        return self.all_ids()[:limit]

    def next_prompt_logprob_position(self) -> int | None:
        """The first prompt position whose logits are still owed for prompt logprobs (None:
        none are). Positions already computed are not owed again: a request retracted in
        the middle of its prompt resumes its prompt logprobs where they stopped."""
        spec = self.logprobs
        if spec is None or spec.start is None or self.output_ids:
            return None
        computed = len(self.input_token_logprobs) - (spec.start == 0 and
                                                      bool(self.input_token_logprobs))
        return spec.start + computed

    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids
