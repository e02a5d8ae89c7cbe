"""A generation request as callers give it, and its validation into the scheduler's messages.

``GenerateInput`` is the one shape of a request at the entry: the body of ``POST /generate``
(FastAPI validates the JSON into it) and the arguments of ``Engine.generate`` /
``async_generate`` (which build it from their keywords). ``build_generate_reqs`` checks
every value and turns it into one ``GenerateReq`` per sample, so a bad value queues nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec
from transformers import PreTrainedTokenizerBase

from radixlm.kv_cache.allocator import pages_for
from radixlm.runtime import messages as wire
from radixlm.runtime.engine.request_caps import RequestCaps
from radixlm.runtime.sampling.sampling_params import SamplingParams


@dataclass
class GenerateInput:
    """One call of the SGLang native API: a prompt (or a list of them) and how to run it.

    Exactly one of ``text`` and ``input_ids``; ``sampling_params`` and ``rid`` are one value
    for every prompt or a list with one per prompt.
    """

    __pydantic_config__: ClassVar[dict[str, Any]] = {"extra": "forbid"}
    """As an HTTP body, unknown fields are refused (400 naming them)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool = False
    logprob_start_len: int | None = None
    """First prompt position whose logprob is returned; None or -1: output only."""
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    extra_key: str | None = None
    """A prefix-cache namespace (a tenant): requests under different keys never share
    cached KV."""
    lora_path: str | None | list[str | None] = None
    """The LoRA adapter to run with, by name (one for all prompts or one per prompt;
    None: the base model). Its KV is cached apart from other adapters'."""
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | None | list[int | None] = None
    bootstrap_room: int | list[int] | None = None
    """Prefill/decode disaggregation (SGLang's router sets them, one per prompt or one for
    all): the prefill server's bootstrap service (host; port, None: this server's
    ``disaggregation_bootstrap_port``) and the number pairing the two halves of a request
    (sample j of a prompt uses room + j)."""


@dataclass
class RequestLimits:
    """What the running model accepts, for checking requests before they are sent."""

    context_length: int
    vocab_size: int
    max_total_tokens: int
    page_size: int
    generation_defaults: dict[str, Any]
    check_constraint: Callable[[str, str], None]
    """The grammar backend's parser: raises ``ValueError`` for a constraint it refuses."""
    caps: RequestCaps
    max_prompt_chars: int
    """Longer prompt texts are refused untokenized (``request_caps.max_prompt_chars``)."""
    disaggregation_mode: str = "null"
    bootstrap_port: int = 8998
    """This server's ``disaggregation_bootstrap_port``: a paired request's default."""
    request_rows: int = 2**31
    """Requests the scheduler runs at once (a beam search needs a row per beam)."""
    tp_size: int = 1
    lora_adapters: set[str] | None = None
    """The LoRA adapters requests may name (None: the server serves none)."""
    eos_token_ids: frozenset[int] = frozenset()
    """The model's end-of-sequence tokens (they stop an output unless ``ignore_eos``)."""


