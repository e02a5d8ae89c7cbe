"""``radixlm.Engine``: the SGLang-compatible offline API.

    engine = Engine()                      # the default model
    out = engine.generate("The capital of France is", {"max_new_tokens": 16})
    for chunk in engine.generate("Tell me a story", stream=True): ...
    out = await engine.async_generate("Hi", {"max_new_tokens": 8})
    engine.shutdown()

Behind it run three processes: this one (validation, tokenization and the
TokenizerManager, on an event loop in a background thread, so the Engine works the same
in a script, in Jupyter and inside a running event loop), the Scheduler (the model and its
KV memory) and the Detokenizer. All requests of one ``generate`` call run together in one
continuous batch, with whatever other calls are in flight.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from radixlm.models.default_model import resolve_model_path
from radixlm.models.model_config import ModelConfig
from radixlm.models.registry import model_class
from radixlm.runtime import messages as io
from radixlm.runtime.engine.request_inputs import (
    GenerateInput,
    RequestLimits,
    build_generate_reqs,
)
from radixlm.runtime.engine.runtime_processes import start_runtime_processes
from radixlm.runtime.engine.tokenizer_manager import RuntimeUnavailable, TokenizerManager
from radixlm.runtime.grammar.factory import constraint_checker
from radixlm.runtime.server_args import ServerArgs

_END = object()


class Engine:
    """Loads a model in a scheduler process and serves ``generate`` calls.

    ``model_path``: a Hugging Face directory, a ``.gguf`` file, a hub id, or None for the
    default model (SmolLM2-135M-Instruct, fetched and converted on first use). Other
    keyword options are the fields of ``ServerArgs``. Thread-safe.
    """

    def __init__(self, model_path: str | None = None, **options: Any):
        self._shut_down = False
        self.server_args = ServerArgs.from_kwargs(model_path, **options)
        path = resolve_model_path(self.server_args.model_path)
        self.model_config = ModelConfig.from_path(path, self.server_args.trust_remote_code)
        model_class(self.model_config.architecture)  # an unknown one fails here, fast
        tokenizer_path = str(self.server_args.tokenizer_path or path)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(tokenizer_path)
        self._runtime = start_runtime_processes(self.server_args, str(path), tokenizer_path)
        info = self._runtime.scheduler_info
        self.context_length: int = info["context_length"]
        self.max_total_tokens: int = info["max_total_tokens"]
        self._limits = RequestLimits(
            info["context_length"], self.model_config.vocab_size, info["max_total_tokens"],
            info["page_size"], self.model_config.generation_defaults,
            constraint_checker(self.server_args.grammar_backend),
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="radixlm-engine-loop", daemon=True
        )
        self._thread.start()
        self._tm: TokenizerManager = self._call(self._make_tokenizer_manager())

    # The public API -----------------------------------------------------------------

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
        chunks whose ``text`` is cumulative; for a list of prompts each chunk carries its
        prompt's ``index``. Closing the iterator early aborts what is unfinished.
        """
        request = GenerateInput(text=prompt, input_ids=input_ids, sampling_params=sampling_params,
                                **options)
        reqs, batched = self._build(request)
        if request.stream:
            return self._stream_sync(reqs, batched)
        outputs = self._call(self._tm.collect(reqs))
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
        reqs, batched = self._build(request)
        if request.stream:
            return self._stream_async(reqs, batched)
        future = asyncio.run_coroutine_threadsafe(self._tm.collect(reqs), self._loop)
        outputs = await asyncio.wrap_future(future)
        return outputs if batched else outputs[0]

    def abort(self, rid: str | None = None) -> None:
        """Aborts the unfinished request ``rid`` (all of them when None), freeing its KV at
        once; it ends with ``finish_reason`` type ``abort``."""
        self._call(self._tm.abort(rid))

    def flush_cache(self) -> bool:
        """Empties the prefix cache. Refused (returns False) while requests are in flight."""
        return self._call(self._tm.control("flush_cache")).ok

    def get_server_info(self) -> dict[str, Any]:
        """The model, the options, and the live state of the KV pool, cache and queues."""
        info = dict(self._call(self._tm.control("server_info")).info)
        info["model_path"] = str(self.model_config.path)
        return info

    def attach_metrics(self, metrics) -> None:
        """Reports every finished request to ``metrics`` (a ``ServerMetrics``)."""
        self._tm.metrics = metrics

    def is_healthy(self) -> bool:
        """False once a runtime process has died (every call then raises)."""
        return not self._shut_down and self._tm.failure is None

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """The prompt text for a chat, in the model's own chat template."""
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )

    def shutdown(self) -> None:
        """Stops the runtime processes (none is left behind) and the event loop."""
        if self._shut_down or not hasattr(self, "_tm"):
            return
        self._shut_down = True
        asked = False
        try:
            asyncio.run_coroutine_threadsafe(self._tm.shutdown(), self._loop).result(2)
            asked = True
        except Exception:  # the loop may be gone (interpreter exit): stop the processes anyway
            pass
        finally:
            self._runtime.stop(graceful=asked)
            self._loop.call_soon_threadsafe(self._tm.close)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if hasattr(self, "_tm"):
            self.shutdown()

    # Internals ------------------------------------------------------------------------

    async def _make_tokenizer_manager(self) -> TokenizerManager:
        queued = self.server_args.max_queued_requests
        limit = None if queued is None else self.server_args.max_running_requests + queued
        return TokenizerManager(self._runtime.paths, self._runtime.processes, limit)

    def _call(self, coroutine):
        """Runs ``coroutine`` on the engine's loop and waits for its result."""
        if self._shut_down:
            coroutine.close()
            raise RuntimeUnavailable("this Engine has been shut down")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _build(self, request: GenerateInput) -> tuple[list[io.GenerateReq], bool]:
        if self._shut_down:
            raise RuntimeUnavailable("this Engine has been shut down")
        return build_generate_reqs(request, self.tokenizer, self._limits)

    def _stream_sync(self, reqs: list[io.GenerateReq], batched: bool) -> Iterator[dict]:
        chunks: queue.Queue = queue.Queue()

        async def pump() -> None:
            try:
                async for chunk in self._tm.stream(reqs, batched):
                    chunks.put(chunk)
                chunks.put(_END)
            except BaseException as err:  # handed to the consumer's thread
                chunks.put(err)

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := chunks.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not future.done():
                future.cancel()  # the stream's own cleanup aborts what is unfinished

    async def _stream_async(self, reqs: list[io.GenerateReq], batched: bool) -> AsyncIterator:
        caller = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()

        async def pump() -> None:
            try:
                async for chunk in self._tm.stream(reqs, batched):
                    caller.call_soon_threadsafe(chunks.put_nowait, chunk)
                caller.call_soon_threadsafe(chunks.put_nowait, _END)
            except BaseException as err:
                caller.call_soon_threadsafe(chunks.put_nowait, err)

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := await chunks.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not future.done():
                future.cancel()
