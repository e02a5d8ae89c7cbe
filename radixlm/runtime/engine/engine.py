"""``radixlm.Engine``: the SGLang-compatible offline API.

    engine = Engine()                      # the default model
    out = engine.generate("The capital of France is", {"max_new_tokens": 16})
    for chunk in engine.generate("Tell me a story", stream=True): ...
    out = await engine.async_generate("Hi", {"max_new_tokens": 8})
    engine.shutdown()

Behind it run three processes: this one (validation, tokenization and the
RequestTracker), the Scheduler (the model and its KV memory) and the Detokenizer. All
requests of one ``generate`` call run together in one continuous batch, with whatever
other calls are in flight.

The RequestTracker runs on the Engine's own event loop, in a background thread, so the
Engine works the same in a script, in Jupyter, inside a running event loop and under an
HTTP server: calls from other threads and loops hop onto it (``loop_bridge.py``). Hosting
it on a server's loop instead saved that hop and no measurable time
(``benchmarks/bench_loop_hop.py``, figures in ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from radixlm.chat_templates import load_chat_template
from radixlm.models.default_model import resolve_model_path
from radixlm.models.model_config import ModelConfig
from radixlm.models.registry import model_class
from radixlm.runtime import messages as wire
from radixlm.runtime.detokenizer.text_decoder import backend_decoder_json
from radixlm.runtime.engine.chat_template_kwargs import check_template_kwargs
from radixlm.runtime.engine.client_template_renderer import ClientTemplateRenderer
from radixlm.runtime.engine.errors import RuntimeUnavailable
from radixlm.runtime.engine.loop_bridge import (
    iterate_on_loop,
    run_on_loop,
    run_on_loop_blocking,
)
from radixlm.runtime.engine.native_output import native_chunks, native_results
from radixlm.runtime.engine.request_caps import (
    RequestCaps,
    chat_chars,
    longest_token_chars,
    max_prompt_chars,
)
from radixlm.runtime.engine.request_inputs import (
    GenerateInput,
    RequestLimits,
    build_generate_reqs,
)
from radixlm.runtime.engine.request_state import OutputDelta
from radixlm.runtime.engine.request_tracker import RequestTracker
from radixlm.runtime.engine.runtime_processes import start_runtime_processes
from radixlm.runtime.engine.template_render_worker import TEMPLATE_FAILURES
from radixlm.runtime.free_memory import return_free_memory
from radixlm.runtime.grammar.factory import constraint_checker
from radixlm.runtime.output_parsing.reasoning_parser import get_reasoning_parser
from radixlm.runtime.output_parsing.tool_call_registry import get_tool_call_parser
from radixlm.runtime.server_args import ServerArgs
from radixlm.runtime.speculative.draft_model_check import resolve_draft_model

TOKENIZE_ON_LOOP_CHARS = 50_000
"""Prompt texts longer than this (together) are tokenized off the event loop: tokenizing
them would hold the loop long enough to delay other requests (benchmarks/RESULTS.md)."""


class Engine:
    """Loads a model in a scheduler process and serves ``generate`` calls.

    ``model_path``: a Hugging Face directory, a ``.gguf`` file, a hub id, or None for the
    default model (SmolLM2-135M-Instruct, fetched and converted on first use). Other
    keyword options are the fields of ``ServerArgs``. Thread-safe.
    """

    def __init__(self, model_path: str | None = None, **options: Any):
        self._shut_down = False
        self.server_args = ServerArgs.from_kwargs(model_path, **options)
        if self.server_args.node_rank:
            raise ValueError("node_rank > 0 only hosts tensor-parallel ranks for node 0's "
                             "server: run `radixlm serve --node-rank N ...` there")
        path = resolve_model_path(self.server_args.model_path)
        self.model_config = ModelConfig.from_path(path, self.server_args.trust_remote_code)
        model_class(self.model_config.architecture)  # an unknown one fails here, fast
        if self.server_args.speculative_draft_model_path is not None:
            self.server_args.speculative_draft_model_path = str(resolve_draft_model(
                self.server_args.speculative_draft_model_path, self.model_config,
                self.server_args.trust_remote_code))
        tokenizer_path = str(self.server_args.tokenizer_path or path)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(tokenizer_path)
        check_output_parsers(self.server_args)
        if self.server_args.chat_template is not None:
            self.tokenizer.chat_template = load_chat_template(self.server_args.chat_template)
        self._runtime = start_runtime_processes(self.server_args, str(path), tokenizer_path,
                                                backend_decoder_json(self.tokenizer))
        # renders the templates requests bring (only where the operator trusts them)
        self.client_templates = (ClientTemplateRenderer(tokenizer_path)
                                 if self.server_args.trust_request_chat_template else None)
        info = self._runtime.scheduler_info
        self.context_length: int = info["context_length"]
        self.max_total_tokens: int = info["max_total_tokens"]
        self._limits = RequestLimits(
            info["context_length"], self.model_config.vocab_size, info["max_total_tokens"],
            info["page_size"], self.model_config.generation_defaults,
            constraint_checker(self.server_args.grammar_backend),
            RequestCaps.from_options(self.server_args),
            max_prompt_chars(info["context_length"], longest_token_chars(self.tokenizer)),
            self.server_args.disaggregation_mode, self.server_args.disaggregation_bootstrap_port,
            request_rows=self.server_args.max_running_requests,
            tp_size=self.server_args.tp_size,
            lora_adapters=(set(info["lora"]["adapters"]) if info.get("lora") else None),
            eos_token_ids=frozenset(self.model_config.eos_token_ids),
        )
        self._metrics = None
        self._loop = asyncio.new_event_loop()  # where the RequestTracker runs
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="radixlm-engine-loop", daemon=True
        )
        self._thread.start()
        self._tracker: RequestTracker = self._call(self._make_request_tracker())
        return_free_memory()  # what loading the tokenizer left in the heap

    # Generation -------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        **options: Any,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generates for one prompt (a dict back) or a list of prompts (a list back).

        ``options`` are the other fields of ``GenerateInput`` (``return_logprob``,
        ``logprob_start_len``, ``top_logprobs_num``, ``return_text_in_logprobs``,
        ``stream``, ``rid``, ``extra_key``). With ``stream=True`` returns an iterator of
        chunks whose ``text`` is cumulative (each chunk's own segment with
        ``incremental_streaming_output``); for a list of prompts each chunk carries its
        prompt's ``index``. Closing the iterator early aborts what is unfinished.
        """
        request = GenerateInput(text=prompt, input_ids=input_ids,
                                sampling_params=sampling_params, **options)
        reqs, batched = self._build(request)
        if request.stream:
            chunks = native_chunks(self._tracker.stream(reqs), reqs, batched,
                                   self.server_args.incremental_streaming_output)
            return iterate_on_loop(chunks, self._loop)
        outputs = self._call(native_results(self._tracker.stream(reqs, streamed=False), reqs))
        return outputs if batched else outputs[0]

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        **options: Any,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """``generate`` for callers on an event loop: awaits the result, or with
        ``stream=True`` returns an async iterator of chunks."""
        return await self.generate_request(GenerateInput(
            text=prompt, input_ids=input_ids, sampling_params=sampling_params, **options))

    async def generate_request(
        self, request: GenerateInput
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """``async_generate`` for a request already in its one shape (the HTTP body)."""
        reqs, batched = await self._build_off_loop(request)
        if request.stream:
            return self._from_loop(native_chunks(self._tracker.stream(reqs), reqs, batched,
                                                 self.server_args.incremental_streaming_output))
        whole = native_results(self._tracker.stream(reqs, streamed=False), reqs)
        outputs = await run_on_loop(whole, self._loop)
        return outputs if batched else outputs[0]

    async def stream_deltas(
        self, request: GenerateInput
    ) -> AsyncIterator[tuple[int, OutputDelta]]:
        """The request's outputs as ``(index, delta)`` pairs (``index``: the sample's
        position, prompt-major), for callers that stream deltas themselves (the OpenAI
        API); ``request.stream`` is ignored."""
        reqs, _ = await self._build_off_loop(request)
        return self._from_loop(self._tracker.stream(reqs))

    def _from_loop(self, stream: AsyncIterator) -> AsyncIterator:
        """``stream``, which runs on the RequestTracker's loop, iterable from the caller's
        (a running loop)."""
        if self._shut_down:
            raise RuntimeUnavailable("this Engine has been shut down")
        if asyncio.get_running_loop() is self._loop:
            return stream
        return iterate_on_loop(stream, self._loop, async_consumer=True)

    # Control ----------------------------------------------------------------------------

    def abort(self, rid: str | None = None) -> None:
        """Aborts the unfinished request ``rid`` (all of them when None), freeing its KV at
        once; it ends with ``finish_reason`` type ``abort``."""
        self._call(self._tracker.abort(rid))

    async def async_abort(self, rid: str | None = None) -> None:
        await run_on_loop(self._tracker.abort(rid), self._loop)

    def flush_cache(self) -> bool:
        """Empties the prefix cache. Refused (returns False) while requests are in flight."""
        return self._call(self._tracker.control("flush_cache")).ok

    async def async_flush_cache(self) -> bool:
        return (await run_on_loop(self._tracker.control("flush_cache"), self._loop)).ok

    def lora_adapters(self) -> list[str]:
        """The LoRA adapters requests may name ([] where none is loaded or served)."""
        return sorted(self._limits.lora_adapters or ())

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """Loads the PEFT adapter at ``lora_path`` as ``lora_name`` (ValueError naming what
        is wrong: the name taken, the files, its rank or modules; the server serves on)."""
        return self._call(self._lora_control("load_lora_adapter", lora_name, lora_path))

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Takes adapter ``lora_name`` away from new requests; requests running on it keep
        it until they end (``in_use`` in the reply)."""
        return self._call(self._lora_control("unload_lora_adapter", lora_name))

    async def async_load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        return await run_on_loop(self._lora_control("load_lora_adapter", lora_name,
                                                    lora_path), self._loop)

    async def async_unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        return await run_on_loop(self._lora_control("unload_lora_adapter", lora_name),
                                 self._loop)

    async def _lora_control(self, kind: str, name, path=None) -> dict[str, Any]:
        if not isinstance(name, str) or (kind == "load_lora_adapter"
                                         and not isinstance(path, str)):
            raise ValueError("lora_name (and, to load, lora_path) must be strings")
        args = {"lora_name": name} | ({"lora_path": path} if path is not None else {})
        reply = await self._tracker.control(kind, args)
        if not reply.ok:
            raise ValueError(reply.info.get("error", f"{kind} failed"))
        adapters = self._limits.lora_adapters
        if adapters is not None:
            (adapters.add if kind == "load_lora_adapter" else adapters.discard)(name)
        return dict(reply.info)

    def get_server_info(self) -> dict[str, Any]:
        """The model, the options, and the live state of the KV pool, cache and queues."""
        return self._server_info(self._call(self._tracker.control("server_info")))

    async def async_get_server_info(self) -> dict[str, Any]:
        reply = await run_on_loop(self._tracker.control("server_info"), self._loop)
        return self._server_info(reply)

    def attach_metrics(self, metrics) -> None:
        """Reports every finished request to ``metrics`` (a ``ServerMetrics``)."""
        self._metrics = metrics
        self._tracker.metrics = metrics

    @property
    def received_bytes(self) -> int:
        """Bytes of the messages the RequestTracker has received from the runtime's
        processes since the Engine started (outputs arrive as deltas: a stream of N tokens
        costs O(N) of them)."""
        return self._tracker.received_bytes

    def is_healthy(self) -> bool:
        """False once a runtime process has died (every call then raises), while the Engine
        drains, and while the Scheduler has shown no sign of life for ``health_timeout``
        seconds with requests waiting on it (a step that does not end)."""
        tm = self._tracker
        return (not self._shut_down and tm.failure is None and tm.refusing is None
                and tm.stalled_for() < self.server_args.health_timeout)

    async def async_drain(self, grace_s: float, reason: str) -> None:
        """Refuses new requests (``RuntimeUnavailable(reason)``), waits at most ``grace_s``
        seconds for those in flight, then ends the rest with ``reason`` as their error.
        For a server about to stop: the Engine accepts requests again once the server's
        lifespan ends (``async_resume``)."""
        await run_on_loop(self._tracker.drain_then_end(grace_s, reason), self._loop)

    async def async_resume(self) -> None:
        """Accepts new requests again after ``async_drain`` (its server has stopped)."""
        if self._shut_down:
            return
        await run_on_loop(self._tracker.resume(), self._loop)

    def apply_chat_template(self, messages: list[dict[str, str]], **template_kwargs: Any) -> str:
        """The prompt text for a chat, in the model's own chat template (``template_kwargs``:
        extra template variables)."""
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **template_kwargs
        )

    async def async_chat_prompt_ids(self, messages: list[dict[str, Any]],
                                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The prompt ids of a chat in the model's own template (the OpenAI chat route's
        prompt), rendered with ``template_kwargs`` as extra template variables (SGLang's
        ``chat_template_kwargs``, e.g. ``enable_thinking``). Long chats are rendered and
        tokenized off the event loop; raises ``ValueError`` if the template refuses the
        messages or they are longer than any prompt that fits the context."""
        template_kwargs = template_kwargs or {}
        chars = chat_chars(messages, template_kwargs)
        if chars > self._limits.max_prompt_chars:
            raise ValueError(f"the messages and template variables have {chars} characters "
                             f"(as JSON); no prompt of more than {self._limits.max_prompt_chars}"
                             f" fits the context of {self.context_length} tokens")
        clients_template = check_template_kwargs(
            template_kwargs, self.server_args.trust_request_chat_template)
        if clients_template:
            text = await asyncio.to_thread(self.client_templates.render, messages,
                                           template_kwargs, self._limits.max_prompt_chars)
            if len(text) < TOKENIZE_ON_LOOP_CHARS:
                return self.tokenizer.encode(text, add_special_tokens=False)
            return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=False)
        if chars < TOKENIZE_ON_LOOP_CHARS:
            return self._chat_prompt_ids(messages, template_kwargs)
        return await asyncio.to_thread(self._chat_prompt_ids, messages, template_kwargs)

    def _chat_prompt_ids(self, messages: list[dict[str, Any]],
                         template_kwargs: dict[str, Any]) -> list[int]:
        try:
            text = self.apply_chat_template(messages, **template_kwargs)
        except TEMPLATE_FAILURES as err:  # a template given values of types it cannot take
            raise ValueError(f"the chat template failed: {type(err).__name__}: {err}") from None
        if len(text) > self._limits.max_prompt_chars:
            raise ValueError(f"the chat template made a prompt of {len(text)} characters; no "
                             f"prompt of more than {self._limits.max_prompt_chars} fits the "
                             f"context of {self.context_length} tokens")
        return self.tokenizer.encode(text, add_special_tokens=False)

    def shutdown(self) -> None:
        """Stops the runtime processes (none is left behind) and the event loop."""
        if self._shut_down or not hasattr(self, "_tracker"):
            return
        self._shut_down = True
        asked = False
        try:
            if self._loop.is_running():
                run_on_loop_blocking(self._tracker.shutdown(), self._loop, timeout=2)
                asked = True
        except Exception:  # the loop may be gone (interpreter exit): stop the processes anyway
            pass
        finally:
            if self.client_templates is not None:
                self.client_templates.close()
            self._runtime.stop(graceful=asked)
            tm, loop = self._tracker, self._loop
            if loop.is_running():
                loop.call_soon_threadsafe(tm.close)
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(5)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if hasattr(self, "_tracker"):
            self.shutdown()

    # Internals ------------------------------------------------------------------------

    async def _make_request_tracker(self) -> RequestTracker:
        queued = self.server_args.max_queued_requests
        limit = None if queued is None else self.server_args.max_running_requests + queued
        return RequestTracker(self._runtime.paths, self._runtime.processes, limit,
                                self._metrics)

    def _server_info(self, reply: wire.ControlReply) -> dict[str, Any]:
        info = dict(reply.info)
        info["model_path"] = str(self.model_config.path)
        return info

    def _call(self, coroutine: Coroutine):
        """Runs ``coroutine`` on the RequestTracker's loop and waits for its result."""
        if self._shut_down:
            coroutine.close()
            raise RuntimeUnavailable("this Engine has been shut down")
        return run_on_loop_blocking(coroutine, self._loop)

    async def _build_off_loop(self, request: GenerateInput) -> tuple[list[wire.GenerateReq], bool]:
        """``_build`` for a caller on an event loop: a request with long texts is
        tokenized in a worker thread (the tokenizer releases the GIL), so the loop keeps
        serving everyone else meanwhile."""
        if _text_chars(request) < TOKENIZE_ON_LOOP_CHARS:
            return self._build(request)
        return await asyncio.to_thread(self._build, request)

    def _build(self, request: GenerateInput) -> tuple[list[wire.GenerateReq], bool]:
        if self._shut_down:
            raise RuntimeUnavailable("this Engine has been shut down")
        return build_generate_reqs(request, self.tokenizer, self._limits)


def check_output_parsers(args: ServerArgs) -> None:
    """Raises ``ValueError`` for an unknown ``--tool-call-parser`` or ``--reasoning-parser``
    (at start, not on the first chat with tools)."""
    if args.tool_call_parser is not None:
        get_tool_call_parser(args.tool_call_parser)
    if args.reasoning_parser is not None:
        get_reasoning_parser(args.reasoning_parser)


def _text_chars(request: GenerateInput) -> int:
    """Characters of ``request``'s prompt texts (0 for token ids)."""
    text = request.text
    if isinstance(text, str):
        return len(text)
    if isinstance(text, list):
        return sum(len(t) for t in text if isinstance(t, str))
    return 0