def build_generate_reqs(
    request: GenerateInput, tokenizer: PreTrainedTokenizerBase, limits: RequestLimits,
) -> tuple[list[wire.GenerateReq], bool]:
    """The scheduler's messages for ``request`` (one per sample: ``n`` per prompt), and
    whether the caller gets a list back.

    Raises ``ValueError`` naming the argument for: both or neither of ``text`` and
    ``input_ids``, prompts that are not valid Unicode, a ``rid`` given twice, empty
    prompts, ids outside the vocabulary, prompts that fill the context, list lengths that
    do not match, any bad sampling parameter or constraint, and anything over one of the
    server's ``limits.caps`` (checked before the costly part: tokenizing, building). The model's
    generation-config defaults fill in what the request leaves out. A ``max_new_tokens``
    given beyond the context is refused (as SGLang does); the default
    budget is clamped to the context.
    """
    id_lists, batched = _prompt_ids(request, tokenizer, limits)
    top_logprobs_num = request.top_logprobs_num
    if top_logprobs_num is not None and (
        not isinstance(top_logprobs_num, int) or top_logprobs_num < 0
    ):
        raise ValueError(f"top_logprobs_num must be an integer >= 0, got {top_logprobs_num!r}")
    limits.caps.check_logprobs(top_logprobs_num or 0, 0)
    if request.extra_key is not None and not isinstance(request.extra_key, str):
        raise ValueError(f"extra_key must be a string, got {type(request.extra_key).__name__}")
    if request.extra_key is not None and "\x00" in request.extra_key:
        raise ValueError("extra_key must not hold a NUL character")
    adapters = _adapters(request.lora_path, len(id_lists), limits)
    params_list = _per_item("sampling_params", request.sampling_params, len(id_lists), dict)
    rids = [r or uuid.uuid4().hex for r in _per_item("rid", request.rid, len(id_lists), str)]
    if len(set(rids)) < len(rids):
        twice = next(rid for rid in rids if rids.count(rid) > 1)
        raise ValueError(f"rid {twice!r} is given to more than one prompt of the request")
    prompts = []
    for ids, given in zip(id_lists, params_list):
        params = _sampling_params(given or {}, len(ids), limits)
        if params.use_beam_search:
            _check_beam_search(params, set(given or {}), len(ids), request, limits)
        start = _logprob_start(request.logprob_start_len, len(ids)) \
            if request.return_logprob else None
        if start is not None:
            limits.caps.check_logprobs(top_logprobs_num or 0, len(ids) - start)
        prompts.append((params, start))
    limits.caps.check_samples(sum(params.n for params, _ in prompts))
    limits.caps.check_parameter_entries([params for params, _ in prompts])
    pairs = _bootstrap_pairs(request, [params.n for params, _ in prompts], limits)
    messages = []
    for ids, (params, start), rid, (host, port, rooms), adapter in zip(
            id_lists, prompts, rids, pairs, adapters):
        for sample in range(params.n):
            sampling = params
            if params.sampling_seed is not None and sample > 0:
                sampling = msgspec.structs.replace(params,
                                                   sampling_seed=params.sampling_seed + sample)
            messages.append(wire.GenerateReq(
                rid=rid if params.n == 1 else f"{rid}-{sample}",
                input_ids=ids,
                sampling=sampling,
                logprob_start=start,
                return_logprob=bool(request.return_logprob),
                top_logprobs_num=top_logprobs_num or 0,
                return_text_in_logprobs=bool(request.return_text_in_logprobs),
                extra_key=request.extra_key,
                prefill_leader=f"{rid}-0" if sample > 0 else None,
                bootstrap_host=host, bootstrap_port=port,
                bootstrap_room=rooms[sample], lora_path=adapter,
            ))
    return messages, batched or len(messages) > len(id_lists)


def _adapters(lora_path, count: int, limits: RequestLimits) -> list[str | None]:
    """Each prompt's LoRA adapter (``lora_path``: one name for all, or one per prompt)."""
    names = (list(lora_path) if isinstance(lora_path, list)
             else [lora_path] * count)
    if len(names) != count:
        raise ValueError(f"lora_path has {len(names)} entries for {count} prompts")
    for name in names:
        if name is None:
            continue
        if not isinstance(name, str):
            raise ValueError(f"lora_path must name an adapter (a string), got {name!r}")
        if limits.lora_adapters is None:
            raise ValueError("lora_path needs a server started with LoRA adapters "
                             "(--enable-lora or --lora-paths)")
        if name not in limits.lora_adapters:
            raise ValueError(f"lora_path {name!r}: no such adapter is loaded (loaded: "
                             f"{sorted(limits.lora_adapters)})")
    return names


ROOMS = 2**63
"""Bootstrap rooms are integers in [0, 2^63) (SGLang's router draws them so)."""


def _bootstrap_pairs(request: GenerateInput, samples: list[int], limits: RequestLimits
                     ) -> list[tuple[str | None, int | None, list[int | None]]]:
    """Each prompt's bootstrap host and port, and its samples' rooms, checked (all None
    for an unpaired request).

    Rooms come one for all prompts, one per prompt (sample j of a prompt then uses room +
    j, as in SGLang), or, for one prompt of n samples, one per sample (SGLang's router
    sends chat requests with ``n`` > 1 so)."""
    count = len(samples)
    given = [request.bootstrap_host, request.bootstrap_port, request.bootstrap_room]
    if all(value is None for value in given):
        return [(None, None, [None] * n) for n in samples]
    if limits.disaggregation_mode == "null":
        raise ValueError("bootstrap_host, bootstrap_port and bootstrap_room pair the halves of "
                         "a disaggregated request; this server runs both halves "
                         "(--disaggregation-mode null)")
    sample_lists = count == 1 and samples[0] > 1  # values may come one per sample

    def per_prompt(name: str, kind: type) -> list:
        value = getattr(request, name)
        if sample_lists and isinstance(value, list) and len(value) == samples[0]:
            value = value[0]
        return _per_item(name, value, count, kind)

    pairs = []
    for host, port, room, n in zip(per_prompt("bootstrap_host", str),
                                   per_prompt("bootstrap_port", int),
                                   per_prompt("bootstrap_room", int), samples):
        if host is None or room is None:
            raise ValueError("a paired request needs both bootstrap_host and bootstrap_room")
        check_unicode("bootstrap_host", host)
        if port is None:
            port = limits.bootstrap_port
        if isinstance(port, bool) or not 0 < port < 65536:
            raise ValueError(f"bootstrap_port must be in 1..65535, got {port!r}")
        if isinstance(room, bool):
            raise ValueError(f"bootstrap_room must be an integer in [0, 2^63), got {room!r}")
        rooms = [room + j for j in range(n)]
        if sample_lists and isinstance(request.bootstrap_room, list) and len(
                request.bootstrap_room) == n:
            rooms = request.bootstrap_room
        for each in rooms:
            if not isinstance(each, int) or isinstance(each, bool) or not 0 <= each < ROOMS:
                raise ValueError(f"bootstrap_room must be an integer in [0, 2^63), got {each!r}")
        pairs.append((host, port, [each % ROOMS for each in rooms]))
    return pairs


def _prompt_ids(request: GenerateInput, tokenizer: PreTrainedTokenizerBase,
                limits: RequestLimits) -> tuple[list[list[int]], bool]:
    """Every prompt as token ids, checked against the vocabulary and the context."""
    if (request.text is None) == (request.input_ids is None):
        raise ValueError("pass exactly one of prompt and input_ids (text and input_ids over HTTP)")
    if request.text is not None:
        batched = isinstance(request.text, list)
        texts = request.text if batched else [request.text]
        if not all(isinstance(t, str) for t in texts):
            raise ValueError("prompt must be a string or a list of strings")
        limits.caps.check_samples(len(texts))
        for text in texts:
            check_unicode("prompt", text)
            if len(text) > limits.max_prompt_chars:
                raise ValueError(
                    f"prompt has {len(text)} characters; no prompt of more than "
                    f"{limits.max_prompt_chars} fits the context of {limits.context_length} "
                    "tokens")
        id_lists = [tokenizer.encode(t) for t in texts]
        name = "prompt"
    else:
        input_ids = request.input_ids
        batched = bool(input_ids) and isinstance(input_ids[0], list)
        id_lists = input_ids if batched else [input_ids]
        limits.caps.check_samples(len(id_lists))
        for ids in id_lists:
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise ValueError("input_ids must be a list of ints or a list of lists of ints")
            bad = [t for t in ids if not 0 <= t < limits.vocab_size]
            if bad:
                raise ValueError(
                    f"input_ids {bad[:5]} are outside the vocabulary (size {limits.vocab_size})"
                )
        name = "input_ids"
    if batched and not id_lists:
        raise ValueError(f"{name} is an empty list")
    for ids in id_lists:
        if not ids:
            raise ValueError(f"{name} is empty: a request needs at least one prompt token")
        if len(ids) >= limits.context_length:
            raise ValueError(
                f"{name} has {len(ids)} tokens; the context length is {limits.context_length}, "
                "so a prompt may have at most context_length - 1 tokens"
            )
    return [list(ids) for ids in id_lists], batched


def _sampling_params(given: dict[str, Any], prompt_len: int,
                     limits: RequestLimits) -> SamplingParams:
    """The validated params of one prompt, defaults filled in and the budget fitted."""
    params = SamplingParams.from_dict({**limits.generation_defaults, **given},
                                      compile_regexes=False)  # after the caps on their number
    limits.caps.check_params(params)
    params.check_vocab(limits.vocab_size, limits.eos_token_ids)
    constraint = params.constraint()
    if constraint is not None:
        limits.check_constraint(constraint.kind, constraint.text)
    room = limits.context_length - prompt_len
    if "max_new_tokens" in given and params.max_new_tokens > room:
        raise ValueError(
            f"max_new_tokens ({params.max_new_tokens}) plus the prompt ({prompt_len} "
            f"tokens) exceeds the context length ({limits.context_length})"
        )
    params.max_new_tokens = min(params.max_new_tokens, room)  # a default budget is clamped
    need = pages_for(prompt_len + params.max_new_tokens, limits.page_size)
    if need > limits.max_total_tokens:
        raise ValueError(
            f"the prompt ({prompt_len} tokens) plus max_new_tokens ({params.max_new_tokens}) "
            f"needs {need} KV slots; the pool holds {limits.max_total_tokens} "
            "(raise max_total_tokens or lower max_new_tokens)"
        )
    return params


def _check_beam_search(params: SamplingParams, given: set[str], prompt_len: int,
                       request: GenerateInput, limits: RequestLimits) -> None:
    """A beam search of width ``n``: only what it honours, and room for its ``n`` beams (a
    request row each, and KV for the prompt plus each beam's output, and a page each)."""
    conflicts = params.beam_search_conflicts(given)
    if conflicts:
        raise ValueError(f"use_beam_search picks the most likely tokens and cannot honour "
                         f"{', '.join(conflicts)}; leave them out (sampled or constrained "
                         "beams are not supported)")
    if request.return_logprob:
        raise ValueError("return_logprob is not supported with use_beam_search (each output's "
                         "cumulative_logprob and beam_score come in its meta_info)")
    if limits.disaggregation_mode != "null":
        raise ValueError("use_beam_search is not supported on a disaggregated server "
                         f"(--disaggregation-mode {limits.disaggregation_mode})")
    if limits.tp_size > 1 and limits.page_size > 1:
        raise ValueError("use_beam_search with page_size > 1 is not supported under tensor "
                         "parallelism (a forked beam's page is copied on rank 0 only)")
    width = params.n
    if width > limits.request_rows:
        raise ValueError(f"n ({width}) is the beam width: it needs {width} request rows, and "
                         f"the server runs at most {limits.request_rows} requests at once")
    page = limits.page_size
    need = pages_for(prompt_len, page) + width * (pages_for(params.max_new_tokens, page) + page)
    if need > limits.max_total_tokens:
        raise ValueError(
            f"a beam search of width {width} over the prompt ({prompt_len} tokens) with "
            f"max_new_tokens {params.max_new_tokens} may need {need} KV slots; the pool holds "
            f"{limits.max_total_tokens} (lower n or max_new_tokens)")


def check_unicode(name: str, text: str) -> None:
    """Raises ``ValueError`` naming ``name`` if ``text`` cannot be encoded as UTF-8 (a lone
    surrogate, which JSON's ``\\udXXX`` escapes can carry)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{name} is not valid Unicode: {err.reason} at character "
                         f"{err.start}") from None


def _per_item(name: str, value: Any, count: int, item_type: type) -> list[Any]:
    """One value for all items, or a list with one per item."""
    if isinstance(value, list):
        if len(value) != count:
            raise ValueError(f"{name} is a list of {len(value)}, but there are {count} prompts")
        return value
    if value is not None and not isinstance(value, item_type):
        raise ValueError(f"{name} must be a {item_type.__name__} or a list of them")
    return [value] * count


def _logprob_start(logprob_start_len: int | None, prompt_len: int) -> int | None:
    if logprob_start_len is None or logprob_start_len == -1:
        return None
    if not isinstance(logprob_start_len, int) or not 0 <= logprob_start_len < prompt_len:
        raise ValueError(
            f"logprob_start_len must be -1 (output only) or in [0, {prompt_len}) for a "
            f"{prompt_len}-token prompt, got {logprob_start_len!r}"
        )
    return logprob_start_len
